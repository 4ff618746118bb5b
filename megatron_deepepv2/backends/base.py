"""The backend contract: :class:`DispatchConfig` (what a layer's dispatches do), :class:`BufferSpec` and what the
ranks agree on at a build (:data:`BUILD_AGREEMENT`), :class:`Streams` and :data:`SYNC`, :class:`DispatchHandle` and
:class:`DispatchResult`, and :class:`DispatchBackend`, whose instances are communication buffers.

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
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple, Optional

import torch

from megatron_deepepv2.config import DeepepV2Settings, check_fields
from megatron_deepepv2.agreement import AgreedField, yes_no
from megatron_deepepv2.groups import GroupState
from megatron_deepepv2.layout import ExpertLayout, HiddenStates


@dataclass(frozen=True)
class DispatchConfig:
    """What a layer's dispatches do, checked when it is built (resolved from the settings by
    :func:`megatron_deepepv2.ops.resolve_config`).

    Attributes:
        backend: The backend class.
        settings: The switches it was resolved with (:class:`~megatron_deepepv2.config.DeepepV2Settings`).
        layout: Receive layout: an :class:`~megatron_deepepv2.layout.ExpertLayout`, or its name (``"compact"`` /
            ``"expand"``, any case), which construction converts to the enum member.
        expert_alignment: Expand layout: each expert block is padded to a multiple of this (1 = none); the padding rows
            and their weights are zero (:attr:`padded`).
        mask_foreign_weights: Compact layout: zero the received weights of other ranks' experts.
        clear_tail: Without host sync: expert id -1 and weight 0 past the valid rows, zero rows past them in a
            combine's input gradient, for a consumer that reads every row.

    Raises:
        ValueError: At construction, for a field of the wrong type or out of range, and as :meth:`check`.
    """

    backend: type["DispatchBackend"]
    settings: DeepepV2Settings = field(default_factory=DeepepV2Settings)
    layout: ExpertLayout = field(default=ExpertLayout.COMPACT, metadata={"note": "an ExpertLayout or its name"})
    expert_alignment: int = field(default=1, metadata={"minimum": 1, "note": "1 for no padding"})
    mask_foreign_weights: bool = True
    clear_tail: bool = True

    def __post_init__(self) -> None:
        # Each field by its annotation (a layout name becomes its member: backends compare with ``is``), then the rest.
        check_fields(self, _how_to_set_config_field)
        self.check()
        # A configuration keys the backend's per-call argument cache on every call: hash it once.
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self) if f.compare)))

    def check(self) -> None:
        """Checks what depends on several fields (each field was checked as it was built, its settings too).

        Raises:
            ValueError: For deterministic mode where the backend cannot order the received rows
                (:meth:`DispatchBackend.deterministic_order_unavailable_reason`).
        """
        settings = self.settings
        reason = settings.deterministic and self.backend.deterministic_order_unavailable_reason(settings.host_sync)
        if reason:
            mode, or_sync = ("", "") if settings.host_sync else (" without host sync",
                                                                 ", or MEGATRON_DEEPEPV2_NO_HOST_SYNC")
            raise ValueError(f"Deterministic mode{mode} is not available on the {self.backend.name} backend as "
                             f"installed: {reason} Otherwise, turn off deterministic mode "
                             f"(MEGATRON_DEEPEPV2_DETERMINISTIC / Megatron's --deterministic-mode){or_sync}.")

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


def _how_to_set_config_field(f: Field) -> str:
    """How a :class:`DispatchConfig` field is given, for its errors (the field's note follows it)."""
    given = {"settings": "settings as keywords", "backend": "a backend name as backend="}.get(f.name, f"{f.name}=")
    return f"Pass it to DispatchConfig, or {given} to resolve_config() or dispatch()"


#: What the ranks agree on at a build of any backend (then its :attr:`DispatchBackend.extra_agreement`): the buffer's
#: key (:attr:`BufferSpec.key`) is their values, the agreement their integers, its error their names; not ``num_sms``.
BUILD_AGREEMENT: tuple[AgreedField, ...] = (
    AgreedField("hidden size", lambda spec: spec.hidden),
    AgreedField("top-k", lambda spec: spec.num_topk),
    AgreedField("FP8", lambda spec: spec.fp8, yes_no),
)


@dataclass(frozen=True)
class BufferSpec:
    """What a communication buffer is built for: hidden size ``H``, top-k ``K``, the most tokens any rank dispatches in
    one call (the same on every rank), whether dispatches send FP8 rows (sizing is BF16's: combine's backward sends
    BF16 rows), the settings of the dispatches, and the backend class (None: the contract's agreement only).

    Attributes:
        key: What buffers are kept apart by, and what the ranks agree on at a build: the values of
            :attr:`agreed_fields`.
    """

    hidden: int
    num_topk: int
    num_max_tokens_per_rank: int
    settings: DeepepV2Settings = field(default_factory=DeepepV2Settings, compare=False)
    fp8: bool = False
    backend: Optional[type["DispatchBackend"]] = None

    def __post_init__(self) -> None:
        # Read on every dispatch (the buffer registry's key): computed once.
        object.__setattr__(self, "key", tuple(each.read(self) for each in self.agreed_fields))

    agreed_fields = property(lambda self: BUILD_AGREEMENT + (self.backend.extra_agreement if self.backend else ()),
                             doc="What the ranks agree on at a build: :data:`BUILD_AGREEMENT`, then the backend's own.")


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
    """How a call orders the communication stream: ``async_finish`` runs it asynchronously (the call still makes
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
    """A backend class; each instance is one communication buffer on one process group (the package's "buffer"; the
    library's own buffer object, when there is one, is the backend's under another name). Construction and
    :meth:`destroy` are collective over the group; inputs arrive checked (:mod:`megatron_deepepv2.validation`),
    contiguous, on the device ``limits`` asks for.

    Args:
        state: The state of the expert-parallel group (:func:`~megatron_deepepv2.groups.state_of`), which the buffer
            keeps as :attr:`state`: its ``group`` is the process group the buffer spans.
        spec: What the buffer is built for; ``spec.num_max_tokens_per_rank`` is the same on every rank.

    Attributes:
        handle_records: The dispatch handles made on this buffer, as :mod:`megatron_deepepv2.buffers` records them
            (a retired buffer is kept while one is alive); None until the first.
        state: The group's :class:`~megatron_deepepv2.groups.GroupState` (its ``call`` is the context of every call
            on the buffer's handles).

    Raises:
        TypeError: If ``state`` is not a :class:`~megatron_deepepv2.groups.GroupState` (a process group, say).
    """

    name: ClassVar[str]  #: registry name
    limits: ClassVar[BackendLimits]
    #: What else the ranks agree on at a build, also in :attr:`BufferSpec.key`: what construction reads off settings.
    extra_agreement: ClassVar[tuple[AgreedField, ...]] = ()
    #: Order of preference of backend ``auto``: the usable backend with the lowest value is chosen.
    auto_preference: ClassVar[int] = 100

    def __init__(self, state: GroupState, spec: BufferSpec) -> None:
        if not isinstance(state, GroupState):  # a build, once: a backend written for the former (group, spec)
            raise TypeError(f"{type(self).__name__} is built with the group's state, not {type(state).__name__}: pass "
                            "megatron_deepepv2.groups.state_of(group).")
        self.state = state
        self.group = state.group
        self.spec = spec
        self.group_size, self.rank = self.state.size, self.state.rank
        self.handle_records: Any = None

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Returns why this backend cannot run in this process (what is missing, how to fix it), or None when it can."""

    @classmethod
    def deterministic_order_unavailable_reason(cls, host_sync: bool) -> Optional[str]:
        """Returns why deterministic mode cannot order received rows, with or without ``host_sync``, on this backend
        as installed, or None when it can."""

    @abstractmethod
    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: DispatchConfig, num_experts: int, streams: Streams = SYNC) -> DispatchResult:
        """Sends each token to the ranks hosting its selected experts.

        Args:
            x: ``[T, H]`` hidden states in one of ``limits.dispatch_dtypes``, or an FP8 pair ``(x_fp8 [T, H] float8,
                scales [T, S] fp32 | int32)`` passed through; ``T <= spec.num_max_tokens_per_rank``.
            topk_idx: ``[T, K]`` int64 global expert ids in ``[0, num_experts)``, ``-1`` = no selection.
            topk_weights: ``[T, K]`` fp32 routing weights, or None.
            config: What the dispatch does (layout, alignment, host sync, determinism).
            num_experts: Global number of experts, a multiple of the group size.
            streams: How it orders the communication stream.

        Returns:
            ``recv_x`` ``[N, H]`` (an FP8 pair for one), compact ``recv_topk_idx`` ``[N, K]`` int64 local ids (None for
            expand), ``recv_topk_weights`` as sent (compact ``[N, K]``, expand ``[N]``; fp32, None without weights)
            and the handle. ``N`` is exact with host sync, else the worst case with valid rows first.
        """

    @abstractmethod
    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchResult:
        """Repeats the routing of ``handle`` for new data, without host sync, in its layout and order.

        Args:
            x: ``[handle.num_tokens, H]`` rows (dtype as :meth:`dispatch`).
            handle: Handle of the dispatch whose routing is repeated.
            topk_weights: ``[T, K]`` fp32 weights, or None.
            streams: How it orders the communication stream.

        Returns:
            As :meth:`dispatch`, ``recv_x`` with ``handle.num_recv_rows`` rows; the same ``handle``.
        """

    @abstractmethod
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        """Sums every token's expert outputs back on the rank the token came from (unweighted).

        Args:
            x: ``[handle.num_recv_rows, H]`` rows in the receive layout of ``handle``, in one of
                ``limits.combine_dtypes``; rows past the valid ones are ignored.
            handle: Handle of the dispatch being reversed.
            topk_weights: fp32 weights in the receive layout (compact ``[N, K]``, expand ``[N]``), or None.
            streams: How it orders the communication stream.

        Returns:
            ``x`` ``[handle.num_tokens, H]`` in ``x``'s dtype, and with ``topk_weights`` the ``[T, K]`` fp32 weights
            gathered back per top-k slot (else None).
        """

    @abstractmethod
    def device_counts(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(tokens_per_expert [E_local] int64, num_valid_rows 0-dim int64)`` of ``handle``, on the rows'
        device, without a host sync (see :class:`DispatchHandle`)."""

    @abstractmethod
    def host_counts(self, handle: DispatchHandle) -> list[int]:
        """Returns the alignment-padded rows per local expert (``E_local`` ints) of a host-sync dispatch, as the
        dispatch read them."""

    num_bytes: int = 0  #: device memory the buffer holds for its lifetime, in bytes (0: allocated per call)

    def destroy(self) -> None:
        """Releases the buffer. Collective for backends whose construction is collective."""
