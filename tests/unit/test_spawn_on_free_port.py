"""``spawn_on_free_port`` (the demo's and the comparison tool's launcher): a port taken between being chosen and
being bound fails the start with EADDRINUSE, which is retried on a new port; other failures are raised."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from megatron_deepepv2.testing import spawn
from tests.distributed import _cpu_context
from tests.unit.spawn_worker import rendezvous as _rendezvous


def test_a_taken_port_is_retried_and_other_failures_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # the first port handed out is in use
    chosen = []
    original = spawn.free_port
    monkeypatch.setattr(spawn, "free_port", lambda: chosen.append(ports.pop() if ports else original()) or chosen[-1])
    # The ranks fork from the suite's CPU forkserver (already running in most workers): what is tested is the retry,
    # the same for every start method, not interpreter start-up.
    _cpu_context()
    try:
        spawn.spawn_on_free_port(_rendezvous, (False,), 2, start_method="forkserver")
        assert len(chosen) == 2 and chosen[0] == taken.getsockname()[1]  # retried once, on another port
        with pytest.raises(mp.ProcessRaisedException, match="a failure of the worker itself"):
            spawn.spawn_on_free_port(_rendezvous, (True,), 2, start_method="forkserver")
        assert len(chosen) == 3  # not retried
    finally:
        taken.close()
