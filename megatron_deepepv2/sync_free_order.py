"""The deterministic receive order of a dispatch, computed without reading the device from the host.

DeepEP's deterministic mode orders the received rows after each dispatch: compact rows by source token, and in the
expand layout the rows of each expert block by source token, valid rows before the block's padding. Its own sort
selects rows with boolean masks, which synchronises the host. The functions here compute the same order with masked
arithmetic only (``torch.where``, a scatter into a tensor with one spare slot, a stable sort over every row of the
worst-case receive), so they can run inside a CUDA graph. They take the handle's metadata as plain tensors:

* ``src_token_idx`` ``[N]``: each received token's global source index (DeepEP: ``recv_src_metadata[:, 0]``);
* ``slots`` ``[N, K]``: the expanded row of each of its selections, ``-1`` for none (``recv_src_metadata[:, 2:]``);
* ``num_valid_tokens``: 0-dim count of the received tokens that hold data, or None when all ``N`` do;
* ``block_starts`` ``[E]``: the aligned first row of each local expert's block;
* ``links`` (hybrid mode, compact): entries that point to received rows (DeepEP: ``channel_linked_list``).
"""

from __future__ import annotations

from typing import Optional

import torch

#: Sort-key stride per expert block: larger than twice any global source token index.
_EXPERT_STRIDE = 10_000_000_000


def compact_order(src_token_idx: torch.Tensor, num_valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gather index that puts compact rows in source-token order, rows past ``num_valid_tokens`` last.

    Args:
        src_token_idx: ``[N]`` integer global source index of each received row.
        num_valid_tokens: 0-dim integer count of the rows that hold data (on the rows' device), or None for all.

    Returns:
        ``[N]`` int64 ``order``: ``rows[order]`` is the deterministic order.
    """
    keys = src_token_idx.long()
    if num_valid_tokens is not None:
        past = torch.arange(keys.shape[0], device=keys.device) >= num_valid_tokens
        keys = torch.where(past, torch.iinfo(torch.int64).max, keys)
    return torch.sort(keys, stable=True).indices


def _moved_to(order: torch.Tensor) -> torch.Tensor:
    """The inverse of the gather index ``order``: where each original row went."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))


def relink(links: torch.Tensor, order: torch.Tensor, num_valid_tokens: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``links`` after the rows were gathered by ``order``: entries pointing to a row below ``num_valid_tokens`` point
    to where that row went; the others (negative, or past the valid rows) stay.

    Args:
        links: Integer tensor of row indices (any shape).
        order: ``[N]`` int64 gather index of the rows (:func:`compact_order`).
        num_valid_tokens: 0-dim integer count of the rows that hold data, or None for all ``N``.

    Returns:
        The updated links, in ``links``' dtype and shape.
    """
    num_rows = order.shape[0]
    if num_rows == 0:
        return links
    valid = (links >= 0) & (links < (num_rows if num_valid_tokens is None else num_valid_tokens))
    return torch.where(valid, _moved_to(order)[links.long().clamp(0, num_rows - 1)].to(links.dtype), links)


def expand_order(src_token_idx: torch.Tensor, slots: torch.Tensor, block_starts: torch.Tensor, num_rows: int,
                 num_valid_tokens: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather index that orders each expert block of an expand receive by source token, and the selections'
    rows after it.

    Within each block the rows of selections come first, in source-token order, then the block's other rows (padding)
    in their order; rows past the last block stay after it. Selections of tokens past ``num_valid_tokens`` and
    ``-1`` slots are left out and keep their slot.

    Args:
        src_token_idx: ``[N]`` integer global source index of each received token.
        slots: ``[N, K]`` integer expanded row of each selection, ``-1`` for none.
        block_starts: ``[E]`` integer first row of each local expert's block, ascending.
        num_rows: Rows of the expanded tensors (``R``).
        num_valid_tokens: 0-dim integer count of the received tokens that hold data, or None for all ``N``.

    Returns:
        ``order`` ``[R]`` int64 (``rows[order]`` is the deterministic order) and ``slots`` ``[N, K]`` pointing to the
        selections' rows in that order, in ``slots``' dtype.
    """
    device = slots.device
    if num_rows == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), slots
    rows = torch.arange(num_rows, device=device)
    expert = torch.bucketize(rows, block_starts[1:].long(), right=True)
    valid = slots >= 0
    if num_valid_tokens is not None:
        valid &= (torch.arange(slots.shape[0], device=device) < num_valid_tokens).unsqueeze(1)
    # One spare key past the rows takes every left-out selection (with 0), so no mask selects on the host.
    keys = torch.cat([expert * _EXPERT_STRIDE, rows.new_zeros(1)])
    offsets = torch.where(valid, src_token_idx.long().unsqueeze(1) - _EXPERT_STRIDE // 2, 0)
    keys.scatter_add_(0, torch.where(valid, slots.long(), num_rows).flatten(), offsets.flatten())
    order = torch.sort(keys[:num_rows], stable=True).indices
    # Left-out slots may hold anything (rows past the valid tokens are unspecified): clamped to a row, then dropped.
    new_slots = torch.where(valid, _moved_to(order)[slots.long().clamp(0, num_rows - 1)].to(slots.dtype), slots)
    return order, new_slots
