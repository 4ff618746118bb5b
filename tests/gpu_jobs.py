"""How the pytest wrappers of the GPU suites start their torchrun jobs: sharing the GPU or alone, on a free port.

``make test`` runs pytest with several ``-n`` workers, so the GPU wrappers (the functional suite in shards, the
ElasticBuffer replays, `make demo` and the GPU blocks of the README test) can be collected by different workers at
once. :func:`gpu_job_lock` (:func:`run_gpu_job` uses it) holds a machine-wide file lock for a job's duration: jobs of
one rank share it, up to :func:`job_slots` at a time (``MEGATRON_DEEPEPV2_GPU_JOB_SLOTS``, default
:data:`DEFAULT_JOB_SLOTS`), and a job of several ranks holds it alone. Every torchrun command gets a rendezvous port
that is free when it is built. The environment is the test process's minus the settings the test conftest forces for
CPU tests (value validation synchronises the host, which the no-host-sync and CUDA-graph cases forbid).

Waiting for the lock does not count against the waiting test's pytest-timeout. This module is also a pytest plugin
(tests/conftest.py registers it) that notes when pytest-timeout arms a test's timer; a test that finds the lock taken
cancels its timer (through pytest-timeout's own hooks, so both its signal and thread methods) while it waits and, once
it holds the lock, arms it again with what is left of its timeout. The timeout still limits everything the test does
itself, its GPU jobs included. A wait gives up after :data:`MAX_LOCK_WAIT_S`, naming the holders.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Iterator, Sequence

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOCK_PATH = Path(tempfile.gettempdir()) / "megatron_deepepv2_gpu_job.lock"
#: Next to a lock, one line per job that held it: its test, how long it waited and how long it held the lock (its own
#: time, which the test's duration does not tell apart from the wait). For the GPU jobs: this file.
JOB_LOG_PATH = LOCK_PATH.with_suffix(".log")
#: Set by tests/conftest.py for the CPU tests; the GPU cases choose their own settings.
CPU_TEST_SETTINGS = ("MEGATRON_DEEPEPV2_VALIDATE", "TORCHDYNAMO_DISABLE")
#: How long a job waits for the lock before it fails: far beyond the GPU jobs' run times together (each is bounded by
#: its test's timeout), so it ends only a wait on a holder that no timeout stops (a stopped process, say).
MAX_LOCK_WAIT_S = 3600.0
#: The variable that sets how many one-rank GPU jobs may run at once, and its default.
SLOTS_VARIABLE = "MEGATRON_DEEPEPV2_GPU_JOB_SLOTS"
DEFAULT_JOB_SLOTS = 4
_POLL_S = 0.1

#: The running test's pytest-timeout timer: (item, settings, when its budget started, the thread that runs the test).
_timer: tuple[pytest.Item, object, float, int] | None = None


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings) -> None:
    """Notes a test's timer; returns None, so pytest-timeout arms it next."""
    global _timer
    _timer = (item, settings, time.monotonic(), threading.get_ident())


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    global _timer
    _timer = None


@contextlib.contextmanager
def _timeout_paused() -> Iterator[None]:
    """The running test's timer off for the block, then on again with what is left of its timeout.

    Only in the thread that runs the test (pytest-timeout's signal method can be armed from no other); elsewhere, and
    outside pytest or without a timeout, the block is timed like the rest of the test.
    """
    global _timer
    timer = _timer
    if timer is None or timer[3] != threading.get_ident():
        yield
        return
    item, settings, started, _ = timer
    hook = item.config.pluginmanager.hook
    hook.pytest_timeout_cancel_timer(item=item)
    paused = time.monotonic()
    used = paused - started
    try:
        yield
    finally:
        left = round(max(settings.timeout - used, 1e-3), 3)
        hook.pytest_timeout_set_timer(item=item, settings=settings._replace(timeout=left))
        _timer = (item, settings, time.monotonic() - used, timer[3])  # the call above noted `left` as the timeout
        print(f"waited {time.monotonic() - paused:.1f} s for the GPU-job lock, not counted against the "
              f"{settings.timeout:g} s timeout ({left:.1f} s of it left)", file=sys.stderr)


def gpu_job_env() -> dict[str, str]:
    """The environment of a GPU job: this process's, with the package on PYTHONPATH.

    ``EP_DISABLE_GIN`` is left as it is: the library decides it from the hardware, as for a user.
    """
    env = {k: v for k, v in os.environ.items() if k not in CPU_TEST_SETTINGS}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


def torchrun_command(script: str, *args: str, nproc: int = 2) -> list[str]:
    """``python -m torch.distributed.run`` for ``script`` on ``nproc`` GPUs, rendezvous on a free local port."""
    # Imported here: it imports torch, which tests/conftest.py, loading this module as a plugin, must not yet do.
    from tests.distributed import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(ROOT / script), *args]


def job_slots() -> int:
    """How many one-GPU jobs may share the GPU at once: ``MEGATRON_DEEPEPV2_GPU_JOB_SLOTS``, else
    :data:`DEFAULT_JOB_SLOTS`.

    Raises:
        ValueError: The variable is set to something other than a positive integer.
    """
    value = os.environ.get(SLOTS_VARIABLE, "").strip()
    if not value:
        return DEFAULT_JOB_SLOTS
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{SLOTS_VARIABLE}={value!r}: expected a positive integer (1 runs the GPU jobs one at a time)")
    return int(value)


def _try_lock(lock: IO[str], shared: bool = False) -> bool:
    try:
        fcntl.flock(lock, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _slot_path(lock_path: Path, index: int) -> Path:
    return Path(lock_path).with_suffix(f".slot{index}")


def _holders(lock_path: Path, slots: int) -> str:
    """Who holds the lock or its slots, as they wrote it (for the message of a wait that gave up)."""
    names = [path.read_text().strip() for path in [Path(lock_path), *(_slot_path(lock_path, i) for i in range(slots))]
             if path.exists()]
    return "; ".join(name for name in names if name) or "an unknown process"


def _take_slot(lock_path: Path, slots: int) -> IO[str] | None:
    """One free slot's file, locked, or None when all ``slots`` are taken."""
    for index in range(slots):
        slot = open(_slot_path(lock_path, index), "a+")
        if _try_lock(slot):
            return slot
        slot.close()
    return None


@contextlib.contextmanager
def gpu_job_lock(gpus: int, alone: bool = False, lock_path: Path = LOCK_PATH, max_wait: float = MAX_LOCK_WAIT_S,
                 slots: int | None = None) -> Iterator[None]:
    """Holds the machine-wide GPU-job lock for a job on ``gpus`` GPUs (waits, untimed, for jobs of other workers).

    Jobs of one rank share the GPU, up to ``slots`` at a time: each is small next to an H100's memory and mostly waits
    on its host (imports, DeepEP's JIT compilation), so they overlap well. A job of several ranks has every GPU to
    itself (its ranks' all-to-alls would otherwise share the links and the SMs with other jobs).

    Args:
        gpus: The job's ranks, one per GPU.
        alone: Run with no other job whatever ``gpus`` is: the job changes what the others use (it installs into
            the Python environment they import from).
        lock_path: The lock file (another one only in the lock's own tests, which must not wait for real GPU jobs).
        max_wait: Seconds to wait for the lock before raising ``TimeoutError`` naming the holders.
        slots: How many one-rank jobs may run at once; :func:`job_slots` when None. 1 runs every job alone.

    Raises:
        TimeoutError: The lock was not free within ``max_wait`` seconds.
    """
    slots = job_slots() if slots is None else slots
    shared = gpus == 1 and slots > 1 and not alone
    asked = time.monotonic()
    # The gate beside the lock: a job that runs alone takes it while it waits, and one-rank jobs pass through it on
    # their way in, so none starts past a waiting job (which would otherwise wait as long as one-rank jobs keep coming).
    with open(lock_path, "a+") as lock, open(Path(lock_path).with_suffix(".gate"), "a+") as gate:
        gate_held = False

        def attempt() -> IO[str] | None:
            """The file this job writes its name into, once it holds the lock (and a slot), else None."""
            nonlocal gate_held
            if not shared:
                gate_held = gate_held or _try_lock(gate)
                if not (gate_held and _try_lock(lock)):
                    return None
                fcntl.flock(gate, fcntl.LOCK_UN)  # in: the next job to run alone may queue
                gate_held = False
                return lock
            if not _try_lock(gate, shared=True):
                return None
            try:
                if not _try_lock(lock, shared=True):
                    return None
                slot = _take_slot(Path(lock_path), slots)
                if slot is None:
                    fcntl.flock(lock, fcntl.LOCK_UN)  # all slots taken: a job that runs alone may queue meanwhile
                return slot
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)

        mine = attempt()
        if mine is None:
            with _timeout_paused():
                deadline = time.monotonic() + max_wait
                while (mine := attempt()) is None:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"waited {max_wait:g} s for the GPU-job lock {lock_path}, held by "
                                           f"{_holders(Path(lock_path), slots)}")
                    time.sleep(_POLL_S)
        held = time.monotonic()
        holder = os.environ.get("PYTEST_CURRENT_TEST") or " ".join(sys.argv)
        try:
            mine.truncate(0)  # who holds it, for the message above
            mine.write(f"pid {os.getpid()} ({holder})\n")
            mine.flush()
            yield
        finally:
            mine.truncate(0)
            fcntl.flock(mine, fcntl.LOCK_UN)
            if mine is not lock:
                mine.close()
                fcntl.flock(lock, fcntl.LOCK_UN)
            with open(Path(lock_path).with_suffix(".log"), "a") as log:
                log.write(f"{time.strftime('%H:%M:%S')} {holder} [{gpus} GPU{'s' if gpus > 1 else ''}, "
                          f"{'shared' if shared else 'alone'}]: waited {held - asked:.1f} s, held "
                          f"{time.monotonic() - held:.1f} s\n")


def run_gpu_job(command: Sequence[str], timeout: float, gpus: int) -> subprocess.CompletedProcess:
    """Runs one GPU job of ``gpus`` ranks under the lock, from the repository root, capturing its output."""
    with gpu_job_lock(gpus):
        return subprocess.run(list(command), capture_output=True, text=True, env=gpu_job_env(), timeout=timeout,
                              cwd=ROOT)
