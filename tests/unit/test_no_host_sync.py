"""No-host-sync mode on CPU: worst-case sizing, device-side counts, no host reads, same results.

The reference backend runs the mode over gloo with its fixed-block transport. Every case compares the
no-host-sync path with the dense oracle and with the host-synchronised path, and runs the whole
forward/backward with ``Tensor.item`` / ``Tensor.tolist`` / ``int(tensor)`` / ``bool(tensor)`` made to
raise, so a host read anywhere on the deepepv2 path fails the test.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Iterator

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2.layout import ExpertLayout, worst_case_recv_rows
from megatron_deepepv2.testing.moe_model import dispatch_stages
from tests.distributed import run_distributed
from tests.oracle import dense_moe, experts_on_compact, experts_on_expand, make_problem

HIDDEN, EXPERTS, TOPK = 16, 8, 3
TOKENS = {2: [9, 0], 4: [7, 0, 12, 3]}
CAPACITY = 16  # num_max_tokens_per_rank: every rank's batch fits


class HostRead(AssertionError):
    """A device value was read on the host inside :func:`no_host_reads`."""


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Makes every Python-level device-to-host read of a tensor raise for the block."""
    names = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def forbid(name: str):
        def read(self, *args, **kwargs):
            raise HostRead(f"Tensor.{name}() read a device value on the host")

        return read

    for name in names:
        setattr(torch.Tensor, name, forbid(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def _roundtrip(rank: int, world: int, layout: str, alignment: int) -> None:
    dv2.configure(num_max_tokens_per_rank=CAPACITY, validate=False)  # validation reads the host by design
    local = EXPERTS // world
    problem = make_problem(7, TOKENS[world], HIDDEN, EXPERTS, TOPK)
    rows = problem.rows(rank)
    mine = slice(rank * local, (rank + 1) * local)
    idx = problem.topk_idx[rows]
    kwargs = dict(layout=layout, expert_alignment=alignment)

    synced = dv2.dispatch(problem.x[rows], idx, problem.topk_weights[rows], EXPERTS, **kwargs)
    x = problem.x[rows].clone().requires_grad_()
    w = problem.topk_weights[rows].clone().requires_grad_()
    local_w = problem.expert_weights[mine].clone().requires_grad_()
    with no_host_reads():
        result = dv2.dispatch(x, idx, w, EXPERTS, host_sync=False, **kwargs)
    handle = result.handle
    assert handle.tokens_per_expert_list is None and not handle.config.host_sync
    expected_rows = worst_case_recv_rows(
        ExpertLayout.parse(layout), group_size=world, num_max_tokens_per_rank=CAPACITY, num_topk=TOPK,
        num_local_experts=local, expert_alignment=alignment,
    )
    assert result.recv_x.shape[0] == handle.num_recv_rows == expected_rows
    assert result.tokens_per_expert.tolist() == synced.handle.tokens_per_expert_list

    # Valid rows first, identical to the synchronised output; the tail is zero, with id -1 and weight 0.
    valid = int(handle.num_valid_rows)
    assert valid == synced.recv_x.shape[0]
    assert torch.equal(result.recv_x[:valid], synced.recv_x)
    assert torch.equal(result.recv_topk_weights[:valid], synced.recv_topk_weights)
    assert not result.recv_x[valid:].any() and not result.recv_topk_weights[valid:].any()
    if layout == "compact":
        assert torch.equal(result.recv_topk_idx[:valid], synced.recv_topk_idx)
        assert (result.recv_topk_idx[valid:] == -1).all()

    # Experts fill the tail with garbage: combine must ignore it. Then compare with the dense oracle.
    counts = result.tokens_per_expert.tolist()
    if layout == "expand":
        head = experts_on_expand(result.recv_x[:valid], result.recv_topk_weights[:valid], counts, local_w)
    else:
        head = experts_on_compact(result.recv_x[:valid], result.recv_topk_idx[:valid],
                                  result.recv_topk_weights[:valid], local_w)
    garbage = torch.full((expected_rows - valid, HIDDEN), 1e6, dtype=head.dtype)
    expert_out = torch.cat([head, garbage])
    with no_host_reads():
        y = dv2.combine(expert_out, handle)
        (y * problem.grad_out[rows]).sum().backward()

    gx = problem.x.clone().requires_grad_()
    gw = problem.topk_weights.clone().requires_grad_()
    gexp = problem.expert_weights.clone().requires_grad_()
    (dense_moe(gx, problem.topk_idx, gw, gexp) * problem.grad_out).sum().backward()
    tol = dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, dense_moe(problem.x, problem.topk_idx, problem.topk_weights,
                                            problem.expert_weights)[rows], **tol)
    torch.testing.assert_close(x.grad, gx.grad[rows], **tol)
    torch.testing.assert_close(w.grad, gw.grad[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(local_w.grad, gexp.grad[mine], **tol)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_no_host_sync_roundtrip(world: int, layout: str) -> None:
    run_distributed(_roundtrip, world, layout, 4 if layout == "expand" else 1)


def test_no_host_sync_roundtrip_alignment_128() -> None:
    run_distributed(_roundtrip, 2, "expand", 128)


def _cached_and_fp8(rank: int, world: int) -> None:
    dv2.configure(num_max_tokens_per_rank=CAPACITY, host_sync=False, validate=False)  # the setting
    problem = make_problem(9, TOKENS[world], HIDDEN, EXPERTS, TOPK)
    rows = problem.rows(rank)
    idx, w = problem.topk_idx[rows], problem.topk_weights[rows]
    for layout in ("compact", "expand"):
        first = dv2.dispatch(problem.x[rows], idx, w, EXPERTS, layout=layout, expert_alignment=4)
        assert not first.handle.config.host_sync
        with no_host_reads():
            cached = first.handle.buffer.cached_dispatch(problem.grad_out[rows], first.handle, w)
        fresh = dv2.dispatch(problem.grad_out[rows], idx, w, EXPERTS, layout=layout, expert_alignment=4)
        assert torch.equal(cached.recv_x, fresh.recv_x)
        x_fp8 = problem.x[rows].to(torch.float8_e4m3fn)
        scales = torch.rand(x_fp8.shape[0], 2, generator=torch.Generator().manual_seed(rank))
        fp8 = dv2.dispatch((x_fp8, scales), idx, None, EXPERTS, layout=layout, expert_alignment=4)
        plain = dv2.dispatch(problem.x[rows].float(), idx, None, EXPERTS, layout=layout, expert_alignment=4)
        assert torch.equal(fp8.recv_x[0].view(torch.uint8), plain.recv_x.to(torch.float8_e4m3fn).view(torch.uint8))


def test_no_host_sync_cached_dispatch_and_fp8() -> None:
    run_distributed(_cached_and_fp8, 4)


def test_no_host_sync_setting_from_environment() -> None:
    from megatron_deepepv2.config import DeepepV2Settings

    assert DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_NO_HOST_SYNC": "1"}).host_sync is False
    assert DeepepV2Settings.from_env({}).host_sync is True
    with pytest.raises(ValueError, match="MEGATRON_DEEPEPV2_NO_HOST_SYNC='maybe' is not a boolean"):
        DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_NO_HOST_SYNC": "maybe"})


def test_deepep_takes_no_host_sync_with_deterministic_where_its_handle_allows(monkeypatch) -> None:
    """Deterministic mode without host sync resolves on DeepEP when the installed handle exposes what the order reads,
    and is refused, naming it, when it does not."""
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend

    monkeypatch.setattr(DeepEPBackend, "deterministic_order_unavailable_reason", classmethod(
        lambda cls, host_sync: None if host_sync else "EPHandle does not expose recv_src_metadata."))
    with pytest.raises(ValueError, match="without host sync is not available on the deepep backend as installed: "
                                         "EPHandle does not expose recv_src_metadata"):
        dv2.resolve_config(backend=DeepEPBackend, host_sync=False, deterministic=True)
    assert dv2.resolve_config(backend=DeepEPBackend, host_sync=False, deterministic=False).host_sync is False
    assert dv2.resolve_config(backend=DeepEPBackend, host_sync=True, deterministic=True).settings.deterministic
    monkeypatch.setattr(DeepEPBackend, "deterministic_order_unavailable_reason", classmethod(lambda cls, host_sync: None))
    config = dv2.resolve_config(backend=DeepEPBackend, host_sync=False, deterministic=True)
    assert config.settings.deterministic and not config.host_sync


# ----------------------------------------------------------------------------------------------
# Megatron MoELayer
# ----------------------------------------------------------------------------------------------
def _setup() -> None:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    dv2.install()


def _moe_layer(rank: int, world: int, alignment: int) -> dict:
    _setup()
    from megatron.core.transformer.moe import moe_utils

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    moe_utils.get_align_size_for_quantization = lambda config: alignment
    shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3)
    reference = build_moe_layer(shape, "alltoall")
    dv2.configure(host_sync=False, num_max_tokens_per_rank=16, validate=False)
    layer = build_moe_layer(shape, "deepepv2", sync_free_experts=True)
    layer.load_state_dict(reference.state_dict())  # same parameters as SequentialMLP
    x = torch.randn([12, 5, 16, 9][rank], 1, shape.hidden, generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(99 + rank))

    def run(module, staged: bool):
        xin = x.clone().requires_grad_()
        module.zero_grad()
        y = _forward_deepepv2_without_host_reads(module, xin) if staged else module(xin)[0]
        with no_host_reads() if staged else contextlib.nullcontext():
            (y * grad).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        return y.detach(), xin.grad, _per_expert_names(grads)

    expected = run(reference, False)
    layer(x)[0].sum().backward()  # warm-up: builds the buffer (a collective, outside the checked region)
    actual = run(layer, True)
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    assert actual[2].keys() == expected[2].keys()
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name], rtol=1e-5, atol=1e-6, msg=name)
    return {}


def _per_expert_names(grads: dict) -> dict:
    """SyncFreeSequentialMLP's stacked weight gradients under SequentialMLP's per-expert parameter names."""
    renamed = {}
    for name, grad in grads.items():
        stacked = {"experts.weight1": "linear_fc1", "experts.weight2": "linear_fc2"}.get(name)
        if stacked is None:
            renamed[name] = grad
            continue
        for index, expert_grad in enumerate(grad):
            renamed[f"experts.local_experts.{index}.{stacked}.weight"] = expert_grad
    return renamed


def _forward_deepepv2_without_host_reads(layer, x: torch.Tensor) -> torch.Tensor:
    """The MoELayer forward, stage by stage: every dispatcher and expert stage runs with host reads forbidden."""
    hidden_states = x
    probs, routing_map = layer.router(hidden_states)
    dispatcher = layer.token_dispatcher
    with no_host_reads():
        hidden, tokens_per_expert, probs = dispatch_stages(dispatcher, hidden_states, routing_map, probs)
        out, _ = layer.experts(hidden, tokens_per_expert, probs)
        out = dispatcher.combine_preprocess(out)
        out = dispatcher.token_combine(out)
        return dispatcher.combine_postprocess(out)


@pytest.mark.parametrize("alignment", [1, 16])
def test_moe_layer_without_host_sync_matches_alltoall(alignment: int) -> None:
    run_distributed(_moe_layer, 4, alignment, timeout=180)


def _unsupported(rank: int, world: int) -> list[str]:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    errors = []
    shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=4, topk=2)
    with dv2.settings_override(host_sync=False):
        with pytest.raises(ValueError) as excinfo:
            build_moe_layer(shape, "deepepv2")  # plain SequentialMLP
        errors.append(str(excinfo.value))
    build_moe_layer(shape, "deepepv2")  # with host sync SequentialMLP is fine
    return errors


def test_no_host_sync_rejects_experts_that_read_counts_on_the_host() -> None:
    errors = run_distributed(_unsupported, 2)[0]
    assert "SequentialMLP reads tokens_per_expert on the host" in errors[0]
    assert "SyncFreeSequentialMLP" in errors[0]


def _op_fuser_experts(graph_safe: bool, monkeypatch: pytest.MonkeyPatch):
    """``TEGroupedMLP`` experts on the op-fuser path, and Transformer Engine's path predicate answering ``graph_safe``
    (stand-in modules: Transformer Engine does not import here)."""
    import sys
    from types import ModuleType

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig

    asked = []

    def is_op_fuser_grouped_tensor_path_supported(recipe, dtype):
        asked.append((recipe, dtype))
        return graph_safe

    grouped_linear = ModuleType("transformer_engine.pytorch.ops.basic.grouped_linear")
    grouped_linear.is_op_fuser_grouped_tensor_path_supported = is_op_fuser_grouped_tensor_path_supported
    monkeypatch.setitem(sys.modules, grouped_linear.__name__, grouped_linear)
    tex = ModuleType("transformer_engine_torch")
    tex.get_cublasLt_version = lambda: 130100
    monkeypatch.setitem(sys.modules, "transformer_engine_torch", tex)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    shape = TinyMoEConfig(params_dtype=torch.bfloat16)
    experts = TEGroupedMLP.__new__(TEGroupedMLP)  # the attributes the check reads, without TE's modules
    experts.__dict__.update(_with_fused_impl=True, config=SimpleNamespace(fp8=None, fp4=None,
                                                                           params_dtype=shape.params_dtype))
    return experts, asked


def test_op_fuser_experts_without_host_sync_need_transformer_engines_graph_safe_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """TEGroupedMLP through TE's op fuser takes device counts only where TE's GroupedLinear takes its graph-safe path
    (TE's own predicate, asked with the layer's dtype and recipe); elsewhere TE splits on the host and the layer is
    refused, saying why and what works."""
    from megatron_deepepv2.mcore import experts as experts_module

    experts, asked = _op_fuser_experts(False, monkeypatch)
    with pytest.raises(ValueError) as refused:
        experts_module.check_experts_take_device_counts(experts)
    message = str(refused.value)
    assert "splits the rows with tokens_per_expert.tolist()" in message and "cuBLASLt 13.1" in message, message
    assert "SM90" in message and "SyncFreeSequentialMLP" in message, message
    assert asked == [(None, torch.bfloat16)]

    experts, asked = _op_fuser_experts(True, monkeypatch)
    monkeypatch.setattr(experts_module, "_warned_never_run_op_fuser", False)
    with _captured_warnings("megatron_deepepv2.mcore.experts") as warnings:
        experts_module.check_experts_take_device_counts(experts)
        experts_module.check_experts_take_device_counts(experts)
    assert len(warnings) == 1 and "never run" in warnings[0], warnings


@contextlib.contextmanager
def _captured_warnings(logger_name: str) -> Iterator[list[str]]:
    import logging

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def _experts_setting(rank: int, world: int) -> list[str]:
    _setup()
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3)
    reference = {name: build_moe_layer(shape, name) for name in ("alltoall", "allgather")}
    with dv2.settings_override(host_sync=False, experts="sync_free", num_max_tokens_per_rank=16, validate=False):
        layers = {name: build_moe_layer(shape, name) for name in ("alltoall", "allgather", "deepepv2")}
    assert all(type(layer.experts) is SequentialMLP for layer in reference.values())
    x = torch.randn(12, 1, shape.hidden, generator=torch.Generator().manual_seed(rank))
    built = []
    for name, layer in layers.items():
        assert type(layer.experts) is SyncFreeSequentialMLP, (name, type(layer.experts))
        baseline = reference.get(name, reference["alltoall"])
        layer.load_state_dict(baseline.state_dict())  # SequentialMLP's checkpoint keys
        expected = baseline(x)[0]
        if name == "deepepv2":  # another dispatcher: the same sums in another order
            torch.testing.assert_close(layer(x)[0], expected, rtol=1e-5, atol=1e-6)
        else:  # the same dispatcher with the other experts module: the same numbers
            assert torch.equal(layer(x)[0], expected), name
        built.append(f"{name}:{type(layer.experts).__name__}")
    return built


def test_experts_setting_builds_sync_free_experts_from_the_local_spec() -> None:
    """MEGATRON_DEEPEPV2_EXPERTS=sync_free: every layer of an unchanged local spec, whatever its dispatcher, gets
    SyncFreeSequentialMLP (so dispatchers compare with the same experts); behind alltoall and allgather it computes
    what SequentialMLP computes, bit for bit."""
    expected = [f"{name}:SyncFreeSequentialMLP" for name in ("alltoall", "allgather", "deepepv2")]
    assert run_distributed(_experts_setting, 2) == [expected] * 2


def test_experts_setting_rejects_other_experts_and_unknown_values(monkeypatch) -> None:
    import dataclasses

    from megatron.core.transformer.moe.moe_layer import MoESubmodules

    from megatron_deepepv2.mcore.experts import sync_free_submodules

    class GroupedExperts(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="this layer's experts are GroupedExperts"):
        sync_free_submodules(MoESubmodules(experts=GroupedExperts))
    assert dataclasses.is_dataclass(MoESubmodules)
    monkeypatch.setenv("MEGATRON_DEEPEPV2_EXPERTS", "grouped")
    with pytest.raises(ValueError, match="MEGATRON_DEEPEPV2_EXPERTS: 'spec' for"):
        dv2.DeepepV2Settings.from_env()  # the settings check their values when they are read


def _graphs_left_after_a_step(rank: int, world: int, no_host_sync: bool) -> list[str]:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.configure(host_sync=not no_host_sync, num_max_tokens_per_rank=16, validate=False)
    layer = build_moe_layer(TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3), "deepepv2",
                            sync_free_experts=no_host_sync)
    x = torch.randn(12, 1, 32, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    y, _ = layer(x)
    y.sum().backward()
    del y
    dispatcher = layer.token_dispatcher
    holders = {"token_dispatcher": vars(dispatcher), "token_dispatcher._comm_manager": vars(dispatcher._comm_manager)}
    return [f"{owner}.{name} ({type(value.grad_fn).__name__})" for owner, attributes in holders.items()
            for name, value in attributes.items() if isinstance(value, torch.Tensor) and value.grad_fn is not None]


@pytest.mark.parametrize("no_host_sync", [False, True])
def test_dispatcher_keeps_no_autograd_graph_after_a_step(no_host_sync: bool) -> None:
    """A tensor with a grad_fn kept past the step keeps the parameters' gradient accumulators alive, with the
    stream of the step that created them: after an eager step on the default stream, capturing the layer in a
    CUDA graph then failed on the GPUs ("operation would make the legacy stream depend on a capturing blocking
    stream"). The router's probs were such a tensor."""
    for rank_holders in run_distributed(_graphs_left_after_a_step, 2, no_host_sync):
        assert rank_holders == [], f"autograd graph kept after the step by {rank_holders}"


# ----------------------------------------------------------------------------------------------
# Static receive bound (--moe-expert-rank-capacity-factor)
# ----------------------------------------------------------------------------------------------
BOUND_SHAPE = dict(hidden=32, ffn=48, num_experts=8, topk=3)


def _megatron_has_rank_capacity_factor() -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return "moe_expert_rank_capacity_factor" in TransformerConfig.__dataclass_fields__


needs_rank_capacity_factor = pytest.mark.skipif(
    not _megatron_has_rank_capacity_factor(),
    reason="this megatron-core has no moe_expert_rank_capacity_factor (added in 0.19)",
)
BOUND_CAPACITY = 16  # num_max_tokens_per_rank; worst case 2 ranks x 16 x min(3, 4) = 96 rows


def _bounded_step(layer, x: torch.Tensor, grad: torch.Tensor, staged: bool):
    xin = x.clone().requires_grad_()
    layer.zero_grad()
    y = _forward_deepepv2_without_host_reads(layer, xin) if staged else layer(xin)[0]
    (y * grad).sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), xin.grad, grads


def _bounded_layer(rank: int, world: int, factor: float) -> dict:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.configure(host_sync=False, num_max_tokens_per_rank=BOUND_CAPACITY, validate=False)
    plain = build_moe_layer(TinyMoEConfig(**BOUND_SHAPE), "deepepv2", sync_free_experts=True)
    bounded = build_moe_layer(TinyMoEConfig(**BOUND_SHAPE, extra={"moe_expert_rank_capacity_factor": factor}),
                              "deepepv2", sync_free_experts=True)
    bounded.load_state_dict(plain.state_dict())
    tokens = [12, 5][rank]
    expected_bound = min(int(tokens * BOUND_SHAPE["topk"] * factor), 96)  # HybridEP's budget int(T * K * f), align 1
    x = torch.randn(tokens, 1, 32, generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + rank))
    for layer in (plain, bounded):
        layer(x)[0].sum().backward()  # builds the buffer outside the checked region

    rows_seen, valid_rows = [], []

    def note_rows(module, inputs, output):
        rows_seen.append(inputs[0].shape[0])
        valid_rows.append(int(inputs[1].sum()))

    def drop_past_bound(module, inputs, output):
        out, bias = output  # the oracle of a drop: the expert output of rows past the bound is zero
        keep = (torch.arange(out.shape[0]) < expected_bound).unsqueeze(1)
        return torch.where(keep, out, 0), bias

    hook = plain.experts.register_forward_hook(note_rows)
    _bounded_step(plain, x, grad, staged=False)
    hook.remove()
    hook = plain.experts.register_forward_hook(drop_past_bound)
    expected = _bounded_step(plain, x, grad, staged=False)
    hook.remove()

    manager = bounded.token_dispatcher._comm_manager
    bounded.token_dispatcher.reset_over_budget()
    dropped_before = int(manager.dropped_rows)  # the counter runs from the layer's first dispatch on
    seen = []
    hook = bounded.experts.register_forward_hook(lambda m, inputs, out: seen.append((inputs[0].shape[0], inputs[1])))
    actual = _bounded_step(bounded, x, grad, staged=True)  # no host read on the bounded path either
    hook.remove()
    expert_rows, counts = seen[0]  # what the experts were given and told: blocks cut at the bound, summing to the rows kept
    assert int(counts.sum()) == min(valid_rows[0], int(expected_bound)), (counts, valid_rows[0])
    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name], rtol=1e-5, atol=1e-6, msg=name)
    return {
        "worst_rows": rows_seen[0],
        "valid_rows": valid_rows[0],
        "expert_rows": expert_rows,
        "bound": manager.receive_bound(SimpleNamespace(num_tokens=tokens, num_recv_rows=rows_seen[0])),
        "expected_bound": int(expected_bound),
        "dropped": int(manager.dropped_rows) - dropped_before,
        "over_budget": bool(bounded.token_dispatcher.check_over_budget()),
    }


@needs_rank_capacity_factor
def test_receive_bound_hands_experts_fewer_rows_and_drops_nothing_that_fits() -> None:
    reports = run_distributed(_bounded_layer, 2, 3.0, timeout=180)
    assert [r["expected_bound"] for r in reports] == [96, 45]  # rank 1: int(5 tokens x 3 x 3.0) < 96 rows
    for report in reports:
        assert report["worst_rows"] == 96 and report["expert_rows"] == report["expected_bound"] == report["bound"]
        assert report["valid_rows"] <= report["bound"] and report["dropped"] == 0, report
        assert not report["over_budget"], report


@needs_rank_capacity_factor
def test_receive_bound_drops_rows_past_it_counts_them_and_flags_over_budget() -> None:
    reports = run_distributed(_bounded_layer, 2, 0.25, timeout=180)
    assert [r["bound"] for r in reports] == [9, 3]  # int(T x 3 x 0.25) for T = 12, 5
    assert any(r["valid_rows"] > r["bound"] for r in reports)  # the case exercises a drop
    for report in reports:
        assert report["expert_rows"] == report["bound"] == report["expected_bound"], report
        assert report["dropped"] == max(report["valid_rows"] - report["bound"], 0), report  # alignment 1: no padding
        assert report["over_budget"] is (report["dropped"] > 0), report


def _bound_config_errors(rank: int, world: int) -> list[str]:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    errors = []
    with pytest.raises(ValueError) as excinfo:
        transformer_config(TinyMoEConfig(extra={"moe_expert_rank_capacity_factor": 0.0}), "deepepv2")
    errors.append(str(excinfo.value))
    # Megatron alone would refuse the factor for any flex backend but hybridep / ncclep; deepepv2 accepts it.
    config = transformer_config(TinyMoEConfig(extra={"moe_expert_rank_capacity_factor": 1.5}), "deepepv2")
    errors.append(str(config.moe_expert_rank_capacity_factor))
    return errors


@needs_rank_capacity_factor
def test_receive_bound_configuration_errors() -> None:
    errors = run_distributed(_bound_config_errors, 2)[0]
    assert "must be a positive factor" in errors[0]
    assert errors[1] == "1.5"


def _rebuild_with_micro_batches_in_flight(rank: int, world: int, layout: str) -> dict:
    """Capacity learnt (not configured): a larger micro-batch rebuilds the buffer while the first one's handle waits
    for its backward. The dispatches after the rebuild, and every backward, run with host reads forbidden."""
    from megatron_deepepv2 import buffers

    dv2.configure(host_sync=False, validate=False, num_max_tokens_per_rank=None)
    released_before = buffers.buffer_stats().released

    def micro_batch(seed: int, tokens: list[int]):
        problem = make_problem(seed, tokens, HIDDEN, EXPERTS, TOPK)
        rows = problem.rows(rank)
        x = problem.x[rows].clone().requires_grad_()
        w = problem.topk_weights[rows].clone().requires_grad_()
        idx = problem.topk_idx[rows]
        out = dv2.dispatch(x, idx, w, EXPERTS, layout=layout, expert_alignment=2)
        weights = out.recv_topk_weights.unsqueeze(1) if layout == "expand" else \
            out.recv_topk_weights.sum(dim=1, keepdim=True)
        return x, w, idx, problem.grad_out[rows], dv2.combine(out.recv_x * weights, out.handle)

    first = micro_batch(1, [6, 5, 3, 7][:world])  # builds the buffer: capacity 8
    second = micro_batch(2, [20, 18, 9, 17][:world])  # rebuilds it (capacity 32): the first buffer is retired
    retired_in_flight = len(buffers.retired_buffers())
    with no_host_reads():
        third = micro_batch(3, [7, 8, 2, 5][:world])
        for x, w, idx, grad, y in (first, third, second):
            (y * grad).sum().backward()
    retired_after_backwards = len(buffers.retired_buffers())
    # Independent oracle: each token comes back scaled by the sum of its selected weights (which the op casts to
    # fp32, hence the tolerance).
    tol = dict(rtol=1e-6, atol=1e-6)
    for x, w, idx, grad, y in (first, second, third):
        selected = w.detach() * (idx >= 0)
        torch.testing.assert_close(y, x.detach() * selected.sum(dim=1, keepdim=True), **tol)
        torch.testing.assert_close(x.grad, grad * selected.sum(dim=1, keepdim=True), **tol)
        torch.testing.assert_close(w.grad, (grad * x.detach()).sum(dim=1, keepdim=True) * (idx >= 0), **tol,
                                   check_dtype=False)  # the weights are fp32
    del first, second, third, x, w, idx, grad, y
    micro_batch(4, [40, 33, 12, 40][:world])  # the next build releases the first buffer: no rank uses it now
    return {"retired_in_flight": retired_in_flight, "retired_after_backwards": retired_after_backwards,
            "released_at_next_build": buffers.buffer_stats().released - released_before}


@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_no_host_sync_stays_host_sync_free_after_a_capacity_rebuild(layout: str) -> None:
    """Releasing a retired buffer needs the ranks to agree that no handle uses it (a device read): without host sync
    that waits for the next build, which agrees anyway, instead of running at every dispatch."""
    for report in run_distributed(_rebuild_with_micro_batches_in_flight, 2, layout, timeout=120):
        assert report == {"retired_in_flight": 1, "retired_after_backwards": 1, "released_at_next_build": 1}, report
