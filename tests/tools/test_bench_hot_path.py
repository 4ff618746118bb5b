"""``tools/bench_hot_path.py`` on a CPU box: it refuses with the reason, its outputs are written from any rows, its
one reader of the DeepEP backend's internals finds the buffer, the extra dispatch arguments and the SM count, and its
manager rows dispatch with the configuration a Megatron layer resolves."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import preloaded_python

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import bench_hot_path  # noqa: E402

from tools import _bench  # noqa: E402


def test_without_a_gpu_it_says_what_it_needs(tmp_path: Path) -> None:
    done = subprocess.run([preloaded_python.python(), str(ROOT / "tools" / "bench_hot_path.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "needs a CUDA GPU with DeepEP" in done.stderr, done.stderr[-2000:]
    assert not list(tmp_path.iterdir())


def test_outputs_hold_every_row_and_the_targets(tmp_path: Path) -> None:
    times = {key: 100.0 + i for i, key in enumerate(bench_hot_path.VARIANTS)}
    rows = [{"label": bench_hot_path.HotPathConfig(4096, 4096).label, "layout": layout, "times_us": times,
             "ratios": bench_hot_path.ratios(times, bench_hot_path.TARGETS)} for layout in bench_hot_path.LAYOUTS]
    result = {"targets": bench_hot_path.TARGETS, "rows": rows, "launch_costs_us": {"eager_launch": 4.5}}
    _bench.write_outputs(str(tmp_path), bench_hot_path.NAME, result, bench_hot_path.plot)
    written = json.loads((tmp_path / "bench_hot_path.json").read_text())
    assert [row["layout"] for row in written["rows"]] == ["compact", "expand"]
    assert written["targets"] == {"ops_manager_streams/raw_autograd": 1.10, "ops_defaults/raw_autograd": 1.25,
                                  "ops_no_host_sync/ops_manager": 1.00, "graph_replay/kernel_time": 1.1}
    assert written["rows"][0]["ratios"]["ops_manager_streams/raw_autograd"] == times["ops_manager_streams"] / times[
        "raw_autograd"]
    assert written["launch_costs_us"] == {"eager_launch": 4.5}
    assert (tmp_path / "bench_hot_path.png").exists() == (importlib.util.find_spec("matplotlib") is not None)


def test_every_ratio_names_measured_variants() -> None:
    for name in [*bench_hot_path.TARGETS, *bench_hot_path.REPORTED_RATIOS]:
        numerator, denominator = name.split("/")
        assert {numerator, denominator} <= set(bench_hot_path.VARIANTS), name


def test_the_raw_buffer_is_read_from_the_backend_in_one_place() -> None:
    buffer = object()
    # The backend keeps the extra arguments with the calls of its DeepEP line.
    line = SimpleNamespace(dispatch_kwargs=(("do_handle_copy", False),), num_sms=lambda requested: requested + 1)
    handle = SimpleNamespace(buffer=SimpleNamespace(ep_buffer=buffer, line=line),
                             config=SimpleNamespace(settings=SimpleNamespace(num_sms=7)))
    # The SM count is the line's for the configuration's (a per-call argument of DeepEP).
    assert bench_hot_path._raw_buffer(handle) == (buffer, {"do_handle_copy": False}, 8)


@pytest.mark.parametrize("host_sync", [True, False])
def test_the_manager_rows_dispatch_as_a_megatron_layer_does(host_sync: bool) -> None:
    import megatron_deepepv2 as dv2
    from megatron_deepepv2.mcore.manager import dispatch_config_for
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    with _bench.process_group("gloo", one_rank=True), dv2.settings_override(
            backend="reference", num_max_tokens_per_rank=256, num_sms=6, host_sync=host_sync):
        layer = dispatch_config_for(transformer_config(TinyMoEConfig(), "deepepv2"))
        ours = bench_hot_path.manager_config("expand", 256, 6, host_sync, backend="reference")
    # The oracle is the manager's own resolution; a layer's alignment comes from its quantisation (none here: 1),
    # the tool's expand rows pad each expert block to 16.
    assert layer.expert_alignment == 1
    assert ours == replace(layer, expert_alignment=bench_hot_path.LAYOUTS["expand"]["expert_alignment"])
