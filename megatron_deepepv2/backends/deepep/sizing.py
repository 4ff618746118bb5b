"""DeepEP 2.1's buffer arithmetic as plain Python: what each call needs, what a buffer gets, what a layer keeps.

DeepEP sizes an ``ElasticBuffer`` from the constructor's MoE shape (``calculate_elastic_buffer_size``: the larger of
its dispatch and combine layouts, rounded up to 2 MiB) and, on **every** call, asserts on the host that the layout of
that call (its token limit, hidden size, scale packs, top-k and element size) fits the buffer. A buffer built for
FP8 dispatch is sized for 1-byte rows, but combine's backward is a BF16 *cached* dispatch through the same buffer; so
the backend sizes for BF16 whatever the dispatch dtype
(:func:`~megatron_deepepv2.backends.deepep.backend.buffer_size_arguments`), which also fits every FP8
dispatch (its rows are never larger than BF16 ones: DeepEP asserts ``4 * ceil(H / 32) <= H``).

This module reproduces the arithmetic (``csrc/elastic/buffer.hpp`` ``get_dispatch_buffer_size`` /
``get_combine_buffer_size`` / ``calculate_buffer_size``, ``layout.cuh`` ``TokenLayout`` / ``BufferLayout``) so that the
sizing of every shape and group size can be checked without a GPU, and memory can be budgeted
(:func:`layer_memory`); the tests check the backend's own decision against it. It imports
:mod:`~megatron_deepepv2.layout` and :mod:`~megatron_deepepv2.fp8` (the scale block); no dispatch imports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_deepepv2 import fp8
from megatron_deepepv2.layout import ExpertLayout, align_up, receive_bound_rows, worst_case_recv_rows

#: DeepEP's symmetric-memory alignment of a buffer size (2 MiB).
BUFFER_ALIGNMENT = 2 * 1024 * 1024
#: TMA alignment of each part of a token's slot (hidden bytes, scale bytes, metadata bytes).
_TMA_ALIGNMENT = 32
#: Hybrid mode: channels whose token slots the scale-out receive layout adds per rank (8 per SM x 160 SMs).
_MAX_CHANNELS = 8 * 160
#: Bytes of a BF16 value, the dtype of combine and of every cached dispatch (the backward of combine).
BF16_BYTES = 2
#: Bytes of one scale pack (fp32, or four UE8M0 exponents).
SF_PACK_BYTES = 4


@dataclass(frozen=True)
class Topology:
    """DeepEP's logical domains for a group (``get_logical_domain_size``).

    Attributes:
        num_scaleout_ranks: Ranks across the scale-out (RDMA) network; 1 in direct mode.
        num_scaleup_ranks: Ranks in one scale-up domain (the whole group in direct mode).
        scaleup_is_nvlink: Whether the scale-up domain is one NVLink domain (no send staging in the buffer).
    """

    num_scaleout_ranks: int
    num_scaleup_ranks: int
    scaleup_is_nvlink: bool = True

    @property
    def num_ranks(self) -> int:
        """Ranks in the group."""
        return self.num_scaleout_ranks * self.num_scaleup_ranks

    @classmethod
    def for_group(cls, num_nodes: int, ranks_per_node: int, allow_hybrid_mode: bool) -> "Topology":
        """The domains DeepEP derives for a group of ``num_nodes`` NVLink domains of ``ranks_per_node`` ranks.

        Args:
            num_nodes: NVLink domains (nodes) the group spans.
            ranks_per_node: Ranks of the group in each of them.
            allow_hybrid_mode: The constructor's ``allow_hybrid_mode``.

        Returns:
            Hybrid: ``num_nodes`` scale-out ranks of ``ranks_per_node`` NVLink ranks. Direct: one flat scale-up
            domain of every rank, over NVLink only when the group is one node.
        """
        if allow_hybrid_mode:
            return cls(num_scaleout_ranks=num_nodes, num_scaleup_ranks=ranks_per_node, scaleup_is_nvlink=True)
        return cls(num_scaleout_ranks=1, num_scaleup_ranks=num_nodes * ranks_per_node, scaleup_is_nvlink=num_nodes == 1)


def token_slot_bytes(hidden_bytes: int, sf_bytes: int, num_topk: int, with_metadata: bool) -> int:
    """Bytes of one token's slot in a buffer layout (``TokenLayout::get_num_bytes<false>``).

    Args:
        hidden_bytes: Bytes of the token's hidden values.
        sf_bytes: Bytes of its scale packs (0 without FP8).
        num_topk: Top-k (an int32 index and an fp32 weight each).
        with_metadata: Dispatch slots also carry the source index and one slot per top-k entry.

    Returns:
        The slot size: each part rounded up to 32 bytes.
    """
    metadata = num_topk * 8 + ((1 + num_topk) * 4 if with_metadata else 0)
    return sum(align_up(part, _TMA_ALIGNMENT) for part in (hidden_bytes, sf_bytes, metadata))


def dispatch_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, elem_size: int, num_sf_packs: int,
                   topology: Topology) -> int:
    """Buffer bytes one dispatch (fresh or cached) needs (``get_dispatch_buffer_size``).

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.
        elem_size: Bytes per hidden value of the dispatched tensor (2 BF16, 1 FP8).
        num_sf_packs: Scale packs per token (0 without FP8).
        topology: The group's domains.

    Returns:
        Bytes of the dispatch layout.
    """
    slot = token_slot_bytes(hidden * elem_size, num_sf_packs * SF_PACK_BYTES, num_topk, with_metadata=True)
    tokens, up, out = num_max_tokens_per_rank, topology.num_scaleup_ranks, topology.num_scaleout_ranks
    if out == 1:
        send = 0 if topology.scaleup_is_nvlink else tokens
        return slot * (send + topology.num_ranks * tokens)
    return slot * (up * out * tokens + tokens + out * (tokens + _MAX_CHANNELS))


def combine_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, topology: Topology,
                  allow_multiple_reduction: bool = True) -> int:
    """Buffer bytes one combine needs (``get_combine_buffer_size``; combine is always BF16).

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.
        topology: The group's domains.
        allow_multiple_reduction: The constructor's ``allow_multiple_reduction`` (the backend passes True).

    Returns:
        Bytes of the combine layout.
    """
    slot = token_slot_bytes(hidden * BF16_BYTES, 0, num_topk, with_metadata=False)
    tokens, up, out = num_max_tokens_per_rank, topology.num_scaleup_ranks, topology.num_scaleout_ranks
    if out == 1:
        copies = min(topology.num_ranks, num_topk) if allow_multiple_reduction else num_topk
        send = 0 if topology.scaleup_is_nvlink else topology.num_ranks * tokens * (1 if allow_multiple_reduction
                                                                                   else num_topk)
        return slot * (send + copies * tokens)
    up_copies = min(up, num_topk) if allow_multiple_reduction else num_topk
    out_copies = min(out, num_topk) if allow_multiple_reduction else num_topk
    send_copies = 1 if allow_multiple_reduction else num_topk
    return slot * (up_copies * out * tokens + out_copies * tokens + send_copies * out * (tokens + _MAX_CHANNELS))


def calculated_buffer_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8_dispatch: bool,
                            topology: Topology, allow_multiple_reduction: bool = True) -> int:
    """The size DeepEP gives a buffer built from an MoE shape (``calculate_elastic_buffer_size``).

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K`` (0 sizes for 32, DeepEP's largest).
        use_fp8_dispatch: Size the dispatch layout for FP8 rows with ``ceil(H / 32)`` scale packs.
        topology: The group's domains.
        allow_multiple_reduction: The constructor's ``allow_multiple_reduction``.

    Returns:
        ``max(dispatch, combine)`` rounded up to 2 MiB.
    """
    num_topk = num_topk or 32
    elem_size, packs = (1, math.ceil(hidden / 32)) if use_fp8_dispatch else (BF16_BYTES, 0)
    needed = max(dispatch_bytes(num_max_tokens_per_rank, hidden, num_topk, elem_size, packs, topology),
                 combine_bytes(num_max_tokens_per_rank, hidden, num_topk, topology, allow_multiple_reduction))
    return align_up(needed, BUFFER_ALIGNMENT)


def call_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, use_fp8: bool, topology: Topology,
               num_sf_packs: int = 0) -> dict[str, int]:
    """Buffer bytes each call of a training step needs on one buffer.

    Args:
        num_max_tokens_per_rank: Token limit ``T_max``.
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.
        use_fp8: Whether the fresh dispatch carries FP8 rows.
        topology: The group's domains.
        num_sf_packs: FP8 scale packs per token (0: one per :data:`~megatron_deepepv2.fp8.BLOCK` values, the
            package's quantisation).

    Returns:
        ``{"dispatch": ..., "cached_dispatch": ..., "combine": ...}``: the fresh dispatch (FP8 or BF16), the cached
        BF16 dispatch of combine's backward, and combine (forward, and dispatch's backward).
    """
    if use_fp8:
        fresh = dispatch_bytes(num_max_tokens_per_rank, hidden, num_topk, 1, num_sf_packs or hidden // fp8.BLOCK,
                               topology)
    else:
        fresh = dispatch_bytes(num_max_tokens_per_rank, hidden, num_topk, BF16_BYTES, 0, topology)
    return {
        "dispatch": fresh,
        "cached_dispatch": dispatch_bytes(num_max_tokens_per_rank, hidden, num_topk, BF16_BYTES, 0, topology),
        "combine": combine_bytes(num_max_tokens_per_rank, hidden, num_topk, topology),
    }


@dataclass(frozen=True)
class LayerMemory:
    """Device bytes of one MoE layer's dispatch on one rank (expand layout, BF16 rows).

    Attributes:
        buffer: The communication buffer (one per process group and shape key, shared by alike layers).
        received: The received rows the experts keep for backward (bound rows with a receive bound).
        transient: The dispatch's own output, alive from the dispatch to the layer's combine (the worst case without
            host sync); without a receive bound it is the same tensor as ``received``, with one the experts keep a
            bound-sized copy for backward instead.
    """

    buffer: int
    received: int
    transient: int

    @property
    def peak(self) -> int:
        """Bytes held between the layer's dispatch and combine: the buffer, the dispatch's output and, with a receive
        bound, the experts' copy of the kept rows."""
        return self.buffer + self.transient + (self.received if self.received < self.transient else 0)

    @property
    def kept(self) -> int:
        """Bytes held from the dispatch until the layer's backward: the buffer and the received rows."""
        return self.buffer + self.received


def layer_memory(*, group_size: int, num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_experts: int,
                 expert_alignment: int = 1, host_sync: bool = True, rank_capacity_factor: float | None = None,
                 topology: Topology | None = None) -> LayerMemory:
    """Bytes one MoE layer's dispatch holds on a rank, for budgeting (expand layout, BF16 rows, balanced routing).

    Args:
        group_size: Ranks in the expert-parallel group ``G``.
        num_max_tokens_per_rank: Tokens each rank dispatches ``T`` (and the buffer's capacity).
        hidden: Hidden size ``H``.
        num_topk: Top-k ``K``.
        num_experts: Experts over the group.
        expert_alignment: Expand-layout block alignment.
        host_sync: With host sync the received rows are exact (here: a balanced router, ``T * K`` selections plus
            the block padding); without, the dispatch allocates the worst case.
        rank_capacity_factor: Megatron's ``moe_expert_rank_capacity_factor``: the experts keep at most that many
            times a balanced receive (None: no bound).
        topology: The group's domains (default: direct mode over one NVLink domain).

    Returns:
        The layer's :class:`LayerMemory`.
    """
    topology = topology or Topology(num_scaleout_ranks=1, num_scaleup_ranks=group_size, scaleup_is_nvlink=True)
    local_experts = num_experts // group_size
    row_bytes = hidden * BF16_BYTES
    padding = local_experts * (expert_alignment - 1)
    balanced = align_up(num_max_tokens_per_rank * num_topk + padding, expert_alignment)
    worst = worst_case_recv_rows(ExpertLayout.EXPAND, group_size=group_size,
                                 num_max_tokens_per_rank=num_max_tokens_per_rank, num_topk=num_topk,
                                 num_local_experts=local_experts, expert_alignment=expert_alignment)
    output_rows = balanced if host_sync else worst
    kept_rows = output_rows
    if rank_capacity_factor is not None:
        kept_rows = min(receive_bound_rows(num_max_tokens_per_rank, num_topk, rank_capacity_factor, expert_alignment),
                        output_rows)
    buffer = calculated_buffer_bytes(num_max_tokens_per_rank, hidden, num_topk, use_fp8_dispatch=False,
                                     topology=topology)
    return LayerMemory(buffer=buffer, received=kept_rows * row_bytes, transient=output_rows * row_bytes)
