"""Receive-layout details of the reference backend: ordering, padding, cached dispatch, FP8 pairs.

The expected layouts are built independently here from the global problem with plain Python loops
(test code only), following DeepEP v2's contract with ``deterministic=True``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_deepepv2 as dv2
from megatron_deepepv2.backends.base import DispatchConfig
from megatron_deepepv2.backends.reference import ReferenceBackend
from tests.distributed import run_distributed
from tests.oracle import make_problem

HIDDEN, EXPERTS, TOPK = 8, 8, 3
TOKENS = [6, 0, 5, 4]


def _expected_compact(problem, rank: int, world: int):
    """Rows (source-rank-major, token order) that ``rank`` must receive, with local ids."""
    local = EXPERTS // world
    rows, ids, weights = [], [], []
    for src in range(world):
        for t in range(problem.rows(src).start, problem.rows(src).stop):
            idx = problem.topk_idx[t]
            if ((idx >= 0) & (idx // local == rank)).any():
                rows.append(problem.x[t])
                ids.append(torch.where((idx >= 0) & (idx // local == rank), idx - rank * local, -1))
                weights.append(problem.topk_weights[t])
    return rows, ids, weights


def _compact_worker(rank: int, world: int) -> None:
    problem = make_problem(3, TOKENS[:world], HIDDEN, EXPERTS, TOPK)
    mine = problem.rows(rank)
    result = dv2.dispatch(problem.x[mine], problem.topk_idx[mine], problem.topk_weights[mine], EXPERTS)
    rows, ids, weights = _expected_compact(problem, rank, world)
    assert result.recv_x.shape[0] == len(rows)
    if rows:
        assert torch.equal(result.recv_x, torch.stack(rows))
        assert torch.equal(result.recv_topk_idx, torch.stack(ids))
        # The op zeroes weights of other ranks' experts (their gradient is then exactly zero).
        expected_w = torch.stack(weights).masked_fill(torch.stack(ids) < 0, 0.0)
        assert torch.equal(result.recv_topk_weights, expected_w)
    # The raw backend returns the weights as sent, like DeepEP.
    buffer = result.handle.buffer
    raw = buffer.dispatch(problem.x[mine], problem.topk_idx[mine], problem.topk_weights[mine],
                          DispatchConfig(ReferenceBackend), EXPERTS)
    if rows:
        assert torch.equal(raw.recv_topk_weights, torch.stack(weights))
    counts = torch.bincount(result.recv_topk_idx[result.recv_topk_idx >= 0], minlength=EXPERTS // world)
    assert result.handle.tokens_per_expert_list == counts.tolist()


def _assert_expand_rows(result, problem, rank: int, world: int, alignment: int) -> None:
    """``result`` is ``rank``'s expand receive of ``problem``: per local expert, the rows and weights of its selections
    in global source order, padded with zero rows to a multiple of ``alignment``; counts as the blocks; no ids."""
    local = EXPERTS // world
    assert result.recv_topk_idx is None
    assert result.recv_topk_weights.dim() == 1
    expected_counts = []
    offset = 0
    for expert in range(local):
        global_expert = rank * local + expert
        expected_rows, expected_w = [], []
        for t in range(sum(problem.tokens_per_rank)):  # global source order
            slots = (problem.topk_idx[t] == global_expert).nonzero()
            if len(slots):
                expected_rows.append(problem.x[t])
                expected_w.append(problem.topk_weights[t, slots[0, 0]])
        count = -(-len(expected_rows) // alignment) * alignment
        expected_counts.append(count)
        block = result.recv_x[offset : offset + count]
        block_w = result.recv_topk_weights[offset : offset + count]
        if expected_rows:
            assert torch.equal(block[: len(expected_rows)], torch.stack(expected_rows))
            assert torch.equal(block_w[: len(expected_rows)], torch.stack(expected_w))
        assert not block[len(expected_rows) :].any(), "padding rows must be zero"
        assert not block_w[len(expected_rows) :].any(), "padding weights must be zero"
        offset += count
    assert result.handle.tokens_per_expert_list == expected_counts
    assert result.tokens_per_expert.tolist() == expected_counts
    assert result.recv_x.shape[0] == offset == sum(expected_counts)


def _expand_worker(rank: int, world: int, alignment: int) -> None:
    problem = make_problem(4, TOKENS[:world], HIDDEN, EXPERTS, TOPK)
    mine = problem.rows(rank)
    result = dv2.dispatch(
        problem.x[mine], problem.topk_idx[mine], problem.topk_weights[mine], EXPERTS,
        layout="expand", expert_alignment=alignment,
    )
    _assert_expand_rows(result, problem, rank, world, alignment)


def _string_layout_worker(rank: int, world: int) -> None:
    """A configuration given the layout as a string dispatches in that layout, and the dispatches of the equal
    configurations made afterwards (the documented keywords, the enum) do too."""
    from megatron_deepepv2 import ops

    problem = make_problem(8, [6, 5][:world], HIDDEN, EXPERTS, TOPK)
    mine = problem.rows(rank)
    args = (problem.x[mine], problem.topk_idx[mine], problem.topk_weights[mine], EXPERTS)
    # The process-wide settings: the configuration the keywords below resolve to equals this one.
    by_name = DispatchConfig(ReferenceBackend, dv2.get_settings(), layout="expand", expert_alignment=16)
    _assert_expand_rows(dv2.dispatch(*args, config=by_name), problem, rank, world, 16)
    assert dv2.resolve_config(layout="expand", expert_alignment=16, backend="reference") == by_name
    _assert_expand_rows(dv2.dispatch(*args, layout="expand", expert_alignment=16, backend="reference"), problem,
                        rank, world, 16)
    by_enum = DispatchConfig(ReferenceBackend, dv2.get_settings(), layout=dv2.ExpertLayout.EXPAND, expert_alignment=16)
    _assert_expand_rows(dv2.dispatch(*args, config=by_enum), problem, rank, world, 16)
    dispatcher = ops.bind(by_name, dist.group.WORLD, EXPERTS)
    assert dispatcher is ops.bind(by_enum, dist.group.WORLD, EXPERTS)
    assert dispatcher.config.layout is dv2.ExpertLayout.EXPAND
    # The compact name: compact rows with [N, K] local ids, source-rank-major.
    compact = dv2.dispatch(*args, config=DispatchConfig(ReferenceBackend, layout="compact"))
    rows, ids, _ = _expected_compact(problem, rank, world)
    assert compact.recv_x.shape[0] == len(rows) and torch.equal(compact.recv_x, torch.stack(rows))
    assert torch.equal(compact.recv_topk_idx, torch.stack(ids))


def _cached_worker(rank: int, world: int, layout: str) -> None:
    problem = make_problem(5, TOKENS[:world], HIDDEN, EXPERTS, TOPK)
    mine = problem.rows(rank)
    idx, w = problem.topk_idx[mine], problem.topk_weights[mine]
    first = dv2.dispatch(problem.x[mine], idx, w, EXPERTS, layout=layout, expert_alignment=4)
    other = problem.grad_out[mine]
    fresh = dv2.dispatch(other, idx, w, EXPERTS, layout=layout, expert_alignment=4)
    buffer = first.handle.buffer
    cached = buffer.cached_dispatch(other, first.handle, w)
    assert cached.handle is first.handle
    assert torch.equal(cached.recv_x, fresh.recv_x)
    # The configuration the op chose (zero padding).
    raw_fresh = buffer.dispatch(other, idx, w, first.handle.config, EXPERTS)
    assert torch.equal(cached.recv_topk_weights, raw_fresh.recv_topk_weights)
    if layout == "compact":
        assert torch.equal(cached.recv_topk_idx, fresh.recv_topk_idx)


def _fp8_worker(rank: int, world: int, layout: str) -> None:
    problem = make_problem(6, TOKENS[:world], HIDDEN, EXPERTS, TOPK)
    mine = problem.rows(rank)
    x_fp8 = problem.x[mine].to(torch.float8_e4m3fn)
    scales = torch.rand(x_fp8.shape[0], 2)
    plain = dv2.dispatch(problem.x[mine].float(), problem.topk_idx[mine], None, EXPERTS, layout=layout)
    fp8 = dv2.dispatch((x_fp8, scales), problem.topk_idx[mine], None, EXPERTS, layout=layout)
    recv_fp8, recv_scales = fp8.recv_x
    assert recv_fp8.dtype == torch.float8_e4m3fn and recv_scales.dtype == torch.float32
    assert recv_fp8.shape == plain.recv_x.shape
    # FP8 rows travel bit for bit: they equal the FP8 cast of the plain rows (padding stays zero).
    assert torch.equal(recv_fp8.view(torch.uint8), plain.recv_x.to(torch.float8_e4m3fn).view(torch.uint8))
    # Scales follow their rows: dispatch the scales as data to get the expectation.
    as_data = dv2.dispatch(scales, problem.topk_idx[mine], None, EXPERTS, layout=layout)
    assert torch.equal(recv_scales, as_data.recv_x)


@pytest.mark.parametrize("world", [2, 4])
def test_compact_rows_are_source_rank_major_with_local_ids(world: int) -> None:
    run_distributed(_compact_worker, world)


@pytest.mark.parametrize("alignment", [1, 16, 128])
def test_expand_rows_grouped_by_expert_in_source_order_with_zero_padding(alignment: int) -> None:
    """Padding rows are zero (the backend leaves them NaN where nothing asks for zeros)."""
    run_distributed(_expand_worker, 4, alignment)


def test_a_layout_given_as_a_string_dispatches_in_that_layout() -> None:
    """``DispatchConfig(layout="expand")`` gives expanded rows (not compact rows with expand counts), and afterwards
    ``dispatch(layout="expand", ...)`` in the same process still does."""
    run_distributed(_string_layout_worker, 2)


@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_cached_dispatch_equals_fresh_dispatch(layout: str) -> None:
    run_distributed(_cached_worker, 4, layout)


@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_fp8_pair_passes_through(layout: str) -> None:
    run_distributed(_fp8_worker, 2, layout)
