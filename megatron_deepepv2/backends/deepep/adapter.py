"""DeepEP v2 backend: the backend contract over ``deep_ep``'s ``EPBuffer`` (V2.5) or ``ElasticBuffer`` (2.1).

:class:`~.lines.DeepEPLine` holds what differs between the lines; :meth:`DeepEPBackend._kwargs` is the one place a
setting becomes a DeepEP call argument, :meth:`DeepEPBackend._call` the one way a call is made.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.backends.base import (SYNC, BackendLimits, BufferSpec, CombineOutput, DispatchBackend,
                                             DispatchConfig, DispatchHandle, DispatchResult, Streams)
from megatron_deepepv2.backends.registry import register_backend
from megatron_deepepv2.backends.deepep.lines import (deepep_unavailable_reason, ensure_nccl_communicator, fill_guard,
                                            handle_order_unavailable_reason, import_deep_ep, line_of_module,
                                            log_buffer_built)
from megatron_deepepv2.layout import ExpertLayout, HiddenStates, align_up, split_hidden
from megatron_deepepv2.backends.deepep.receive_order import order_received
from megatron_deepepv2.backends.deepep.topology import HYBRID_MODE_FIELD, choose_hybrid_mode, set_gin_variable_for_group

logger = logging.getLogger(__name__)


def buffer_size_arguments(num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> dict[str, Any]:
    """The sizing keyword arguments the DeepEP backend passes the buffer constructor: the one place a buffer's size
    is decided.

    ``use_fp8_dispatch`` is always False: a training step sends BF16 rows through every buffer (combine's backward
    is a cached dispatch of the BF16 gradient), so an FP8-sized buffer fails that call once ``G * T_max`` rows of
    BF16 outgrow the combine layout. A BF16-sized buffer fits every call (:func:`~.sizing.call_bytes`, the arithmetic
    that checks this choice).

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.

    Returns:
        ``num_max_tokens_per_rank``, ``hidden``, ``num_topk`` and ``use_fp8_dispatch`` for the constructor.
    """
    return {"num_max_tokens_per_rank": num_max_tokens_per_rank, "hidden": hidden, "num_topk": num_topk,
            "use_fp8_dispatch": False}


@register_backend
class DeepEPBackend(DispatchBackend):
    """Dispatch/combine over DeepEP v2's buffer (NVLink; NCCL GIN across nodes).

    Args:
        group: NCCL process group of the expert-parallel ranks.
        spec: Buffer shape key; ``num_max_tokens_per_rank`` must be the same on every rank.

    Raises:
        ImportError: ``deep_ep`` does not import.
    """

    name: ClassVar[str] = "deepep"
    auto_preference: ClassVar[int] = 0
    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16,), combine_dtypes=(torch.bfloat16,),
        combine_hidden_multiple=256,  # combine kernel static assert kHidden % 256
        fp8_hidden_multiple=32, max_topk=32, requires_cuda=True)  # FP8: TMA needs hidden bytes % 32
    extra_agreement = (HYBRID_MODE_FIELD,)  # construction arguments from the settings

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        super().__init__(group, spec)
        deep_ep = import_deep_ep()
        self.line = line_of_module(deep_ep)
        self._call_kwargs: dict[tuple, dict[str, Any]] = {}  # see _kwargs
        ensure_nccl_communicator(group)  # before DeepEP reads it
        allow_hybrid, why = choose_hybrid_mode(group, spec.settings.allow_hybrid_mode)
        set_gin_variable_for_group(group)  # DeepEP reads EP_DISABLE_GIN when the buffer is built: decided before
        buffer_class = getattr(deep_ep, self.line.buffer_class)
        # Sized for BF16 rows even with FP8 dispatch: combine's backward sends BF16 rows through this buffer.
        self.ep_buffer = buffer_class(
            group, **buffer_size_arguments(spec.num_max_tokens_per_rank, spec.hidden, spec.num_topk),
            deterministic=False, allow_hybrid_mode=allow_hybrid,  # deterministic mode: receive_order sorts
            allow_multiple_reduction=True, explicitly_destroy=True)  # multiple reduction: expand combine with weights
        log_buffer_built(self.line, allow_hybrid, why)

    @property
    def num_bytes(self) -> int:
        return self.ep_buffer.num_bytes if self.ep_buffer is not None else 0

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return deepep_unavailable_reason()  # cached: the probes (import, NCCL query) are slow

    @classmethod
    def deterministic_order_unavailable_reason(cls, host_sync: bool) -> Optional[str]:
        return handle_order_unavailable_reason(host_sync)

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
        """One call of the DeepEP buffer's ``method`` (``dispatch`` or ``combine``), under :func:`~.lines.fill_guard`,
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
        handle = DispatchHandle(self, config, native, topk_idx.shape[0], topk_idx.shape[1],
                                split_hidden(recv_x)[0].shape[0])
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
