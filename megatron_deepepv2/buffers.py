"""Buffer lifecycle: the single source of truth for the communication buffers of this process.

One buffer (a :class:`~megatron_deepepv2.backends.base.DispatchBackend` instance) lives per
(backend, process group). It is rebuilt when the shape key changes (hidden size, top-k, FP8, determinism,
SM count) or when a batch needs more token capacity; a rebuild is collective on every rank of the group,
exactly like the first build, and never happens inside CUDA-graph capture.

Token capacity (``num_max_tokens_per_rank``) is the same on every rank, as DeepEP requires (it is a JIT
constant and a layout parameter). It comes from configuration, exactly as configured (it sizes the worst-case
buffers of the no-host-sync mode), or, when not configured, from the largest first batch over the ranks (agreed
by the collective build) rounded up to a power of two. In steady state
no collective runs: a dispatch only compares its token count with the capacity. When a batch exceeds it,
capacity grows collectively to the maximum over the ranks. That growth assumes the ranks exceed together,
as Megatron's equal per-rank token counts do; for workloads where one rank alone can exceed, configure
the true maximum, or turn on ``validate`` (then the per-call validation all-reduce shares every rank's
count and ranks grow in lock-step).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megatron_deepepv2._dist import all_reduce_max, next_power_of_two
from megatron_deepepv2.backends.base import BufferSpec, DispatchBackend

logger = logging.getLogger(__name__)


@dataclass
class BufferStats:
    """Counters of the buffer registry, for logs and tests.

    Attributes:
        builds: Buffers built since the process started (first builds and rebuilds).
        rebuilds_for_key: Rebuilds caused by a shape-key change.
        rebuilds_for_capacity: Rebuilds caused by a batch larger than the capacity.
    """

    builds: int = 0
    rebuilds_for_key: int = 0
    rebuilds_for_capacity: int = 0


_buffers: dict[tuple[str, dist.ProcessGroup], DispatchBackend] = {}
_stats = BufferStats()


def _is_capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def get_buffer(
    backend_cls: type[DispatchBackend],
    group: dist.ProcessGroup,
    *,
    hidden: int,
    num_topk: int,
    use_fp8: bool,
    num_tokens: int,
    configured_capacity: Optional[int] = None,
    deterministic: bool = False,
    num_sms: int = 0,
) -> DispatchBackend:
    """Returns the buffer for ``group``, building or rebuilding it when needed.

    Args:
        backend_cls: Backend class to build.
        group: Expert-parallel process group.
        hidden: Hidden size of the dispatched tokens.
        num_topk: Top-k of the routing.
        use_fp8: Whether FP8 pairs are dispatched.
        num_tokens: Tokens this call dispatches (the largest over the group when known).
        configured_capacity: Configured ``num_max_tokens_per_rank``, or None to take the largest first batch.
        deterministic: Build the buffer in deterministic mode.
        num_sms: SMs for the communication kernels (0 = backend's choice).

    Returns:
        A buffer whose capacity is at least ``num_tokens``.

    Raises:
        RuntimeError: If a build would happen during CUDA-graph capture.
    """
    key = (backend_cls.name, group)
    current = _buffers.get(key)
    wanted = BufferSpec(
        hidden=hidden,
        num_topk=num_topk,
        use_fp8=use_fp8,
        num_max_tokens_per_rank=0,
        deterministic=deterministic,
        num_sms=num_sms,
    )
    if current is not None:
        same_shape = current.spec.with_capacity(0) == wanted
        if same_shape and num_tokens <= current.spec.num_max_tokens_per_rank:
            return current  # steady state: no collective

    if _is_capturing():
        raise RuntimeError(
            "The deepepv2 communication buffer must be (re)built, which cannot happen during CUDA-graph "
            "capture. Run one eager step with the same shapes before capturing."
        )

    # A configured capacity is taken as it is: without host sync it sizes every worst-case receive buffer, so
    # rounding it up would inflate them. Only the learnt capacity (largest batch) is rounded to a power of two,
    # so that batches of varying size rebuild (and recompile DeepEP's kernels) rarely.
    capacity = int(configured_capacity) if configured_capacity else 0
    if current is not None:
        capacity = max(capacity, current.spec.num_max_tokens_per_rank)
    # Collective, and unconditional so that every rank on this path runs it: the ranks agree on the
    # largest batch before building.
    (largest,) = all_reduce_max([num_tokens], group)
    capacity = max(capacity, next_power_of_two(largest))

    if current is not None:
        if current.spec.with_capacity(0) != wanted:
            _stats.rebuilds_for_key += 1
            reason = f"shape key changed from {current.spec} to {wanted.with_capacity(capacity)}"
        else:
            _stats.rebuilds_for_capacity += 1
            reason = f"{num_tokens} tokens exceed capacity {current.spec.num_max_tokens_per_rank}"
        logger.info("Rebuilding the %s buffer: %s", backend_cls.name, reason)
        current.destroy()
        del _buffers[key]

    buffer = backend_cls(group, wanted.with_capacity(capacity))
    _buffers[key] = buffer
    _stats.builds += 1
    return buffer


def destroy_buffers() -> None:
    """Destroys every buffer of this process (collective: call it on every rank, e.g. before shutdown)."""
    for key in list(_buffers):
        _buffers.pop(key).destroy()


def buffer_stats() -> BufferStats:
    """Returns the registry's counters (a live object)."""
    return _stats


def active_buffers() -> list[DispatchBackend]:
    """Returns the live buffers of this process."""
    return list(_buffers.values())
