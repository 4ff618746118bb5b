"""The GPU wrappers' job plumbing on CPU: command lines, environment, and one job at a time."""

from __future__ import annotations

import os
import socket
import threading
import time

from tests.gpu_jobs import ROOT, exclusive_gpus, gpu_job_env, torchrun_command


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
    assert env["MEGATRON_DEEPEPV2_LAYOUT"] == "compact" and env["EP_DISABLE_GIN"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)


def test_gpu_jobs_run_one_at_a_time(tmp_path) -> None:
    spans: list[tuple[float, float]] = []

    def job() -> None:
        with exclusive_gpus(tmp_path / "gpu.lock"):  # not the machine's lock: real GPU jobs may hold it for minutes
            start = time.monotonic()
            time.sleep(0.3)
            spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=job) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    spans.sort()
    assert len(spans) == 3
    assert all(earlier[1] <= later[0] for earlier, later in zip(spans, spans[1:])), spans
