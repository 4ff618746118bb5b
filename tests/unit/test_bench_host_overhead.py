"""``tools/bench_host_overhead.py``: ``--compare`` measures every tree in its own processes and reports every variant;
``--instructions`` counts each variant's instructions under callgrind."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_host_overhead.py"
VARIANTS = {"ops_resolved_per_call", "ops_config", "ops_config_no_id_check", "ops_megatron_config", "backend_floor",
            "autograd_floor"}


def test_compare_measures_each_tree_in_its_own_processes(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--compare", "first=.", "second=.",
                    "--processes", "2", "--iters", "2", "--warmup", "1", "--no-plot"], check=True, timeout=300,
                   capture_output=True)
    rows = json.loads((tmp_path / "bench_host_overhead.json").read_text())
    assert set(rows) == {"first", "second"}
    for label, variants in rows.items():
        assert set(variants) == VARIANTS, (label, sorted(variants))
        for name, result in variants.items():
            assert len(result["processes"]) == 2 and all(math.isfinite(v) for v in result["processes"]), (label, name)
            assert result["layer_min"] == min(result["processes"]), (label, name)


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="--instructions needs valgrind (callgrind) on PATH")
def test_instructions_counts_the_steps_under_callgrind(tmp_path: Path) -> None:
    # One variant (a callgrind run costs a minute of CPU, most of it importing torch): the end-to-end count.
    subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--instructions", "--variants",
                    "bare_tensor_ops", "--steps", "3", "--warmup", "2", "--no-plot"], check=True, timeout=280,
                   capture_output=True)
    (variants,) = json.loads((tmp_path / "bench_host_instructions.json").read_text()).values()
    # Two small tensor ops and their backward: hundreds of thousands of instructions, not the import or the dumps.
    assert set(variants) == {"bare_tensor_ops"} and 20_000 < variants["bare_tensor_ops"]["instructions"] < 2_000_000


def test_layer_instructions_are_relative_to_bare() -> None:
    sys.path.insert(0, str(TOOL.parent))
    try:
        import bench_host_overhead
    finally:
        sys.path.remove(str(TOOL.parent))
    rows = {"now": {"ops": {"instructions": 500.0}, "bare_tensor_ops": {"instructions": 200.0}},
            "bare_missing": {"ops": {"instructions": 7.0}}}
    assert bench_host_overhead.layer_instructions(rows) == {
        "now": {"ops": {"instructions": 500.0, "layer_instructions": 300.0}, "bare_tensor_ops": {"instructions": 200.0}},
        "bare_missing": {"ops": {"instructions": 7.0}}}


def test_a_tree_that_is_not_a_checkout_is_refused(tmp_path: Path) -> None:
    # Otherwise the installed package would be measured under the other tree's label.
    for mode in ([], ["--instructions"]):
        run = subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), *mode, "--compare", "now=.",
                              f"other={tmp_path}", "--no-plot"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 2 and "is not a checkout of this package" in run.stderr, run.stderr
    assert not (tmp_path / "bench_host_overhead.json").exists()
