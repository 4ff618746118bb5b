"""How the pytest wrappers of the GPU suites start their torchrun jobs: one at a time, on a free port.

``make test`` runs pytest with several ``-n`` workers, so the GPU wrappers (the functional suite, the ElasticBuffer
replays, `make demo` of the README test) can be collected by different workers at once. Each job needs all GPUs and a
rendezvous port, so :func:`run_gpu_job` holds a machine-wide file lock for the job's duration and every torchrun
command gets a port that is free when it is built. The environment is the test process's minus the settings the test conftest
forces for CPU tests (value validation synchronises the host, which the no-host-sync and CUDA-graph cases forbid).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Sequence

from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
LOCK_PATH = Path(tempfile.gettempdir()) / "megatron_deepepv2_gpu_job.lock"
#: Set by tests/conftest.py for the CPU tests; the GPU cases choose their own settings.
CPU_TEST_SETTINGS = ("MEGATRON_DEEPEPV2_VALIDATE", "TORCHDYNAMO_DISABLE")


def gpu_job_env() -> dict[str, str]:
    """The environment of a GPU job: this process's, with the package on PYTHONPATH and single-node DeepEP."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_TEST_SETTINGS}
    env.setdefault("EP_DISABLE_GIN", "1")  # single node without RDMA; harmless with NVLink only
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def torchrun_command(script: str, *args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` for ``script`` on ``nproc`` GPUs, rendezvous on a free local port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / script), *args]


@contextlib.contextmanager
def exclusive_gpus(lock_path: Path = LOCK_PATH) -> Iterator[None]:
    """Holds the machine-wide GPU-job lock (waits for a job of another pytest worker to finish).

    Args:
        lock_path: The lock file (another one only in the lock's own test, which must not wait for real GPU jobs).
    """
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def run_gpu_job(command: Sequence[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs one GPU job under the lock, from the repository root, capturing its output."""
    with exclusive_gpus():
        return subprocess.run(list(command), capture_output=True, text=True, env=gpu_job_env(), timeout=timeout,
                              cwd=ROOT)
