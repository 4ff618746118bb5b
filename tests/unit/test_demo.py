"""The README's main job: the demo trains with deepepv2 and matches the alltoall loss trajectory."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_and_loss_trajectories_match() -> None:
    done = subprocess.run([sys.executable, "-m", "megatron_deepepv2.demo", "--steps", "4", "--cpu"],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "[deepepv2] step   4/4" in output and ": MATCH" in output


def test_demo_compares_fp8_with_bf16_dispatch() -> None:
    """``--fp8-dispatch``: the deepepv2 layer trained with BF16 and with FP8 dispatch; the curves stay within the
    tolerance and the received rows' quantisation error is reported."""
    done = subprocess.run([sys.executable, "-m", "megatron_deepepv2.demo", "--steps", "4", "--cpu", "--fp8-dispatch"],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "[deepepv2] step   4/4" in output and "[deepepv2 fp8] step   4/4" in output, output[-3000:]
    assert "FP8 dispatch, step 1: received rows' error relative to each row's largest value: max" in output
    assert "(deepepv2 (FP8 dispatch)); largest difference" in output and ": MATCH" in output
