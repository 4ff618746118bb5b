"""DeepEP v2 backend: the backend contract over ``deep_ep``'s ``EPBuffer`` (V2.5) or ``ElasticBuffer`` (2.1).

:class:`_LineCalls` holds what differs between the two lines; :meth:`DeepEPBackend._kwargs` is the one place a
setting becomes a DeepEP call argument (the buffer's construction arguments: :meth:`DeepEPBackend.__init__`).
``deep_ep`` is imported when a backend is built; :meth:`DeepEPBackend.unavailable_reason` says what is missing.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2._dist import collective_device
from megatron_deepepv2.backends.base import (SYNC, BackendLimits, BufferSpec, CombineOutput, DispatchBackend,
                                             DispatchConfig, DispatchHandle, DispatchResult, Streams)
from megatron_deepepv2.deepep_lines import (DEEPEP_2_1, DEEPEP_2_5, DeepEPLine, deepep_unavailable_reason,
                                            handle_order_problem, import_deep_ep, line_of_module)
from megatron_deepepv2.layout import ExpertLayout, HiddenStates, align_up
from megatron_deepepv2.sizing import buffer_size_arguments
from megatron_deepepv2.sync_free_order import compact_order, expand_order, relink
from megatron_deepepv2.topology import choose_hybrid_mode

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _LineCalls:
    """How one DeepEP ``line`` differs in this backend's calls: ``dispatch_kwargs`` go to every dispatch;
    ``even_num_sms``: an explicit SM count is rounded up to even; ``keeps_topk_idx``: the handle keeps the caller's
    ``topk_idx``, not a copy."""

    line: DeepEPLine
    dispatch_kwargs: tuple[tuple[str, Any], ...] = ()
    even_num_sms: bool = False
    keeps_topk_idx: bool = False

    def num_sms(self, requested: int) -> int:
        """The SM count the line runs with for ``requested`` (0 = DeepEP's choice)."""
        return requested + (requested % 2) if self.even_num_sms else requested


_LINE_CALLS = {
    DEEPEP_2_1: _LineCalls(DEEPEP_2_1),
    DEEPEP_2_5: _LineCalls(DEEPEP_2_5, dispatch_kwargs=(("do_handle_copy", False),), even_num_sms=True,
                           keeps_topk_idx=True),
}


def ensure_nccl_communicator(group: dist.ProcessGroup) -> None:
    """Makes PyTorch create the NCCL communicator of ``group`` (the expert-parallel group) now, by one all-reduce:
    DeepEP reuses it (``EP_REUSE_NCCL_COMM=1``, its default) and segfaults on the null pointer of a lazy one."""
    probe = torch.zeros(1, device=collective_device(group))
    dist.all_reduce(probe, group=group)


class _FillOff:
    """Turns ``torch.utils.deterministic.fill_uninitialized_memory`` off for a block, then restores it."""

    def __enter__(self) -> None:
        self.was_fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc_info: Any) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self.was_fill


_FILL_OFF, _NO_GUARD = _FillOff(), contextlib.nullcontext()


def _fill_guard() -> contextlib.AbstractContextManager:
    """The context of every DeepEP call: the fill off while deterministic algorithms are on, as DeepEP asserts (the
    fill kernels could overlap its communication; nothing here reads uninitialised rows); else nothing."""
    return _FILL_OFF if torch.are_deterministic_algorithms_enabled() else _NO_GUARD


class DeepEPBackend(DispatchBackend):
    """Dispatch/combine over DeepEP v2's buffer (NVLink; NCCL GIN across nodes).

    Args:
        group: NCCL process group of the expert-parallel ranks.
        spec: Buffer shape key; ``num_max_tokens_per_rank`` must be the same on every rank.
    """

    name: ClassVar[str] = "deepep"
    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16,), combine_dtypes=(torch.bfloat16,),
        combine_hidden_multiple=256,  # combine kernel static assert kHidden % 256
        fp8_hidden_multiple=32, max_topk=32, requires_cuda=True)  # FP8: TMA needs hidden bytes % 32

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        super().__init__(group, spec)
        deep_ep = import_deep_ep()
        self.line_calls = _LINE_CALLS[line_of_module(deep_ep)]
        settings = spec.settings
        self.num_sms = self.line_calls.num_sms(settings.num_sms)
        if self.num_sms != settings.num_sms:
            logger.info("DeepEP %s runs an even number of SMs: %d SMs asked, %d used", self.line_calls.line.name,
                        settings.num_sms, self.num_sms)
        self._call_kwargs: dict[tuple, dict[str, Any]] = {}  # see _kwargs
        ensure_nccl_communicator(group)  # before DeepEP reads it
        allow_hybrid, why = choose_hybrid_mode(group, settings.allow_hybrid_mode)
        buffer_class = getattr(deep_ep, self.line_calls.line.buffer_class)
        # Sized for BF16 rows even with FP8 dispatch: combine's backward sends BF16 rows through this buffer.
        self.buffer = buffer_class(
            group, **buffer_size_arguments(spec.num_max_tokens_per_rank, spec.hidden, spec.num_topk),
            deterministic=False, allow_hybrid_mode=allow_hybrid,  # deterministic mode: _order sorts
            allow_multiple_reduction=True, explicitly_destroy=True)  # multiple reduction: expand combine with weights
        logger.info("DeepEP %s %s: %s mode (%s)", self.line_calls.line.name, self.line_calls.line.buffer_class,
                    "hybrid (RDMA x NVLink)" if allow_hybrid else "direct", why)

    @property
    def num_bytes(self) -> int:
        return self.buffer.num_bytes if self.buffer is not None else 0

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return deepep_unavailable_reason()  # cached: the probes (import, NCCL query) are slow

    @classmethod
    def deterministic_order_problem(cls, host_sync: bool) -> Optional[str]:
        return handle_order_problem(host_sync)

    def _kwargs(self, kind: str, config: DispatchConfig, num_experts: int, streams: Streams) -> dict[str, Any]:
        """DeepEP's keyword arguments of one kind of call (``fresh``, ``cached`` or ``combine``), built once per key.
        Outputs go on the communication stream only in async mode, the one where DeepEP ``record_stream``-s them."""
        key = (kind, config, num_experts, streams)
        kwargs = self._call_kwargs.get(key)
        if kwargs is not None:
            return kwargs
        on_comm_stream = streams.async_finish and streams.allocate_on_comm_stream
        kwargs = {"async_with_compute_stream": streams.async_finish, "allocate_on_comm_stream": on_comm_stream}
        expand = config.layout is ExpertLayout.EXPAND
        if kind == "fresh":
            kwargs.update(num_experts=num_experts, num_max_tokens_per_rank=self.spec.num_max_tokens_per_rank,
                          expert_alignment=config.expert_alignment, num_sms=self.num_sms, do_expand=expand,
                          do_zero_padding=config.padded, do_cpu_sync=config.host_sync)
        if kind == "cached":  # padding rows of a gradient must be zero
            kwargs.update(do_expand=expand, do_zero_padding=expand)
        if kind != "combine":
            kwargs.update(self.line_calls.dispatch_kwargs)
        self._call_kwargs[key] = kwargs
        return kwargs

    def _previous_event(self, streams: Streams) -> Optional[Any]:
        # DeepEP accepts a previous event only with allocate_on_comm_stream.
        return self.buffer.capture() if streams.async_finish and streams.allocate_on_comm_stream else None

    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: DispatchConfig, num_experts: int, streams: Streams = SYNC) -> DispatchResult:
        if self.line_calls.keeps_topk_idx:  # Megatron refills it on CUDA-graph replay, before a pending backward
            topk_idx = topk_idx.clone()
        with _fill_guard():
            recv_x, recv_idx, recv_weights, native, event = self.buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, previous_event=self._previous_event(streams),
                **self._kwargs("fresh", config, num_experts, streams))
            if streams.async_finish:  # DeepEP asserts against current_stream_wait in sync mode
                event.current_stream_wait()
        rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        handle = DispatchHandle(self, config, native, topk_idx.shape[0], topk_idx.shape[1], rows.shape[0])
        if config.settings.deterministic:
            recv_x, recv_idx, recv_weights = self._order(recv_x, recv_idx, recv_weights, handle, cached=False)
        return DispatchResult(recv_x, recv_idx if config.layout is ExpertLayout.COMPACT else None, recv_weights, handle)

    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchResult:
        native = handle.native
        with _fill_guard():  # num_sms from the handle: DeepEP raises on 0 with a handle
            recv_x, recv_idx, recv_weights, _, event = self.buffer.dispatch(
                x, topk_weights=topk_weights, handle=native, num_sms=native.num_sms,
                previous_event=self._previous_event(streams), **self._kwargs("cached", handle.config, 0, streams))
            if streams.async_finish:
                event.current_stream_wait()
        if handle.config.settings.deterministic:
            recv_x, recv_idx, recv_weights = self._order(recv_x, recv_idx, recv_weights, handle, cached=True)
        expand = handle.config.layout is ExpertLayout.EXPAND
        return DispatchResult(recv_x, None if expand else recv_idx, recv_weights, handle)

    @staticmethod
    def _order(recv_x: HiddenStates, recv_idx: Optional[torch.Tensor], recv_weights: Optional[torch.Tensor],
               handle: DispatchHandle, cached: bool) -> tuple:
        """Deterministic mode: a dispatch's outputs in DeepEP's deterministic order, its handle updated to match (as
        DeepEP's sort leaves it). With host sync, DeepEP's own sort (what a ``deterministic=True`` buffer runs);
        without, :mod:`~megatron_deepepv2.sync_free_order`: the same order, nothing read on the host."""
        native, expand = handle.native, handle.config.layout is ExpertLayout.EXPAND
        if cached and expand:  # placed by the slots the first order rewrote (DeepEP's sort leaves it too)
            return recv_x, recv_idx, recv_weights
        rows, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        if handle.config.host_sync:  # a cached dispatch has no host sync in DeepEP either
            native.deterministic_sort(not cached, cached, rows, scales, recv_idx, recv_weights,
                                      native.channel_linked_list)
            return recv_x, recv_idx, recv_weights
        metadata, num_valid = native.recv_src_metadata, native.psum_num_recv_tokens_per_scaleup_rank[-1]
        if expand:
            starts = native.psum_num_recv_tokens_per_expert - native.num_unaligned_recv_tokens_per_expert
            order, slots = expand_order(metadata[:, 0], metadata[:, 2:], starts, rows.shape[0], num_valid)
            metadata[:, 2:] = slots
        else:  # a cached compact receive comes in the first dispatch's order: the same gather applies
            if not cached:
                handle.receive_order = compact_order(metadata[:, 0], num_valid)
                metadata.copy_(metadata[handle.receive_order])
                if native.channel_linked_list is not None:  # hybrid mode
                    native.channel_linked_list.copy_(relink(native.channel_linked_list, handle.receive_order, num_valid))
            order = handle.receive_order
            recv_idx = None if recv_idx is None else recv_idx[order]
        rows, scales, recv_weights = (None if t is None else t[order] for t in (rows, scales, recv_weights))
        return (rows, scales) if scales is not None else rows, recv_idx, recv_weights

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        native = handle.native
        with _fill_guard():  # num_sms from the handle, as in cached_dispatch
            combined, combined_weights, event = self.buffer.combine(
                x, native, topk_weights=topk_weights, num_sms=native.num_sms,
                previous_event=self._previous_event(streams), **self._kwargs("combine", handle.config, 0, streams))
            if streams.async_finish:
                event.current_stream_wait()
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
        if getattr(self, "buffer", None) is not None:
            self.buffer.destroy()
            self.buffer = None
