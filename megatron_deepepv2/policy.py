"""How a Megatron ``TransformerConfig`` maps onto a deepepv2 dispatch: the Megatron-facing policy, decided once.

The manager (:mod:`megatron_deepepv2.manager`) and the patches (:mod:`megatron_deepepv2.integration`) ask this module
the same questions -- which layout, which alignment, how many SMs, whether the experts must pad again -- so each
has one answer: :func:`dispatch_config_for` resolves the layer's :class:`~megatron_deepepv2.ops.DispatchConfig` on
first use and keeps it on the config object.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from megatron.core.transformer.moe import moe_utils

from megatron_deepepv2 import fp8, ops
from megatron_deepepv2.backends import ExpertLayout, uninitialized_memory_fill_off
from megatron_deepepv2.config import get_settings


def alignment_for(config) -> int:
    """Row alignment the experts need (grouped-GEMM / quantization), 1 when none."""
    return max(int(moe_utils.get_align_size_for_quantization(config)), 1)


def configured_num_sms(config) -> int:
    """Megatron's SM setting for the dispatcher kernels, 0 when unset.

    ``moe_flex_dispatcher_num_sms`` on megatron-core >= 0.19 (default None = unset, then the package's
    ``num_sms`` setting applies); ``moe_deepep_num_sms`` before, whose Megatron default 20 always counts as set.
    """
    if hasattr(config, "moe_flex_dispatcher_num_sms"):
        return int(config.moe_flex_dispatcher_num_sms or 0)
    return int(getattr(config, "moe_deepep_num_sms", 0) or 0)


def permute_pads(config) -> bool:
    """Whether Megatron's permute pads per-expert blocks itself (TE fused permute-and-pad with an align size)."""
    return bool(
        config.moe_permute_fusion
        and getattr(moe_utils, "fused_permute_and_pad_with_probs", None) is not None
        and moe_utils.get_align_size_for_quantization(config) > 0
    )


def dispatch_config_for(config) -> ops.DispatchConfig:
    """The deepepv2 dispatch configuration of a Megatron ``TransformerConfig``: resolved once, then carried.

    Resolved from the process-wide settings and the config (layout, alignment, SMs, host sync, determinism,
    capacity, backend) on first use and kept on the config object, so every layer built from it and every
    Megatron patch that asks about it see the same answer, however the settings change later.

    Args:
        config: Megatron ``TransformerConfig`` of a deepepv2 MoE layer.

    Returns:
        The configuration.

    Raises:
        ValueError: If no-host-sync mode is asked for with the compact layout, the backend cannot run the mode, or
            FP8 dispatch is asked for with a hidden size that is not a multiple of 128.
        TypeError: If FP8 dispatch is asked for by a model that does not train in BF16.
        ImportError: If the configured backend was named explicitly and cannot run.
    """
    resolved = getattr(config, "_deepepv2_dispatch_config", None)
    if resolved is not None:
        return resolved
    settings = get_settings()
    layout = settings.layout
    if settings.no_host_sync and layout is ExpertLayout.COMPACT:
        raise ValueError(
            "MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 needs the expand layout: the compact layout goes through "
            "Megatron's permute, which sizes its output on the host. Set MEGATRON_DEEPEPV2_LAYOUT=expand."
        )
    expand = layout is ExpertLayout.EXPAND
    resolved = ops.DispatchConfig.resolve(
        layout=layout,
        expert_alignment=alignment_for(config) if expand else 1,
        zero_padding=expand,
        # One SM count for dispatch and combine, forward and backward (combine and cached dispatch reuse the
        # count the dispatch recorded in its handle).
        num_sms=configured_num_sms(config) or settings.num_sms or 0,
        deterministic=settings.deterministic or bool(getattr(config, "deterministic_mode", False)),
        # Passes whose results no consumer here reads: Megatron's multihot conversion ignores the entries of other
        # ranks' experts; the experts stop at the device counts, and combine ignores rows past them.
        mask_foreign_weights=False,
        clear_tail=False,
        # The manager's ids come from torch.topk (setup_metadata): in range and distinct by construction.
        check_ids=False,
    )
    if resolved.fp8_dispatch:  # at layer construction, not mid-step
        bf16 = bool(getattr(config, "bf16", False)) or getattr(config, "params_dtype", None) == torch.bfloat16
        if not bf16:
            raise TypeError("FP8 dispatch (MEGATRON_DEEPEPV2_FP8_DISPATCH=1) quantises BF16 hidden states; this model "
                            "does not train in BF16. Add --bf16 or turn FP8 dispatch off.")
        problem = fp8.fp8_hidden_size_problem(config.hidden_size)
        if problem is not None:
            raise problem
    object.__setattr__(config, "_deepepv2_dispatch_config", resolved)
    return resolved


def dispatcher_pads_for_experts(config) -> bool:
    """Whether the deepepv2 path hands experts already-padded blocks (so experts must not pad again).

    Args:
        config: Megatron ``TransformerConfig``.

    Returns:
        True for the expand layout (DeepEP's ``expert_alignment``), and for the compact layout when
        Megatron's fused permute pads.
    """
    return dispatch_config_for(config).layout is ExpertLayout.EXPAND or permute_pads(config)


@contextlib.contextmanager
def deterministic_algorithms() -> Iterator[None]:
    """Enables torch's deterministic algorithms for the block, without filling uninitialised memory.

    ``fill_uninitialized_memory`` stays off because DeepEP rejects it (and it is not needed for
    reproducibility of results that never read uninitialised memory). Both settings are restored.
    """
    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    with uninitialized_memory_fill_off():
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)
