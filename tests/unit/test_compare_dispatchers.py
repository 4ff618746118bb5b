"""``tools/compare_dispatchers.py`` on 2 CPU ranks: every variant it can run here runs, and each agrees with
Megatron's ``alltoall`` (the oracle), the ones it cannot say why, and the outputs are written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.distributed import run_distributed

RUNNABLE_ON_CPU = ["alltoall", "allgather", "deepepv2-expand", "deepepv2-expand-no-host-sync"]


def _smoke(rank: int, world: int, out: str) -> list[dict]:
    from tools import compare_dispatchers

    args = compare_dispatchers._parse(["--cpu", "--models", "tiny", "--tokens", "48", "--iters", "2", "--warmup", "1",
                                       "--out", out])
    return compare_dispatchers.run_rank(rank, args, False, {"device": "cpu", "world_size": world})


@pytest.mark.parametrize("world", [1, 2])
def test_every_runnable_variant_runs_and_matches_alltoall(world: int, tmp_path: Path) -> None:
    """World 1 is EP=1 (one GPU's comparison: the fixed costs of each dispatcher, no traffic between ranks)."""
    from tools import compare_dispatchers

    rows = run_distributed(_smoke, world, str(tmp_path), timeout=240, env={"LOCAL_WORLD_SIZE": str(world)})[0]
    by_name = {row["variant"]: row for row in rows}
    assert list(by_name) == [variant.name for variant in compare_dispatchers.VARIANTS]
    for name in RUNNABLE_ON_CPU:
        assert by_name[name]["path_us"] > 0 and by_name[name]["layer_us"] > 0, by_name[name]
    for name in RUNNABLE_ON_CPU[1:]:
        assert by_name[name]["matches"] and by_name[name]["max_rel_diff"] <= 1e-4, by_name[name]
    assert "fused_a2a.HAVE_DEEP_EP is False" in by_name["flex-deepep-v1"]["unavailable"]
    assert "needs CUDA" in by_name["deepepv2-expand-graph"]["unavailable"]

    # Rank 0 wrote the outputs after the model.
    written = json.loads((tmp_path / "compare_dispatchers.json").read_text())
    assert written["rows"] == rows and written["world_size"] == world
    table = (tmp_path / "compare_dispatchers.md").read_text()
    assert "### tiny, 48 tokens per rank" in table and "| deepepv2-expand |" in table and "(ok)" in table
    # The plot needs matplotlib (the bench extra, not the test one); the data never depend on it.
    assert (tmp_path / "compare_dispatchers.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
