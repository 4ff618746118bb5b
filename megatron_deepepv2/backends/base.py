"""The backend contract: what every dispatch/combine backend of this package implements.

This module owns the vocabulary shared by the backends, the autograd ops and the Megatron manager:

* :class:`ExpertLayout` -- the two receive layouts of DeepEP v2 (``compact`` and ``expand``);
* :class:`BufferSpec` -- the shape key a communication buffer is built for;
* :class:`DispatchHandle` -- what a dispatch leaves behind for combine and for a cached re-dispatch;
* :class:`DispatchBackend` -- the abstract backend. One instance is one communication buffer bound to one
  process group; constructing it is collective over that group.

The semantics mirror ``deep_ep.ElasticBuffer`` (DeepEP 2.1.0):

* **dispatch** sends every token to each rank that hosts at least one of its selected experts.
  ``compact`` returns one row per (token, destination rank) in source-rank-major order, the token's
  full top-k weights and its expert ids rewritten to local ids (``-1`` for experts of other ranks).
  ``expand`` returns one row per (token, local expert) selection, grouped by local expert in ascending
  order, each expert block padded to ``expert_alignment`` rows, with one weight per row (1-D).
* **combine** is the transpose of dispatch: an *unweighted* sum over each token's destinations
  (apply router probabilities before combine), returning ``[T, H]``. Weights passed to combine are
  gathered back per top-k slot from the rank that owns the slot's expert.
* **cached dispatch** repeats a dispatch's routing for new data (combine backward).
* **host sync**: by default a dispatch waits on the host for the received row counts and returns outputs of
  the exact size plus the per-expert counts as a host list. With ``host_sync=False`` nothing waits: outputs
  are sized for the worst case from the buffer's ``num_max_tokens_per_rank`` (compact ``G * T_max`` rows,
  expand ``align(G * T_max * min(K, E_local) + (alignment - 1) * E_local, alignment)`` rows for a group of
  ``G`` ranks), valid rows come first, and the valid extent and the per-expert counts stay on the device
  (:attr:`DispatchHandle.num_valid_rows`, :attr:`DispatchHandle.tokens_per_expert`). Rows past the valid
  extent carry expert id ``-1`` and weight 0 (their hidden states are unspecified). Such a dispatch can be
  captured in a CUDA graph.
"""

from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, NamedTuple, Optional, Protocol, TypeVar, Union

import torch
import torch.distributed as dist

#: Hidden states handed to dispatch: a BF16/FP32 tensor ``[T, H]`` or an FP8 pair ``(x_fp8 [T, H], scales [T, S])``.
HiddenStates = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class uninitialized_memory_fill_off:  # noqa: N801 - used like a function: `with ...()` / `@...()`
    """Turns ``torch.utils.deterministic.fill_uninitialized_memory`` off for a block or a call, then restores it.

    Under ``torch.use_deterministic_algorithms(True)`` (Megatron's ``--deterministic-mode``) the flag makes every
    ``torch.empty`` launch a fill kernel. DeepEP asserts at each dispatch/combine that the two are not both on
    (the fills may overlap its communication streams); results never read uninitialised rows, so turning the
    fill off around those calls keeps them reproducible.

    As a decorator it costs one check per call when deterministic algorithms are off (the flag does nothing then),
    which is the common case on the dispatch path.
    """

    __slots__ = ("_was_fill",)

    def __enter__(self) -> None:
        self._was_fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc_info: Any) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self._was_fill

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not torch.are_deterministic_algorithms_enabled():
                return fn(*args, **kwargs)
            with uninitialized_memory_fill_off():
                return fn(*args, **kwargs)

        return call


class ExpertLayout(str, enum.Enum):
    """Receive layout of a dispatch.

    ``COMPACT``: one row per (source token, this rank), with ``[N, K]`` local expert ids and weights.
    ``EXPAND``: one row per (token, local expert) selection, grouped by local expert and padded to the
    expert alignment, with 1-D weights. Grouped GEMMs can consume it directly.
    """

    COMPACT = "compact"
    EXPAND = "expand"

    @classmethod
    def parse(cls, value: Union[str, "ExpertLayout"]) -> "ExpertLayout":
        """Returns the layout named by ``value``.

        Args:
            value: An :class:`ExpertLayout` or its name (``"compact"`` / ``"expand"``, any case).

        Returns:
            The matching layout.

        Raises:
            ValueError: If ``value`` names no layout.
        """
        if isinstance(value, ExpertLayout):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            names = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"layout={value!r} is not a known expert layout; use one of {names}.") from None


@dataclass(frozen=True)
class BufferSpec:
    """The shape key of a communication buffer.

    Two dispatches can share a buffer when their specs are equal. ``num_max_tokens_per_rank`` is part of
    the key because DeepEP sizes the buffer and JIT-compiles its kernels for it; it must be the same on
    every rank of the group.

    Attributes:
        hidden: Hidden size ``H`` of the dispatched tokens.
        num_topk: Number of experts each token selects (``K``).
        use_fp8: Whether dispatch carries FP8 tokens with scales (sizes the buffer only).
        num_max_tokens_per_rank: Upper bound of tokens any rank dispatches in one call.
        deterministic: Whether received rows must come out in a run-to-run stable order.
        num_sms: SMs the communication kernels may use (0 = the backend's choice).
    """

    hidden: int
    num_topk: int
    use_fp8: bool
    num_max_tokens_per_rank: int
    deterministic: bool = False
    num_sms: int = 0

    def with_capacity(self, num_max_tokens_per_rank: int) -> "BufferSpec":
        """Returns a copy of this spec with another token capacity."""
        return BufferSpec(
            hidden=self.hidden,
            num_topk=self.num_topk,
            use_fp8=self.use_fp8,
            num_max_tokens_per_rank=num_max_tokens_per_rank,
            deterministic=self.deterministic,
            num_sms=self.num_sms,
        )


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


class CommEvent(Protocol):
    """Completion of an asynchronous communication step."""

    def wait(self) -> None:
        """Makes the current stream wait until the communication (and its epilogue) has finished."""


class CompletedEvent:
    """An event that has already happened (synchronous backends, or ``async_finish=False``)."""

    def wait(self) -> None:
        """Returns at once: nothing is pending."""


@dataclass(eq=False)
class DispatchHandle:
    """What a dispatch leaves for the matching combine and for cached re-dispatches.

    Keep it alive until the backward pass has used it; it holds device tensors.

    Attributes:
        backend: The backend instance (buffer) that dispatched; combine must use the same one.
        layout: Receive layout of the dispatch.
        num_experts: Global number of experts.
        expert_alignment: Expand-layout block alignment (1 = none).
        num_tokens: Rows of the dispatch input on this rank (``T``); combine returns this many rows.
        num_topk: Top-k of the routing (``K``).
        num_recv_rows: Rows of the received tensor (the worst case without host sync).
        tokens_per_expert_list: Alignment-padded row count of each local expert on the host; None when the
            dispatch did not sync the host.
        host_sync: Whether the dispatch synchronised the host (exact sizes, host counts).
        native: Backend-private routing state (a DeepEP ``EPHandle``, or the reference backend's plan).
        device_counts: Returns ``(tokens_per_expert, num_valid_rows)`` (see the properties); called at most
            once, on first access, so a host-sync caller that uses the host list launches nothing for them.
        validate: Whether the combine of this dispatch agrees on input errors over the group (the dispatch
            configuration's ``validate``; set by :func:`megatron_deepepv2.ops.dispatch`).
    """

    backend: "DispatchBackend"
    layout: ExpertLayout
    num_experts: int
    expert_alignment: int
    num_tokens: int
    num_topk: int
    num_recv_rows: int
    tokens_per_expert_list: Optional[list[int]]
    host_sync: bool
    native: Any = field(repr=False)
    device_counts: Callable[[], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    validate: bool = field(default=False, repr=False)

    @functools.cached_property
    def _device_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.device_counts()

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Alignment-padded row count of each local expert, int64 on the input's device."""
        return self._device_counts[0]

    @property
    def num_valid_rows(self) -> torch.Tensor:
        """0-dim int64 on the input's device: rows holding data (compact: received rows; expand: the sum of
        ``tokens_per_expert``). Equals ``num_recv_rows`` with host sync."""
        return self._device_counts[1]


class DispatchOutput(NamedTuple):
    """Result of a dispatch.

    Attributes:
        recv_x: Received hidden states (an FP8 pair when an FP8 pair was dispatched).
        recv_topk_idx: Compact: ``[N, K]`` local expert ids, ``-1`` for other ranks' experts. Expand: None.
        recv_topk_weights: Compact: ``[N, K]`` fp32 weights as sent. Expand: ``[N]`` fp32, one per row.
            None when no weights were dispatched.
        handle: The dispatch handle.
        event: Completion event; wait on it before reading the outputs when ``async_finish`` was set. Without
            ``async_finish`` the outputs are ready in stream order when the call returns (callers do not wait).
    """

    recv_x: HiddenStates
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle
    event: CommEvent


class CombineOutput(NamedTuple):
    """Result of a combine.

    Attributes:
        x: ``[T, H]`` sum of each token's expert outputs.
        topk_weights: ``[T, K]`` fp32 weights gathered per top-k slot, or None when none were passed.
        event: Completion event, as :class:`DispatchOutput`'s.
    """

    x: torch.Tensor
    topk_weights: Optional[torch.Tensor]
    event: CommEvent


def rows_past_valid(num_rows: int, num_valid_rows: torch.Tensor) -> torch.Tensor:
    """``[num_rows]`` bool, True on the rows that hold no data: those from ``num_valid_rows`` (a device count) on, in a
    worst-case-sized output of a dispatch without host sync. On the count's device, without a host read; callers
    ``masked_fill`` with it (the mask of the rows to clear, so that no negation kernel is needed)."""
    return torch.arange(num_rows, device=num_valid_rows.device) >= num_valid_rows


_Count = TypeVar("_Count", int, torch.Tensor)


def align_up(value: _Count, alignment: int) -> _Count:
    """``value`` rounded up to a multiple of ``alignment``: the one align-up of the package (ints and int tensors,
    on the device for tensors)."""
    return (value + alignment - 1) // alignment * alignment


def worst_case_recv_rows(
    layout: ExpertLayout,
    *,
    group_size: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    num_local_experts: int,
    expert_alignment: int = 1,
) -> int:
    """Rows a dispatch without host sync allocates (DeepEP 2.1.0's worst case, which every backend uses).

    Args:
        layout: Receive layout.
        group_size: Ranks in the group (``G``).
        num_max_tokens_per_rank: The buffer's token capacity (``T_max``).
        num_topk: Top-k of the routing (``K``).
        num_local_experts: Experts per rank (``E_local``).
        expert_alignment: Expand-layout block alignment.

    Returns:
        ``G * T_max`` for compact; ``align(G * T_max * min(K, E_local) + (alignment - 1) * E_local,
        alignment)`` for expand.
    """
    if layout is ExpertLayout.COMPACT:
        return group_size * num_max_tokens_per_rank
    rows = group_size * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    rows += (expert_alignment - 1) * num_local_experts
    return align_up(rows, expert_alignment)


class DispatchBackend(ABC):
    """A communication buffer that dispatches tokens to experts and combines them back.

    Subclasses register under :attr:`name` (see :mod:`megatron_deepepv2.backends`). Construction is
    collective over ``group``; so is :meth:`destroy`.

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

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        """Says why this backend cannot run in this process, or None when it can.

        Returns:
            A sentence naming what is missing and how to fix it, or None.
        """
        return None

    @classmethod
    def preflight(cls, *, host_sync: bool = True, deterministic: bool = False) -> Optional[Exception]:
        """Process-state and mode problems that would make this backend fail mid-communication, checked first.

        Args:
            host_sync: Whether the dispatch may synchronise the host.
            deterministic: Whether deterministic mode is on.

        Returns:
            An exception describing the problem and its fix, or None.
        """
        return None

    @abstractmethod
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
        """Sends each token to the ranks hosting its selected experts.

        Inputs must already be validated (:mod:`megatron_deepepv2.validation`).

        Args:
            x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])`` passed through.
            topk_idx: ``[T, K]`` int64 global expert ids, ``-1`` = no selection.
            topk_weights: ``[T, K]`` fp32 routing weights, or None.
            num_experts: Global number of experts (a multiple of the group size).
            layout: Receive layout.
            expert_alignment: Expand layout: pad each expert block to a multiple of this.
            zero_padding: Expand layout: zero-fill padding rows (and their weights).
            async_finish: Return before the communication finished; wait on the returned event.
            allocate_on_comm_stream: Allocate outputs on the communication stream, with ``async_finish`` (the
                outputs are then recorded on the current stream); a synchronous call allocates them on the current
                stream whatever this says, since nothing would protect them from reuse by the other stream.
            previous_event: Event the communication must wait for (with ``allocate_on_comm_stream``).
            host_sync: Wait on the host for exact sizes; False sizes outputs for the worst case and keeps
                counts on the device (see the module docstring).

        Returns:
            The received tensors, the handle and the completion event.
        """

    @abstractmethod
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
        """Repeats the routing of ``handle`` for new data (no layout computation, no host sync).

        Args:
            x: ``[T, H]`` data with the same ``T`` as the dispatch that made ``handle``.
            handle: Handle of an earlier dispatch on this backend.
            topk_weights: Optional ``[T, K]`` fp32 weights to send along.
            async_finish: See :meth:`dispatch`.
            allocate_on_comm_stream: See :meth:`dispatch`.
            previous_event: See :meth:`dispatch`.

        Returns:
            Output in the layout of ``handle``; ``handle`` is returned unchanged. Without host sync, rows past
            ``handle.num_valid_rows`` are zero (a consumer may reduce over every row).
        """

    @abstractmethod
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
        """Sums every token's expert outputs back on the rank the token came from.

        Args:
            x: Rows in the receive layout of ``handle`` (``[N, H]`` compact: the per-rank partial sum of
                the token's local experts; ``[N_expanded, H]`` expand: one row per selection).
            handle: Handle of the dispatch being reversed.
            topk_weights: Optional weights in the receive layout (``[N, K]`` compact, ``[N_expanded]``
                expand), gathered back per top-k slot from the slot's owning rank.
            async_finish: See :meth:`dispatch`.
            allocate_on_comm_stream: See :meth:`dispatch`.
            previous_event: See :meth:`dispatch`.

        Returns:
            ``[T, H]`` combined rows and, when weights were given, ``[T, K]`` fp32 weights.
        """

    @property
    def num_bytes(self) -> int:
        """Device memory this buffer holds for its lifetime, in bytes (0 for backends that allocate per call)."""
        return 0

    def capture_event(self) -> Optional[Any]:
        """Captures an event on the current stream for ``previous_event`` (None when not needed).

        Enqueue every kernel that produces a communication input *before* calling this.
        """
        return None

    def destroy(self) -> None:
        """Releases the buffer. Collective for backends whose construction is collective."""
