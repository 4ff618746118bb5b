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

from tests import preloaded_python
from tests.launch_stand_ins import stand_in_launch
from tools import train_gpt


def test_recorder_keeps_each_step_exactly_and_passes_the_call_on(tmp_path: Path, monkeypatch) -> None:
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1), raising=False)
    monkeypatch.setenv("MEGATRON_DEEPEPV2_EXPERTS", "sync_free")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same record on a CPU and a GPU machine
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
    assert {"git_commit", "git_dirty", "date"} <= set(header["provenance"])
    assert header["experts"] == "SyncFreeSequentialMLP" and header["round"] is None and header["profile"] is None
    for step, loss in zip(steps, losses):
        assert float.fromhex(step["losses_hex"]["lm loss"]) == loss.item()  # the float32 value, bit for bit
        assert step["losses"]["load_balancing_loss"] == 1.5  # a (sum, count) pair
        assert float.fromhex(step["grad_norm_hex"]) == 0.25 * step["iteration"]
    assert steps[0]["seconds"] is None and all(s["seconds"] >= 0 for s in steps[1:])
    since_start = [s["since_start"] for s in steps]
    assert 0 < since_start[0] <= since_start[1] <= since_start[2], since_start
    assert all(s["cuda_graphs"] == train_gpt.CudaGraphCaptures.count for s in steps)
    assert header["device"] == "cpu" and header["versions"]["torch"] == torch.__version__.split("+")[0], header
    assert set(header["versions"]) >= {"torch", "megatron-core", "deep_ep", "transformer_engine"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA H100 80GB HBM3")
    assert train_gpt.StepRecorder(str(tmp_path / "gpu.jsonl"), "x")._header()["device"] == "NVIDIA H100 80GB HBM3"


def test_since_start_counts_from_the_launch_when_rounds_launched_the_run(tmp_path: Path, monkeypatch) -> None:
    from megatron.training import global_vars

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1), raising=False)
    monkeypatch.setenv(train_gpt.LAUNCHED_AT_VARIABLE, repr(time.time() - 100.0))
    monkeypatch.setenv("EP_JIT_CACHE_DIR", "/caches/deepep")  # a cold-cache run says so in its header
    path = tmp_path / "run.jsonl"
    recorded = train_gpt.StepRecorder(str(path), "launched").wrap(lambda *args, **kwargs: None)
    recorded({"lm loss": torch.tensor(1.0)}, {}, 1e-4, 1, 1.0, True, 0, 1.0, None)
    header, step = (json.loads(line) for line in path.read_text().splitlines())
    assert header["started_from"] == "launch" and 100.0 <= step["since_start"] < 160.0, (header, step)
    assert header["environment"]["EP_JIT_CACHE_DIR"] == "/caches/deepep"


def test_each_launch_gets_its_settings_its_launch_time_and_with_fresh_caches_empty_ones(tmp_path: Path) -> None:
    (first, second) = train_gpt.schedule(["deepepv2-nohostsync-graphs", "alltoall"], 1, str(tmp_path))
    before = time.time()
    env = train_gpt.launch_environment(first, "gpt-moe", "RUN", str(tmp_path))
    assert env["MODEL"] == "gpt-moe" and env["RUNNER"] == "RUN" and env["MEGATRON_DEEPEPV2_NO_HOST_SYNC"] == "1"
    assert before <= float(env[train_gpt.LAUNCHED_AT_VARIABLE]) <= time.time()
    assert not set(train_gpt.CACHE_VARIABLES) & (set(env) - set(__import__("os").environ))
    fresh = [train_gpt.launch_environment(launch, "gpt-moe", "RUN", str(tmp_path), fresh_caches=True)
             for launch in (first, second)]
    folders = [Path(env[variable]) for env in fresh for variable in train_gpt.CACHE_VARIABLES]
    assert len(set(folders)) == 6 and all(folder.is_dir() and not any(folder.iterdir()) for folder in folders)
    assert all(tmp_path / "caches" in folder.parents for folder in folders)
    (folders[0] / "kernel.cubin").write_bytes(b"compiled")  # what a run into the same folder left behind
    again = train_gpt.launch_environment(first, "gpt-moe", "RUN", str(tmp_path), fresh_caches=True)
    assert Path(again[train_gpt.CACHE_VARIABLES[0]]) == folders[0] and not any(folders[0].iterdir())


def test_cuda_graph_captures_are_counted_once_per_capture(monkeypatch) -> None:
    """Every capture ends in ``CUDAGraph.capture_end``; installing the count twice still counts each capture once."""
    ended = []

    class CUDAGraph:
        """Stands in for torch.cuda.CUDAGraph (no capture without a GPU)."""

        def capture_end(self) -> str:
            ended.append(self)
            return "ended"

    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(train_gpt.CudaGraphCaptures, "count", 0)
    train_gpt.CudaGraphCaptures.install()
    train_gpt.CudaGraphCaptures.install()
    first, second = CUDAGraph(), CUDAGraph()
    assert first.capture_end() == "ended" and second.capture_end() == "ended" and first.capture_end() == "ended"
    assert train_gpt.CudaGraphCaptures.count == 3 and ended == [first, second, first]


def _write_run(path: Path, label: str, losses: list[float], seconds: list[float], tokens: int = 4096,
               **header) -> str:
    lines = [{"label": label, "tokens_per_step": tokens, **header}]
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


def test_report_carries_time_to_first_step_graphs_device_and_versions(tmp_path: Path) -> None:
    """Each run's time to its first step and its CUDA graph count (the last step's) reach the report, per run and per
    configuration; the machine's versions only where the runs agree."""
    versions = {"torch": "2.11.0", "transformer_engine": "2.20.2"}

    def write(name: str, label: str, started: float, graphs: list[int], run_versions: dict) -> str:
        path = _write_run(tmp_path / name, label, [5.0, 4.0, 3.0], [None, 0.1, 0.1], device="NVIDIA H100",
                          versions=run_versions)
        lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
        for step, graph_count in zip(lines[1:], graphs):
            step.update(since_start=started + step["iteration"], cuda_graphs=graph_count)
        Path(path).write_text("\n".join(json.dumps(line) for line in lines) + "\n")
        return path

    paths = [write("a.jsonl", "a", 40.0, [0, 8, 8], versions), write("b.jsonl", "b", 70.0, [0, 0, 16], versions),
             write("b2.jsonl", "b", 30.0, [0, 0, 16], versions)]
    document = train_gpt.report(paths, None, [], skip=0)
    first, second, third = document["runs"]
    assert (first["first_step_s"], first["cuda_graphs"]) == (41.0, 8)
    assert (second["first_step_s"], second["cuda_graphs"], third["first_step_s"]) == (71.0, 16, 31.0)
    assert document["configurations"]["b"]["first_step_s_each"] == [71.0, 31.0]
    assert document["configurations"]["b"]["cuda_graphs"] == [16]
    assert document["machine"] == {"devices": ["NVIDIA H100"], "versions": versions}
    mixed = train_gpt.report([*paths, write("c.jsonl", "c", 1.0, [0, 0, 0], {**versions, "torch": "2.10.0"})],
                             None, [], skip=0)
    assert mixed["machine"]["versions"] is None and mixed["runs"][-1]["versions"]["torch"] == "2.10.0"


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
    # Without recorded rounds, the k-th runs pair: ratios 180/200 and 250/240, their median against the limit.
    assert [round(r, 4) for r in loose["round_ratios"].values()] == [0.9, round(250 / 240, 4)]
    assert math.isclose(loose["ratio"], (0.9 + 250 / 240) / 2) and loose["met"]
    assert not loose["faster_in_every_round"] and math.isclose(loose["pooled_ratio"], 215 / 220)
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


def test_targets_pair_runs_by_their_recorded_round_and_judge_every_round(tmp_path: Path) -> None:
    """Runs of ``rounds`` carry their round: ratios pair within a round whatever the order of the files, the median
    of the round ratios meets the limit, a round limit fails on one slow round, and a round only one side completed
    is left out."""
    def run(name: str, label: str, round_number: int, step_s: float) -> str:
        return _write_run(tmp_path / name, label, [5.0] * 5, [None] + [step_s] * 4, round=round_number)

    paths = [run("a3.jsonl", "alltoall-syncfree", 3, 0.100), run("d1.jsonl", "deepepv2-syncfree", 1, 0.090),
             run("a1.jsonl", "alltoall-syncfree", 1, 0.100), run("d2.jsonl", "deepepv2-syncfree", 2, 0.120),
             run("a2.jsonl", "alltoall-syncfree", 2, 0.110), run("d3.jsonl", "deepepv2-syncfree", 3, 0.095),
             run("a4.jsonl", "alltoall-syncfree", 4, 0.500)]  # round 4: alltoall only
    document = train_gpt.report(paths, None, [], skip=1, targets=[
        "deepepv2-syncfree:alltoall-syncfree:1.0", "deepepv2-syncfree:alltoall-syncfree:1.0:1.05"])
    median_only, every_round = document["targets"]
    assert median_only["round_ratios"] == pytest.approx({"1": 0.9, "2": 0.12 / 0.11, "3": 0.95})
    assert median_only["ratio"] == pytest.approx(0.95) and median_only["rounds"] == 3
    assert median_only["min_ratio"] == pytest.approx(0.9) and median_only["max_ratio"] == pytest.approx(0.12 / 0.11)
    assert median_only["met"] and not median_only["faster_in_every_round"]
    assert not every_round["met"]  # round 2 at 1.09 > 1.05
    assert document["configurations"]["alltoall-syncfree"]["rounds"] == [3, 1, 2, 4]
    with pytest.raises(ValueError, match="RUN:BASELINE:LIMIT"):
        train_gpt.report(paths, None, [], skip=1, targets=["deepepv2-syncfree:alltoall-syncfree"])


def test_traced_steps_are_left_out_of_the_step_time(tmp_path: Path) -> None:
    """A run timed for 4 steps then traced for 2: the traced steps (slow under the profiler) and the one whose log
    wrote the trace do not count."""
    path = _write_run(tmp_path / "t.jsonl", "deepepv2", [5.0] * 6, [None, 0.1, 0.1, 0.1, 0.9, 3.0], profile=[5, 6])
    (summary,) = train_gpt.report([path], None, [], skip=1)["runs"]
    assert summary["median_step_ms"] == pytest.approx(100.0) and summary["timed_steps"] == 3


def test_schedule_rotates_the_order_each_round_and_traces_the_last_round() -> None:
    launches = train_gpt.schedule(["alltoall-syncfree", "deepepv2-syncfree", "deepepv2-nohostsync-graphs"], 3, "out",
                                  profile_last=["deepepv2-syncfree"], steps=20)
    order = [(launch.round_number, launch.variant.name) for launch in launches]
    assert order == [(1, "alltoall-syncfree"), (1, "deepepv2-syncfree"), (1, "deepepv2-nohostsync-graphs"),
                     (2, "deepepv2-syncfree"), (2, "deepepv2-nohostsync-graphs"), (2, "alltoall-syncfree"),
                     (3, "deepepv2-nohostsync-graphs"), (3, "alltoall-syncfree"), (3, "deepepv2-syncfree")]
    assert [launch.profile for launch in launches if launch.profile] == [(21, 22)]
    assert launches[-1].out == str(Path("out") / "deepepv2-syncfree-r3.jsonl")
    command, runner = train_gpt.launch_command(launches[-1], "/Megatron-LM", 20, ["--seed", "7"])
    assert command[command.index("--train-iters") + 1] == "22" and command[-2:] == ["--seed", "7"]
    assert "--round 3" in runner and "--profile 21:22" in runner and runner.endswith(" --")
    with pytest.raises(ValueError, match="unknown variants"):
        train_gpt.schedule(["alltoall-syncfree", "alltoall-graphs"], 3, "out")
    with pytest.raises(ValueError, match="not among those run"):
        train_gpt.schedule(["alltoall-syncfree"], 3, "out", profile_last=["deepepv2-syncfree"])


def test_resumed_rounds_run_only_what_an_earlier_call_left_undone(tmp_path: Path, monkeypatch) -> None:
    """A second call with ``resume`` runs the launches the first did not complete (failed, record gone, or never
    started) in the schedule's order and keeps the completed ones of its own schedule; other options, another machine
    or a file that is not a rounds file are refused rather than mixed in or overwritten."""
    ran, failing = [], set()

    def fake_run(command, env, stdout, stderr, cwd, timeout):
        record = env["RUNNER"].split("--out ", 1)[1].split(" ", 1)[0]
        ran.append(Path(record).name)
        if Path(record).name in failing:
            return argparse.Namespace(returncode=1)
        Path(record).write_text("{}\n")
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(train_gpt.subprocess, "run", fake_run)
    out, variants = tmp_path / "runs", ["alltoall-te-graphs", "deepepv2-te-graphs"]
    failing.add("deepepv2-te-graphs-r1.jsonl")
    first = train_gpt.run_rounds("/mlm", "gpt-moe", variants, rounds=1, steps=20, out=str(out))
    assert [r["exit"] for r in first] == [0, 1]
    failing.clear()
    ran.clear()
    resumed = train_gpt.run_rounds("/mlm", "gpt-moe", variants, rounds=2, steps=20, out=str(out), resume=True)
    assert ran == ["deepepv2-te-graphs-r1.jsonl", "deepepv2-te-graphs-r2.jsonl", "alltoall-te-graphs-r2.jsonl"]
    assert [(r["variant"], r["round"], r["exit"]) for r in resumed] == [
        ("alltoall-te-graphs", 1, 0), ("deepepv2-te-graphs", 1, 0), ("deepepv2-te-graphs", 2, 0),
        ("alltoall-te-graphs", 2, 0)]
    assert json.loads((out / "rounds.json").read_text())["launches"] == resumed
    (out / "alltoall-te-graphs-r2.jsonl").unlink()
    ran.clear()
    train_gpt.run_rounds("/mlm", "gpt-moe", variants, rounds=2, steps=20, out=str(out), resume=True)
    assert ran == ["alltoall-te-graphs-r2.jsonl"]
    ran.clear()
    # A narrower schedule keeps only its own completed launches and runs nothing more.
    narrower = train_gpt.run_rounds("/mlm", "gpt-moe", variants[1:], rounds=1, steps=20, out=str(out), resume=True)
    assert ran == [] and [(r["variant"], r["round"]) for r in narrower] == [("deepepv2-te-graphs", 1)]
    # Other options would pair unlike runs or overwrite records: refused, naming what differs, the file untouched.
    kept = (out / "rounds.json").read_text()
    for changed, named in (({"steps": 30}, "steps was 20, is 30"), ({"extra": ["--seed", "7"]}, "extra was []"),
                           ({"fresh_caches": True}, "fresh_caches was False"),
                           ({"model": "gpt-moe-large"}, "model was 'gpt-moe'")):
        arguments = {"model": "gpt-moe", "steps": 20, **changed}
        with pytest.raises(ValueError, match=re.escape(named)):
            train_gpt.run_rounds("/mlm", arguments.pop("model"), variants, rounds=2, out=str(out), resume=True,
                                 **arguments)
        assert (out / "rounds.json").read_text() == kept and ran == []
    monkeypatch.setattr(train_gpt.socket, "gethostname", lambda: "another-machine")
    with pytest.raises(ValueError, match="host was .*, is 'another-machine'"):
        train_gpt.run_rounds("/mlm", "gpt-moe", variants, rounds=2, steps=20, out=str(out), resume=True)
    for not_rounds in ("[1, 2]", json.dumps({"options": {}, "launches": [{"variant": "x"}]})):
        (out / "rounds.json").write_text(not_rounds)
        with pytest.raises(ValueError, match="not a rounds file"):
            train_gpt.run_rounds("/mlm", "gpt-moe", variants, rounds=1, steps=30, out=str(out), resume=True)
        assert (out / "rounds.json").read_text() == not_rounds


def test_every_variant_names_its_experts_and_pairs_hold_them_equal() -> None:
    """Each comparison the rounds make holds the experts equal, and the plot names them on every bar."""
    variants = train_gpt.VARIANTS
    for run, baseline in (("deepepv2", "alltoall"), ("deepepv2-syncfree", "alltoall-syncfree"),
                          ("deepepv2-nohostsync-graphs", "alltoall-syncfree-graphs"),
                          ("deepepv2-syncfree-compiled-preprocess", "deepepv2-syncfree"),
                          ("deepepv2-te", "alltoall-te"), ("deepepv2-te-graphs", "alltoall-te-graphs"),
                          ("deepepv2-nohostsync-te-graphs", "alltoall-syncfree-te-graphs")):
        assert variants[run].experts == variants[baseline].experts
    for variant in variants.values():
        assert train_gpt.expert_module(variant.env, variant.args) == variant.experts
    graphs = variants["alltoall-syncfree-graphs"].args
    assert graphs[graphs.index("--cuda-graph-modules") + 1:] == train_gpt.ALLTOALL_GRAPH_MODULES
    labels = train_gpt.bar_labels([("deepepv2", {"experts": "SequentialMLP", "runs": ["a", "b", "c"]})])
    assert labels == ["deepepv2\nSequentialMLP (x3)"]


def test_megatron_dispatch_preprocess_swaps_in_megatrons_compiled_stage(monkeypatch) -> None:
    import megatron_deepepv2
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    megatron_deepepv2.install()
    ours = moe_layer.MoEFlexTokenDispatcher
    monkeypatch.setattr(ours, "dispatch_preprocess", ours.dispatch_preprocess)  # undone after the test
    assert ours.dispatch_preprocess is not token_dispatcher.MoEFlexTokenDispatcher.dispatch_preprocess
    train_gpt.use_megatrons_dispatch_preprocess()
    assert ours.dispatch_preprocess is token_dispatcher.MoEFlexTokenDispatcher.dispatch_preprocess
    monkeypatch.setattr(moe_layer, "MoEFlexTokenDispatcher", token_dispatcher.MoEFlexTokenDispatcher)
    with pytest.raises(RuntimeError, match="not megatron_deepepv2's"):
        train_gpt.use_megatrons_dispatch_preprocess()


ROUNDS_LAUNCHES = {
    "larger-model": ("gpt-moe-large", "alltoall-syncfree-graphs", None, 0,
                     ["SHAPE 2048 4096 4 64 768 0.01 ['moe_router', 'moe_preprocess']", "CONFIG alltoall deepep"]),
    "128-experts": ("qwen3-moe-router", "deepepv2-nohostsync-graphs", None, 0,
                    ["SHAPE 1024 1024 4 128 384 0.001 []", "CONFIG flex deepepv2 128 True False False local"]),
    # The whole MoE layer (``moe``) is refused for a dropless layer by Megatron's own checks: a failed launch is
    # reported and its log kept.
    "refused-scope": ("gpt-moe", "alltoall-syncfree-graphs", ["moe"], 1,
                      ["moe cuda graph is only supported with drop-padding MoE"]),
}


@pytest.mark.parametrize("case", sorted(ROUNDS_LAUNCHES))
def test_rounds_launch_each_model_and_variant_through_megatrons_argument_checks(case: str, tmp_path: Path,
                                                                               monkeypatch) -> None:
    """``rounds`` through the example with stand-ins for torchrun and ``pretrain_gpt.py`` (Megatron's argument parsing
    and validation, then the model's config printed): the larger model and the 128-expert one get their shapes, the
    alltoall graph variant gets its capture scope past Megatron's checks, and the deepepv2 graph variant whole-layer
    graphs; a launch that fails is reported, its log kept and its entry written."""
    model, variant, graph_modules, failed, expected = ROUNDS_LAUNCHES[case]
    tree, env = stand_in_launch(tmp_path, dict(__import__("os").environ))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "runs"
    (result,) = train_gpt.run_rounds(str(tree), model, [variant], rounds=1, steps=20, out=str(out),
                                     alltoall_graph_modules=graph_modules)
    log = (out / f"{variant}-r1.log").read_text()
    assert (result["exit"] != 0) == bool(failed), log[-3000:]
    assert all(text in log for text in expected), log[-3000:]
    assert json.loads((out / "rounds.json").read_text())["launches"] == [result]


EXIT_SCRIPT = """
import argparse, sys, torch
sys.path.insert(0, sys.argv[2])
from megatron.training import global_vars
from tools import train_gpt
global_vars._GLOBAL_ARGS = argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1, train_iters=2)
recorded = train_gpt.StepRecorder(sys.argv[1], "x", exit_after_last_step=True).wrap(lambda *a, **k: print("LOGGED", a[3]))
for iteration in (1, 2, 3):
    recorded({"lm loss": torch.tensor(1.0)}, {}, 1e-4, iteration, 1.0, True, 0, 1.0, None)
print("AFTER THE LAST STEP")
sys.exit(3)
"""


def test_recorder_ends_the_process_once_the_last_step_is_recorded(tmp_path: Path) -> None:
    """With ``exit_after_last_step`` the process ends with status 0 right after the last iteration's log (which still
    runs), its record complete; nothing after it runs."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    path = tmp_path / "run.jsonl"
    done = subprocess.run([preloaded_python.python(), "-c", EXIT_SCRIPT, str(path), str(root)], capture_output=True, text=True,
                          timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["LOGGED", "1", "LOGGED", "2"]
    assert [json.loads(line).get("iteration") for line in path.read_text().splitlines()] == [None, 1, 2]


def test_older_reports_get_their_bars_and_expert_modules_from_their_runs() -> None:
    """A report written before configurations named their experts (or before configurations existed): the plot's
    configurations come from the runs, the expert module from each run's recorded environment."""
    runs = [{"label": "deepepv2", "median_step_ms": 700.0, "tokens_per_s": 4096 / 0.7, "environment": {}},
            {"label": "deepepv2-syncfree", "median_step_ms": 100.0, "tokens_per_s": 40960.0,
             "environment": {"MEGATRON_DEEPEPV2_EXPERTS": "sync_free"}}]
    groups = train_gpt.plotted_configurations({"runs": runs})
    assert {label: g["experts"] for label, g in groups.items()} == {"deepepv2": "SequentialMLP",
                                                                    "deepepv2-syncfree": "SyncFreeSequentialMLP"}
    assert groups["deepepv2"]["tokens_per_s"] == pytest.approx(4096 / 0.7)
    pooled = {"runs": runs, "configurations": {"deepepv2-syncfree": {"runs": ["x"], "tokens_per_s": 1.0}}}
    assert train_gpt.plotted_configurations(pooled)["deepepv2-syncfree"]["experts"] == "SyncFreeSequentialMLP"


def test_the_record_names_the_experts_the_built_model_has(tmp_path: Path, monkeypatch) -> None:
    """The header's experts come from the MoE layers Megatron built (seen through ``setup_model_and_optimizer``), not
    from the environment, which says nothing of ``--moe-grouped-gemm``."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training import global_vars

    class TEGroupedMLP(torch.nn.Module):
        """Stands in for Transformer Engine's grouped experts: only the class name is read."""

    class BuiltMoELayer(MoELayer):
        """A MoE layer as built, without Megatron's construction (which needs the parallel state)."""

        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.experts = TEGroupedMLP()

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS",
                        argparse.Namespace(global_batch_size=4, seq_length=8, world_size=1), raising=False)
    monkeypatch.setenv("MEGATRON_DEEPEPV2_EXPERTS", "sync_free")  # what the environment alone would claim
    chunks = [torch.nn.Sequential(torch.nn.Linear(2, 2), BuiltMoELayer()), torch.nn.Sequential(BuiltMoELayer())]
    recorder = train_gpt.StepRecorder(str(tmp_path / "run.jsonl"), "te")
    setup = recorder.wrap_setup(lambda *args, **kwargs: (chunks, "optimizer", "scheduler"))
    assert setup("provider", kind="gpt") == (chunks, "optimizer", "scheduler")
    header = recorder._header()
    assert header["experts"] == "TEGroupedMLP" and header["experts_from"] == "built model", header
    assert train_gpt.built_expert_modules(chunks[1]) == ["TEGroupedMLP"]  # one model chunk as a module
    assert train_gpt.StepRecorder(str(tmp_path / "b.jsonl"), "b")._header()["experts"] == train_gpt.SYNC_FREE
