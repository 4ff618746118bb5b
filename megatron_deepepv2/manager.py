"""``_DeepepV2Manager``: Megatron's flex-dispatcher stages over :mod:`megatron_deepepv2.ops`, and the policy that maps
a Megatron ``TransformerConfig`` onto a dispatch configuration (:func:`dispatch_config_for`).

Megatron's flex dispatcher drives a manager in fixed stages (``setup_metadata`` -> ``dispatch`` ->
``get_permuted_hidden_states_by_experts`` -> experts -> ``get_restored_hidden_states_by_experts`` -> ``combine``).
This one dispatches in DeepEP's expand layout: each expert block padded to ``get_align_size_for_quantization(config)``
(at least 1) with zero rows and zero probs, so permute and unpermute are identities and the tokens per expert come from
the dispatch handle (the experts must not pad again: :mod:`megatron_deepepv2.integration` makes
``skip_routed_expert_padding`` say so). Each stage calls the autograd Function of its op, which calls the backend.

Without host sync (``MEGATRON_DEEPEPV2_NO_HOST_SYNC=1``) the dispatch output has the worst-case row count,
``get_number_of_tokens_per_expert()`` is a device tensor and nothing on this path reads the device on the host, so the
layer can be captured in a CUDA graph; the experts must take device counts (:mod:`megatron_deepepv2.experts`).

Receive bound (``--moe-expert-rank-capacity-factor``): the experts get at most :meth:`_DeepepV2Manager.receive_bound`
rows, HybridEP's budget, a static size; rows past it are dropped and counted on the device (``dropped_rows``,
``over_budget``, which Megatron's ``check_over_budget`` reads and ``reset_over_budget`` clears). The kept rows are a
copy (:class:`_KeepRows`), so the experts save bound-sized tensors for backward, and the worst-case receive is reused
as the combine's input (:class:`_RestoreRows`).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from megatron_deepepv2 import ops, validation
from megatron_deepepv2.backends import SYNC, DispatchConfig, DispatchHandle, ExpertLayout
from megatron_deepepv2.config import get_settings
from megatron_deepepv2.layout import receive_bound_rows

logger = logging.getLogger(__name__)

_warned_low_precision_probs = False


def alignment_for(config: Any) -> int:
    """Row alignment the experts of a Megatron config need (grouped GEMM, quantization), 1 when none."""
    return max(int(moe_utils.get_align_size_for_quantization(config)), 1)


def configured_num_sms(config: Any) -> int:
    """Megatron's SM count for the dispatcher kernels, 0 when unset: ``moe_flex_dispatcher_num_sms`` (megatron-core
    >= 0.19, None = unset), else ``moe_deepep_num_sms`` (whose default, 20, counts as set)."""
    if hasattr(config, "moe_flex_dispatcher_num_sms"):
        return int(config.moe_flex_dispatcher_num_sms or 0)
    return int(getattr(config, "moe_deepep_num_sms", 0) or 0)


def dispatch_config_for(config: Any) -> DispatchConfig:
    """The dispatch configuration of a Megatron ``TransformerConfig``, resolved on first use and kept on it: every
    layer built from one config (a model's, usually) shares it, whatever the settings say later.

    The expand layout, zero padding, :func:`alignment_for`, Megatron's SM count over the ``num_sms`` setting,
    deterministic when the settings or ``--deterministic-mode`` say, and none of the passes only direct callers need
    (the ids come from ``torch.topk``; nothing reads other ranks' weights or the rows past the valid ones).

    Raises:
        ValueError: If the settings or the config are out of range, the backend cannot run the mode, or FP8 dispatch
            is asked for with a hidden size that is not a multiple of 128.
        TypeError: If FP8 dispatch is asked for by a model that does not train in BF16.
        ImportError: If the configured backend was named explicitly and cannot run.
    """
    resolved = getattr(config, "_deepepv2_dispatch_config", None)
    if resolved is not None:
        return resolved
    settings = get_settings()
    resolved = ops.resolve_config(
        layout=ExpertLayout.EXPAND, expert_alignment=alignment_for(config), zero_padding=True,
        num_sms=configured_num_sms(config) or settings.num_sms,
        deterministic=settings.deterministic or bool(getattr(config, "deterministic_mode", False)),
        check_ids=False, mask_foreign_weights=False, clear_tail=False)
    if resolved.settings.fp8_dispatch:
        validation.check_fp8_model(config)
    object.__setattr__(config, "_deepepv2_dispatch_config", resolved)
    return resolved


class _DeepepV2Manager(_DispatchManager):
    """Dispatch manager for ``--moe-flex-dispatcher-backend deepepv2``.

    Args:
        group: The TPxEP process group of the flex dispatcher.
        num_local_experts: Experts on this rank.
        router_topk: Top-k over the TPxEP group (``tp * moe_router_topk``).
        num_experts: Experts over the TPxEP group (``tp * num_moe_experts``).
        config: Megatron ``TransformerConfig`` (see :func:`dispatch_config_for`).

    Raises:
        ImportError: If the configured backend was named explicitly and cannot run.
        ValueError: If the configuration is out of range or the backend cannot run the configured mode.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_local_experts: int,
        router_topk: int,
        num_experts: int,
        config: Any,
    ) -> None:
        self.group = group
        self.num_local_experts = num_local_experts
        self.config = config
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.router_dtype = config.moe_router_dtype
        self.capacity_factor = config.moe_expert_capacity_factor
        self.dispatch_config = dispatch_config_for(config)
        self.dispatcher = ops.bind(self.dispatch_config, group, num_experts)
        #: Megatron's name and meaning (HybridEP's manager): None = dropless. Megatron's over-budget rerun sets it to
        #: None for the rerun and restores it from the config; read at every dispatch.
        self.moe_expert_rank_capacity_factor: Optional[float] = getattr(config, "moe_expert_rank_capacity_factor", None)
        # Megatron's budget hooks look for `over_budget` with hasattr: it and `dropped_rows` exist only with a bound,
        # from its first dispatch on.
        self._bound_slot: Optional[_BoundSlot] = None

        self.token_indices: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self.handle: Optional[DispatchHandle] = None
        self.dispatched_indices: Optional[torch.Tensor] = None
        self.dispatched_probs: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """Turns the router's ``[T, E]`` probabilities into ``[T, K]`` expert ids and their probabilities.

        The ids are ``torch.topk`` indices over the experts, so each is in ``[0, E)`` and no row names an expert
        twice, by construction: this layer's dispatch configuration therefore skips the expert-id check (the
        ``validate`` setting runs it all the same). With a capacity factor, selections the router dropped (prob 0)
        become ``-1``, as in Megatron's DeepEP manager.

        Args:
            routing_map: ``[T, E]`` (or reshapeable) bool map of the selected experts (only its token count is used).
            probs: ``[T, E]`` (or reshapeable) routing probabilities, zero where not selected.
        """
        num_tokens = routing_map.shape[0]
        probs = probs.reshape(num_tokens, self.num_experts)
        self.token_probs, self.token_indices = torch.topk(probs, self.router_topk, dim=-1)
        if self.capacity_factor is not None:
            self.token_indices = self.token_indices.masked_fill(self.token_probs == 0, -1)

    def dispatch(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """Sends tokens to their experts' ranks; keeps the routing for the later stages.

        Args:
            hidden_states: ``[T, H]`` tokens.
            async_finish: Megatron's flag. Every call here is synchronous (:data:`~megatron_deepepv2.backends.base.
                SYNC`), which orders the streams as the asynchronous call followed by Megatron's wait does.
            allocate_on_comm_stream: Megatron's flag; see ``async_finish``.

        Returns:
            ``[N, H]`` received rows in the expand layout (``N``: the bound, with a receive bound).
        """
        global _warned_low_precision_probs
        if self.token_probs.dtype != torch.float32:
            if self.token_probs.dtype in (torch.bfloat16, torch.float16) and not _warned_low_precision_probs:
                logger.warning("deepepv2 dispatches fp32 probs; set --moe-router-dtype fp32 to avoid a cast.")
                _warned_low_precision_probs = True
            self.token_probs = self.token_probs.float()
        recv_x, self.dispatched_probs, _, self.dispatched_indices, self.handle = ops.DispatchFunction.apply(
            hidden_states.contiguous(), self.token_probs, self.dispatcher, self.token_indices, None, SYNC)
        if self.dispatch_config.host_sync:  # the counts are on the host already: the dispatch read them
            self.tokens_per_expert = torch.tensor(self.handle.tokens_per_expert_list, dtype=torch.int64)
        else:
            self.tokens_per_expert = self.handle.tokens_per_expert
        self._bound_slot = None
        if self.moe_expert_rank_capacity_factor is not None:
            return self._apply_receive_bound(recv_x, self.handle)
        return recv_x

    def receive_bound(self, handle: DispatchHandle) -> int:
        """Rows the experts receive at most under ``moe_expert_rank_capacity_factor``: HybridEP's budget.

        ``align(int(T * K * factor), alignment)``, never more than the dispatch's rows: ``T`` is the tokens this rank
        dispatched (``handle.num_tokens``), ``K`` the top-k over the TPxEP group (``tp x moe_router_topk``, the
        selections each token sends; HybridEP's formula reads ``moe_router_topk``, the same at expert TP 1) and the
        alignment the experts' (``get_align_size_for_quantization``, at least 1). The expert blocks' padding counts
        against the budget, as in HybridEP's permuted buffer. Static for a given token count, so a CUDA graph sees
        fixed shapes.

        Args:
            handle: The dispatch's handle.

        Returns:
            The bound, in rows.
        """
        bound = receive_bound_rows(handle.num_tokens, self.router_topk, self.moe_expert_rank_capacity_factor,
                                   self.dispatch_config.expert_alignment)
        return min(bound, handle.num_recv_rows)

    def _apply_receive_bound(self, recv_x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Hands the experts a copy of the first :meth:`receive_bound` rows; rows past it are dropped and counted.

        A dropped row's expert output is zero (it contributes nothing to its token, as a capacity drop) and its
        probability gets no gradient. ``dropped_rows`` accumulates the dropped selections -- rows past the bound with
        a nonzero probability (padding rows have probability zero; so would a selection the router gave exactly
        zero) -- and ``over_budget`` turns True, both on the device, until ``reset_over_budget``; without host sync
        nothing here reads the device (the count is two small kernels over the dropped rows' probabilities).
        """
        bound = self.receive_bound(handle)
        device = recv_x.device
        if not hasattr(self, "over_budget"):
            self.over_budget = torch.zeros(1, dtype=torch.bool, device=device)
            self.dropped_rows = torch.zeros(1, dtype=torch.int64, device=device)
        num_rows = handle.num_recv_rows
        if bound >= num_rows:
            return recv_x  # the dispatch's rows fit: nothing to bound
        counts = self.tokens_per_expert
        ends = torch.cumsum(counts, 0)
        self.tokens_per_expert = (ends.clamp(max=bound) - (ends - counts)).clamp(min=0)  # blocks cut at the bound
        selected = self.dispatched_probs[bound:] != 0
        if not self.dispatch_config.host_sync:  # rows past the valid ones are unspecified
            rows = torch.arange(bound, num_rows, device=selected.device)
            selected &= rows < handle.num_valid_rows.to(selected.device)
        dropped = selected.sum().to(device=device, dtype=torch.int64).reshape(1)
        self.dropped_rows += dropped
        self.over_budget |= dropped > 0
        slot = self._bound_slot = _BoundSlot(bound, num_rows)
        kept_x, self.dispatched_probs = _KeepRows.apply(recv_x, self.dispatched_probs, slot)
        return kept_x

    def reset_over_budget(self) -> None:
        """Clears ``over_budget`` and ``dropped_rows`` (Megatron's ``reset_over_budget`` of the dispatcher calls it)."""
        if hasattr(self, "over_budget"):
            self.over_budget.fill_(False)
            self.dropped_rows.zero_()

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """Returns ``(rows grouped by local expert, their probs)``: the dispatch output already is that layout
        (padding rows and probs are zero)."""
        probs = self.dispatched_probs
        if self.router_dtype == "fp64":
            probs = probs.to(torch.float64)
        return hidden_states, probs

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`get_permuted_hidden_states_by_experts`: an identity, but after a receive bound, which
        dropped rows: the experts' rows go back into the dispatch's worst-case tensor, zero past the bound, so combine
        sees the dispatch's row count (no new worst-case tensor: see :class:`_RestoreRows`)."""
        if self._bound_slot is not None:
            hidden_states = _RestoreRows.apply(hidden_states, self._bound_slot)
        return hidden_states

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """Rows per local expert (alignment-padded for expand): int64, on the CPU, or on the device
        without host sync."""
        return self.tokens_per_expert

    def combine(
        self,
        hidden_states: torch.Tensor,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ) -> torch.Tensor:
        """Sums every token's expert outputs back on its rank and releases the routing state (the router's probs too:
        they hold the step's autograd graph, which a later CUDA-graph capture must not see).

        Args:
            hidden_states: Expert outputs in the dispatch's receive layout.
            async_finish: Megatron's flag; see :meth:`dispatch`.
            allocate_on_comm_stream: Megatron's flag; see :meth:`dispatch`.

        Returns:
            ``[T, H]`` combined tokens.
        """
        combined = ops.CombineFunction.apply(hidden_states, self.handle, SYNC)
        self.token_indices = None
        self.token_probs = None
        self.handle = None
        self.dispatched_indices = None
        self.dispatched_probs = None
        self._bound_slot = None
        return combined


class _BoundSlot:
    """One bounded dispatch's worst-case tensors, handed from :class:`_KeepRows` to :class:`_RestoreRows` in forward
    and back in backward (each call its own slot: micro-batches in flight do not share one).

    Attributes:
        bound: Rows the experts keep.
        num_rows: Rows of the dispatch (its worst case without host sync).
        buffer: Forward: the dispatch's worst-case receive (detached) until the restore reuses it.
        grad: Backward: the combine backward's worst-case gradient, for the dispatch backward to reuse.
    """

    __slots__ = ("bound", "num_rows", "buffer", "grad")

    def __init__(self, bound: int, num_rows: int) -> None:
        self.bound = bound
        self.num_rows = num_rows
        self.buffer: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None


def _only_holder(tensor: torch.Tensor) -> bool:
    """Whether nothing but ``tensor`` (and its base, if it is a view) holds its storage: no other tensor or view of
    it is alive anywhere. A host-side count; False where this PyTorch cannot count."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    storage = tensor.untyped_storage()
    # Holders: ``tensor``, the ``storage`` object just made, and the base a view keeps alive.
    return use_count(storage._cdata) == 2 + (tensor._base is not None)


class _KeepRows(torch.autograd.Function):
    """Forward: copies of the first ``slot.bound`` received rows and probabilities, what the experts keep for
    backward; the worst-case receive goes into ``slot.buffer`` for :class:`_RestoreRows` (and is freed after it).

    Backward: the worst-case gradient the dispatch backward reads, the kept rows' gradients and zeros past the
    bound. It is the combine backward's gradient that :class:`_RestoreRows` left in the slot when no view of it is
    still alive (the experts' backward is done; a delayed weight gradient may still hold one), else a new tensor.
    """

    @staticmethod
    def forward(ctx: Any, recv_x: torch.Tensor, probs: torch.Tensor, slot: _BoundSlot):  # type: ignore[override]
        bound = slot.bound
        slot.buffer = recv_x.detach()
        ctx.slot = slot
        ctx.set_materialize_grads(False)
        return recv_x[:bound].clone(), probs[:bound].clone()

    @staticmethod
    def backward(ctx: Any, grad_x: Optional[torch.Tensor], grad_probs: Optional[torch.Tensor]):
        slot: _BoundSlot = ctx.slot
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


class _RestoreRows(torch.autograd.Function):
    """Forward: the experts' ``[bound, H]`` output written into the dispatch's worst-case receive (which nothing reads
    any more), zeros past the bound: combine's input, without a new worst-case tensor. Backward: the combine
    backward's gradient of the kept rows (a view), the whole gradient left in the slot for :class:`_KeepRows`."""

    @staticmethod
    def forward(ctx: Any, expert_out: torch.Tensor, slot: _BoundSlot):  # type: ignore[override]
        buffer, bound = slot.buffer, slot.bound
        slot.buffer = None
        if buffer is None or buffer.dtype != expert_out.dtype or buffer.shape[1] != expert_out.shape[1]:
            # Restored twice, or the experts changed the dtype or width: a new tensor, as a pad would make.
            buffer = expert_out.new_empty((slot.num_rows, expert_out.shape[1]))
        buffer[:bound].copy_(expert_out)
        buffer[bound:].zero_()
        ctx.slot = slot
        return buffer

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        slot: _BoundSlot = ctx.slot
        slot.grad = grad
        return grad[:slot.bound], None
