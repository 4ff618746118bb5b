"""The multi-process test harness itself: failures, hangs and unsendable results are reported, never waited on."""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time

import pytest
import torch.distributed

from tests.distributed import RankFailure, run_distributed


def _rank_values(rank: int, world: int) -> dict:
    return {"rank": rank, "world": world}


def _rank_one_raises(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("bad input on rank one")


def _returns_unpicklable(rank: int, world: int):
    return threading.Lock()


def _rank_zero_hangs(rank: int, world: int) -> None:
    if rank == 0:
        time.sleep(600)


def test_returns_each_ranks_value() -> None:
    assert run_distributed(_rank_values, 3) == [{"rank": r, "world": 3} for r in range(3)]


def test_a_failing_rank_is_reported_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match=r"(?s)rank 1 of 2 failed.*ValueError: bad input on rank one"):
        run_distributed(_rank_one_raises, 2)


def test_an_unsendable_result_fails_at_once_instead_of_hanging() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match="cannot be sent back to the test process"):
        run_distributed(_returns_unpicklable, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_a_hung_rank_fails_after_the_timeout_with_its_stack() -> None:
    with pytest.raises(RankFailure, match=r"(?s)ranks \[0\] did not finish within 3s.*rank 0 \(alive\) stacks:"
                                          r".*in _rank_zero_hangs"):
        run_distributed(_rank_zero_hangs, 2, timeout=3)


def _rank_one_dies(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no exception, no result: as a crash in native code or a kill would leave it
    time.sleep(600)


def test_a_rank_that_dies_without_a_result_is_reported_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"ranks \[1\] exited without a result \(exit codes: rank 1: 3\)"):
        run_distributed(_rank_one_dies, 2, timeout=120)
    assert time.monotonic() - start < 30


def _rank_one_needs_the_store_after_rank_zero_returned(rank: int, world: int) -> str:
    if rank == 0:
        return "left at once"
    time.sleep(1.0)  # rank 0 has returned by now; the store lives in its process
    group = torch.distributed.new_group([1], use_local_synchronization=True)  # a gloo group meets through the store
    return f"group of {torch.distributed.get_world_size(group)}"


def test_the_store_outlives_every_rank_that_still_needs_it() -> None:
    # A rank that returns first must not take the store with it: its peers may still be creating groups through it.
    assert run_distributed(_rank_one_needs_the_store_after_rank_zero_returned, 2) == ["left at once", "group of 1"]


def _imported_megatron(rank: int, world: int) -> dict:
    return {"megatron": "megatron.core.transformer.moe.moe_layer" in sys.modules,
            "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}


def test_forked_ranks_start_with_megatron_imported_and_fresh_ones_without() -> None:
    installed = importlib.util.find_spec("megatron") is not None
    forked = run_distributed(_imported_megatron, 2)
    assert forked == [{"megatron": installed, "visible_gpus": ""}] * 2  # imported once, by the forkserver
    # A fresh interpreter leaves the import to the test (to put another Megatron tree first), and still hides GPUs.
    fresh = run_distributed(_imported_megatron, 2, fresh_interpreter=True)
    assert fresh == [{"megatron": False, "visible_gpus": ""}] * 2
