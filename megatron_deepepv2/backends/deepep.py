"""DeepEP v2 adapter: the backend contract over DeepEP's expert-parallel buffer, both lines.

DeepEP 2.1 (``deep_ep.ElasticBuffer``) and V2.5 (``deep_ep.EPBuffer``, :mod:`megatron_deepepv2.deepep_lines`) take
the same calls for what this backend does; the backend picks the buffer ``deep_ep`` has (V2.5 first) with no
setting, and the few differences live in :class:`_LineCalls`:

* V2.5 keeps a reference to ``topk_idx`` in its handle (``do_handle_copy`` must be False) and asserts that the
  tensor's version did not change while the handle lives: nothing here writes to ``topk_idx`` after the dispatch
  (the Megatron manager builds it out of place), so the reference is safe; 2.1 copies it (its default);
* V2.5 rounds an explicit ``num_sms`` up to even; the backend rounds it itself and says so, so that the handle, the
  log and the buffer agree;
* V2.5 dropped ``previous_event_before_epilogue`` (never passed here) and added ``defer_epilogue``, which is not
  used: every dispatch here waits for its event before returning (the device counts are read in stream order
  right after), so a deferred copy epilogue would run at that same wait and overlap nothing.

A thin layer: argument plumbing, the handle translation, and the fixes for DeepEP's known traps (each handled
where noted):

* the group's NCCL communicator is materialised before DeepEP reads it (a lazy one segfaults, DeepEP #726);
* cached dispatch always passes ``num_sms`` from the handle (``num_sms=0`` raises, DeepEP #685) and
  ``do_expand`` / ``do_zero_padding`` explicitly (dispatch does not take them from the handle);
* ``previous_event`` is only passed together with ``allocate_on_comm_stream`` (a host assert otherwise), and
  outputs are allocated on the communication stream only in async mode, the only mode where DeepEP protects
  them from the caching allocator (:meth:`DeepEPBackend._stream_kwargs`);
* rows past the valid extent of a cached dispatch without host sync (a combine's backward) are zeroed;
* events are waited through ``EventOverlap.current_stream_wait`` only in async mode (it asserts otherwise),
  which is also what runs DeepEP's deterministic sort in async mode;
* hybrid (RDMA x NVLink) mode is used only when the group spans nodes; single-node runs use direct mode;
* DeepEP asserts that torch's deterministic algorithms and ``fill_uninitialized_memory`` are not both on, so
  every call into DeepEP runs with the fill off (Megatron's ``--deterministic-mode`` turns both on).

``deep_ep`` is imported lazily: this module imports without it, and :meth:`DeepEPBackend.unavailable_reason`
explains what is missing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
import logging
import os
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2 import expert_kernels
from megatron_deepepv2._dist import collective_device, runtime_nccl_version
from megatron_deepepv2.deepep_lines import DEEPEP_2_1, DEEPEP_2_5, DeepEPLine, line_of_module, version_text
from megatron_deepepv2.backends.base import (
    BackendLimits,
    BufferSpec,
    CombineOutput,
    CompletedEvent,
    DispatchBackend,
    DispatchHandle,
    DispatchOutput,
    ExpertLayout,
    HiddenStates,
    align_up,
    rows_past_valid,
    uninitialized_memory_fill_off,
)

logger = logging.getLogger(__name__)

INSTALL_HINT = (
    "Install DeepEP v2 -- the 2.1 line (deep_ep.ElasticBuffer, NCCL >= 2.30.4) or V2.5 (deep_ep.EPBuffer, NCCL >= "
    "2.32.3 and nvcc >= 13.1) -- built against the NCCL that PyTorch loads, on an SM90/SM100 GPU with nvcc at run "
    "time for its JIT: `python -m megatron_deepepv2.install_deepep --deepep-src PATH` does it "
    "(see https://github.com/deepseek-ai/DeepEP). On single-node machines without an RDMA NIC also set "
    "EP_DISABLE_GIN=1. Or select the portable backend with MEGATRON_DEEPEPV2_BACKEND=reference. "
    "`python -m megatron_deepepv2.doctor` checks every requirement."
)


@dataclass(frozen=True)
class _LineCalls:
    """How one DeepEP line differs in the calls this backend makes (see the module docstring).

    Attributes:
        line: The line.
        dispatch_kwargs: Extra keyword arguments of every dispatch.
        even_num_sms: The line rounds an explicit SM count up to even.
    """

    line: DeepEPLine
    dispatch_kwargs: tuple[tuple[str, Any], ...] = ()
    even_num_sms: bool = False

    def num_sms(self, requested: int) -> int:
        """The SM count the line runs with for ``requested`` (0 = DeepEP's choice)."""
        return requested + (requested % 2) if self.even_num_sms else requested


_LINE_CALLS = {
    DEEPEP_2_1: _LineCalls(DEEPEP_2_1),
    DEEPEP_2_5: _LineCalls(DEEPEP_2_5, dispatch_kwargs=(("do_handle_copy", False),), even_num_sms=True),
}


def import_deep_ep() -> Any:
    """Imports ``deep_ep`` and checks that it is DeepEP v2 (the 2.1 or the V2.5 line).

    Returns:
        The ``deep_ep`` module.

    Raises:
        ImportError: If ``deep_ep`` is missing, fails its own import checks (DeepEP raises AssertionError for
            an NCCL mismatch, which is converted here), or has neither ``EPBuffer`` nor ``ElasticBuffer``; the
            message names what was found (v1's ``Buffer``, or another package's ``deep_ep``).
    """
    try:
        import deep_ep  # noqa: PLC0415 - optional dependency
    except ImportError as error:
        raise ImportError(f"deep_ep is not importable ({error}). {INSTALL_HINT}") from error
    except AssertionError as error:  # check_nccl_so(): duplicate or mismatched libnccl
        raise ImportError(f"deep_ep refused to import: {error}. {INSTALL_HINT}") from error
    if line_of_module(deep_ep) is None:
        raise ImportError(f"{_describe_deep_ep(deep_ep)} {INSTALL_HINT}")
    return deep_ep


def _describe_deep_ep(deep_ep: Any) -> str:
    """Says what a ``deep_ep`` without a DeepEP v2 buffer is, from what it exports."""
    version = getattr(deep_ep, "__version__", "of unknown version")
    where = getattr(deep_ep, "__file__", None) or "an unknown location"
    if hasattr(deep_ep, "Buffer"):
        return (f"deep_ep {version} (from {where}) has Buffer but neither ElasticBuffer (DeepEP 2.1) nor EPBuffer "
                "(V2.5): it is DeepEP v1 (or HybridEP, which installs a module of the same name).")
    found = sorted(name for name in vars(deep_ep) if not name.startswith("_"))
    return (f"deep_ep {version} (from {where}) has neither ElasticBuffer (DeepEP 2.1) nor EPBuffer (V2.5) nor Buffer "
            f"(v1); it exports {found[:12]}. Another package may own the name deep_ep (HybridEP installs one too).")


def ensure_nccl_communicator(group: dist.ProcessGroup) -> None:
    """Makes PyTorch create the NCCL communicator of ``group`` now.

    DeepEP reuses PyTorch's communicator (``EP_REUSE_NCCL_COMM=1``, its default) and segfaults on the null
    pointer of a lazy one. One tiny all-reduce on a CUDA tensor forces its creation.

    Args:
        group: The expert-parallel process group (NCCL in production).
    """
    probe = torch.zeros(1, device=collective_device(group))
    dist.all_reduce(probe, group=group)


def _group_spans_nodes(group_size: int) -> bool:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    per_node = int(local) if local else max(torch.cuda.device_count(), 1)
    return group_size > per_node


@functools.lru_cache(maxsize=1)
def _deepep_unavailable_reason() -> Optional[str]:
    """Why DeepEP v2 cannot run in this process, or None (computed once)."""
    if not torch.cuda.is_available():
        return f"no CUDA device is visible. {INSTALL_HINT}"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return f"DeepEP v2 needs an SM90 (Hopper) or SM100 GPU; this one is SM{major}x. {INSTALL_HINT}"
    nccl = runtime_nccl_version()
    if nccl is not None and nccl < DEEPEP_2_1.min_nccl:
        return f"PyTorch loaded NCCL {version_text(nccl)}; DeepEP v2 needs >= 2.30.4. {INSTALL_HINT}"
    try:
        line = line_of_module(import_deep_ep())
    except ImportError as error:
        return str(error)
    if nccl is not None and nccl < line.min_nccl:
        return (f"PyTorch loaded NCCL {version_text(nccl)}; DeepEP {line.name} ({line.buffer_class}) needs >= "
                f"{version_text(line.min_nccl)}. {INSTALL_HINT}")
    return None


def aligned_counts_from_psum(psum: torch.Tensor, alignment: int, expand: bool) -> torch.Tensor:
    """Alignment-padded rows per local expert from DeepEP's ``psum_num_recv_tokens_per_expert``, on the device.

    Computing them on the device avoids a host-to-device copy of the host list, which would block the host
    until the dispatch epilogue finished.

    Args:
        psum: ``EPHandle.psum_num_recv_tokens_per_expert``. Compact: inclusive prefix sum of aligned counts.
            Expand: aligned start of expert ``i`` plus its unaligned count.
        alignment: The dispatch's ``expert_alignment``.
        expand: Whether the dispatch used the expand layout.

    Returns:
        int64 ``[E_local]`` aligned counts (the device twin of ``num_recv_tokens_per_expert_list``).
    """
    psum = psum.to(torch.int64)
    if expand:
        psum = align_up(psum, alignment)  # aligned end of each expert block
    return torch.diff(psum, prepend=psum.new_zeros(1))


class _EventOverlapWait:
    """Adapts DeepEP's ``EventOverlap`` of an async call to :class:`~megatron_deepepv2.backends.base.CommEvent`."""

    def __init__(self, event_overlap: Any) -> None:
        self._event_overlap = event_overlap

    @uninitialized_memory_fill_off()
    def wait(self) -> None:
        # Also runs DeepEP's deterministic sort, registered as an after-wait hook in async mode.
        self._event_overlap.current_stream_wait()


class DeepEPBackend(DispatchBackend):
    """Dispatch/combine with DeepEP v2's buffer: ``EPBuffer`` (V2.5) or ``ElasticBuffer`` (2.1); NVLink / NCCL GIN.

    Args:
        group: NCCL process group of the expert-parallel ranks.
        spec: Buffer shape key; ``num_max_tokens_per_rank`` must be the same on every rank.
    """

    name: ClassVar[str] = "deepep"
    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16,),
        combine_dtypes=(torch.bfloat16,),
        combine_hidden_multiple=256,  # combine kernel static assert kHidden % 256
        fp8_hidden_multiple=32,  # TMA: hidden bytes % 32
        max_topk=32,
        requires_cuda=True,
    )

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        super().__init__(group, spec)
        from megatron_deepepv2.config import get_settings  # noqa: PLC0415 - avoid an import cycle

        deep_ep = import_deep_ep()
        self.line_calls = _LINE_CALLS[line_of_module(deep_ep)]
        self.num_sms = self.line_calls.num_sms(spec.num_sms)
        if self.num_sms != spec.num_sms:
            logger.info("DeepEP %s runs an even number of SMs: %d SMs asked, %d used", self.line_calls.line.name,
                        spec.num_sms, self.num_sms)
        self._dispatch_kwargs = dict(self.line_calls.dispatch_kwargs)
        ensure_nccl_communicator(group)
        allow_hybrid = get_settings().allow_hybrid_mode
        if allow_hybrid is None:
            allow_hybrid = _group_spans_nodes(self.group_size)
        buffer_class = getattr(deep_ep, self.line_calls.line.buffer_class)
        self.buffer = buffer_class(
            group,
            num_max_tokens_per_rank=spec.num_max_tokens_per_rank,
            hidden=spec.hidden,
            num_topk=spec.num_topk,
            use_fp8_dispatch=spec.use_fp8,
            deterministic=spec.deterministic,
            allow_hybrid_mode=allow_hybrid,
            allow_multiple_reduction=True,  # expand combine with weights needs it
            explicitly_destroy=True,
        )
        logger.info("DeepEP %s %s: %s mode", self.line_calls.line.name, self.line_calls.line.buffer_class,
                    "hybrid (RDMA x NVLink)" if allow_hybrid else "direct")

    @property
    def num_bytes(self) -> int:
        return self.buffer.num_bytes if self.buffer is not None else 0

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        # Cached: availability does not change within a process, and the probes (import, NCCL query)
        # are far too slow for the per-dispatch backend resolution.
        return _deepep_unavailable_reason()

    @classmethod
    def preflight(cls, *, host_sync: bool = True, deterministic: bool = False) -> Optional[Exception]:
        if deterministic and not host_sync:
            return ValueError(
                "Dispatch without host sync cannot be combined with deterministic mode on the DeepEP backend: "
                "DeepEP 2.1.0's deterministic sort selects rows with boolean masks, which synchronises the host "
                "(and fails in CUDA-graph capture). Turn off MEGATRON_DEEPEPV2_NO_HOST_SYNC, or deterministic mode "
                "(MEGATRON_DEEPEPV2_DETERMINISTIC / Megatron's --deterministic-mode); the reference backend supports "
                "both together."
            )
        return None

    # ------------------------------------------------------------------------------------------
    def _wrap(self, layout: ExpertLayout, native_handle: Any, num_tokens: int, num_topk: int,
              num_experts: int, expert_alignment: int, num_recv_rows: int, host_sync: bool) -> DispatchHandle:
        expand = layout is ExpertLayout.EXPAND

        def device_counts() -> tuple[torch.Tensor, torch.Tensor]:
            tokens_per_expert = aligned_counts_from_psum(
                native_handle.psum_num_recv_tokens_per_expert, expert_alignment, expand
            )
            if expand:
                return tokens_per_expert, tokens_per_expert.sum()
            return tokens_per_expert, native_handle.psum_num_recv_tokens_per_scaleup_rank[-1].to(torch.int64)

        if not host_sync:
            counts = device_counts()  # launched now, while the dispatch's stream order is the current one
            device_counts = lambda: counts  # noqa: E731

        return DispatchHandle(
            backend=self,
            layout=layout,
            num_experts=num_experts,
            expert_alignment=expert_alignment,
            num_tokens=num_tokens,
            num_topk=num_topk,
            num_recv_rows=num_recv_rows,
            # With host sync the host list is what callers use; the device counts follow only on request.
            tokens_per_expert_list=list(native_handle.num_recv_tokens_per_expert_list) if host_sync else None,
            host_sync=host_sync,
            native=native_handle,
            device_counts=device_counts,
        )

    @staticmethod
    def _event(event_overlap: Any, async_finish: bool):
        return _EventOverlapWait(event_overlap) if async_finish else CompletedEvent()

    @staticmethod
    def _stream_kwargs(async_finish: bool, allocate_on_comm_stream: bool, previous_event: Optional[Any]) -> dict:
        """DeepEP's stream arguments of one call.

        Outputs are allocated on the communication stream only in async mode: only there does DeepEP
        ``record_stream`` them on the compute stream. A synchronous call that allocated them there would hand the
        compute stream memory of the communication stream's pool, which the caching allocator gives back to that
        stream as soon as the tensor is freed, while compute kernels may still read it. Synchronous calls
        therefore allocate on the current stream (the communication stream waits on it first, and the current
        stream waits on the communication stream after, so nothing else changes); DeepEP accepts a previous event
        only with ``allocate_on_comm_stream``, so one is passed only then.
        """
        on_comm_stream = allocate_on_comm_stream and async_finish
        return {"previous_event": previous_event if on_comm_stream else None,
                "async_with_compute_stream": async_finish, "allocate_on_comm_stream": on_comm_stream}

    @uninitialized_memory_fill_off()
    def dispatch(
        self,
        x: HiddenStates,
        topk_idx: torch.Tensor,
        topk_weights: Optional[torch.Tensor],
        *,
        num_experts: int,
        layout: ExpertLayout = ExpertLayout.COMPACT,
        expert_alignment: int = 1,
        zero_padding: bool = False,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        previous_event: Optional[Any] = None,
        host_sync: bool = True,
    ) -> DispatchOutput:
        expand = layout is ExpertLayout.EXPAND
        recv_x, recv_idx, recv_weights, native_handle, event = self.buffer.dispatch(
            x,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            num_experts=num_experts,
            num_max_tokens_per_rank=self.spec.num_max_tokens_per_rank,
            expert_alignment=expert_alignment,
            num_sms=self.num_sms,
            **self._stream_kwargs(async_finish, allocate_on_comm_stream, previous_event),
            do_expand=expand,
            do_zero_padding=zero_padding and expand,
            do_cpu_sync=host_sync,
            **self._dispatch_kwargs,
        )
        # The device-side counts are derived from prefix sums the dispatch kernels write on the communication
        # stream: order the current stream after them first (in async mode they may still be running; reading
        # them earlier is a race). Callers wait right after dispatch anyway (Megatron's fused ops do).
        self._event(event, async_finish).wait()
        rows = recv_x[0] if isinstance(recv_x, tuple) else recv_x
        handle = self._wrap(
            layout, native_handle, topk_idx.shape[0], topk_idx.shape[1], num_experts, expert_alignment,
            rows.shape[0], host_sync,
        )
        if not host_sync:
            # Rows past the valid extent are uninitialised: expert id -1 and weight 0, as the contract says.
            recv_idx, recv_weights = self._mask_unused_rows(recv_idx, recv_weights, handle.num_valid_rows)
        return DispatchOutput(recv_x, None if expand else recv_idx, recv_weights, handle, CompletedEvent())

    @staticmethod
    def _mask_unused_rows(
        recv_idx: Optional[torch.Tensor], recv_weights: Optional[torch.Tensor], num_valid_rows: torch.Tensor
    ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Expert id -1 and weight 0 on rows past ``num_valid_rows`` (device-side, no host sync)."""
        reference = recv_idx if recv_idx is not None else recv_weights
        if reference is None:
            return recv_idx, recv_weights
        unused = rows_past_valid(reference.shape[0], num_valid_rows)
        if recv_idx is not None:
            recv_idx = recv_idx.masked_fill_(unused.unsqueeze(1), -1)
        if recv_weights is not None:
            recv_weights = recv_weights.masked_fill_(unused if recv_weights.dim() == 1 else unused.unsqueeze(1), 0.0)
        return recv_idx, recv_weights

    @uninitialized_memory_fill_off()
    def cached_dispatch(
        self,
        x: HiddenStates,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        *,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        previous_event: Optional[Any] = None,
    ) -> DispatchOutput:
        expand = handle.layout is ExpertLayout.EXPAND
        native = handle.native
        recv_x, recv_idx, recv_weights, _, event = self.buffer.dispatch(
            x,
            topk_weights=topk_weights,
            num_sms=native.num_sms,  # DeepEP #685: num_sms=0 with a handle raises
            **self._stream_kwargs(async_finish, allocate_on_comm_stream, previous_event),
            handle=native,
            do_expand=expand,
            do_zero_padding=expand,  # padding rows of a gradient must be zero
            **self._dispatch_kwargs,
        )
        event = self._event(event, async_finish)
        if not handle.host_sync:
            # Worst-case rows past the valid extent are left uninitialised by DeepEP; a consumer that reduces over
            # every row (a bias gradient, a norm) would read garbage. Zero them, in stream order after the copy:
            # one kernel that writes those rows only (a masked fill would read and write the whole buffer).
            event.wait()
            event = CompletedEvent()
            if expert_kernels.AVAILABLE and recv_x.is_cuda:
                expert_kernels.zero_rows_from(recv_x, handle.num_valid_rows)
            else:
                recv_x.masked_fill_(rows_past_valid(recv_x.shape[0], handle.num_valid_rows).unsqueeze(1), 0)
        return DispatchOutput(recv_x, None if expand else recv_idx, recv_weights, handle, event)

    @uninitialized_memory_fill_off()
    def combine(
        self,
        x: torch.Tensor,
        handle: DispatchHandle,
        topk_weights: Optional[torch.Tensor] = None,
        *,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
        previous_event: Optional[Any] = None,
    ) -> CombineOutput:
        combined, combined_weights, event = self.buffer.combine(
            x,
            handle.native,
            topk_weights=topk_weights,
            num_sms=handle.native.num_sms,
            **self._stream_kwargs(async_finish, allocate_on_comm_stream, previous_event),
        )
        return CombineOutput(combined, combined_weights, self._event(event, async_finish))

    def capture_event(self) -> Optional[Any]:
        return self.buffer.capture()

    def destroy(self) -> None:
        if getattr(self, "buffer", None) is not None:
            self.buffer.destroy()
            self.buffer = None
