"""How a rank learns of its peers' failures, and says what failed: the one attribution of errors.

A rank that fails in a dispatch or combine (forward or backward) or a buffer build leaves its error in the rendezvous
store, scoped to the call (:class:`GroupCall`, :func:`announce_failure`); every path that communicates passes its
errors through :func:`peer_failure`, which names the peers' announced errors, so a peer whose wait fails (DeepEP's
timeout, a closed connection) raises naming the rank that failed first and its error. Builds are counted per group
(:func:`begin_build`), so a rank that waits at a build its peers did not need is seen by them the same way
(:func:`pending_builds`). :func:`wait_watching_peers` is the one wait that reads these announcements while it waits;
the collectives and the rendezvous that use it are :mod:`megatron_deepepv2.agreement`'s.

Every function takes the group's :class:`~megatron_deepepv2.groups.GroupState` (its ranks, its name in the store, its
call and build counters), which the caller holds: nothing here looks a group up.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron_deepepv2.groups import GroupState

_FAILURE_PREFIX = "megatron_deepepv2/failure"
_RENDEZVOUS_PREFIX = "megatron_deepepv2/rendezvous"
_BUILD_REASON_PREFIX = "megatron_deepepv2/build"
#: The longest a polling wait blocks between two looks at the store (the interval doubles up to it).
_LONGEST_POLL_S = 0.05


class GroupCall:
    """The context of every dispatch or combine call on a group, forward or backward: entering it counts the call (the
    ranks of a group make the same calls in the same order, so the count names a call alike on every rank; a failure
    announcement carries it, and a peer reads only the announcements of the call it failed in), and an error raised in
    the block passes through :func:`peer_failure` (the one attribution of failures). One per group, made with its
    state (:attr:`GroupState.call <megatron_deepepv2.groups.GroupState>`, the one way to it), entered again by each
    call; it keeps no state of its own.

    Args:
        state: The group's state.
    """

    __slots__ = ("state",)

    def __init__(self, state: GroupState) -> None:
        self.state = state

    def __enter__(self) -> "GroupCall":
        self.state.calls += 1
        return self

    def __exit__(self, kind: Any, error: Optional[BaseException], traceback: Any) -> None:
        if error is not None and isinstance(error, Exception):
            attributed = peer_failure(error, self.state)
            if attributed is not error:
                raise attributed from error


def store() -> Optional[dist.Store]:
    """The rendezvous store every rank already has, or None (no default group)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _call_flag(state: GroupState) -> str:
    """The store key that exists once any rank of the group announced a failure in the current call."""
    return f"{_FAILURE_PREFIX}/{state.tag}/call-{state.calls}"


def rendezvous_key(state: GroupState, name: str) -> str:
    """The store key counting the ranks of the group that arrived at the point ``name``."""
    return f"{_RENDEZVOUS_PREFIX}/{state.tag}/{name}"


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


def settled(error: BaseException) -> BaseException:
    """Marks ``error`` as settled -- raised by every rank of the group together (after an agreement), or announced
    by this rank: :func:`peer_failure` passes it through unchanged. Returns ``error``."""
    try:
        setattr(error, _ATTRIBUTED, True)
    except AttributeError:  # an exception type without a __dict__: attributed again where it passes
        pass
    return error


def announce_failure(state: GroupState, error: BaseException, *, consequence: bool = False,
                     interrupt: bool = True) -> None:
    """Leaves this rank's error where the other ranks of the group can read it (the rendezvous store).

    A peer waiting in a collective of the same call over a CPU group sees it within milliseconds
    (:func:`wait_watching_peers`); a peer blocked elsewhere (a DeepEP kernel, an NCCL collective) names it when its own
    wait fails (:func:`peer_failure`). The announcement is scoped to the current call (see :class:`GroupCall`). Costs
    two store writes, on the error path only. ``error`` is marked settled: :func:`peer_failure` passes it through.

    Args:
        state: The state of the group whose ranks should learn of the error.
        error: This rank's error.
        consequence: The error only follows from another rank's (peers then name that rank rather than this one).
        interrupt: Make peers that wait in a collective of this call stop waiting. False where every rank reaches
            the same collective anyway and reads the announcement after it (an agreement of errors).
    """
    settled(error)
    rendezvous_store = store()
    if rendezvous_store is None:
        return
    try:
        rendezvous_store.set(f"{_FAILURE_PREFIX}/{state.tag}/{dist.get_rank()}",
                             f"{state.calls}|{'consequence' if consequence else 'cause'}|"
                             f"{type(error).__name__}: {error}")
        if interrupt:
            rendezvous_store.add(_call_flag(state), 1)
    except Exception:  # noqa: BLE001 - best effort: the error itself is raised by the caller
        pass


def _announcements(state: GroupState) -> tuple[dict[int, str], dict[int, str]]:
    """``(causes, consequences)`` the other ranks of the group announced in this rank's current call."""
    rendezvous_store = store()
    causes: dict[int, str] = {}
    consequences: dict[int, str] = {}
    if rendezvous_store is None:
        return causes, consequences
    call, me = str(state.calls), dist.get_rank()
    for rank in state.ranks:
        key = f"{_FAILURE_PREFIX}/{state.tag}/{rank}"
        try:
            if rank != me and rendezvous_store.check([key]):
                announced_call, kind, message = rendezvous_store.get(key).decode(errors="replace").split("|", 2)
                if announced_call == call:
                    (consequences if kind == "consequence" else causes)[rank] = message
        except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
            break
    return causes, consequences


def announced_failures(state: GroupState) -> dict[int, str]:
    """The errors other ranks of the group announced in this rank's current call (global rank -> message): the
    first failures, else (when only those are left) the ranks that stopped because of another.

    Announcements of other calls (an earlier, unrelated failure) are left out. Empty when none or unreachable.
    """
    causes, consequences = _announcements(state)
    return causes or consequences


def begin_build(state: GroupState, reason: str) -> str:
    """Counts a collective buffer build on the group and leaves ``reason`` for the peers; returns the name of the
    build's rendezvous point (the same on every rank), for :func:`~megatron_deepepv2.agreement.rendezvous`.

    A peer that waits in a collective of the group meanwhile (it did not need this build) reads ``reason`` and stops
    (see :func:`pending_builds`); one store write, at a build only.

    Args:
        state: The state of the group building.
        reason: Why this rank builds, as a clause (e.g. "dispatches 20 tokens, more than the token limit 8").
    """
    state.builds += 1
    rendezvous_store = store()
    if rendezvous_store is not None:
        try:
            rendezvous_store.set(f"{_BUILD_REASON_PREFIX}/{state.tag}/{state.builds}/{dist.get_rank()}",
                                 f"{state.calls}|{reason}")
        except Exception:  # noqa: BLE001 - best effort: the rendezvous says whether the ranks came
            pass
    return f"build-{state.builds}"


def pending_builds(state: GroupState) -> dict[int, str]:
    """The peers of the group waiting, in this rank's current call, at a buffer build this rank has not started
    (global rank -> their reason).

    The builds of a group are collective and counted alike on every rank, so a peer at build ``n + 1`` of this call
    while this rank has started ``n`` waits for this rank there: this rank did not need the build (its batch fit the
    token limit, or it dispatches another shape) and went on to communicate, where that peer will not join it. A peer at
    that build in a later call is left out: it has done its part of this rank's call.
    """
    rendezvous_store = store()
    if rendezvous_store is None:
        return {}
    build, call, me = state.builds + 1, str(state.calls), dist.get_rank()
    waiting = {}
    try:
        if not rendezvous_store.check([rendezvous_key(state, f"build-{build}")]):
            return {}
        for rank in state.ranks:
            key = f"{_BUILD_REASON_PREFIX}/{state.tag}/{build}/{rank}"
            if rank != me and rendezvous_store.check([key]):
                build_call, _, reason = rendezvous_store.get(key).decode(errors="replace").partition("|")
                if build_call == call:
                    waiting[rank] = reason
    except Exception:  # noqa: BLE001 - the store's host may be the rank that failed
        return waiting
    return waiting


def _describe(peers: dict[int, str]) -> str:
    return "; ".join(f"rank {rank}: {message}" for rank, message in sorted(peers.items()))


def peer_failure(error: BaseException, state: GroupState) -> BaseException:
    """The error to raise for ``error`` in a dispatch or combine on the group: the one attribution of failures.

    Every path that communicates (buffer build, dispatch, combine, and the backward of each) passes its errors here.
    When peers announced a failure in this call, or wait at a build this rank did not start, the result is a
    :class:`PeerFailure` naming each and its error (this rank's own error follows it); this rank's error is then
    announced as their consequence. Otherwise this rank is the first to fail: its error is announced for the peers
    and returned unchanged. An error already settled -- a :class:`PeerFailure`, an error announced before
    (:func:`announce_failure`) or one every rank raises together (:func:`settled`) -- is returned as it is, so that
    nested callers may each pass errors here.

    Args:
        error: What this rank's call raised.
        state: The state of the call's expert-parallel group.

    Returns:
        The exception to raise (``raise peer_failure(error, state) from error``).
    """
    if isinstance(error, PeerFailure) or getattr(error, _ATTRIBUTED, False):
        return error
    causes, consequences = _announcements(state)
    waiting = pending_builds(state)
    if not causes and not consequences and not waiting:
        announce_failure(state, error)
        return error
    announce_failure(state, error, consequence=True)
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


def wait_watching_peers(state: GroupState, done: Callable[[float], bool], first_slice_s: float, where: str, *,
                        with_builds: bool = False, deadline: Optional[float] = None) -> bool:
    """The one polling wait of the package: asks ``done(slice_s)`` until it is True, the slice doubling from
    ``first_slice_s`` to :data:`_LONGEST_POLL_S`; between two asks, reads the store for a peer's failure in the current
    call and, ``with_builds``, for a peer waiting at a build this rank did not start.

    Args:
        state: The state of the group waited on.
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
    rendezvous_store = store()
    slice_s = first_slice_s
    while not done(slice_s):
        slice_s = min(2 * slice_s, _LONGEST_POLL_S)
        if rendezvous_store is not None:
            try:
                failed = rendezvous_store.check([_call_flag(state)])
                waiting = with_builds and not failed and pending_builds(state)
            except Exception:  # noqa: BLE001 - the store's host is gone: its process exits, which fails the wait
                rendezvous_store, failed, waiting = None, False, False
            if failed or waiting:
                raise peer_failure(RuntimeError(f"stopped waiting for them {where}"), state)
        if deadline is not None and time.monotonic() > deadline:
            return False
    return True
