"""Multi-process test harness: runs a function on N gloo ranks and returns what each rank returned.

Ranks are forked from a forkserver that has already imported torch, this package and Megatron (where installed),
so a multi-rank test costs well under a second of start-up. Every run has a timeout: a hang fails the test instead
of blocking CI, with each hung rank's Python stacks, and a rank that dies without a result fails the test at once;
leftover processes are killed. A failure on any rank is re-raised with that rank's traceback.
The ranks leave together: rank 0, whose process serves the store, stays until every rank is done with it.
"""

from __future__ import annotations

import faulthandler
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

from megatron_deepepv2.testing.preload import server_preload
from megatron_deepepv2.testing.spawn import free_port

_CONTEXT = mp.get_context("forkserver")
# What the ranks would import: Megatron (where installed; a missing module is skipped) takes seconds per rank, so the
# server imports it once. Tests that must import Megatron themselves (from another tree) ask for a fresh interpreter.
RANK_PRELOAD = server_preload(
    # Patched by the integration for EP overlap (the tests only).
    after_megatron=("megatron.core.models.gpt.fine_grained_callables",))
_CONTEXT.set_forkserver_preload(RANK_PRELOAD)
# Ranks that use the GPU start from a fresh interpreter: CUDA state must not be inherited through a fork.
_SPAWN_CONTEXT = mp.get_context("spawn")
_forkserver_hides_gpus = False


_INIT_FAILED = "process-group initialisation failed:\n"
_POLL_S = 0.5  # how often the parent looks for ranks that died without a result
_INIT_ATTEMPTS = 3
_GROUP_TIMEOUT = timedelta(seconds=60)
# Store keys through which the ranks leave together (see _leave_together).
_LEFT_COUNT_KEY = "tests.distributed/left"
_ALL_LEFT_KEY = "tests.distributed/all_left"


class RankFailure(AssertionError):
    """A rank of a distributed test raised; the message holds its traceback."""


def _cpu_context() -> Any:
    """The forkserver context for CPU ranks, its server started with every GPU hidden.

    The server imports torch before it forks ranks, and CUDA caches the device count process-wide once anything
    asks for it; hiding the GPUs in a rank after the fork would leave torch half-sure a GPU is there. Hidden from
    the server on, CPU ranks see no GPU at all, consistently (else Megatron places parameters on it and the CPU
    shims step aside).
    """
    global _forkserver_hides_gpus
    if not _forkserver_hides_gpus:
        from multiprocessing import forkserver

        saved = os.environ.get("CUDA_VISIBLE_DEVICES")
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["CUDA_VISIBLE_DEVICES"]
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
        _forkserver_hides_gpus = True
    return _CONTEXT


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, results: Any, env: dict,
            stack_file: str) -> None:
    os.environ.update(env)
    # A hung run is reported with each rank's Python stacks: the parent sends SIGUSR1 before it kills the ranks.
    stacks = open(stack_file, "w")  # noqa: SIM115 - open for the process's lifetime
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=_GROUP_TIMEOUT)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT)
    except BaseException:  # noqa: BLE001 - e.g. the port was taken between choosing and binding it
        results.put((rank, False, _INIT_FAILED + traceback.format_exc()))
        return
    try:
        value = fn(rank, world_size, *args)
        try:  # the queue pickles in a background thread, where an error would be lost (and the run hang)
            pickle.dumps(value)
        except Exception as error:
            raise TypeError(f"{getattr(fn, '__name__', fn)} returned a {type(value).__name__}, which cannot be "
                            f"sent back to the test process ({error}); return plain data instead.") from error
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, False, traceback.format_exc()))
    finally:
        try:
            import megatron_deepepv2

            megatron_deepepv2.destroy_buffers()
        except Exception:  # noqa: BLE001 - the group may be broken already
            pass
        _leave_together(store, rank, world_size)
        if dist.is_initialized():
            dist.destroy_process_group()
        # The rank exits next. A forked rank skips the interpreter's shutdown; a fresh one (spawned) would end it with a
        # garbage collection over every object torch and Megatron created, seconds; frozen objects are skipped.
        gc.freeze()


def _leave_together(store: Any, rank: int, world_size: int) -> None:
    """Keeps rank 0, whose process serves the store, alive until every rank is done with it.

    A rank that returns first would otherwise take the store down while its peers still meet through it (a gloo
    group is created over the store, and nothing in the test function need follow it), and they fail with
    "Connection reset by peer". A rank that died leaves rank 0 waiting until the group timeout, by which time the
    parent has reported and killed the run.
    """
    try:
        if store.add(_LEFT_COUNT_KEY, 1) == world_size:
            store.set(_ALL_LEFT_KEY, "1")
        if rank == 0:
            store.wait([_ALL_LEFT_KEY], _GROUP_TIMEOUT)
    except Exception:  # noqa: BLE001 - a peer's failure is already reported; this only delays rank 0's exit
        pass


def run_distributed(
    fn: Callable,
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict | None = None,
    cuda: bool = False,
    fresh_interpreter: bool = False,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    Args:
        fn: A module-level function (it is pickled by reference).
        world_size: Number of ranks.
        *args: Extra picklable arguments.
        timeout: Seconds before the run is declared hung and killed.
        env: Environment variables to set in every rank.
        cuda: Whether the ranks may use the GPU. CPU ranks (the default) see no GPU; CUDA ranks start from a
            fresh interpreter (a few seconds more) and see the GPUs the test process sees.
        fresh_interpreter: Start CPU ranks from a fresh interpreter too, with nothing imported but this harness and
            ``fn``'s module (forked ranks have Megatron imported already, from the first ``megatron`` on ``sys.path``).

    Returns:
        The return values, indexed by rank.

    Raises:
        RankFailure: If any rank raised (first failing rank's traceback), or the run timed out. A failed
            process-group start (a port taken between choosing and binding it) is retried with a new port.
    """
    for attempt in range(_INIT_ATTEMPTS):
        outcomes = _run_once(fn, world_size, args, timeout, env, cuda, fresh_interpreter)
        init_failed = any(not ok and str(v).startswith(_INIT_FAILED) for ok, v in outcomes.values())
        if not init_failed or attempt == _INIT_ATTEMPTS - 1:
            break
    failures = {r: v for r, (ok, v) in outcomes.items() if not ok}
    if failures:
        rank = min(failures)
        raise RankFailure(f"rank {rank} of {world_size} failed:\n{failures[rank]}")
    return [outcomes[r][1] for r in range(world_size)]


def _run_once(
    fn: Callable, world_size: int, args: tuple, timeout: float, env: dict | None, cuda: bool, fresh: bool
) -> dict[int, tuple[bool, Any]]:
    context = _SPAWN_CONTEXT if cuda or fresh else _cpu_context()
    env = dict(env or {})
    if fresh and not cuda:  # set in the rank before anything there asks CUDA for its devices
        env["CUDA_VISIBLE_DEVICES"] = ""
    port = free_port()
    results = context.Queue()
    with tempfile.TemporaryDirectory(prefix="rank-stacks-") as stack_dir:
        stack_files = [os.path.join(stack_dir, f"rank{r}.txt") for r in range(world_size)]
        procs = [
            context.Process(target=_worker, args=(r, world_size, port, fn, args, results, env, stack_files[r]))
            for r in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes: dict[int, tuple[bool, Any]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcomes) < world_size:
                try:
                    rank, ok, value = results.get(timeout=_POLL_S)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    # A rank that exited has sent all it ever will (its queue is flushed at exit): one that exited
                    # without a result died (a signal, os._exit, a crash in the interpreter); say so at once.
                    dead = [r for r in missing if procs[r].exitcode is not None]
                    if dead and _nothing_more(results):
                        codes = ", ".join(f"rank {r}: {procs[r].exitcode}" for r in dead)
                        raise RankFailure(f"ranks {dead} exited without a result (exit codes: {codes})") from None
                    if time.monotonic() < deadline:
                        continue
                    raise RankFailure(f"ranks {missing} did not finish within {timeout}s (hang?)\n"
                                      + _stacks_of(procs, stack_files, missing)) from None
                outcomes[rank] = (ok, value)
                if not ok:
                    break  # peers may now be stuck waiting for this rank
        finally:
            for proc in procs:
                proc.join(timeout=5 if len(outcomes) == world_size else 0.5)
                if proc.is_alive():
                    proc.kill()
                    proc.join()
    return outcomes


def _nothing_more(results: Any) -> bool:
    """Whether ``results`` stays empty for a moment (a result sent just before its rank exited is on its way)."""
    try:
        item = results.get(timeout=_POLL_S)
    except queue.Empty:
        return True
    results.put(item)  # back for the caller's loop (the order of results does not matter)
    return False


def _stacks_of(procs: list, stack_files: list[str], ranks: list[int]) -> str:
    """The Python stacks of the hung ``ranks`` (each dumps them on SIGUSR1), or why a rank has none."""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(1.0)  # the dump runs in the rank's signal handler
    parts = []
    for rank in ranks:
        try:
            with open(stack_files[rank]) as stacks:
                text = stacks.read().strip()
        except OSError:
            text = ""
        state = "alive" if procs[rank].is_alive() else f"exited with {procs[rank].exitcode}"
        parts.append(f"--- rank {rank} ({state}) stacks:\n{text or '(none: the rank never reached its worker)'}")
    return "\n".join(parts)
