"""What the ranks of a group agree on, and how they agree: the one module of the agreement across ranks.

:class:`AgreedField` is one value every rank of a group must share; tables of them say what a buffer build
(:data:`~megatron_deepepv2.backends.base.BUILD_AGREEMENT`, and a backend's ``extra_agreement``) and a validated
dispatch (:data:`DISPATCH_AGREEMENT`, read off a :class:`DispatchFacts`) agree on, and :func:`raise_on_every_rank`
runs either. The small collectives an agreement runs through are here too: :func:`all_reduce_max`,
:func:`all_gather_ints`, :func:`run_collective` (which over CPU groups stops for a peer's announced failure,
:mod:`megatron_deepepv2.failures`) and the store's :func:`rendezvous`. Every function takes the group's
:class:`~megatron_deepepv2.groups.GroupState`, which the caller holds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepepv2.failures import (announce_failure, announced_failures, rendezvous_key, settled,
                                        store, wait_watching_peers)

if TYPE_CHECKING:
    from megatron_deepepv2.groups import GroupState

#: How long a polling collective first blocks before it looks at the store: one that completes in time reads nothing.
_FIRST_POLL_S = 0.002
#: The first sleep of a rendezvous between two reads of the arrivals (doubling as a collective's slices do).
_FIRST_RENDEZVOUS_S = 0.0005


@dataclass(frozen=True)
class AgreedField:
    """One value every rank of a group must share, read off a subject (a :class:`BufferSpec`, or a dispatch's
    :class:`DispatchFacts`), sent as an integer in the agreement and described in words in its error.

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


class DispatchFacts(NamedTuple):
    """What one rank's dispatch with ``validate`` agrees on over the group (:data:`DISPATCH_AGREEMENT`): what fixes
    the layout of the exchange."""

    dtype: torch.dtype
    hidden: int
    num_topk: int
    fp8: bool
    num_sms: int


#: dtypes by a small code, for the agreement of the ranks (0: any other dtype).
_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def _dtype_words(code: int) -> str:
    """The dtype an agreed code (:data:`DISPATCH_AGREEMENT`) stands for, for a message."""
    return str(_DTYPE_CODES[code - 1]).removeprefix("torch.") if 0 < code <= len(_DTYPE_CODES) else "another"


#: What the ranks of a group agree on at every dispatch with ``validate``, read off each rank's
#: :class:`DispatchFacts` (a buffer build agrees on its own table,
#: :data:`~megatron_deepepv2.backends.base.BUILD_AGREEMENT`).
DISPATCH_AGREEMENT: tuple[AgreedField, ...] = (
    AgreedField("dtype", lambda facts: _DTYPE_CODES.index(facts.dtype) + 1 if facts.dtype in _DTYPE_CODES else 0,
                _dtype_words),
    AgreedField("hidden size", lambda facts: facts.hidden),
    AgreedField("top-k", lambda facts: facts.num_topk),
    AgreedField("FP8", lambda facts: facts.fp8, lambda value: "yes" if value else "no"),
    AgreedField("SM count", lambda facts: facts.num_sms),
)


def all_reduce_max(values: Sequence[int], state: GroupState) -> list[int]:
    """Element-wise maximum of integer vectors over the group (one small all-reduce, a host sync).

    Args:
        values: This rank's integers; every rank passes the same length.
        state: The group's state.

    Returns:
        The element-wise maxima, the same on every rank.

    Raises:
        PeerFailure: A peer failed in the current call instead of joining (CPU groups, see :func:`run_collective`).
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device="cpu" if state.polled else "cuda")
    run_collective(dist.all_reduce, tensor, op=dist.ReduceOp.MAX, state=state)
    return tensor.tolist()


def all_gather_ints(values: Sequence[int], state: GroupState) -> list[list[int]]:
    """Every rank's integer vector (one small all-gather, a host sync); every rank passes the same length.

    Returns:
        One list per rank of the group, in group-rank order.
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device="cpu" if state.polled else "cuda")
    gathered = [torch.empty_like(tensor) for _ in range(state.size)]
    run_collective(dist.all_gather, gathered, tensor, state=state)
    return [t.tolist() for t in gathered]


def run_collective(collective: Callable, *args, state: GroupState, exchange: bool = False, **kwargs) -> None:
    """Runs the ``torch.distributed`` function ``collective(*args, group=state.group, **kwargs)`` to completion.

    Over a CPU (gloo) group it is issued asynchronously and waited for in slices (2 ms, doubling to 50 ms); between
    slices the store is read for a peer's failure in the current call and, in an exchange, for a peer waiting at a
    build this rank did not start (:func:`~megatron_deepepv2.failures.wait_watching_peers`); then a PeerFailure naming
    them is raised within milliseconds, instead of waiting until the process group's timeout. A collective that
    completes within the first slice reads nothing. Over other groups (NCCL: the wait is the stream's, no host sync)
    ``collective`` runs as it is.

    Args:
        collective: A ``torch.distributed`` collective taking ``group`` and ``async_op``.
        *args: Its positional arguments.
        state: The state of the process group.
        exchange: The collective is a dispatch's or combine's exchange: the call's buffer build, if any, is behind
            every rank that reaches it, so a peer at a build of this call is one this rank did not need. (Collectives
            before the build point, e.g. the agreement of ``validate``, leave this False: peers may be past them.)
        **kwargs: Its other keyword arguments.

    Raises:
        PeerFailure: A peer failed in this call, or waits at a build (the group is unusable after it).
        RuntimeError: The collective's own error (e.g. a peer's process exited).
    """
    if not state.polled:
        collective(*args, group=state.group, **kwargs)
        return
    work = collective(*args, group=state.group, async_op=True, **kwargs)
    wait_watching_peers(state, lambda slice_s: _waited(work, slice_s), _FIRST_POLL_S,
                        f"in {getattr(collective, '__name__', 'a collective')}; the expert-parallel group is unusable "
                        "in this process (end the run)", with_builds=exchange)


def _waited(work: dist.Work, timeout_s: float) -> bool:
    """Whether ``work`` completed within ``timeout_s`` (its own error, if it failed, is raised)."""
    try:
        work.wait(timedelta(seconds=timeout_s))
        return True
    except RuntimeError:
        if not work.is_completed():
            return False
    work.wait()  # completed with an error: raise it
    return True


def rendezvous(state: GroupState, name: str, timeout_s: float) -> bool:
    """Waits until every rank of the group reached the point called ``name`` (through the store, no collective).

    Args:
        state: The state of the group whose ranks must arrive.
        name: The point, the same string on every rank (e.g. :func:`~megatron_deepepv2.failures.begin_build`'s).
        timeout_s: How long to wait.

    Returns:
        True when all arrived, False when ``timeout_s`` passed first (or True at once without a store).

    Raises:
        PeerFailure: A peer announced a failure in the current call (it will not come).
    """
    rendezvous_store = store()
    if rendezvous_store is None:
        return True
    key = rendezvous_key(state, name)
    arrived = rendezvous_store.add(key, 1)

    def everyone_arrived(slice_s: float) -> bool:
        nonlocal arrived
        if arrived < state.size:
            time.sleep(slice_s)
            arrived = rendezvous_store.add(key, 0)
        return arrived >= state.size

    return arrived >= state.size or wait_watching_peers(state, everyone_arrived, _FIRST_RENDEZVOUS_S,
                                                        f"at the rendezvous '{name}'",
                                                        deadline=time.monotonic() + timeout_s)


def raise_on_every_rank(problem: Optional[Exception], state: GroupState, *, agree: bool, num_tokens: int = 0,
                        fields: Sequence[AgreedField] = (), values: Sequence[int] = (),
                        purpose: str = "dispatch inputs") -> int:
    """Raises ``problem``; with ``agree``, first makes every rank of the group raise together.

    With ``agree`` this is collective: one small all-reduce (error flags, token count, range of each agreed value),
    plus an all-gather only when values differ. Without it, ``problem`` is announced to the peers, then raised.

    Args:
        problem: This rank's problem, or None.
        state: The state of the call's process group.
        agree: Share the outcome over the group.
        num_tokens: This rank's token count (maximised over the group).
        fields: What every rank must share (a table such as :data:`DISPATCH_AGREEMENT`), the same on every rank.
        values: This rank's value of each of ``fields``, as :meth:`AgreedField.encode` gives them (ignored on a rank
            with a problem, which sends zeros).
        purpose: What the values are of, for the message ("dispatch inputs", "buffer builds").

    Returns:
        The largest token count over the group (``num_tokens`` itself without ``agree``).

    Raises:
        TypeError, ValueError: ``problem``; with ``agree``, on the other ranks a ValueError naming each rank that had
            one and its error, or each rank's differing values; each marked by
            :func:`~megatron_deepepv2.failures.settled`.
    """
    if not agree:
        if problem is not None:
            announce_failure(state, problem)  # for the peers, whose next collective fails without this rank
            raise problem
        return num_tokens
    world = state.size
    flags = [0] * world
    flags[state.rank] = int(problem is not None)
    values = [0] * len(fields) if problem is not None else list(values)
    if problem is not None:  # before the all-reduce, so that every peer can read it once the flags arrive
        announce_failure(state, problem, interrupt=False)
    outcome = all_reduce_max(flags + [num_tokens] + values + [-value for value in values], state)
    if problem is not None:
        raise settled(problem)
    if any(outcome[:world]):
        raise settled(_rejected_by_peers([r for r in range(world) if outcome[r]], state))
    count = len(values)
    highs, lows = outcome[world + 1:world + 1 + count], [-v for v in outcome[world + 1 + count:]]
    if highs != lows:
        raise settled(_differing_values(fields, values, highs, lows, state, purpose))
    return outcome[world]


def _rejected_by_peers(failed_group_ranks: list[int], state: GroupState) -> ValueError:
    """The error of a rank whose inputs were valid, for the peers (group ranks ``failed_group_ranks``) whose were
    not."""
    failed = [state.ranks[r] for r in failed_group_ranks]
    errors = announced_failures(state)
    said = "; ".join(f"rank {r}: {errors[r]}" for r in failed if r in errors)
    unsaid = [r for r in failed if r not in errors]
    if unsaid:  # the store could not be read: the errors are only on those ranks
        said += f"{'; ' if said else ''}rank(s) {unsaid}: their error is raised there"
    return ValueError(f"Rank(s) {failed} of the expert-parallel group rejected their dispatch or combine inputs "
                      f"({said}); this rank's inputs were valid but it stops too instead of waiting.")


def _differing_values(fields: Sequence[AgreedField], values: list[int], highs: list[int], lows: list[int],
                      state: GroupState, purpose: str) -> ValueError:
    """The error of ranks whose agreed values differ: each rank's differing values, gathered (one all-gather)."""
    differing = [i for i, (high, low) in enumerate(zip(highs, lows)) if high != low]
    ranks = state.ranks
    every = all_gather_ints(values, state)
    described = "; ".join(f"rank {ranks[r]}: " + ", ".join(f"{fields[i].name} {fields[i].words(every[r][i])}"
                                                          for i in differing) for r in range(len(ranks)))
    return ValueError(
        f"The ranks of the expert-parallel group have {purpose} whose {', '.join(fields[i].name for i in differing)} "
        f"differ ({described}). Every rank must have the same {', '.join(field.name for field in fields)}: they fix "
        "the layout of the exchange. Give every rank the same model configuration and settings.")
