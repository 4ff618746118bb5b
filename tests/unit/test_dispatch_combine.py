"""Dispatch -> per-expert compute -> combine against the dense oracle, forward and backward.

Every case runs on 2 and 4 gloo ranks with uneven token counts (one rank has none), dropped (-1)
selections and a token with no selection at all, for both layouts and alignments 1, 16 and 128.
"""

from __future__ import annotations

import pytest
import torch

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed
from tests.oracle import dense_step, experts_on_compact, experts_on_expand, make_problem

TOKENS = {2: [9, 0], 4: [7, 0, 12, 3]}
HIDDEN, EXPERTS, TOPK = 16, 8, 3


def _roundtrip(rank: int, world: int, layout: str, alignments: list[int], dtype: torch.dtype) -> dict:
    tol = {torch.float64: 1e-12, torch.float32: 1e-5}[dtype]
    local_experts = EXPERTS // world
    report = {}
    for seed, alignment in enumerate(alignments):
        problem = make_problem(seed, TOKENS[world], HIDDEN, EXPERTS, TOPK, dtype=dtype)
        rows = problem.rows(rank)
        x = problem.x[rows].clone().requires_grad_()
        w = problem.topk_weights[rows].clone().requires_grad_()
        idx = problem.topk_idx[rows].clone()
        mine = slice(rank * local_experts, (rank + 1) * local_experts)
        local_w = problem.expert_weights[mine].clone().requires_grad_()

        result = dv2.dispatch(x, idx, w, EXPERTS, layout=layout, expert_alignment=alignment)
        counts = result.handle.tokens_per_expert_list
        # Oracle: every token of every rank that selected each local expert, padded to the alignment.
        selected = [int((problem.topk_idx == expert).sum()) for expert in range(mine.start, mine.stop)]
        assert counts == [-(-c // alignment) * alignment for c in selected], (counts, selected)
        if layout == "expand":
            assert result.recv_x.shape[0] == sum(counts)
        else:  # one row per received token: those with a selection on this rank, from every rank
            on_rank = ((problem.topk_idx >= mine.start) & (problem.topk_idx < mine.stop)).any(dim=1)
            assert result.recv_x.shape[0] == int(on_rank.sum())
        assert result.tokens_per_expert.tolist() == counts
        if layout == "expand":
            expert_out = experts_on_expand(result.recv_x, result.recv_topk_weights, counts, local_w)
        else:
            expert_out = experts_on_compact(result.recv_x, result.recv_topk_idx, result.recv_topk_weights, local_w)
        y = dv2.combine(expert_out, result.handle)
        (y * problem.grad_out[rows]).sum().backward()

        dense = dense_step(problem)
        torch.testing.assert_close(y, dense.y[rows], rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad, dense.x_grad[rows], rtol=tol, atol=tol)
        torch.testing.assert_close(w.grad, dense.weights_grad[rows], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(local_w.grad, dense.experts_grad[mine], rtol=tol, atol=tol)
        report[alignment] = result.recv_x.shape[0]
    return report


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_roundtrip_matches_dense_oracle(world: int, layout: str) -> None:
    reports = run_distributed(_roundtrip, world, layout, [1, 16, 128], torch.float64)
    if layout == "expand":
        # Larger alignment never shrinks the expanded row count.
        for report in reports:
            assert report[1] <= report[16] <= report[128]


def test_roundtrip_float32_two_ranks() -> None:
    run_distributed(_roundtrip, 2, "expand", [16], torch.float32)


def _config_case(rank: int, world: int) -> None:
    problem = make_problem(5, TOKENS[world], HIDDEN, EXPERTS, TOPK, dtype=torch.float64)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    masked = dv2.dispatch(x, idx, w, EXPERTS)
    config = dv2.resolve_config(mask_foreign_weights=False)
    raw = dv2.dispatch(x, idx, w, EXPERTS, config=config)
    foreign = raw.recv_topk_idx < 0
    # Same rows; the foreign entries keep the weights as sent (the oracle: the sender's weights of those tokens).
    assert torch.equal(raw.recv_x, masked.recv_x) and torch.equal(raw.recv_topk_idx, masked.recv_topk_idx)
    assert torch.equal(masked.recv_topk_weights[foreign], torch.zeros_like(masked.recv_topk_weights[foreign]))
    assert torch.equal(raw.recv_topk_weights[~foreign], masked.recv_topk_weights[~foreign])
    if rank == 0 and rows.stop > rows.start:
        on_rank0 = ((idx >= 0) & (idx // (EXPERTS // world) == 0)).any(dim=1)
        sent = w[on_rank0]  # rank 0 receives its own tokens first, in order
        assert torch.equal(raw.recv_topk_weights[: sent.shape[0]], sent)
    with pytest.raises(TypeError, match="either config= or"):
        dv2.dispatch(x, idx, w, EXPERTS, config=config, layout="expand")


def test_dispatch_config_resolved_once_and_foreign_weight_mask_optional() -> None:
    run_distributed(_config_case, 2)


def test_dispatch_config_runs_the_backend_mode_checks_when_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from tests.deepep_stand_in import EPHandle, handle_stand_in, install_deep_ep_with_handle

    handle_without_metadata = handle_stand_in(
        "HandleWithoutMetadata", doc="A DeepEP whose handle sorts but keeps none of what the sync-free order reads.")

    # The mode check needs no process group: it fails when the configuration is made, before any dispatch.
    install_deep_ep_with_handle(monkeypatch, handle_without_metadata)
    refused = ("Deterministic mode without host sync is not available on the deepep backend as installed: "
               ".*recv_src_metadata")
    with pytest.raises(ValueError, match=refused):
        dv2.resolve_config(backend=DeepEPBackend, host_sync=False, deterministic=True)
    assert dv2.resolve_config(backend=DeepEPBackend, host_sync=True, deterministic=True).settings.deterministic
    assert dv2.resolve_config(backend=DeepEPBackend, host_sync=False).host_sync is False
    assert dv2.resolve_config(backend="reference", host_sync=False, deterministic=True).settings.deterministic
    monkeypatch.setattr(DeepEPBackend, "unavailable_reason", classmethod(lambda cls: None))
    with pytest.raises(ValueError, match=refused):  # by name too
        dv2.resolve_config(backend="deepep", host_sync=False, deterministic=True)
    install_deep_ep_with_handle(monkeypatch, EPHandle)  # a handle with everything: accepted
    assert not dv2.resolve_config(backend="deepep", host_sync=False, deterministic=True).host_sync


def test_padding_follows_the_alignment_and_a_configuration_is_checked_when_built() -> None:
    """Padding rows exist (and are zero) exactly when expand blocks are aligned past 1; the removed zero_padding
    argument is refused saying so; a configuration built directly is checked at construction, as a resolved one."""
    from megatron_deepepv2.backends.base import DispatchConfig
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.layout import ExpertLayout

    assert not dv2.resolve_config(backend="reference", layout="expand", expert_alignment=1).padded
    assert dv2.resolve_config(backend="reference", layout="expand", expert_alignment=4).padded
    assert not dv2.resolve_config(backend="reference", layout="compact", expert_alignment=4).padded
    assert DispatchConfig(ReferenceBackend, layout=ExpertLayout.EXPAND, expert_alignment=4).padded
    with pytest.raises(TypeError, match="zero_padding: the expand layout's padding rows are always zero"):
        dv2.resolve_config(backend="reference", layout="expand", expert_alignment=4, zero_padding=False)
    for alignment in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=f"expert_alignment={alignment!r} must be an integer >= 1"):
            DispatchConfig(ReferenceBackend, expert_alignment=alignment)
        with pytest.raises(ValueError, match=f"expert_alignment={alignment!r} must be an integer >= 1"):
            dv2.resolve_config(backend="reference", expert_alignment=alignment)
