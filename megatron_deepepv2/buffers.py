"""Buffer lifecycle: the one registry of this process's communication buffers.

One buffer lives per (backend, process group, :attr:`~megatron_deepepv2.backends.base.BufferSpec.key`), kept in the
group's :class:`~megatron_deepepv2.groups.GroupState`. Builds are collective, never run in CUDA-graph capture, and
agree on :attr:`~megatron_deepepv2.backends.base.BufferSpec.agreed_fields` over the ranks. A rebuild for more tokens
retires the old buffer: its handles keep working until :func:`release_retired_buffers` (or a build) finds no rank
uses it.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_deepepv2.agreement import all_reduce_max, raise_on_every_rank, rendezvous
from megatron_deepepv2.failures import PeerFailure, announce_failure, begin_build
from megatron_deepepv2.groups import GroupState, known_states, next_power_of_two

if TYPE_CHECKING:
    from megatron_deepepv2.backends.base import BufferSpec, DispatchBackend

logger = logging.getLogger(__name__)


@dataclass
class BufferStats:
    """Counters of the registry since the process started: ``builds`` (first builds and rebuilds), ``rebuilds`` (for
    a batch above the token limit) and ``released`` (retired buffers destroyed once no handle used them)."""

    builds: int = 0
    rebuilds: int = 0
    released: int = 0


#: A buffer's handle records are pruned when they grow past this many entries (then past twice the live ones).
_PRUNE_AT = 64


class _HandleRecords:
    """Weak references to the dispatch handles of one buffer, dead ones pruned in bulk (O(1) per dispatch)."""

    __slots__ = ("refs", "prune_at")

    def __init__(self) -> None:
        self.refs: list[weakref.ref] = []
        self.prune_at = _PRUNE_AT

    def prune(self) -> None:
        """Drops the references of dead handles."""
        self.refs = [ref for ref in self.refs if ref() is not None]
        self.prune_at = max(_PRUNE_AT, 2 * len(self.refs))

    def any_alive(self) -> bool:
        """Returns whether a handle is still alive."""
        return any(ref() is not None for ref in self.refs)


_stats = BufferStats()


def get_buffer(backend_cls: type[DispatchBackend], state: GroupState, spec: BufferSpec,
               num_tokens: int) -> DispatchBackend:
    """Returns the buffer for the group of ``state`` and ``spec.key`` with room for ``num_tokens``, building or
    rebuilding it.

    Collective when it builds: every rank of the group must come. The token limit is
    ``spec.settings.num_max_tokens_per_rank`` when set, else the largest first batch over the ranks rounded up to a
    power of two; a batch above it grows it to the maximum over the ranks, which the ranks must exceed together.

    Args:
        backend_cls: Backend class to build.
        state: The state of the expert-parallel process group.
        spec: What to build, for ``backend_cls``; its ``num_max_tokens_per_rank`` is ignored (the limit is set here).
        num_tokens: Tokens this call dispatches.

    Raises:
        RuntimeError: If a build would happen during CUDA-graph capture.
        ValueError: If the other ranks did not come to the build (within ``spec.settings.growth_timeout_s``, or they
            stopped waiting for this rank), or build with another key.
        PeerFailure: A peer failed in this call.
    """
    key = (backend_cls.name, spec.key)
    current = state.buffers.get(key)
    if current is not None and num_tokens <= current.spec.num_max_tokens_per_rank:
        return current
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("The deepepv2 communication buffer must be (re)built, which cannot happen during CUDA-graph "
                           "capture. Run one eager step with the same shapes before capturing.")
    _meet_to_build(backend_cls.name, state, spec, num_tokens, current)
    # Unconditional, so that every rank on this path runs the collective: the ranks agree on the largest batch and on
    # the key (a differing one would corrupt the exchange), then release the retired buffers no rank uses.
    largest = raise_on_every_rank(None, state, agree=True, num_tokens=num_tokens, fields=spec.agreed_fields,
                                  values=[field.encode(spec) for field in spec.agreed_fields], purpose="buffer builds")
    if state.retired:
        _release(state)
    configured = spec.settings.num_max_tokens_per_rank
    # A configured limit is kept exact (without host sync it sizes every worst-case receive). Start from the group's
    # largest limit, so that a second key does not grow through the sizes the first one did.
    limit = max([int(configured or 0)] + [b.spec.num_max_tokens_per_rank for (name, _), b in state.buffers.items()
                                          if name == backend_cls.name])
    # A learnt limit is rounded up to a power of two, so that varying batches rebuild (and recompile DeepEP) rarely.
    limit = max(limit, next_power_of_two(largest) if not configured else largest)
    if current is not None:
        _stats.rebuilds += 1
        logger.info("Rebuilding the %s buffer: %d tokens exceed the token limit %d (the old buffer is kept until no "
                    "dispatch handle uses it)", backend_cls.name, largest, current.spec.num_max_tokens_per_rank)
        state.retired.append(state.buffers.pop(key))
    buffer = state.buffers[key] = backend_cls(state, replace(spec, num_max_tokens_per_rank=limit))
    _stats.builds += 1
    logger.info("Built the %s buffer: %.1f MiB of device memory, sized for %d tokens per rank (hidden %d, top-k %d, "
                "%d ranks)", backend_cls.name, buffer.num_bytes / 2**20, limit, spec.hidden, spec.num_topk,
                buffer.group_size)
    return buffer


def _meet_to_build(backend_name: str, state: GroupState, spec: BufferSpec, num_tokens: int,
                   current: Optional[DispatchBackend]) -> None:
    """Meets the other ranks of the group at the store before a build (``current`` None) or a growth of ``current``:
    a rank that exceeds the limit alone then fails with its reason instead of waiting in an all-reduce the others
    never join.

    Args:
        backend_name: The backend's registry name, for the messages.
        state: The state of the expert-parallel group.
        spec: What the build is for.
        num_tokens: Tokens this call dispatches.
        current: The buffer a growth replaces, or None for a first build.

    Raises:
        ValueError: The others did not come within ``spec.settings.growth_timeout_s``, or stopped waiting for this
            rank (announced to them).
        PeerFailure: A peer failed first in this call.
    """
    growth_timeout_s = spec.settings.growth_timeout_s
    if current is None:
        reason = f"builds its first {backend_name} buffer for hidden size {spec.hidden}, top-k {spec.num_topk}"
        why_not, fix = "they dispatch shapes they have a buffer for, or stopped before", ""
    else:
        reason = (f"dispatches {num_tokens} tokens, more than the {backend_name} buffer's token limit "
                  f"{current.spec.num_max_tokens_per_rank}")
        why_not = "their batches fit"
        fix = ("the limit grows only when the ranks exceed it together: set num_max_tokens_per_rank "
               "(MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK) to the largest per-rank token count, or turn on "
               "MEGATRON_DEEPEPV2_VALIDATE=1 (the ranks then grow in lock-step)")
    what, fix_sentence = "build" if current is None else "grow", f" The {fix}." if fix else ""
    try:
        arrived = rendezvous(state, begin_build(state, f"{reason} ({fix})" if fix else reason), growth_timeout_s)
    except PeerFailure as failure:
        if failure.causes:  # a peer failed first: that is the cause
            raise
        # The peers stopped waiting for this rank in their communication: they did not need this build.
        problem = ValueError(f"This rank {reason}, but the other ranks of the expert-parallel group did not come to "
                             f"{what} it: {why_not}; they stopped waiting for this rank (rank(s) "
                             f"{sorted(failure.consequences)}).{fix_sentence}")
        announce_failure(state, problem)
        raise problem from failure
    if not arrived:
        problem = ValueError(f"This rank {reason}, but the other ranks of the expert-parallel group did not come to "
                             f"{what} it within {growth_timeout_s:g} s: {why_not}.{fix_sentence}")
        announce_failure(state, problem)
        raise problem


def track_handle(handle: Any) -> None:
    """Records ``handle``, a :class:`~megatron_deepepv2.backends.base.DispatchHandle` just returned by a dispatch, as
    a user of its buffer until the handle is garbage (one weak reference appended; O(1))."""
    records = handle.buffer.handle_records
    if records is None:
        records = handle.buffer.handle_records = _HandleRecords()
    refs = records.refs  # appended here, not in a method: this runs every dispatch
    refs.append(weakref.ref(handle))  # no callback: the cheapest record there is
    if len(refs) > records.prune_at:
        records.prune()


def _in_use(buffer: DispatchBackend) -> bool:
    """Whether a dispatch handle of ``buffer`` is still alive on this rank."""
    return buffer.handle_records is not None and buffer.handle_records.any_alive()


def _forget(buffer: DispatchBackend) -> None:
    """Destroys ``buffer`` (collective) and drops its handle records."""
    buffer.destroy()
    buffer.handle_records = None


def _release(state: GroupState) -> int:
    """Destroys the retired buffers of the group of ``state`` that no rank's handle uses (collective: every rank
    calls it with the same retired buffers). Returns how many it destroyed."""
    retired = state.retired
    in_use = all_reduce_max([int(_in_use(buffer)) for buffer in retired], state)
    state.retired = [buffer for buffer, used in zip(retired, in_use) if used]
    for buffer, used in zip(retired, in_use):
        if not used:
            _forget(buffer)
            _stats.released += 1
    return len(retired) - len(state.retired)


def release_retired_buffers() -> int:
    """Destroys the retired buffers (superseded by a rebuild for more tokens) that no dispatch handle uses any more.

    Collective: call it on every rank of the expert-parallel groups at the same point of every training step, once
    that step's backward passes have run, never per dispatch. One small all-reduce per group with retired buffers (a
    buffer any rank still uses is kept on all), plus the backend's collective destroy of each one released; no
    collective at all when nothing is retired.

    Returns:
        How many buffers it destroyed (the same on every rank).
    """
    released = 0
    # The same order on every rank, whatever order the groups retired buffers in.
    for state in sorted((state for state in known_states() if state.retired), key=lambda s: s.ranks):
        released += _release(state)
    return released


def destroy_buffers() -> None:
    """Destroys every buffer of this process, retired ones included (collective: call it on every rank, e.g.
    before shutdown, once no backward pass is pending)."""
    for state in known_states():
        for buffer in [*state.buffers.values(), *state.retired]:
            _forget(buffer)
        state.buffers.clear()
        state.retired = []


def buffer_stats() -> BufferStats:
    """Returns the registry's counters (a live object)."""
    return _stats


def active_buffers() -> list[DispatchBackend]:
    """Returns the buffers in use of this process (one per backend, group and shape key)."""
    return [buffer for state in known_states() for buffer in state.buffers.values()]


def retired_buffers() -> list[DispatchBackend]:
    """Returns the superseded buffers still kept for the dispatch handles that use them."""
    return [buffer for state in known_states() for buffer in state.retired]
