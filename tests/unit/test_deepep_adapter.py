"""The DeepEP adapter's plumbing and its deterministic order, on CPU, against the strict stand-ins of
``deep_ep.ElasticBuffer`` (2.1) and ``deep_ep.EPBuffer`` (V2.5) in :mod:`tests.deepep_stand_in`: the calls and their
arguments, events, destroy, DeepEP's determinism check under torch's deterministic algorithms, the version checks,
and the dense order of deterministic mode (with and without host sync, through the backend and the autograd ops),
compared with the dense oracle of :mod:`tests.stand_in`. Real ElasticBuffer runs are in ``tests/functional``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_deepepv2.groups import state_of
from tests.deepep_stand_in import (DEEPEP_V1_EXPORTS, STAND_INS, EventOverlap, group_of, in_dense_order,
                                   install_deep_ep, install_fake_deep_ep, use_stand_in_backend)
from tests.distributed import run_distributed
from tests.oracle import dense_step, experts_on_compact, experts_on_expand, make_problem
from tests.stand_in import DenseExchange


def _adapter_worker(rank: int, world: int, line: str) -> None:
    # The stand-in, and the reference backend's limits, so that the autograd ops take CPU tensors of any dtype.
    use_stand_in_backend(line)
    stand_in = STAND_INS[line][1]
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig, Streams
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.config import DeepepV2Settings

    derived = []  # one entry per derivation of device counts from DeepEP's prefix sums
    count_from_psum = DeepEPBackend.device_counts
    DeepEPBackend.device_counts = lambda self, handle: derived.append(1) or count_from_psum(self, handle)
    spec = BufferSpec(hidden=8, num_topk=3, num_max_tokens_per_rank=32, settings=DeepepV2Settings(num_sms=23))
    sms = 24 if line == "V2.5" else 23  # V2.5 runs an even count; the backend rounds it itself
    backend, reference = DeepEPBackend(state_of(group_of()), spec), ReferenceBackend(state_of(group_of()), spec)
    assert isinstance(backend.ep_buffer, stand_in) and backend.line.num_sms(23) == sms
    assert backend.ep_buffer.ctor["allow_hybrid_mode"] is False  # single node -> direct mode
    problem = make_problem(41, [7, 0, 5, 9][:world], 8, 8, 3, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    for layout, host_sync in [(layout, sync) for layout in ExpertLayout for sync in (True, False)]:
        # The settings of the buffer above: the autograd ops below get theirs from the buffer registry.
        settings = DeepepV2Settings(host_sync=host_sync, num_sms=23, num_max_tokens_per_rank=32)
        config = DispatchConfig(DeepEPBackend, settings, layout, 4)
        derived.clear()
        got, want = backend.dispatch(x, idx, w, config, 8), reference.dispatch(x, idx, w, config, 8)
        valid = int(want.handle.num_valid_rows)
        # Without deterministic mode DeepEP's order is its own: compared in the oracle's order (the stand-in's record).
        assert torch.equal(in_dense_order(got.recv_x, got.handle.native)[:valid], want.recv_x[:valid])
        assert got.handle.tokens_per_expert_list == want.handle.tokens_per_expert_list
        # The device counts are derived only when asked for (host-sync callers use the host list), and once.
        assert not derived
        assert torch.equal(got.handle.tokens_per_expert, want.handle.tokens_per_expert)
        assert len(derived) == 1
        assert int(got.handle.num_valid_rows) == valid and len(derived) == 1
        assert got.handle.num_recv_rows == want.recv_x.shape[0]
        # The backend hands DeepEP's tensors back as they are: past the valid extent they are unspecified.
        assert torch.equal(in_dense_order(got.recv_topk_weights, got.handle.native)[:valid],
                           want.recv_topk_weights[:valid])
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(in_dense_order(got.recv_topk_idx, got.handle.native)[:valid], want.recv_topk_idx[:valid])
        assert (got.recv_topk_idx is None) == (layout is ExpertLayout.EXPAND)
        combined = backend.combine(got.recv_x, got.handle, got.recv_topk_weights)
        expected = reference.combine(want.recv_x, want.handle, want.recv_topk_weights)
        torch.testing.assert_close(combined.x, expected.x)
        torch.testing.assert_close(combined.topk_weights, expected.topk_weights)
        cached = backend.cached_dispatch(problem.grad_out[rows], got.handle)
        assert torch.equal(in_dense_order(cached.recv_x, got.handle.native)[:valid],
                           reference.cached_dispatch(problem.grad_out[rows], want.handle).recv_x[:valid])
        # The autograd ops with DeepEP's stream flags: previous event passed, async events waited; the direct-call
        # passes clear what DeepEP left past the valid extent (expert id -1, weight 0, zero gradient rows).
        stand_in.calls.clear()
        EventOverlap.created.clear()
        xg = x.clone().requires_grad_()
        bound = ops.bind(config, group_of(), 8)
        recv_x, recv_w, _, recv_idx, handle = ops.DispatchFunction.apply(xg, w, bound, idx, None, Streams(True, True))
        assert isinstance(handle.buffer, DeepEPBackend) and handle.buffer is not backend  # the registry's buffer
        assert torch.equal(in_dense_order(recv_w, handle.native), want.recv_topk_weights.masked_fill(
            want.recv_topk_idx < 0, 0) if layout is ExpertLayout.COMPACT else want.recv_topk_weights)
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(in_dense_order(recv_idx, handle.native), want.recv_topk_idx)
        recv_x.retain_grad()
        y = ops.CombineFunction.apply(recv_x, handle, Streams(True, True))
        y.sum().backward()
        grad_rows = reference.cached_dispatch(torch.ones_like(y), want.handle).recv_x
        assert torch.equal(in_dense_order(recv_x.grad, handle.native)[:valid], grad_rows[:valid])
        assert not recv_x.grad[valid:].any()
        # Dispatch, combine, and in the backward the cached dispatch and the combine: every one asynchronous, and
        # every one waited on before its outputs were used.
        assert len(EventOverlap.created) == 4 and all(e.is_async and e.waited for e in EventOverlap.created)
        for call in stand_in.calls[:4]:
            assert call["prev"] == "event-handle" and call["alloc"]
            assert call["num_sms"] == sms, call
        cached_calls = [c for c in stand_in.calls if c.get("cached")]
        assert cached_calls and all(c["do_expand"] == (layout is ExpertLayout.EXPAND)
                                    and c["zero"] == (layout is ExpertLayout.EXPAND) for c in cached_calls)
        # Synchronous calls never allocate on the communication stream (nothing would protect those outputs from
        # reuse by that stream once freed), so they pass no previous event either.
        stand_in.calls.clear()
        recv_x, _, _, _, handle = ops.DispatchFunction.apply(x.clone().requires_grad_(), None, bound, idx, None,
                                                             Streams(False, True))
        ops.CombineFunction.apply(recv_x, handle, Streams(False, True)).sum().backward()
        assert len(stand_in.calls) == 4 and not any(c["alloc"] or c["prev"] or c["async_"] for c in stand_in.calls)
    DeepEPBackend.device_counts = count_from_psum
    # FP8 pairs pass through as pairs, bytes unchanged.
    fp8 = (x.to(torch.float8_e4m3fn), torch.rand(x.shape[0], 2, generator=torch.Generator().manual_seed(rank)))
    config = DispatchConfig(DeepEPBackend, layout=ExpertLayout.EXPAND, expert_alignment=4)
    got, want = backend.dispatch(fp8, idx, w, config, 8), reference.dispatch(fp8, idx, w, config, 8)
    assert isinstance(got.recv_x, tuple) and got.recv_x[0].dtype == torch.float8_e4m3fn
    assert torch.equal(in_dense_order(got.recv_x[0].view(torch.uint8), got.handle.native),
                       want.recv_x[0].view(torch.uint8))
    assert torch.equal(in_dense_order(got.recv_x[1], got.handle.native), want.recv_x[1])
    backend.destroy()
    assert backend.ep_buffer is None


def _deterministic_algorithms_worker(rank: int, world: int, line: str) -> None:
    """Megatron's --deterministic-mode turns on torch's deterministic algorithms with the fill left on (torch's
    default): every adapter call must still pass DeepEP's check, and the user's setting must come back."""
    use_stand_in_backend(line)
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig, Streams
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.config import DeepepV2Settings

    settings = DeepepV2Settings(num_sms=24, deterministic=True, host_sync=True, num_max_tokens_per_rank=16)
    spec = BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=16, settings=settings)
    config = DispatchConfig(DeepEPBackend, settings, ExpertLayout.EXPAND, expert_alignment=2)
    backend, reference = DeepEPBackend(state_of(group_of()), spec), ReferenceBackend(state_of(group_of()), spec)
    assert backend.ep_buffer.ctor["deterministic"] is False  # the backend orders the rows itself
    problem = make_problem(43, [5, 3], 8, 4, 2, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows].clone().requires_grad_(), problem.topk_idx[rows], problem.topk_weights[rows]
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        recv_x, _, _, _, handle = ops.DispatchFunction.apply(x, w, ops.bind(config, group_of(), 4), idx, None,
                                                             Streams(True, True))
        assert handle.buffer.ep_buffer.ctor["deterministic"] is False  # the registry's buffer: the backend sorts
        y = ops.CombineFunction.apply(recv_x * 2, handle, Streams(True, True))
        y.sum().backward()
        assert torch.utils.deterministic.fill_uninitialized_memory  # restored after every call
    finally:
        torch.use_deterministic_algorithms(False)
    want = reference.dispatch(x.detach(), idx, w, config, 4)
    torch.testing.assert_close(y, reference.combine(want.recv_x * 2, want.handle).x)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0) * (idx >= 0).sum(1, keepdim=True))
    backend.destroy()


@pytest.mark.parametrize("line", list(STAND_INS))
def test_adapter_passes_deepeps_determinism_check_under_deterministic_algorithms(line: str) -> None:
    run_distributed(_deterministic_algorithms_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"})


@pytest.mark.parametrize("line", list(STAND_INS))
def test_adapter_plumbing_against_strict_stand_in(line: str) -> None:
    run_distributed(_adapter_worker, 4, line, env={"LOCAL_WORLD_SIZE": "4"})


def test_adapter_reports_deepep_v1_and_import_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.backends.deepep.probes import import_deep_ep

    install_fake_deep_ep(monkeypatch, **DEEPEP_V1_EXPORTS)
    with pytest.raises(ImportError, match="deep_ep 1.2.1 .* has Buffer but neither ElasticBuffer .* it is DeepEP v1"):
        import_deep_ep()


def _caller_reuses_topk_idx(rank: int, world: int) -> str:
    """V2.5's handle keeps the ``topk_idx`` it is given: a caller that refills its tensor before the backward (as the
    next replay of a CUDA graph refills its static inputs) must not change the routing of a pending combine."""
    install_deep_ep("V2.5")
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.backends.reference import ReferenceBackend

    spec, config = BufferSpec(hidden=8, num_topk=3, num_max_tokens_per_rank=16), DispatchConfig(DeepEPBackend)
    backend, reference = DeepEPBackend(state_of(group_of()), spec), ReferenceBackend(state_of(group_of()), spec)
    problem = make_problem(44, [6, 5], 8, 8, 3, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows].clone(), problem.topk_weights[rows]
    got, want = backend.dispatch(x, idx, w, config, 8), reference.dispatch(x, idx, w, config, 8)
    idx.copy_(idx.roll(1, dims=0))  # the caller's static tensor, refilled for the next micro-batch
    torch.testing.assert_close(backend.combine(got.recv_x, got.handle).x, reference.combine(want.recv_x, want.handle).x)
    backend.destroy()
    return "ok"


def test_v25_handles_keep_a_copy_of_the_routing_not_the_callers_tensor() -> None:
    assert run_distributed(_caller_reuses_topk_idx, 2, env={"LOCAL_WORLD_SIZE": "2"}) == ["ok", "ok"]


# ------------------------------------------------------------------ deterministic mode: the order the backend makes
EXPERTS, HIDDEN, TOPK, CAPACITY = 8, 8, 3, 16
#: Tokens per rank: one rank sends none; then both send (several source groups to order).
ORDER_TOKENS = ([12, 0], [6, 9])


def _order_problem(seed: int, tokens: list[int]):
    """A problem whose routing leaves experts 2 and 5 empty (one on each rank) and drops further selections (-1)."""
    problem = make_problem(seed, tokens, HIDDEN, EXPERTS, TOPK)
    problem.topk_idx = problem.topk_idx.masked_fill((problem.topk_idx == 2) | (problem.topk_idx == 5), -1)
    return problem


def _backend_order_worker(rank: int, world: int, line: str) -> int:
    """The backend's calls in deterministic mode, with and without host sync and hybrid mode: the valid received rows,
    weights, compact ids, a cached dispatch, and a combine with weights of distinct rows, against the dense oracle."""
    use_stand_in_backend(line)
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.config import DeepepV2Settings

    oracle = DenseExchange(group_of(), CAPACITY)
    backends = {hybrid: DeepEPBackend(state_of(group_of()), BufferSpec(
        hidden=HIDDEN, num_topk=TOPK, num_max_tokens_per_rank=CAPACITY,
        settings=DeepepV2Settings(allow_hybrid_mode=hybrid))) for hybrid in (False, True)}
    assert not any(b.ep_buffer.ctor["deterministic"] for b in backends.values())
    cases = 0
    for seed, tokens in enumerate(ORDER_TOKENS):
        problem = _order_problem(seed, tokens)
        rows = problem.rows(rank)
        x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
        for layout in ExpertLayout:
            expand = layout is ExpertLayout.EXPAND
            for alignment in (1, 16, 128):
                for host_sync in (True, False):
                    for hybrid, backend in backends.items():
                        tag = f"{layout.value} alignment={alignment} host_sync={host_sync} hybrid={hybrid}"
                        settings = DeepepV2Settings(deterministic=True, host_sync=host_sync,
                                                    num_max_tokens_per_rank=CAPACITY, allow_hybrid_mode=hybrid)
                        config = DispatchConfig(DeepEPBackend, settings, layout, alignment)
                        got = backend.dispatch(x, idx, w, config, EXPERTS)
                        want_x, want_idx, want_w, plan = oracle.dispatch(
                            x, idx, w, num_experts=EXPERTS, expand=expand, alignment=alignment, cpu_sync=host_sync)
                        valid = sum(plan.aligned_counts) if expand else len(plan.rows)
                        assert got.recv_x.shape == want_x.shape, tag
                        assert torch.equal(got.recv_x[:valid], want_x[:valid]), tag
                        assert torch.equal(got.recv_topk_weights[:valid], want_w[:valid]), tag
                        if not expand:
                            assert torch.equal(got.recv_topk_idx[:valid], want_idx[:valid]), tag
                        # A combine of distinct rows (and weights): each row must reach its own token and slot.
                        gen = torch.Generator().manual_seed(1000 * cases + rank)
                        z = torch.randn(want_x.shape, generator=gen, dtype=want_x.dtype)
                        zw = torch.rand(want_w.shape, generator=gen)
                        combined = backend.combine(z, got.handle, zw)
                        expected = oracle.combine(z, plan, zw)
                        torch.testing.assert_close(combined.x, expected[0], rtol=1e-12, atol=1e-12, msg=tag)
                        assert torch.equal(combined.topk_weights, expected[1]), tag
                        for repeat in range(2):  # every cached dispatch of the handle, not just the first
                            g = torch.randn(x.shape, generator=gen, dtype=x.dtype)
                            gw = torch.rand(w.shape, generator=gen)
                            cached = backend.cached_dispatch(g, got.handle, gw)
                            want_gx, want_gw = oracle.cached_dispatch(g, plan, gw)
                            assert torch.equal(cached.recv_x[:valid], want_gx[:valid]), (tag, repeat)
                            assert torch.equal(cached.recv_topk_weights[:valid], want_gw[:valid]), (tag, repeat)
                        cases += 1
    for backend in backends.values():
        backend.destroy()
    return cases


@pytest.mark.parametrize("line", list(STAND_INS))
def test_deterministic_mode_receives_in_the_dense_order_with_and_without_host_sync(line: str) -> None:
    assert run_distributed(_backend_order_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"}) == [48, 48]


def _experts(result, local_weights: torch.Tensor, expand: bool) -> torch.Tensor:
    """The experts on the valid rows only (the same shapes with and without host sync), zero rows after them."""
    counts = result.handle.tokens_per_expert.tolist()
    valid = sum(counts) if expand else int(result.handle.num_valid_rows)
    recv_x, recv_w = result.recv_x[:valid], result.recv_topk_weights[:valid]
    if expand:
        out = experts_on_expand(recv_x, recv_w, counts, local_weights)
    else:
        out = experts_on_compact(recv_x, result.recv_topk_idx[:valid], recv_w, local_weights)
    return torch.nn.functional.pad(out, (0, 0, 0, result.recv_x.shape[0] - valid))


def _autograd_order_worker(rank: int, world: int, line: str) -> int:
    """``dispatch`` -> experts -> ``combine`` in deterministic mode: host sync or not, the same received rows (the
    oracle's), and bit-identical outputs and gradients (x, routing weights, expert weights), close to the dense step."""
    use_stand_in_backend(line)
    import megatron_deepepv2 as dv2

    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    oracle = DenseExchange(group_of(), CAPACITY)
    runs = 0
    for seed, tokens in enumerate(ORDER_TOKENS):
        problem = _order_problem(10 + seed, tokens)
        rows = problem.rows(rank)
        dense = dense_step(problem)
        for layout in ("compact", "expand"):
            for alignment in (1, 16, 128):
                outcomes = []
                for host_sync in (True, False):
                    x = problem.x[rows].clone().requires_grad_()
                    w = problem.topk_weights[rows].clone().requires_grad_()
                    experts = problem.expert_weights[mine].clone().requires_grad_()
                    result = dv2.dispatch(x, problem.topk_idx[rows], w, EXPERTS, layout=layout,
                                          expert_alignment=alignment, backend="deepep", deterministic=True,
                                          host_sync=host_sync, num_max_tokens_per_rank=CAPACITY)
                    y = dv2.combine(_experts(result, experts, layout == "expand"), result.handle)
                    (y * problem.grad_out[rows]).sum().backward()
                    valid = int(result.handle.num_valid_rows)
                    outcomes.append((result.recv_x[:valid].detach(), result.recv_topk_weights[:valid].detach(),
                                     y.detach(), x.grad, w.grad, experts.grad))
                    runs += 1
                tag = f"{layout} alignment={alignment} tokens={tokens}"
                want_x, want_idx, want_w, _ = oracle.dispatch(problem.x[rows], problem.topk_idx[rows],
                                                       problem.topk_weights[rows], num_experts=EXPERTS,
                                                       expand=layout == "expand", alignment=alignment, cpu_sync=True)
                if layout == "compact":  # the op masks the weights of other ranks' experts
                    want_w = want_w.masked_fill(want_idx < 0, 0.0)
                synced, unsynced = outcomes
                assert torch.equal(synced[0], want_x) and torch.equal(synced[1], want_w), tag
                for name, a, b in zip(("rows", "weights", "y", "x grad", "weights grad", "experts grad"),
                                      synced, unsynced):
                    assert torch.equal(a, b), f"{tag}: {name} differs without host sync"
                for name, got, want in (("y", synced[2], dense.y[rows]), ("x grad", synced[3], dense.x_grad[rows]),
                                        ("weights grad", synced[4], dense.weights_grad[rows]),
                                        ("experts grad", synced[5], dense.experts_grad[mine])):
                    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-10, atol=1e-10, msg=f"{tag}: {name}")
    return runs


@pytest.mark.parametrize("line", list(STAND_INS))
def test_deterministic_mode_through_the_autograd_ops_is_the_same_with_and_without_host_sync(line: str) -> None:
    assert run_distributed(_autograd_order_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"}) == [24, 24]


def _scrambled_worker(rank: int, world: int, line: str) -> None:
    use_stand_in_backend(line)
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.config import DeepepV2Settings

    spec = BufferSpec(hidden=HIDDEN, num_topk=TOPK, num_max_tokens_per_rank=CAPACITY)
    backend = DeepEPBackend(state_of(group_of()), spec)
    oracle = DenseExchange(group_of(), CAPACITY)
    problem = _order_problem(3, [6, 9])
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    for layout in ExpertLayout:
        expand = layout is ExpertLayout.EXPAND
        config = DispatchConfig(DeepEPBackend, DeepepV2Settings(deterministic=False), layout, 16)
        first, second = backend.dispatch(x, idx, w, config, EXPERTS), backend.dispatch(x, idx, w, config, EXPERTS)
        want_x, _, _, plan = oracle.dispatch(x, idx, w, num_experts=EXPERTS, expand=expand, alignment=16,
                                             cpu_sync=True)
        valid = want_x.shape[0]
        assert valid > 4
        for got in (first, second):  # the same rows, in an order of DeepEP's own
            assert not torch.equal(got.recv_x, want_x), layout
            assert torch.equal(in_dense_order(got.recv_x, got.handle.native), want_x), layout
        assert not torch.equal(first.recv_x, second.recv_x), f"{layout}: one order for every dispatch"
    backend.destroy()


@pytest.mark.parametrize("line", list(STAND_INS))
def test_without_deterministic_mode_the_stand_in_receives_in_a_scrambled_order(line: str) -> None:
    """What makes the ordering tests able to fail: without deterministic mode the order is not the oracle's."""
    run_distributed(_scrambled_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"})
