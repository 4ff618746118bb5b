"""Portable reference backend: the DeepEP v2 dispatch/combine contract in plain ``torch.distributed``.

It runs wherever ``all_to_all_single`` runs: gloo on CPU, NCCL on any GPU. Users can select it on
machines without DeepEP (``MEGATRON_DEEPEPV2_BACKEND=reference``), and the test suites use it as the
oracle for the DeepEP adapter.

How it works: every dispatch computes a *routing plan* with vectorised index operations (no Python
loop over tokens or experts), exchanges the per-rank row counts, then moves all row data -- hidden
states, FP8 scales, expert ids, weights and source indices, packed side by side as bytes -- in **one**
``all_to_all_single``. Combine moves the rows back in one ``all_to_all_single`` and reduces them.

Deterministic by construction: received rows come in source-rank-major order (tokens ascending
inside each source), which is exactly DeepEP's order with ``deterministic=True``; expand rows are
ordered by local expert, then by global source index; every reduction runs in a fixed order (FP32
accumulation over the top-k slots in slot order, one cast at the end, as DeepEP's combine does).
Running the same inputs twice gives bit-identical outputs whatever the thread scheduling.

Padding rows of the expand layout are always zero (with or without ``zero_padding``), which the
contract allows: without ``zero_padding`` their content is unspecified.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepepv2._dist import all_reduce_max
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
)


@dataclass(eq=False)
class _RoutingPlan:
    """Routing of one dispatch, enough to replay it and to reverse it.

    Row indices named ``*_rows`` address the rows a combine gets back (one per sent row), with the
    value ``num_sent`` pointing at an appended zero row, so reductions need no masking.
    """

    send_token_index: torch.Tensor  # [S] local token of each sent row, destination-rank-major
    send_splits: list[int]  # rows sent to each rank
    recv_splits: list[int]  # rows received from each rank
    recv_local_idx: torch.Tensor  # [N, K] local expert ids, -1 elsewhere
    recv_src_index: torch.Tensor  # [N] global source index src_rank * T_max + token
    slot_rows: torch.Tensor  # [T, K] returned row reduced at slot k (first slot of its rank), else S
    owner_rows: torch.Tensor  # [T, K] returned row of the rank owning slot k's expert, else S
    # Expand layout only.
    expand_rows: Optional[torch.Tensor] = None  # [N, K] expanded row of each selection, N_exp if none
    expand_positions: Optional[torch.Tensor] = None  # [M] expanded row of each valid selection
    expand_src_rows: Optional[torch.Tensor] = None  # [M] received row of each valid selection
    expand_selection: Optional[torch.Tensor] = None  # [M] flat (row * K + slot) of each valid selection
    num_expanded_rows: int = 0

    @property
    def num_sent(self) -> int:
        return int(self.send_token_index.numel())


def _as_byte_columns(tensor: torch.Tensor) -> torch.Tensor:
    """Views a row-major tensor ``[R, ...]`` as bytes ``[R, row_bytes]``."""
    rows = tensor.shape[0]
    if tensor.numel() == 0:  # empty tensors may carry strides .contiguous() keeps (e.g. expanded grads)
        return torch.empty((rows, _row_width_bytes(tensor)), dtype=torch.uint8, device=tensor.device)
    return tensor.reshape(rows, math.prod(tensor.shape[1:])).contiguous().view(torch.uint8)


def _from_byte_columns(columns: torch.Tensor, dtype: torch.dtype, tail: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`_as_byte_columns` for a slice of packed columns."""
    rows, width = columns.shape
    if columns.stride() != (width, 1):  # .contiguous() keeps odd strides of size-1 dims; copy instead
        columns = columns.new_empty((rows, width)).copy_(columns)
    return columns.view(dtype).reshape(rows, *tail)


def _exchange_rows(
    tensors: Sequence[torch.Tensor],
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup,
) -> list[torch.Tensor]:
    """Sends row blocks of several tensors to the ranks of ``group`` in one ``all_to_all_single``.

    Args:
        tensors: Tensors with the same number of rows, ordered destination-rank-major.
        send_splits: Rows for each destination rank.
        recv_splits: Rows expected from each source rank.
        group: Process group.

    Returns:
        The received tensors, same dtypes and trailing shapes, ``sum(recv_splits)`` rows each.
    """
    packed = torch.cat([_as_byte_columns(t) for t in tensors], dim=1)
    received = packed.new_empty((sum(recv_splits), packed.shape[1]))
    dist.all_to_all_single(received, packed, recv_splits, send_splits, group=group)
    outputs, offset = [], 0
    for tensor in tensors:
        width = _row_width_bytes(tensor)
        columns = received[:, offset : offset + width]
        outputs.append(_from_byte_columns(columns, tensor.dtype, tuple(tensor.shape[1:])))
        offset += width
    return outputs


def _row_width_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``tensor[rows]`` for any dtype (FP8 has no CPU index kernels), going through bytes."""
    picked = _as_byte_columns(tensor)[rows]
    return _from_byte_columns(picked, tensor.dtype, tuple(tensor.shape[1:]))


def _append_zero_row(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros((1, *tensor.shape[1:]))], dim=0)


def _local_expert_counts(local_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Selections per local expert; entries outside ``[0, num_local_experts)`` (-1, sentinels) are ignored."""
    valid = (local_idx >= 0) & (local_idx < num_local_experts)
    bins = torch.where(valid, local_idx, num_local_experts)
    return torch.bincount(bins, minlength=num_local_experts + 1)[:num_local_experts]


def _align_up(counts: torch.Tensor, alignment: int) -> torch.Tensor:
    return (counts + alignment - 1) // alignment * alignment


class ReferenceBackend(DispatchBackend):
    """Dispatch/combine over ``torch.distributed.all_to_all_single`` (gloo, NCCL).

    Honours the whole contract of :class:`~megatron_deepepv2.backends.base.DispatchBackend`: compact
    and expand layouts, expert alignment, zero padding, FP8 pairs passed through, cached dispatch and
    combine with weights. Construction runs one barrier-like all-reduce on ``group`` so that buffer
    (re)builds are collective exactly like DeepEP's.
    """

    name: ClassVar[str] = "reference"
    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
        combine_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
    )

    def __init__(self, group: dist.ProcessGroup, spec: BufferSpec) -> None:
        super().__init__(group, spec)
        # Collective like every buffer construction: a rank that builds alone blocks here instead of
        # corrupting a later exchange. Also materialises a lazy NCCL communicator.
        (agreed,) = all_reduce_max([spec.num_max_tokens_per_rank], group)
        if agreed != spec.num_max_tokens_per_rank:
            raise RuntimeError(
                f"Ranks built buffers with different num_max_tokens_per_rank (this rank "
                f"{spec.num_max_tokens_per_rank}, largest {agreed}); it must be the same on every rank."
            )

    # ------------------------------------------------------------------------------------------
    # Routing plan
    # ------------------------------------------------------------------------------------------
    def _plan_send(self, topk_idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
        """Computes which token rows go to which rank, and where combine finds each slot's row."""
        num_tokens, num_topk = topk_idx.shape
        world = self.group_size
        experts_per_rank = num_experts // world
        device = topk_idx.device
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, world))

        sends = torch.zeros((num_tokens, world + 1), dtype=torch.bool, device=device)
        sends.scatter_(1, dest, True)
        sends = sends[:, :world]
        dest_rank, token = sends.t().nonzero(as_tuple=True)  # destination-major, tokens ascending
        num_sent = int(token.numel())
        send_counts = sends.sum(dim=0, dtype=torch.int64)

        row_of = torch.full((num_tokens, world + 1), num_sent, dtype=torch.int64, device=device)
        row_of[token, dest_rank] = torch.arange(num_sent, dtype=torch.int64, device=device)
        owner_rows = row_of.gather(1, dest)  # invalid slots point at column `world` = sentinel

        # A rank's contribution is reduced at the first top-k slot of the token that lives on it.
        same_rank = dest.unsqueeze(2) == dest.unsqueeze(1)
        earlier = torch.ones((num_topk, num_topk), dtype=torch.bool, device=device).tril(diagonal=-1)
        first_slot = valid & ~(same_rank & earlier).any(dim=2)
        slot_rows = torch.where(first_slot, owner_rows, torch.full_like(owner_rows, num_sent))
        return token, send_counts, owner_rows, slot_rows

    def _plan_expand(
        self, plan: _RoutingPlan, expert_alignment: int, num_local_experts: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Places every local selection in the expand layout.

        Returns:
            Aligned tokens per expert, on the device and as a host list (one device-to-host copy).
        """
        recv_idx = plan.recv_local_idx
        num_rows, num_topk = recv_idx.shape
        device = recv_idx.device
        flat_expert = torch.where(recv_idx >= 0, recv_idx, num_local_experts).flatten()
        # Stable sort by expert keeps received-row order (= global source order) inside each expert.
        order = torch.sort(flat_expert, stable=True).indices
        counts = _local_expert_counts(flat_expert, num_local_experts)
        aligned = _align_up(counts, expert_alignment)
        counts_host, aligned_host = torch.stack([counts, aligned]).tolist()
        num_selected, num_expanded = sum(counts_host), sum(aligned_host)
        selection = order[:num_selected]
        expert = flat_expert[selection]
        aligned_starts = torch.cumsum(aligned, 0) - aligned
        unaligned_starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.arange(num_selected, device=device) - unaligned_starts[expert]
        positions = aligned_starts[expert] + rank_in_expert

        expand_rows = torch.full((num_rows * num_topk,), num_expanded, dtype=torch.int64, device=device)
        expand_rows[selection] = positions
        plan.expand_rows = expand_rows.view(num_rows, num_topk)
        plan.expand_positions = positions
        plan.expand_src_rows = torch.div(selection, num_topk, rounding_mode="floor")
        plan.expand_selection = selection
        plan.num_expanded_rows = num_expanded
        return aligned, aligned_host

    # ------------------------------------------------------------------------------------------
    # Layout helpers
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _to_expanded(rows: torch.Tensor, plan: _RoutingPlan) -> torch.Tensor:
        """Copies received rows to their expand-layout positions (padding rows stay zero).

        Works on bytes so that every dtype (FP8 included) takes the same path.
        """
        row_bytes = _as_byte_columns(rows)
        out = row_bytes.new_zeros((plan.num_expanded_rows, row_bytes.shape[1]))
        out[plan.expand_positions] = row_bytes[plan.expand_src_rows]
        return _from_byte_columns(out, rows.dtype, tuple(rows.shape[1:]))

    @staticmethod
    def _expanded_weights(recv_weights: torch.Tensor, plan: _RoutingPlan) -> torch.Tensor:
        out = recv_weights.new_zeros((plan.num_expanded_rows,))
        out[plan.expand_positions] = recv_weights.flatten()[plan.expand_selection]
        return out

    def _expand_rows(
        self, recv_x: HiddenStates, recv_weights: Optional[torch.Tensor], plan: _RoutingPlan
    ) -> tuple[HiddenStates, Optional[torch.Tensor]]:
        """Moves received compact rows (and their weights) into the expand layout of ``plan``."""
        if isinstance(recv_x, tuple):
            recv_x = tuple(self._to_expanded(t, plan) for t in recv_x)
        else:
            recv_x = self._to_expanded(recv_x, plan)
        if recv_weights is not None:
            recv_weights = self._expanded_weights(recv_weights, plan)
        return recv_x, recv_weights

    def _unpack_recv(self, received: list[torch.Tensor], is_fp8: bool) -> tuple[HiddenStates, list[torch.Tensor]]:
        if is_fp8:
            return (received[0], received[1]), received[2:]
        return received[0], received[1:]

    # ------------------------------------------------------------------------------------------
    # Contract
    # ------------------------------------------------------------------------------------------
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
    ) -> DispatchOutput:
        is_fp8 = isinstance(x, tuple)
        data = list(x) if is_fp8 else [x]
        num_tokens = topk_idx.shape[0]
        num_local_experts = num_experts // self.group_size

        token, send_counts, owner_rows, slot_rows = self._plan_send(topk_idx, num_experts)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()

        src_index = self.rank * self.spec.num_max_tokens_per_rank + token
        payload = [_take_rows(t, token) for t in data] + [topk_idx[token], src_index.unsqueeze(1)]
        if topk_weights is not None:
            payload.append(topk_weights[token])
        received = _exchange_rows(payload, send_splits, recv_splits, self.group)
        recv_x, rest = self._unpack_recv(received, is_fp8)
        recv_global_idx, recv_src = rest[0], rest[1].squeeze(1)
        recv_weights = rest[2] if topk_weights is not None else None

        first_local = self.rank * num_local_experts
        is_local = (recv_global_idx >= first_local) & (recv_global_idx < first_local + num_local_experts)
        recv_local_idx = torch.where(is_local, recv_global_idx - first_local, torch.full_like(recv_global_idx, -1))

        plan = _RoutingPlan(
            send_token_index=token,
            send_splits=send_splits,
            recv_splits=recv_splits,
            recv_local_idx=recv_local_idx,
            recv_src_index=recv_src,
            slot_rows=slot_rows,
            owner_rows=owner_rows,
        )
        if layout is ExpertLayout.EXPAND:
            tokens_per_expert, tokens_per_expert_list = self._plan_expand(plan, expert_alignment, num_local_experts)
            recv_x, recv_weights = self._expand_rows(recv_x, recv_weights, plan)
            out_idx, num_recv_rows = None, plan.num_expanded_rows
        else:
            counts = _local_expert_counts(recv_local_idx.flatten(), num_local_experts)
            tokens_per_expert = _align_up(counts, expert_alignment)
            tokens_per_expert_list = tokens_per_expert.tolist()
            out_idx, num_recv_rows = recv_local_idx, int(recv_local_idx.shape[0])

        handle = DispatchHandle(
            backend=self,
            layout=layout,
            num_experts=num_experts,
            num_local_experts=num_local_experts,
            expert_alignment=expert_alignment,
            zero_padding=zero_padding,
            num_tokens=num_tokens,
            num_topk=topk_idx.shape[1],
            num_recv_rows=num_recv_rows,
            tokens_per_expert=tokens_per_expert,
            tokens_per_expert_list=tokens_per_expert_list,
            native=plan,
        )
        return DispatchOutput(recv_x, out_idx, recv_weights, handle, CompletedEvent())

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
        plan: _RoutingPlan = handle.native
        is_fp8 = isinstance(x, tuple)
        data = list(x) if is_fp8 else [x]
        token = plan.send_token_index
        payload = [_take_rows(t, token) for t in data]
        if topk_weights is not None:
            payload.append(topk_weights[token])
        received = _exchange_rows(payload, plan.send_splits, plan.recv_splits, self.group)
        recv_x, rest = self._unpack_recv(received, is_fp8)
        recv_weights = rest[0] if topk_weights is not None else None
        if handle.layout is ExpertLayout.EXPAND:
            recv_x, recv_weights = self._expand_rows(recv_x, recv_weights, plan)
            out_idx = None
        else:
            out_idx = plan.recv_local_idx
        return DispatchOutput(recv_x, out_idx, recv_weights, handle, CompletedEvent())

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
        plan: _RoutingPlan = handle.native
        # DeepEP accumulates in FP32 (BF16 in, one cast out); FP64 inputs keep FP64.
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        if handle.layout is ExpertLayout.EXPAND:
            # Each rank first reduces its own selections of a token (FP32, slot order, one cast).
            rows = _append_zero_row(x)
            partial = torch.zeros((plan.recv_local_idx.shape[0], x.shape[1]), dtype=acc_dtype, device=x.device)
            for slot in range(handle.num_topk):
                partial += rows[plan.expand_rows[:, slot]].to(acc_dtype)
            x = partial.to(x.dtype)
            if topk_weights is not None:
                topk_weights = _append_zero_row(topk_weights.unsqueeze(1)).squeeze(1)[plan.expand_rows]

        payload = [x] if topk_weights is None else [x, topk_weights]
        returned = _exchange_rows(payload, plan.recv_splits, plan.send_splits, self.group)
        rows = _append_zero_row(returned[0])
        combined = torch.zeros((handle.num_tokens, x.shape[1]), dtype=acc_dtype, device=x.device)
        for slot in range(handle.num_topk):
            combined += rows[plan.slot_rows[:, slot]].to(acc_dtype)
        combined = combined.to(x.dtype)

        combined_weights = None
        if topk_weights is not None:
            weight_rows = _append_zero_row(returned[1])
            slots = torch.arange(handle.num_topk, device=x.device)
            combined_weights = weight_rows[plan.owner_rows, slots]
        return CombineOutput(combined, combined_weights, CompletedEvent())

