"""Megatron-Core integration: MoELayer with deepepv2 against the alltoall dispatcher, config/CLI checks.

The MoELayer cases run megatron-core's own MoELayer (SequentialMLP experts) on 2 and 4 gloo ranks through
the CPU shims of :mod:`megatron_deepepv2.testing.cpu_shims`, and compare the deepepv2 output and every
gradient (input, router, expert weights) with the alltoall dispatcher's.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_distributed


def _setup() -> None:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    import megatron_deepepv2

    megatron_deepepv2.install()


def _forward_backward(layer, x: torch.Tensor):
    x = x.clone().requires_grad_()
    y, _ = layer(x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(99), dtype=y.dtype)
    (y * grad).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}


def _parity(rank: int, world: int, layout: str, tokens_per_rank: list[int], capacity_factor, alignment: int) -> dict:
    _setup()
    import megatron_deepepv2 as dv2
    from megatron.core.transformer.moe import moe_utils

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    if alignment > 1:  # what FP8/FP4 or the TE op fuser would ask for; not reachable on CPU otherwise
        moe_utils.get_align_size_for_quantization = lambda config: alignment
    shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3, capacity_factor=capacity_factor)
    reference = build_moe_layer(shape, "alltoall")
    layer = build_moe_layer(shape, "deepepv2")
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(tokens_per_rank[rank], 1, shape.hidden, generator=torch.Generator().manual_seed(rank))

    expected = _forward_backward(reference, x)
    captured = {}
    manager = layer.token_dispatcher._comm_manager
    original = manager.get_permuted_hidden_states_by_experts

    def capture(hidden):
        rows, probs = original(hidden)
        captured.update(rows=rows.detach().clone(), probs=probs.detach().clone(),
                        counts=manager.get_number_of_tokens_per_expert().clone())
        return rows, probs

    manager.get_permuted_hidden_states_by_experts = capture
    actual = _forward_backward(layer, x)

    torch.testing.assert_close(actual[0], expected[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual[1], expected[1], rtol=1e-5, atol=1e-6)
    assert actual[2].keys() == expected[2].keys() and len(actual[2]) >= 3  # router + 2 per local expert
    for name in expected[2]:
        torch.testing.assert_close(actual[2][name], expected[2][name], rtol=1e-5, atol=1e-6, msg=name)

    counts = captured["counts"]
    assert int(counts.sum()) == captured["rows"].shape[0], "tokens_per_expert must sum to the rows"
    if layout == "expand":
        assert all(int(c) % alignment == 0 for c in counts)
        # Padding rows (after each expert's real rows) are zero and carry zero probs.
        handle_counts = counts.tolist()
        start = 0
        for c in handle_counts:
            block_probs = captured["probs"][start:start + c]
            real = int((block_probs != 0).sum())
            assert not captured["rows"][start + real:start + c].any()
            start += c
        if _has_skip_padding_hook():  # megatron-core >= 0.18: the experts must be told not to pad again
            assert moe_utils.skip_routed_expert_padding(layer.config) is True
    return {"rows": captured["rows"].shape[0]}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_moe_layer_matches_alltoall(world: int) -> None:
    """World 1 is EP=1: the flex dispatcher on a 1-rank group, which Megatron's own deepep refuses."""
    run_distributed(_parity, world, "expand", [16, 8, 12, 4][:world], None, 1, timeout=180)


def test_moe_layer_with_capacity_factor() -> None:
    run_distributed(_parity, 2, "expand", [16, 16], 0.5, 1, timeout=180)


@pytest.mark.parametrize("alignment", [16, 32])
def test_moe_layer_expand_alignment_pads_once(alignment: int) -> None:
    reports = run_distributed(_parity, 2, "expand", [16, 8], None, alignment, timeout=180)
    assert all(r["rows"] % alignment == 0 for r in reports)


def test_moe_layer_uneven_tokens() -> None:
    # Megatron's router cannot take an empty rank (it reshapes 0 elements with -1), so the MoELayer
    # comparison uses a rank with a single token; the empty rank is covered through the dispatcher
    # stages below.
    run_distributed(_parity, 4, "expand", [10, 1, 7, 3], None, 1, timeout=180)


class _CudaOnlyNorm:
    def __init__(self, *args, **kwargs) -> None:
        raise RuntimeError("Transformer Engine's LayerNorm runs on CUDA tensors only")


def _cpu_run_where_transformer_engine_is_installed(rank: int, world: int) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import moe_utils

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    def cuda_only_gemm(*args, **kwargs):
        raise RuntimeError("Transformer Engine's GEMM takes CUDA tensors only")

    # What `import megatron.core` binds where Transformer Engine is installed: the router's logits go through TE's
    # GEMM, and a TransformerBlock's final norm is TE's, whatever the layer spec.
    moe_utils.te_general_gemm = cuda_only_gemm
    transformer_block.HAVE_TE, transformer_block.LayerNormImpl = True, _CudaOnlyNorm
    _setup()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 1, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(8, 16, generator=gen).to(torch.bfloat16).requires_grad_()
    logits = moe_utils.router_gating_linear(x, weight, None, torch.float32)
    logits.sum().backward()
    dense = x.detach().float().view(6, 16) @ weight.detach().float().t()
    torch.testing.assert_close(logits.view(6, 8), dense, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad.float(), x.detach().float().view(6, 16).sum(0).expand(8, 16),
                               rtol=1e-2, atol=1e-2)
    init_expert_parallel()
    config = transformer_config(TinyMoEConfig(hidden=16), "alltoall")
    submodules = transformer_block._get_block_submodules(config, get_gpt_layer_local_spec(num_experts=8))
    norm = submodules.layer_norm(config=config, hidden_size=16, eps=1e-5)
    rows = torch.randn(4, 16, generator=gen)
    torch.testing.assert_close(norm(rows), torch.nn.functional.layer_norm(rows, (16,), eps=1e-5))


def test_cpu_runs_take_no_transformer_engine_kernel_where_it_is_installed() -> None:
    """The CPU shims keep Megatron off Transformer Engine's CUDA kernels that it takes wherever TE is installed: the
    router's GEMM runs in torch, a TransformerBlock's final norm is PyTorch's."""
    run_distributed(_cpu_run_where_transformer_engine_is_installed, 1, timeout=120)


def _empty_rank_stages(rank: int, world: int, layout: str, tokens_per_rank: list[int]) -> None:
    _setup()
    import megatron_deepepv2 as dv2

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    shape = TinyMoEConfig(hidden=16, num_experts=8, topk=2)
    dispatcher = build_moe_layer(shape, "deepepv2").token_dispatcher
    gen = torch.Generator().manual_seed(rank)
    tokens = tokens_per_rank[rank]
    hidden = torch.randn(tokens, 1, shape.hidden, generator=gen, requires_grad=True)
    scores = torch.rand(tokens, shape.num_experts, generator=gen)
    top = scores.topk(shape.topk, dim=1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.where(routing_map, scores, torch.zeros_like(scores))

    h, p = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    h, p = dispatcher.token_dispatch(h, p)
    h, tokens_per_expert, p = dispatcher.dispatch_postprocess(h, p)
    assert int(tokens_per_expert.sum()) == h.shape[0]
    out = dispatcher.combine_preprocess(h * p.unsqueeze(1).to(h.dtype))
    out = dispatcher.combine_postprocess(dispatcher.token_combine(out))
    prob_sum = probs.sum(dim=1).view(tokens, 1, 1)
    torch.testing.assert_close(out, hidden.detach() * prob_sum)
    out.sum().backward()
    torch.testing.assert_close(hidden.grad, prob_sum.expand_as(hidden).contiguous())


def test_dispatcher_stages_with_an_empty_rank() -> None:
    run_distributed(_empty_rank_stages, 4, "expand", [5, 0, 9, 2])


# ------------------------------------------------------------------------------------------------
# Config validation, CLI, install()
# ------------------------------------------------------------------------------------------------
def _config_errors(rank: int, world: int) -> list[str]:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    init_expert_parallel()
    shape = TinyMoEConfig()
    messages = []
    for extra, phrase in [
        ({"moe_enable_deepep": True}, "moe_enable_deepep=True selects the DeepEP v1 backend"),
        ({"moe_pad_expert_input_to_capacity": True, "moe_expert_capacity_factor": 1.0}, "does not support moe_pad_expert_input_to_capacity"),
    ]:
        shape.extra = extra
        with pytest.raises(ValueError) as info:
            transformer_config(shape, "deepepv2")
        assert phrase in str(info.value), str(info.value)
        messages.append(str(info.value))
    shape.extra = {"moe_token_dispatcher_type": "alltoall"}
    with pytest.raises(ValueError, match="requires moe_token_dispatcher_type='flex'"):
        transformer_config(shape, "deepepv2")
    # A single expert-parallel rank (EP=1) is accepted: the same path on a 1-rank group.
    shape.extra = {"expert_model_parallel_size": 1}
    assert transformer_config(shape, "deepepv2").expert_model_parallel_size == 1
    # Other backends are untouched: deepep (v1) still builds its config.
    shape.extra = {}
    assert transformer_config(shape, "deepep").moe_flex_dispatcher_backend == "deepep"
    return messages


def test_config_validation_errors() -> None:
    run_distributed(_config_errors, 2)


def _routing_ids(rank: int, world: int) -> None:
    _setup()
    from megatron_deepepv2 import ops
    from megatron_deepepv2.mcore.manager import _DeepepV2Manager
    from megatron_deepepv2.mcore.manager import dispatch_config_for
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    init_expert_parallel()
    num_experts, topk, tokens = 8, 3, 64
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(tokens, num_experts, generator=gen)
    probs[::4] = probs[::4].round(decimals=1)  # ties between experts
    probs[1::5, :] = 0.0  # rows the router dropped entirely
    probs[2::5, 2:] = 0.0  # rows with fewer than top-k selections
    for capacity_factor in (None, 1.0):
        config = transformer_config(TinyMoEConfig(num_experts=num_experts, topk=topk, capacity_factor=capacity_factor),
                                    "deepepv2")
        manager = _DeepepV2Manager(None, num_experts // world, topk, num_experts, config)
        manager.setup_metadata(probs > 0, probs)
        ids, picked = manager.token_indices, manager.token_probs
        assert ids.dtype == torch.int64 and ids.shape == (tokens, topk)
        for row in range(tokens):  # oracle: the row's top-k probabilities, each expert at most once
            chosen = [int(e) for e in ids[row] if e >= 0]
            assert len(set(chosen)) == len(chosen) and all(0 <= e < num_experts for e in chosen), ids[row]
            assert sorted(picked[row].tolist(), reverse=True) == sorted(probs[row].tolist(), reverse=True)[:topk]
            assert all(picked[row, k] == probs[row, int(e)] for k, e in enumerate(ids[row]) if e >= 0)
            # With a capacity factor the router's drops (prob 0) are no selection (-1); dropless keeps the ids.
            dropped = [k for k in range(topk) if picked[row, k] == 0] if capacity_factor else []
            assert [k for k in range(topk) if ids[row, k] < 0] == dropped, (row, ids[row], picked[row])
        # Valid by construction, so the layer's dispatches skip the id check, and validate runs it all the same.
        assert dispatch_config_for(config).settings.check_ids is False
        assert ops.resolve_config().settings.check_ids is True
    import megatron_deepepv2 as dv2

    with dv2.settings_override(validate=True):
        config = transformer_config(TinyMoEConfig(num_experts=num_experts, topk=topk), "deepepv2")
        manager = _DeepepV2Manager(torch.distributed.group.WORLD, num_experts // world, topk, num_experts, config)
        manager.token_indices = torch.tensor([[0, 0, 1]] * 4)
        manager.token_probs = torch.rand(4, topk)
        with pytest.raises(ValueError, match="selects the same expert twice for token 0"):
            manager.dispatch(torch.randn(4, 64))


def test_manager_ids_are_valid_by_construction() -> None:
    run_distributed(_routing_ids, 2)


def _cli(rank: int, world: int) -> str:
    _setup()
    import sys

    from megatron.training.arguments import parse_args

    sys.argv = ["train.py", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "4",
                "--num-experts", "8", "--moe-token-dispatcher-type", "flex",
                "--moe-flex-dispatcher-backend", "deepepv2", "--micro-batch-size", "1"]
    args = parse_args(ignore_unknown_args=True)
    return args.moe_flex_dispatcher_backend


def test_cli_accepts_deepepv2() -> None:
    assert run_distributed(_cli, 1) == ["deepepv2"]


def _install_twice(rank: int, world: int) -> list[str]:
    _setup()
    import megatron_deepepv2
    from megatron.core.transformer.moe import moe_layer, moe_utils

    first = megatron_deepepv2.install()
    home = _should_free_input_module()
    dispatcher, free_input = moe_layer.MoEFlexTokenDispatcher, home.should_free_input
    skip = getattr(moe_utils, "skip_routed_expert_padding", None)
    second = megatron_deepepv2.install()
    assert second is first
    assert moe_layer.MoEFlexTokenDispatcher is dispatcher and home.should_free_input is free_input
    assert getattr(moe_utils, "skip_routed_expert_padding", None) is skip
    return first.patches


def _should_free_input_module():
    """Where this megatron-core defines should_free_input (0.19: models.common.utils; 0.17/0.18: gpt callables)."""
    import importlib

    for name in ("megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "should_free_input"):
            return module
    raise AssertionError("should_free_input not found")


def _has_skip_padding_hook() -> bool:
    from megatron.core.transformer.moe import moe_utils

    return hasattr(moe_utils, "skip_routed_expert_padding")


def test_install_is_idempotent_and_lists_patches() -> None:
    (patches,) = run_distributed(_install_twice, 1)
    assert any("MoEFlexTokenDispatcher" in p for p in patches)
    assert any("should_free_input" in p for p in patches)
    assert any("build_transformer_layer_callables" in p for p in patches)
    # megatron-core 0.17 has no skip_routed_expert_padding hook (its experts' FP8 padding is a no-op on aligned blocks).
    assert any("skip_routed_expert_padding" in p for p in patches) == _has_skip_padding_hook()


def _backend_string_checks(rank: int, world: int) -> None:
    _setup()
    from megatron.core.transformer.moe import moe_utils

    should_free_input = _should_free_input_module().should_free_input

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    init_expert_parallel()
    v1 = transformer_config(TinyMoEConfig(), "deepep")
    v2 = transformer_config(TinyMoEConfig(), "deepepv2")
    for node in ("moe_dispatch", "moe_combine"):
        assert should_free_input(node, True, v2, 4) == should_free_input(node, True, v1, 4), node
    # The expand rows go straight into the expert GEMMs, which save them for backward (like hybridep).
    assert should_free_input("mlp", True, v2, 4) is False and should_free_input("mlp", True, v1, 4) is True
    assert should_free_input("moe_dispatch", True, v2, 4) is False  # dispatch input kept for backward
    if _has_skip_padding_hook():
        assert moe_utils.skip_routed_expert_padding(v2) is True  # expand layout pads already
        alltoall = transformer_config(TinyMoEConfig(), "alltoall")
        assert moe_utils.skip_routed_expert_padding(alltoall) is False


def test_backend_string_checks_treat_deepepv2_like_deepep() -> None:
    run_distributed(_backend_string_checks, 2)


def _native_policy(rank: int, world: int, manager: str) -> dict:
    import logging

    import megatron_deepepv2 as dv2
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    from megatron_deepepv2.mcore import integration

    token_dispatcher._DeepepV2Manager = object  # what a release with native support has
    original = moe_layer.MoEFlexTokenDispatcher
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    integration.logger.addHandler(handler)
    integration.logger.setLevel(logging.INFO)
    with dv2.settings_override(manager=manager):
        report = integration.install()
    assert report.native_available and report.manager == manager
    if manager == "native":
        assert report.native and report.patches == [] and moe_layer.MoEFlexTokenDispatcher is original
        assert any("MEGATRON_DEEPEPV2_MANAGER=native: deepepv2 layers use megatron-core" in r for r in records), records
    else:
        assert not report.native and report.patches and moe_layer.MoEFlexTokenDispatcher is not original
        assert any("ships its own deepepv2; deepepv2 layers use megatron-deepepv2's" in r for r in records), records
    return {"native": report.native}


@pytest.mark.parametrize("manager", ["plugin", "native"])
def test_one_switch_chooses_the_manager_when_megatron_ships_deepepv2(manager: str) -> None:
    assert run_distributed(_native_policy, 1, manager) == [{"native": manager == "native"}]


def _native_without_native(rank: int, world: int) -> str:
    import megatron_deepepv2 as dv2
    from megatron_deepepv2.mcore import integration

    if integration.supports_deepepv2_natively():
        return "native"

    with dv2.settings_override(manager="native"), pytest.raises(RuntimeError, match="has none. Unset it"):
        integration.install()
    with pytest.raises(ValueError, match="manager='megatron' is not one of plugin, native"):
        dv2.configure(manager="megatron")  # refused where it is given; install() then reads valid settings only
    return "ok"


def test_asking_for_a_native_manager_megatron_lacks_raises() -> None:
    outcome = run_distributed(_native_without_native, 1)
    if outcome == ["native"]:
        pytest.skip("this megatron-core ships its own deepepv2")
    assert outcome == ["ok"]


def _unsupported_version(rank: int, world: int) -> str:
    import logging

    from megatron.core import package_info

    from megatron_deepepv2.mcore import integration

    package_info.__version__ = "0.16.1"
    with pytest.raises(RuntimeError, match=r"needs megatron-core >= 0.17.0 \(tested: >=0.17.0,<0.20.0\); "
                                           r"megatron-core 0.16.1"):
        integration.install()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    integration.logger.addHandler(handler)
    package_info.__version__ = "0.21.0"
    report = integration.install()  # an untested newer release: patched, with a warning
    assert report.patches and any("0.21.0 is newer than the releases" in r for r in records), records
    return "ok"


def test_old_megatron_raises_and_newer_ones_warn() -> None:
    assert run_distributed(_unsupported_version, 1) == ["ok"]


#: (Megatron's SM count, the num_sms setting, the count DeepEP's fresh dispatches must get): Megatron's wins; unset,
#: the setting; not given, the package default (64, the measured knee of docs/usage.md); 0 is DeepEP's own choice.
SM_CASES = ((24, None, 24), (24, 12, 24), (None, None, 64), (None, 12, 12), (None, 0, 0))


def _sm_setting(rank: int, world: int) -> list[list[int]]:
    _setup()
    import megatron_deepepv2 as dv2
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer, transformer_config
    from tests.deepep_stand_in import STAND_INS, use_stand_in_backend

    use_stand_in_backend()  # the DeepEP adapter over the 2.1 stand-in, which records each call's arguments
    dv2.configure(backend="deepep", validate=False)
    calls = STAND_INS["2.1"][1].calls
    field = "moe_flex_dispatcher_num_sms"
    if not hasattr(transformer_config(TinyMoEConfig(), "deepepv2"), field):
        field = "moe_deepep_num_sms"  # megatron-core < 0.19
    unset = {} if field == "moe_flex_dispatcher_num_sms" else {field: 0}  # before 0.19 only 0 means unset
    seen = []
    for megatron_value, setting, _ in SM_CASES:
        extra = unset if megatron_value is None else {field: megatron_value}
        shape = TinyMoEConfig(hidden=32, ffn=48, num_experts=4, topk=2, extra=extra)
        with dv2.settings_override(**({} if setting is None else {"num_sms": setting})):
            layer = build_moe_layer(shape, "deepepv2")
            calls.clear()
            layer(torch.randn(6, 1, 32))[0].sum().backward()
        seen.append([call["num_sms"] for call in calls if call["op"] == "dispatch" and not call["cached"]])
        dv2.destroy_buffers()
    return seen


def test_sm_setting_reaches_the_buffer() -> None:
    """The SM count each fresh DeepEP dispatch of a Megatron layer gets, as the adapter passes it to DeepEP: Megatron's
    wins; unset, the num_sms setting; neither, the package default; a setting of 0 leaves the choice to DeepEP."""
    for seen in run_distributed(_sm_setting, 2, env={"LOCAL_WORLD_SIZE": "2"}):
        assert seen == [[expected] for _, _, expected in SM_CASES], seen


# ------------------------------------------------------------------------------------------------
# The manager's contract with Megatron's flex dispatcher
# ------------------------------------------------------------------------------------------------
def _names_the_flex_dispatcher_uses() -> tuple[set[str], set[str]]:
    """Every ``self._comm_manager.<name>`` that this megatron-core's ``MoEFlexTokenDispatcher`` reads or calls, and the
    ones it guards with ``hasattr`` (read from its source)."""
    import ast
    import inspect
    import textwrap

    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    tree = ast.parse(textwrap.dedent(inspect.getsource(MoEFlexTokenDispatcher)))
    used, guarded = set(), set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and node.value.attr == "_comm_manager" and isinstance(node.ctx, ast.Load)):
            used.add(node.attr)
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr" and len(node.args) == 2
                and isinstance(node.args[0], ast.Attribute) and node.args[0].attr == "_comm_manager"
                and isinstance(node.args[1], ast.Constant)):
            guarded.add(node.args[1].value)
    return used, guarded


def _manager_contract(rank: int, world: int) -> dict:
    _setup()
    from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    manager = build_moe_layer(TinyMoEConfig(), "deepepv2").token_dispatcher._comm_manager
    used, guarded = _names_the_flex_dispatcher_uses()
    abstract = set(getattr(_DispatchManager, "__abstractmethods__", ()))
    return {"is_dispatch_manager": isinstance(manager, _DispatchManager), "used": sorted(used),
            "missing": sorted(name for name in (used - guarded) | abstract if not hasattr(manager, name)),
            "abstract_left": sorted(getattr(type(manager), "__abstractmethods__", ()))}


def test_manager_has_everything_megatrons_flex_dispatcher_uses() -> None:
    """The manager is a ``_DispatchManager`` with every method and attribute Megatron's flex dispatcher reads of its
    manager (but those it guards with ``hasattr``). A release that reads a new one fails here (CI runs this on every
    supported megatron-core)."""
    (report,) = run_distributed(_manager_contract, 1)
    assert report["is_dispatch_manager"] and not report["abstract_left"], report
    assert {"setup_metadata", "dispatch", "combine", "dispatched_probs"} <= set(report["used"]), report
    assert not report["missing"], f"_DeepepV2Manager lacks {report['missing']}, which the flex dispatcher reads"


def _copy_after_a_step(rank: int, world: int) -> dict:
    import copy
    import pickle

    _setup()
    from megatron_deepepv2.mcore.manager import dispatch_config_for
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    layer = build_moe_layer(TinyMoEConfig(), "deepepv2")
    _forward_backward(layer, torch.randn(6, 1, layer.config.hidden_size, generator=torch.Generator().manual_seed(rank)))
    from megatron_deepepv2.groups import known_states

    resolved = dispatch_config_for(layer.config)
    bound = [key for state in known_states() for key in state.bindings]
    assert any(key[0] is resolved for key in bound), "the step should have bound a dispatcher"
    copied = copy.deepcopy(layer.config)
    restored = pickle.loads(pickle.dumps(layer.config))
    return {"copied_same": dispatch_config_for(copied) == resolved,
            "restored_same": dispatch_config_for(restored) == resolved,
            "restored_hash": hash(dispatch_config_for(restored)) == hash(resolved),
            "hidden": (copied.hidden_size, restored.hidden_size)}


def test_transformer_config_deep_copies_and_pickles_after_a_deepepv2_step() -> None:
    """Megatron deep-copies configs (checkpointing, model builders): the dispatch configuration the manager keeps on
    the TransformerConfig must not make that fail after the first step."""
    for report in run_distributed(_copy_after_a_step, 2):
        assert report == {"copied_same": True, "restored_same": True, "restored_hash": True, "hidden": (64, 64)}, report


def _stream_flags_reaching_deepep(rank: int, world: int) -> list[dict]:
    _setup()
    import megatron_deepepv2 as dv2

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer
    from tests.deepep_stand_in import STAND_INS, use_stand_in_backend

    use_stand_in_backend()
    dv2.configure(backend="deepep", validate=False)
    layer = build_moe_layer(TinyMoEConfig(), "deepepv2")
    calls = STAND_INS["2.1"][1].calls
    calls.clear()
    _forward_backward(layer, torch.randn(6, 1, layer.config.hidden_size, generator=torch.Generator().manual_seed(rank)))
    return [{"async": c["async_"], "alloc": c["alloc"], "prev": c["prev"]} for c in calls]


def test_megatron_layers_call_deepep_synchronously_whatever_the_stream_flags() -> None:
    """Megatron's flex dispatcher passes async_finish and allocate_on_comm_stream, then waits at once: the manager calls
    DeepEP synchronously (no event capture, wait or record_stream per call), dispatch, combine and both backwards."""
    for calls in run_distributed(_stream_flags_reaching_deepep, 2, env={"LOCAL_WORLD_SIZE": "2"}):
        assert len(calls) == 4, calls
        assert all(c == {"async": False, "alloc": False, "prev": None} for c in calls), calls


@pytest.mark.parametrize("tp_size", [1, 2])
def test_deepepv2_dispatch_preprocess_is_megatrons_stage_without_torch_compile(tp_size: int) -> None:
    """deepepv2's dispatch_preprocess hands the manager the probabilities Megatron's own stage builds (replicated over
    the TP ranks), and flattens the tokens the same way, but is not a torch.compile'd function (its guards and wrappers
    cost more host time than its two views); other backends keep Megatron's compiled stage."""
    import types

    import megatron_deepepv2 as dv2
    from megatron.core.transformer.moe import moe_layer
    from megatron.core.transformer.moe.token_dispatcher import MoEFlexTokenDispatcher

    dv2.install()
    ours = moe_layer.MoEFlexTokenDispatcher
    received = {}

    class Manager:  # records what the stage hands the manager
        def setup_metadata(self, routing_map, probs):
            received.update(routing_map=routing_map, probs=probs)
            self.token_probs = probs.reshape(probs.shape[0], -1)

    manager = Manager()
    ep_size, local_experts, tokens = 2, 3, 5
    fake = types.SimpleNamespace(config=types.SimpleNamespace(moe_flex_dispatcher_backend="deepepv2"),
                                 tp_size=tp_size, ep_size=ep_size, num_local_experts=local_experts, _comm_manager=manager)
    probs = torch.rand(tokens, ep_size * local_experts)
    routing_map = probs > 0.5
    hidden = torch.randn(tokens, 1, 8)
    flat, token_probs = ours.dispatch_preprocess(fake, hidden, routing_map, probs)
    assert flat.shape == (tokens, 8) and flat.data_ptr() == hidden.data_ptr() and fake.hidden_shape == hidden.shape
    _, expected = MoEFlexTokenDispatcher._initialize_metadata(fake, routing_map, probs)  # Megatron's own expansion
    assert torch.equal(received["probs"].reshape(tokens, -1), expected.reshape(tokens, -1))
    assert received["routing_map"] is routing_map and token_probs is manager.token_probs
    # Any other backend still gets Megatron's stage.
    other = ours.__new__(ours)
    other.config = types.SimpleNamespace(moe_flex_dispatcher_backend="hybridep")
    called = []
    original = MoEFlexTokenDispatcher.dispatch_preprocess
    try:
        MoEFlexTokenDispatcher.dispatch_preprocess = lambda self, *args: called.append(args) or "megatron"
        assert ours.dispatch_preprocess(other, hidden, routing_map, probs) == "megatron" and called
    finally:
        MoEFlexTokenDispatcher.dispatch_preprocess = original


def test_deepepv2_dispatch_preprocess_is_not_compiled_where_megatrons_is() -> None:
    """With torch.compile on (this test process turns it off), Megatron's flex stage is a compiled function and
    deepepv2's is not."""
    import subprocess
    import sys

    code = ("import megatron_deepepv2 as dv2; dv2.install(); "
            "from megatron.core.transformer.moe import moe_layer, token_dispatcher as t; "
            "compiled = lambda f: hasattr(f, '_torchdynamo_orig_callable'); "
            "print('COMPILED', compiled(t.MoEFlexTokenDispatcher.dispatch_preprocess), "
            "compiled(moe_layer.MoEFlexTokenDispatcher.dispatch_preprocess))")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TORCHDYNAMO_DISABLE"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)
    assert "COMPILED True False" in done.stdout, done.stdout[-1000:] + done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# How deep the path from Megatron's stage to the backend is
# ------------------------------------------------------------------------------------------------
def _frames_to_the_backend(rank: int, world: int) -> dict:
    import inspect
    from pathlib import Path

    _setup()
    import megatron_deepepv2
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    package = Path(megatron_deepepv2.__file__).parent
    seen: dict = {}

    def recording(name: str):
        original = getattr(ReferenceBackend, name)

        def method(self, *args, **kwargs):
            ours = [f"{Path(f.filename).relative_to(package)}:{f.function}" for f in inspect.stack()
                    if Path(f.filename).is_relative_to(package)]
            start = max((i for i, frame in enumerate(ours) if frame.startswith("mcore/manager.py")), default=None)
            if start is not None:  # a forward call (the backward ones start in autograd's engine)
                seen.setdefault(name, list(reversed(ours[:start + 1])))
            return original(self, *args, **kwargs)
        return method

    for name in ("dispatch", "combine"):
        setattr(ReferenceBackend, name, recording(name))
    layer = build_moe_layer(TinyMoEConfig(), "deepepv2")
    _forward_backward(layer, torch.randn(6, 1, layer.config.hidden_size, generator=torch.Generator().manual_seed(0)))
    return seen


def test_megatron_stages_reach_the_backend_in_three_frames_of_the_package() -> None:
    """The manager's dispatch and combine each call their autograd Function, which calls the backend: three frames of
    this package from Megatron's stage to the buffer, and combine goes the way dispatch goes."""
    (seen,) = run_distributed(_frames_to_the_backend, 1)  # the frames of ours on the stack when the backend is called
    assert seen == {"dispatch": ["mcore/manager.py:dispatch", "ops.py:forward"],
                    "combine": ["mcore/manager.py:combine", "ops.py:forward"]}, seen
