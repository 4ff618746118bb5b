"""The backend contract: what every dispatch/combine backend of this package implements.

* :class:`BufferSpec` -- the shape key a communication buffer is built for;
* :class:`Routing` and :class:`Streams` -- what a dispatch does and how it orders its streams: small tuples a caller
  builds once and passes on every call (the call signature is written here, once);
* :class:`DispatchHandle` -- what a dispatch leaves for combine and for a cached re-dispatch;
* :class:`DispatchBackend` -- one communication buffer bound to one process group (built collectively).

The semantics are ``deep_ep.ElasticBuffer``'s (DeepEP 2.1.0). **dispatch** sends every token to each rank hosting one
of its experts: ``compact`` gives one row per (token, destination rank) in source-rank-major order with the token's
full top-k weights and local expert ids (``-1`` for other ranks' experts); ``expand`` gives one row per (token, local
expert) selection, grouped by local expert, each block padded to ``expert_alignment``, with 1-D weights. **combine**
is its transpose, an *unweighted* sum over the token's destinations; weights passed to it come back per top-k slot
from the rank owning the slot's expert. **cached dispatch** repeats a routing for new data (combine's backward).
With host sync a dispatch waits on the host for exact sizes; without, outputs have the worst-case size
(:func:`~megatron_deepepv2.layout.worst_case_recv_rows`), valid rows first, counts on the device and derived when
first asked for; rows past the valid extent are unspecified (the ops clear them for callers that read them). Every
call returns with the current stream ordered after its communication, whatever :class:`Streams` says.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.layout import (  # noqa: F401 - re-exported: the contract's vocabulary
    ExpertLayout,
    HiddenStates,
    align_up,
    rows_past_valid,
    worst_case_recv_rows,
)


@dataclass(frozen=True)
class BufferSpec:
    """The shape key of a communication buffer (dispatches with equal specs share one).

    Attributes:
        hidden: Hidden size ``H`` of the dispatched tokens.
        num_topk: Number of experts each token selects (``K``).
        use_fp8: Whether dispatch carries FP8 tokens with scales (a key only: every buffer is sized for BF16 rows,
            which combine's backward sends, see :mod:`megatron_deepepv2.sizing`).
        num_max_tokens_per_rank: Upper bound of tokens any rank dispatches in one call, the same on every rank
            (DeepEP sizes the buffer and JIT-compiles its kernels for it).
        deterministic: Whether received rows must come out in a run-to-run stable order.
        num_sms: SMs the communication kernels may use (0 = the backend's choice).
        allow_hybrid_mode: DeepEP's hybrid (RDMA x NVLink) mode; None: only when the group spans nodes.
    """

    hidden: int
    num_topk: int
    use_fp8: bool
    num_max_tokens_per_rank: int
    deterministic: bool = False
    num_sms: int = 0
    allow_hybrid_mode: Optional[bool] = None


@dataclass(frozen=True)
class BackendLimits:
    """Static input limits of a backend, checked before any communication starts.

    Attributes:
        dispatch_dtypes: Dtypes accepted for a plain (non-FP8) dispatch input.
        combine_dtypes: Dtypes accepted for the combine input.
        combine_hidden_multiple: Combine needs ``H % combine_hidden_multiple == 0``.
        fp8_hidden_multiple: FP8 dispatch needs ``H % fp8_hidden_multiple == 0``.
        max_topk: Largest supported top-k.
        requires_cuda: Whether tensors must live on a CUDA device.
    """

    dispatch_dtypes: tuple[torch.dtype, ...]
    combine_dtypes: tuple[torch.dtype, ...]
    combine_hidden_multiple: int = 1
    fp8_hidden_multiple: int = 1
    max_topk: int = 32
    requires_cuda: bool = False


class Routing(NamedTuple):
    """What a fresh dispatch does, the same for every call of a layer.

    Attributes:
        num_experts: Global number of experts (a multiple of the group size).
        layout: Receive layout.
        expert_alignment: Expand layout: pad each expert block to a multiple of this (1 = none).
        zero_padding: Expand layout: zero-fill the padding rows (and their weights).
        host_sync: Wait on the host for exact sizes; False sizes outputs for the worst case and keeps counts on the
            device (see the module docstring).
    """

    num_experts: int
    layout: ExpertLayout = ExpertLayout.COMPACT
    expert_alignment: int = 1
    zero_padding: bool = False
    host_sync: bool = True


class Streams(NamedTuple):
    """How a call orders DeepEP's communication stream (Megatron's flex dispatcher passes both True).

    Attributes:
        async_finish: Let the communication run asynchronously on the communication stream; the call still
            makes the current stream wait for it before returning.
        allocate_on_comm_stream: Allocate outputs on the communication stream (with ``async_finish`` only: a
            synchronous call allocates on the current stream, where nothing else can reuse the memory early).
    """

    async_finish: bool = False
    allocate_on_comm_stream: bool = False


#: The synchronous stream mode.
SYNC = Streams()


class DispatchHandle:
    """What a dispatch leaves for the matching combine and for cached re-dispatches: a plain attribute bag whose
    counts are derived when first asked for (a caller that never reads them launches nothing for them). It holds
    device tensors: keep it until the backward pass has used it.

    Attributes:
        backend: The backend instance (buffer) that dispatched; combine must use the same one.
        routing: The dispatch's :class:`Routing`.
        native: Backend-private routing state (a DeepEP ``EPHandle``, or the reference backend's plan).
        num_tokens: Rows of the dispatch input on this rank (``T``); combine returns this many rows.
        num_topk: Top-k of the routing (``K``).
        num_recv_rows: Rows of the received tensor (the worst case without host sync).
        config: The :class:`~megatron_deepepv2.ops.DispatchConfig` of the op that dispatched (None for a backend
            called directly): combine agrees on its errors and clears its tail as the dispatch did.
    """

    __slots__ = ("backend", "routing", "native", "num_tokens", "num_topk", "num_recv_rows", "config", "_device_counts",
                 "_host_counts", "__weakref__")

    def __init__(self, backend: "DispatchBackend", routing: Routing, native: Any, num_tokens: int, num_topk: int,
                 num_recv_rows: int, device_counts: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                 host_counts: Optional[list[int]] = None) -> None:
        self.backend = backend
        self.routing = routing
        self.native = native
        self.num_tokens = num_tokens
        self.num_topk = num_topk
        self.num_recv_rows = num_recv_rows
        self.config = None
        self._device_counts = device_counts
        self._host_counts = host_counts

    # The routing's fields, read where a handle is at hand.
    layout = property(lambda self: self.routing.layout)
    host_sync = property(lambda self: self.routing.host_sync)
    num_experts = property(lambda self: self.routing.num_experts)
    expert_alignment = property(lambda self: self.routing.expert_alignment)

    @property
    def tokens_per_expert_list(self) -> Optional[list[int]]:
        """Alignment-padded rows per local expert on the host (what the dispatch read), None without host sync."""
        if self._host_counts is None and self.routing.host_sync:
            self._host_counts = self.backend.host_counts(self)
        return self._host_counts

    def _counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._device_counts is None:
            self._device_counts = self.backend.device_counts(self)
        return self._device_counts

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 alignment-padded rows per local expert, on the rows' device (computed on first use)."""
        return self._counts()[0]

    @property
    def num_valid_rows(self) -> torch.Tensor:
        """0-dim int64 on the rows' device: rows holding data (compact: received rows; expand: the sum of
        ``tokens_per_expert``). Equals ``num_recv_rows`` with host sync."""
        return self._counts()[1]

    def __repr__(self) -> str:
        return (f"DispatchHandle({self.backend.name}, {self.routing.layout.value}, tokens={self.num_tokens}, "
                f"top-k={self.num_topk}, rows={self.num_recv_rows}, host_sync={self.routing.host_sync})")


class DispatchOutput(NamedTuple):
    """Result of a backend dispatch: received rows (an FP8 pair if one was sent), compact ``[N, K]`` local expert ids
    (expand: None), weights as sent (compact ``[N, K]``, expand ``[N]``; None if none were sent), the handle."""

    recv_x: HiddenStates
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle


class CombineOutput(NamedTuple):
    """Result of a backend combine: ``[T, H]`` sums and, when weights were given, ``[T, K]`` fp32 weights."""

    x: torch.Tensor
    topk_weights: Optional[torch.Tensor]


class DispatchBackend(ABC):
    """A communication buffer that dispatches tokens to experts and combines them back. Subclasses register under
    :attr:`name` (:mod:`megatron_deepepv2.backends`); construction and :meth:`destroy` are collective over ``group``;
    inputs arrive checked (:mod:`megatron_deepepv2.validation`).

    Args:
        group: Process group spanning the expert-parallel ranks.
        spec: Shape key the buffer is built for.
    """

    #: Registry name (``--moe-flex-dispatcher-backend deepepv2`` selects among these by name).
    name: ClassVar[str]
    #: Static input limits checked before communication.
    limits: ClassVar[BackendLimits]

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        self.group = group
        self.spec = spec
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: Set when a larger buffer replaced this one: its handles still work, new dispatches go elsewhere.
        self.retired = False

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Why this backend cannot run in this process (what is missing, how to fix it), or None when it can."""

    @classmethod
    def preflight(cls, *, host_sync: bool = True, deterministic: bool = False) -> Optional[Exception]:
        """A mode this backend cannot run (the exception says why and how to fix it), or None."""

    @abstractmethod
    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 routing: Routing, streams: Streams = SYNC) -> DispatchOutput:
        """Sends each token to the ranks hosting its selected experts.

        Args:
            x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])`` passed through.
            topk_idx: ``[T, K]`` contiguous int64 global expert ids, ``-1`` = no selection.
            topk_weights: ``[T, K]`` contiguous fp32 routing weights, or None.
            routing: What the dispatch does.
            streams: How it orders the communication stream.
        """

    @abstractmethod
    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchOutput:
        """Repeats the routing of ``handle`` for new data ``[T, H]`` (no layout computation, no host sync); the
        output is in the layout of ``handle``, which it returns unchanged."""

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        """Sums every token's expert outputs back on the rank the token came from.

        Args:
            x: Rows in the receive layout of ``handle`` (compact ``[N, H]``: the per-rank partial sum of the token's
                local experts; expand ``[N_expanded, H]``: one row per selection).
            handle: Handle of the dispatch being reversed.
            topk_weights: Optional weights in the receive layout (``[N, K]`` compact, ``[N_expanded]`` expand),
                gathered back per top-k slot from the slot's owning rank.
            streams: How it orders the communication stream.
        """

    @abstractmethod
    def device_counts(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens_per_expert, num_valid_rows)`` of ``handle`` on the device (see :class:`DispatchHandle`)."""

    @abstractmethod
    def host_counts(self, handle: DispatchHandle) -> list[int]:
        """Alignment-padded rows per local expert of a host-sync dispatch, as the dispatch read them."""

    @property
    def num_bytes(self) -> int:
        """Device memory this buffer holds for its lifetime, in bytes (0 for backends that allocate per call)."""
        return 0

    def destroy(self) -> None:
        """Releases the buffer. Collective for backends whose construction is collective."""
