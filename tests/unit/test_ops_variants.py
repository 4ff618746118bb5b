"""The communication-ordering flags of the autograd ops: passed through as asked, and results unchanged.

Runs through the DeepEP adapter over the strict stand-in (``tests/deepep_stand_in.py``), which records the
flags of every call and enforces DeepEP's rules about them (a previous event only with ``allocate_on_comm_stream``,
events waited only in async mode), so each variant really takes its own path; every variant's results are checked
against the dense oracle.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed
from tests.oracle import dense_step, experts_on_expand, make_problem


def _run_once(problem, rank: int, world: int, **flags):
    rows = problem.rows(rank)
    local = problem.num_experts // world
    x = problem.x[rows].clone().requires_grad_()
    w = problem.topk_weights[rows].to(torch.float64).clone().requires_grad_()  # cast to fp32 by the op
    out = dv2.dispatch(x, problem.topk_idx[rows], w, problem.num_experts, layout="expand", expert_alignment=8, backend="deepep", **flags)
    y = experts_on_expand(out.recv_x, out.recv_topk_weights, out.handle.tokens_per_expert_list,
                          problem.expert_weights[rank * local:(rank + 1) * local])
    y = dv2.combine(y, out.handle, **flags)
    (y * problem.grad_out[rows]).sum().backward()
    assert w.grad.dtype == torch.float64  # autograd casts the fp32 weight gradient back
    return y.detach(), x.grad, w.grad


def _variants(rank: int, world: int, line: str) -> None:
    from tests.deepep_stand_in import STAND_INS, use_stand_in_backend

    use_stand_in_backend(line)
    stand_in = STAND_INS[line][1]
    dv2.configure(validate=False)
    problem = make_problem(11, [5, 7, 0, 4][:world], 8, 8, 2)
    rows = problem.rows(rank)
    dense = dense_step(problem)
    for async_finish, allocate in itertools.product([False, True], repeat=2):
        stand_in.calls.clear()
        y, x_grad, w_grad = _run_once(problem, rank, world, async_finish=async_finish, allocate_on_comm_stream=allocate)
        calls = stand_in.calls
        assert {c["op"] for c in calls} == {"dispatch", "combine"} and len(calls) == 4  # forward and backward
        # Outputs go on the communication stream only in async mode, the one where DeepEP records them on the
        # compute stream; a previous event goes only with them.
        on_comm_stream = allocate and async_finish
        assert all(c["async_"] is async_finish and c["alloc"] is on_comm_stream for c in calls), calls
        assert all(c["prev"] == ("event-handle" if on_comm_stream else None) for c in calls), calls
        tag = f"async={async_finish} allocate_on_comm_stream={allocate}"
        torch.testing.assert_close(y, dense.y[rows], rtol=1e-10, atol=1e-10, msg=tag)
        torch.testing.assert_close(x_grad, dense.x_grad[rows], rtol=1e-10, atol=1e-10, msg=tag)
        torch.testing.assert_close(w_grad, dense.weights_grad[rows].double(), rtol=1e-5, atol=1e-5, msg=tag)


@pytest.mark.parametrize("line", ["2.1", "V2.5"])
def test_async_and_comm_stream_flags_reach_deepep_and_change_no_result(line: str) -> None:
    run_distributed(_variants, 4, line, env={"LOCAL_WORLD_SIZE": "4"})
