"""The backend contract: :class:`DispatchConfig` (what a layer's dispatches do), :class:`BufferSpec`, :class:`Streams`
and :data:`SYNC`, :class:`DispatchHandle` and :class:`DispatchResult`, and :class:`DispatchBackend`, whose instances
are communication buffers.

The semantics are ``deep_ep.ElasticBuffer``'s (DeepEP 2.1.0). **dispatch** sends every token to each rank hosting one
of its experts: ``compact`` gives one row per (token, destination rank), source-rank-major, with the token's top-k
weights and local expert ids (``-1``: another rank's); ``expand`` one row per (token, local expert), grouped by expert,
each block padded to ``expert_alignment``, with 1-D weights. **combine** is its transpose, an unweighted sum; weights
passed to it come back per top-k slot. **cached dispatch** repeats a routing for new data. Without host sync outputs
have the worst-case size (:func:`~megatron_deepepv2.layout.worst_case_recv_rows`), valid rows first, counts on the
device, the rest unspecified. Every call returns with the current stream ordered after its communication.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.config import DeepepV2Settings, buffer_settings
from megatron_deepepv2.layout import ExpertLayout, HiddenStates


@dataclass(frozen=True)
class DispatchConfig:
    """What a layer's dispatches do, resolved and checked once (:func:`megatron_deepepv2.backends.resolve_config`).

    Attributes:
        backend: The backend class.
        settings: The switches it was resolved with (:class:`~megatron_deepepv2.config.DeepepV2Settings`).
        layout: Receive layout.
        expert_alignment: Expand layout: each expert block is padded to a multiple of this (1 = none).
        zero_padding: The caller's request for zero padding rows (None: whenever there are any). Padding rows and
            weights are zero whenever there are any (:attr:`padded`); False is rejected there, True outside expand.
        mask_foreign_weights: Compact layout: zero the received weights of other ranks' experts.
        clear_tail: Without host sync: expert id -1 and weight 0 past the valid rows, zero rows past them in a
            combine's input gradient, for a consumer that reads every row.
    """

    backend: type["DispatchBackend"]
    settings: DeepepV2Settings = field(default_factory=DeepepV2Settings)
    layout: ExpertLayout = ExpertLayout.COMPACT
    expert_alignment: int = 1
    zero_padding: Optional[bool] = None
    mask_foreign_weights: bool = True
    clear_tail: bool = True

    def __post_init__(self) -> None:
        # A configuration keys the backend's per-call argument cache on every call: hash it once.
        object.__setattr__(self, "_hash", hash((self.backend, self.settings, self.layout, self.expert_alignment,
                                                self.zero_padding, self.mask_foreign_weights, self.clear_tail)))

    def __hash__(self) -> int:
        return self._hash

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        del state["_hash"]  # a string's hash differs between processes: recomputed where it is loaded
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__post_init__()

    host_sync = property(lambda self: self.settings.host_sync, doc="Whether a dispatch waits on the host for sizes.")
    padded = property(lambda self: self.layout is ExpertLayout.EXPAND and self.expert_alignment > 1,
                      doc="Whether expand blocks have padding rows (alignment > 1): zero, as their weights.")


@dataclass(frozen=True)
class BufferSpec:
    """What a communication buffer is built for: hidden size ``H``, top-k ``K``, the most tokens any rank dispatches in
    one call (the same on every rank), and the dispatches' settings (those marked ``BUFFER`` are construction
    arguments).

    Attributes:
        fp8: Whether dispatches send FP8 rows (in the key so that builds agree on it; sizing is BF16's).
        key: What buffers are kept apart by: all but the token count and the settings not marked ``BUFFER``.
    """

    hidden: int
    num_topk: int
    num_max_tokens_per_rank: int
    settings: DeepepV2Settings = field(default_factory=DeepepV2Settings, compare=False)
    fp8: bool = False

    def __post_init__(self) -> None:
        # Read on every dispatch (the buffer registry's key): computed once.
        object.__setattr__(self, "key", (self.hidden, self.num_topk, self.fp8) + buffer_settings(self.settings))


@dataclass(frozen=True)
class BackendLimits:
    """Static limits of a backend, checked before any communication (:mod:`megatron_deepepv2.validation`): input
    dtypes, ``H`` multiples of combine and FP8 dispatch, the largest top-k, CUDA only."""

    dispatch_dtypes: tuple[torch.dtype, ...]
    combine_dtypes: tuple[torch.dtype, ...]
    combine_hidden_multiple: int = 1
    fp8_hidden_multiple: int = 1
    max_topk: int = 32
    requires_cuda: bool = False


class Streams(NamedTuple):
    """How a call orders DeepEP's communication stream: ``async_finish`` runs it asynchronously (the call still makes
    the current stream wait for it), ``allocate_on_comm_stream`` allocates outputs there (with ``async_finish``)."""

    async_finish: bool = False
    allocate_on_comm_stream: bool = False


#: The synchronous stream mode: what every call of the Megatron manager uses.
SYNC = Streams()


@dataclass(eq=False, slots=True, weakref_slot=True)
class DispatchHandle:
    """What a dispatch leaves for its combine and cached re-dispatches; keep it until the backward has used it.

    Attributes:
        buffer: The buffer that dispatched; combine runs on it.
        config: The dispatch's configuration.
        native: Backend-private routing state (a DeepEP handle, or the reference backend's plan).
        num_tokens: Rows of the dispatch input on this rank (``T``); combine returns this many rows.
        num_topk: Top-k of the routing (``K``).
        num_recv_rows: Rows of the received tensor (the worst case without host sync).
        device_counts, host_counts: Counts the dispatch computed anyway, else derived when first asked for.
        receive_order: Compact layout ordered by the backend: the gather index each cached dispatch applies again.
    """

    buffer: "DispatchBackend"
    config: DispatchConfig
    native: Any
    num_tokens: int
    num_topk: int
    num_recv_rows: int
    device_counts: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    host_counts: Optional[list[int]] = None
    receive_order: Optional[torch.Tensor] = None

    @property
    def tokens_per_expert_list(self) -> Optional[list[int]]:
        """Alignment-padded rows per local expert on the host (what the dispatch read); None without host sync."""
        if self.host_counts is None and self.config.host_sync:
            self.host_counts = self.buffer.host_counts(self)
        return self.host_counts

    def _counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.device_counts is None:
            self.device_counts = self.buffer.device_counts(self)
        return self.device_counts

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 alignment-padded rows per local expert, on the rows' device (computed on first use)."""
        return self._counts()[0]

    @property
    def num_valid_rows(self) -> torch.Tensor:
        """0-dim int64 on the rows' device: rows holding data (expand: the sum of ``tokens_per_expert``); equals
        ``num_recv_rows`` with host sync."""
        return self._counts()[1]

    def __repr__(self) -> str:
        return (f"DispatchHandle({self.buffer.name}, {self.config.layout.value}, tokens={self.num_tokens}, "
                f"top-k={self.num_topk}, rows={self.num_recv_rows}, host_sync={self.config.host_sync})")


class DispatchResult(NamedTuple):
    """What a dispatch returns: received rows ``recv_x`` ``[N, H]`` (an FP8 pair when one was dispatched), compact
    ``[N, K]`` int64 local expert ids (-1: another rank's; None for expand), fp32 weights (``[N, K]`` / ``[N]``, None
    when none were dispatched) and the ``handle`` for combine."""

    recv_x: HiddenStates
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 alignment-padded rows per local expert, on the rows' device."""
        return self.handle.tokens_per_expert


class CombineOutput(NamedTuple):
    """What a backend combine returns: ``[T, H]`` sums and, when weights were given, ``[T, K]`` fp32 weights."""

    x: torch.Tensor
    topk_weights: Optional[torch.Tensor]


class DispatchBackend(ABC):
    """A backend class; each instance is one communication buffer on one process group. Construction and
    :meth:`destroy` are collective over ``group``; inputs arrive checked (:mod:`megatron_deepepv2.validation`).

    Args:
        group: Process group spanning the expert-parallel ranks.
        spec: What the buffer is built for.
    """

    name: ClassVar[str]  #: registry name
    limits: ClassVar[BackendLimits]

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        self.group = group
        self.spec = spec
        self.group_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Why this backend cannot run in this process (what is missing, how to fix it), or None when it can."""

    @classmethod
    def deterministic_order_problem(cls, host_sync: bool) -> Optional[str]:
        """Why deterministic mode cannot order received rows, with or without ``host_sync``, on this backend as
        installed, or None when it can."""

    @abstractmethod
    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: DispatchConfig, num_experts: int, streams: Streams = SYNC) -> DispatchResult:
        """Sends each token to the ranks hosting its selected experts.

        Args:
            x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])`` passed through.
            topk_idx: ``[T, K]`` contiguous int64 global expert ids, ``-1`` = no selection.
            topk_weights: ``[T, K]`` contiguous fp32 routing weights, or None.
            config: What the dispatch does.
            num_experts: Global number of experts, a multiple of the group size.
            streams: How it orders the communication stream.

        Returns:
            The received rows, ids (compact only) and weights as sent, and the handle.
        """

    @abstractmethod
    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchResult:
        """Repeats the routing of ``handle`` for new ``[T, H]`` data, without host sync, in its layout."""

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        """Sums every token's expert outputs back on the rank the token came from.

        Args:
            x: Rows in the receive layout of ``handle`` (compact ``[N, H]``, expand ``[N_expanded, H]``).
            handle: Handle of the dispatch being reversed.
            topk_weights: Weights in the receive layout (``[N, K]`` / ``[N_expanded]``), gathered back per slot.
            streams: How it orders the communication stream.
        """

    @abstractmethod
    def device_counts(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens_per_expert, num_valid_rows)`` of ``handle`` on the device (see :class:`DispatchHandle`)."""

    @abstractmethod
    def host_counts(self, handle: DispatchHandle) -> list[int]:
        """Alignment-padded rows per local expert of a host-sync dispatch, as the dispatch read them."""

    num_bytes: int = 0  #: device memory the buffer holds for its lifetime, in bytes (0: allocated per call)

    def destroy(self) -> None:
        """Releases the buffer. Collective for backends whose construction is collective."""
