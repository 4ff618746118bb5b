"""How the ranks of a group learn of each other's failures, and the small collectives and waits that watch for them.

A rank that fails in a dispatch or combine (forward or backward) or a buffer build leaves its error in the rendezvous
store, scoped to the call (:class:`GroupCall`, :func:`announce_failure`); every path that communicates passes its
errors through :func:`peer_failure`, which names the peers' announced errors, so a peer whose wait fails (DeepEP's
timeout, a closed connection) raises naming the rank that failed first and its error. Collectives over CPU (gloo)
groups also watch the store while they wait (:func:`run_collective`): a peer raises within milliseconds of the failure
instead of at the group's timeout. Builds are counted per group (:func:`begin_build`), so a rank that waits at a build
its peers did not need is seen by them the same way (:func:`pending_builds`).
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepepv2.groups import AgreedField, GroupState, collective_device, group_size, state_of


def all_reduce_max(values: Sequence[int], group: dist.ProcessGroup) -> list[int]:
    """Element-wise maximum of integer vectors over ``group`` (one small all-reduce, a host sync).

    Args:
        values: This rank's integers; every rank passes the same length.
        group: Process group.

    Returns:
        The element-wise maxima, the same on every rank.

    Raises:
        PeerFailure: A peer failed in the current call instead of joining (CPU groups, see :func:`run_collective`).
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    run_collective(dist.all_reduce, tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def all_gather_ints(values: Sequence[int], group: dist.ProcessGroup) -> list[list[int]]:
    """Every rank's integer vector (one small all-gather, a host sync); every rank passes the same length.

    Returns:
        One list per rank of ``group``, in group-rank order.
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    gathered = [torch.empty_like(tensor) for _ in range(group_size(group))]
    run_collective(dist.all_gather, gathered, tensor, group=group)
    return [t.tolist() for t in gathered]


_FAILURE_PREFIX = "megatron_deepepv2/failure"
_RENDEZVOUS_PREFIX = "megatron_deepepv2/rendezvous"
_BUILD_REASON_PREFIX = "megatron_deepepv2/build"
#: How long a polling wait first blocks on the collective before it looks at the store, and the longest it blocks
#: between two looks (the interval doubles): a collective that completes in time costs no store access at all.
_FIRST_POLL_S, _LONGEST_POLL_S = 0.002, 0.05
#: The first sleep of a rendezvous between two reads of the arrivals (doubling as a collective's slices do).
_FIRST_RENDEZVOUS_S = 0.0005


class GroupCall:
    """The context of every dispatch or combine call on a group, forward or backward: entering it counts the call (the
    ranks of a group make the same calls in the same order, so the count names a call alike on every rank; a failure
    announcement carries it, and a peer reads only the announcements of the call it failed in), and an error raised in
    the block passes through :func:`peer_failure` (the one attribution of failures). One per group
    (:func:`group_call`), entered again by each call; it keeps no state of its own.

    Args:
        group: The expert-parallel group.
        state: The group's state.
    """

    __slots__ = ("group", "state")

    def __init__(self, group: dist.ProcessGroup, state: GroupState) -> None:
        self.group, self.state = group, state

    def __enter__(self) -> "GroupCall":
        self.state.calls += 1
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        if error is not None and isinstance(error, Exception):
            attributed = peer_failure(error, self.group)
            if attributed is not error:
                raise attributed from error


def group_call(group: dist.ProcessGroup) -> GroupCall:
    """Returns the :class:`GroupCall` of ``group`` (made once, kept in the group's state)."""
    state = state_of(group)
    if state.call is None:
        state.call = GroupCall(group, state)
    return state.call


def _store() -> Optional[dist.Store]:
    try:
        return dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already has
    except (RuntimeError, ValueError, AttributeError):
        return None


def _group_tag(group: dist.ProcessGroup) -> str:
    return ",".join(map(str, dist.get_process_group_ranks(group)))


def _call_flag(group: dist.ProcessGroup) -> str:
    """The store key that exists once any rank of ``group`` announced a failure in the current call."""
    return f"{_FAILURE_PREFIX}/{_group_tag(group)}/call-{state_of(group).calls}"


class PeerFailure(RuntimeError):
    """Raised on a rank whose peers failed in the current call, or wait for it at a buffer build it did not start.

    The message names each such rank and its error; the peers raise their own errors. After a failure in the middle
    of a call the ranks no longer make the same collectives, so the group cannot be used further in this process.

    Attributes:
        causes: Global rank -> ``"Type: message"`` of the peers that failed first in this call.
        consequences: Global rank -> message of the peers that stopped because of another rank.
        waiting: Global rank -> why that peer waits at a buffer build this rank did not start.
    """

    def __init__(self, message: str, causes: dict[int, str], consequences: dict[int, str],
                 waiting: dict[int, str]) -> None:
        super().__init__(message)
        self.causes, self.consequences, self.waiting = causes, consequences, waiting


#: Set on an error whose cause is settled (announced by this rank, or raised by every rank together):
#: :func:`peer_failure` passes it through unchanged.
_ATTRIBUTED = "_megatron_deepepv2_attributed"


def _settle(error: BaseException) -> BaseException:
    try:
        setattr(error, _ATTRIBUTED, True)
    except AttributeError:  # an exception type without a __dict__: attributed again where it passes
        pass
    return error


def agreed(error: BaseException) -> BaseException:
    """Marks ``error`` as raised by every rank of the group together (after an agreement): :func:`peer_failure`
    passes it through unchanged. Returns ``error``."""
    return _settle(error)


def announce_failure(group: dist.ProcessGroup, error: BaseException, *, consequence: bool = False,
                     interrupt: bool = True) -> None:
    """Leaves this rank's error where the other ranks of ``group`` can read it (the rendezvous store).

    A peer waiting in a collective of the same call over a CPU group sees it within milliseconds
    (:func:`run_collective`); a peer blocked elsewhere (a DeepEP kernel, an NCCL collective) names it when its own wait
    fails (:func:`peer_failure`). The announcement is scoped to the current call (see :class:`GroupCall`). Costs two
    store writes, on the error path only. ``error`` is marked settled: :func:`peer_failure` passes it through.

    Args:
        group: The group whose ranks should learn of the error.
        error: This rank's error.
        consequence: The error only follows from another rank's (peers then name that rank rather than this one).
        interrupt: Make peers that wait in a collective of this call stop waiting. False where every rank reaches
            the same collective anyway and reads the announcement after it (an agreement of errors).
    """
    _settle(error)
    store = _store()
    if store is None:
        return
    try:
        store.set(f"{_FAILURE_PREFIX}/{_group_tag(group)}/{dist.get_rank()}",
                  f"{state_of(group).calls}|{'consequence' if consequence else 'cause'}|"
                  f"{type(error).__name__}: {error}")
        if interrupt:
            store.add(_call_flag(group), 1)
    except Exception:  # noqa: BLE001 - best effort: the error itself is raised by the caller
        pass


def _announcements(group: dist.ProcessGroup) -> tuple[dict[int, str], dict[int, str]]:
    """``(causes, consequences)`` the other ranks of ``group`` announced in this rank's current call."""
    store = _store()
    causes: dict[int, str] = {}
    consequences: dict[int, str] = {}
    if store is None:
        return causes, consequences
    tag, call = _group_tag(group), str(state_of(group).calls)
    for rank in dist.get_process_group_ranks(group):
        key = f"{_FAILURE_PREFIX}/{tag}/{rank}"
        try:
            if rank != dist.get_rank() and store.check([key]):
                announced_call, kind, message = store.get(key).decode(errors="replace").split("|", 2)
                if announced_call == call:
                    (consequences if kind == "consequence" else causes)[rank] = message
        except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
            break
    return causes, consequences


def announced_failures(group: dist.ProcessGroup) -> dict[int, str]:
    """The errors other ranks of ``group`` announced in this rank's current call (global rank -> message): the
    first failures, else (when only those are left) the ranks that stopped because of another.

    Announcements of other calls (an earlier, unrelated failure) are left out. Empty when none or unreachable.
    """
    causes, consequences = _announcements(group)
    return causes or consequences


def _rendezvous_key(group: dist.ProcessGroup, name: str) -> str:
    return f"{_RENDEZVOUS_PREFIX}/{_group_tag(group)}/{name}"


def begin_build(group: dist.ProcessGroup, reason: str) -> str:
    """Counts a collective buffer build on ``group`` and leaves ``reason`` for the peers; returns the name of the
    build's rendezvous point (the same on every rank), for :func:`rendezvous`.

    A peer that waits in a collective of ``group`` meanwhile (it did not need this build) reads ``reason`` and stops
    (see :func:`pending_builds`); one store write, at a build only.

    Args:
        group: The group building.
        reason: Why this rank builds, as a clause (e.g. "dispatches 20 tokens, more than the token limit 8").
    """
    state = state_of(group)
    state.builds += 1
    build = state.builds
    store = _store()
    if store is not None:
        try:
            store.set(f"{_BUILD_REASON_PREFIX}/{_group_tag(group)}/{build}/{dist.get_rank()}",
                      f"{state_of(group).calls}|{reason}")
        except Exception:  # noqa: BLE001 - best effort: the rendezvous says whether the ranks came
            pass
    return f"build-{build}"


def pending_builds(group: dist.ProcessGroup) -> dict[int, str]:
    """The peers of ``group`` waiting, in this rank's current call, at a buffer build this rank has not started
    (global rank -> their reason).

    The builds of a group are collective and counted alike on every rank, so a peer at build ``n + 1`` of this call
    while this rank has started ``n`` waits for this rank there: this rank did not need the build (its batch fit the
    token limit, or it dispatches another shape) and went on to communicate, where that peer will not join it. A peer at
    that build in a later call is left out: it has done its part of this rank's call.
    """
    store = _store()
    if store is None:
        return {}
    build = state_of(group).builds + 1
    call = str(state_of(group).calls)
    waiting = {}
    try:
        if not store.check([_rendezvous_key(group, f"build-{build}")]):
            return {}
        tag = _group_tag(group)
        for rank in dist.get_process_group_ranks(group):
            key = f"{_BUILD_REASON_PREFIX}/{tag}/{build}/{rank}"
            if rank != dist.get_rank() and store.check([key]):
                build_call, _, reason = store.get(key).decode(errors="replace").partition("|")
                if build_call == call:
                    waiting[rank] = reason
    except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
        return waiting
    return waiting


def _describe(peers: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in sorted(peers.items()))


def peer_failure(error: BaseException, group: dist.ProcessGroup) -> BaseException:
    """The error to raise for ``error`` in a dispatch or combine on ``group``: the one attribution of failures.

    Every path that communicates (buffer build, dispatch, combine, and the backward of each) passes its errors here.
    When peers announced a failure in this call, or wait at a build this rank did not start, the result is a
    :class:`PeerFailure` naming each and its error (this rank's own error follows it); this rank's error is then
    announced as their consequence. Otherwise this rank is the first to fail: its error is announced for the peers
    and returned unchanged. An error already settled -- a :class:`PeerFailure`, an error announced before
    (:func:`announce_failure`) or one every rank raises together (:func:`agreed`) -- is returned as it is, so that
    nested callers may each pass errors here.

    Args:
        error: What this rank's call raised.
        group: The expert-parallel group of the call.

    Returns:
        The exception to raise (``raise peer_failure(error, group) from error``).
    """
    if isinstance(error, PeerFailure) or getattr(error, _ATTRIBUTED, False):
        return error
    causes, consequences = _announcements(group)
    waiting = pending_builds(group)
    if not causes and not consequences and not waiting:
        announce_failure(group, error)
        return error
    announce_failure(group, error, consequence=True)
    named = causes or (consequences if not waiting else {})
    heads, details = [], []
    if named:
        heads.append(f"Rank(s) {sorted(named)} of the expert-parallel group failed in this call")
        details.append(f"Their errors: {_describe(named)}")
    if waiting:
        heads.append(f"Rank(s) {sorted(waiting)} of the expert-parallel group wait for this rank at a communication "
                     "buffer build that this rank did not need")
        details.append(f"Why they build: {_describe(waiting)}")
    return PeerFailure(f"{'; and '.join(heads)}; this rank stopped too ({type(error).__name__}: {error}). "
                       + " ".join(details), causes, consequences, waiting)


def _polls(group: dist.ProcessGroup) -> bool:
    """Whether collectives over ``group`` wait by polling the store: CPU (gloo) groups (asked once per group)."""
    state = state_of(group)
    if state.polled is None:
        state.polled = collective_device(group).type == "cpu"
    return state.polled


def run_collective(collective: Callable, *args, group: dist.ProcessGroup, exchange: bool = False, **kwargs) -> None:
    """Runs the ``torch.distributed`` function ``collective(*args, group=group, **kwargs)`` to completion.

    Over a CPU (gloo) group it is issued asynchronously and waited for in slices (2 ms, doubling to 50 ms); between
    slices the store is read for a peer's failure in the current call (:func:`announce_failure`) and, in an exchange,
    for a peer waiting at a build this rank did not start (:func:`pending_builds`); then a :class:`PeerFailure` naming
    them is raised within milliseconds, instead of waiting until the process group's timeout. A collective that
    completes within the first slice reads nothing. Over other groups (NCCL: the wait is the stream's, no host sync)
    ``collective`` runs as it is.

    Args:
        collective: A ``torch.distributed`` collective taking ``group`` and ``async_op``.
        *args: Its positional arguments.
        group: The process group.
        exchange: The collective is a dispatch's or combine's exchange: the call's buffer build, if any, is behind
            every rank that reaches it, so a peer at a build of this call is one this rank did not need. (Collectives
            before the build point, e.g. the agreement of ``validate``, leave this False: peers may be past them.)
        **kwargs: Its other keyword arguments.

    Raises:
        PeerFailure: A peer failed in this call, or waits at a build (the group is unusable after it).
        RuntimeError: The collective's own error (e.g. a peer's process exited).
    """
    if not _polls(group):
        collective(*args, group=group, **kwargs)
        return
    work = collective(*args, group=group, async_op=True, **kwargs)
    _wait_watching_peers(group, lambda slice_s: _waited(work, slice_s), _FIRST_POLL_S,
                         f"in {getattr(collective, '__name__', 'a collective')}; the expert-parallel group is unusable "
                         "in this process (end the run)", with_builds=exchange)


def _wait_watching_peers(group: dist.ProcessGroup, done: Callable[[float], bool], first_slice_s: float, where: str, *,
                         with_builds: bool = False, deadline: Optional[float] = None) -> bool:
    """The one polling wait of the package: asks ``done(slice_s)`` until it is True, the slice doubling from
    ``first_slice_s`` to :data:`_LONGEST_POLL_S`; between two asks, reads the store for a peer's failure in the current
    call and, ``with_builds``, for a peer waiting at a build this rank did not start.

    Args:
        group: The process group waited on.
        done: Waits at most the given seconds; returns whether the awaited thing happened.
        first_slice_s: The first slice, in seconds.
        where: Where this rank waited, for the error (after "stopped waiting for them ").
        with_builds: Also stop for a peer at a build (:func:`pending_builds`).
        deadline: A ``time.monotonic()`` after which the wait gives up; None: no limit.

    Returns:
        True once ``done``; False when ``deadline`` passed first.

    Raises:
        PeerFailure: A peer failed in this call, or waits at a build (``with_builds``).
    """
    store = _store()
    slice_s = first_slice_s
    while not done(slice_s):
        slice_s = min(2 * slice_s, _LONGEST_POLL_S)
        if store is not None:
            try:
                failed = store.check([_call_flag(group)])
                waiting = with_builds and not failed and pending_builds(group)
            except Exception:  # noqa: BLE001 - the store's host is gone: its process exits, which fails the wait
                store, failed, waiting = None, False, False
            if failed or waiting:
                raise peer_failure(RuntimeError(f"stopped waiting for them {where}"), group)
        if deadline is not None and time.monotonic() > deadline:
            return False
    return True


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


def rendezvous(group: dist.ProcessGroup, name: str, timeout_s: float) -> bool:
    """Waits until every rank of ``group`` reached the point called ``name`` (through the store, no collective).

    Args:
        group: The ranks that must arrive.
        name: The point, the same string on every rank (e.g. :func:`begin_build`'s).
        timeout_s: How long to wait.

    Returns:
        True when all arrived, False when ``timeout_s`` passed first (or True at once without a store).

    Raises:
        PeerFailure: A peer announced a failure in the current call (it will not come).
    """
    store = _store()
    if store is None:
        return True
    key, size = _rendezvous_key(group, name), group_size(group)
    arrived = store.add(key, 1)

    def everyone_arrived(slice_s: float) -> bool:
        nonlocal arrived
        if arrived < size:
            time.sleep(slice_s)
            arrived = store.add(key, 0)
        return arrived >= size

    return arrived >= size or _wait_watching_peers(group, everyone_arrived, _FIRST_RENDEZVOUS_S,
                                                   f"at the rendezvous '{name}'", deadline=time.monotonic() + timeout_s)


def raise_on_every_rank(problem: Optional[Exception], group: dist.ProcessGroup, *, agree: bool, num_tokens: int = 0,
                        fields: Sequence[AgreedField] = (), values: Sequence[int] = (),
                        purpose: str = "dispatch inputs") -> int:
    """Raises ``problem``; with ``agree``, first makes every rank of ``group`` raise together.

    With ``agree`` this is collective: one small all-reduce (error flags, token count, range of each agreed value),
    plus an all-gather only when values differ. Without it, ``problem`` is announced to the peers, then raised.

    Args:
        problem: This rank's problem, or None.
        group: The process group of the call.
        agree: Share the outcome over ``group``.
        num_tokens: This rank's token count (maximised over the group).
        fields: What every rank must share (a table such as
            :data:`~megatron_deepepv2.backends.base.BUILD_AGREEMENT`), the same on every rank.
        values: This rank's value of each of ``fields``, as :meth:`AgreedField.encode` gives them (ignored on a rank
            with a problem, which sends zeros).
        purpose: What the values are of, for the message ("dispatch inputs", "buffer builds").

    Returns:
        The largest token count over the group (``num_tokens`` itself without ``agree``).

    Raises:
        TypeError, ValueError: ``problem``; with ``agree``, on the other ranks a ValueError naming each rank that had
            one and its error, or each rank's differing values; each marked by :func:`agreed`.
    """
    if not agree:
        if problem is not None:
            announce_failure(group, problem)  # for the peers, whose next collective fails without this rank
            raise problem
        return num_tokens
    world, rank = group_size(group), dist.get_rank(group)
    flags = [0] * world
    flags[rank] = int(problem is not None)
    values = [0] * len(fields) if problem is not None else list(values)
    if problem is not None:  # before the all-reduce, so that every peer can read it once the flags arrive
        announce_failure(group, problem, interrupt=False)
    outcome = all_reduce_max(flags + [num_tokens] + values + [-value for value in values], group)
    if problem is not None:
        raise agreed(problem)
    if any(outcome[:world]):
        raise agreed(_rejected_by_peers([r for r in range(world) if outcome[r]], group))
    count = len(values)
    highs, lows = outcome[world + 1:world + 1 + count], [-v for v in outcome[world + 1 + count:]]
    if highs != lows:
        raise agreed(_differing_values(fields, values, highs, lows, group, purpose))
    return outcome[world]


def _rejected_by_peers(failed_group_ranks: list[int], group: dist.ProcessGroup) -> ValueError:
    """The error of a rank whose inputs were valid, for the peers (group ranks ``failed_group_ranks``) whose were
    not."""
    ranks = dist.get_process_group_ranks(group)
    failed = [ranks[r] for r in failed_group_ranks]
    errors = announced_failures(group)
    said = "; ".join(f"rank {r}: {errors[r]}" for r in failed if r in errors)
    unsaid = [r for r in failed if r not in errors]
    if unsaid:  # the store could not be read: the errors are only on those ranks
        said += f"{'; ' if said else ''}rank(s) {unsaid}: their error is raised there"
    return ValueError(f"Rank(s) {failed} of the expert-parallel group rejected their dispatch or combine inputs "
                      f"({said}); this rank's inputs were valid but it stops too instead of waiting.")


def _differing_values(fields: Sequence[AgreedField], values: list[int], highs: list[int], lows: list[int],
                      group: dist.ProcessGroup, purpose: str) -> ValueError:
    """The error of ranks whose agreed values differ: each rank's differing values, gathered (one all-gather)."""
    differing = [i for i, (high, low) in enumerate(zip(highs, lows)) if high != low]
    ranks = dist.get_process_group_ranks(group)
    every = all_gather_ints(values, group)
    described = "; ".join(f"rank {ranks[r]}: " + ", ".join(f"{fields[i].name} {fields[i].words(every[r][i])}"
                                                          for i in differing) for r in range(len(ranks)))
    return ValueError(
        f"The ranks of the expert-parallel group have {purpose} whose {', '.join(fields[i].name for i in differing)} "
        f"differ ({described}). Every rank must have the same {', '.join(field.name for field in fields)}: they fix "
        "the layout of the exchange. Give every rank the same model configuration and settings.")
