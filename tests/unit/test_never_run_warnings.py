"""A buffer build that takes a path which has never run on a GPU with this package says so, once per process."""

from __future__ import annotations

import logging

import pytest

from megatron_deepepv2.backends.deepep import backend as deepep_backend
from megatron_deepepv2.backends.deepep.backend import log_buffer_built
from megatron_deepepv2.backends.deepep.lines import DEEPEP_2_1, DEEPEP_2_5


@pytest.fixture(autouse=True)
def _nothing_warned_yet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(deepep_backend, "_warned_never_run", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_the_line_that_ran_in_direct_mode_logs_its_choice_and_warns_of_nothing(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="megatron_deepepv2.backends.deepep.backend"):
        log_buffer_built(DEEPEP_2_1, hybrid=False, why="one node")
    assert [r.getMessage() for r in caplog.records] == ["DeepEP 2.1 ElasticBuffer: direct mode (one node)"]


def test_v2_5_and_hybrid_mode_each_warn_once_per_process(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="megatron_deepepv2.backends.deepep.backend"):
        for _ in range(3):  # a buffer per layer or per hidden size: one warning each, not one per build
            log_buffer_built(DEEPEP_2_5, hybrid=False, why="one node")
        log_buffer_built(DEEPEP_2_1, hybrid=True, why="the group spans 2 nodes")
        log_buffer_built(DEEPEP_2_5, hybrid=True, why="the group spans 2 nodes")
    warned = _warnings(caplog)
    assert len(warned) == 2, warned
    assert warned[0].startswith("DeepEP V2.5's EPBuffer has never run on a GPU with megatron-deepepv2")
    assert warned[1].startswith("DeepEP's hybrid mode (a group across nodes, RDMA x NVLink) has never run on a GPU")
    assert all("compare the first steps with a run you trust" in message for message in warned)
