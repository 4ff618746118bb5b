"""The deterministic receive order of a DeepEP dispatch: :func:`order_received` puts a dispatch's outputs in it and
updates DeepEP's handle to match, after :func:`check_handle_layout` found the handle laid out as it relies on.

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

from typing import Any, Optional

import torch

from megatron_deepepv2.layout import ExpertLayout, HiddenStates, split_hidden

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


def check_handle_layout(native: Any, num_topk: int, layout: ExpertLayout) -> None:
    """Checks that DeepEP's dispatch handle ``native`` holds the tensors :func:`order_received` reads and rewrites, in
    the layout it relies on (shapes and dtypes, read on the host; no device access).

    DeepEP documents the handle's fields but not as a stable interface: a DeepEP whose metadata is laid out otherwise
    would have its handle silently corrupted by the rewrite, so this check runs before every deterministic ordering.

    Args:
        native: The ``EPHandle`` of a dispatch.
        num_topk: Top-k of the dispatch (``K``).
        layout: Its receive layout.

    Raises:
        RuntimeError: Naming each field that is missing or laid out otherwise, and what was expected.
    """
    wrong = []

    def expect(name: str, dims: Optional[int], columns: Optional[int] = None, optional: bool = False) -> None:
        tensor = getattr(native, name, None)
        if tensor is None and optional:
            return
        if (not isinstance(tensor, torch.Tensor) or tensor.is_floating_point() or tensor.is_complex()
                or (dims is not None and tensor.dim() != dims)
                or (columns is not None and tensor.shape[-1] != columns)):
            shape = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
            wrong.append(f"{name} is {shape}, expected {'an' if dims is None else f'a {dims}-D'} integer tensor"
                         + (f" with {columns} columns" if columns is not None else ""))

    expect("recv_src_metadata", 2, columns=num_topk + 2)  # [N, K + 2]: source index, rank/slot, K expanded rows
    expect("psum_num_recv_tokens_per_scaleup_rank", 1)
    if layout is ExpertLayout.EXPAND:
        expect("psum_num_recv_tokens_per_expert", 1)
        expect("num_unaligned_recv_tokens_per_expert", 1)
    else:
        expect("channel_linked_list", None, optional=True)  # hybrid mode only: row indices, any shape
    if wrong:
        raise RuntimeError("The installed DeepEP's dispatch handle is not laid out as deterministic ordering relies "
                           "on (" + "; ".join(wrong) + "). Deterministic mode supports DeepEP 2.1.0 and V2.5; turn "
                           "it off (MEGATRON_DEEPEPV2_DETERMINISTIC=0) or install one of those.")


def order_received(recv_x: HiddenStates, recv_idx: Optional[torch.Tensor], recv_weights: Optional[torch.Tensor],
                   native: Any, num_topk: int, layout: ExpertLayout, *, host_sync: bool, cached: bool,
                   receive_order: Optional[torch.Tensor] = None) -> tuple[HiddenStates, Optional[torch.Tensor],
                                                                          Optional[torch.Tensor],
                                                                          Optional[torch.Tensor]]:
    """A dispatch's outputs in DeepEP's deterministic order, its handle ``native`` updated to match (as DeepEP's own
    sort leaves it). With host sync, DeepEP's sort itself (what a ``deterministic=True`` buffer runs); without, the
    same order computed here, nothing read on the host.

    Args:
        recv_x: ``[N, H]`` received rows, or an FP8 pair.
        recv_idx: Compact ``[N, K]`` int64 local ids, or None.
        recv_weights: ``[N, K]`` (compact) or ``[N]`` (expand) fp32 weights, or None.
        native: The dispatch's ``EPHandle``, checked by :func:`check_handle_layout` (rewritten in place: its
            ``recv_src_metadata`` and, in hybrid mode, ``channel_linked_list``, which DeepEP's combine reads).
        num_topk: Top-k of the dispatch (``K``).
        layout: The receive layout.
        host_sync: Whether the dispatch read its sizes on the host.
        cached: A cached dispatch of a handle ordered before.
        receive_order: Compact, cached: the ``[N]`` gather index the first dispatch applied.

    Returns:
        ``(recv_x, recv_idx, recv_weights, receive_order)`` ordered; ``receive_order`` the compact gather index to
        apply again on a cached dispatch (None otherwise).
    """
    expand = layout is ExpertLayout.EXPAND
    if cached and expand:  # placed by the slots the first order rewrote (DeepEP's sort leaves it so too)
        return recv_x, recv_idx, recv_weights, receive_order
    rows, scales = split_hidden(recv_x)
    if host_sync:  # a cached dispatch has no host sync in DeepEP either
        # DeepEP's binding, positional: (do_cpu_sync, is_cached_dispatch, recv_x, recv_sf, recv_topk_idx,
        # recv_topk_weights, channel_linked_list).
        native.deterministic_sort(not cached, cached, rows, scales, recv_idx, recv_weights, native.channel_linked_list)
        return recv_x, recv_idx, recv_weights, receive_order
    check_handle_layout(native, num_topk, layout)
    metadata, num_valid = native.recv_src_metadata, native.psum_num_recv_tokens_per_scaleup_rank[-1]
    if expand:
        starts = native.psum_num_recv_tokens_per_expert - native.num_unaligned_recv_tokens_per_expert
        order, slots = expand_order(metadata[:, 0], metadata[:, 2:], starts, rows.shape[0], num_valid)
        metadata[:, 2:] = slots  # the expanded row of each selection: what a cached dispatch and combine replay
    else:  # a cached compact receive comes in the first dispatch's order: the same gather applies
        if not cached:
            receive_order = compact_order(metadata[:, 0], num_valid)
            metadata.copy_(metadata[receive_order])  # combine reads each row's source from its metadata row
            if native.channel_linked_list is not None:  # hybrid mode: its entries point to received rows
                native.channel_linked_list.copy_(relink(native.channel_linked_list, receive_order, num_valid))
        order = receive_order
        recv_idx = None if recv_idx is None else recv_idx[order]
    rows, scales, recv_weights = (None if t is None else t[order] for t in (rows, scales, recv_weights))
    return (rows, scales) if scales is not None else rows, recv_idx, recv_weights, receive_order
