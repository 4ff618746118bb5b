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

from tests import preloaded_python

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_host_overhead.py"
VARIANTS = {"ops_resolved_per_call", "ops_config", "ops_config_no_id_check", "ops_megatron_config", "backend_floor",
            "autograd_floor"}


def _tool_module():
    sys.path.insert(0, str(TOOL.parent))
    try:
        import bench_host_overhead
    finally:
        sys.path.remove(str(TOOL.parent))
    return bench_host_overhead


def test_compare_measures_each_tree_in_its_own_processes(tmp_path: Path) -> None:
    # One process per tree (each costs seconds, nearly all of it importing torch): how several processes of a tree
    # are summarised is the next test's.
    subprocess.run([preloaded_python.python(), str(TOOL), "--out", str(tmp_path), "--compare", "first=.", "second=.",
                    "--processes", "1", "--iters", "2", "--warmup", "1", "--no-plot"], check=True, timeout=300,
                   capture_output=True)
    rows = json.loads((tmp_path / "bench_host_overhead.json").read_text())
    assert set(rows) == {"first", "second"}
    for label, variants in rows.items():
        assert set(variants) == VARIANTS, (label, sorted(variants))
        for name, result in variants.items():
            assert len(result["processes"]) == 1 and all(math.isfinite(v) for v in result["processes"]), (label, name)
            assert result["layer_min"] == min(result["processes"]), (label, name)


def test_the_processes_of_a_tree_are_summarised_by_their_smallest_and_median() -> None:
    samples = {"before": {"ops": [30.0, 10.0, 50.0, 20.0]}, "now": {"ops": [7.0], "floor": [2.0, 4.0]}}
    assert _tool_module().summarise_processes(samples) == {
        "before": {"ops": {"layer_min": 10.0, "layer_median": 25.0, "processes": [30.0, 10.0, 50.0, 20.0]}},
        "now": {"ops": {"layer_min": 7.0, "layer_median": 7.0, "processes": [7.0]},
                "floor": {"layer_min": 2.0, "layer_median": 3.0, "processes": [2.0, 4.0]}}}


def test_package_free_variants_are_built_without_importing_the_package() -> None:
    # What keeps a callgrind count of bare_tensor_ops cheap: under valgrind every import costs tens of times more.
    code = (f"import sys; sys.path.insert(0, {str(TOOL.parent)!r}); import bench_host_overhead as tool; "
            "steps = tool.build_variants({'bare_tensor_ops', 'autograd_floor'}); "
            "[step() for step in steps.values()]; "
            "print(sorted(steps), 'megatron_deepepv2' in sys.modules)")
    done = subprocess.run([preloaded_python.python(), "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split("\n")[-2] == "['autograd_floor', 'bare_tensor_ops'] False", done.stdout


@pytest.mark.skipif(shutil.which("valgrind") is None or shutil.which("callgrind_control") is None,
                    reason="--instructions needs valgrind (callgrind) on PATH")
def test_instructions_counts_the_steps_under_callgrind(tmp_path: Path) -> None:
    # One variant, which needs no package (so no checkout's variants are listed first): a callgrind run still costs
    # about 40 s of CPU, nearly all of it loading torch's libraries under valgrind.
    subprocess.run([sys.executable, str(TOOL), "--out", str(tmp_path), "--instructions", "--variants",
                    "bare_tensor_ops", "--steps", "3", "--warmup", "2", "--no-plot"], check=True, timeout=280,
                   capture_output=True)
    (variants,) = json.loads((tmp_path / "bench_host_instructions.json").read_text()).values()
    # Two small tensor ops and their backward: hundreds of thousands of instructions, not the import or the dumps.
    assert set(variants) == {"bare_tensor_ops"} and 20_000 < variants["bare_tensor_ops"]["instructions"] < 2_000_000


def test_layer_instructions_are_relative_to_bare() -> None:
    bench_host_overhead = _tool_module()
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
