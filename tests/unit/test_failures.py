"""A failure on one rank makes every peer raise within seconds, naming that rank and its error.

Each case injects an error on one rank (inside the spawned worker) at one communicating step -- the buffer build, the
forward dispatch and combine, and both backwards (dispatch's is a combine, combine's a cached dispatch) -- and checks
every other rank's error against it: its type, the failing rank, that rank's error text, and the time it took (far
below the process group's and the growth timeouts). Over the reference backend the peers wait in gloo collectives
that watch for announcements; over a stand-in whose peers wait without communicating and then raise a timeout, as a
DeepEP kernel does, the timeout surfaces naming the cause.
"""

from __future__ import annotations

import time
from typing import Callable

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2 import agreement, failures
from megatron_deepepv2.backends.reference import ReferenceBackend
from megatron_deepepv2.groups import state_of
from tests.distributed import run_distributed

T, H, E, K = 6, 8, 8, 2
#: Far above what any check here allows a peer: a peer that waited for a timeout fails the test by its time.
ENV = {"MEGATRON_DEEPEPV2_VALIDATE": "0", "MEGATRON_DEEPEPV2_GROWTH_TIMEOUT_S": "60"}
PEER_SECONDS = 5.0
#: The backend method each injection point runs in.
METHODS = {"build": "__init__", "dispatch": "dispatch", "combine": "combine", "dispatch_backward": "combine",
           "combine_backward": "cached_dispatch"}


class TimeoutStandIn(ReferenceBackend):
    """The reference backend under another name: a separate buffer whose methods a case replaces."""

    name = "timeout_stand_in"


def _inputs(rank: int, num_tokens: int = T):
    gen = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(num_tokens)])
    return torch.randn(num_tokens, H, generator=gen).requires_grad_(), idx, torch.rand(num_tokens, K, generator=gen)


def _install(cls: type, method: str, action: Callable[[object], None]) -> None:
    """Makes ``cls.method`` run ``action(group)`` first (in this process only: each rank is a process of its own)."""
    original = getattr(cls, method)

    def patched(self, *args, **kwargs):
        action(args[0].group if method == "__init__" else self.group)  # a build's first argument: the group's state
        return original(self, *args, **kwargs)

    setattr(cls, method, patched)


#: Store counter of the peers that entered the stand-in's method (:func:`_time_out`).
_IN_BACKEND = "test_failures/in_backend"


def _fail(where: str, peers_in_backend: int = 0) -> Callable[[object], None]:
    """The failing rank's injection; it first waits (at most 20 s) until ``peers_in_backend`` peers wait inside the
    backend, so that each peer's own error is the stand-in's timeout and not an earlier collective of the same call
    (the build's agreement) that it had not yet seen complete when the announcement arrived."""
    def action(group) -> None:
        if peers_in_backend:
            import torch.distributed as dist

            store, deadline = dist.distributed_c10d._get_default_store(), time.monotonic() + 20
            while store.add(_IN_BACKEND, 0) < peers_in_backend and time.monotonic() < deadline:
                time.sleep(0.005)
        raise RuntimeError(f"injected {where} failure")
    return action


def _time_out(group) -> None:
    """What a peer inside DeepEP's kernel sees: nothing arrives, then a timeout (once the failing rank has spoken)."""
    import torch.distributed as dist

    dist.distributed_c10d._get_default_store().add(_IN_BACKEND, 1)
    deadline = time.monotonic() + 20
    state = state_of(group)
    while not (failures.announced_failures(state) or failures.pending_builds(state)) and time.monotonic() < deadline:
        time.sleep(0.005)
    raise RuntimeError("DeepEP timeout (stand-in): the dispatch's CPU wait timed out")


def _step(x, idx, w, config) -> None:
    out = dv2.dispatch(x, idx, w, E, config=config)
    y = dv2.combine(out.recv_x * 2, out.handle)
    y.sum().backward()


def _stay_until_the_peers_report(rank: int, world: int, bad_rank: int) -> None:
    """Keeps the failing rank's process (and its connections) up until every peer has raised: a peer must learn of the
    failure from the announcement, not from the failing process's exit closing the connections."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if rank != bad_rank:
        store.add("test_failures/reported", 1)
        return
    deadline = time.monotonic() + 30
    while store.add("test_failures/reported", 0) < world - 1 and time.monotonic() < deadline:
        time.sleep(0.01)


def _fail_once(rank: int, world: int, where: str, bad_rank: int, peers_time_out: bool) -> tuple[str, str, float]:
    cls = TimeoutStandIn if peers_time_out else ReferenceBackend
    config = dv2.resolve_config(backend=cls)
    x, idx, w = _inputs(rank)
    if where != "build":
        _step(x, idx, w, config)  # the buffer exists and every op has run once on every rank
    peers_in_backend = world - 1 if peers_time_out else 0  # the failing rank waits until they wait in the stand-in
    action = _fail(where, peers_in_backend) if rank == bad_rank else _time_out if peers_time_out else None
    if action is not None and where != "dispatch_backward":
        _install(cls, METHODS[where], action)
    started = time.monotonic()
    try:
        out = dv2.dispatch(x, idx, w, E, config=config)
        y = dv2.combine(out.recv_x * 2, out.handle)
        if action is not None and where == "dispatch_backward":  # the forward combine is done: only the backward's
            _install(cls, "combine", action)
        y.sum().backward()
    except Exception as error:  # noqa: BLE001 - returned to the test
        outcome = type(error).__name__, str(error), time.monotonic() - started
    else:
        outcome = "no error", "", time.monotonic() - started
    _stay_until_the_peers_report(rank, world, bad_rank)
    return outcome


def _check(outcomes: list, where: str, bad_rank: int) -> None:
    bad_type, bad_message, _ = outcomes[bad_rank]
    assert (bad_type, bad_message) == ("RuntimeError", f"injected {where} failure"), outcomes[bad_rank]
    for rank, (kind, message, seconds) in enumerate(outcomes):
        if rank == bad_rank:
            continue
        assert kind == "PeerFailure", (rank, kind, message)
        assert f"Rank(s) [{bad_rank}] of the expert-parallel group failed in this call" in message, (rank, message)
        assert f"rank {bad_rank}: RuntimeError: injected {where} failure" in message, (rank, message)
        assert seconds < PEER_SECONDS, (rank, seconds, message)


WHERE = list(METHODS)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("world,bad_rank", [(2, 1), (4, 2)])
def test_a_failure_on_one_rank_is_named_on_every_peer_within_seconds(world: int, bad_rank: int, where: str) -> None:
    outcomes = run_distributed(_fail_once, world, where, bad_rank, False, env=ENV, timeout=60)
    _check(outcomes, where, bad_rank)


def test_a_failure_on_the_rank_hosting_the_store_is_named_too() -> None:
    outcomes = run_distributed(_fail_once, 2, "dispatch", 0, False, env=ENV, timeout=60)
    _check(outcomes, "dispatch", 0)


@pytest.mark.parametrize("where", WHERE)
def test_a_peer_timeout_as_deepep_raises_it_names_the_announced_cause(where: str) -> None:
    """Peers that wait without communicating (inside a kernel) and then raise a timeout name the rank that failed
    and its error instead of a bare timeout, on every path that reaches the backend."""
    outcomes = run_distributed(_fail_once, 2, where, 1, True, env=ENV, timeout=60)
    _check(outcomes, where, 1)
    assert "DeepEP timeout (stand-in)" in outcomes[0][1], outcomes[0]


# ---------------------------------------------------------------- a rank whose batch exceeds the capacity alone
def _exceed_alone(rank: int, world: int, big_rank: int, peers_time_out: bool) -> tuple[str, str, float]:
    cls = TimeoutStandIn if peers_time_out else ReferenceBackend
    config = dv2.resolve_config(backend=cls)
    _step(*_inputs(rank), config)  # learns capacity 8 (the largest first batch, 6, rounded up) on every rank
    if peers_time_out and rank != big_rank:
        _install(cls, "dispatch", _time_out)
    x, idx, w = _inputs(rank, 20 if rank == big_rank else T)
    started = time.monotonic()
    try:
        dv2.dispatch(x, idx, w, E, config=config)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.parametrize("world,big_rank,peers_time_out", [(2, 0, False), (4, 2, False), (2, 1, True)])
def test_a_rank_that_exceeds_the_capacity_alone_fails_fast_and_named_on_every_rank(
        world: int, big_rank: int, peers_time_out: bool) -> None:
    """Its peers, whose batches fit, are already communicating through the buffer; they see it wait at the build
    they did not need (or, inside DeepEP, name it when their timeout surfaces), and it learns that they stopped."""
    outcomes = run_distributed(_exceed_alone, world, big_rank, peers_time_out, env=ENV, timeout=60)
    name = TimeoutStandIn.name if peers_time_out else ReferenceBackend.name
    why = f"dispatches 20 tokens, more than the {name} buffer's token limit 8"
    kind, message, seconds = outcomes[big_rank]
    assert kind == "ValueError" and f"This rank {why}" in message, outcomes[big_rank]
    assert "did not come to grow it: their batches fit" in message and "MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK" in message
    assert seconds < PEER_SECONDS, outcomes[big_rank]
    for rank, (kind, message, seconds) in enumerate(outcomes):
        if rank != big_rank:
            assert kind == "PeerFailure" and f"Rank(s) [{big_rank}]" in message and f"rank {big_rank}: {why}" in message, \
                (rank, message)
            assert "wait for this rank at a communication buffer build that this rank did not need" in message
            assert seconds < PEER_SECONDS, (rank, seconds)


# ---------------------------------------------------------------- no false alarm when ranks grow together
def _linger_then_grow(rank: int, world: int, in_agreement: bool) -> tuple[int, bool]:
    """Rank 1 lingers in a collective whose data has arrived while rank 0 goes on to a build, and grows the buffer
    with it: rank 1 sees rank 0 at a build it has not started, which is no reason to stop. Either the collective is
    the last of a dispatch and the build is the next call's, or (``validate``) it is the agreement before the build
    of the same call."""
    import pytest
    import torch.distributed as dist

    config = dv2.resolve_config(backend=ReferenceBackend, validate=in_agreement)
    _step(*_inputs(rank), config)  # capacity 8
    group, store = dist.group.WORLD, dist.distributed_c10d._get_default_store()
    lingering_in = 1 if in_agreement else 2  # the growing dispatch's agreement, or the dispatch before's rows exchange
    saw_the_build = []
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            works: list = []
            waited = agreement._waited

            def linger(work, timeout_s: float) -> bool:
                if not works or works[-1] is not work:
                    works.append(work)
                if len(works) == lingering_in and not saw_the_build:
                    deadline = time.monotonic() + 20
                    build = failures.rendezvous_key(state_of(group), f"build-{state_of(group).builds + 1}")
                    while not store.check([build]) and time.monotonic() < deadline:
                        time.sleep(0.005)
                    saw_the_build.append(store.check([build]))
                    return False  # one more look at the store, with rank 0 at the build
                return waited(work, timeout_s)

            patch.setattr(agreement, "_waited", linger)
        if not in_agreement:
            dv2.dispatch(*_inputs(rank)[:2], None, E, config=config)
        grown = dv2.dispatch(*_inputs(rank, 20), E, config=config)  # every rank exceeds: they grow together
    return grown.handle.buffer.spec.num_max_tokens_per_rank, bool(saw_the_build and saw_the_build[0])


@pytest.mark.parametrize("in_agreement", [False, True])
def test_a_rank_still_in_a_collective_while_its_peer_goes_on_to_grow_raises_nothing(in_agreement: bool) -> None:
    outcomes = run_distributed(_linger_then_grow, 2, in_agreement, env=ENV, timeout=60)
    assert outcomes == [(32, False), (32, True)], outcomes
