"""NCCL GIN decided from the hardware (:func:`megatron_deepepv2.backends.deepep.topology.decide_gin` and what applies
it).

The RDMA probe and the environment are faked: a dictionary for the environment (or ``os.environ`` under
``monkeypatch``), a list of device paths for ``/sys/class/infiniband``. The backend's use of the decision runs on gloo
ranks over the DeepEP stand-in, each rank's node faked through ``MEGATRON_DEEPEPV2_NODE_ID``, and records the variable
as DeepEP's constructor would read it.
"""

from __future__ import annotations

import logging
from typing import Optional

import pytest

from megatron_deepepv2.backends.deepep import topology
from megatron_deepepv2.groups import state_of
from megatron_deepepv2.backends.deepep.topology import (GIN_VARIABLE, NODE_ID_VARIABLE, decide_gin, launch_num_nodes,
                                        set_gin_variable)
from tests.distributed import run_distributed

NIC = ["/sys/class/infiniband/mlx5_0"]


@pytest.fixture(autouse=True)
def _fresh_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no environment marked as set by the decision."""
    monkeypatch.setattr(topology, "_gin_set_in", [])


def _set_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if f"{GIN_VARIABLE}=1" in r.getMessage()]


def test_no_rdma_nic_and_unset_sets_it_in_the_process_environment_with_one_info_line(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    import os

    monkeypatch.setenv(GIN_VARIABLE, "placeholder")  # recorded first, so teardown undoes what the call sets
    monkeypatch.delenv(GIN_VARIABLE)
    monkeypatch.setattr(topology, "find_rdma_devices", lambda: [])  # the default probe, looked up at each call
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.backends.deepep.topology")
    for _ in range(2):  # a second decision (a second buffer) changes nothing and says nothing
        decision = set_gin_variable(1)
        assert os.environ.get(GIN_VARIABLE) == "1"
        assert decision.automatic and not decision.gin_on and "no RDMA NIC" in decision.reason
    (line,) = _set_lines(caplog)
    assert line.levelno == logging.INFO and "No RDMA NIC on this node" in line.getMessage()
    assert f"Set {GIN_VARIABLE} yourself to override" in line.getMessage()


@pytest.mark.parametrize("value", ["0", "1"])
@pytest.mark.parametrize("nics", [[], NIC])
@pytest.mark.parametrize("num_nodes", [1, 2])
def test_a_value_the_user_set_is_kept(caplog: pytest.LogCaptureFixture, value: str, nics: list,
                                      num_nodes: int) -> None:
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.backends.deepep.topology")
    env = {GIN_VARIABLE: value}
    decision = set_gin_variable(num_nodes, env, lambda: nics)  # several nodes without a NIC too: the user decided
    assert env == {GIN_VARIABLE: value}
    assert (decision.value, decision.automatic, decision.gin_on) == (value, False, value == "0")
    assert not _set_lines(caplog)


@pytest.mark.parametrize("num_nodes", [1, 4])
def test_an_rdma_nic_leaves_it_unset(caplog: pytest.LogCaptureFixture, num_nodes: int) -> None:
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.backends.deepep.topology")
    env: dict = {}
    decision = set_gin_variable(num_nodes, env, lambda: NIC)
    assert env == {} and decision.gin_on and not decision.automatic
    assert "mlx5_0" in decision.reason
    assert not _set_lines(caplog)


def test_several_nodes_without_an_rdma_nic_is_an_error_naming_the_fix() -> None:
    env: dict = {}
    with pytest.raises(RuntimeError) as error:
        set_gin_variable(2, env, lambda: [])
    message = str(error.value)
    assert "span 2 nodes" in message and "no RDMA NIC" in message
    assert "To fix" in message and "RDMA NICs" in message and "within one node" in message
    assert f"set {GIN_VARIABLE} yourself" in message
    assert env == {}  # not disabled silently


def test_a_value_the_decision_set_is_decided_again_for_a_group_across_nodes() -> None:
    """A launcher that saw one node set it; a buffer whose group spans nodes still gets the error."""
    env: dict = {}
    assert set_gin_variable(1, env, lambda: []).automatic and env == {GIN_VARIABLE: "1"}
    assert decide_gin(1, env, lambda: []).automatic  # still the decision's, not the user's
    with pytest.raises(RuntimeError, match="no RDMA NIC"):
        set_gin_variable(2, env, lambda: [])
    assert decide_gin(2, {GIN_VARIABLE: "1"}, lambda: []).value == "1"  # the same value in another mapping: a user's


@pytest.mark.parametrize("environ,expected", [
    ({}, 1),  # one process, or a launcher that says nothing
    ({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 1),
    ({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}, 2),
    ({"WORLD_SIZE": "12", "LOCAL_WORLD_SIZE": "8"}, 2),
    ({"GROUP_WORLD_SIZE": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"}, 3),  # torchrun's own count first
    ({"WORLD_SIZE": "16"}, 1),
    ({"GROUP_WORLD_SIZE": "x", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"}, 4),
])
def test_launch_num_nodes_reads_the_launchers_environment(environ: dict, expected: int) -> None:
    assert launch_num_nodes(environ) == expected


# ------------------------------------------------------------------------------------------ the backend's buffer build
def _gin_at_build(rank: int, world: int, nodes: Optional[list[str]], nics: list[str],
                  user_value: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """Builds the DeepEP backend over the stand-in; returns (EP_DISABLE_GIN when DeepEP's constructor ran, error)."""
    import os
    import sys

    from megatron_deepepv2.backends.base import BufferSpec
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from tests.deepep_stand_in import group_of, use_stand_in_backend

    os.environ.pop(GIN_VARIABLE, None)
    if user_value is not None:
        os.environ[GIN_VARIABLE] = user_value
    if nodes is not None:
        os.environ[NODE_ID_VARIABLE] = nodes[rank]
    topology.find_rdma_devices = lambda: nics
    use_stand_in_backend()
    buffer_class = sys.modules["deep_ep"].ElasticBuffer
    seen: list[Optional[str]] = []
    build = buffer_class.__init__

    def recording_build(self, *args, **kwargs) -> None:  # what DeepEP's constructor reads
        seen.append(os.environ.get(GIN_VARIABLE))
        build(self, *args, **kwargs)

    buffer_class.__init__ = recording_build
    try:
        backend = DeepEPBackend(state_of(group_of()), BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=8))
    except RuntimeError as error:
        assert not seen, "the buffer was built before the error"
        return None, str(error)
    backend.destroy()
    (value,) = seen
    return value, None


def test_backend_on_one_node_without_an_rdma_nic_builds_with_gin_off() -> None:
    assert run_distributed(_gin_at_build, 2, None, [], None) == [("1", None)] * 2


def test_backend_with_an_rdma_nic_builds_with_gin_on() -> None:
    assert run_distributed(_gin_at_build, 2, ["n0", "n1"], NIC, None) == [(None, None)] * 2


@pytest.mark.parametrize("value", ["0", "1"])
def test_backend_keeps_the_users_value(value: str) -> None:
    """Even across nodes without an RDMA NIC: the user decided (no error, the value as set)."""
    assert run_distributed(_gin_at_build, 2, ["n0", "n1"], [], value) == [(value, None)] * 2


def test_backend_across_nodes_without_an_rdma_nic_refuses_on_every_rank() -> None:
    outcomes = run_distributed(_gin_at_build, 2, ["n0", "n1"], [], None)
    assert [value for value, _ in outcomes] == [None, None]
    assert all(error and "span 2 nodes" in error and "no RDMA NIC" in error for _, error in outcomes), outcomes
