"""DeepEP's hybrid/direct mode from the nodes of the expert-parallel group's ranks
(:mod:`megatron_deepepv2.backends.deepep.topology`).

The expected modes are written out by hand from DeepEP's rule (hybrid when the ranks span more than one NVLink
domain, NCCL's LSA team) for layouts a launcher produces: a plain 8-GPU node, an expert-parallel group strided one rank
per node, two full nodes, one GPU per task under srun, and layouts NCCL would cut into smaller NVLink domains. The
gloo tests fake each rank's node through ``MEGATRON_DEEPEPV2_NODE_ID`` and check the gathered decision on every rank,
the single gather per group, and the backend's constructor argument.
"""

from __future__ import annotations

from typing import Optional

import pytest

from megatron_deepepv2.backends.deepep.topology import NODE_ID_VARIABLE, local_node_id, node_layout
from megatron_deepepv2.groups import state_of
from tests.distributed import run_distributed


# ------------------------------------------------------------------------------------------------ the pure decision
def test_one_node_of_eight_gpus_is_direct() -> None:
    layout = node_layout(["node-a"] * 8)
    assert layout.allow_hybrid_mode is False
    assert (layout.num_nodes, layout.ranks_per_node, layout.nvlink_domain_size) == (1, (8,), 8)
    assert layout.describe() == "8 ranks on 1 node"


def test_group_strided_one_rank_per_node_is_hybrid() -> None:
    """8 ranks on 8 nodes (e.g. expert parallelism across tensor-parallel node groups): RDMA between every pair."""
    layout = node_layout([f"node-{i}" for i in range(8)])
    assert layout.allow_hybrid_mode is True
    assert (layout.num_nodes, layout.ranks_per_node, layout.nvlink_domain_size) == (8, (1,) * 8, 1)
    assert layout.describe() == "8 ranks on 8 nodes, 1 per node"


def test_sixteen_ranks_on_two_nodes_is_hybrid() -> None:
    layout = node_layout(["node-a"] * 8 + ["node-b"] * 8)
    assert layout.allow_hybrid_mode is True
    assert (layout.num_nodes, layout.ranks_per_node, layout.nvlink_domain_size) == (2, (8, 8), 8)
    assert layout.describe() == "16 ranks on 2 nodes, 8 per node"


def test_one_gpu_per_task_under_srun_is_direct(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 tasks on one host, each seeing one GPU and no LOCAL_WORLD_SIZE: one node, so direct mode."""
    import torch

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv(NODE_ID_VARIABLE, raising=False)
    monkeypatch.delenv("NCCL_HOSTID", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    tasks = [{"SLURM_PROCID": str(task), "SLURM_LOCALID": str(task), "CUDA_VISIBLE_DEVICES": str(task)}
             for task in range(8)]
    layout = node_layout([local_node_id(environ) for environ in tasks])
    assert layout.allow_hybrid_mode is False
    assert layout.describe() == "8 ranks on 1 node"


@pytest.mark.parametrize("node_ids, named, nvlink_domain", [
    (["a"] * 6 + ["b"] * 2, "unequal numbers of its ranks ('a': 6, 'b': 2)", "2 ranks"),
    (["a"] * 8 + ["b"] * 4, "unequal numbers of its ranks ('a': 8, 'b': 4)", "4 ranks"),
    (["a", "b"] * 4, "not as consecutive group ranks (node of each group rank: 0 1 0 1 0 1 0 1)", "1 rank,"),
])
def test_layouts_nccl_would_cut_into_smaller_nvlink_domains_are_refused(node_ids: list[str], named: str,
                                                                        nvlink_domain: str) -> None:
    """NCCL's LSA team is the gcd of the runs of consecutive ranks on one node (6+2: 2; 8+4: 4; alternating: 1)."""
    with pytest.raises(ValueError) as error:
        node_layout(node_ids)
    message = str(error.value)
    assert named in message, message
    assert "num_ranks % num_nvl_ranks == 0" in message
    assert f"domains of their greatest common divisor, here {nvlink_domain}" in message, message
    assert "MEGATRON_DEEPEPV2_ALLOW_HYBRID_MODE" in message


def test_an_empty_group_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        node_layout([])


def test_node_identity_override_then_nccls_then_the_host() -> None:
    import socket

    assert local_node_id({NODE_ID_VARIABLE: "nvl72-rack3", "NCCL_HOSTID": "h"}) == "nvl72-rack3"
    assert local_node_id({NODE_ID_VARIABLE: "  ", "NCCL_HOSTID": "h"}) == "h"  # blank: not set
    assert local_node_id({}).split(":")[0] == socket.gethostname()


# ------------------------------------------------------------------------------------------------ over gloo ranks
def _gathered_decisions(rank: int, world: int, nodes: list[str]) -> dict:
    import os

    import torch.distributed as dist

    from megatron_deepepv2.backends.deepep import topology

    os.environ[NODE_ID_VARIABLE] = nodes[rank]
    gathers = []
    gather = dist.all_gather_object
    dist.all_gather_object = lambda *args, **kwargs: gathers.append(1) or gather(*args, **kwargs)
    first = topology.choose_hybrid_mode(state_of(dist.group.WORLD), None)
    again = topology.choose_hybrid_mode(state_of(dist.group.WORLD), None)  # cached: no second gather
    forced = topology.choose_hybrid_mode(state_of(dist.group.WORLD), not first[0])  # the setting wins, without a gather
    gathers_on_world = len(gathers)
    ids = topology.group_node_ids(state_of(dist.group.WORLD))
    # A new group over ranks 0 and 2 gathers once more, in its own rank order.
    pair = dist.new_group([0, 2])
    pair_choice = topology.choose_hybrid_mode(state_of(pair), None) if rank in (0, 2) else None
    return dict(first=first, again=again, forced=forced, ids=list(ids), gathers_on_world=gathers_on_world,
                gathers=len(gathers), pair=pair_choice)


@pytest.mark.parametrize("nodes, hybrid, described, pair_hybrid", [
    (["n0"] * 4, False, "4 ranks on 1 node", False),
    (["nB", "nB", "nA", "nA"], True, "4 ranks on 2 nodes, 2 per node", True),  # group order, not sorted
    (["n0", "n1", "n2", "n3"], True, "4 ranks on 4 nodes, 1 per node", True),
])
def test_every_rank_gathers_the_same_nodes_once_per_group(nodes: list[str], hybrid: bool, described: str,
                                                          pair_hybrid: bool) -> None:
    results = run_distributed(_gathered_decisions, 4, nodes, env={"LOCAL_WORLD_SIZE": "4"})
    for rank, got in enumerate(results):
        assert got["ids"] == nodes, (rank, got)
        assert got["first"] == got["again"] == (hybrid, described), (rank, got)
        assert got["forced"] == (not hybrid, f"allow_hybrid_mode={not hybrid} set"), (rank, got)
        assert got["gathers_on_world"] == 1, (rank, got)
        if rank in (0, 2):
            assert got["gathers"] == 2 and got["pair"][0] is pair_hybrid, (rank, got)
        else:
            assert got["gathers"] == 1 and got["pair"] is None, (rank, got)


def _refusal(rank: int, world: int, nodes: list[str]) -> str:
    import os

    import torch.distributed as dist

    from megatron_deepepv2.backends.deepep import topology

    os.environ[NODE_ID_VARIABLE] = nodes[rank]
    try:
        topology.choose_hybrid_mode(state_of(dist.group.WORLD), None)
    except ValueError as error:
        return str(error)
    return "no error"


def test_an_uneven_group_is_refused_on_every_rank() -> None:
    """Three ranks on one node, one on another: every rank raises the same error (none waits for the others)."""
    messages = run_distributed(_refusal, 4, ["n0", "n0", "n0", "n1"])
    assert len(set(messages)) == 1 and "unequal numbers of its ranks ('n0': 3, 'n1': 1)" in messages[0], messages


def _backend_mode(rank: int, world: int, nodes: Optional[list[str]], setting: Optional[bool]) -> tuple[bool, bool]:
    import os

    import torch

    from megatron_deepepv2.backends.deepep import backend as deepep_backend, topology
    from megatron_deepepv2.backends.base import BufferSpec
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.config import DeepepV2Settings
    from tests.deepep_stand_in import group_of, use_stand_in_backend

    # One GPU per task under srun: no LOCAL_WORLD_SIZE, one visible device (CPU ranks see none).
    os.environ.pop("LOCAL_WORLD_SIZE", None)
    topology.find_rdma_devices = lambda: ["/sys/class/infiniband/mlx5_0"]  # nodes joined by RDMA, as hybrid needs
    torch.cuda.device_count = lambda: 1
    if nodes is not None:
        os.environ[NODE_ID_VARIABLE] = nodes[rank]
    use_stand_in_backend()
    spec = BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=8,
                      settings=DeepepV2Settings(allow_hybrid_mode=setting))
    warned: list[str] = []
    deepep_backend.logger.warning = lambda message, *args: warned.append(message)
    backend = DeepEPBackend(state_of(group_of()), spec)
    try:
        return backend.ep_buffer.ctor["allow_hybrid_mode"], any("hybrid mode" in message for message in warned)
    finally:
        backend.destroy()


@pytest.mark.parametrize("nodes, setting, expected", [
    (None, None, False),  # one host, one GPU per task: direct
    (["n0", "n1"], None, True),  # two nodes, one rank each: hybrid
    (["n0", "n1"], False, False),  # the setting overrides the layout
    (None, True, True),
])
def test_backend_passes_the_mode_of_the_layout_unless_set(nodes: Optional[list[str]], setting: Optional[bool],
                                                          expected: bool) -> None:
    """The mode reaches DeepEP's constructor; hybrid mode, which has never run on a GPU, is warned about."""
    assert run_distributed(_backend_mode, 2, nodes, setting) == [(expected, expected)] * 2
