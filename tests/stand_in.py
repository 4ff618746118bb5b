"""A dense oracle of DeepEP's exchange, for the stand-ins of ``deep_ep``'s buffers in CPU tests.

:class:`DenseExchange` computes what DeepEP's dispatch, cached dispatch and combine return on this rank from every
rank's inputs, gathered whole (``all_gather_object``), with plain Python loops over tokens and slots: received rows
in (source rank, token) order, expand blocks per local expert padded to the alignment, and combine sums in FP32.
It shares no code with the package's backends, so a stand-in built on it checks the adapter against an independent
computation, not against the reference backend. Its receive order is DeepEP's deterministic order; a stand-in
scrambles it where DeepEP's order is its own, and uses :meth:`DenseExchange.gather_inputs` and
:meth:`DenseExchange.sum_at_sources` to place and reduce rows by its own handle's metadata.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.layout import ExpertLayout, worst_case_recv_rows


def _gather(value: Any, group) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


_FP8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)}


def _tensors(x) -> list[tuple[torch.Tensor, torch.dtype]]:
    """The tensors of x (an FP8 pair too), FP8 as bytes: pickling FP8 storages is not supported."""
    return [(t.view(torch.uint8) if t.dtype in _FP8 else t, t.dtype) for t in (x if isinstance(x, tuple) else (x,))]


def _untensors(parts: list[tuple[torch.Tensor, torch.dtype]]) -> list[torch.Tensor]:
    return [t.view(dtype) if dtype in _FP8 else t for t, dtype in parts]


@dataclass
class DensePlan:
    """One dispatch's routing on this rank, enough to replay and reverse it.

    Attributes:
        rows: Compact receive rows as (source rank, token), in order.
        expand_rows: Expand receive rows as (source rank, token, slot), None on padding rows.
        local_idx: ``[len(rows), K]`` local expert ids, -1 where the slot's expert is elsewhere.
        aligned_counts: Alignment-padded rows per local expert.
        real_counts: Selections per local expert.
        num_recv_rows: Rows of the outputs (the worst case without CPU sync).
        expand: Whether the layout is expand.
        num_tokens: Tokens this rank dispatched.
        num_topk: Top-k.
    """

    rows: list[tuple[int, int]]
    expand_rows: list[Optional[tuple[int, int, int]]]
    local_idx: torch.Tensor
    aligned_counts: list[int]
    real_counts: list[int]
    num_recv_rows: int
    expand: bool
    num_tokens: int
    num_topk: int


class DenseExchange:
    """Dense dispatch / combine over a process group (see the module docstring).

    Args:
        group: The expert-parallel group.
        num_max_tokens_per_rank: The buffer's token capacity (sizes the outputs without CPU sync).
    """

    def __init__(self, group, num_max_tokens_per_rank: int) -> None:
        self.group = group
        self.capacity = num_max_tokens_per_rank
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def _plan(self, all_idx: list[torch.Tensor], num_experts: int, expand: bool, alignment: int,
              cpu_sync: bool) -> DensePlan:
        per_rank = num_experts // self.world
        first = self.rank * per_rank
        rows = [(src, t) for src, idx in enumerate(all_idx) for t in range(idx.shape[0])
                if any(first <= e < first + per_rank for e in idx[t].tolist())]
        num_topk = all_idx[self.rank].shape[1]
        local_idx = torch.full((len(rows), num_topk), -1, dtype=torch.int64)
        for i, (src, t) in enumerate(rows):
            for k, e in enumerate(all_idx[src][t].tolist()):
                if first <= e < first + per_rank:
                    local_idx[i, k] = e - first
        real = [int((local_idx == e).sum()) for e in range(per_rank)]
        aligned = [-(-c // alignment) * alignment for c in real]
        expand_rows: list[Optional[tuple[int, int, int]]] = []
        for e in range(per_rank):
            block = [(src, t, k) for i, (src, t) in enumerate(rows) for k in range(num_topk) if local_idx[i, k] == e]
            expand_rows += block + [None] * (aligned[e] - len(block))
        if cpu_sync:
            num_recv_rows = len(expand_rows) if expand else len(rows)
        else:
            num_recv_rows = worst_case_recv_rows(ExpertLayout.EXPAND if expand else ExpertLayout.COMPACT,
                                                 group_size=self.world, num_max_tokens_per_rank=self.capacity,
                                                 num_topk=num_topk, num_local_experts=per_rank,
                                                 expert_alignment=alignment)
        return DensePlan(rows, expand_rows, local_idx, aligned, real, num_recv_rows, expand,
                         all_idx[self.rank].shape[0], num_topk)

    def _place(self, plan: DensePlan, all_x: list[list[torch.Tensor]], all_w: Optional[list[torch.Tensor]]):
        """Received rows (per tensor of x) and weights in the plan's layout, zero past the valid rows."""
        outs = []
        for part in range(len(all_x[self.rank])):
            like = all_x[self.rank][part]
            as_bytes = like.dtype in _FP8  # row copies of FP8 go through bytes
            out = torch.zeros((plan.num_recv_rows, *like.shape[1:]), dtype=torch.uint8 if as_bytes else like.dtype)
            sources = plan.expand_rows if plan.expand else plan.rows
            for i, source in enumerate(sources):
                if source is not None:
                    row = all_x[source[0]][part][source[1]]
                    out[i] = row.view(torch.uint8) if as_bytes else row
            outs.append(out.view(like.dtype) if as_bytes else out)
        weights = None
        if all_w is not None:
            if plan.expand:
                weights = torch.zeros(plan.num_recv_rows, dtype=torch.float32)
                for i, source in enumerate(plan.expand_rows):
                    if source is not None:
                        weights[i] = all_w[source[0]][source[1], source[2]]
            else:
                weights = torch.zeros((plan.num_recv_rows, plan.num_topk), dtype=torch.float32)
                for i, (src, t) in enumerate(plan.rows):
                    weights[i] = all_w[src][t]
        return outs, weights

    def gather_inputs(self, x, topk_weights: Optional[torch.Tensor]):
        """Every rank's rows and weights: ``(all_x, all_w)``, ``all_x[rank]`` the list of x's tensors (one, or the
        two of an FP8 pair), ``all_w`` None without weights. Collective."""
        gathered = _gather((_tensors(x), topk_weights), self.group)
        all_w = [g[1] for g in gathered] if topk_weights is not None else None
        return [_untensors(g[0]) for g in gathered], all_w

    def dispatch(self, x, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], *, num_experts: int,
                 expand: bool, alignment: int, cpu_sync: bool):
        """Fresh dispatch: returns ``(recv_x, recv_local_idx or None, recv_weights, plan)``."""
        gathered = _gather((_tensors(x), topk_idx, topk_weights), self.group)
        all_x, all_idx = [_untensors(g[0]) for g in gathered], [g[1] for g in gathered]
        all_w = [g[2] for g in gathered] if topk_weights is not None else None
        plan = self._plan(all_idx, num_experts, expand, alignment, cpu_sync)
        outs, weights = self._place(plan, all_x, all_w)
        recv_idx = None
        if not expand:
            recv_idx = torch.full((plan.num_recv_rows, plan.num_topk), -1, dtype=torch.int64)
            recv_idx[:len(plan.rows)] = plan.local_idx
        return (tuple(outs) if isinstance(x, tuple) else outs[0]), recv_idx, weights, plan

    def cached_dispatch(self, x, plan: DensePlan, topk_weights: Optional[torch.Tensor]):
        """Replays ``plan`` with new rows: returns ``(recv_x, recv_weights)``."""
        outs, weights = self._place(plan, *self.gather_inputs(x, topk_weights))
        return (tuple(outs) if isinstance(x, tuple) else outs[0]), weights

    def combine(self, x: torch.Tensor, plan: DensePlan, topk_weights: Optional[torch.Tensor]):
        """Sums each token's rows back on its source rank: returns ``(combined [T, H], weights [T, K] or None)``."""
        acc = torch.promote_types(x.dtype, torch.float32)
        # This rank's contribution per (source rank, token): its selections' rows summed (expand), or its row.
        partial: dict[tuple[int, int], torch.Tensor] = {}
        slot_weight: dict[tuple[int, int, int], float] = {}
        if plan.expand:
            for i, source in enumerate(plan.expand_rows):
                if source is None:
                    continue
                src, t, k = source
                partial[(src, t)] = partial.get((src, t), torch.zeros(x.shape[1], dtype=acc)) + x[i].to(acc)
                if topk_weights is not None:
                    slot_weight[(src, t, k)] = float(topk_weights[i])
            partial = {key: value.to(x.dtype) for key, value in partial.items()}
        else:
            for i, (src, t) in enumerate(plan.rows):
                partial[(src, t)] = x[i]
                if topk_weights is not None:
                    for k in range(plan.num_topk):
                        if plan.local_idx[i, k] >= 0:
                            slot_weight[(src, t, k)] = float(topk_weights[i, k])
        return self.sum_at_sources(partial, slot_weight if topk_weights is not None else None, plan.num_tokens,
                                   plan.num_topk, x)

    def sum_at_sources(self, partial: dict[tuple[int, int], torch.Tensor],
                       slot_weight: Optional[dict[tuple[int, int, int], float]], num_tokens: int, num_topk: int,
                       like: torch.Tensor):
        """Sends each rank's per-token contributions home and sums them there (collective).

        Args:
            partial: This rank's contribution to each (source rank, token), in ``like``'s dtype.
            slot_weight: The weight this rank holds for each (source rank, token, slot), or None without weights.
            num_tokens, num_topk: This rank's dispatch input shape.
            like: The combine input (its dtype and width).

        Returns:
            ``(combined [num_tokens, H] in like's dtype, weights [num_tokens, K] fp32 or None)``; the sum runs in FP32
            or wider, in rank order.
        """
        acc = torch.promote_types(like.dtype, torch.float32)
        gathered = _gather((partial, slot_weight or {}), self.group)
        combined = torch.zeros((num_tokens, like.shape[1]), dtype=acc)
        weights = torch.zeros((num_tokens, num_topk), dtype=torch.float32) if slot_weight is not None else None
        for rank_partial, rank_weights in gathered:
            for (src, t), row in rank_partial.items():
                if src == self.rank:
                    combined[t] += row.to(acc)
            for (src, t, k), value in rank_weights.items():
                if src == self.rank and weights is not None:
                    weights[t, k] = value
        return combined.to(like.dtype), weights
