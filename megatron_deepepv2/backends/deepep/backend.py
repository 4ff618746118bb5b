"""The DeepEP backend as registered: :class:`DeepEPBackend` builds DeepEP's buffer for a group, then runs its calls
as :class:`~.adapter.DeepEPAdapter`; whether it can run here, and with deterministic mode, is asked of :mod:`.probes`.

A build imports and checks ``deep_ep``, has PyTorch create the group's NCCL communicator, chooses direct or hybrid
mode and decides GIN from the nodes of the group (:mod:`.topology`), sizes the buffer (:func:`buffer_size_arguments`,
the one place a size is decided) and logs what it built, warning once per process of a path that has never run on a
GPU (:data:`NEVER_RUN`).
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.backends.base import BufferSpec
from megatron_deepepv2.backends.deepep.adapter import DeepEPAdapter
from megatron_deepepv2.backends.deepep.lines import DeepEPLine, line_of_module
from megatron_deepepv2.backends.deepep.probes import (deepep_unavailable_reason, handle_order_unavailable_reason,
                                                      import_deep_ep)
from megatron_deepepv2.backends.deepep.topology import HYBRID_MODE_FIELD, choose_hybrid_mode, set_gin_variable_for_group
from megatron_deepepv2.backends.registry import register_backend
from megatron_deepepv2.groups import GroupState, collective_device

logger = logging.getLogger(__name__)


def buffer_size_arguments(num_max_tokens_per_rank: int, hidden: int, num_topk: int) -> dict[str, Any]:
    """The sizing keyword arguments the DeepEP backend passes the buffer constructor: the one place a buffer's size
    is decided.

    ``use_fp8_dispatch`` is always False: a training step sends BF16 rows through every buffer (combine's backward
    is a cached dispatch of the BF16 gradient), so an FP8-sized buffer fails that call once ``G * T_max`` rows of
    BF16 outgrow the combine layout. A BF16-sized buffer fits every call (:func:`~.sizing.call_bytes`, the arithmetic
    that checks this choice).

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.

    Returns:
        ``num_max_tokens_per_rank``, ``hidden``, ``num_topk`` and ``use_fp8_dispatch`` for the constructor.
    """
    return {"num_max_tokens_per_rank": num_max_tokens_per_rank, "hidden": hidden, "num_topk": num_topk,
            "use_fp8_dispatch": False}


def ensure_nccl_communicator(group: dist.ProcessGroup) -> None:
    """Makes PyTorch create the NCCL communicator of ``group`` (the expert-parallel group) now, by one all-reduce:
    DeepEP reuses it (``EP_REUSE_NCCL_COMM=1``, its default) and segfaults on the null pointer of a lazy one."""
    probe = torch.zeros(1, device=collective_device(group))
    dist.all_reduce(probe, group=group)


#: The paths a buffer build can take that have never run on a GPU with this package, each warned about once per
#: process when taken.
NEVER_RUN = {
    "line": "DeepEP {line}'s {buffer_class} has never run on a GPU with megatron-deepepv2 (it is tested on CPU against "
            "a stand-in written from its sources): compare the first steps with a run you trust (e.g. "
            "MEGATRON_DEEPEPV2_BACKEND=reference or the alltoall dispatcher) before relying on it",
    "hybrid": "DeepEP's hybrid mode (a group across nodes, RDMA x NVLink) has never run on a GPU with "
              "megatron-deepepv2 (its choice is tested over gloo ranks): compare the first steps with a run you trust "
              "before relying on it",
}
_warned_never_run: set[str] = set()


def log_buffer_built(line: DeepEPLine, hybrid: bool, why: str) -> None:
    """Logs the buffer a backend built (its line, class and mode, and why that mode) and, once per process, a WARNING
    for each path of :data:`NEVER_RUN` the build took.

    Args:
        line: The DeepEP line of the buffer.
        hybrid: Whether the buffer runs in hybrid mode.
        why: Why that mode, for the log.
    """
    logger.info("DeepEP %s %s: %s mode (%s)", line.name, line.buffer_class, "hybrid (RDMA x NVLink)" if hybrid
                else "direct", why)
    for path, taken in (("line", not line.ran_on_gpu), ("hybrid", hybrid)):
        if taken and path not in _warned_never_run:
            _warned_never_run.add(path)
            logger.warning(NEVER_RUN[path].format(line=line.name, buffer_class=line.buffer_class))


@register_backend
class DeepEPBackend(DeepEPAdapter):
    """The ``deepep`` backend: DeepEP v2's buffer, built on construction (collective over the group).

    Args:
        state: The state of the expert-parallel group, an NCCL group.
        spec: Buffer shape key; ``num_max_tokens_per_rank`` must be the same on every rank.

    Raises:
        ImportError: ``deep_ep`` does not import.
    """

    name: ClassVar[str] = "deepep"
    auto_preference: ClassVar[int] = 0
    extra_agreement = (HYBRID_MODE_FIELD,)  # construction arguments from the settings

    def __init__(self, state: GroupState, spec: BufferSpec) -> None:
        deep_ep = import_deep_ep()
        line = line_of_module(deep_ep)
        ensure_nccl_communicator(state.group)  # before DeepEP reads it
        allow_hybrid, why = choose_hybrid_mode(state, spec.settings.allow_hybrid_mode)
        set_gin_variable_for_group(state)  # DeepEP reads EP_DISABLE_GIN when the buffer is built: decided before
        buffer_class = getattr(deep_ep, line.buffer_class)
        # Sized for BF16 rows even with FP8 dispatch: combine's backward sends BF16 rows through this buffer.
        ep_buffer = buffer_class(
            state.group, **buffer_size_arguments(spec.num_max_tokens_per_rank, spec.hidden, spec.num_topk),
            deterministic=False, allow_hybrid_mode=allow_hybrid,  # deterministic mode: receive_order sorts
            allow_multiple_reduction=True, explicitly_destroy=True)  # multiple reduction: expand combine with weights
        log_buffer_built(line, allow_hybrid, why)
        super().__init__(state, spec, ep_buffer, line)

    @classmethod
    def unavailable_reason(cls) -> Optional[str]:
        return deepep_unavailable_reason()  # cached: the probes (import, NCCL query) are slow

    @classmethod
    def deterministic_order_unavailable_reason(cls, host_sync: bool) -> Optional[str]:
        return handle_order_unavailable_reason(host_sync)
