"""How a Megatron ``TransformerConfig`` maps onto a deepepv2 dispatch: the Megatron-facing policy, decided once.

The manager (:mod:`megatron_deepepv2.manager`) and the patches (:mod:`megatron_deepepv2.integration`) ask this module
the same questions -- which alignment, how many SMs, whether to sync the host -- so each has one answer:
:func:`dispatch_config_for` resolves the layer's :class:`~megatron_deepepv2.ops.DispatchConfig` on first use and
keeps it on the config object. Megatron layers dispatch in the expand layout: DeepEP's per-expert blocks, aligned
and zero-padded for the grouped GEMMs, so permute and unpermute are identities and the experts must not pad again.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe import moe_utils

from megatron_deepepv2 import fp8, ops
from megatron_deepepv2.backends import ExpertLayout
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
        ValueError: If the layout setting is not expand, the backend cannot run the mode, or FP8 dispatch is asked
            for with a hidden size that is not a multiple of 128.
        TypeError: If FP8 dispatch is asked for by a model that does not train in BF16.
        ImportError: If the configured backend was named explicitly and cannot run.
    """
    resolved = getattr(config, "_deepepv2_dispatch_config", None)
    if resolved is not None:
        return resolved
    settings = get_settings()
    if settings.layout is not ExpertLayout.EXPAND:
        raise ValueError(
            f"MEGATRON_DEEPEPV2_LAYOUT={settings.layout.value}: Megatron layers dispatch in the expand layout only "
            "(set MEGATRON_DEEPEPV2_LAYOUT=expand, the default). The compact layout needs Megatron's multihot "
            "conversion and permute after the exchange, which synchronise the host three times per step and cost "
            "more than DeepEP's own expand epilogue (docs/benchmarks.md). It stays available to direct callers of "
            "megatron_deepepv2.dispatch(layout='compact').")
    resolved = ops.DispatchConfig.resolve(
        layout=ExpertLayout.EXPAND,
        expert_alignment=alignment_for(config),
        zero_padding=True,
        # One SM count for dispatch and combine, forward and backward (combine and cached dispatch reuse the
        # count the dispatch recorded in its handle).
        num_sms=configured_num_sms(config) or settings.num_sms or 0,
        deterministic=settings.deterministic or bool(getattr(config, "deterministic_mode", False)),
        # No id check, foreign-weight mask or tail clearing: no consumer of a Megatron layer reads what they write.
        **ops.WITHOUT_DIRECT_CALL_PASSES,
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
