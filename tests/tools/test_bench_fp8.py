"""``tools/bench_fp8.py`` as a smoke run on the CPU: every row measured, the byte counts right, the outputs written."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from pathlib import Path

from tests import preloaded_python
from tools.compare_dispatchers import MODELS

ROOT = Path(__file__).resolve().parents[2]


def test_bench_fp8_smoke_run(tmp_path: Path) -> None:
    done = subprocess.run([preloaded_python.python(), str(ROOT / "tools" / "bench_fp8.py"), "--cpu", "--models", "qwen3-30b-a3b",
                           "mixtral-8x7b", "--tokens", "16", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "bench_fp8.json").read_text())["rows"]
    assert [(r["model"], r["tokens"], r["layout"]) for r in rows] == [
        (model, 16, layout) for model in ("qwen3-30b-a3b", "mixtral-8x7b") for layout in ("compact", "expand")]
    for row in rows:
        assert row["bf16_bytes"] == 16 * row["hidden"] * 2
        assert row["fp8_bytes"] == 16 * row["hidden"] + 16 * (row["hidden"] // 128) * 4  # values + fp32 scales
        assert row["quantize_us"] > 0 and row["dequantize_us"] > 0 and row["dispatch_combine_us"] > 0
        assert row["quantize_torch_us"] > 0 and row["dequantize_torch_us"] > 0
        # EP=1: compact receives each token once; expand one row per (token, expert), padded per expert to 16.
        model = MODELS[row["model"]]
        expand_rows = range(16 * model.topk, 16 * model.topk + 16 * model.experts)
        assert row["recv_rows"] == 16 if row["layout"] == "compact" else row["recv_rows"] in expand_rows
        assert row["overhead"] == (row["quantize_us"] + row["dequantize_us"]) / row["dispatch_combine_us"]
    assert "BF16 dispatch + combine" in done.stderr
    assert (tmp_path / "bench_fp8.png").exists() == (importlib.util.find_spec("matplotlib") is not None)
