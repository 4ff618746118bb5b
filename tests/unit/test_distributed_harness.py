"""The multi-process test harness itself: failures, hangs and unsendable results are reported, never waited on."""

from __future__ import annotations

import threading
import time

import pytest

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


def test_a_hung_rank_fails_after_the_timeout() -> None:
    with pytest.raises(RankFailure, match=r"ranks \[0\] did not finish within 3s"):
        run_distributed(_rank_zero_hangs, 2, timeout=3)
