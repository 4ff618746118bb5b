"""Functional cases for the DeepEP v2 backend on one or more GPUs, run under ``torchrun`` (one process per GPU).

Each case compares the ElasticBuffer path with an independent one over the same NCCL group: the reference
backend (``torch.distributed``), or Megatron's alltoall dispatcher. On one GPU the group has one rank (EP=1):
every kernel, stream, event, graph and determinism property runs, without NVLink traffic between GPUs; uneven
token counts with an empty rank need two ranks and run from two on. ``tests/functional/test_deepep.py``
launches this file; it can also be run by hand::

    EP_DISABLE_GIN=1 torchrun --nproc-per-node 1 tests/functional/deepep_cases.py [CASE ...] [--except=CASE ...]

Prints ``PASS name`` / ``SKIP name: reason`` / ``FAIL name`` per case and exits non-zero when any case failed.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron_deepepv2 as dv2  # noqa: E402
from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
from megatron_deepepv2.layout import ExpertLayout
from megatron_deepepv2.backends.reference import ReferenceBackend
from megatron_deepepv2.config import DeepepV2Settings  # noqa: E402
from megatron_deepepv2.groups import state_of  # noqa: E402
from megatron_deepepv2.testing.moe_model import capture_layer_step, layer_step  # noqa: E402
from tools._bench import median_us  # noqa: E402
from tests.functional.runner import RANK, CaseRegistry, exact, log  # noqa: E402

# Read by cuBLAS when its handle is created; torch's deterministic algorithms (a case below) require it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
CASES = CaseRegistry()
case, needs_world = CASES.case, CASES.needs_world


def make_routing(tokens: int, hidden: int, experts: int, topk: int, seed: int, drop: float = 0.1):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, :topk]
    idx = idx.masked_fill(torch.rand(tokens, topk, generator=gen) < drop, -1)
    if tokens:
        idx[0] = -1  # a token with no expert at all
    weights = torch.rand(tokens, topk, generator=gen)
    return x.cuda(), idx.cuda().contiguous(), weights.cuda().contiguous()


def tokens_for_rank(world: int, base: int) -> int:
    """Uneven counts with an empty last rank on two or more ranks; a single rank (EP=1) gets real tokens."""
    return 0 if world > 1 and RANK == world - 1 else base + 37 * RANK


@case
def layouts_match_reference() -> None:
    """Dispatch, cached dispatch and combine equal the reference backend bitwise (deterministic mode)."""
    world = dist.get_world_size()
    group = dist.group.WORLD
    hidden, experts, topk, t_max = 1024, 32, 8, 1024
    settings = DeepepV2Settings(deterministic=True, num_sms=0)  # num_sms=0: DeepEP's choice
    for fp8 in (False, True):
        spec = BufferSpec(hidden=hidden, num_topk=topk, num_max_tokens_per_rank=t_max, settings=settings, fp8=fp8)
        deepep, reference = DeepEPBackend(state_of(group), spec), ReferenceBackend(state_of(group), spec)
        try:
            for layout in (ExpertLayout.COMPACT, ExpertLayout.EXPAND):
                for alignment in (1, 128):
                    x, idx, w = make_routing(tokens_for_rank(world, 300), hidden, experts, topk, seed=7 + RANK)
                    data = x
                    if fp8:
                        scales = torch.rand(x.shape[0], hidden // 128, device="cuda") + 0.5
                        data = ((x.float() / 4).to(torch.float8_e4m3fn), scales)
                    config = DispatchConfig(DeepEPBackend, settings, layout, alignment)
                    got = deepep.dispatch(data, idx, w, config, experts)
                    want = reference.dispatch(data, idx, w, config, experts)
                    tag = f"{layout.value}/align{alignment}/fp8={fp8}"
                    if fp8:
                        exact(f"{tag} recv_x_fp8", got.recv_x[0], want.recv_x[0])
                        exact(f"{tag} recv_scales", got.recv_x[1], want.recv_x[1])
                        recv_rows = want.recv_x[0].float().to(torch.bfloat16)
                    else:
                        exact(f"{tag} recv_x", got.recv_x, want.recv_x)
                        recv_rows = want.recv_x
                    assert got.handle.tokens_per_expert_list == want.handle.tokens_per_expert_list, tag
                    assert got.handle.tokens_per_expert.tolist() == want.handle.tokens_per_expert_list, tag
                    if layout is ExpertLayout.COMPACT:
                        exact(f"{tag} recv_idx", got.recv_topk_idx, want.recv_topk_idx)
                    exact(f"{tag} recv_weights", got.recv_topk_weights, want.recv_topk_weights)
                    # Combine (BF16) of the same rows, with weights, equals the reference bitwise.
                    y = (recv_rows.float() * 0.5).to(torch.bfloat16).contiguous()
                    got_c = deepep.combine(y, got.handle, got.recv_topk_weights)
                    want_c = reference.combine(y, want.handle, want.recv_topk_weights)
                    exact(f"{tag} combine", got_c.x, want_c.x)
                    exact(f"{tag} combine weights", got_c.topk_weights, want_c.topk_weights)
                    if not fp8:
                        grad = (x.float() * 2).to(torch.bfloat16).contiguous()
                        exact(f"{tag} cached dispatch", deepep.cached_dispatch(grad, got.handle).recv_x,
                              reference.cached_dispatch(grad, want.handle).recv_x)
        finally:
            deepep.destroy()


@case
def nondeterministic_mode_matches_after_canonical_sort() -> None:
    """Without deterministic mode rows may arrive in any order; as a set (and through combine) they match."""
    world, group = dist.get_world_size(), dist.group.WORLD
    hidden, experts, topk = 1024, 32, 8
    spec = BufferSpec(hidden=hidden, num_topk=topk, num_max_tokens_per_rank=1024, settings=DeepepV2Settings(num_sms=0))
    deepep, reference = DeepEPBackend(state_of(group), spec), ReferenceBackend(state_of(group), spec)
    config = DispatchConfig(DeepEPBackend)
    try:
        x, idx, w = make_routing(tokens_for_rank(world, 500), hidden, experts, topk, seed=11 + RANK)
        got = deepep.dispatch(x, idx, w, config, experts)
        want = reference.dispatch(x, idx, w, config, experts)
        order_got = got.handle.native.recv_src_metadata[:, 0].long().argsort()
        order_want = want.handle.native.recv_src_index.argsort()
        exact("sorted recv_x", got.recv_x[order_got], want.recv_x[order_want])
        exact("sorted recv_idx", got.recv_topk_idx[order_got], want.recv_topk_idx[order_want])
        y_got = (got.recv_x.float() * 0.25).to(torch.bfloat16)
        y_want = (want.recv_x.float() * 0.25).to(torch.bfloat16)
        # Combine reduces per top-k slot in slot order, whatever the receive order: bitwise equal.
        exact("combine", deepep.combine(y_got, got.handle).x, reference.combine(y_want, want.handle).x)
    finally:
        deepep.destroy()


def _ops_inputs():
    x, idx, w = make_routing(tokens_for_rank(dist.get_world_size(), 256), 1024, 32, 8, seed=23 + RANK)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(RANK)).to(torch.bfloat16).cuda()
    return x, idx, w, grad


def _ops_run(backend: str, layout: str, inputs=None, host_sync: bool = True, fp8_dispatch: bool = False, **flags):
    """Dispatch -> scale by weights -> combine, forward and backward; no host sync of its own."""
    x, idx, w, grad = inputs if inputs is not None else _ops_inputs()
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    out = dv2.dispatch(x, idx, w, 32, layout=layout, expert_alignment=16 if layout == "expand" else 1, backend=backend, num_max_tokens_per_rank=1024,
                       host_sync=host_sync, fp8_dispatch=fp8_dispatch, **flags)
    if layout == "expand":
        y = out.recv_x * out.recv_topk_weights.unsqueeze(1).to(out.recv_x.dtype)
    else:
        y = out.recv_x * out.recv_topk_weights.sum(dim=1, keepdim=True).to(out.recv_x.dtype)
    combined = dv2.combine(y, out.handle, **flags)
    combined.backward(grad)
    return combined.detach(), x.grad, w.grad


@case
def autograd_ops_match_reference() -> None:
    """Forward and gradients of our ops with DeepEP equal the reference backend's; flag variants agree."""
    with dv2.settings_override(deterministic=True):
        for layout in ("compact", "expand"):
            want = _ops_run("reference", layout)
            got = _ops_run("deepep", layout)
            for name, a, b in zip(("output", "grad_x", "grad_probs"), got, want):
                exact(f"{layout} {name}", a, b)
            for async_finish in (False, True):
                for allocate in (False, True):
                    variant = _ops_run("deepep", layout, async_finish=async_finish, allocate_on_comm_stream=allocate)
                    for name, a, b in zip(("output", "grad_x", "grad_probs"), variant, got):
                        exact(f"{layout} async={async_finish} alloc={allocate} {name}", a, b)
    dv2.destroy_buffers()


@case
def buffer_per_hidden_size() -> None:
    """Two hidden sizes get an ElasticBuffer each (built collectively, then reused); results stay right."""
    from megatron_deepepv2 import buffers

    with dv2.settings_override(deterministic=True):
        builds = buffers.buffer_stats().builds
        backends = {}
        for hidden in (1024, 2048, 1024):
            x, idx, w = make_routing(128, hidden, 32, 8, seed=31 + RANK)
            got = dv2.dispatch(x, idx, w, 32, backend="deepep", num_max_tokens_per_rank=512)
            want = dv2.dispatch(x, idx, w, 32, backend="reference", num_max_tokens_per_rank=512)
            exact(f"hidden {hidden}", got.recv_x, want.recv_x)
            assert got.handle.buffer.spec.hidden == hidden
            assert backends.setdefault(hidden, got.handle.buffer) is got.handle.buffer
        assert buffers.buffer_stats().builds - builds == 4  # one per hidden size and backend
    dv2.destroy_buffers()


def _moe_layer_grads(dispatcher: str, shape, x0):
    """One forward and backward of a MoELayer: ``(output, input gradient, parameter gradients, layer)``."""
    from megatron_deepepv2.testing.moe_model import build_moe_layer

    dv2.configure(backend="deepep")
    layer = build_moe_layer(shape, dispatcher, seed=5)
    x = x0.clone().requires_grad_()
    y, _ = layer(x)
    y.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}, layer


class _Messages(logging.Handler):
    """Keeps the message of every WARNING (or worse) record it is handed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def layout_variable_is_unread() -> None:
    """``MEGATRON_DEEPEPV2_LAYOUT=compact`` selects nothing (there is no layout setting: Megatron layers dispatch in
    the expand layout): the settings read from it are the defaults, and it gets the unread-variable WARNING."""
    handler, config_logger = _Messages(), logging.getLogger("megatron_deepepv2.config")
    config_logger.addHandler(handler)
    try:
        settings = DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_LAYOUT": "compact"})
    finally:
        config_logger.removeHandler(handler)
    assert settings == DeepepV2Settings(), settings
    unread = "MEGATRON_DEEPEPV2_LAYOUT is set, but no megatron_deepepv2 setting reads it"
    assert any(message.startswith(unread) for message in handler.messages), handler.messages


@case
def moe_layer_matches_alltoall() -> None:
    """Megatron MoELayer with deepepv2 vs the alltoall dispatcher: output and every gradient; the layer dispatches in
    the expand layout, which no variable changes (:func:`layout_variable_is_unread`)."""
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig

    dv2.install()
    layout_variable_is_unread()
    shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(RANK)
    x0 = torch.randn(512, 1, shape.hidden, generator=gen).to(torch.bfloat16).cuda()
    want = _moe_layer_grads("alltoall", shape, x0)
    got = _moe_layer_grads("deepepv2", shape, x0)
    config = got[3].token_dispatcher._comm_manager.dispatch_config
    assert config.layout is ExpertLayout.EXPAND and config.backend is DeepEPBackend, config
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2, msg="output")
    torch.testing.assert_close(got[1], want[1], rtol=2e-2, atol=2e-2, msg="input grad")
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=2e-2, atol=2e-2, msg=name)
    del got, want
    dv2.destroy_buffers()


@case
@needs_world(2, "Megatron asserts expert_model_parallel_size > 1 for overlap_moe_expert_parallel_comm")
def ep_overlap_combined_1f1b_matches_alltoall() -> None:
    """overlap_moe_expert_parallel_comm: Megatron's combined 1F1B schedule (forward of one micro-batch interleaved
    with the backward of the previous, dispatch and combine on Megatron's communication stream) over ElasticBuffer,
    vs plain forward + backward steps through the alltoall dispatcher: losses and every gradient."""
    from tests.unit.test_ep_overlap import GPU_SHAPE, compare_overlap_with_alltoall

    dv2.install()
    dv2.configure(backend="deepep")
    compare_overlap_with_alltoall(RANK, GPU_SHAPE)
    dv2.destroy_buffers()


@case
def moe_layer_replays_bit_exact_in_deterministic_mode() -> None:
    """GPU replay: deepepv2 MoELayer, ElasticBuffer deterministic mode, 3 replays under contention; the
    same with Megatron's --deterministic-mode (config.deterministic_mode and torch's deterministic algorithms with
    fill_uninitialized_memory on, which DeepEP asserts against unless the adapter turns it off around its calls)."""
    from tests.determinism.harness import assert_replays_bit_exact, count_differing_replays, moe_layer_replay

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.install()
    x0 = torch.randn(1024, 1, 1024, generator=torch.Generator().manual_seed(RANK)).to(torch.bfloat16).cuda()
    for mode in ("setting", "megatron", "off"):
        extra = {"deterministic_mode": True} if mode == "megatron" else {}
        shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16, extra=extra)
        dv2.configure(backend="deepep", deterministic=mode == "setting")
        torch.use_deterministic_algorithms(mode == "megatron")
        try:
            run = moe_layer_replay(build_moe_layer(shape, "deepepv2", seed=9), x0)
            if mode == "off":
                log(f"  deterministic off: {count_differing_replays(run, replays=3)} of 2 replays differed (informational)")
            else:
                assert_replays_bit_exact(run, replays=3)
        finally:
            torch.use_deterministic_algorithms(False)
        dv2.destroy_buffers()
    dv2.configure(deterministic=False)


@case
def no_host_sync_matches_reference_without_syncs() -> None:
    """DeepEP without CPU sync vs the reference backend without host sync (over NCCL): worst-case shapes, device
    counts, combine and gradients bitwise equal; the second pass runs under CUDA's sync debug mode = error."""
    results = {}
    for backend in ("reference", "deepep"):
        for layout in ("expand", "compact"):
            inputs = _ops_inputs()
            for attempt in range(2):  # the first builds the buffer (a collective with a host read)
                torch.cuda.synchronize()
                if attempt == 1:
                    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises
                try:
                    out = _ops_run(backend, layout, inputs, host_sync=False)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            results[(backend, layout)] = out
    for layout in ("expand", "compact"):
        for name, a, b in zip(("output", "grad_x", "grad_probs"), results[("deepep", layout)],
                              results[("reference", layout)]):
            exact(f"no-host-sync {layout} {name}", a, b)
    x, idx, w = make_routing(tokens_for_rank(dist.get_world_size(), 256), 1024, 32, 8, seed=23 + RANK)
    got = dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16, backend="deepep",
                       num_max_tokens_per_rank=1024, host_sync=False)
    want = dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16,
                        backend="reference", num_max_tokens_per_rank=1024, host_sync=False)
    exact("tokens_per_expert", got.tokens_per_expert, want.tokens_per_expert)
    exact("num_valid_rows", got.handle.num_valid_rows, want.handle.num_valid_rows)
    assert got.recv_x.shape == want.recv_x.shape, (got.recv_x.shape, want.recv_x.shape)
    valid = int(got.handle.num_valid_rows)
    assert not got.recv_topk_weights[valid:].any(), "weights past the valid rows must be zero"
    dv2.destroy_buffers()


def _order_routings(tokens: int, hidden: int, experts: int, topk: int, seed: int):
    """Routings the deterministic order must handle: random with -1 selections and a token with none; half the
    experts empty (only even ids chosen); most selections dropped."""
    yield "random", make_routing(tokens, hidden, experts, topk, seed)
    x, idx, w = make_routing(tokens, hidden, experts // 2, topk, seed + 1)
    yield "empty experts", (x, torch.where(idx >= 0, idx * 2, idx).contiguous(), w)
    yield "mostly -1", make_routing(tokens, hidden, experts, topk, seed + 2, drop=0.7)


def _by_source(metadata: torch.Tensor) -> torch.Tensor:
    """An expand handle's metadata rows (one per received token, in arrival order) sorted by source token."""
    return metadata[metadata[:, 0].long().argsort()]


@case
def sync_free_deterministic_order_equals_deepeps_sort() -> None:
    """Deterministic mode without host sync (the sync-free order) against DeepEP's own deterministic mode with host
    sync (a buffer built ``deterministic=True``): the valid rows, weights, compact ids and the handle's metadata,
    combine with weights and cached dispatch, bitwise, for both layouts with and without alignment, on routings with
    empty experts and -1 selections; then the autograd ops' output and both gradients, host sync against none."""
    from megatron_deepepv2.backends.deepep.backend import buffer_size_arguments

    world, group = dist.get_world_size(), dist.group.WORLD
    hidden, experts, topk, t_max = 1024, 32, 8, 1024
    settings = DeepepV2Settings(deterministic=True, host_sync=False, num_sms=0)
    spec = BufferSpec(hidden=hidden, num_topk=topk, num_max_tokens_per_rank=t_max, settings=settings)
    ours = DeepEPBackend(state_of(group), spec)
    deep_ep = sys.modules["deep_ep"]
    theirs = getattr(deep_ep, ours.line.buffer_class)(
        group, **buffer_size_arguments(t_max, hidden, topk), deterministic=True, allow_hybrid_mode=False,
        allow_multiple_reduction=True, explicitly_destroy=True)
    checked = 0
    try:
        for name, (x, idx, w) in _order_routings(tokens_for_rank(world, 300), hidden, experts, topk, 31 + RANK):
            for layout, alignment in ((ExpertLayout.COMPACT, 1), (ExpertLayout.COMPACT, 128), (ExpertLayout.EXPAND, 1),
                                      (ExpertLayout.EXPAND, 16), (ExpertLayout.EXPAND, 128)):
                expand, tag = layout is ExpertLayout.EXPAND, f"{name} {layout.value}/align{alignment}"
                config = DispatchConfig(DeepEPBackend, settings, layout, alignment)
                got = ours.dispatch(x, idx, w, config, experts)
                want_x, want_idx, want_w, want_handle, _ = theirs.dispatch(
                    x, topk_idx=idx, topk_weights=w, num_experts=experts, num_max_tokens_per_rank=t_max,
                    expert_alignment=alignment, num_sms=ours.line.num_sms(settings.num_sms), do_expand=expand, do_zero_padding=config.padded,
                    do_cpu_sync=True, **dict(ours.line.dispatch_kwargs))
                rows = want_x.shape[0]
                assert int(got.handle.num_valid_rows) == rows, (tag, int(got.handle.num_valid_rows), rows)
                exact(f"{tag} rows", got.recv_x[:rows], want_x)
                exact(f"{tag} weights", got.recv_topk_weights[:rows], want_w)
                # Metadata: column 0 the source token, columns 2.. the expand rows of its selections (column 1 and
                # compact's slot columns hold DeepEP-internal positions, which differ between dispatches).
                got_meta, want_meta = got.handle.native.recv_src_metadata, want_handle.recv_src_metadata
                if expand:  # one metadata row per received token, in arrival order: compared by source token
                    tokens = want_meta.shape[0]
                    got_meta, want_meta = _by_source(got_meta[:tokens]), _by_source(want_meta)
                    exact(f"{tag} slots", got_meta[:, 2:], want_meta[:, 2:])
                else:
                    exact(f"{tag} ids", got.recv_topk_idx[:rows], want_idx)
                    got_meta = got_meta[:rows]
                exact(f"{tag} metadata sources", got_meta[:, 0], want_meta[:, 0])
                y = (got.recv_x.float() * 0.5).to(torch.bfloat16)
                got_c = ours.combine(y, got.handle, got.recv_topk_weights)
                want_c, want_cw, _ = theirs.combine(y[:rows].contiguous(), want_handle, topk_weights=want_w,
                                                    num_sms=want_handle.num_sms)
                exact(f"{tag} combine", got_c.x, want_c)
                exact(f"{tag} combine weights", got_c.topk_weights, want_cw)
                grad = (x.float() * 2).to(torch.bfloat16)
                got_g = ours.cached_dispatch(grad, got.handle).recv_x
                want_g = theirs.dispatch(grad, handle=want_handle, num_sms=want_handle.num_sms, do_expand=expand,
                                         do_zero_padding=expand, **dict(ours.line.dispatch_kwargs))[0]
                exact(f"{tag} cached dispatch", got_g[:rows], want_g)
                checked += 1
        # What ordering adds to a dispatch without host sync (compact and expand, the random routing), called eagerly
        # and replayed from a CUDA graph (no launch cost: the GPU time).
        x, idx, w = make_routing(tokens_for_rank(world, 300), hidden, experts, topk, 31 + RANK)
        for layout in (ExpertLayout.COMPACT, ExpertLayout.EXPAND):
            times = {}
            for deterministic in (False, True):
                config = DispatchConfig(DeepEPBackend, DeepepV2Settings(deterministic=deterministic, host_sync=False,
                                                                        num_sms=0), layout, 16 if layout is
                                        ExpertLayout.EXPAND else 1)
                times[deterministic] = median_us(lambda: ours.dispatch(x, idx, w, config, experts), 30, 5, cuda=True)
                graph, _ = _capture(lambda xin: ours.dispatch(xin, idx, w, config, experts).recv_x, x.clone())
                times[deterministic, "graph"] = median_us(graph.replay, 30, 5, cuda=True)
                del graph
            log(f"  {layout.value} dispatch without host sync, eager / graph replay: {times[False]:.0f} / "
                f"{times[False, 'graph']:.0f} us, deterministic {times[True]:.0f} / {times[True, 'graph']:.0f} us "
                f"(T={x.shape[0]} H={hidden} E={experts} top-{topk}, {ours.spec.num_max_tokens_per_rank} tokens per "
                "rank at most)")
    finally:
        ours.destroy()
        theirs.destroy()
    log(f"  {checked} routings x layouts equal DeepEP's deterministic mode with host sync")
    for layout in ("compact", "expand"):
        with dv2.settings_override(deterministic=True):
            inputs = _ops_inputs()
            host_sync = _ops_run("deepep", layout, inputs)
            sync_free = _ops_run("deepep", layout, inputs, host_sync=False)
        for name, a, b in zip(("output", "grad_x", "grad_probs"), sync_free, host_sync):
            exact(f"ops {layout} {name}", a, b)
    dv2.destroy_buffers()


def _device_to_host_copies(step: Callable[[], None]) -> list[str]:
    """Names of the device-to-host copies ``step`` makes, from a ``torch.profiler`` trace of it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if "DtoH" in event.name or "Device -> Host" in event.name]


@case
def deterministic_graph_replays_bit_exact() -> None:
    """Deterministic mode without host sync: a deepepv2 MoELayer (sync-free experts) forward+backward captured in one
    CUDA graph; ten replays on one input are bitwise equal to each other and to an eager step (output, input and
    router gradients, every expert weight gradient), with the setting and with Megatron's --deterministic-mode
    (torch's deterministic algorithms); the profiler sees no device-to-host copy in an eager step or a replay."""
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.install()
    tokens = 512
    for mode in ("setting", "megatron"):
        extra = {"deterministic_mode": True} if mode == "megatron" else {}
        shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16, extra=extra)
        inputs, grad = _layer_inputs(shape, tokens, seed=300)
        dv2.configure(backend="deepep", host_sync=False, num_max_tokens_per_rank=tokens, deterministic=True)
        torch.use_deterministic_algorithms(mode == "megatron")
        try:
            layer = build_moe_layer(shape, "deepepv2", seed=17, sync_free_experts=True)
            static_x = inputs[0].clone().requires_grad_()
            layer_step(layer, static_x, grad)
            graph, static_y = capture_layer_step(layer, static_x, grad)
            static = {"output": static_y, "grad_x": static_x.grad}
            static.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
            eager_x = inputs[1].clone().requires_grad_()
            eager = _snapshot(layer, eager_x, layer_step(layer, eager_x, grad))
            eager_copies = _device_to_host_copies(lambda: layer_step(layer, eager_x, grad))
            replays = []
            for _ in range(10):
                static_x.data.copy_(inputs[1])
                graph.replay()
                torch.cuda.synchronize()
                replays.append({name: tensor.detach().clone() for name, tensor in static.items()})
            replay_copies = _device_to_host_copies(graph.replay)
            assert replays[0].keys() == eager.keys(), (replays[0].keys(), eager.keys())
            for i, replayed in enumerate(replays):
                for name in eager:
                    exact(f"{mode} replay {i} {name}", replayed[name], eager[name])
            assert not eager_copies and not replay_copies, f"device-to-host copies: {eager_copies} / {replay_copies}"
            log(f"  {mode}: 10 replays bitwise equal to each other and to eager ({len(eager)} tensors); no "
                "device-to-host copy in an eager step or a replay")
        finally:
            torch.use_deterministic_algorithms(False)
            graph = layer = None
            dv2.destroy_buffers()
    dv2.configure(host_sync=True, num_max_tokens_per_rank=None, deterministic=False)


def _graph_layer(backend: str, shape, tokens: int):
    from megatron_deepepv2.testing.moe_model import build_moe_layer

    dv2.configure(backend=backend, host_sync=False, num_max_tokens_per_rank=tokens,
                  deterministic=False)
    return build_moe_layer(shape, "deepepv2", seed=13, sync_free_experts=True)


def _layer_inputs(shape, tokens: int, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Three ``[T, 1, H]`` BF16 inputs of a layer and one output gradient, on the GPU (per rank)."""
    gen = torch.Generator().manual_seed(seed + RANK)
    inputs = [torch.randn(tokens, 1, shape.hidden, generator=gen).to(torch.bfloat16).cuda() for _ in range(3)]
    return inputs, torch.randn(tokens, 1, shape.hidden, generator=gen).to(torch.bfloat16).cuda()


def _snapshot(layer, x, y):
    return {"output": y.detach().clone(), "grad_x": x.grad.clone(),
            **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}}


@case
def moe_layer_cuda_graph_replay_equals_eager() -> None:
    """No host sync: a deepepv2 MoELayer forward+backward captured in one torch.cuda.CUDAGraph replays equal to eager
    on new inputs. Reference backend: every tensor bitwise. DeepEP (rows arrive in atomic order without
    deterministic mode, which needs host syncs): output, input and router gradients bitwise, expert weight
    gradients within BF16 tolerance."""
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig

    dv2.install()
    shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16)
    tokens = 512
    inputs, grad = _layer_inputs(shape, tokens, seed=100)
    for backend in ("reference", "deepep"):
        layer = _graph_layer(backend, shape, tokens)
        static_x = inputs[0].clone().requires_grad_()
        layer_step(layer, static_x, grad)  # an eager step on the default stream first, as in a training loop
        graph, static_y = capture_layer_step(layer, static_x, grad)
        # The gradients allocated during capture are the memory every replay writes.
        static_grads = {"output": static_y, "grad_x": static_x.grad}
        static_grads.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
        for i, x_new in enumerate(inputs[1:]):
            eager_x = x_new.clone().requires_grad_()
            eager = _snapshot(layer, eager_x, layer_step(layer, eager_x, grad))
            static_x.data.copy_(x_new)
            graph.replay()
            torch.cuda.synchronize()
            replayed = {name: tensor.detach() for name, tensor in static_grads.items()}
            assert replayed.keys() == eager.keys(), (replayed.keys(), eager.keys())
            for name in eager:
                expert_weight = "experts" in name
                if backend == "deepep" and expert_weight:
                    torch.testing.assert_close(replayed[name], eager[name], rtol=2e-2, atol=2e-2,
                                               msg=f"{backend} replay {i} {name}")
                else:
                    exact(f"{backend} replay {i} {name}", replayed[name], eager[name])
        log(f"  {backend}: graph replays equal eager on 2 new inputs")
        timings = {label: median_us(run, 10, 2, cuda=True)
                   for label, run in (("eager", lambda: layer_step(layer, eager_x, grad)), ("graph", graph.replay))}
        log(f"  {backend}: forward+backward eager {timings['eager']:.0f} us, graph replay {timings['graph']:.0f} us "
            f"(T={tokens} H={shape.hidden} E={shape.num_experts} top-{shape.topk})")
        graph = layer = None
        dv2.destroy_buffers()
    dv2.configure(host_sync=True, num_max_tokens_per_rank=None)


@case
def receive_bound_captured_in_a_cuda_graph() -> None:
    """No host sync with a receive bound that drops rows (``moe_expert_rank_capacity_factor`` 0.75 keeps 3/4 of a
    balanced receive, and a balanced receive is all of it at EP=1): the layer's forward+backward, with the bound's
    copy and restore, captures in a CUDA graph on both backends. Reference backend: every replay bitwise equal to
    eager. DeepEP (an expert's rows arrive in atomic order, so which rows of the block the bound cuts are kept
    varies): the dropped selections counted and the over-budget flag equal eager's, the output is finite."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig

    if "moe_expert_rank_capacity_factor" not in TransformerConfig.__dataclass_fields__:
        raise AssertionError("this megatron-core has no moe_expert_rank_capacity_factor (0.19 has)")
    dv2.install()
    shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16,
                          extra={"moe_expert_rank_capacity_factor": 0.75})
    tokens = 512
    inputs, grad = _layer_inputs(shape, tokens, seed=200)
    for backend in ("reference", "deepep"):
        layer = _graph_layer(backend, shape, tokens)
        dispatcher = layer.token_dispatcher
        manager = dispatcher._comm_manager
        static_x = inputs[0].clone().requires_grad_()
        layer_step(layer, static_x, grad)
        graph, static_y = capture_layer_step(layer, static_x, grad)
        static_grads = {"output": static_y, "grad_x": static_x.grad}
        static_grads.update({n: p.grad for n, p in layer.named_parameters() if p.grad is not None})
        for i, x_new in enumerate(inputs[1:]):
            dispatcher.reset_over_budget()
            eager_x = x_new.clone().requires_grad_()
            eager = _snapshot(layer, eager_x, layer_step(layer, eager_x, grad))
            eager_dropped = int(manager.dropped_rows)
            assert eager_dropped > 0 and bool(dispatcher.check_over_budget()), (backend, eager_dropped)
            dispatcher.reset_over_budget()
            static_x.data.copy_(x_new)
            graph.replay()
            torch.cuda.synchronize()
            assert int(manager.dropped_rows) == eager_dropped, (backend, int(manager.dropped_rows), eager_dropped)
            assert bool(dispatcher.check_over_budget()), backend
            replayed = {name: tensor.detach() for name, tensor in static_grads.items()}
            if backend == "reference":
                for name in eager:
                    exact(f"bounded {backend} replay {i} {name}", replayed[name], eager[name])
            else:
                assert all(bool(torch.isfinite(t.float()).all()) for t in replayed.values()), backend
        log(f"  {backend}: bounded layer captured; replays drop {eager_dropped} selections, as eager")
        graph = layer = None
        dv2.destroy_buffers()
    dv2.configure(host_sync=True, num_max_tokens_per_rank=None)


@case
def shared_expert_overlap_matches_serial() -> None:
    """moe_shared_expert_overlap with deepepv2: output and every parameter gradient bitwise equal to the serial run;
    the input gradient equal up to the order of its three bf16 terms (router, routed experts, shared expert).

    Megatron reorders the backward on purpose with overlap on (``SharedExpertMLP.pre_forward_comm`` gives the
    shared expert's input the highest autograd sequence number, so its backward runs first and overlaps the
    combine), which changes the order in which the three contributions are summed into ``x.grad``. The same layer
    under Megatron's alltoall dispatcher shows the same reordering; it is logged for comparison.
    """
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.install()
    x0 = torch.randn(1024, 1, 1024, generator=torch.Generator().manual_seed(RANK)).to(torch.bfloat16).cuda()
    for dispatcher in ("deepepv2", "alltoall"):
        runs = {}
        for overlap in (False, True):
            shape = TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16,
                                  extra=dict(moe_shared_expert_intermediate_size=1024, moe_shared_expert_overlap=overlap))
            dv2.configure(backend="deepep", deterministic=True)
            layer = build_moe_layer(shape, dispatcher, seed=21)
            assert layer.shared_experts is not None and layer.shared_expert_overlap == overlap
            x = x0.clone().requires_grad_()
            runs[overlap] = _snapshot(layer, x, layer_step(layer, x, torch.ones_like(x0)))
            dv2.destroy_buffers()
        serial, overlapped = runs[False], runs[True]
        assert serial.keys() == overlapped.keys()
        grad_x_diff = (overlapped["grad_x"].float() - serial["grad_x"].float()).abs()
        log(f"  {dispatcher}: shared-expert overlap on vs off, input grad max |diff| {grad_x_diff.max().item():.3e} "
            f"on {(grad_x_diff > 0).float().mean().item():.2%} of elements")
        if dispatcher != "deepepv2":
            continue
        for name in serial:
            if name != "grad_x":
                exact(f"shared-expert overlap {name}", overlapped[name], serial[name])
        # Summation order only: every element within two bf16 roundings of its token's largest gradient (a missing
        # or doubled contribution would be of the order of the gradient itself).
        bound = serial["grad_x"].float().abs().amax(dim=-1, keepdim=True) * 2.0**-6
        assert bool((grad_x_diff <= bound).all()), (
            f"shared-expert overlap grad_x: differs by more than summation order allows "
            f"(worst ratio {(grad_x_diff / bound).max().item():.2f})")
    dv2.configure(deterministic=False)


def _capture(step: Callable[[torch.Tensor], torch.Tensor], static_x: torch.Tensor):
    """``step`` warmed up on a side stream (as ``torch.cuda.graphs`` asks), then captured: ``(graph, static output)``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step(static_x)
    return graph, static_y


@case
def ops_graph_replay_equals_eager() -> None:
    """No host sync: dispatch + combine captured in a CUDA graph replay bitwise equal to eager, for both stream
    modes (synchronous, and Megatron's async + allocate-on-comm-stream) and both backends."""
    x, idx, w, _ = _ops_inputs()
    for backend in ("reference", "deepep"):
        for async_finish, alloc in ((False, False), (True, True)):
            def step(xin):
                out = dv2.dispatch(xin, idx, w, 32, layout="expand", expert_alignment=16,
                                   backend=backend, num_max_tokens_per_rank=1024, host_sync=False,
                                   async_finish=async_finish, allocate_on_comm_stream=alloc)
                y = out.recv_x * out.recv_topk_weights.unsqueeze(1).to(out.recv_x.dtype)
                return dv2.combine(y, out.handle, async_finish=async_finish, allocate_on_comm_stream=alloc)

            static_x = x.clone()
            graph, static_y = _capture(step, static_x)
            diffs = []
            for scale in (1.0, 2.0, 2.0):
                static_x.copy_(x * scale)
                graph.replay()
                torch.cuda.synchronize()
                eager = step(x * scale)
                diff = (static_y.float() - eager.float()).abs()
                diffs.append(diff.max().item() if diff.numel() else 0.0)
            assert diffs == [0.0, 0.0, 0.0], f"{backend} async={async_finish}: max |replay - eager| = {diffs}"
            del graph
        dv2.destroy_buffers()


@case
def host_sync_dispatch_in_graph_capture_raises() -> None:
    """A dispatch with host sync inside CUDA-graph capture raises at once (DeepEP would spin in its CPU wait until its
    300 s timeout for counts the captured kernels never write); without host sync the capture works."""
    x, idx, w, _ = _ops_inputs()
    kwargs = dict(backend="deepep", num_max_tokens_per_rank=1024, layout="expand", expert_alignment=16)
    dv2.dispatch(x, idx, w, 32, **kwargs)  # builds the buffer, eagerly
    torch.cuda.synchronize()
    for check_ids in (True, False):  # Megatron's layers skip the id check (ids valid by construction)
        graph = torch.cuda.CUDAGraph()
        start = time.perf_counter()
        try:
            with dv2.settings_override(check_ids=check_ids), torch.cuda.graph(graph):
                dv2.dispatch(x, idx, w, 32, **kwargs)
        except RuntimeError as error:
            assert "host sync inside CUDA-graph capture" in str(error), error
        else:
            raise AssertionError("a host-sync dispatch was captured")
        assert time.perf_counter() - start < 10, time.perf_counter() - start
        del graph
    torch.cuda.synchronize()
    graph, _ = _capture(lambda xin: dv2.dispatch(xin, idx, w, 32, host_sync=False, **kwargs).recv_x, x)
    graph.replay()
    torch.cuda.synchronize()
    del graph
    dv2.destroy_buffers()


@case
def bad_ids_with_host_sync_raise_in_seconds() -> None:
    """Default id check, host sync, the GPU busy with earlier work: a ValueError naming the token within seconds (not
    a device assert followed by DeepEP's 300 s CPU wait), and the process goes on: the next dispatch is right."""
    x, idx, w, _ = _ops_inputs()
    kwargs = dict(backend="deepep", num_max_tokens_per_rank=1024)
    want = dv2.dispatch(x, idx, w, 32, backend="reference", num_max_tokens_per_rank=1024)
    dv2.dispatch(x, idx, w, 32, **kwargs)
    torch.cuda.synchronize()
    for token, ids in ((5, (3, 3)), (7, (32, 1))):  # an expert twice, an id past the experts
        bad = idx.clone()
        bad[token, :2] = torch.tensor(ids, device=bad.device)
        start = time.perf_counter()
        torch.cuda._sleep(1 << 30)  # about half a second of queued GPU work before the check
        try:
            dv2.dispatch(x, bad, w, 32, **kwargs)
        except ValueError as error:
            assert f"token {token}" in str(error), error
        else:
            raise AssertionError(f"bad ids {ids} of token {token} were dispatched")
        assert time.perf_counter() - start < 10, time.perf_counter() - start
    # Rows arrive in atomic order without deterministic mode: compare the round trip (combine sums in slot order).
    got = dv2.dispatch(x, idx, w, 32, **kwargs)
    exact("round trip after the error", dv2.combine(got.recv_x, got.handle), dv2.combine(want.recv_x, want.handle))
    dv2.destroy_buffers()


@case
def no_host_sync_combine_backward_tail_rows_are_zero() -> None:
    """Without host sync, the combine's backward hands the experts worst-case rows: those past the valid extent are
    zero (on memory the allocator hands out full of NaNs), so a bias gradient summed over every row equals the
    reference backend's."""
    x, idx, w, grad = _ops_inputs()
    for layout in ("compact", "expand"):
        results = {}
        for backend in ("reference", "deepep"):
            poison = torch.full((1 << 29,), float("nan"), dtype=torch.bfloat16, device="cuda")
            del poison  # the allocator's cached 1 GiB block now holds NaNs
            bias = torch.zeros(x.shape[1], dtype=torch.bfloat16, device="cuda", requires_grad=True)
            out = dv2.dispatch(x, idx, w, 32, layout=layout, expert_alignment=16 if layout == "expand" else 1, backend=backend, num_max_tokens_per_rank=1024,
                               host_sync=False)
            grads = {}
            y = out.recv_x + bias

            def keep_rows_gradient(gradient: torch.Tensor) -> None:
                grads["rows"] = gradient.detach().clone()

            y.register_hook(keep_rows_gradient)
            dv2.combine(y, out.handle).backward(grad)
            torch.cuda.synchronize()
            valid = int(out.handle.num_valid_rows)
            assert valid < y.shape[0], (valid, y.shape)  # there are tail rows
            tail = grads["rows"][valid:]
            assert not tail.any() and not tail.isnan().any(), (
                f"{backend} {layout}: {int((tail != 0).sum())} nonzero tail gradient values")
            results[backend] = bias.grad
        # Rows arrive in atomic order without deterministic mode, so the bias gradient's sum order may differ.
        torch.testing.assert_close(results["deepep"], results["reference"], rtol=1e-2, atol=1e-2,
                                   msg=f"{layout} bias gradient")
    dv2.destroy_buffers()


@case
def expand_padding_rows_are_zero_on_nan_memory() -> None:
    """Expand with alignment 16 and ``zero_padding`` left at its default, on memory the allocator hands out full of
    NaNs: padding rows and their weights are zero (equal to the reference backend's rows bitwise), so a grouped GEMM's
    weight gradient over whole blocks stays finite, with and without host sync (where DeepEP is not deterministic,
    each block's rows are compared in a canonical order)."""
    x, idx, w, _ = _ops_inputs()
    for host_sync in (True, False):
        results = {}
        for backend in ("reference", "deepep"):
            poison = torch.full((1 << 29,), float("nan"), dtype=torch.bfloat16, device="cuda")
            del poison  # the allocator's cached 1 GiB block now holds NaNs
            out = dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16, backend=backend,
                               num_max_tokens_per_rank=1024, host_sync=host_sync, deterministic=host_sync)
            valid = int(out.handle.num_valid_rows)
            counts = out.tokens_per_expert.tolist()
            rows, weights = out.recv_x[:valid], out.recv_topk_weights[:valid]
            # The weight gradient of one linear layer per expert block with an all-ones output gradient: X^T 1.
            weight_grads = [block.float().t() @ torch.ones(len(block), 1, device="cuda")
                            for block in rows.split(counts) if len(block)]
            assert all(g.isfinite().all() for g in weight_grads), f"{backend} host_sync={host_sync}: NaN in dW"
            assert weights.isfinite().all(), f"{backend} host_sync={host_sync}: NaN padding weights"
            order = torch.cat([start + (block.float().sum(1) + blockw).argsort(stable=True)
                               for start, block, blockw in zip(torch.tensor([0, *counts]).cumsum(0).tolist(),
                                                               rows.split(counts), weights.split(counts))])
            results[backend] = (rows[order].clone(), weights[order].clone())
        exact(f"host_sync={host_sync} rows", results["deepep"][0], results["reference"][0])
        exact(f"host_sync={host_sync} weights", results["deepep"][1], results["reference"][1])
    dv2.destroy_buffers()


@case
def micro_batches_in_flight_across_rebuilds() -> None:
    """Four micro-batches' forwards, then their backwards in reverse order, with the token count growing twice: the
    ElasticBuffer is rebuilt while earlier handles still wait for their backward. Outputs and gradients equal the
    reference backend's run of the same schedule bitwise; the superseded buffers are kept while in use and
    destroyed at the next build after."""
    from megatron_deepepv2 import buffers

    def schedule(backend: str):
        steps = []
        for i, tokens in enumerate((64, 200, 48, 700)):  # capacity 128, then 256 and 1024: two rebuilds
            x, idx, w = make_routing(tokens + 3 * RANK, 1024, 32, 8, seed=50 + i + RANK)
            x, w = x.requires_grad_(), w.requires_grad_()
            out = dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16,
                               backend=backend)
            y = out.recv_x * out.recv_topk_weights.unsqueeze(1).to(out.recv_x.dtype)
            steps.append((x, w, dv2.combine(y, out.handle)))
        retired_while_pending = sum(b.name == backend for b in buffers.retired_buffers())
        results = []
        for x, w, y in reversed(steps):
            y.backward((y.detach().float() * 0.5 + 1).to(y.dtype))
            results.append((y.detach(), x.grad, w.grad))
        return results, retired_while_pending

    want, _ = schedule("reference")
    got, retired_while_pending = schedule("deepep")
    assert retired_while_pending >= 2, retired_while_pending  # both superseded buffers outlived their rebuild
    for index, (a, b) in enumerate(zip(got, want)):
        for name, tensor_a, tensor_b in zip(("output", "grad_x", "grad_weights"), a, b):
            exact(f"micro-batch {3 - index} {name}", tensor_a, tensor_b)
    del got, want
    # No dispatch releases them (nothing runs per call for retired buffers); the next build on the group does.
    x, idx, w = make_routing(16, 1024, 32, 8, seed=60 + RANK)
    dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16, backend="deepep")
    assert len([b for b in buffers.retired_buffers() if b.name == "deepep"]) == retired_while_pending
    x, idx, w = make_routing(16, 2048, 32, 8, seed=60 + RANK)
    dv2.dispatch(x, idx, w, 32, layout="expand", expert_alignment=16, backend="deepep")
    assert not [b for b in buffers.retired_buffers() if b.name == "deepep"], buffers.retired_buffers()
    dv2.destroy_buffers()


def _allocation_stream(tensor: torch.Tensor) -> int:
    """The CUDA stream whose pool the caching allocator took ``tensor``'s memory from."""
    address = tensor.data_ptr()
    for segment in torch.cuda.memory._snapshot()["segments"]:
        if segment["address"] <= address < segment["address"] + segment["total_size"]:
            return segment["stream"]
    raise AssertionError("tensor not found in the allocator's segments")


@case
def synchronous_calls_allocate_on_the_current_stream() -> None:
    """``allocate_on_comm_stream=True`` without ``async_finish``: DeepEP records outputs on the compute stream only in
    async mode, so a synchronous call's outputs must come from the current stream's pool (memory of the
    communication stream's pool would go back to that stream when freed while compute kernels still read it).
    Dispatch, combine and both backwards; results equal the default-stream run."""
    x, idx, w, grad = _ops_inputs()
    current = torch.cuda.current_stream().cuda_stream
    baseline = _ops_run("deepep", "compact", (x, idx, w, grad))
    streams = {}
    xg = x.clone().requires_grad_()
    out = dv2.dispatch(xg, idx, w, 32, backend="deepep", num_max_tokens_per_rank=1024, allocate_on_comm_stream=True)
    streams["dispatch"] = _allocation_stream(out.recv_x)
    y = out.recv_x * out.recv_topk_weights.sum(dim=1, keepdim=True).to(out.recv_x.dtype)

    def record_stream_of(gradient: torch.Tensor) -> None:  # the combine backward's output (a cached dispatch)
        streams["combine backward"] = _allocation_stream(gradient)

    y.register_hook(record_stream_of)
    combined = dv2.combine(y, out.handle, allocate_on_comm_stream=True)
    streams["combine"] = _allocation_stream(combined)
    combined.backward(grad)
    streams["dispatch backward"] = _allocation_stream(xg.grad)
    assert all(stream == current for stream in streams.values()), (current, streams)
    exact("output", combined.detach(), baseline[0])
    exact("grad_x", xg.grad, baseline[1])
    dv2.destroy_buffers()


@case
def fp8_dispatch_matches_reference() -> None:
    """FP8 dispatch (BF16 in, e4m3 + 1x128 scales on the wire, BF16 rows out, BF16 gradients) over ElasticBuffer
    equals the reference backend's: the same quantiser and an exchange that is bitwise equal for FP8 pairs, so output,
    input and weight gradients are bitwise equal, both layouts, with and without host sync; and they differ from the
    BF16 dispatch (the quantisation happened)."""
    inputs = _ops_inputs()
    for layout in ("compact", "expand"):
        bf16 = _ops_run("deepep", layout, inputs)
        for host_sync in (True, False):
            want = _ops_run("reference", layout, inputs, host_sync=host_sync, fp8_dispatch=True)
            got = _ops_run("deepep", layout, inputs, host_sync=host_sync, fp8_dispatch=True)
            for name, a, b in zip(("output", "grad_x", "grad_probs"), got, want):
                exact(f"fp8 {layout} host_sync={host_sync} {name}", a, b)
            assert not torch.equal(got[0], bf16[0]), f"fp8 {layout}: the output equals the BF16 dispatch's"
    # Captured in a CUDA graph without host sync, the FP8 step replays equal to eager on new inputs.
    x, idx, w, _ = inputs

    def step(xin: torch.Tensor) -> torch.Tensor:
        out = dv2.dispatch(xin, idx, w, 32, layout="expand", expert_alignment=16, backend="deepep",
                           num_max_tokens_per_rank=1024, host_sync=False, fp8_dispatch=True)
        return dv2.combine(out.recv_x * out.recv_topk_weights.unsqueeze(1).to(out.recv_x.dtype), out.handle)

    static_x = x.clone()
    graph, static_y = _capture(step, static_x)
    for scale in (1.0, 3.0):
        static_x.copy_(x * scale)
        graph.replay()
        torch.cuda.synchronize()
        exact(f"fp8 graph replay x{scale}", static_y, step(x * scale))
    del graph
    dv2.destroy_buffers()


@case
def fp8_layer_buffer_fits_combine_backward() -> None:
    """FP8 dispatch at DeepSeek-V3's shape (H 7168, top-8 of 64 experts) with 32,768 rows per rank in the group: the
    forward sends FP8 rows, combine's backward sends BF16 ones through the same buffer, so a buffer sized for FP8
    rows fails that cached dispatch (DeepEP asserts the size on every call). Forward and backward complete and equal
    the reference backend's; at EP=1 the output also equals a dense computation."""
    from megatron_deepepv2 import fp8

    world, hidden, experts, topk = dist.get_world_size(), 7168, 64, 8
    tokens = 32768 // world
    x, idx, w = make_routing(tokens, hidden, experts, topk, seed=71 + RANK, drop=0.0)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(5 + RANK)).to(torch.bfloat16).cuda()
    results = {}
    for backend in ("deepep", "reference"):
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = dv2.dispatch(xg, idx, wg, experts, layout="expand", backend=backend, num_max_tokens_per_rank=tokens,
                           fp8_dispatch=True)
        combined = dv2.combine(out.recv_x * out.recv_topk_weights.unsqueeze(1).to(out.recv_x.dtype), out.handle)
        combined.backward(grad)
        torch.cuda.synchronize()
        results[backend] = (combined.detach(), xg.grad, wg.grad)
        del out, combined
    for name, a, b in zip(("output", "grad_x", "grad_probs"), results["deepep"], results["reference"]):
        exact(f"fp8 H{hidden} T{tokens} {name}", a, b)
    if world == 1:  # every selection is local: out[t] = sum_k w[t, k] * dequant(quant(x[t]))
        rows = fp8.dequantize_e4m3_1x128_torch(*fp8.quantize_e4m3_1x128_torch(x))
        weights = w.masked_fill(idx < 0, 0).to(torch.bfloat16)  # token 0 selects no expert
        dense = (rows.unsqueeze(1) * weights.unsqueeze(2)).float().sum(dim=1).to(torch.bfloat16)
        torch.testing.assert_close(results["deepep"][0], dense, rtol=2e-2, atol=2e-2)
    dv2.destroy_buffers()


@case
def sizing_model_matches_deepep() -> None:
    """The package's model of DeepEP's buffer arithmetic gives the size DeepEP itself computes for the group, in
    direct mode, BF16 and FP8, over several shapes (megatron_deepepv2.backends.deepep.sizing is what the CPU tests
    check every shape and group size with)."""
    from deep_ep import ElasticBuffer

    from megatron_deepepv2.backends.deepep.sizing import Topology, calculated_buffer_bytes

    group, world = dist.group.WORLD, dist.get_world_size()
    topology = Topology(1, world, True)  # one node, direct mode
    for tokens, hidden, topk in ((4096, 7168, 8), (32768, 7168, 8), (8192, 2048, 8), (4096, 4096, 2),
                                 (1024, 2880, 4), (333, 1024, 32), (16384, 4096, 0)):
        for use_fp8 in (False, True):
            deepep = ElasticBuffer.get_buffer_size_hint(group, tokens, hidden, topk, use_fp8, allow_hybrid_mode=False)
            model = calculated_buffer_bytes(tokens, hidden, topk, use_fp8, topology)
            assert deepep == model, f"T{tokens} H{hidden} K{topk} fp8={use_fp8}: DeepEP {deepep} B, model {model} B"


if __name__ == "__main__":
    sys.exit(CASES.main(sys.argv[1:], what=__doc__.split("\n\n")[0]))
