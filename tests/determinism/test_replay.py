"""Bit-exact replays of the deepepv2 path: dispatcher ops and a MoELayer with deepepv2, forward and backward.

The CPU cases (reference backend over gloo) run in CI. The ElasticBuffer case (deterministic mode from the
setting and from Megatron's --deterministic-mode, replays asserted; off, reported) needs a GPU with DeepEP v2 (EP=1
on one GPU, EP2 on two or more): it launches ``tests/functional/deepep_cases.py`` under torchrun and is skipped with
the reason otherwise.
"""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from tests.determinism.harness import (
    ReplayMismatch,
    assert_replays_bit_exact,
    count_differing_replays,
    moe_layer_replay,
)
from tests.distributed import run_distributed
from tests.oracle import experts_on_compact, experts_on_expand, make_problem


def _ops_run(rank: int, world: int, layout: str, dtype: torch.dtype):
    import megatron_deepepv2 as dv2

    problem = make_problem(21, [13, 0, 9, 4][:world], 32, 8, 3, dtype=dtype)
    rows = problem.rows(rank)
    local = problem.num_experts // world

    def run() -> dict[str, torch.Tensor]:
        x = problem.x[rows].clone().requires_grad_()
        w = problem.topk_weights[rows].clone().requires_grad_()
        experts = problem.expert_weights[rank * local:(rank + 1) * local].clone().requires_grad_()
        out = dv2.dispatch(x, problem.topk_idx[rows], w, problem.num_experts, layout=layout, expert_alignment=4)
        if layout == "expand":
            y = experts_on_expand(out.recv_x, out.recv_topk_weights, out.handle.tokens_per_expert_list, experts)
        else:
            y = experts_on_compact(out.recv_x, out.recv_topk_idx, out.recv_topk_weights, experts)
        combined = dv2.combine(y, out.handle)
        (combined * problem.grad_out[rows]).sum().backward()
        return {"recv_x": out.recv_x, "output": combined, "grad_x": x.grad, "grad_probs": w.grad,
                "grad_experts": experts.grad}

    return run


def _ops_replays(rank: int, world: int, layout: str) -> None:
    assert_replays_bit_exact(_ops_run(rank, world, layout, torch.bfloat16), replays=3)


@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_dispatcher_ops_replay_bit_exact(layout: str) -> None:
    run_distributed(_ops_replays, 4, layout)


def _replay_moe_layer(rank: int, capacity_factor, extra: Optional[dict] = None):
    """Builds a deepepv2 MoELayer, asserts 3 bit-exact replays of forward + backward; returns the layer."""
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    import megatron_deepepv2 as dv2

    dv2.install()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    shape = TinyMoEConfig(hidden=32, ffn=32, num_experts=8, topk=2, capacity_factor=capacity_factor,
                          params_dtype=torch.bfloat16, extra=extra or {})
    layer = build_moe_layer(shape, "deepepv2")
    x0 = torch.randn(24, 1, shape.hidden, generator=torch.Generator().manual_seed(rank), dtype=torch.bfloat16)
    manager = layer.token_dispatcher._comm_manager
    original_dispatch = manager.dispatch
    probs_grad = {}

    def dispatch(hidden, *args):
        if manager.token_probs.requires_grad:
            manager.token_probs.register_hook(lambda g: probs_grad.__setitem__("probs", g.detach().clone()))
        return original_dispatch(hidden, *args)

    manager.dispatch = dispatch
    run = moe_layer_replay(layer, x0, extra=lambda: {"grad_probs": probs_grad["probs"]})
    result = assert_replays_bit_exact(run, replays=3)
    assert len(result) >= 5
    return layer


def _moe_layer_replays(rank: int, world: int, capacity_factor) -> None:
    _replay_moe_layer(rank, capacity_factor)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_layer_with_deepepv2_replays_bit_exact(capacity_factor) -> None:
    run_distributed(_moe_layer_replays, 2, capacity_factor, timeout=180)


def test_negative_control_catches_nondeterminism() -> None:
    """A reduction whose order comes from outside the RNG state must be reported, every time.

    The order alternates between two fixed summation orders of ``[1, 1e8, -1e8]`` by a call counter the harness
    does not restore between replays: in float32 ``(1 + 1e8) - 1e8 == 0`` but ``1 + (1e8 - 1e8) == 1``, so
    consecutive replays differ with certainty (a shuffled sum of random values may agree by chance).
    """
    values = torch.tensor([1.0, 1e8, -1e8], dtype=torch.float32)
    orders = ([0, 1, 2], [1, 2, 0])
    calls = [0]

    def unordered_sum() -> dict[str, torch.Tensor]:
        order = orders[calls[0] % 2]
        calls[0] += 1
        total = torch.zeros((), dtype=torch.float32)
        for index in order:  # one addition at a time: the order is exactly the one chosen
            total = total + values[index]
        return {"total": total}

    assert unordered_sum()["total"].item() != unordered_sum()["total"].item()  # the two orders differ
    assert count_differing_replays(unordered_sum, replays=4) == 2  # replays 1 and 3 (the other order)
    with pytest.raises(ReplayMismatch, match=r"^replay 1: total differs in 1 element\(s\) "
                                             r"\(dtype torch.float32, shape \(\)\)$"):
        assert_replays_bit_exact(unordered_sum, replays=2)
    with pytest.raises(ReplayMismatch, match=r"^replay 1: total differs in 1 element.*; "
                                             r"replay 3: total differs in 1 element"):
        assert_replays_bit_exact(unordered_sum, replays=4)


def test_harness_compares_dtype_shape_and_signed_zero() -> None:
    from tests.determinism.harness import bytes_equal

    assert not bytes_equal(torch.zeros(2), torch.zeros(2, dtype=torch.float64))
    assert not bytes_equal(torch.zeros(2), torch.zeros(1, 2))
    assert not bytes_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert bytes_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))


def _megatron_deterministic_mode(rank: int, world: int) -> None:
    """Megatron's --deterministic-mode: config.deterministic_mode plus torch's deterministic algorithms (fill on)."""
    from megatron_deepepv2 import buffers

    torch.use_deterministic_algorithms(True)
    layer = _replay_moe_layer(rank, None, extra={"deterministic_mode": True})
    assert layer.token_dispatcher._comm_manager.dispatch_config.settings.deterministic
    assert [buffer.spec.settings.deterministic for buffer in buffers.active_buffers()] == [True]
    assert torch.utils.deterministic.fill_uninitialized_memory  # the user's setting is left alone


def test_megatron_deterministic_mode_makes_deepepv2_deterministic() -> None:
    run_distributed(_megatron_deterministic_mode, 2, timeout=180)


def _no_host_sync_replays(rank: int, world: int) -> None:
    """The no-host-sync path (fixed-block transport, worst-case rows, grouped-GEMM experts) replays bit-exactly."""
    import megatron_deepepv2 as dv2
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    install_cpu_shims()
    dv2.install()
    dv2.configure(host_sync=False, num_max_tokens_per_rank=32, validate=False)
    layer = build_moe_layer(TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3), "deepepv2",
                            sync_free_experts=True)
    x0 = torch.randn([20, 7][rank], 1, 32, generator=torch.Generator().manual_seed(rank))
    assert_replays_bit_exact(moe_layer_replay(layer, x0), replays=3)


def test_no_host_sync_moe_layer_replays_bit_exact() -> None:
    run_distributed(_no_host_sync_replays, 2, timeout=180)


def _gpu_skip_reason() -> str | None:
    if torch.cuda.device_count() < 1:
        return "ElasticBuffer replays need a CUDA GPU (found none)"
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend

    return DeepEPBackend.unavailable_reason()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(_gpu_skip_reason() is not None, reason=str(_gpu_skip_reason()))
def test_elastic_buffer_moe_layer_replays_under_torchrun() -> None:
    """ElasticBuffer MoELayer replays, one rank per GPU (EP=1 on one GPU, EP2 on two or more): bit-exact with
    deterministic mode on; reported (not asserted) with it off."""
    from tests.gpu_jobs import run_gpu_job, torchrun_command

    ranks = min(2, torch.cuda.device_count())
    done = run_gpu_job(torchrun_command("tests/functional/deepep_cases.py",
                                        "moe_layer_replays_bit_exact_in_deterministic_mode", nproc=ranks),
                       timeout=580, gpus=ranks)
    assert done.returncode == 0 and "PASS moe_layer_replays" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
