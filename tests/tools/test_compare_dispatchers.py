"""``tools/compare_dispatchers.py`` on CPU ranks (gloo, reference backend): every variant it can run here runs, and
each agrees with Megatron's ``alltoall`` (the oracle), the ones it cannot say why; each layer ratio is taken against
the alltoall row with the same experts, each path ratio against alltoall's path; the outputs say which, with the SMs,
commit and date of the run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_deepepv2.config import DeepepV2Settings
from tests.distributed import run_distributed
from tools import _bench, compare_dispatchers

#: The package's default SM count (what a user gets).
DEFAULT_NUM_SMS = DeepepV2Settings().num_sms
RUNNABLE_ON_CPU = ["alltoall", "alltoall-syncfree", "allgather", "deepepv2-expand", "deepepv2-expand-syncfree",
                   "deepepv2-expand-no-host-sync"]
# What each row's layer really holds, and the alltoall row with the same experts that its layer ratio is taken against.
EXPERTS = {"alltoall": "SequentialMLP", "alltoall-syncfree": "SyncFreeSequentialMLP", "allgather": "SequentialMLP",
           "deepepv2-expand": "SequentialMLP", "deepepv2-expand-syncfree": "SyncFreeSequentialMLP",
           "deepepv2-expand-no-host-sync": "SyncFreeSequentialMLP"}
LAYER_BASELINE = {"allgather": "alltoall", "deepepv2-expand": "alltoall",
                  "deepepv2-expand-syncfree": "alltoall-syncfree", "deepepv2-expand-no-host-sync": "alltoall-syncfree",
                  "deepepv2-no-host-sync-layer-graph": "alltoall-syncfree",
                  "alltoall-syncfree-graphs": "alltoall-syncfree"}
#: The rows replayed from CUDA graphs (CUDA only), and what each replays.
GRAPH_SCOPES = {"alltoall-syncfree-graphs": compare_dispatchers.MEGATRON_PARTIAL,
                "deepepv2-no-host-sync-layer-graph": compare_dispatchers.WHOLE_LAYER}


def _smoke(rank: int, world: int, out: str) -> list[dict]:
    args = compare_dispatchers._parse(["--cpu", "--models", "tiny", "--tokens", "48", "--iters", "2", "--warmup", "1",
                                       "--out", out])
    return compare_dispatchers.run_rank(rank, args, False, {"device": "cpu", "world_size": world})


def _check_pairing(by_name: dict[str, dict]) -> None:
    """Every measured row's ratios: the layer against the alltoall row with its experts, the path against alltoall's."""
    for name, row in by_name.items():
        if "layer_us" not in row:
            continue
        assert row["expert_module"] == EXPERTS[name], row
        if name in ("alltoall", "alltoall-syncfree"):  # the baselines themselves
            assert "layer_speedup" not in row and "layer_baseline" not in row, row
        else:
            baseline = by_name[LAYER_BASELINE[name]]
            assert row["layer_baseline"] == LAYER_BASELINE[name], row
            assert baseline["expert_module"] == row["expert_module"]
            assert row["layer_speedup"] == pytest.approx(baseline["layer_us"] / row["layer_us"]), row
        if name != "alltoall":
            assert row["path_baseline"] == "alltoall", row
            assert row["path_speedup"] == pytest.approx(by_name["alltoall"]["path_us"] / row["path_us"]), row


@pytest.mark.parametrize("world", [1, 2])
def test_every_runnable_variant_runs_matches_alltoall_and_has_its_ratio_against_the_same_experts(
        world: int, tmp_path: Path) -> None:
    """World 1 is EP=1 (one GPU's comparison: the fixed costs of each dispatcher, no traffic between ranks)."""
    rows = run_distributed(_smoke, world, str(tmp_path), timeout=240, env={"LOCAL_WORLD_SIZE": str(world)})[0]
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == [variant.name for variant in compare_dispatchers.VARIANTS]
    for name in RUNNABLE_ON_CPU:
        assert by_name[name]["path_us"] > 0 and by_name[name]["layer_us"] > 0, by_name[name]
    for name in RUNNABLE_ON_CPU[1:]:
        assert by_name[name]["matches"] and by_name[name]["max_rel_diff"] <= 1e-4, by_name[name]
    # The sync-free experts behind alltoall compute what SequentialMLP computes, bit for bit (FP32 on the CPU).
    assert by_name["alltoall-syncfree"]["max_rel_diff"] == 0.0
    assert "fused_a2a.HAVE_DEEP_EP is False" in by_name["flex-deepep-v1"]["unavailable"]
    for name in GRAPH_SCOPES:
        assert "needs CUDA" in by_name[name]["unavailable"], by_name[name]
    _check_pairing(by_name)
    # deepepv2 ran at the package's default SMs (what a user gets).
    assert {by_name[name]["num_sms"] for name in RUNNABLE_ON_CPU if name.startswith("deepepv2")} == {DEFAULT_NUM_SMS}

    # Rank 0 wrote the outputs after the last variant: the rows, the run and which baseline each ratio uses.
    written = json.loads((tmp_path / "compare_dispatchers.json").read_text())
    assert written["rows"] == rows and written["world_size"] == world
    assert written["deepepv2_num_sms"] == DEFAULT_NUM_SMS
    here = _bench.provenance()
    assert (written["git_commit"], written["git_dirty"]) == (here["git_commit"], here["git_dirty"])
    assert written["date"][:10] == here["date"][:10]
    assert written["layer_baselines"] == {"SequentialMLP": "alltoall", "SyncFreeSequentialMLP": "alltoall-syncfree"}
    assert written["path_baseline"] == "alltoall"
    for name, baseline in LAYER_BASELINE.items():
        assert written["variants"][name]["layer_baseline"] == baseline
    assert written["graph_baseline"] == "alltoall-syncfree-graphs"
    for name, variant in written["variants"].items():
        assert variant["cuda_graph"] is (name in GRAPH_SCOPES) and variant["cuda_graph_scope"] == GRAPH_SCOPES.get(name)
    table = (tmp_path / "compare_dispatchers.md").read_text()
    assert "### tiny, 48 tokens per rank" in table and "(ok)" in table and f"{DEFAULT_NUM_SMS} SMs" in table
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    for name, baseline in LAYER_BASELINE.items():
        if name in RUNNABLE_ON_CPU:
            assert f"x vs {baseline} |" in lines[name] and f"| {EXPERTS[name]} |" in lines[name], lines[name]
    for name in GRAPH_SCOPES:
        assert "| not run: CUDA-graph replay needs CUDA GPUs |" in lines[name], lines[name]
    # The plot needs matplotlib (the bench extra, not the test one); the data never depend on it.
    assert (tmp_path / "compare_dispatchers.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def _subset(rank: int, world: int, out: str) -> list[dict]:
    args = compare_dispatchers._parse(["--cpu", "--models", "tiny", "--tokens", "32", "--iters", "1", "--warmup", "0",
                                       "--variants", "deepepv2-expand-no-host-sync", "--sms", "20", "--out", out])
    return compare_dispatchers.run_rank(rank, args, False, {"device": "cpu", "world_size": world})


def test_a_subset_brings_the_baselines_its_ratios_need_and_runs_at_the_sms_asked_for(tmp_path: Path) -> None:
    """A row with sync-free experts brings alltoall-syncfree (its layer baseline) and alltoall (the reference)."""
    rows = run_distributed(_subset, 2, str(tmp_path), timeout=240, env={"LOCAL_WORLD_SIZE": "2"})[0]
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == ["alltoall", "alltoall-syncfree", "deepepv2-expand-no-host-sync"]
    _check_pairing(by_name)
    assert by_name["deepepv2-expand-no-host-sync"]["num_sms"] == 20
    written = json.loads((tmp_path / "compare_dispatchers.json").read_text())
    assert written["rows"] == rows and written["deepepv2_num_sms"] == 20


def test_a_layer_ratio_needs_a_baseline_with_the_experts_the_layer_really_held() -> None:
    """Paired on the built layer's experts: a sync-free row is never divided by SequentialMLP's alltoall, nor by an
    alltoall-syncfree row that did not hold sync-free experts."""
    def row(variant: str, experts: str, layer_us: float) -> dict:
        return {"model": "m", "tokens": 8, "variant": variant, "expert_module": experts, "layer_us": layer_us,
                "path_us": 1.0}

    rows = compare_dispatchers.add_ratios([row("alltoall", "SequentialMLP", 100.0),
                                           row("deepepv2-expand-no-host-sync", "SyncFreeSequentialMLP", 5.0)])
    assert "layer_speedup" not in rows[1] and rows[1]["path_speedup"] == 1.0  # no alltoall-syncfree row: no ratio
    rows = compare_dispatchers.add_ratios([row("alltoall", "SequentialMLP", 100.0),
                                           row("alltoall-syncfree", "SequentialMLP", 90.0),
                                           row("deepepv2-expand-no-host-sync", "SyncFreeSequentialMLP", 5.0)])
    assert "layer_speedup" not in rows[2]
    rows = compare_dispatchers.add_ratios([row("alltoall", "SequentialMLP", 100.0),
                                           row("alltoall-syncfree", "SyncFreeSequentialMLP", 10.0),
                                           row("deepepv2-expand-no-host-sync", "SyncFreeSequentialMLP", 5.0)])
    assert (rows[2]["layer_baseline"], rows[2]["layer_speedup"]) == ("alltoall-syncfree", 2.0)


def test_megatrons_graphs_row_is_listed_brings_its_baselines_and_says_why_it_cannot_run() -> None:
    """alltoall-syncfree-graphs: Megatron's alltoall layer with the sync-free experts, under Megatron's partial graphs;
    its layer ratio is against alltoall-syncfree (eager, same experts), which it is never the layer baseline of."""
    variant = next(v for v in compare_dispatchers.VARIANTS if v.name == "alltoall-syncfree-graphs")
    assert (variant.dispatcher, variant.expert_module, variant.graph_scope) == (
        "alltoall", "SyncFreeSequentialMLP", compare_dispatchers.MEGATRON_PARTIAL)
    assert compare_dispatchers.LAYER_BASELINES == {"SequentialMLP": "alltoall",
                                                   "SyncFreeSequentialMLP": "alltoall-syncfree"}
    assert [v.name for v in compare_dispatchers.selected_variants(["alltoall-syncfree-graphs"])] == [
        "alltoall", "alltoall-syncfree", "alltoall-syncfree-graphs"]
    assert "needs CUDA GPUs" in compare_dispatchers.unavailable_reason(variant, cuda=False)
    assert compare_dispatchers.unavailable_reason(variant, cuda=True) is None  # megatron-core 0.17 - 0.19 have it all
    with pytest.raises(ValueError, match="alltoall"):
        compare_dispatchers.Variant("x", "deepepv2", "", sync_free_experts=True, partial_graphs=True)


def test_a_megatron_without_the_layer_stages_makes_the_graphs_row_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    variant = next(v for v in compare_dispatchers.VARIANTS if v.name == "alltoall-syncfree-graphs")
    monkeypatch.delattr(MoELayer, "postprocess")
    reason = compare_dispatchers.unavailable_reason(variant, cuda=True)
    assert reason is not None and "MoELayer has no postprocess" in reason, reason


def _timed(variant: str, experts: str, layer_us: float, graph: bool = False) -> dict:
    return {"model": "m", "tokens": 8, "variant": variant, "expert_module": experts, "layer_us": layer_us,
            "cuda_graph": graph}


def test_rows_replayed_from_graphs_also_get_a_ratio_against_megatrons_graphs() -> None:
    """graph_speedup: graphs against graphs (Megatron's alltoall layer under its widest capture, same experts), next
    to the layer ratio against the eager alltoall-syncfree; eager rows get none, nor does the baseline itself."""
    rows = compare_dispatchers.add_ratios([
        _timed("alltoall", "SequentialMLP", 100.0),
        _timed("alltoall-syncfree", "SyncFreeSequentialMLP", 10.0),
        _timed("alltoall-syncfree-graphs", "SyncFreeSequentialMLP", 8.0, graph=True),
        _timed("deepepv2-expand-no-host-sync", "SyncFreeSequentialMLP", 5.0),
        _timed("deepepv2-no-host-sync-layer-graph", "SyncFreeSequentialMLP", 2.0, graph=True)])
    by_name = {row["variant"]: row for row in rows}
    layer_graph = by_name["deepepv2-no-host-sync-layer-graph"]
    assert (layer_graph["layer_baseline"], layer_graph["layer_speedup"]) == ("alltoall-syncfree", 5.0)
    assert (layer_graph["graph_baseline"], layer_graph["graph_speedup"]) == ("alltoall-syncfree-graphs", 4.0)
    graphs = by_name["alltoall-syncfree-graphs"]
    assert (graphs["layer_baseline"], graphs["layer_speedup"]) == ("alltoall-syncfree", 1.25)
    assert "graph_speedup" not in graphs and "graph_baseline" not in graphs
    assert all("graph_speedup" not in by_name[name] for name in ("alltoall", "alltoall-syncfree",
                                                                 "deepepv2-expand-no-host-sync"))
    table = compare_dispatchers.markdown(rows)
    line = next(line for line in table.splitlines() if line.startswith("| deepepv2-no-host-sync-layer-graph |"))
    assert "| 5.00x vs alltoall-syncfree | 4.00x vs alltoall-syncfree-graphs |" in line, line

    # Without Megatron's graphs row, or with one whose layer held other experts: no graph ratio.
    for graphs_experts in (None, "SequentialMLP"):
        rows = [_timed("alltoall-syncfree", "SyncFreeSequentialMLP", 10.0),
                _timed("deepepv2-no-host-sync-layer-graph", "SyncFreeSequentialMLP", 2.0, graph=True)]
        if graphs_experts is not None:
            rows.append(_timed("alltoall-syncfree-graphs", graphs_experts, 8.0, graph=True))
        layer_graph = compare_dispatchers.add_ratios(rows)[1]
        assert layer_graph["layer_speedup"] == 5.0 and "graph_speedup" not in layer_graph, layer_graph


def test_every_bar_of_the_plot_names_the_expert_module_its_layer_held() -> None:
    rows = [{**_timed("alltoall", "SequentialMLP", 4000.0), "tokens": 8},
            {**_timed("alltoall", "SequentialMLP", 8000.0), "tokens": 16},
            {**_timed("alltoall-syncfree", "SyncFreeSequentialMLP", 2000.0), "tokens": 16},
            {**_timed("alltoall-syncfree-graphs", "SyncFreeSequentialMLP", 1000.0, graph=True), "tokens": 16,
             "cuda_graph_scope": compare_dispatchers.MEGATRON_PARTIAL},
            # A row whose layer held other experts than its variant names is labelled with what it held.
            {**_timed("deepepv2-expand-syncfree", "SequentialMLP", 500.0), "tokens": 16},
            {"model": "m", "tokens": 16, "variant": "flex-deepep-v1", "unavailable": "not here"}]
    series, hatched = compare_dispatchers.bar_series(rows, [("m", 8), ("m", 16)])
    assert series == {
        "alltoall (SequentialMLP)": [4.0, 8.0],
        "alltoall-syncfree (SyncFreeSequentialMLP)": [0.0, 2.0],
        "alltoall-syncfree-graphs (SyncFreeSequentialMLP; route+preprocess, postprocess graphed)": [0.0, 1.0],
        "deepepv2-expand-syncfree (SequentialMLP)": [0.0, 0.5]}
    assert hatched == [False, True, True, False]
    assert compare_dispatchers.bar_label("deepepv2-no-host-sync-layer-graph", "SyncFreeSequentialMLP",
                                         compare_dispatchers.WHOLE_LAYER) == (
        "deepepv2-no-host-sync-layer-graph (SyncFreeSequentialMLP; whole layer in a CUDA graph)")
    assert compare_dispatchers.bar_series([], [("m", 8)]) == ({"nothing measured": [0.0]}, [False])


def _as_a_replay(stage, dispatcher):
    """``stage`` run eagerly, then the dispatcher's ``cudagraph_attrs`` put back to what they held before it: what a
    graph's replay leaves (it runs no Python, so the attributes are what the previous eager stage left)."""
    def replay(x):
        before = {name: getattr(dispatcher, name) for name in dispatcher.cudagraph_attrs}
        outputs = stage(x)
        for name, value in before.items():
            setattr(dispatcher, name, value)
        return outputs

    return replay


def _staged_against_layer(rank: int, world: int) -> tuple:
    import torch

    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims
    from megatron_deepepv2.testing.moe_model import layer_step

    install_cpu_shims()
    variants = {v.name: v for v in compare_dispatchers.VARIANTS}
    args = compare_dispatchers._parse(["--cpu"])
    model = compare_dispatchers.MODELS["tiny"]
    weights: dict = {}
    plain = compare_dispatchers._build_layer(variants["alltoall-syncfree"], model, 48, args, False, weights)
    layer = compare_dispatchers._build_layer(variants["alltoall-syncfree-graphs"], model, 48, args, False, weights)
    # Megatron's own configuration of the capture moved the dispatcher's host copies out of the graphed stage.
    assert plain.token_dispatcher.cuda_dtoh_point == "before_permutation_1"
    assert layer.token_dispatcher.cuda_dtoh_point == "before_ep_alltoall"
    stages = compare_dispatchers.MoEStages(layer)
    route = _as_a_replay(stages.route_and_preprocess, layer.token_dispatcher)
    grad = torch.ones(48, 1, model.hidden)
    layer_step(layer, torch.randn(48, 1, model.hidden, requires_grad=True), grad)  # the graph's capture, eager
    for seed in (1, 2):  # the second input routes otherwise: nothing of the first may remain
        x = torch.randn(48, 1, model.hidden, generator=torch.Generator().manual_seed(10 * seed + rank))
        x.requires_grad_()
        expected = layer_step(plain, x, grad).detach()
        expected_grads = {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in plain.named_parameters()}}
        output = compare_dispatchers.staged_step(stages, x, grad, route_stage=route, host_wait=lambda: None)
        grads = {"x": x.grad, **{n: p.grad for n, p in layer.named_parameters()}}
        assert torch.equal(output, expected), (output - expected).abs().max()
        assert grads.keys() == expected_grads.keys()
        for name, value in grads.items():
            assert torch.equal(value, expected_grads[name]), (name, (value - expected_grads[name]).abs().max())
    return stages.attr_names, layer.token_dispatcher.cudagraph_attrs


@pytest.mark.parametrize("world", [1, 2])
def test_the_layer_run_in_megatrons_graph_stages_computes_its_forward_and_backward_bit_for_bit(world: int) -> None:
    """The stages the GPU graphs capture and replay, run eagerly on CPU ranks, the dispatcher's tensors left stale
    by the route + preprocess stage as a replay leaves them: output, input gradient and every parameter gradient
    equal the plain alltoall-syncfree layer's own forward + backward, bit for bit, on two inputs in a row."""
    names, cudagraph_attrs = run_distributed(_staged_against_layer, world, timeout=120,
                                             env={"LOCAL_WORLD_SIZE": str(world)})[0]
    # What the route + preprocess graph's outputs carry: Megatron's cudagraph_attrs that hold tensors (0.19 adds the
    # router's probs), the counts and splits the eager stage reads among them.
    needed = {"tokens_per_expert", "num_global_tokens_per_local_expert", "reversed_local_input_permutation_mapping",
              "routing_map"} | ({"input_splits", "output_splits", "output_splits_tp"} if world > 1 else set())
    assert needed <= set(names) <= set(cudagraph_attrs) - {"num_out_tokens", "hidden_shape"}, (names, cudagraph_attrs)


def _graphs_against_layer(rank: int, world: int) -> list[float]:
    import torch

    from megatron_deepepv2.testing.moe_model import init_expert_parallel, layer_step

    init_expert_parallel()  # before Megatron's CUDA RNG tracker is seeded
    variants = {v.name: v for v in compare_dispatchers.VARIANTS}
    args = compare_dispatchers._parse([])
    model = compare_dispatchers.ModelShape(hidden=256, experts=8, topk=2, ffn=128)
    weights: dict = {}
    plain = compare_dispatchers._build_layer(variants["alltoall-syncfree"], model, 256, args, True, weights)
    layer = compare_dispatchers._build_layer(variants["alltoall-syncfree-graphs"], model, 256, args, True, weights)
    x = torch.randn(256, 1, model.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn_like(x)
    graphs = compare_dispatchers.PartialGraphs(layer, x)
    differences = []
    for seed in (1, 2):  # new values in the static input: routed otherwise, replayed right
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        expected = layer_step(plain, x, grad).detach().float()
        expected_grads = [x.grad.float()] + [p.grad.float() for p in plain.parameters()]
        output = graphs.step(x, grad).float()
        grads = [x.grad.float()] + [p.grad.float() for p in layer.parameters()]
        for got, want in zip([output, *grads], [expected, *expected_grads]):
            differences.append(float((got - want).abs().max() / want.abs().max()))
    return differences


@pytest.mark.gpu
def test_megatrons_partial_graphs_replay_what_the_layer_computes_on_a_gpu() -> None:
    """The route + preprocess and postprocess graphs replayed around the eager stage: output and gradients of the
    layer's forward + backward (BF16, up to the order of atomic additions), on two inputs in a row."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (CUDA graphs)")
    differences = run_distributed(_graphs_against_layer, 1, timeout=300, cuda=True, env={"LOCAL_WORLD_SIZE": "1"})[0]
    assert max(differences) <= 1e-2, differences
