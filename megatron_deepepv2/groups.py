"""What this process keeps per ``torch.distributed`` process group: its :class:`GroupState`, one per group.

A group's state is made on first use by :func:`state_of` and holds every per-group fact and record of the package:
its size, rank and ranks (asked once: each call costs tens of microseconds), whether its collectives poll the store,
the call and build counters that scope failure announcements and the group's
:class:`~megatron_deepepv2.failures.GroupCall` (:mod:`megatron_deepepv2.failures`), its buffers in use and retired
(:mod:`megatron_deepepv2.buffers`), the dispatch bindings made on it and the inputs whose checks passed
(:mod:`megatron_deepepv2.ops`) and the node identity of its ranks (:mod:`megatron_deepepv2.backends.deepep.topology`).
Nothing else in the package keeps a dictionary keyed by process group; the functions that need a group's state take
the state itself, not the group, so that it is looked up once per call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.failures import GroupCall


@dataclass(eq=False)
class GroupState:
    """This process's state of one process group.

    Attributes:
        group: The process group.
        size: ``dist.get_world_size(group)``.
        rank: This process's rank in the group, ``dist.get_rank(group)``.
        ranks: The global rank of each group rank, ``dist.get_process_group_ranks(group)``.
        polled: Whether its collectives wait by polling the store (CPU groups: their tensors live on the CPU).
        calls: Dispatch and combine calls (forward or backward) started on the group; the ranks make the same calls in
            the same order, so the count names a call alike on every rank (failure announcements carry it).
        builds: Collective buffer builds started on the group, the same count on every rank while they build together.
        buffers: The buffer in use per (backend name, :attr:`~megatron_deepepv2.backends.base.BufferSpec.key`).
        retired: Buffers superseded by a rebuild, in retirement order, kept while a dispatch handle uses them.
        bindings: The :class:`~megatron_deepepv2.ops.DispatchBinding` made per (configuration, number of experts).
        checked_inputs: The one memo of inputs whose static checks passed on the group, by (configuration,
            signature): a dispatch's maps to the buffer spec it leases with, a combine's to True.
        node_ids: The node identity of each group rank, in group-rank order; None until gathered.
        call: The group's :class:`~megatron_deepepv2.failures.GroupCall`, the context of every call on it: the one
            way to it.
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    ranks: tuple[int, ...]
    polled: bool
    calls: int = 0
    builds: int = 0
    buffers: dict[tuple, Any] = field(default_factory=dict)
    retired: list[Any] = field(default_factory=list)
    bindings: dict[tuple, Any] = field(default_factory=dict)
    checked_inputs: dict[tuple, Any] = field(default_factory=dict)
    node_ids: Optional[tuple[str, ...]] = None
    call: GroupCall = field(init=False)
    tag: str = field(init=False)  #: the group's name in the rendezvous store's keys: its ranks

    def __post_init__(self) -> None:
        self.call, self.tag = GroupCall(self), ",".join(map(str, self.ranks))


#: The state of each process group this process has used.
_states: dict[dist.ProcessGroup, GroupState] = {}


def state_of(group: dist.ProcessGroup) -> GroupState:
    """Returns the :class:`GroupState` of ``group``, made on first use (one dictionary lookup after that).

    Args:
        group: A process group this rank belongs to.
    """
    state = _states.get(group)
    if state is None:
        state = _states[group] = GroupState(group=group, size=dist.get_world_size(group), rank=dist.get_rank(group),
                                            ranks=tuple(dist.get_process_group_ranks(group)),
                                            polled=collective_device(group).type == "cpu")
    return state


def known_states() -> list[GroupState]:
    """Returns the state of each process group this process has used, in the order they were first used."""
    return list(_states.values())


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Returns the device whose tensors collectives over ``group`` take (CUDA for NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def next_power_of_two(value: int) -> int:
    """Returns the smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()
