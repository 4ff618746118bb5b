"""``_DeepepV2Manager``, the dispatch manager of ``--moe-flex-dispatcher-backend deepepv2``: the flex dispatcher's
stages over :mod:`megatron_deepepv2.ops` in the expand layout (permute and unpermute are identities) and the receive
bound of ``moe_expert_rank_capacity_factor``; and the policy mapping a ``TransformerConfig`` onto a dispatch config.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import _DispatchManager

from megatron_deepepv2 import ops
from megatron_deepepv2.backends.base import SYNC, DispatchConfig, DispatchHandle
from megatron_deepepv2.layout import ExpertLayout, receive_bound_rows
from megatron_deepepv2.mcore import bounded_receive, megatron_config

logger = logging.getLogger(__name__)
_warned_low_precision_probs = False


def dispatch_config_for(config: Any) -> DispatchConfig:
    """The dispatch configuration of Megatron ``config``, resolved once and cached on it (layers of one config share
    it): expand layout (padding rows zero), :func:`~.megatron_config.alignment_for`,
    :func:`~.megatron_config.configured_num_sms` (else the setting),
    deterministic with the setting or ``config.deterministic_mode``; no id check, weight masking or tail clearing.

    Args:
        config: A Megatron ``TransformerConfig``.

    Returns:
        The configuration every deepepv2 layer built from ``config`` dispatches with.

    Raises:
        ValueError: For an out-of-range setting, a mode the backend cannot run, or FP8 with hidden size % 128 != 0.
        TypeError: If FP8 dispatch is asked for by a model that does not train in BF16.
        ImportError: If the configured backend was named explicitly and cannot run.
    """
    resolved = getattr(config, "_deepepv2_dispatch_config", None)
    if resolved is not None:
        return resolved
    resolved = ops.resolve_config(  # None leaves the process-wide setting
        layout=ExpertLayout.EXPAND, expert_alignment=megatron_config.alignment_for(config),
        num_sms=megatron_config.configured_num_sms(config) or None,
        deterministic=bool(getattr(config, "deterministic_mode", False)) or None,
        check_ids=False, mask_foreign_weights=False, clear_tail=False)
    if resolved.settings.fp8_dispatch:
        megatron_config.check_fp8_model(config)
    object.__setattr__(config, "_deepepv2_dispatch_config", resolved)
    return resolved


class _DeepepV2Manager(_DispatchManager):
    """Dispatch manager for ``--moe-flex-dispatcher-backend deepepv2``, built as Megatron's flex dispatcher builds
    its managers.

    Args:
        group: The TPxEP process group.
        num_local_experts: Experts on this rank.
        router_topk: Experts per token (``K``).
        num_experts: Experts over ``group`` (``tp *`` Megatron's).
        config: The ``TransformerConfig``.

    Raises:
        ValueError, TypeError, ImportError: As :func:`dispatch_config_for` and :func:`megatron_deepepv2.ops.bind`.
    """

    def __init__(self, group: dist.ProcessGroup, num_local_experts: int, router_topk: int, num_experts: int,
                 config: Any) -> None:
        self.group = group
        self.num_local_experts = num_local_experts
        self.config = config
        self.router_topk = router_topk
        self.num_experts = num_experts
        self.router_dtype = config.moe_router_dtype
        self.capacity_factor = config.moe_expert_capacity_factor
        self.dispatch_config = dispatch_config_for(config)
        self.binding = ops.bind(self.dispatch_config, group, num_experts)
        #: None = dropless. Read at every dispatch: Megatron's over-budget rerun sets it to None, then restores it.
        self.moe_expert_rank_capacity_factor: Optional[float] = getattr(config, "moe_expert_rank_capacity_factor", None)
        self._bound_slot: Optional[bounded_receive.BoundSlot] = None
        self.token_indices: Optional[torch.Tensor] = None
        self.token_probs: Optional[torch.Tensor] = None
        self.handle: Optional[DispatchHandle] = None
        self.dispatched_indices: Optional[torch.Tensor] = None
        self.dispatched_probs: Optional[torch.Tensor] = None
        self.tokens_per_expert: Optional[torch.Tensor] = None

    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor) -> None:
        """Sets ``token_indices`` (``torch.topk`` ids: in ``[0, E)``, distinct within a row) and ``token_probs``, both
        ``[T, K]``; with a capacity factor, selections the router dropped (prob 0) get id ``-1``.

        Args:
            routing_map: ``[T, E]`` bool: only its token count is read.
            probs: ``[T, E]`` router probabilities, zero where not selected.
        """
        num_tokens = routing_map.shape[0]
        probs = probs.reshape(num_tokens, self.num_experts)
        self.token_probs, self.token_indices = torch.topk(probs, self.router_topk, dim=-1)
        if self.capacity_factor is not None:
            self.token_indices = self.token_indices.masked_fill(self.token_probs == 0, -1)

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Returns the ``[N, H]`` rows this rank's experts receive, in the expand layout (``N`` at most
        :meth:`receive_bound` with a bound); keeps the routing for the later stages.

        Args:
            hidden_states: ``[T, H]`` tokens.
            async_finish, allocate_on_comm_stream: Unused: every call is synchronous (``backends.base.SYNC``).
        """
        global _warned_low_precision_probs
        if self.token_probs.dtype != torch.float32:
            if self.token_probs.dtype in (torch.bfloat16, torch.float16) and not _warned_low_precision_probs:
                logger.warning("deepepv2 dispatches fp32 probs; set --moe-router-dtype fp32 to avoid a cast.")
                _warned_low_precision_probs = True
            self.token_probs = self.token_probs.float()
        # apply() takes no keywords: (x, topk_weights, binding, topk_idx, scales: None for BF16 rows, streams).
        recv_x, self.dispatched_probs, _, self.dispatched_indices, self.handle = ops.DispatchFunction.apply(
            hidden_states.contiguous(), self.token_probs, self.binding, self.token_indices, None, SYNC)
        if self.dispatch_config.host_sync:  # the counts are on the host already: the dispatch read them
            self.tokens_per_expert = torch.tensor(self.handle.tokens_per_expert_list, dtype=torch.int64)
        else:
            self.tokens_per_expert = self.handle.tokens_per_expert
        self._bound_slot = None
        if self.moe_expert_rank_capacity_factor is not None:
            return self._apply_receive_bound(recv_x, self.handle)
        return recv_x

    def receive_bound(self, handle: DispatchHandle) -> int:
        """Returns the rows the experts receive at most under ``moe_expert_rank_capacity_factor``, HybridEP's budget
        (padding counts against it): ``align(int(T * K * factor), alignment)`` for ``T = handle.num_tokens`` and ``K =
        router_topk``, at most ``handle.num_recv_rows``.

        Args:
            handle: The dispatch's handle.
        """
        bound = receive_bound_rows(handle.num_tokens, self.router_topk, self.moe_expert_rank_capacity_factor,
                                   self.dispatch_config.expert_alignment)
        return min(bound, handle.num_recv_rows)

    def _apply_receive_bound(self, recv_x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Returns the experts' rows under :meth:`receive_bound` (:func:`~.bounded_receive.keep_bounded_rows`),
        counting dropped selections in ``dropped_rows`` / ``over_budget`` on the device."""
        bound = self.receive_bound(handle)
        if not hasattr(self, "over_budget"):  # made lazily: Megatron's budget hooks test hasattr
            self.over_budget = torch.zeros(1, dtype=torch.bool, device=recv_x.device)
            self.dropped_rows = torch.zeros(1, dtype=torch.int64, device=recv_x.device)
        if bound >= handle.num_recv_rows:
            return recv_x  # the dispatch's rows fit: nothing to bound
        kept_x, self.dispatched_probs, self.tokens_per_expert, self._bound_slot = bounded_receive.keep_bounded_rows(
            recv_x, self.dispatched_probs, self.tokens_per_expert, handle, bound, self.dropped_rows, self.over_budget)
        return kept_x

    def reset_over_budget(self) -> None:
        """Clears ``over_budget`` and ``dropped_rows``, if a bound made them."""
        if hasattr(self, "over_budget"):
            self.over_budget.fill_(False)
            self.dropped_rows.zero_()

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """Returns ``(hidden_states [N, H], probs [N])``: the received rows, already grouped by local expert, and their
        fp32 weights (float64 for an fp64 router)."""
        probs = self.dispatched_probs
        if self.router_dtype == "fp64":
            probs = probs.to(torch.float64)
        return hidden_states, probs

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Returns combine's input: ``hidden_states`` (the experts' ``[N, H]`` outputs), or with a receive bound the
        dispatch's ``[N_received, H]``, zero past the bound."""
        if self._bound_slot is not None:
            hidden_states = bounded_receive.RestoreRows.apply(hidden_states, self._bound_slot)
        return hidden_states

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        """Rows per local expert, padding included: int64, on the CPU, or on the device without host sync."""
        return self.tokens_per_expert

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = False,
                allocate_on_comm_stream: bool = False) -> torch.Tensor:
        """Returns ``[T, H]``: each token's expert outputs summed back on its rank. Releases the routing state.

        Args:
            hidden_states: Expert outputs in the dispatch's receive layout.
            async_finish, allocate_on_comm_stream: Unused; see :meth:`dispatch`.
        """
        combined = ops.CombineFunction.apply(hidden_states, self.handle, SYNC)
        self.token_indices = None
        self.token_probs = None  # holds the step's autograd graph: a later CUDA-graph capture must not see it
        self.handle = None
        self.dispatched_indices = None
        self.dispatched_probs = None
        self._bound_slot = None
        return combined
