"""``tools/bench_hot_path.py`` on a CPU box: it refuses with the reason, and its outputs are written from any rows."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_hot_path  # noqa: E402


def test_without_a_gpu_it_says_what_it_needs(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_hot_path.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "needs a CUDA GPU with DeepEP" in done.stderr, done.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_outputs_hold_every_row_and_the_targets(tmp_path: Path) -> None:
    times = {key: 100.0 + i for i, key in enumerate(
        ["raw", "raw_no_host_sync", "ops_manager", "ops_defaults", "ops_no_host_sync", "graph_replay", "kernel_time"])}
    rows = [{"label": bench_hot_path.HotPathConfig(4096, 4096).label, "layout": layout, "times_us": times}
            for layout in bench_hot_path.LAYOUTS]
    bench_hot_path.write_outputs({"targets": bench_hot_path.TARGETS, "rows": rows}, str(tmp_path))
    written = json.loads((tmp_path / "bench_hot_path.json").read_text())
    assert [row["layout"] for row in written["rows"]] == ["compact", "expand"]
    assert written["targets"] == {"ops_manager/raw": 1.2, "ops_defaults/raw": 1.35,
                                  "ops_no_host_sync/ops_manager": 1.05, "graph_replay/kernel_time": 1.1}
    assert (tmp_path / "bench_hot_path.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
