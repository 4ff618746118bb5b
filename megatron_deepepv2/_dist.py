"""Small ``torch.distributed`` helpers shared by the buffer lifecycle, validation and backends."""

from __future__ import annotations

import ctypes
import socket
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Returns the device whose tensors collectives over ``group`` take (CUDA for NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on this host now, for the rendezvous of processes this one starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_on_free_port(worker: Callable, args: tuple, nprocs: int, attempts: int = 3,
                       start_method: str = "spawn") -> None:
    """``torch.multiprocessing.start_processes(worker, args=(nprocs, port, *args))`` on a free rendezvous port.

    The port is free when chosen, but another process can take it before rank 0 binds it; a start that fails so
    (EADDRINUSE) is retried on a new port, ``attempts`` times in all. ``start_method`` is multiprocessing's (``spawn``:
    fresh interpreters; ``forkserver``: forked from a server, e.g. one that preloaded modules).

    Raises:
        torch.multiprocessing.ProcessRaisedException, ProcessExitedException: A rank failed (for another reason,
            or on the last attempt).
    """
    import torch.multiprocessing as mp  # noqa: PLC0415

    for attempt in range(attempts):
        try:
            mp.start_processes(worker, args=(nprocs, free_port(), *args), nprocs=nprocs, join=True,
                               start_method=start_method)
            return
        except mp.ProcessRaisedException as error:
            if "EADDRINUSE" not in str(error) or attempt == attempts - 1:
                raise


_group_sizes: dict[dist.ProcessGroup, int] = {}


def group_size(group: dist.ProcessGroup) -> int:
    """``dist.get_world_size(group)``, asked once per group (the call costs tens of microseconds per dispatch)."""
    size = _group_sizes.get(group)
    if size is None:
        size = _group_sizes[group] = dist.get_world_size(group)
    return size


def all_reduce_max(values: Sequence[int], group: dist.ProcessGroup) -> list[int]:
    """Element-wise maximum of integer vectors over ``group`` (one small all-reduce, a host sync).

    Args:
        values: This rank's integers; every rank passes the same length.
        group: Process group.

    Returns:
        The element-wise maxima, the same on every rank.
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's integer vector (one small all-gather, a host sync); every rank passes the same length.

    Returns:
        One list per rank of ``group``, in group-rank order.
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    gathered = [torch.empty_like(tensor) for _ in range(group_size(group))]
    dist.all_gather(gathered, tensor, group=group)
    return [t.tolist() for t in gathered]


_FAILURE_PREFIX = "megatron_deepepv2/failure"
#: Per process group: how many dispatch / combine calls this process has started on it. The ranks of a group make the
#: same calls in the same order, so the count names a call the same way on every rank; a failure announcement carries
#: it, and a peer reads only the announcements of the call it failed in (an earlier failure's are not its cause).
_calls: dict[dist.ProcessGroup, int] = {}


def count_call(group: dist.ProcessGroup) -> None:
    """Counts a dispatch or combine call on ``group`` (at its start; a dictionary update)."""
    _calls[group] = _calls.get(group, 0) + 1


def _store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already has
    except (RuntimeError, ValueError, AttributeError):
        return None


def _group_tag(group: dist.ProcessGroup) -> str:
    return ",".join(map(str, dist.get_process_group_ranks(group)))


def announce_failure(group: dist.ProcessGroup, error: BaseException) -> None:
    """Leaves this rank's error where the other ranks of ``group`` can read it (the rendezvous store).

    A rank that raises before a collective leaves its peers blocked in that collective until it fails for them
    (the peer's process exits, the process group times out, or DeepEP's kernel timeout trips); they then name
    this error as the cause (:func:`announced_failures`). The announcement is scoped to the current call (see
    :func:`count_call`). Costs one store write, on the error path only.
    """
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_FAILURE_PREFIX}/{_group_tag(group)}/{dist.get_rank()}",
                  f"{_calls.get(group, 0)}|{type(error).__name__}: {error}")
    except Exception:  # noqa: BLE001 - best effort: the error itself is raised by the caller
        pass


def announced_failures(group: dist.ProcessGroup) -> dict[int, str]:
    """The errors other ranks of ``group`` announced in this rank's current call (global rank -> message).

    Announcements of other calls (an earlier, unrelated failure) are left out. Empty when none or unreachable.
    """
    store = _store()
    if store is None:
        return {}
    found = {}
    tag = _group_tag(group)
    call = str(_calls.get(group, 0))
    for rank in dist.get_process_group_ranks(group):
        key = f"{_FAILURE_PREFIX}/{tag}/{rank}"
        try:
            if rank != dist.get_rank() and store.check([key]):
                announced_call, _, message = store.get(key).decode(errors="replace").partition("|")
                if announced_call == call:
                    found[rank] = message
        except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
            break
    return found


def rendezvous(group: dist.ProcessGroup, name: str, timeout_s: float) -> bool:
    """Waits until every rank of ``group`` reached the point called ``name`` (through the store, no collective).

    Args:
        group: The ranks that must arrive.
        name: The point, the same string on every rank (e.g. a counter of collective events).
        timeout_s: How long to wait.

    Returns:
        True when all arrived, False when ``timeout_s`` passed first (or True at once without a store).
    """
    store = _store()
    if store is None:
        return True
    key = f"megatron_deepepv2/rendezvous/{_group_tag(group)}/{name}"
    size = group_size(group)
    arrived = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while arrived < size:
        if time.monotonic() > deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
        arrived = store.add(key, 0)
    return True


def next_power_of_two(value: int) -> int:
    """Smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


def mapped_nccl_libraries() -> list[str]:
    """Paths of the ``libnccl`` files mapped into this process (from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps if "libnccl" in line and "/" in line})
    except OSError:
        return []


def runtime_nccl_version() -> Optional[tuple[int, int, int]]:
    """Version of the NCCL library actually loaded, asked from the library itself (``ncclGetVersion``).

    ``torch.cuda.nccl.version()`` reports the NCCL PyTorch was compiled against, which differs when the
    runtime library was replaced (as DeepEP v2 setups do to get NCCL >= 2.30.4).

    Returns:
        ``(major, minor, patch)``, or None when no NCCL is loaded or it cannot be asked.
    """
    for path in mapped_nccl_libraries():
        try:
            code = ctypes.c_int()
            if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
                continue
        except (OSError, AttributeError):
            continue
        value = code.value  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return value // 10000, (value % 10000) // 100, value % 100
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - torch without NCCL raises various errors
        return None
    return tuple(version) if isinstance(version, tuple) else None
