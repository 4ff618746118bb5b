"""Starting the ranks of a multi-process run on this host (the demo and the CPU tests): on a free rendezvous port."""

from __future__ import annotations

import socket
from typing import Callable


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
