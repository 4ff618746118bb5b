"""Small Megatron-Core MoE layers for the demo and the tests (built from megatron-core's own MoELayer)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


@dataclass
class TinyMoEConfig:
    """Shape of a small MoE layer.

    Attributes:
        hidden: Hidden size.
        ffn: Expert FFN hidden size.
        num_experts: Global number of experts.
        topk: Experts per token.
        capacity_factor: Megatron's ``moe_expert_capacity_factor`` (None = dropless).
        params_dtype: Parameter and activation dtype.
        extra: Further ``TransformerConfig`` fields.
    """

    hidden: int = 64
    ffn: int = 64
    num_experts: int = 8
    topk: int = 2
    capacity_factor: Optional[float] = None
    params_dtype: torch.dtype = torch.float32
    extra: dict = dataclasses.field(default_factory=dict)


def init_expert_parallel(expert_parallel_size: Optional[int] = None) -> None:
    """Initialises Megatron's model-parallel state on the default process group (TP=PP=1, EP = world)."""
    from megatron.core import parallel_state  # noqa: PLC0415

    if parallel_state.model_parallel_is_initialized():
        return
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=expert_parallel_size or dist.get_world_size(),
    )


def transformer_config(shape: TinyMoEConfig, dispatcher: str):
    """Builds the ``TransformerConfig`` of a one-layer MoE.

    Args:
        shape: Layer shape.
        dispatcher: ``"alltoall"``, ``"allgather"`` or a flex backend name such as ``"deepepv2"``.

    Returns:
        The config.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    flex = dispatcher not in ("alltoall", "allgather")
    fields = dict(
        num_layers=1,
        hidden_size=shape.hidden,
        ffn_hidden_size=shape.ffn,
        moe_ffn_hidden_size=shape.ffn,
        num_attention_heads=4,
        num_moe_experts=shape.num_experts,
        moe_router_topk=shape.topk,
        moe_token_dispatcher_type="flex" if flex else dispatcher,
        moe_router_dtype="fp32",
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=shape.capacity_factor,
        moe_permute_fusion=False,
        moe_grouped_gemm=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        expert_model_parallel_size=dist.get_world_size(),
        use_cpu_initialization=True,
        params_dtype=shape.params_dtype,
        bf16=shape.params_dtype == torch.bfloat16,
        add_bias_linear=False,
        gradient_accumulation_fusion=False,
    )
    if flex:
        fields["moe_flex_dispatcher_backend"] = dispatcher
    fields.update(shape.extra)
    return TransformerConfig(**fields)


def _layer_spec(shape: TinyMoEConfig, config, transformer_engine: bool, sync_free_experts: bool):
    """Megatron's GPT layer spec for ``shape``: the local spec, or the Transformer Engine spec (TE attention and
    linear layers; ``TEGroupedMLP`` experts when ``config.moe_grouped_gemm``)."""
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: PLC0415

    if transformer_engine:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=shape.num_experts, moe_grouped_gemm=config.moe_grouped_gemm)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=shape.num_experts, moe_grouped_gemm=False)
    if sync_free_experts:
        from megatron_deepepv2.mcore.experts import with_sync_free_experts  # noqa: PLC0415

        spec = with_sync_free_experts(spec)
    return spec


def _seed(seed: int) -> None:
    """Seeds the CPU generator (parameters initialise on the CPU) and Megatron's CUDA generators."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

        model_parallel_cuda_manual_seed(seed)


def build_moe_layer(shape: TinyMoEConfig, dispatcher: str, seed: int = 1234, sync_free_experts: bool = False,
                    transformer_engine: bool = False):
    """Builds a megatron-core ``MoELayer``.

    Args:
        shape: Layer shape.
        dispatcher: See :func:`transformer_config`.
        seed: Parameter-initialisation seed (identical across dispatchers and ranks).
        sync_free_experts: Use :class:`~megatron_deepepv2.mcore.experts.SyncFreeSequentialMLP` (same parameters
            as SequentialMLP, device-side token counts) for the no-host-sync mode.
        transformer_engine: Build from Megatron's Transformer Engine spec (``TEGroupedMLP`` experts when
            ``shape.extra`` sets ``moe_grouped_gemm``); needs Transformer Engine. Otherwise the local spec's
            ``SequentialMLP`` (no Transformer Engine needed).

    Returns:
        The layer, on CUDA when available else on the CPU.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: PLC0415

    init_expert_parallel()
    config = transformer_config(shape, dispatcher)
    mlp = _layer_spec(shape, config, transformer_engine, sync_free_experts).submodules.mlp
    submodules = mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules
    _seed(seed)
    layer = MoELayer(config=config, submodules=submodules)
    return layer.cuda() if torch.cuda.is_available() else layer


def build_transformer_layer(shape: TinyMoEConfig, dispatcher: str, seed: int = 1234, sync_free_experts: bool = False,
                            transformer_engine: bool = True):
    """Builds a whole GPT ``TransformerLayer``: causal self-attention, then the MoE MLP (as ``pretrain_gpt.py`` does).

    Args:
        shape: Layer shape (``shape.hidden`` divisible by the 4 attention heads).
        dispatcher: See :func:`transformer_config`.
        seed: Parameter-initialisation seed.
        sync_free_experts: See :func:`build_moe_layer`.
        transformer_engine: Megatron's Transformer Engine spec (TE attention, layer norms and linear layers), else
            the local spec.

    Returns:
        The layer on CUDA; ``layer(x)`` takes ``[S, B, H]`` and returns ``(output, context)``.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

    init_expert_parallel()
    config = transformer_config(shape, dispatcher)
    spec = _layer_spec(shape, config, transformer_engine, sync_free_experts)
    _seed(seed)
    return TransformerLayer(config=config, submodules=spec.submodules, layer_number=1).cuda()


def layer_step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """One forward + backward of a MoE layer from cleared gradients.

    Args:
        layer: The layer (returns ``(output, bias)``).
        x: Input (``requires_grad``); its ``.grad`` and the parameters' are set to this step's.
        grad: Gradient of the output.

    Returns:
        The output.
    """
    for param in layer.parameters():
        param.grad = None
    x.grad = None
    output, _ = layer(x)
    output.backward(grad)
    return output


def dispatch_stages(dispatcher, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
    """Megatron's three dispatch stages of a token dispatcher, in order (what ``MoELayer`` runs between its router
    and its experts).

    Args:
        dispatcher: The layer's ``token_dispatcher``.
        hidden_states: The layer's input.
        routing_map: The router's routing map.
        probs: The router's probabilities.

    Returns:
        ``(hidden states for the experts, tokens per expert, their probabilities)``.
    """
    hidden, probs = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
    hidden, probs = dispatcher.token_dispatch(hidden, probs)
    return dispatcher.dispatch_postprocess(hidden, probs)


def dispatcher_path_step(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """One forward + backward of a MoE layer's dispatcher path alone: router, Megatron's dispatch stages, the
    routing probabilities as identity experts, the combine stages.

    Args:
        layer: A megatron-core ``MoELayer`` (any dispatcher).
        x: ``[S, B, H]`` input (``requires_grad``).

    Returns:
        The combined output (its backward has run, with a gradient of ones).
    """
    dispatcher = layer.token_dispatcher
    probs, routing_map = layer.router(x)
    hidden, _, probs = dispatch_stages(dispatcher, x, routing_map, probs)
    hidden = dispatcher.combine_preprocess(hidden * probs.unsqueeze(1).to(hidden.dtype))
    output = dispatcher.combine_postprocess(dispatcher.token_combine(hidden))
    output.backward(torch.ones_like(output))
    return output


def capture_layer_step(layer: torch.nn.Module, x: torch.Tensor, grad: torch.Tensor,
                       warmup_steps: int = 2) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Captures one forward + backward of a MoE layer in a CUDA graph, after a warm-up on a side stream.

    Needs no host sync on the dispatcher path (``host_sync=False`` with experts that take device-side counts).
    Eager steps on the default stream may come before, once nothing they returned is referenced any more: a live
    autograd graph ties the parameters' gradient accumulators to that step's stream and the capture fails.

    Args:
        layer: The layer; its parameters' ``.grad`` are cleared before every step and the capture.
        x: Static input (``requires_grad``); copy new values into it before each replay.
        grad: Gradient of the output.
        warmup_steps: Eager steps on the side stream before the capture (buffers, JIT, allocator).

    Returns:
        The graph and its static output. ``x.grad`` and the parameters' ``.grad`` set during the capture are the
        memory every replay writes.
    """

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_steps):
            layer_step(layer, x, grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for param in layer.parameters():
        param.grad = None
    x.grad = None
    with torch.cuda.graph(graph):
        output, _ = layer(x)
        output.backward(grad)
    return graph, output
