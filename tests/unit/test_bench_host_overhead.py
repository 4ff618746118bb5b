"""``tools/bench_host_overhead.py --compare``: every tree is measured in its own processes, every variant reported."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_host_overhead.py"
VARIANTS = {"ops_resolved_per_call", "ops_config", "ops_config_no_id_check", "ops_megatron_config", "autograd_floor"}


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
