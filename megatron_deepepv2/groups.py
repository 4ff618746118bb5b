"""What this process keeps per ``torch.distributed`` process group, and what the ranks of a group agree on.

:class:`AgreedField` is one value every rank of a group must share; tables of them say what a buffer build
(:data:`~megatron_deepepv2.backends.base.BUILD_AGREEMENT`) and a validated dispatch
(:data:`~megatron_deepepv2.validation.DISPATCH_AGREEMENT`) agree on, and
:func:`~megatron_deepepv2.failures.raise_on_every_rank` runs the agreement.

A group's state is made on first use by :func:`state_of` and holds every per-group fact and record of the package:
its size (asked once: the call costs tens of microseconds), the call and build counters that scope failure
announcements (:mod:`megatron_deepepv2.failures`), its buffers in use and retired (:mod:`megatron_deepepv2.buffers`),
the dispatchers bound on it and the inputs whose checks passed (:mod:`megatron_deepepv2.ops`) and the node identity of
its ranks (:mod:`megatron_deepepv2.backends.deepep.topology`). Nothing else in the package keeps a dictionary keyed by
process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist


@dataclass(eq=False)
class GroupState:
    """This process's state of one process group.

    Attributes:
        size: ``dist.get_world_size(group)``.
        calls: Dispatch and combine calls (forward or backward) started on the group; the ranks make the same calls in
            the same order, so the count names a call alike on every rank (failure announcements carry it).
        builds: Collective buffer builds started on the group, the same count on every rank while they build together.
        polled: Whether its collectives wait by polling the store (CPU groups); None until first asked.
        buffers: The buffer in use per (backend name, :attr:`~megatron_deepepv2.backends.base.BufferSpec.key`).
        retired: Buffers superseded by a rebuild, in retirement order, kept while a dispatch handle uses them.
        dispatchers: The :class:`~megatron_deepepv2.ops.Dispatcher` bound per (configuration, number of experts).
        checked_inputs: The one memo of inputs whose static checks passed on the group, by (configuration,
            signature): a dispatch's maps to the buffer spec it leases with, a combine's to True.
        node_ids: The node identity of each group rank, in group-rank order; None until gathered.
        call: The group's :class:`~megatron_deepepv2.failures.GroupCall`, made on first use.
    """

    size: int
    calls: int = 0
    builds: int = 0
    polled: Optional[bool] = None
    buffers: dict[tuple, Any] = field(default_factory=dict)
    retired: list[Any] = field(default_factory=list)
    dispatchers: dict[tuple, Any] = field(default_factory=dict)
    checked_inputs: dict[tuple, Any] = field(default_factory=dict)
    node_ids: Optional[tuple[str, ...]] = None
    call: Any = None


@dataclass(frozen=True)
class AgreedField:
    """One value every rank of a group must share, read off a subject (a :class:`BufferSpec`, or a dispatch's
    inputs), sent as an integer in the agreement and described in words in its error.

    Attributes:
        name: The value's name in messages (``"hidden size"``).
        read: The value of a subject: an int, a bool or None.
        words: An agreed integer in words (default: the number).
    """

    name: str
    read: Callable[[Any], Any]
    words: Callable[[int], str] = str

    def encode(self, subject: Any) -> int:
        """The integer the ranks agree on for ``subject``'s value: None is -1, a bool 0 or 1."""
        value = self.read(subject)
        return -1 if value is None else int(value)


def yes_no(value: int) -> str:
    """An agreed optional bool in words: ``auto`` (None), ``yes`` or ``no``."""
    return "auto" if value < 0 else "yes" if value else "no"


#: The state of each process group this process has used.
_states: dict[dist.ProcessGroup, GroupState] = {}


def state_of(group: dist.ProcessGroup) -> GroupState:
    """Returns the :class:`GroupState` of ``group``, made on first use (one dictionary lookup after that).

    Args:
        group: A process group this rank belongs to.
    """
    state = _states.get(group)
    if state is None:
        state = _states[group] = GroupState(size=dist.get_world_size(group))
    return state


def known_groups() -> list[dist.ProcessGroup]:
    """Returns the process groups that have a state, in the order they were first used."""
    return list(_states)


def group_size(group: dist.ProcessGroup) -> int:
    """Returns the number of ranks of ``group`` (asked of ``torch.distributed`` once per group)."""
    return state_of(group).size


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Returns the device whose tensors collectives over ``group`` take (CUDA for NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def next_power_of_two(value: int) -> int:
    """Returns the smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()
