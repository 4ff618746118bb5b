"""``tools/memory_budget.py``: the per-layer memory table written from DeepEP's buffer arithmetic."""

from __future__ import annotations

import json
import os
import subprocess

from tests import preloaded_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_memory_budget_writes_the_deepseek_v3_table(tmp_path) -> None:
    done = subprocess.run([preloaded_python.python(), "tools/memory_budget.py", "--ep", "8", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "memory_deepseek_v3.json").read_text())
    rows = {row["mode"]: row for row in document["rows"]}
    # By hand: T 4096 x top-8 balanced rows of 7168 BF16 values = 448 MiB; the worst case is G = 8 times that; the
    # bound keeps 1.5x the balanced rows; the buffer is 8 x 4096 dispatch slots of 14,464 bytes = 452 MiB.
    assert rows["host sync"]["received_mib"] == 448 and rows["host sync"]["buffer_mib"] == 452
    assert rows["no host sync"]["received_mib"] == 8 * 448
    assert rows["no host sync, bound 1.5"]["received_mib"] == 672
    assert rows["no host sync, bound 1.5"]["kept_mib"] == 452 + 672
    assert "EP8" in done.stderr and document["computed_not_measured"] is True
