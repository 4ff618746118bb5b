"""Several micro-batches in flight: forwards first, then backwards in 1F1B and in reverse order.

The batches differ in length, so the buffer's capacity grows (a rebuild) while earlier micro-batches still wait
for their backward. Every result is checked against the dense single-process oracle, on the reference backend and
on the DeepEP adapter over a stand-in whose ``destroy()`` frees the buffer (as ``ElasticBuffer``'s does): a buffer
destroyed under a pending backward fails loudly there. Afterwards the superseded buffers are released, on every rank.
"""

from __future__ import annotations

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2 import buffers
from tests.distributed import run_distributed
from tests.oracle import dense_step, experts_on_compact, experts_on_expand, make_problem

HIDDEN, EXPERTS, TOPK = 16, 8, 3
#: Tokens per rank of each micro-batch: capacity 8, then 32 (a rebuild), then 64 (another).
MICRO_BATCHES = [[8, 6], [20, 24], [5, 0], [40, 33]]  # both ranks exceed together (as Megatron's do)


def _use_backend(name: str) -> None:
    if name == "deepep":
        from tests.deepep_stand_in import use_stand_in_backend

        use_stand_in_backend()
    dv2.configure(backend=name, validate=False)


def _in_flight(rank: int, world: int, backend: str, layout: str, order: str) -> dict:
    _use_backend(backend)
    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    steps = []
    for seed, tokens in enumerate(MICRO_BATCHES):
        problem = make_problem(100 + seed, tokens, HIDDEN, EXPERTS, TOPK)
        rows = problem.rows(rank)
        x = problem.x[rows].clone().requires_grad_()
        w = problem.topk_weights[rows].clone().requires_grad_()
        experts = problem.expert_weights[mine].clone().requires_grad_()
        out = dv2.dispatch(x, problem.topk_idx[rows], w, EXPERTS, layout=layout, expert_alignment=4)
        if layout == "expand":
            expert_out = experts_on_expand(out.recv_x, out.recv_topk_weights, out.handle.tokens_per_expert_list,
                                           experts)
        else:
            expert_out = experts_on_compact(out.recv_x, out.recv_topk_idx, out.recv_topk_weights, experts)
        y = dv2.combine(expert_out, out.handle)
        steps.append((problem, rows, x, w, experts, y))
        del out, expert_out
    capacities = sorted({b.spec.num_max_tokens_per_rank for b in buffers.active_buffers() + buffers.retired_buffers()})
    retired_while_pending = len(buffers.retired_buffers())

    for index in (range(len(steps)) if order == "1f1b" else reversed(range(len(steps)))):
        problem, rows, x, w, experts, y = steps[index]
        (y * problem.grad_out[rows]).sum().backward()
        dense = dense_step(problem)
        tag = f"micro-batch {index}"
        torch.testing.assert_close(y, dense.y[rows], rtol=1e-10, atol=1e-10, msg=tag)
        torch.testing.assert_close(x.grad, dense.x_grad[rows], rtol=1e-10, atol=1e-10, msg=tag)
        torch.testing.assert_close(w.grad, dense.weights_grad[rows], rtol=1e-5, atol=1e-5, msg=tag)
        torch.testing.assert_close(experts.grad, dense.experts_grad[mine], rtol=1e-10, atol=1e-10, msg=tag)
    stand_ins = [getattr(b, "ep_buffer", None) for b in buffers.retired_buffers()]  # the ElasticBuffer stand-ins
    del steps, problem, rows, x, w, experts, y  # the step is over: nothing refers to the handles any more
    # Nothing is released per call: the retired buffers wait for the next build on the group (here a layer of
    # another hidden size), which releases them collectively.
    probe = make_problem(7, [2, 2], HIDDEN, EXPERTS, TOPK)
    dv2.dispatch(probe.x[probe.rows(rank)], probe.topk_idx[probe.rows(rank)], None, EXPERTS)
    assert len(buffers.retired_buffers()) == retired_while_pending
    probe = make_problem(7, [2, 2], 2 * HIDDEN, EXPERTS, TOPK)
    dv2.dispatch(probe.x[probe.rows(rank)], probe.topk_idx[probe.rows(rank)], None, EXPERTS)
    released = [getattr(fake, "destroyed", None) for fake in stand_ins]
    return {
        "capacities": capacities,
        "retired_while_pending": retired_while_pending,
        "retired_after": len(buffers.retired_buffers()),
        "active": len(buffers.active_buffers()),
        "released_stand_ins": released,
    }


@pytest.mark.parametrize("backend", ["reference", "deepep"])
@pytest.mark.parametrize("layout", ["compact", "expand"])
@pytest.mark.parametrize("order", ["1f1b", "reverse"])
def test_micro_batches_in_flight_through_rebuilds(backend: str, layout: str, order: str) -> None:
    for report in run_distributed(_in_flight, 2, backend, layout, order, env={"LOCAL_WORLD_SIZE": "2"}):
        assert report["capacities"] == [8, 32, 64], report  # two rebuilds while backwards were pending
        assert report["retired_while_pending"] == 2, report
        assert report["retired_after"] == 0 and report["active"] == 2, report
        if backend == "deepep":
            assert report["released_stand_ins"] == [True, True], report  # destroyed once unused


def _layers_with_two_keys(rank: int, world: int) -> dict:
    """Two shape keys alternate (two MoE layers of different hidden sizes): neither rebuilds the other's buffer."""
    _use_backend("deepep")
    stats = buffers.buffer_stats()
    for step in range(6):
        for hidden in (16, 32):
            problem = make_problem(step, [4, 4], hidden, EXPERTS, TOPK)
            rows = problem.rows(rank)
            dv2.dispatch(problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows], EXPERTS)
    return {"builds": stats.builds, "active": len(buffers.active_buffers())}


def test_layers_with_different_keys_keep_their_own_buffers() -> None:
    for report in run_distributed(_layers_with_two_keys, 2, env={"LOCAL_WORLD_SIZE": "2"}):
        assert report == {"builds": 2, "active": 2}, report


def _moe_layer_in_flight(rank: int, world: int) -> None:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    install_cpu_shims()
    dv2.install()
    _use_backend("deepep")  # a stand-in that frees on destroy: a buffer destroyed under a pending backward fails
    shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3)
    reference = build_moe_layer(shape, "alltoall")
    layer = build_moe_layer(shape, "deepepv2")
    layer.load_state_dict(reference.state_dict())

    def two_in_flight(module) -> list:
        """Forward micro-batch A (8 tokens), forward B (20: the buffer grows), backward A, backward B."""
        steps = []
        module.zero_grad()
        for tokens, seed in ((8, 1), (20, 2)):
            x = torch.randn(tokens, 1, 32, generator=torch.Generator().manual_seed(seed * 10 + rank)).requires_grad_()
            grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed * 10 + 5 + rank))
            steps.append((x, module(x)[0], grad))
        for x, y, grad in steps:
            (y * grad).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        return [(y.detach(), x.grad) for x, y, _ in steps], grads

    expected, expected_grads = two_in_flight(reference)
    actual, actual_grads = two_in_flight(layer)
    for (y, gx), (want_y, want_gx) in zip(actual, expected):
        torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, want_gx, rtol=1e-5, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert buffers.buffer_stats().rebuilds == 1


def test_moe_layer_with_two_micro_batches_in_flight_matches_alltoall() -> None:
    run_distributed(_moe_layer_in_flight, 2, timeout=180, env={"LOCAL_WORLD_SIZE": "2"})


def _retained_graph(rank: int, world: int) -> None:
    """A backward with retain_graph=True can run again (the handle stays with the graph until it is freed)."""
    _use_backend("reference")
    problem = make_problem(3, [6, 4], HIDDEN, EXPERTS, TOPK)
    rows = problem.rows(rank)
    x = problem.x[rows].clone().requires_grad_()
    out = dv2.dispatch(x, problem.topk_idx[rows], problem.topk_weights[rows], EXPERTS)
    y = dv2.combine(out.recv_x * 2, out.handle)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * first)


def test_backward_with_retained_graph_runs_twice() -> None:
    run_distributed(_retained_graph, 2)
