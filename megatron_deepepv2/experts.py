"""Experts for the no-host-sync mode: which Megatron expert modules take device-side token counts.

Without host sync (``MEGATRON_DEEPEPV2_NO_HOST_SYNC=1``) the deepepv2 dispatcher hands the experts the
worst-case expand buffer (expert blocks first, then unused rows) and ``tokens_per_expert`` as a device
tensor. An expert module must then process only the rows the counts cover, without reading the counts
on the host:

=====================================================  ==========================================================
expert module                                          no-host-sync support
=====================================================  ==========================================================
:class:`SyncFreeSequentialMLP` (this module)            yes: one ``torch._grouped_mm`` per projection over the
                                                       stacked weights of Megatron's ``SequentialMLP`` experts
``TEGroupedMLP`` with ``use_transformer_engine_op_fuser``  yes (megatron-core >= 0.19 with Transformer Engine):
and ``moe_grouped_gemm``                               the fused grouped MLP takes device counts, as Megatron's
                                                       own NCCL-EP static-shape mode requires
``TEGroupedMLP`` without the op fuser, ``SequentialMLP``  no: they split with ``tokens_per_expert.tolist()``
=====================================================  ==========================================================

:func:`check_experts_take_device_counts` raises for the unsupported ones (the Megatron integration calls
it when a deepepv2 ``MoELayer`` is built in this mode).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

NO_HOST_SYNC_EXPERTS_HINT = (
    "With MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 the experts must take tokens_per_expert as a device tensor: use "
    "megatron_deepepv2.experts.SyncFreeSequentialMLP as the experts module of the layer spec, or "
    "TEGroupedMLP with --moe-grouped-gemm --use-transformer-engine-op-fuser (megatron-core >= 0.19 with "
    "Transformer Engine). Or unset MEGATRON_DEEPEPV2_NO_HOST_SYNC."
)


def _uses_te_op_fuser(experts: Any) -> bool:
    # _with_fused_impl (megatron-core >= 0.19) is set from use_transformer_engine_op_fuser; TEGroupedMLP is
    # what moe_grouped_gemm builds.
    return isinstance(experts, TEGroupedMLP) and bool(getattr(experts, "_with_fused_impl", False))


def no_host_sync_problem(experts: Any) -> Optional[str]:
    """Says why ``experts`` cannot run without host sync, or None when it can.

    Args:
        experts: The ``experts`` module of a ``MoELayer``.

    Returns:
        A sentence naming the module and the fix, or None.
    """
    if isinstance(experts, SyncFreeSequentialMLP) or _uses_te_op_fuser(experts):
        return None
    return (
        f"{type(experts).__name__} reads tokens_per_expert on the host (a device-to-host sync each step). "
        + NO_HOST_SYNC_EXPERTS_HINT
    )


def check_experts_take_device_counts(experts: Any) -> None:
    """Raises when ``experts`` cannot consume the no-host-sync dispatch output.

    Raises:
        ValueError: Naming the expert module and what to use instead.
    """
    problem = no_host_sync_problem(experts)
    if problem is not None:
        raise ValueError(problem)


class SyncFreeSequentialMLP(SequentialMLP):
    """``SequentialMLP`` whose forward never reads ``tokens_per_expert`` on the host.

    The parameters, their names, initialisation and checkpoint layout are exactly ``SequentialMLP``'s
    (one Megatron ``MLP`` per local expert), so checkpoints move freely between the two. The forward
    stacks the experts' weights and runs one ``torch._grouped_mm`` per projection with the expert
    offsets computed on the device: rows past the last expert block (the no-host-sync worst-case tail)
    are neither read nor written -- their outputs and input gradients are zero.

    Supported: expert tensor parallelism 1, linear layers without bias, BF16/FP32 (no FP8/FP4), any
    activation ``MLP`` supports through ``config.activation_func`` / ``gated_linear_unit``. Numerics
    equal ``SequentialMLP``'s up to GEMM rounding (a grouped GEMM instead of one GEMM per expert).

    Args:
        num_local_experts: Experts on this rank.
        config: Megatron ``TransformerConfig``.
        submodules: ``MLPSubmodules`` of each expert (the local spec's).
        pg_collection: Process groups (``ep``, ``expt_tp``, ``expt_dp``).
        **kwargs: Further ``SequentialMLP`` arguments of the installed release (e.g. ``name`` from 0.18).

    Raises:
        ValueError: For a configuration outside the supported set, saying what to change.
    """

    def __init__(self, num_local_experts: int, config: Any, submodules: Any, pg_collection=None, **kwargs) -> None:
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
        tp_group = getattr(self, "tp_group", None)
        if tp_group is not None and tp_group.size() > 1:
            raise ValueError(
                "SyncFreeSequentialMLP supports expert tensor parallel size 1; set --expert-tensor-parallel-size 1."
            )
        if self.config.add_bias_linear:
            raise ValueError("SyncFreeSequentialMLP supports experts without bias; pass --disable-bias-linear.")
        if self.config.fp8 or self.config.fp4:
            raise ValueError(
                "SyncFreeSequentialMLP runs BF16/FP32 grouped GEMMs; for FP8/FP4 without host sync use TEGroupedMLP "
                "with --use-transformer-engine-op-fuser."
            )

    def _activation(self, intermediate: torch.Tensor) -> torch.Tensor:
        """``MLP``'s unfused activation (GLU with its clamp and offset, or the plain activation)."""
        config = self.config
        if not config.gated_linear_unit:
            return config.activation_func(intermediate)
        x_glu, x_linear = torch.chunk(intermediate, 2, dim=-1)
        if (clamp := getattr(config, "activation_func_clamp_value", None)) is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return config.activation_func(x_glu) * (x_linear + getattr(config, "glu_linear_offset", 0.0))

    def forward(
        self,
        permuted_local_hidden_states: torch.Tensor,
        tokens_per_expert: torch.Tensor,
        permuted_probs: torch.Tensor,
    ) -> tuple[torch.Tensor, None]:
        """Runs every local expert on its row block.

        Args:
            permuted_local_hidden_states: ``[N, H]`` rows grouped by expert; rows past the blocks are ignored.
            tokens_per_expert: ``[E_local]`` rows per expert (device or host tensor, never read on the host).
            permuted_probs: ``[N]`` router probability of each row.

        Returns:
            ``([N, H]`` outputs, zero past the blocks; ``None`` bias).
        """
        hidden = permuted_local_hidden_states
        if self.config.moe_apply_probs_on_input:
            hidden = (permuted_probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        counts = tokens_per_expert.to(device=hidden.device, dtype=torch.int64)
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        in_blocks = (torch.arange(hidden.shape[0], device=hidden.device) < offsets[-1]).unsqueeze(1)
        hidden = torch.where(in_blocks, hidden, 0)

        # [E, out, in] weights; transposed views give the column-major [E, in, out] grouped GEMM operand.
        fc1 = torch.stack([expert.linear_fc1.weight for expert in self.local_experts])
        fc2 = torch.stack([expert.linear_fc2.weight for expert in self.local_experts])
        intermediate = torch._grouped_mm(hidden, fc1.transpose(1, 2), offs=offsets)
        intermediate = self._activation(intermediate)
        intermediate = (intermediate * permuted_probs.unsqueeze(-1)).to(hidden.dtype)
        output = torch._grouped_mm(intermediate, fc2.transpose(1, 2), offs=offsets)
        return torch.where(in_blocks, output, 0), None
