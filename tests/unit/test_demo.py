"""The README's main job: the demo trains with deepepv2 and matches the alltoall loss trajectory."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_and_loss_trajectories_match() -> None:
    done = subprocess.run([sys.executable, "-m", "megatron_deepepv2.demo", "--steps", "4", "--layout", "compact", "--cpu"],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "[deepepv2] step   4/4" in output and ": MATCH" in output
