"""Independent oracle for dispatch/combine tests: a dense, single-process MoE computation.

A test builds one global problem (every rank's tokens, routing and the expert weights) from a seed, so
each rank can compute its slice through the distributed path and compare it with the dense result of the
whole problem computed locally by plain autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class MoEProblem:
    """A routed MoE problem over several ranks.

    Attributes:
        tokens_per_rank: Tokens each rank dispatches (zeros allowed).
        x: ``[sum T, H]`` hidden states of all ranks, rank-major.
        topk_idx: ``[sum T, K]`` int64 expert ids with -1 for dropped selections.
        topk_weights: ``[sum T, K]`` weights (random also where the id is -1).
        expert_weights: ``[E, H, H]`` one linear map per expert.
        grad_out: ``[sum T, H]`` fixed upstream gradient.
    """

    tokens_per_rank: list[int]
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    expert_weights: torch.Tensor
    grad_out: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.expert_weights.shape[0]

    def rows(self, rank: int) -> slice:
        """Rows of ``rank``'s tokens in the global tensors."""
        start = sum(self.tokens_per_rank[:rank])
        return slice(start, start + self.tokens_per_rank[rank])


def make_problem(
    seed: int,
    tokens_per_rank: list[int],
    hidden: int,
    num_experts: int,
    topk: int,
    drop_fraction: float = 0.2,
    dtype: torch.dtype = torch.float64,
) -> MoEProblem:
    """Builds a reproducible problem; every rank calling it with the same arguments gets the same tensors.

    Args:
        seed: RNG seed.
        tokens_per_rank: Token count of each rank.
        hidden: Hidden size.
        num_experts: Global expert count.
        topk: Selections per token (distinct experts).
        drop_fraction: Fraction of selections replaced by -1; the first token of each non-empty rank
            other than rank 0 drops all of its selections.
        dtype: Floating dtype of activations and weights.

    Returns:
        The problem.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    x = torch.randn(total, hidden, generator=gen, dtype=torch.float64).to(dtype)
    topk_idx = torch.rand(total, num_experts, generator=gen).argsort(dim=1)[:, :topk].contiguous()
    dropped = torch.rand(total, topk, generator=gen) < drop_fraction
    start = 0
    for rank, count in enumerate(tokens_per_rank):
        if rank > 0 and count > 0:
            dropped[start] = True
        start += count
    topk_idx = topk_idx.masked_fill(dropped, -1)
    topk_weights = torch.rand(total, topk, generator=gen, dtype=torch.float64).float()
    expert_weights = (torch.randn(num_experts, hidden, hidden, generator=gen, dtype=torch.float64) / hidden**0.5).to(dtype)
    grad_out = torch.randn(total, hidden, generator=gen, dtype=torch.float64).to(dtype)
    return MoEProblem(tokens_per_rank, x, topk_idx, topk_weights, expert_weights, grad_out)


def dense_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_weights: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_k [idx >= 0] w[t, k] * x[t] @ W[idx[t, k]]``, by plain autograd-friendly ops."""
    valid = (topk_idx >= 0).to(x.dtype)
    selected = expert_weights[topk_idx.clamp(min=0)]  # [T, K, H, H]
    per_slot = torch.einsum("th,tkhj->tkj", x, selected)
    return torch.einsum("tkj,tk->tj", per_slot, topk_weights.to(x.dtype) * valid)


def experts_on_compact(recv_x: torch.Tensor, recv_idx: torch.Tensor, recv_weights: torch.Tensor, local_weights: torch.Tensor) -> torch.Tensor:
    """Per-rank partial sums for the compact layout: each row sums its local experts' weighted outputs."""
    out = torch.zeros_like(recv_x)
    for expert in range(local_weights.shape[0]):
        gate = (recv_idx == expert).to(recv_x.dtype) * recv_weights.to(recv_x.dtype)
        out = out + gate.sum(dim=1, keepdim=True) * (recv_x @ local_weights[expert])
    return out


def experts_on_expand(recv_x: torch.Tensor, recv_weights: torch.Tensor, tokens_per_expert: list[int], local_weights: torch.Tensor) -> torch.Tensor:
    """Expand layout: row blocks per local expert, each row scaled by its own weight."""
    blocks = torch.split(recv_x, tokens_per_expert)
    weights = torch.split(recv_weights.to(recv_x.dtype), tokens_per_expert)
    outs = [(b @ local_weights[e]) * w.unsqueeze(1) for e, (b, w) in enumerate(zip(blocks, weights))]
    return torch.cat(outs, dim=0) if outs else recv_x.new_zeros((0, recv_x.shape[1]))


class DenseResult(NamedTuple):
    """The dense oracle's output and gradients for a whole problem (every rank's tokens)."""

    y: torch.Tensor
    x_grad: torch.Tensor
    weights_grad: torch.Tensor
    experts_grad: torch.Tensor


def dense_step(problem: MoEProblem) -> DenseResult:
    """:func:`dense_moe` forward and backward against ``problem.grad_out``, on fresh copies of its tensors."""
    x = problem.x.clone().requires_grad_()
    weights = problem.topk_weights.clone().requires_grad_()
    experts = problem.expert_weights.clone().requires_grad_()
    y = dense_moe(x, problem.topk_idx, weights, experts)
    (y * problem.grad_out).sum().backward()
    return DenseResult(y.detach(), x.grad, weights.grad, experts.grad)


def fp8_round_trip(x: torch.Tensor) -> torch.Tensor:
    """What FP8 dispatch hands the experts for BF16 rows ``x``, block by block: e4m3 with scale amax / 448 per 128
    values (amax floored at 1e-4), multiplied back, rounded to ``x``'s dtype."""
    out = torch.empty_like(x)
    for start in range(0, x.shape[1], 128):
        block = x[:, start:start + 128].float()
        scale = block.abs().max(dim=1, keepdim=True).values.clamp(min=1e-4) / 448.0
        out[:, start:start + 128] = ((block / scale).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)
    return out
