"""What deepepv2 reads off a Megatron ``TransformerConfig`` (its experts' row alignment, its SM count), and the
rules on one whose MoE layers use deepepv2: the combinations this package does not support, each refused with an
error that says what to change, when the layer (or its experts) is built.

Naming, as :mod:`megatron_deepepv2.validation`'s: ``check_*`` raises.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_deepepv2.validation import fp8_hidden_size_problem


def alignment_for(config: Any) -> int:
    """Row alignment the experts of Megatron ``config`` need (grouped GEMM, quantization); at least 1."""
    # Imported here: importing this module must not import megatron.core (install() runs before that import).
    from megatron.core.transformer.moe import moe_utils  # noqa: PLC0415

    return max(int(moe_utils.get_align_size_for_quantization(config)), 1)


def configured_num_sms(config: Any) -> int:
    """Megatron's SM count for the dispatcher kernels: ``config.moe_flex_dispatcher_num_sms`` where it exists (None =
    unset), else ``config.moe_deepep_num_sms`` (its default, 20, counts as set); 0 when unset."""
    if hasattr(config, "moe_flex_dispatcher_num_sms"):
        return int(config.moe_flex_dispatcher_num_sms or 0)
    return int(getattr(config, "moe_deepep_num_sms", 0) or 0)


def check_megatron_config(config: Any) -> None:
    """Raises a ValueError, saying what to change, for a ``TransformerConfig`` selecting deepepv2 in a combination it
    does not support."""
    if getattr(config, "moe_enable_deepep", False):
        raise ValueError(
            "moe_enable_deepep=True selects the DeepEP v1 backend but moe_flex_dispatcher_backend='deepepv2' "
            "was also given. Drop --moe-enable-deepep (deprecated) and keep --moe-flex-dispatcher-backend deepepv2.")
    rank_capacity_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if rank_capacity_factor is not None and not rank_capacity_factor > 0:
        raise ValueError(f"moe_expert_rank_capacity_factor={rank_capacity_factor} must be a positive factor of the "
                         "per-rank receive (tokens per rank x top-k), or unset for a dropless receive.")
    if getattr(config, "moe_paged_stash", False):
        raise ValueError(
            "moe_paged_stash is not supported with moe_flex_dispatcher_backend='deepepv2'. Megatron's paged stash "
            "pages only the Transformer Engine grouped tensors that TEGroupedMLP's op-fuser path saves for backward "
            "(--use-transformer-engine-op-fuser --moe-grouped-gemm), and that paging has never run with deepepv2: "
            "SyncFreeSequentialMLP, SequentialMLP and TEGroupedMLP without the op fuser save plain tensors, which "
            "paged stash leaves in place. Drop --moe-paged-stash: --moe-expert-rank-capacity-factor alone bounds "
            "the experts' receive, and Megatron's over-budget rerun (a dropless rerun of a step that dropped tokens) "
            "works with deepepv2.")
    if config.num_moe_experts is None:
        return
    if config.moe_token_dispatcher_type != "flex":
        raise ValueError(
            f"moe_flex_dispatcher_backend='deepepv2' requires moe_token_dispatcher_type='flex' (got "
            f"{config.moe_token_dispatcher_type!r}); pass --moe-token-dispatcher-type flex.")
    if config.moe_pad_expert_input_to_capacity:
        raise ValueError(
            "Flex token dispatcher with the deepepv2 backend does not support moe_pad_expert_input_to_capacity; "
            "drop --moe-pad-expert-input-to-capacity (capacity dropping with --moe-expert-capacity-factor works).")


def check_fp8_model(config: Any) -> None:
    """Raises for a ``TransformerConfig`` whose layers dispatch in FP8: a TypeError if the model does not train in
    BF16, a ValueError if its hidden size is not a multiple of 128."""
    bf16 = bool(getattr(config, "bf16", False)) or getattr(config, "params_dtype", None) == torch.bfloat16
    if not bf16:
        raise TypeError("FP8 dispatch (MEGATRON_DEEPEPV2_FP8_DISPATCH=1) quantises BF16 hidden states; this model "
                        "does not train in BF16. Add --bf16 or turn FP8 dispatch off.")
    problem = fp8_hidden_size_problem(config.hidden_size)
    if problem is not None:
        raise problem


def check_sync_free_experts(config: Any, expert_tp_size: int) -> None:
    """Raises a ValueError for what a ``TransformerConfig`` asks of ``SyncFreeSequentialMLP`` experts that they lack:
    expert tensor parallelism, biases, FP8/FP4, delayed weight gradients or TE's activation."""
    if expert_tp_size > 1:
        raise ValueError("SyncFreeSequentialMLP supports expert tensor parallel size 1; set "
                         "--expert-tensor-parallel-size 1.")
    if config.add_bias_linear:
        raise ValueError("SyncFreeSequentialMLP supports experts without bias; pass --disable-bias-linear.")
    if config.fp8 or config.fp4:
        raise ValueError("SyncFreeSequentialMLP runs BF16/FP32 grouped GEMMs; drop --fp8-format / --fp4-format for "
                         "its experts; for FP8 experts use TEGroupedMLP (--moe-grouped-gemm) with host sync.")
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError("SyncFreeSequentialMLP computes weight gradients in backward; unset --delay-wgrad-compute.")
    if getattr(config, "use_te_activation_func", False):
        raise ValueError("SyncFreeSequentialMLP applies config.activation_func itself; unset --use-te-activation-func.")
