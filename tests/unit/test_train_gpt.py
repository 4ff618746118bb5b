"""``tools/train_gpt.py`` on the CPU: the step recorder around Megatron's training log, and the report of runs."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import pytest
import torch

from tools import train_gpt


def test_recorder_keeps_each_step_exactly_and_passes_the_call_on(tmp_path: Path, monkeypatch) -> None:
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1), raising=False)
    monkeypatch.setenv("MEGATRON_DEEPEPV2_EXPERTS", "sync_free")
    calls = []

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, params_norm, *rest, **kwargs):
        calls.append((iteration, params_norm, kwargs))
        return "flag"

    path = tmp_path / "run.jsonl"
    recorded = train_gpt.StepRecorder(str(path), "deepepv2").wrap(training_log)
    losses = [torch.tensor(v, dtype=torch.float32) for v in (10.123456789, 9.87654321, 9.5)]
    for iteration, loss in enumerate(losses, start=1):
        flag = recorded({"lm loss": loss, "load_balancing_loss": torch.tensor([3.0, 2.0])}, {}, 3e-4, iteration,
                        1.0, True, 0, 0.25 * iteration, None, is_first_iteration=iteration == 1)
        assert flag == "flag"
    assert [c[0] for c in calls] == [1, 2, 3] and calls[0][2] == {"is_first_iteration": True}

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    header, steps = lines[0], lines[1:]
    assert header["label"] == "deepepv2" and header["tokens_per_step"] == 32
    assert header["environment"]["MEGATRON_DEEPEPV2_EXPERTS"] == "sync_free"
    assert set(header["provenance"]) == {"git_commit", "git_dirty", "date"}
    for step, loss in zip(steps, losses):
        assert float.fromhex(step["losses_hex"]["lm loss"]) == loss.item()  # the float32 value, bit for bit
        assert step["losses"]["load_balancing_loss"] == 1.5  # a (sum, count) pair
        assert float.fromhex(step["grad_norm_hex"]) == 0.25 * step["iteration"]
    assert steps[0]["seconds"] is None and all(s["seconds"] >= 0 for s in steps[1:])


def _write_run(path: Path, label: str, losses: list[float], seconds: list[float], tokens: int = 4096) -> str:
    lines = [{"label": label, "tokens_per_step": tokens}]
    for i, (loss, s) in enumerate(zip(losses, seconds), start=1):
        lines.append({"iteration": i, "losses": {"lm loss": loss}, "losses_hex": {"lm loss": loss.hex()},
                      "grad_norm": 1.0 / i, "grad_norm_hex": (1.0 / i).hex(), "seconds": s})
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_report_compares_runs_with_a_baseline_and_bit_for_bit(tmp_path: Path) -> None:
    base_losses = [10.0 - 0.01 * i for i in range(40)]
    run_losses = [v + (0.003 if i == 17 else 0.001) for i, v in enumerate(base_losses)]
    base = _write_run(tmp_path / "a.jsonl", "alltoall", base_losses, [None] + [0.2] * 39)
    run = _write_run(tmp_path / "b.jsonl", "deepepv2", run_losses, [None] + [0.1 + 0.001 * i for i in range(39)])
    twin = _write_run(tmp_path / "c.jsonl", "twin", run_losses, [None] * 40)
    off = list(run_losses)
    off[25] = math.nextafter(off[25], math.inf)  # one ulp
    differs = _write_run(tmp_path / "d.jsonl", "off", off, [None] * 40)

    document = train_gpt.report([base, run], "alltoall", [f"{run}:{twin}", f"{run}:{differs}"], skip=10)
    by_label = {r["label"]: r for r in document["runs"]}
    expected_step_s = statistics.median(0.1 + 0.001 * i for i in range(9, 39))  # steps 11..40
    assert math.isclose(by_label["deepepv2"]["median_step_ms"], expected_step_s * 1e3)
    assert math.isclose(by_label["deepepv2"]["tokens_per_s"], 4096 / expected_step_s)
    assert math.isclose(by_label["alltoall"]["tokens_per_s"], 4096 / 0.2)
    gap = document["loss_gap"]["deepepv2"]
    assert gap["iterations"] == 40 and gap["at_iteration"] == 18 and math.isclose(gap["max_abs"], 0.003, rel_tol=1e-6)
    assert math.isclose(gap["last_abs"], 0.001, rel_tol=1e-6)
    same, other = document["bitwise"]
    assert same["equal"] and same["range"] == [1, 40]
    assert not other["equal"] and other["first_difference"] == 26


def test_report_command_fails_when_runs_that_must_be_equal_differ(tmp_path: Path) -> None:
    losses = [5.0, 4.0, 3.0]
    first = _write_run(tmp_path / "x.jsonl", "x", losses, [None, 0.1, 0.1])
    second = _write_run(tmp_path / "y.jsonl", "y", [5.0, 4.0, 3.0000001], [None, 0.1, 0.1])
    assert train_gpt.main(["report", first, "--out", str(tmp_path / "o"), "--equal", f"{first}:{first}"]) == 0
    assert train_gpt.main(["report", first, second, "--out", str(tmp_path / "o"), "--equal", f"{first}:{second}"]) == 1
    document = json.loads((tmp_path / "o" / "training.json").read_text())
    assert document["bitwise"][0]["first_difference"] == 3


def test_repeated_runs_of_a_configuration_pool_into_medians_and_targets(tmp_path: Path) -> None:
    """Two interleaved pairs: each run reported as LABEL#k, each configuration as the median of its runs' medians,
    and a target as the ratio of those, with each pair's own ratio beside it."""
    paths = [_write_run(tmp_path / "a1.jsonl", "alltoall", [5.0] * 6, [None, 0.20, 0.20, 0.21, 0.20, 0.90]),
             _write_run(tmp_path / "d1.jsonl", "deepepv2", [5.0] * 6, [None, 0.18, 0.19, 0.18, 0.18, 0.18]),
             _write_run(tmp_path / "a2.jsonl", "alltoall", [5.0] * 6, [None, 0.24, 0.24, 0.25, 0.24, 0.24]),
             _write_run(tmp_path / "d2.jsonl", "deepepv2", [5.0] * 6, [None, 0.25, 0.25, 0.25, 0.26, 0.25])]
    document = train_gpt.report(paths, "alltoall", [], skip=1,  # steps 2..6
                                targets=["deepepv2:alltoall:1.0", "deepepv2:alltoall:0.9"])
    assert [r["run"] for r in document["runs"]] == ["alltoall#1", "deepepv2#1", "alltoall#2", "deepepv2#2"]
    group = document["configurations"]["deepepv2"]
    assert group["median_step_ms_each"] == [180.0, 250.0] and math.isclose(group["median_step_ms"], 215.0)
    assert math.isclose(group["spread_pct"], 70 / 215 * 100)
    assert math.isclose(group["tokens_per_s"], 4096 / 0.215)
    assert document["configurations"]["alltoall"]["median_step_ms_each"] == [200.0, 240.0]
    loose, tight = document["targets"]
    assert math.isclose(loose["ratio"], 215 / 220) and loose["met"] and not loose["met_in_every_pair"]
    assert [round(r, 4) for r in loose["pair_ratios"]] == [0.9, round(250 / 240, 4)]
    assert not tight["met"]
    assert set(document["loss_gap"]) == {"deepepv2#1", "alltoall#2", "deepepv2#2"}
    with pytest.raises(ValueError, match="no runs labelled \\['allgather'\\]"):
        train_gpt.report(paths, None, [], skip=1, targets=["deepepv2:allgather:1.0"])


def test_recorder_traces_the_asked_iterations_for_the_trace_summary(tmp_path: Path, monkeypatch) -> None:
    from megatron.training import global_vars

    from tools import trace_summary

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1), raising=False)
    trace = tmp_path / "trace.json.gz"
    recorded = train_gpt.StepRecorder(str(tmp_path / "run.jsonl"), "x", profile=(3, 4), profile_out=str(trace)).wrap(
        lambda *args, **kwargs: None)

    def a_training_step(seconds: float) -> None:
        time.sleep(seconds)

    for iteration in range(1, 7):
        a_training_step(0.03 if iteration in (3, 4) else 0.001)  # iteration i runs, then its training_log
        recorded({"lm loss": torch.tensor(1.0)}, {}, 1e-4, iteration, 1.0, True, 0, 1.0, None)
    summary = trace_summary.summarise(trace_summary.load_trace(str(trace)), frames=re.compile("test_train_gpt"))
    assert summary["steps"] == [3, 4] and 30 <= summary["wall_ms"] < 60
    (step_frame,) = [name for name in summary["python"] if name.endswith(": a_training_step")]
    assert summary["python"][step_frame]["calls"] == 1 and 30 <= summary["python"][step_frame]["ms"] < 60


def test_profile_option_needs_a_window_and_a_file(capsys) -> None:
    with pytest.raises(SystemExit):
        train_gpt.main(["record", "--out", "x.jsonl", "--profile", "5:3", "--profile-out", "t.json", "--", "s.py"])
    assert "1 <= FIRST <= LAST" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_gpt.main(["record", "--out", "x.jsonl", "--profile", "3:5", "--", "s.py"])
    assert "--profile needs --profile-out" in capsys.readouterr().err


def test_throughput_bars_span_the_runs_and_never_go_below_zero() -> None:
    """Error bars from the slowest to the fastest run; with one run zero wide, also where the arithmetic rounds below
    zero (a recorded run's values: its upper bar computes as -7e-15, which the plot refuses)."""
    median = 65.88396649999595
    single = {"tokens_per_s": 62169.90593607099, "median_step_ms": median, "median_step_ms_each": [median]}
    pooled = {"tokens_per_s": 4096 / 0.1, "median_step_ms": 100.0, "median_step_ms_each": [80.0, 100.0, 125.0]}
    tokens, lows, highs = train_gpt.throughput_bars([single, pooled])
    assert tokens == pytest.approx([62.16990593607099, 40.96])
    assert 0.0 <= lows[0] < 1e-9 and 0.0 <= highs[0] < 1e-9
    assert lows[1] == pytest.approx(40.96 - 4096 / 125) and highs[1] == pytest.approx(4096 / 80 - 40.96)
