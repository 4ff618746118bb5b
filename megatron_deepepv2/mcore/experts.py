"""Grouped-GEMM experts for the deepepv2 path, and which Megatron expert modules take device-side counts.

:class:`SyncFreeSequentialMLP` is Megatron's ``SequentialMLP`` (same parameters, initialisation and checkpoint
keys) computed as two grouped GEMMs with fused activation kernels: it is the fast choice for users without
Transformer Engine in both modes, with or without host sync (:func:`with_sync_free_experts` puts it into a
layer spec).

Without host sync (``MEGATRON_DEEPEPV2_NO_HOST_SYNC=1``) the deepepv2 dispatcher hands the experts the
worst-case expand buffer (expert blocks first, then unused rows) and ``tokens_per_expert`` as a device
tensor. An expert module must then process only the rows the counts cover, without reading the counts
on the host:

=====================================================  ==========================================================
expert module                                          no-host-sync support
=====================================================  ==========================================================
:class:`SyncFreeSequentialMLP` (this module)            yes: one ``torch._grouped_mm`` per projection over
                                                       the experts' stacked weights, rows past the blocks skipped
``TEGroupedMLP`` with ``use_transformer_engine_op_fuser``  only where Transformer Engine's ``GroupedLinear`` op takes
and ``moe_grouped_gemm``                               its graph-safe grouped-tensor path (TE's
                                                       ``is_op_fuser_grouped_tensor_path_supported``: BF16/FP16 or
                                                       FP8 current scaling, SM90+, cuBLASLt >= 13.4 on Hopper);
                                                       elsewhere TE splits the rows with ``tolist()`` and the layer
                                                       is refused. Accepted, never run (the GPUs tested had
                                                       cuBLASLt 13.1); with host sync it runs
``TEGroupedMLP`` without the op fuser, ``SequentialMLP``  no: they split with ``tokens_per_expert.tolist()``
=====================================================  ==========================================================

:func:`check_experts_take_device_counts` raises for the unsupported ones (the Megatron integration calls
it when a deepepv2 ``MoELayer`` is built in this mode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
from typing import Any, Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

from megatron_deepepv2 import kernels
from megatron_deepepv2.mcore import expert_kernels
from megatron_deepepv2.mcore import megatron_config

logger = logging.getLogger(__name__)
_warned_never_run_op_fuser = False

NO_HOST_SYNC_EXPERTS_HINT = (
    "With MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 the experts must take tokens_per_expert as a device tensor: use "
    "megatron_deepepv2.mcore.experts.SyncFreeSequentialMLP as the experts module of the layer spec (for an unchanged "
    "script with the local or Transformer Engine spec: MEGATRON_DEEPEPV2_EXPERTS=sync_free), or unset "
    "MEGATRON_DEEPEPV2_NO_HOST_SYNC."
)


def _uses_te_op_fuser(experts: Any) -> bool:
    # _with_fused_impl (megatron-core >= 0.19) is set from use_transformer_engine_op_fuser; TEGroupedMLP is
    # what moe_grouped_gemm builds.
    return isinstance(experts, TEGroupedMLP) and bool(getattr(experts, "_with_fused_impl", False))


def te_op_fuser_host_split_reason(config: Any) -> Optional[str]:
    """Why Transformer Engine's op-fuser ``GroupedLinear`` would read the expert counts on the host for ``config``'s
    experts on this GPU, or None when it takes its graph-safe grouped-tensor path (device counts).

    TE decides per call by dtype and quantization recipe (``is_op_fuser_grouped_tensor_path_supported``); its other
    path splits the rows with ``split_sizes.tolist()`` and needs exactly ``sum(split_sizes)`` rows.

    Args:
        config: Megatron ``TransformerConfig`` of the layer.

    Returns:
        A sentence naming what TE lacks here, or None.
    """
    try:
        from transformer_engine.pytorch.ops.basic.grouped_linear import (  # noqa: PLC0415
            is_op_fuser_grouped_tensor_path_supported,
        )
    except ImportError:
        return "this Transformer Engine has no graph-safe grouped-tensor path for its op-fuser GroupedLinear"
    recipe = None
    if config.fp8:
        from megatron.core.fp8_utils import get_fp8_recipe  # noqa: PLC0415

        recipe = get_fp8_recipe(config)
    elif config.fp4:
        from megatron.core.fp4_utils import get_fp4_recipe  # noqa: PLC0415

        recipe = get_fp4_recipe(config)
    if is_op_fuser_grouped_tensor_path_supported(recipe, config.params_dtype):
        return None
    import transformer_engine_torch as tex  # noqa: PLC0415

    version = tex.get_cublasLt_version()
    return (f"Transformer Engine's op-fuser GroupedLinear splits the rows with tokens_per_expert.tolist() here: its "
            f"graph-safe grouped-tensor path needs BF16/FP16 or FP8 current scaling on SM90+ and cuBLASLt >= 13.4 "
            f"on Hopper (this GPU: SM{''.join(map(str, torch.cuda.get_device_capability()))}, cuBLASLt "
            f"{version // 10000}.{version // 100 % 100}, params {config.params_dtype}, FP8 recipe "
            f"{type(recipe).__name__ if recipe is not None else 'none'})")


def device_counts_unavailable_reason(experts: Any) -> Optional[str]:
    """Says why ``experts`` cannot run without host sync, or None when it can.

    Args:
        experts: The ``experts`` module of a ``MoELayer``.

    Returns:
        A sentence naming the module and the fix, or None.
    """
    if isinstance(experts, SyncFreeSequentialMLP):
        return None
    if _uses_te_op_fuser(experts):
        reason = te_op_fuser_host_split_reason(experts.config)
        return None if reason is None else f"TEGroupedMLP with the op fuser cannot take device counts: {reason}. " \
            + NO_HOST_SYNC_EXPERTS_HINT
    return (
        f"{type(experts).__name__} reads tokens_per_expert on the host (a device-to-host sync each step). "
        + NO_HOST_SYNC_EXPERTS_HINT
    )


def check_experts_take_device_counts(experts: Any) -> None:
    """Raises when ``experts`` cannot consume the no-host-sync dispatch output.

    Logs one WARNING per process when it accepts ``TEGroupedMLP`` through Transformer Engine's graph-safe op-fuser
    path, which has never run with deepepv2.

    Raises:
        ValueError: Naming the expert module and what to use instead.
    """
    global _warned_never_run_op_fuser
    reason = device_counts_unavailable_reason(experts)
    if reason is not None:
        raise ValueError(reason)
    if _uses_te_op_fuser(experts) and not _warned_never_run_op_fuser:
        _warned_never_run_op_fuser = True
        logger.warning("deepepv2 without host sync hands TEGroupedMLP's op fuser device counts through Transformer "
                       "Engine's graph-safe grouped-tensor path, which has never run with deepepv2; "
                       "SyncFreeSequentialMLP is the tested choice (MEGATRON_DEEPEPV2_EXPERTS=sync_free).")


class _ZeroRowsPastBlocks(torch.autograd.Function):
    """Forward: zeroes ``x[total:]`` in place (the output contract). Backward: the gradient as it comes.

    The gradient of the zeroed rows is not zeroed: the grouped GEMM before this op reads only the rows of
    the expert blocks (``offs``), so those rows of the gradient are never used.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.mark_dirty(x)
        return kernels.zero_rows_from(x, total)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return grad, None


class _ZeroGradPastBlocks(torch.autograd.Function):
    """Forward: identity. Backward: zeroes the gradient's rows from ``total`` on (the input-gradient contract)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(total)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        (total,) = ctx.saved_tensors
        # The grouped GEMM's input gradient is a fresh tensor that only this op consumes: zero it in place.
        return kernels.zero_rows_from(grad.contiguous(), total), None


class _ActivationProbs(torch.autograd.Function):
    """``activation(fc1_out) * probs`` over the rows of the expert blocks (fused Triton kernels)."""

    @staticmethod
    def forward(ctx: Any, fc1_out: torch.Tensor, probs: torch.Tensor, total: torch.Tensor,  # type: ignore[override]
                activation: expert_kernels.FusedActivation):
        ctx.save_for_backward(fc1_out, probs, total)
        ctx.activation = activation
        return expert_kernels.activation_probs_forward(fc1_out, probs, total, activation)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        fc1_out, probs, total = ctx.saved_tensors
        grad_fc1, grad_probs = expert_kernels.activation_probs_backward(grad.contiguous(), fc1_out, probs, total,
                                                                        ctx.activation)
        return grad_fc1, grad_probs, None, None


def fused_activation_of(config: Any) -> Optional[expert_kernels.FusedActivation]:
    """The fused kernels' description of ``config``'s expert activation, or None when they do not compute it.

    Covered: ``F.silu``, Megatron's ``quick_gelu`` and ``F.gelu``, gated or not; gated ones with Megatron's
    ``activation_func_clamp_value`` and ``glu_linear_offset`` (SwiGLU, GPT-OSS's clamped quick-GeGLU).

    Args:
        config: Megatron ``TransformerConfig``.
    """
    kind = _activation_kind(config.activation_func)
    if kind is None:
        return None
    if not config.gated_linear_unit:  # Megatron's MLP applies the clamp and the offset to gated units only
        return expert_kernels.FusedActivation(kind=kind, gated=False)
    clamp = getattr(config, "activation_func_clamp_value", None)
    return expert_kernels.FusedActivation(kind=kind, gated=True, clamp=None if clamp is None else float(clamp),
                                          linear_offset=float(getattr(config, "glu_linear_offset", 0.0)))


def _activation_kind(func: Any) -> Optional[str]:
    if func is F.silu:
        return "silu"
    if func is F.gelu:
        return "gelu"
    # Megatron defines quick_gelu in two modules (activations and the fused GeGLU), both x * sigmoid(1.702 x).
    if getattr(func, "__name__", "") == "quick_gelu" and getattr(func, "__module__", "").startswith("megatron."):
        return "quick_gelu"
    return None


def _stack_expert_weights(linears: list[torch.nn.Module]) -> torch.nn.Parameter:
    """One ``[E, out, in]`` parameter from the experts' ``[out, in]`` weights, with their Megatron attributes.

    The attributes (``allreduce=False`` marks expert parameters for Megatron's DDP, tensor-parallel flags, ...)
    carry over; ``partition_dim`` moves one dimension right past the new expert dimension.
    """
    originals = [linear.weight for linear in linears]
    stacked = torch.nn.Parameter(torch.stack([w.detach() for w in originals]), requires_grad=originals[0].requires_grad)
    for name, value in vars(originals[0]).items():
        setattr(stacked, name, value + 1 if name == "partition_dim" else value)
    for linear in linears:
        del linear._parameters["weight"]
    return stacked


class SyncFreeSequentialMLP(SequentialMLP):
    """Megatron's ``SequentialMLP`` as two grouped GEMMs, without host sync and at GEMM speed.

    A drop-in for ``SequentialMLP`` (what Megatron's local layer spec builds without Transformer Engine): same
    construction, initialisation and checkpoints; :func:`with_sync_free_experts` puts it into a layer spec.

    * **Parameters**: the experts' FC1 and FC2 weights live stacked as ``weight1 [E, fc1_out, H]`` and
      ``weight2 [E, H, ffn]`` (initialised exactly as ``SequentialMLP`` initialises its experts), so no forward
      stacks or splits weights. ``state_dict`` / ``load_state_dict`` use ``SequentialMLP``'s keys
      (``local_experts.<i>.linear_fc1.weight``, ...) and Megatron's ``sharded_state_dict`` writes its shards (while
      Megatron's optimizers shard their states through the stacked parameters), so checkpoints move freely
      between the two.
    * **Compute**: ``torch._grouped_mm`` per projection with the expert offsets computed on the device; the
      activation times the router probabilities runs as one fused Triton kernel forward and one backward
      (BF16/FP16 on CUDA, for SiLU, quick GELU and GELU, gated or not, with Megatron's clamp and linear offset:
      :func:`fused_activation_of`; other activations and the CPU run the same maths in PyTorch ops).
    * **No host sync**: ``tokens_per_expert`` may be a device tensor; it is never read on the host. Rows past the
      last expert block (the worst-case tail of the no-host-sync dispatch) are neither read nor computed on:
      the GEMMs stop at the blocks, the fused kernels skip those rows, and only the zeroing of their outputs and
      input gradients touches them. With host counts that sum to the row count there is no tail and no zeroing.

    Supported: expert tensor parallel size 1, linear layers without bias, no FP8/FP4, no delayed weight
    gradients, any activation ``MLP`` supports through ``config.activation_func`` / ``gated_linear_unit``.
    Numerics equal ``SequentialMLP``'s up to rounding (grouped GEMMs; the fused activations compute in FP32).

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
        megatron_config.check_sync_free_experts(self.config, tp_group.size() if tp_group is not None else 1)
        self.weight1 = _stack_expert_weights([expert.linear_fc1 for expert in self.local_experts])
        self.weight2 = _stack_expert_weights([expert.linear_fc2 for expert in self.local_experts])
        # Resolved once: the activation as the fused kernels compute it (None: PyTorch ops).
        self._fused_activation = fused_activation_of(self.config)
        self._register_state_dict_hook(_expert_keys_in_state_dict)
        self._register_load_state_dict_pre_hook(_stacked_weights_from_expert_keys, with_module=True)

    # -- checkpoints ---------------------------------------------------------------------------
    def _expert_key(self, index: int, linear: str) -> str:
        return f"local_experts.{index}.{linear}.weight"

    @contextlib.contextmanager
    def _expert_weight_views(self) -> Iterator[None]:
        """Gives every expert's linear layers a ``weight`` buffer viewing its slice of the stacked weights."""
        linears = []
        for index, expert in enumerate(self.local_experts):
            for linear, stacked in ((expert.linear_fc1, self.weight1), (expert.linear_fc2, self.weight2)):
                linear.register_buffer("weight", stacked.detach()[index])
                linears.append(linear)
        try:
            yield
        finally:
            for linear in linears:
                del linear._buffers["weight"]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Megatron's distributed-checkpoint entries: ``SequentialMLP``'s shards, built from the stacked weights.

        Each stacked weight is one ``ShardedTensorFactory`` whose data is the parameter itself: Megatron's optimizers
        find a parameter's entry by identity and shard their states (same shape as the parameter) through it. Built,
        it yields exactly ``SequentialMLP``'s per-expert entries (same keys, global shapes and offsets), so
        checkpoints move freely between the two modules.
        """
        with self._expert_weight_views():
            entries = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        for name, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
            keys = [f"{prefix}{self._expert_key(i, linear)}" for i in range(self.num_local_experts)]
            per_expert = [entries.pop(key) for key in keys]
            entries[f"{prefix}{name}"] = _stacked_factory(getattr(self, name), per_expert)
        return entries

    def backward_dw(self) -> None:
        """Nothing to do: weight gradients are computed in backward (delayed weight gradients are rejected)."""

    # -- compute -------------------------------------------------------------------------------
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
            tokens_per_expert: ``[E_local]`` rows per expert, a host tensor or a device tensor (never read on
                the host).
            permuted_probs: ``[N]`` router probability of each row.

        Returns:
            ``([N, H]`` outputs, zero past the blocks; ``None`` bias).
        """
        hidden = permuted_local_hidden_states
        probs = permuted_probs
        if self.config.moe_apply_probs_on_input:
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        num_rows = hidden.shape[0]
        if tokens_per_expert.shape != (self.num_local_experts,):
            raise ValueError(
                f"tokens_per_expert has shape {tuple(tokens_per_expert.shape)}; expected ({self.num_local_experts},), "
                "one row count per local expert."
            )
        if tokens_per_expert.device.type == "cpu" and hidden.device.type != "cpu":
            # Host counts of device rows (the host-sync path): the row total is known without a device sync.
            offsets = torch.cumsum(tokens_per_expert.to(torch.int64), 0).to(torch.int32)
            has_tail = int(offsets[-1]) < num_rows
            offsets = offsets.to(hidden.device, non_blocking=True)
        else:
            # Counts beside the rows: reading them on the host would sync it, so the buffer may have a tail.
            offsets = torch.cumsum(tokens_per_expert, 0, dtype=torch.int32)
            has_tail = True
        total = offsets[-1:]
        fused = (
            self._fused_activation is not None
            and hidden.is_cuda
            and kernels.AVAILABLE
            and hidden.dtype in (torch.bfloat16, torch.float16)
        )
        if fused:
            return self._forward_fused(hidden, probs.float(), offsets, total, has_tail), None
        return self._forward_unfused(hidden, probs, offsets, total, has_tail), None

    def _forward_fused(self, hidden, probs, offsets, total, has_tail: bool) -> torch.Tensor:
        if has_tail:
            hidden = _ZeroGradPastBlocks.apply(hidden, total)
        # [E, out, in] weights; the transposed views are the column-major [E, in, out] operands.
        fc1_out = torch._grouped_mm(hidden, self.weight1.transpose(1, 2), offs=offsets)
        intermediate = _ActivationProbs.apply(fc1_out, probs, total, self._fused_activation)
        output = torch._grouped_mm(intermediate, self.weight2.transpose(1, 2), offs=offsets)
        return _ZeroRowsPastBlocks.apply(output, total) if has_tail else output

    def _forward_unfused(self, hidden, probs, offsets, total, has_tail: bool) -> torch.Tensor:
        # PyTorch ops over every row: rows past the blocks are masked, so nothing they hold reaches a result.
        in_blocks = None
        if has_tail:
            in_blocks = (torch.arange(hidden.shape[0], device=hidden.device) < total).unsqueeze(1)
            hidden = torch.where(in_blocks, hidden, 0)
            probs = torch.where(in_blocks.squeeze(1), probs, 0)
        fc1_out = torch._grouped_mm(hidden, self.weight1.transpose(1, 2), offs=offsets)
        if in_blocks is not None:
            fc1_out = torch.where(in_blocks, fc1_out, 0)
        intermediate = self._activation(fc1_out)
        intermediate = (intermediate * probs.unsqueeze(-1)).to(hidden.dtype)
        output = torch._grouped_mm(intermediate, self.weight2.transpose(1, 2), offs=offsets)
        return torch.where(in_blocks, output, 0) if in_blocks is not None else output


def _renamed_like(key: str, original: str, renamed: str) -> str:
    """``key`` with the change of prefix that turned ``original`` into ``renamed``.

    Megatron renames sharded entries by prefix after a module returns them (a transformer block drops the local
    layer index, an optimizer prepends ``optimizer.state.<name>.``); a factory passes the rename on to what it builds.
    """
    common = len(os.path.commonprefix([original[::-1], renamed[::-1]]))
    old, new = original[: len(original) - common], renamed[: len(renamed) - common]
    if not key.startswith(old):
        raise ValueError(f"cannot rename the expert shard {key!r} as {original!r} became {renamed!r}")
    return new + key[len(old):]


def _stacked_factory(stacked: torch.nn.Parameter, per_expert: list) -> ShardedTensorFactory:
    """One factory over a stacked ``[E, out, in]`` weight that builds the experts' own sharded entries.

    Args:
        stacked: The stacked parameter (or, when an optimizer rebuilds the factory, a state of its shape).
        per_expert: ``SequentialMLP``'s entry of each local expert's weight (``ShardedTensor``, or the SwiGLU
            ``ShardedTensorFactory`` of a gated FC1), in expert order.

    Returns:
        The factory: built, expert ``i``'s entry over ``data[i]``; merged after loading, the experts' weights
        stacked again.
    """
    first = per_expert[0]

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id: Any, flattened_range: Optional[slice]) -> list:
        if flattened_range is not None:
            raise NotImplementedError(
                "SyncFreeSequentialMLP's stacked expert weights cannot be saved flattened (a distributed optimizer's "
                "'fully_sharded_model_space' format); use the default distributed-optimizer checkpoint format.")
        built = []
        for index, entry in enumerate(per_expert):
            changes = dict(key=_renamed_like(entry.key, first.key, key), data=data[index], replica_id=replica_id)
            if isinstance(entry, ShardedTensorFactory):
                built.append(dataclasses.replace(entry, **changes).build())
            else:
                built.append(dataclasses.replace(entry, dtype=data.dtype, **changes))
        return built

    def merge(loaded: list) -> torch.Tensor:
        return torch.stack([entry.merge_fn(part) if isinstance(entry, ShardedTensorFactory) else part
                            for entry, part in zip(per_expert, loaded)])

    return ShardedTensorFactory(first.key, stacked, build, merge, first.replica_id)


def _expert_keys_in_state_dict(module: SyncFreeSequentialMLP, state_dict: dict, prefix: str, local_metadata) -> None:
    """State-dict hook: the stacked weights leave under ``SequentialMLP``'s per-expert keys."""
    for name, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        stacked = state_dict.pop(prefix + name)
        for index in range(module.num_local_experts):
            state_dict[prefix + module._expert_key(index, linear)] = stacked[index]


def _stacked_weights_from_expert_keys(module: SyncFreeSequentialMLP, state_dict: dict, prefix: str, *args) -> None:
    """Load pre-hook: ``SequentialMLP``'s per-expert weights are stacked into ``weight1`` / ``weight2``.

    A state dict with only some of an expert weight's keys is left as it is, so strict loading reports them.
    """
    for name, linear in (("weight1", "linear_fc1"), ("weight2", "linear_fc2")):
        keys = [prefix + module._expert_key(index, linear) for index in range(module.num_local_experts)]
        if all(key in state_dict for key in keys):
            state_dict[prefix + name] = torch.stack([state_dict.pop(key) for key in keys])


def with_sync_free_experts(layer_spec: Any) -> Any:
    """A copy of a layer spec whose MoE experts are :class:`SyncFreeSequentialMLP`.

    Takes what Megatron's ``get_gpt_layer_local_spec(num_experts=...)`` (or a decoder block spec's layer) returns:
    a ``ModuleSpec`` whose ``submodules.mlp`` is the MoE layer, built with ``SequentialMLP`` experts.

    Args:
        layer_spec: A transformer-layer ``ModuleSpec`` with a MoE MLP.

    Returns:
        The spec with the experts module replaced; ``layer_spec`` itself is unchanged.

    Raises:
        ValueError: If the spec has no MoE experts to replace, or they are not ``SequentialMLP``.
    """
    mlp = layer_spec.submodules.mlp
    moe_submodules = mlp.keywords.get("submodules") if isinstance(mlp, functools.partial) else getattr(
        mlp, "submodules", None)
    experts = getattr(moe_submodules, "experts", None)
    if experts is None:
        raise ValueError("with_sync_free_experts needs a layer spec whose mlp is a MoE layer with an experts module "
                         "(e.g. get_gpt_layer_local_spec(num_experts=...)).")
    moe_submodules = sync_free_submodules(moe_submodules)
    if isinstance(mlp, functools.partial):
        mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": moe_submodules})
    else:
        mlp = dataclasses.replace(mlp, submodules=moe_submodules)
    return dataclasses.replace(layer_spec, submodules=dataclasses.replace(layer_spec.submodules, mlp=mlp))


def sync_free_submodules(moe_submodules: Any) -> Any:
    """A copy of a MoE layer's submodules whose ``SequentialMLP`` experts are :class:`SyncFreeSequentialMLP`.

    Args:
        moe_submodules: Megatron's ``MoESubmodules``.

    Returns:
        The copy (``moe_submodules`` itself when its experts already are :class:`SyncFreeSequentialMLP`).

    Raises:
        ValueError: If the experts are another module: they have other parameters and checkpoints.
    """
    experts = moe_submodules.experts
    module = experts.func if isinstance(experts, functools.partial) else getattr(experts, "module", experts)
    if module is SyncFreeSequentialMLP:
        return moe_submodules
    if module is not SequentialMLP:
        raise ValueError(f"MEGATRON_DEEPEPV2_EXPERTS=sync_free replaces SequentialMLP (the local spec's experts) with "
                         f"SyncFreeSequentialMLP; this layer's experts are {getattr(module, '__name__', module)}, "
                         "whose parameters and checkpoints differ. Unset MEGATRON_DEEPEPV2_EXPERTS, or build the "
                         "model with the local spec.")
    return dataclasses.replace(moe_submodules, experts=_with_module(experts, SyncFreeSequentialMLP))


def _with_module(spec: Any, module: type) -> Any:
    """An experts entry with another module class (a ``partial`` from megatron-core 0.19, else a ModuleSpec)."""
    if isinstance(spec, functools.partial):
        return functools.partial(module, *spec.args, **spec.keywords)
    return dataclasses.replace(spec, module=module)
