"""Portable reference backend: the DeepEP v2 dispatch/combine contract in plain ``torch.distributed``.

It runs wherever ``all_to_all_single`` runs: gloo on CPU, NCCL on any GPU. Users can select it on
machines without DeepEP (``MEGATRON_DEEPEPV2_BACKEND=reference``), and the test suites use it as the
oracle for the DeepEP adapter.

How it works: every dispatch computes a *routing plan* with vectorised index operations (no Python
loop over tokens or experts) and moves all row data -- hidden states, FP8 scales, expert ids, weights and
source indices, packed side by side as bytes -- in **one** ``all_to_all_single``. Combine moves the rows
back in one ``all_to_all_single`` and reduces them. Every collective goes through
:func:`~megatron_deepepv2.agreement.run_collective`: over gloo a rank waiting in one raises within milliseconds, naming
the peer, when that peer announces a failure instead of joining. Two transports:

* with host sync (the default) the ranks first exchange row counts, read them on the host and send
  exactly the rows each destination needs; outputs have exact sizes;
* without host sync every rank sends a fixed block of ``T_max`` rows to every rank (token ``t`` in row
  ``t`` of the block, unused rows zero, a flag byte marking used ones), so no count is read on the host.
  The receiver packs the used rows to the front with device-side prefix sums; outputs have the
  worst-case sizes of :func:`~megatron_deepepv2.backends.base.worst_case_recv_rows`. Over NCCL this path
  can be captured in a CUDA graph.

Deterministic by construction: received rows come in source-rank-major order (tokens ascending
inside each source), which is exactly DeepEP's order with ``deterministic=True``; expand rows are
ordered by local expert, then by global source index; every reduction runs in a fixed order (FP32
accumulation over the top-k slots in slot order, one cast at the end, as DeepEP's combine does).
Running the same inputs twice gives bit-identical outputs whatever the thread scheduling.

What the contract leaves unspecified is filled so that a consumer reading it cannot pass unnoticed:
padding rows of the expand layout without ``zero_padding`` are NaN (every byte 0xFF: NaN in each float
dtype, FP8 included), and so are their weights. Rows past the valid extent without host sync are zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepepv2.agreement import AgreedField, raise_on_every_rank, run_collective
from megatron_deepepv2.backends.base import (SYNC, BackendLimits, BufferSpec, CombineOutput, DispatchBackend,
                                             DispatchConfig, DispatchHandle, DispatchResult, Streams)
from megatron_deepepv2.backends.registry import register_backend
from megatron_deepepv2.groups import GroupState
from megatron_deepepv2.layout import (ExpertLayout, HiddenStates, align_up, rows_past_valid, split_hidden,
                                      worst_case_recv_rows)


@dataclass(eq=False)
class _Transport:
    """How the rows of one routing travel (dispatch direction: sender -> receiver; combine: back).

    With host sync the sent rows are packed per destination (``send_splits`` / ``recv_splits`` exact).
    Without it, every destination gets a block of ``T_max`` rows: ``send_rows`` places each sent row in
    the send buffer and ``recv_positions`` moves each received row to its output row (used rows first).
    """

    send_splits: list[int]
    recv_splits: list[int]
    send_rows: Optional[torch.Tensor] = None  # blocked: send-buffer row of each sent row
    recv_positions: Optional[torch.Tensor] = None  # blocked: output row of each received block row

    @property
    def blocked(self) -> bool:
        return self.send_rows is not None

    def send_blocks(self, packed: torch.Tensor, state: GroupState) -> torch.Tensor:
        """Blocked transport: places packed rows in the per-destination blocks and exchanges them.

        Rows of unused (token, destination) pairs carry the position one past the blocks and are dropped.
        """
        block = packed.new_zeros((sum(self.send_splits) + 1, packed.shape[1]))
        block[self.send_rows] = packed
        return _all_to_all(block[:-1], self.send_splits, self.recv_splits, state)

    def send(self, tensors: Sequence[torch.Tensor], state: GroupState) -> list[torch.Tensor]:
        """Dispatch direction: rows in send order -> rows in receive (output) order."""
        if not self.blocked:
            return _exchange_rows(tensors, self.send_splits, self.recv_splits, state)
        return _unpack(self.to_output_order(self.send_blocks(_pack(tensors), state)), tensors)

    def to_output_order(self, received: torch.Tensor) -> torch.Tensor:
        """Blocked transport: received block rows -> output rows (used rows first)."""
        ordered = torch.empty_like(received)
        ordered[self.recv_positions] = received
        return ordered

    def send_back(self, tensors: Sequence[torch.Tensor], state: GroupState) -> list[torch.Tensor]:
        """Combine direction: rows in receive order -> rows in send-buffer row space of the source."""
        if not self.blocked:
            return _exchange_rows(tensors, self.recv_splits, self.send_splits, state)
        packed = _pack(tensors)[self.recv_positions]
        returned = _all_to_all(packed, self.recv_splits, self.send_splits, state)
        return _unpack(returned, tensors)


@dataclass(eq=False)
class _RoutingPlan:
    """Routing of one dispatch, enough to replay it and to reverse it.

    Row indices named ``*_rows`` address the rows a combine gets back (one per send-buffer row), with
    the value ``num_returned`` pointing at an appended zero row, so reductions need no masking.
    """

    transport: _Transport
    send_token_index: torch.Tensor  # [S] local token of each sent row, destination-rank-major
    recv_local_idx: torch.Tensor  # [N, K] local expert ids, -1 elsewhere (and on unused rows)
    recv_src_index: torch.Tensor  # [N] global source index src_rank * T_max + token (-1 on unused rows)
    slot_rows: torch.Tensor  # [T, K] returned row reduced at slot k (first slot of its rank), else sentinel
    owner_rows: torch.Tensor  # [T, K] returned row of the rank owning slot k's expert, else sentinel
    # Expand layout only.
    expand_rows: Optional[torch.Tensor] = None  # [N, K] expanded row of each selection, N_exp if none
    expand_positions: Optional[torch.Tensor] = None  # [N * K] expanded row of each (sorted) selection
    expand_source: Optional[torch.Tensor] = None  # [N * K] flat (row * K + slot) of each sorted selection
    num_expanded_rows: int = 0


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


def _pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Packs same-row-count tensors side by side as bytes ``[R, sum(row_bytes)]``."""
    return torch.cat([_as_byte_columns(t) for t in tensors], dim=1)


def _unpack(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Inverse of :func:`_pack`: columns back to tensors with the dtypes and trailing shapes of ``like``."""
    outputs, offset = [], 0
    for tensor in like:
        width = _row_width_bytes(tensor)
        columns = packed[:, offset : offset + width]
        outputs.append(_from_byte_columns(columns, tensor.dtype, tuple(tensor.shape[1:])))
        offset += width
    return outputs


def _all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], state) -> torch.Tensor:
    received = rows.new_empty((sum(recv_splits), rows.shape[1]))
    run_collective(dist.all_to_all_single, received, rows, recv_splits, send_splits, state=state, exchange=True)
    return received


def _exchange_rows(
    tensors: Sequence[torch.Tensor],
    send_splits: list[int],
    recv_splits: list[int],
    state: GroupState,
) -> list[torch.Tensor]:
    """Sends row blocks of several tensors to the ranks of the group of ``state`` in one ``all_to_all_single``.

    Args:
        tensors: Tensors with the same number of rows, ordered destination-rank-major.
        send_splits: Rows for each destination rank.
        recv_splits: Rows expected from each source rank.
        state: The state of the process group.

    Returns:
        The received tensors, same dtypes and trailing shapes, ``sum(recv_splits)`` rows each.
    """
    return _unpack(_all_to_all(_pack(tensors), send_splits, recv_splits, state), tensors)


def _row_width_bytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape[1:]) * tensor.element_size()


def _take_rows(tensor: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``tensor[rows]`` for any dtype (FP8 has no CPU index kernels), going through bytes."""
    picked = _as_byte_columns(tensor)[rows]
    return _from_byte_columns(picked, tensor.dtype, tuple(tensor.shape[1:]))


def _append_zero_row(tensor: torch.Tensor) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros((1, *tensor.shape[1:]))], dim=0)


def _counts_of_sorted(sorted_experts: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Entries per expert id ``0 .. num_local_experts - 1`` of an ascending 1-D tensor.

    Binary search instead of ``bincount``, which synchronises the host on CUDA to size its output.
    """
    edges = torch.arange(num_local_experts + 1, dtype=sorted_experts.dtype, device=sorted_experts.device)
    bounds = torch.searchsorted(sorted_experts, edges)
    return bounds[1:] - bounds[:-1]


def _local_expert_counts(local_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """Selections per local expert; entries outside ``[0, num_local_experts)`` (-1, sentinels) are ignored."""
    valid = (local_idx >= 0) & (local_idx < num_local_experts)
    bins = torch.where(valid, local_idx, num_local_experts).flatten()
    return _counts_of_sorted(torch.sort(bins).values, num_local_experts)


def _exclusive_cumsum(values: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(values, 0) - values


#: What the ranks also agree on when they construct a reference buffer: the token limit it is sized for.
_TOKEN_LIMIT = AgreedField("num_max_tokens_per_rank", lambda spec: spec.num_max_tokens_per_rank)


@register_backend
class ReferenceBackend(DispatchBackend):
    """Dispatch/combine over ``torch.distributed.all_to_all_single`` (gloo, NCCL).

    Honours the whole contract of :class:`~megatron_deepepv2.backends.base.DispatchBackend`: compact
    and expand layouts, expert alignment, zero padding, FP8 pairs passed through, cached dispatch,
    combine with weights, and dispatch with or without host sync. Construction runs one small all-reduce
    over the group (and an all-gather naming each rank's token limit when they differ), so that buffer (re)builds are
    collective as DeepEP's are.
    """

    name: ClassVar[str] = "reference"
    limits: ClassVar[BackendLimits] = BackendLimits(
        dispatch_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
        combine_dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64),
    )

    def __init__(self, state: GroupState, spec: BufferSpec) -> None:
        super().__init__(state, spec)
        # Collective like every buffer construction: a rank that builds alone blocks here instead of corrupting a later
        # exchange, and the ranks check that they size for the same token limit. Also materialises a lazy NCCL
        # communicator.
        raise_on_every_rank(None, state, agree=True, fields=(_TOKEN_LIMIT,), values=[_TOKEN_LIMIT.encode(spec)],
                            purpose="reference buffer builds")

    # ------------------------------------------------------------------------------------------
    # Routing plan
    # ------------------------------------------------------------------------------------------
    def _plan_send(
        self, topk_idx: torch.Tensor, num_experts: int, host_sync: bool
    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        """Computes which token rows go to which rank, and where combine finds each slot's row.

        Returns:
            ``(token, returned_row, send_counts, owner_rows, slot_rows)``: the local token of each sent row
            (destination-major, tokens ascending) and the row it comes back in (without host sync: its
            send-buffer row, a sentinel for unused pairs); rows per destination (host sync only, else None);
            and for each (token, slot) the returned row of the slot's owning rank / of the slot where that
            rank's contribution is reduced (a sentinel one past the last returned row otherwise).
        """
        num_tokens, num_topk = topk_idx.shape
        world = self.group_size
        experts_per_rank = num_experts // world
        device = topk_idx.device
        valid = topk_idx >= 0
        dest = torch.where(valid, topk_idx // experts_per_rank, torch.full_like(topk_idx, world))

        sends = torch.zeros((num_tokens, world + 1), dtype=torch.bool, device=device)
        sends.scatter_(1, dest, True)
        sends = sends[:, :world]
        send_counts = None
        if host_sync:
            send_counts = sends.sum(dim=0, dtype=torch.int64)
            dest_rank, token = sends.t().nonzero(as_tuple=True)  # destination-major, tokens ascending
            num_returned = int(token.numel())
            returned_row = torch.arange(num_returned, dtype=torch.int64, device=device)
        else:
            # Every (destination, token) pair has a fixed row dest * T_max + token: no data-dependent sizes.
            max_tokens = self.spec.num_max_tokens_per_rank
            dest_rank = torch.arange(world, device=device).repeat_interleave(num_tokens)
            token = torch.arange(num_tokens, device=device).repeat(world)
            num_returned = world * max_tokens
            returned_row = torch.where(sends.t().flatten(), dest_rank * max_tokens + token, num_returned)

        row_of = torch.full((num_tokens, world + 1), num_returned, dtype=torch.int64, device=device)
        row_of[token, dest_rank] = returned_row
        owner_rows = row_of.gather(1, dest)  # invalid slots point at column `world` = sentinel

        # A rank's contribution is reduced at the first top-k slot of the token that lives on it.
        same_rank = dest.unsqueeze(2) == dest.unsqueeze(1)
        earlier = torch.ones((num_topk, num_topk), dtype=torch.bool, device=device).tril(diagonal=-1)
        first_slot = valid & ~(same_rank & earlier).any(dim=2)
        slot_rows = torch.where(first_slot, owner_rows, torch.full_like(owner_rows, num_returned))
        return token, returned_row, send_counts, owner_rows, slot_rows

    def _plan_expand(
        self, plan: _RoutingPlan, expert_alignment: int, num_local_experts: int, host_sync: bool
    ) -> tuple[torch.Tensor, Optional[list[int]]]:
        """Places every local selection in the expand layout.

        With host sync the layout has exactly the aligned rows; without, the worst-case row count, with
        the expert blocks first.

        Returns:
            Aligned tokens per expert on the device, and as a host list with host sync (else None).
        """
        recv_idx = plan.recv_local_idx
        num_rows, num_topk = recv_idx.shape
        device = recv_idx.device
        flat_expert = torch.where(recv_idx >= 0, recv_idx, num_local_experts).flatten()
        # Stable sort by expert keeps received-row order (= global source order) inside each expert;
        # unselected entries (expert id num_local_experts) sort last.
        expert, order = torch.sort(flat_expert, stable=True)
        counts = _counts_of_sorted(expert, num_local_experts)
        aligned = align_up(counts, expert_alignment)
        if host_sync:
            aligned_host = aligned.tolist()  # the only device-to-host copy of an expand dispatch
            num_expanded = sum(aligned_host)
        else:
            aligned_host = None
            num_expanded = worst_case_recv_rows(
                ExpertLayout.EXPAND,
                group_size=self.group_size,
                num_max_tokens_per_rank=self.spec.num_max_tokens_per_rank,
                num_topk=num_topk,
                num_local_experts=num_local_experts,
                expert_alignment=expert_alignment,
            )
        sentinel = torch.full((1,), num_expanded, dtype=torch.int64, device=device)  # a fill: capturable
        aligned_starts = torch.cat([_exclusive_cumsum(aligned), sentinel])
        unaligned_starts = torch.cat([_exclusive_cumsum(counts), counts.sum().reshape(1)])
        rank_in_expert = torch.arange(order.numel(), device=device) - unaligned_starts[expert]
        positions = torch.where(expert < num_local_experts, aligned_starts[expert] + rank_in_expert, sentinel)

        expand_rows = torch.empty_like(positions)
        expand_rows[order] = positions
        plan.expand_rows = expand_rows.view(num_rows, num_topk)
        plan.expand_positions = positions
        plan.expand_source = order
        plan.num_expanded_rows = num_expanded
        return aligned, aligned_host

    # ------------------------------------------------------------------------------------------
    # Layout helpers
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _to_expanded(rows: torch.Tensor, plan: _RoutingPlan, padding: int) -> torch.Tensor:
        """Copies received rows to their expand-layout positions; padding rows get the byte ``padding``.

        Works on bytes so that every dtype (FP8 included) takes the same path. Unselected entries all
        land in one extra row, dropped at the end.
        """
        row_bytes = _as_byte_columns(rows)
        out = row_bytes.new_full((plan.num_expanded_rows + 1, row_bytes.shape[1]), padding)
        num_topk = plan.recv_local_idx.shape[1]
        source_rows = torch.div(plan.expand_source, num_topk, rounding_mode="floor")
        out[plan.expand_positions] = row_bytes[source_rows]
        return _from_byte_columns(out[:-1], rows.dtype, tuple(rows.shape[1:]))

    @staticmethod
    def _expanded_weights(recv_weights: torch.Tensor, plan: _RoutingPlan, padding: float) -> torch.Tensor:
        out = recv_weights.new_full((plan.num_expanded_rows + 1,), padding)
        out[plan.expand_positions] = recv_weights.flatten()[plan.expand_source]
        return out[:-1]

    def _expand_rows(
        self, recv_x: HiddenStates, recv_weights: Optional[torch.Tensor], plan: _RoutingPlan, zero_padding: bool
    ) -> tuple[HiddenStates, Optional[torch.Tensor]]:
        """Moves received compact rows (and their weights) into the expand layout of ``plan``; padding rows are
        zero with ``zero_padding``, else NaN (unspecified by the contract)."""
        padding = 0 if zero_padding else 0xFF
        rows, scales = split_hidden(recv_x)
        rows = self._to_expanded(rows, plan, padding)
        recv_x = rows if scales is None else (rows, self._to_expanded(scales, plan, padding))
        if recv_weights is not None:
            recv_weights = self._expanded_weights(recv_weights, plan, 0.0 if zero_padding else math.nan)
        return recv_x, recv_weights

    def _unpack_recv(self, received: list[torch.Tensor], is_fp8: bool) -> tuple[HiddenStates, list[torch.Tensor]]:
        if is_fp8:
            return (received[0], received[1]), received[2:]
        return received[0], received[1:]

    # ------------------------------------------------------------------------------------------
    # Contract
    # ------------------------------------------------------------------------------------------
    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 config: DispatchConfig, num_experts: int, streams: Streams = SYNC) -> DispatchResult:
        layout, expert_alignment, host_sync = config.layout, config.expert_alignment, config.host_sync
        rows, scales = split_hidden(x)
        is_fp8 = scales is not None
        data = [rows, scales] if is_fp8 else [rows]
        num_tokens = topk_idx.shape[0]
        num_local_experts = num_experts // self.group_size

        token, returned_row, send_counts, owner_rows, slot_rows = self._plan_send(topk_idx, num_experts, host_sync)
        src_index = self.rank * self.spec.num_max_tokens_per_rank + token
        payload = [_take_rows(t, token) for t in data] + [topk_idx[token], src_index.unsqueeze(1)]
        if topk_weights is not None:
            payload.append(topk_weights[token])

        if host_sync:
            transport, received, num_valid_rows = self._send_exact(payload, send_counts)
        else:
            transport, received, num_valid_rows = self._send_blocked(payload, returned_row)
        recv_x, rest = self._unpack_recv(received, is_fp8)
        recv_global_idx, recv_src = rest[0], rest[1].squeeze(1)
        recv_weights = rest[2] if topk_weights is not None else None
        if not host_sync:  # unused rows arrive as zeros; expert id 0 there would read as a selection
            unused = rows_past_valid(recv_src.shape[0], num_valid_rows)
            recv_global_idx = recv_global_idx.masked_fill(unused.unsqueeze(1), -1)
            recv_src = recv_src.masked_fill(unused, -1)

        first_local = self.rank * num_local_experts
        is_local = (recv_global_idx >= first_local) & (recv_global_idx < first_local + num_local_experts)
        recv_local_idx = torch.where(is_local, recv_global_idx - first_local, torch.full_like(recv_global_idx, -1))

        plan = _RoutingPlan(
            transport=transport,
            send_token_index=token,
            recv_local_idx=recv_local_idx,
            recv_src_index=recv_src,
            slot_rows=slot_rows,
            owner_rows=owner_rows,
        )
        if layout is ExpertLayout.EXPAND:
            tokens_per_expert, tokens_per_expert_list = self._plan_expand(
                plan, expert_alignment, num_local_experts, host_sync
            )
            recv_x, recv_weights = self._expand_rows(recv_x, recv_weights, plan, config.padded)
            out_idx, num_recv_rows = None, plan.num_expanded_rows
            num_valid_rows = tokens_per_expert.sum()
        else:
            counts = _local_expert_counts(recv_local_idx.flatten(), num_local_experts)
            tokens_per_expert = align_up(counts, expert_alignment)
            tokens_per_expert_list = tokens_per_expert.tolist() if host_sync else None
            out_idx, num_recv_rows = recv_local_idx, int(recv_local_idx.shape[0])

        # The counts are computed anyway: the routing plan and the host list are built from them.
        handle = DispatchHandle(self, config, plan, num_tokens=num_tokens, num_topk=topk_idx.shape[1],
                                num_recv_rows=num_recv_rows, device_counts=(tokens_per_expert, num_valid_rows),
                                host_counts=tokens_per_expert_list)
        return DispatchResult(recv_x, out_idx, recv_weights, handle)

    def _send_exact(
        self, payload: list[torch.Tensor], send_counts: torch.Tensor
    ) -> tuple[_Transport, list[torch.Tensor], torch.Tensor]:
        """Exchange of a fresh dispatch with host sync: row counts first (read on the host), then the rows.

        Returns:
            The transport, the received tensors and their row count as a 0-dim device tensor.
        """
        recv_counts = torch.empty_like(send_counts)
        run_collective(dist.all_to_all_single, recv_counts, send_counts, state=self.state, exchange=True)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()
        transport = _Transport(send_splits, recv_splits)
        received = transport.send(payload, self.state)
        return transport, received, torch.tensor(sum(recv_splits), dtype=torch.int64, device=send_counts.device)

    def _send_blocked(
        self, payload: list[torch.Tensor], returned_row: torch.Tensor
    ) -> tuple[_Transport, list[torch.Tensor], torch.Tensor]:
        """Fixed-size exchange of a fresh dispatch without host sync.

        Every rank sends ``T_max`` rows to every rank, with a flag byte on the rows in use; the receiver
        moves used rows to the front (source-rank-major, tokens ascending) with device-side prefix sums.
        Unused rows come out zero.

        Returns:
            The transport (for replays and combine), the received tensors in output order, and the
            number of used rows as a 0-dim device tensor.
        """
        splits = [self.spec.num_max_tokens_per_rank] * self.group_size
        transport = _Transport(splits, list(splits), send_rows=returned_row)
        flag = torch.ones((payload[0].shape[0], 1), dtype=torch.uint8, device=payload[0].device)
        received = transport.send_blocks(_pack([flag, *payload]), self.state)

        used = received[:, 0].bool()
        num_used = used.sum()
        transport.recv_positions = torch.where(
            used, torch.cumsum(used, 0) - 1, num_used + torch.cumsum(~used, 0) - 1
        )
        return transport, _unpack(transport.to_output_order(received)[:, 1:], payload), num_used

    def cached_dispatch(self, x: HiddenStates, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                        streams: Streams = SYNC) -> DispatchResult:
        plan: _RoutingPlan = handle.native
        rows, scales = split_hidden(x)
        is_fp8 = scales is not None
        data = [rows, scales] if is_fp8 else [rows]
        token = plan.send_token_index
        payload = [_take_rows(t, token) for t in data]
        if topk_weights is not None:
            payload.append(topk_weights[token])
        received = plan.transport.send(payload, self.state)
        recv_x, rest = self._unpack_recv(received, is_fp8)
        recv_weights = rest[0] if topk_weights is not None else None
        if handle.config.layout is ExpertLayout.EXPAND:
            # Zero padding always, as the DeepEP adapter asks of a cached dispatch (combine backward's gradient).
            recv_x, recv_weights = self._expand_rows(recv_x, recv_weights, plan, zero_padding=True)
            out_idx = None
        else:
            out_idx = plan.recv_local_idx
        return DispatchResult(recv_x, out_idx, recv_weights, handle)

    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                streams: Streams = SYNC) -> CombineOutput:
        plan: _RoutingPlan = handle.native
        # DeepEP accumulates in FP32 (BF16 in, one cast out); FP64 inputs keep FP64.
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        if handle.config.layout is ExpertLayout.EXPAND:
            # Each rank first reduces its own selections of a token (FP32, slot order, one cast).
            rows = _append_zero_row(x)
            partial = torch.zeros((plan.recv_local_idx.shape[0], x.shape[1]), dtype=acc_dtype, device=x.device)
            for slot in range(handle.num_topk):
                partial += rows[plan.expand_rows[:, slot]].to(acc_dtype)
            x = partial.to(x.dtype)
            if topk_weights is not None:
                topk_weights = _append_zero_row(topk_weights.unsqueeze(1)).squeeze(1)[plan.expand_rows]

        payload = [x] if topk_weights is None else [x, topk_weights]
        returned = plan.transport.send_back(payload, self.state)
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
        return CombineOutput(combined, combined_weights)

    def device_counts(self, handle: DispatchHandle) -> tuple[torch.Tensor, torch.Tensor]:
        return handle.device_counts  # set by the dispatch

    def host_counts(self, handle: DispatchHandle) -> list[int]:
        return handle.host_counts  # set by the dispatch
