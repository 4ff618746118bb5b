"""``tools/gpu_suite_record.py``: a GPU machine's ``make test`` runs from pytest's JUnit XML and the GPU-job log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import gpu_suite_record

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests">
<testsuite name="pytest" errors="{errors}" failures="{failures}" skipped="2" tests="10" time="200.5"
 timestamp="2026-12-05T17:21:33.301490+00:00">
<testcase classname="tests.a" name="test_ok" time="1.0" />
<testcase classname="tests.a" name="test_skip" time="0.0"><skipped message="no GPU" /></testcase>
{cases}
</testsuite></testsuites>
"""
LOG = ("17:22:41 tests/determinism/test_replay.py::test_replays (call) [1 GPU, shared]: waited 0.0 s, held 52.7 s\n"
       "17:24:07 tests/cli/test_readme.py::test_gpu_blocks (call) [1 GPU, alone]: waited 26.3 s, held 75.0 s\n"
       "17:25:16 tests/functional/test_deepep.py::test_ep2 (call) [2 GPUs, alone]: waited 3.5 s, held 8.0 s\n")


def _run(tmp_path: Path, name: str, failed_cases: str = "", failures: int = 0, errors: int = 0) -> tuple[str, str]:
    junit, log = tmp_path / f"{name}.xml", tmp_path / f"{name}.log"
    junit.write_text(JUNIT.format(failures=failures, errors=errors, cases=failed_cases))
    log.write_text(LOG)
    return str(junit), str(log)


def test_a_green_run_within_its_target_is_recorded_with_each_gpu_job(tmp_path: Path) -> None:
    junit, log = _run(tmp_path, "plain")
    document = gpu_suite_record.record([f"plain={junit},{log},229"], target_s=300, device="1x H100")
    run = document["runs"]["plain"]
    assert (run["passed"], run["failed"], run["skipped"]) == (8, 0, 2) and run["green"] and run["met"]
    assert run["pytest_s"] == 200.5 and run["make_test_s"] == 229.0 and run["started"].startswith("2026-12-05T17:21")
    assert [job["test"] for job in run["gpu_jobs"]] == ["tests/determinism/test_replay.py::test_replays",
                                                        "tests/cli/test_readme.py::test_gpu_blocks",
                                                        "tests/functional/test_deepep.py::test_ep2"]
    assert [(job["gpus"], job["shared"]) for job in run["gpu_jobs"]] == [(1, True), (1, False), (2, False)]
    assert run["gpu_jobs"][1]["waited_s"] == 26.3 and run["gpu_jobs"][1]["held_s"] == 75.0
    assert run["longest_wait_s"] == 26.3 and document["device"] == "1x H100" and document["target_s"] == 300


def test_failures_and_time_over_the_target_miss_it_and_fail_the_command(tmp_path: Path) -> None:
    failed = ('<testcase classname="tests.cli.test_doctor" name="test_probe" time="1.0"><failure message="x" />'
              '</testcase><testcase classname="tests.b" name="test_setup" time="0.1"><error message="y" /></testcase>')
    junit, log = _run(tmp_path, "te", failed, failures=1, errors=1)
    run = gpu_suite_record.record([f"te={junit},{log}"], target_s=300)["runs"]["te"]
    assert (run["passed"], run["failed"]) == (6, 2) and not run["green"] and run["met"] is False
    assert run["failed_tests"] == ["tests.cli.test_doctor::test_probe", "tests.b::test_setup"]
    green_junit, green_log = _run(tmp_path, "slow")
    slow = gpu_suite_record.record([f"slow={green_junit},{green_log},301"], target_s=300)["runs"]["slow"]
    assert slow["green"] and slow["met"] is False
    # Without an end-to-end time, pytest's time is judged.
    assert gpu_suite_record.record([f"p={green_junit},{green_log}"], target_s=200)["runs"]["p"]["met"] is False
    out = tmp_path / "out"
    assert gpu_suite_record.main([f"slow={green_junit},{green_log},301", "--out", str(out), "--target-s", "300"]) == 1
    assert gpu_suite_record.main([f"ok={green_junit},{green_log},299", "--out", str(out), "--target-s", "300"]) == 0
    assert json.loads((out / "gpu_suite.json").read_text())["runs"]["ok"]["met"] is True


def test_bad_input_is_named(tmp_path: Path, capsys) -> None:
    junit, log = _run(tmp_path, "x")
    Path(log).write_text(LOG + "17:30:00 something else\n")
    with pytest.raises(ValueError, match=r"x\.log:4: not a GPU-job line: '17:30:00 something else'"):
        gpu_suite_record.gpu_jobs(log)
    with pytest.raises(ValueError, match="expected LABEL=JUNIT_XML,GPU_JOB_LOG"):
        gpu_suite_record.parse_run(f"x={junit}")
    not_junit = tmp_path / "other.xml"
    not_junit.write_text("<report />")
    with pytest.raises(SystemExit):
        gpu_suite_record.main([f"x={not_junit},{log}", "--out", str(tmp_path)])
    assert "no <testsuite> element" in capsys.readouterr().err


def test_reads_the_lines_the_gpu_job_lock_writes(tmp_path: Path, monkeypatch) -> None:
    """The log format is the GPU-job lock's (tests/gpu_jobs.py): what it writes for a shared and an alone job is read
    back as those jobs."""
    from tests.gpu_jobs import gpu_job_lock

    lock = tmp_path / "gpu_job.lock"
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/functional/test_deepep.py::test_shard (call)")
    with gpu_job_lock(1, lock_path=lock, slots=2):
        pass
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/cli/test_readme.py::test_gpu_blocks (call)")
    with gpu_job_lock(1, alone=True, lock_path=lock, slots=2):
        pass
    jobs = gpu_suite_record.gpu_jobs(str(lock.with_suffix(".log")))
    assert [(job["test"], job["gpus"], job["shared"]) for job in jobs] == [
        ("tests/functional/test_deepep.py::test_shard", 1, True), ("tests/cli/test_readme.py::test_gpu_blocks", 1, False)]
    assert all(job["waited_s"] >= 0 and job["held_s"] >= 0 for job in jobs)
