"""The GPU wrappers' job plumbing on CPU: command lines, environment, which jobs share the GPU and which run alone,
and waits for the GPU-job lock that do not count against a test's timeout."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.gpu_jobs import (DEFAULT_JOB_SLOTS, ROOT, SLOTS_VARIABLE, gpu_job_env, gpu_job_lock, job_slots,
                            torchrun_command)


def test_torchrun_command_uses_a_free_port_and_the_repository_script() -> None:
    first, second = torchrun_command("tests/functional/deepep_cases.py", "case_a"), torchrun_command("x.py")
    assert first[1:5] == ["-m", "torch.distributed.run", "--nproc-per-node", "2"]
    port = int(first[first.index("--master-port") + 1])
    with socket.socket() as sock:  # the port was free when chosen (a fixed 29500 would collide between jobs)
        sock.bind(("127.0.0.1", port))
    assert first[-2:] == [str(ROOT / "tests/functional/deepep_cases.py"), "case_a"]
    assert first[first.index("--master-addr") + 1] == "127.0.0.1"
    assert int(second[second.index("--master-port") + 1]) != port  # each job its own port, not a fixed default


def test_gpu_job_environment_drops_the_cpu_test_validation(monkeypatch) -> None:
    monkeypatch.setenv("MEGATRON_DEEPEPV2_VALIDATE", "1")  # what tests/conftest.py sets for the CPU tests
    monkeypatch.setenv("MEGATRON_DEEPEPV2_LAYOUT", "compact")
    monkeypatch.delenv("EP_DISABLE_GIN", raising=False)
    env = gpu_job_env()
    assert "MEGATRON_DEEPEPV2_VALIDATE" not in env  # it would sync the host in the no-host-sync / graph cases
    assert env["MEGATRON_DEEPEPV2_LAYOUT"] == "compact"
    assert "EP_DISABLE_GIN" not in env  # decided by the library from the hardware, as for a user
    monkeypatch.setenv("EP_DISABLE_GIN", "0")
    assert gpu_job_env()["EP_DISABLE_GIN"] == "0"  # a value set is passed on as it is
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def _overlaps(jobs: list[dict], lock: Path, hold: float = 0.3) -> tuple[list[tuple[float, float, str]], int]:
    """Runs ``jobs`` (``gpu_job_lock`` keyword arguments) in threads, each holding ``lock`` for ``hold`` seconds.

    Returns:
        Each job's (start, end, name) while it held the lock, by start; and the most jobs that held it at once.
    """
    spans: list[tuple[float, float, str]] = []

    def job(name: str, arguments: dict) -> None:
        with gpu_job_lock(lock_path=lock, **arguments):
            start = time.monotonic()
            time.sleep(hold)
            spans.append((start, time.monotonic(), name))

    threads = [threading.Thread(target=job, args=(f"job{i}", arguments)) for i, arguments in enumerate(jobs)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans.sort()
    events = sorted([(start, 1) for start, _, _ in spans] + [(end, -1) for _, end, _ in spans])
    running = [sum(step for _, step in events[:i + 1]) for i in range(len(events))]
    return spans, max(running)


def test_jobs_of_several_gpus_run_one_at_a_time(tmp_path) -> None:
    # Not the machine's lock: real GPU jobs may hold it for minutes.
    spans, most = _overlaps([{"gpus": 2, "slots": 4}] * 3, tmp_path / "gpu.lock")
    assert len(spans) == 3 and most == 1, spans
    # Each job's line beside the lock: its own time (about 0.3 s) apart from its wait (up to two other jobs).
    lines = (tmp_path / "gpu.log").read_text().splitlines()
    times = [tuple(float(part.split()[1]) for part in line.split(": ")[-1].split(", ")) for line in lines]
    assert len(lines) == 3 and all("test_jobs_of_several_gpus_run_one_at_a_time" in line and "[2 GPUs, alone]" in line
                                   for line in lines), lines
    assert all(0.25 < held < 0.6 for _, held in times) and max(waited for waited, _ in times) > 0.25, lines


def test_one_gpu_jobs_share_the_gpu_up_to_the_slots(tmp_path) -> None:
    spans, most = _overlaps([{"gpus": 1, "slots": 2}] * 4, tmp_path / "gpu.lock")
    assert len(spans) == 4 and most == 2, spans  # two at a time, never three
    assert "[1 GPU, shared]" in (tmp_path / "gpu.log").read_text()
    _, most = _overlaps([{"gpus": 1, "slots": 1}] * 3, tmp_path / "one.lock")
    assert most == 1  # one slot: every job alone


def test_a_job_alone_or_of_several_gpus_shares_with_no_one_gpu_job(tmp_path) -> None:
    one = {"gpus": 1, "slots": 4}
    for lonely in ({"gpus": 2, "slots": 4}, {"gpus": 1, "alone": True, "slots": 4}):
        spans, _ = _overlaps([one, one, lonely, one, one], tmp_path / "gpu.lock", hold=0.4)
        (start, end, _), = [span for span in spans if span[2] == "job2"]
        others = [span for span in spans if span[2] != "job2"]
        assert len(others) == 4 and all(e <= start or s >= end for s, e, _ in others), (lonely, spans)


def test_a_job_waiting_to_run_alone_goes_before_one_gpu_jobs_that_come_after_it(tmp_path) -> None:
    """One-GPU jobs that arrive while a job waits to run alone wait for it; those running when it came finish first."""
    lock, spans = tmp_path / "gpu.lock", {}

    def job(name: str, delay: float, hold: float, **arguments) -> None:
        time.sleep(delay)
        with gpu_job_lock(lock_path=lock, slots=4, **arguments):
            start = time.monotonic()
            time.sleep(hold)
            spans[name] = (start, time.monotonic())

    threads = [threading.Thread(target=job, args=("running", 0.0, 0.8), kwargs={"gpus": 1}),
               threading.Thread(target=job, args=("alone", 0.2, 0.3), kwargs={"gpus": 1, "alone": True}),
               *(threading.Thread(target=job, args=(f"later{i}", 0.4 + 0.1 * i, 0.2), kwargs={"gpus": 1})
                 for i in range(3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert spans["alone"][0] >= spans["running"][1], spans  # the running job finished first
    assert all(spans[f"later{i}"][0] >= spans["alone"][1] for i in range(3)), spans  # the later ones waited


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_bad_slot_count_names_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv(SLOTS_VARIABLE, value)
    with pytest.raises(ValueError, match=rf"MEGATRON_DEEPEPV2_GPU_JOB_SLOTS={re.escape(repr(value))}: expected a "
                                         "positive integer"):
        job_slots()
    monkeypatch.setenv(SLOTS_VARIABLE, "3")
    assert job_slots() == 3
    monkeypatch.delenv(SLOTS_VARIABLE)
    assert job_slots() == DEFAULT_JOB_SLOTS


@pytest.mark.parametrize("gpus", [1, 2])
def test_a_wait_past_max_wait_fails_naming_the_holder(tmp_path, gpus: int) -> None:
    lock = tmp_path / "gpu.lock"
    with gpu_job_lock(gpus, lock_path=lock, slots=1 if gpus == 2 else 2):  # a second open file waits like a process
        with pytest.raises(TimeoutError, match=rf"waited 0.3 s for the GPU-job lock .* held by pid {os.getpid()} "
                                               r"\(tests/harness/test_gpu_jobs.py::test_a_wait_past_max_wait"):
            with gpu_job_lock(2, lock_path=lock, max_wait=0.3):
                pass


# Tests of an inner pytest run with this suite's configuration (tests/conftest.py as a plugin): each holds a
# timeout of TIMEOUT seconds and waits HOLD > TIMEOUT seconds for a lock that another process holds.
_CONTENDED = """
import subprocess, sys, time

import pytest

from tests.gpu_jobs import gpu_job_lock

LOCK, TIMEOUT, HOLD = {lock!r}, 1.0, 1.5
HOLDER = ("import fcntl, sys, time; lock = open(sys.argv[1], 'a'); fcntl.flock(lock, fcntl.LOCK_EX); "
          "print('held', flush=True); time.sleep(float(sys.argv[2]))")


def _taken_by_another_process():
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, LOCK, str(HOLD)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\\n"


@pytest.mark.timeout(TIMEOUT)
def test_waits_longer_than_its_timeout():
    _taken_by_another_process()
    start = time.monotonic()
    with gpu_job_lock(1, lock_path=LOCK):
        assert time.monotonic() - start > TIMEOUT
        time.sleep(0.2 * TIMEOUT)


@pytest.mark.timeout(TIMEOUT)
def test_runs_its_job_past_its_timeout():
    _taken_by_another_process()
    with gpu_job_lock(1, lock_path=LOCK):
        time.sleep(10 * TIMEOUT)


@pytest.mark.timeout(TIMEOUT)
def test_works_before_and_after_the_wait_past_its_timeout():
    time.sleep(0.6 * TIMEOUT)
    _taken_by_another_process()
    with gpu_job_lock(1, lock_path=LOCK):
        time.sleep(0.6 * TIMEOUT)
"""


@pytest.mark.parametrize("case, outcome", [
    ("test_waits_longer_than_its_timeout", "PASSED"),  # the wait is not counted
    ("test_runs_its_job_past_its_timeout", "FAILED"),  # the timeout still stops the job, after the wait
    ("test_works_before_and_after_the_wait_past_its_timeout", "FAILED"),  # what ran before the wait counts too
])
def test_waiting_for_the_lock_does_not_count_against_the_timeout(tmp_path, case: str, outcome: str) -> None:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_contended.py").write_text(_CONTENDED.format(lock=str(tmp_path / "gpu.lock")))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider", "-q",
                           "-rA", f"test_contended.py::{case}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    output = done.stdout + done.stderr
    assert re.search(rf"^{outcome} test_contended.py::{case}", output, re.M), output[-3000:]
    assert re.search(r"waited 1\.\d s for the GPU-job lock, not counted against the 1 s timeout",
                     output), output[-3000:]
    if outcome == "FAILED":
        assert "Timeout (>" in output and "from pytest-timeout" in output, output[-3000:]
        assert time.monotonic() - start < 8, "the job ran on past its timeout"  # it would sleep 10 s
