"""The receive bound's memory: the experts keep a bound-sized copy of a dispatch's rows, and the worst-case receive is
reused as the combine's input (:class:`KeepRows`, :class:`RestoreRows`), forward and backward.

The Megatron manager (:mod:`megatron_deepepv2.mcore.manager`) applies a bound under ``moe_expert_rank_capacity_factor``
(:func:`keep_bounded_rows`); each bounded dispatch hands its worst-case tensors from one Function to the other through
its own :class:`BoundSlot`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class BoundSlot:
    """One bounded dispatch's worst-case ``buffer``, for :class:`RestoreRows`, and ``grad``, for :class:`KeepRows`."""

    __slots__ = ("bound", "num_rows", "buffer", "grad")

    def __init__(self, bound: int, num_rows: int) -> None:
        self.bound = bound
        self.num_rows = num_rows
        self.buffer: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None


def _only_holder(tensor: torch.Tensor) -> bool:
    """Whether no other tensor or view holds ``tensor``'s storage; False where this PyTorch cannot count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = tensor.untyped_storage()
    # Holders: ``tensor``, the ``storage`` object just made, and the base a view keeps alive.
    return use_count(storage._cdata) == 2 + (tensor._base is not None)


class KeepRows(torch.autograd.Function):
    """Forward: copies of the first ``slot.bound`` rows and probs, which the experts save for backward; the receive
    goes to ``slot.buffer``. Backward: the worst-case gradient, zero past the bound, in ``slot.grad`` when nothing
    else holds that (a delayed weight gradient may), else in a new tensor."""

    @staticmethod
    def forward(ctx: Any, recv_x: torch.Tensor, probs: torch.Tensor, slot: BoundSlot):  # type: ignore[override]
        bound = slot.bound
        slot.buffer = recv_x.detach()
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        return recv_x[:bound].clone(), probs[:bound].clone()

    @staticmethod
    def backward(ctx: Any, grad_x: Optional[torch.Tensor], grad_probs: Optional[torch.Tensor]):
        slot: BoundSlot = ctx.slot
        bound, num_rows = slot.bound, slot.num_rows
        full_x = slot.grad
        slot.grad = None
        if grad_x is not None:
            if full_x is None or full_x.dtype != grad_x.dtype or not _only_holder(full_x):
                full_x = grad_x.new_empty((num_rows, grad_x.shape[1]))
            full_x[:bound].copy_(grad_x)
            full_x[bound:].zero_()
        else:
            full_x = None
        full_probs = None
        if grad_probs is not None:  # 1-D, 4 bytes a row: a new tensor costs little
            full_probs = grad_probs.new_zeros((num_rows,))
            full_probs[:bound].copy_(grad_probs)
        return full_x, full_probs, None


class RestoreRows(torch.autograd.Function):
    """Forward: the experts' ``[bound, H]`` output written into the dispatch's receive (nothing reads it any more),
    zeros past the bound. Backward: the kept rows' gradient (a view); the whole one is left in the slot."""

    @staticmethod
    def forward(ctx: Any, expert_out: torch.Tensor, slot: BoundSlot):  # type: ignore[override]
        buffer, bound = slot.buffer, slot.bound
        slot.buffer = None
        if buffer is None or buffer.dtype != expert_out.dtype or buffer.shape[1] != expert_out.shape[1]:
            buffer = expert_out.new_empty((slot.num_rows, expert_out.shape[1]))  # restored twice, or new dtype/width
        buffer[:bound].copy_(expert_out)
        buffer[bound:].zero_()
        ctx.slot = slot
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        slot: BoundSlot = ctx.slot
        slot.grad = grad
        return grad[:slot.bound], None


def keep_bounded_rows(recv_x: torch.Tensor, probs: torch.Tensor, tokens_per_expert: torch.Tensor, handle: Any,
                      bound: int, dropped_rows: torch.Tensor,
                      over_budget: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, BoundSlot]:
    """The experts' view of an expand dispatch cut at ``bound`` rows, without a host sync.

    Args:
        recv_x: ``[N, H]`` received rows (``N = handle.num_recv_rows > bound``).
        probs: ``[N]`` fp32 routing weights of the rows (0: padding, or a selection the router dropped).
        tokens_per_expert: ``[E_local]`` int64 rows per local expert block, padding included.
        handle: The dispatch's :class:`~megatron_deepepv2.backends.base.DispatchHandle`.
        bound: Rows the experts keep.
        dropped_rows: ``[1]`` int64, increased by the selections past the bound (rows with a nonzero prob among the
            valid ones), in place.
        over_budget: ``[1]`` bool, set in place when any selection is dropped.

    Returns:
        ``(kept_x [bound, H], kept_probs [bound], tokens_per_expert cut at the bound, slot)``, ``slot`` the
        :class:`BoundSlot` that :class:`RestoreRows` takes for the combine's input.
    """
    num_rows = handle.num_recv_rows
    ends = torch.cumsum(tokens_per_expert, 0)
    cut_counts = (ends.clamp(max=bound) - (ends - tokens_per_expert)).clamp(min=0)  # blocks cut at the bound
    selected = probs[bound:] != 0
    if not handle.config.host_sync:  # rows past the valid ones are unspecified
        rows = torch.arange(bound, num_rows, device=selected.device)
        selected &= rows < handle.num_valid_rows.to(selected.device)
    dropped = selected.sum().to(device=dropped_rows.device, dtype=torch.int64).reshape(1)
    dropped_rows += dropped
    over_budget |= dropped > 0
    slot = BoundSlot(bound, num_rows)
    kept_x, kept_probs = KeepRows.apply(recv_x, probs, slot)
    return kept_x, kept_probs, cut_counts, slot
