"""tools/rounds_summary.py: several models' rounds side by side, from the reports and traces the other tools write."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.tools.test_train_gpt import _write_run
from tools import rounds_summary, train_gpt

ALLTOALL, DEEPEPV2 = "alltoall-syncfree-te-graphs", "deepepv2-nohostsync-te-layer-graphs"


def _report(folder: Path, deepepv2_step_s: list[float]) -> str:
    """A ``train_gpt.py report`` of 3 rounds: alltoall at 100 ms a step every round, deepepv2 at the given times."""
    folder.mkdir()
    paths = []
    for r, step_s in enumerate(deepepv2_step_s, start=1):
        paths.append(_write_run(folder / f"a{r}.jsonl", ALLTOALL, [5.0] * 5, [None] + [0.100] * 4, round=r))
        paths.append(_write_run(folder / f"d{r}.jsonl", DEEPEPV2, [5.0] * 5, [None] + [step_s] * 4, round=r))
    document = train_gpt.report(paths, None, [], skip=1, targets=[f"{DEEPEPV2}:{ALLTOALL}:0.60"])
    (folder / "report.json").write_text(json.dumps(document))
    return str(folder / "report.json")


def _trace(path: Path, gpu_busy_ms: dict[str, float]) -> str:
    """A ``trace_summary.py`` JSON with the given GPU-busy time per traced configuration."""
    summaries = {label: {"wall_ms": 99.0, "gpu_busy_ms": busy, "gpu_idle_ms": 99.0 - busy}
                 for label, busy in gpu_busy_ms.items()}
    path.write_text(json.dumps({"summaries": summaries}))
    return str(path)


def test_models_side_by_side_with_each_targets_gpu_busy_floor(tmp_path: Path) -> None:
    """Per model, each configuration's median step and each target's median ratio as the report has them; where the
    target's run was traced, its GPU-busy time over the baseline's median step; an untraced model has no floor."""
    small = _report(tmp_path / "small", [0.050, 0.055, 0.045])
    large = _report(tmp_path / "large", [0.095, 0.090, 0.092])
    trace = _trace(tmp_path / "trace.json", {DEEPEPV2: 70.0, ALLTOALL: 80.0})
    document = rounds_summary.summarise({"small": (small, trace), "large": (large, None)})
    small_model = document["models"]["small"]
    assert small_model["configurations"][DEEPEPV2]["median_step_ms"] == pytest.approx(50.0)
    assert small_model["configurations"][ALLTOALL]["traced"]["gpu_busy_ms"] == 80.0
    (target,) = small_model["targets"]
    assert target["ratio"] == pytest.approx(0.50) and target["met"]
    assert target["gpu_floor_ratio"] == pytest.approx(70.0 / 100.0)
    assert document["provenance"]["git_commit"] == json.loads(Path(small).read_text())["provenance"]["git_commit"]
    row = document["targets"][f"{DEEPEPV2}/{ALLTOALL}"]
    assert row["limit"] == 0.60
    assert row["small"]["met"] and row["large"] == {"ratio": pytest.approx(0.92), "met": False,
                                                    "gpu_floor_ratio": None}


def test_a_trace_of_another_configuration_or_a_report_without_targets_is_refused(tmp_path: Path) -> None:
    report = _report(tmp_path / "r", [0.05, 0.05, 0.05])
    with pytest.raises(ValueError, match=r"traces \['alltoall-te-graphs'\] are not among"):
        rounds_summary.model_summary(report, _trace(tmp_path / "t.json", {"alltoall-te-graphs": 1.0}))
    commits = []
    for commit, date in (("1111111", "2026-01-01T00:00:00Z"), ("0000000", "2099-01-01T00:00:00Z")):
        commits.append(tmp_path / f"{commit}.json")
        commits[-1].write_text(json.dumps({**json.loads(Path(report).read_text()),
                                           "provenance": {"git_commit": commit, "date": date}}))
    mixed = rounds_summary.runs_provenance({"a": rounds_summary.model_summary(str(commits[0])),
                                            "b": rounds_summary.model_summary(str(commits[1]))})
    assert mixed["git_commit"] is None and mixed["git_commits"] == ["0000000", "1111111"]
    assert mixed["date"].startswith("2099") and mixed["first_date"].startswith("2026") and not mixed["git_dirty"]
    assert rounds_summary.runs_provenance({"a": rounds_summary.model_summary(str(commits[0]))})["git_commit"] == \
        "1111111"
    untargeted = tmp_path / "untargeted.json"
    untargeted.write_text(json.dumps({**json.loads(Path(report).read_text()), "targets": []}))
    with pytest.raises(ValueError, match="no configurations or no targets"):
        rounds_summary.model_summary(str(untargeted))
    stricter = tmp_path / "stricter.json"
    stricter.write_text(json.dumps({**json.loads(Path(report).read_text()),
                                    "targets": [{**json.loads(Path(report).read_text())["targets"][0], "limit": 0.5}]}))
    with pytest.raises(ValueError, match="report every model with the same --target"):
        rounds_summary.summarise({"a": (report, None), "b": (str(stricter), None)})
    targetless = json.loads(Path(report).read_text())
    del targetless["targets"][0]["round_ratios"]
    (tmp_path / "truncated.json").write_text(json.dumps(targetless))
    with pytest.raises(ValueError, match="lacks 'round_ratios'"):
        rounds_summary.model_summary(str(tmp_path / "truncated.json"))
    for bad in ("gpt-moe", "=r.json", "gpt-moe=", "gpt-moe=a.json,b.json,c.json", "gpt-moe=a.json,"):
        with pytest.raises(ValueError, match="MODEL=REPORT.json"):
            rounds_summary.parse_model(bad)
    assert rounds_summary.parse_model("m=a.json,b.json") == ("m", ("a.json", "b.json"))


def test_the_command_writes_json_and_png_and_names_a_bad_argument(tmp_path: Path, capsys) -> None:
    report = _report(tmp_path / "r", [0.05, 0.05, 0.05])
    assert rounds_summary.main(["--out", str(tmp_path / "out"), "--name", "s", f"m={report}"]) == 0
    written = json.loads((tmp_path / "out" / "s.json").read_text())
    assert written["models"]["m"]["targets"][0]["ratio"] == pytest.approx(0.5)
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "out" / "s.png").stat().st_size > 0
    with pytest.raises(SystemExit):
        rounds_summary.main(["--out", str(tmp_path / "out"), f"m={tmp_path / 'missing.json'}"])
    assert "missing.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rounds_summary.main(["--out", str(tmp_path / "out"), f"m={report}", f"m={report}"])
    assert "models given more than once: ['m']" in capsys.readouterr().err
