"""The communication-ordering flags of the autograd ops change nothing in the results."""

from __future__ import annotations

import itertools

import torch

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed
from tests.oracle import experts_on_expand, make_problem


def _run_once(problem, rank: int, world: int, **flags):
    rows = problem.rows(rank)
    local = problem.num_experts // world
    x = problem.x[rows].clone().requires_grad_()
    w = problem.topk_weights[rows].to(torch.float64).clone().requires_grad_()  # cast to fp32 by the op
    out = dv2.dispatch(x, problem.topk_idx[rows], w, problem.num_experts, layout="expand", expert_alignment=8, **flags)
    y = experts_on_expand(out.recv_x, out.recv_topk_weights, out.handle.tokens_per_expert_list,
                          problem.expert_weights[rank * local:(rank + 1) * local])
    y = dv2.combine(y, out.handle, **flags)
    (y * problem.grad_out[rows]).sum().backward()
    assert w.grad.dtype == torch.float64  # autograd casts the fp32 weight gradient back
    return y.detach(), x.grad, w.grad


def _variants(rank: int, world: int) -> None:
    problem = make_problem(11, [5, 7, 0, 4][:world], 8, 8, 2)
    baseline = _run_once(problem, rank, world)
    for async_finish, allocate in itertools.product([False, True], repeat=2):
        again = _run_once(problem, rank, world, async_finish=async_finish, allocate_on_comm_stream=allocate)
        for a, b in zip(baseline, again):
            assert torch.equal(a, b)


def test_async_and_comm_stream_flags_give_identical_results() -> None:
    run_distributed(_variants, 4)
