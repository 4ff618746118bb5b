"""tools/trace_summary.py: step figures, GPU busy time, synchronising calls and their call sites, Python attribution."""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
import time
from pathlib import Path

import torch

from tools import trace_summary


def _event(cat: str, name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def _synthetic() -> list[dict]:
    """Two steps of 1,000 us. Step 1: kernels at 100-300 and 200-400 (overlapping: 300 us busy), a sync of 150 us
    inside megatron's dispatch; step 2: one kernel of 500 us, a sync of 50 us in the experts, one outside any frame."""
    return [
        _event("user_annotation", "ProfilerStep#5", 0, 1000),
        _event("user_annotation", "ProfilerStep#6", 1000, 1000),
        _event("python_function", "/x/megatron/core/transformer/moe/moe_layer.py(10): forward", 10, 900),
        _event("python_function", "/x/megatron_deepepv2/mcore/manager.py(20): dispatch", 50, 400),
        _event("python_function", "<built-in method synchronize>", 60, 300),
        _event("cuda_runtime", "cudaStreamSynchronize", 100, 150),
        _event("cuda_runtime", "cudaLaunchKernel", 500, 5),
        _event("kernel", "gemm", 100, 200, tid=7),
        _event("kernel", "gemm", 200, 200, tid=7),
        _event("python_function", "/x/megatron/core/transformer/moe/experts.py(30): forward", 1100, 600),
        _event("cuda_runtime", "cudaEventSynchronize", 1200, 50),
        _event("cuda_runtime", "cudaDeviceSynchronize", 1800, 40),
        _event("kernel", "swiglu", 1300, 500, tid=7),
        _event("kernel", "outside any step", 5000, 10, tid=7),
    ]


def test_steps_gpu_busy_syncs_and_their_sites_from_a_synthetic_trace() -> None:
    summary = trace_summary.summarise(_synthetic())
    assert summary["steps"] == [5, 6]
    assert summary["wall_ms"] == 1.0 and summary["gpu_busy_ms"] == 0.4 and summary["gpu_idle_ms"] == 0.6
    assert summary["kernels"] == 1.5 and summary["syncs"] == 1.5
    assert summary["sync_wait_ms"] == 0.12  # (150 + 50 + 40) us over two steps
    sites = summary["sync_sites"]
    # A frame is named by the last two parts of its path.
    assert sites["cudaStreamSynchronize @ moe/moe_layer.py(10): forward > mcore/manager.py(20): dispatch"] \
        == {"calls": 0.5, "ms": 0.075}
    assert sites["cudaEventSynchronize @ moe/experts.py(30): forward"] == {"calls": 0.5, "ms": 0.025}
    assert sites["cudaDeviceSynchronize @ (no Python frame)"] == {"calls": 0.5, "ms": 0.02}
    assert summary["python"]["mcore/manager.py(20): dispatch"] == {"calls": 0.5, "ms": 0.2}
    assert "<built-in method synchronize>" not in summary["python"]


def _profile(path: Path, sleep_s: float) -> None:
    def slow_part() -> None:
        time.sleep(sleep_s)

    schedule = torch.profiler.schedule(wait=0, warmup=1, active=3)  # a schedule marks ProfilerStep#N
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True,
                                schedule=schedule, on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        for _ in range(4):
            torch.ones(8).sum()
            slow_part()
            prof.step()


def test_a_real_profile_and_the_difference_of_two(tmp_path: Path) -> None:
    _profile(tmp_path / "fast.json", 0.01)
    _profile(tmp_path / "slow.json", 0.04)
    with open(tmp_path / "slow.json", "rb") as f, gzip.open(tmp_path / "slow.json.gz", "wb") as out:
        out.write(f.read())
    frames = re.compile(r"test_trace_summary")
    fast = trace_summary.summarise(trace_summary.load_trace(str(tmp_path / "fast.json")), frames=frames)
    slow = trace_summary.summarise(trace_summary.load_trace(str(tmp_path / "slow.json.gz")), frames=frames)
    assert slow["steps"] == [1, 2, 3] and 40 <= slow["wall_ms"] < 80 and 10 <= fast["wall_ms"] < 40
    (frame,) = [name for name in slow["python"] if name.endswith(": slow_part")]
    assert 40 <= slow["python"][frame]["ms"] < 60 and slow["python"][frame]["calls"] == 1
    assert slow["ops"]["aten::sum"]["calls"] >= 1 and slow["ops"]["aten::ones"]["calls"] >= 1
    differences = trace_summary.diff({"fast": fast, "slow": slow})
    row = differences["runs"]["slow"]
    assert differences["baseline"] == "fast" and 20 <= row["wall_ms"][2] < 45
    assert next(iter(row["python"])).endswith(": slow_part")  # the largest difference comes first


def test_the_command_writes_json_and_png(tmp_path: Path) -> None:
    trace = tmp_path / "a.json"
    trace.write_text(json.dumps({"traceEvents": _synthetic()}))
    assert trace_summary.main([f"one={trace}", f"two={trace}", "--out", str(tmp_path), "--name", "t"]) == 0
    document = json.loads((tmp_path / "t.json").read_text())
    assert document["diff"]["runs"]["two"]["wall_ms"] == [1.0, 1.0, 0.0]
    assert document["provenance"]["date"].startswith("20")
    assert (tmp_path / "t.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
