"""DeepEP's calls for the backend contract: :class:`DeepEPAdapter` runs each dispatch, cached dispatch and combine as
one call of a built DeepEP buffer (``EPBuffer`` of V2.5, ``ElasticBuffer`` of 2.1) and reads the counts off its handle.

What a dispatch runs is this module; building the buffer (the import and its checks, the NCCL communicator, direct or
hybrid mode, GIN, the size) is :class:`~.backend.DeepEPBackend`'s, the registered subclass. :class:`~.lines.DeepEPLine`
holds what differs between the lines; :meth:`DeepEPAdapter._kwargs` is the one place a setting becomes a DeepEP call
argument, :meth:`DeepEPAdapter._call` the one way a call is made, under :func:`fill_guard`.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, ClassVar, Optional

import torch

from megatron_deepepv2.backends.base import (SYNC, BackendLimits, BufferSpec, CombineOutput, DispatchBackend,
                                             DispatchConfig, DispatchHandle, DispatchResult, Streams)
from megatron_deepepv2.backends.deepep.receive_order import order_received
from megatron_deepepv2.layout import ExpertLayout, HiddenStates, align_up, split_hidden

if TYPE_CHECKING:
    from megatron_deepepv2.backends.deepep.lines import DeepEPLine
    from megatron_deepepv2.groups import GroupState

logger = logging.getLogger(__name__)


class _FillOff:
    """Turns ``torch.utils.deterministic.fill_uninitialized_memory`` off for a block, then restores it."""

    def __enter__(self) -> None:
        self.was_fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc_info: Any) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self.was_fill


_FILL_OFF, _NO_GUARD = _FillOff(), contextlib.nullcontext()


def fill_guard() -> contextlib.AbstractContextManager:
    """The context of every DeepEP call: the fill off while deterministic algorithms are on, as DeepEP asserts (the
    fill kernels could overlap its communication; nothing here reads uninitialised rows); else nothing."""
    return _FILL_OFF if torch.are_deterministic_algorithms_enabled() else _NO_GUARD


class DeepEPAdapter(DispatchBackend):
    """Dispatch/combine over a built DeepEP v2 buffer (NVLink; NCCL GIN across nodes).

    Args:
        state: The state of the expert-parallel group, an NCCL group.
        spec: What the buffer was built for.
        ep_buffer: DeepEP's buffer, built on the group for ``spec``; :meth:`destroy` destroys it.
        line: The DeepEP line the buffer belongs to.
    """

    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16,), combine_dtypes=(torch.bfloat16,),
        combine_hidden_multiple=256,  # combine kernel static assert kHidden % 256
        fp8_hidden_multiple=32, max_topk=32, requires_cuda=True)  # FP8: TMA needs hidden bytes % 32

    def __init__(self, state: GroupState, spec: BufferSpec, ep_buffer: Any, line: DeepEPLine) -> None:
        super().__init__(state, spec)
        self.ep_buffer, self.line = ep_buffer, line
        self._call_kwargs: dict[tuple, dict[str, Any]] = {}  # see _kwargs

    @property
    def num_bytes(self) -> int:
        return self.ep_buffer.num_bytes if self.ep_buffer is not None else 0

    def _kwargs(self, kind: str, config: DispatchConfig, num_experts: int, streams: Streams) -> dict[str, Any]:
        """DeepEP's keyword arguments of one kind of call (``fresh``, ``cached`` or ``combine``), built once per key.

        Outputs go on the communication stream only in async mode, the one where DeepEP ``record_stream``-s them.
        ``num_sms`` is a per-call argument of DeepEP: a fresh dispatch runs the configuration's, which the line may
        round (V2.5: even); a cached dispatch and a combine pass the handle's (see :meth:`_call`).
        """
        key = (kind, config, num_experts, streams)
        kwargs = self._call_kwargs.get(key)
        if kwargs is not None:
            return kwargs
        on_comm_stream = streams.async_finish and streams.allocate_on_comm_stream
        kwargs = {"async_with_compute_stream": streams.async_finish, "allocate_on_comm_stream": on_comm_stream}
        expand = config.layout is ExpertLayout.EXPAND
        if kind == "fresh":
            num_sms = self.line.num_sms(config.settings.num_sms)
            if num_sms != config.settings.num_sms:
                logger.info("DeepEP %s runs an even number of SMs: %d SMs asked, %d used", self.line.name,
                            config.settings.num_sms, num_sms)
            kwargs.update(num_experts=num_experts, num_max_tokens_per_rank=self.spec.num_max_tokens_per_rank,
                          expert_alignment=config.expert_alignment, num_sms=num_sms, do_expand=expand,
                          do_zero_padding=config.padded, do_cpu_sync=config.host_sync)
        if kind == "cached":  # padding rows of a gradient must be zero
            kwargs.update(do_expand=expand, do_zero_padding=expand)
        if kind != "combine":
            kwargs.update(self.line.dispatch_kwargs)
        self._call_kwargs[key] = kwargs
        return kwargs

    def _call(self, method: Any, streams: Streams, *args: Any, **kwargs: Any) -> tuple:
        """One call of the DeepEP buffer's ``method`` (``dispatch`` or ``combine``), under :func:`fill_guard`,
        with the previous event DeepEP accepts only with ``allocate_on_comm_stream``; in async mode the current stream
        is made to wait for it (DeepEP asserts against that wait in sync mode).

        Args:
            method: The bound DeepEP method.
            streams: The call's stream mode.
            *args, **kwargs: The call's arguments but ``previous_event``.

        Returns:
            The call's outputs, its event left out.
        """
        previous_event = self.ep_buffer.capture() if streams.async_finish and streams.allocate_on_comm_stream else None
        with fill_guard():
            *outputs, event = method(*args, previous_event=previous_event, **kwargs)
            if streams.async_finish:
                event.current_stream_wait()
        return outputs

    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: DispatchConfig, num_experts: int, streams: Streams = SYNC) -> DispatchResult:
        if self.line.keeps_topk_idx:  # Megatron refills it on CUDA-graph replay, before a pending backward
            topk_idx = topk_idx.clone()
        recv_x, recv_idx, recv_weights, native = self._call(
            self.ep_buffer.dispatch, streams, x, topk_idx=topk_idx, topk_weights=topk_weights,
            **self._kwargs("fresh", config, num_experts, streams))
        handle = DispatchHandle(self, config, native, num_tokens=topk_idx.shape[0], num_topk=topk_idx.shape[1],
                                num_recv_rows=split_hidden(recv_x)[0].shape[0])
        if config.settings.deterministic:
            recv_x, recv_idx, recv_weights, handle.receive_order = order_received(
                recv_x, recv_idx, recv_weights, native, handle.num_topk, config.layout, host_sync=config.host_sync,
                cached=False)
        return DispatchResult(recv_x, recv_idx if config.layout is ExpertLayout.COMPACT else None, recv_weights, handle)

    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchResult:
        config, native = handle.config, handle.native
        recv_x, recv_idx, recv_weights, _ = self._call(  # num_sms from the handle: DeepEP raises on 0 with a handle
            self.ep_buffer.dispatch, streams, x, topk_weights=topk_weights, handle=native, num_sms=native.num_sms,
            **self._kwargs("cached", config, 0, streams))
        if config.settings.deterministic:
            recv_x, recv_idx, recv_weights, _ = order_received(
                recv_x, recv_idx, recv_weights, native, handle.num_topk, config.layout, host_sync=config.host_sync,
                cached=True, receive_order=handle.receive_order)
        return DispatchResult(recv_x, recv_idx if config.layout is ExpertLayout.COMPACT else None, recv_weights, handle)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        native = handle.native
        combined, combined_weights = self._call(  # num_sms from the handle, as in cached_dispatch
            self.ep_buffer.combine, streams, x, native, topk_weights=topk_weights, num_sms=native.num_sms,
            **self._kwargs("combine", handle.config, 0, streams))
        return CombineOutput(combined, combined_weights)

    def device_counts(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """From DeepEP's prefix sums, without a host sync. ``psum_num_recv_tokens_per_expert`` is, compact, the
        inclusive prefix sum of the aligned counts; expand, the aligned start of each block plus its unaligned count."""
        config, native = handle.config, handle.native
        ends = native.psum_num_recv_tokens_per_expert.to(torch.int64)
        if config.layout is ExpertLayout.EXPAND:
            if config.expert_alignment > 1:
                ends = align_up(ends, config.expert_alignment)
            num_valid_rows = ends[-1]
        else:
            num_valid_rows = native.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)
        return torch.diff(ends, prepend=ends.new_zeros(1)), num_valid_rows

    def host_counts(self, handle: DispatchHandle) -> list[int]:
        return list(handle.native.num_recv_tokens_per_expert_list)

    def destroy(self) -> None:
        if getattr(self, "ep_buffer", None) is not None:
            self.ep_buffer.destroy()
            self.ep_buffer = None
