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
                  "deepepv2-no-host-sync-layer-graph": "alltoall-syncfree"}


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
    assert "needs CUDA" in by_name["deepepv2-no-host-sync-layer-graph"]["unavailable"]
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
    assert written["variants"]["deepepv2-no-host-sync-layer-graph"]["cuda_graph"] is True
    table = (tmp_path / "compare_dispatchers.md").read_text()
    assert "### tiny, 48 tokens per rank" in table and "(ok)" in table and f"{DEFAULT_NUM_SMS} SMs" in table
    lines = {line.split(" | ")[0].lstrip("| "): line for line in table.splitlines() if line.startswith("| ")}
    for name, baseline in LAYER_BASELINE.items():
        if name in RUNNABLE_ON_CPU:
            assert f"x vs {baseline} |" in lines[name] and f"| {EXPERTS[name]} |" in lines[name], lines[name]
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
