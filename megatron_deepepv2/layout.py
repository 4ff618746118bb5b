"""The receive layouts of a dispatch and the row arithmetic every module shares (a leaf: it imports no package module).

* :class:`ExpertLayout` -- DeepEP v2's two receive layouts, ``compact`` and ``expand``;
* :data:`HiddenStates` and :func:`split_hidden` -- a dispatch's rows, or an FP8 pair, and the one test of which;
* :func:`align_up` -- the one align-up of the package;
* :func:`worst_case_recv_rows` -- the rows a dispatch without host sync allocates;
* :func:`receive_bound_rows` -- the rows a receive bound (``moe_expert_rank_capacity_factor``) lets the experts keep;
* :func:`rows_past_valid` -- the one predicate for rows that hold no data in such a dispatch's output.
"""

from __future__ import annotations

import enum
from typing import Optional, TypeVar, Union

import torch

#: Hidden states handed to dispatch: a BF16/FP32 tensor ``[T, H]`` or an FP8 pair ``(x_fp8 [T, H], scales [T, S])``.
HiddenStates = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


def split_hidden(x: HiddenStates) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Returns ``(rows, scales)`` of hidden states: an FP8 pair's two tensors, or a tensor and None (the one test of
    an FP8 pair: a tuple).

    Raises:
        ValueError: For a tuple that is not a pair.
    """
    if isinstance(x, tuple):
        rows, scales = x
        return rows, scales
    return x, None


class ExpertLayout(str, enum.Enum):
    """Receive layout of a dispatch.

    ``COMPACT``: one row per (source token, this rank), with ``[N, K]`` local expert ids and weights.
    ``EXPAND``: one row per (token, local expert) selection, grouped by local expert and padded to the
    expert alignment, with 1-D weights. Grouped GEMMs can consume it directly.
    """

    COMPACT = "compact"
    EXPAND = "expand"

    @classmethod
    def parse(cls, value: Union[str, "ExpertLayout"]) -> "ExpertLayout":
        """Returns the layout named by ``value``.

        Args:
            value: An :class:`ExpertLayout` or its name (``"compact"`` / ``"expand"``, any case).

        Returns:
            The matching layout.

        Raises:
            ValueError: If ``value`` is not a layout or a string naming one.
        """
        if isinstance(value, ExpertLayout):
            return value
        if isinstance(value, str):
            for layout in cls:
                if layout.value == value.strip().lower():
                    return layout
        names = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"layout={value!r} is not a known expert layout; use one of {names} "
                         f"(an ExpertLayout or its name; got {type(value).__name__}).")


_Count = TypeVar("_Count", int, torch.Tensor)


def align_up(value: _Count, alignment: int) -> _Count:
    """``value`` rounded up to a multiple of ``alignment`` (ints, and int tensors on their device)."""
    return (value + alignment - 1) // alignment * alignment


def rows_past_valid(num_rows: int, num_valid_rows: torch.Tensor) -> torch.Tensor:
    """``[num_rows]`` bool, True on the rows from ``num_valid_rows`` (a device count) on: the rows of a worst-case-sized
    output that hold no data. Computed on the count's device without a host read; callers ``masked_fill`` with it."""
    return torch.arange(num_rows, device=num_valid_rows.device) >= num_valid_rows


def worst_case_recv_rows(
    layout: Union[ExpertLayout, str],
    *,
    group_size: int,
    num_max_tokens_per_rank: int,
    num_topk: int,
    num_local_experts: int,
    expert_alignment: int = 1,
) -> int:
    """Rows a dispatch without host sync allocates (DeepEP 2.1.0's worst case, which every backend uses).

    Args:
        layout: Receive layout, or its name (see :meth:`ExpertLayout.parse`).
        group_size: Ranks in the group (``G``).
        num_max_tokens_per_rank: The buffer's token limit (``T_max``).
        num_topk: Top-k of the routing (``K``).
        num_local_experts: Experts per rank (``E_local``).
        expert_alignment: Expand-layout block alignment.

    Returns:
        ``G * T_max`` for compact; ``align(G * T_max * min(K, E_local) + (alignment - 1) * E_local,
        alignment)`` for expand.

    Raises:
        ValueError: If ``layout`` names no layout.
    """
    if ExpertLayout.parse(layout) is ExpertLayout.COMPACT:
        return group_size * num_max_tokens_per_rank
    rows = group_size * num_max_tokens_per_rank * min(num_topk, num_local_experts)
    rows += (expert_alignment - 1) * num_local_experts
    return align_up(rows, expert_alignment)


def receive_bound_rows(num_tokens: int, num_topk: int, rank_capacity_factor: float, expert_alignment: int = 1) -> int:
    """HybridEP's receive budget: the rows the experts of a rank get at most under Megatron's
    ``moe_expert_rank_capacity_factor``, block padding included.

    Args:
        num_tokens: Tokens the rank dispatched (``T``).
        num_topk: Selections each token sends (``K``, the top-k over the TPxEP group).
        rank_capacity_factor: The factor (``F`` > 0).
        expert_alignment: Expand-layout block alignment.

    Returns:
        ``align(int(T * K * F), alignment)``.
    """
    return align_up(int(num_tokens * num_topk * rank_capacity_factor), expert_alignment)
