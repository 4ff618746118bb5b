"""The README's main job: the demo trains with deepepv2 and matches the alltoall loss trajectory."""

from __future__ import annotations

import logging
import os
import subprocess

import pytest

from tests import preloaded_python


def test_demo_compares_fp8_with_bf16_dispatch() -> None:
    """``--fp8-dispatch``: the deepepv2 layer trained with BF16 (the demo's own run, which must match alltoall's loss
    trajectory) and with FP8 dispatch; the curves stay within the tolerance and the received rows' quantisation error
    is reported. (``make demo`` as written runs in test_readme.)"""
    done = subprocess.run([preloaded_python.python(), "-m", "megatron_deepepv2.cli.demo", "--steps", "4", "--cpu", "--fp8-dispatch"],
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "[deepepv2] step   4/4" in output and "[deepepv2 fp8] step   4/4" in output, output[-3000:]
    assert "FP8 dispatch, step 1: received rows' error relative to each row's largest value: max" in output
    assert "(deepepv2 (FP8 dispatch)); largest difference" in output and ": MATCH" in output


@pytest.mark.parametrize("argv,nics,user_value,expected", [
    (["--backend", "reference"], [], None, "1"),  # GPU ranks, no RDMA NIC: set for them
    (["--backend", "reference"], ["/sys/class/infiniband/mlx5_0"], None, None),  # a NIC: left unset
    (["--backend", "reference"], [], "0", "0"),  # the user's value stays
    (["--cpu"], [], None, None),  # CPU ranks build no ElasticBuffer: left unset
])
def test_demo_sets_ep_disable_gin_for_gpu_ranks_without_an_rdma_nic(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture, argv, nics,
                                                                    user_value, expected) -> None:
    """``make demo`` on a (faked) one-GPU node: the environment the ranks are launched with, with a faked NIC probe;
    one INFO line when the demo set the variable."""
    import torch

    from megatron_deepepv2.cli import demo, doctor

    launched: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(doctor, "find_rdma_devices", lambda: nics)
    monkeypatch.setattr(demo, "spawn_on_free_port", lambda *a, **k: launched.append(os.environ.get("EP_DISABLE_GIN")))
    monkeypatch.setattr(demo, "_fork_cpu_ranks", lambda config: launched.append(os.environ.get("EP_DISABLE_GIN")))
    for name in ("EP_DISABLE_GIN", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"):  # recorded: teardown undoes main's
        monkeypatch.setenv(name, "placeholder")
        monkeypatch.delenv(name)
    if user_value is not None:
        monkeypatch.setenv("EP_DISABLE_GIN", user_value)
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.cli.doctor")

    assert demo.main(["--steps", "1", *argv]) == 0
    assert launched == [expected]
    lines = [r for r in caplog.records if "EP_DISABLE_GIN=1" in r.getMessage()]
    assert len(lines) == (1 if expected == "1" and user_value is None else 0), lines
