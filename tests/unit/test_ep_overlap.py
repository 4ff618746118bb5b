"""EP all-to-all overlap (``overlap_moe_expert_parallel_comm``): Megatron's combined 1F1B schedule over deepepv2.

The combined schedule splits every MoE layer into nodes (attention, dispatch, experts, combine) and runs the
forward of micro-batch ``i + 1`` layer by layer interleaved with the backward of micro-batch ``i``: each
dispatch and combine runs between the other micro-batch's nodes, on Megatron's communication stream. The
result must equal a plain forward + backward of every micro-batch through Megatron's own ``alltoall``
dispatcher without overlap (the oracle: no deepepv2 code on its path), in losses and in every parameter
gradient.

Runs on 2 gloo CPU ranks (Megatron's streams and events are no-op stand-ins there, so the interleaving is
exactly the schedule's program order) over the reference backend and over the DeepEP adapter on a stand-in that
frees its buffer on destroy. ``tests/functional/deepep_cases.py`` runs the same comparison on
GPUs over ElasticBuffer, with real streams.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed

SEQ, VOCAB, EXPERTS, TOPK = 12, 64, 8, 3
MICRO_BATCHES = 3


@dataclass(frozen=True)
class OverlapShape:
    """Model and precision of one comparison.

    Attributes:
        layers: MoE transformer layers.
        hidden: Hidden size (DeepEP's combine needs a multiple of 256).
        bf16: Compute in BF16 (DeepEP dispatches BF16 only). FP32 otherwise: the config is still checked with
            ``bf16=True`` (the overlap asks for it) and the model then computes in FP32, which on this path only
            changes the attention softmax's input type. With two layers in BF16, a rounding difference between two
            dispatchers' combine sums flips near-tied routing decisions in the second layer (measured: 26%
            gradient difference, with or without the overlap), so BF16 comparisons use one layer.
        tolerance: Relative tolerance of the comparison, and absolute tolerance relative to each tensor's largest
            magnitude (BF16 rounding scales with it).
    """

    layers: int = 2
    hidden: int = 32
    bf16: bool = False
    tolerance: float = 1e-4


CPU_SHAPE = OverlapShape()
GPU_SHAPE = OverlapShape(layers=1, hidden=256, bf16=True, tolerance=2e-2)


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _gpt(dispatcher: str, overlap: bool, shape: OverlapShape):
    """A small MoE GPT (local spec: no Transformer Engine) with identical weights on every call."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    init_expert_parallel()
    extra = dict(num_layers=shape.layers, overlap_moe_expert_parallel_comm=overlap, bf16=True, hidden_dropout=0.0,
                 attention_dropout=0.0, init_method_std=0.2)
    dtype = torch.bfloat16 if shape.bf16 else torch.float32
    config = transformer_config(
        TinyMoEConfig(hidden=shape.hidden, ffn=48, num_experts=EXPERTS, topk=TOPK, params_dtype=dtype, extra=extra),
        dispatcher)
    config.bf16 = shape.bf16  # see OverlapShape.bf16
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    torch.manual_seed(1234)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     pre_process=True, post_process=True)
    return model.to(device=_device(), dtype=dtype)  # as Megatron's Float16Module casts it in BF16 training


def _micro_batch(index: int, rank: int) -> dict:
    gen = torch.Generator().manual_seed(100 * index + rank)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=gen)
    batch = {
        "input_ids": tokens[:, :-1],
        "labels": tokens[:, 1:],
        "position_ids": torch.arange(SEQ).unsqueeze(0),
        "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1),
    }
    return {name: tensor.to(_device()) for name, tensor in batch.items()}


def _grads(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _plain_steps(model, rank: int) -> tuple[list, dict]:
    """Forward + backward of each micro-batch in turn: the oracle."""
    losses = []
    for index in range(MICRO_BATCHES):
        loss = model(**_micro_batch(index, rank))
        loss.backward(torch.ones_like(loss))
        losses.append(loss.detach())
    return losses, _grads(model)


def _overlapped_steps(model, rank: int) -> tuple[list, dict]:
    """Megatron's combined 1F1B: forward 0; forward i + 1 with backward i; backward of the last."""
    from megatron.core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan as Plan
    from megatron.core.pipeline_parallel.utils import set_streams

    set_streams()
    losses, previous = [], None
    for index in range(MICRO_BATCHES + 1):
        plan = model.build_schedule_plan(**_micro_batch(index, rank)) if index < MICRO_BATCHES else None
        b_grad = torch.ones_like(losses[-1]) if previous is not None else None
        loss = Plan.run(plan, previous, b_grad=b_grad)
        if plan is not None:
            losses.append(loss.detach())
        previous = plan
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return losses, _grads(model)


def compare_overlap_with_alltoall(rank: int, shape: OverlapShape) -> None:
    """The combined 1F1B schedule over deepepv2 (the configured backend) against plain alltoall steps.

    Args:
        rank: This rank (selects its micro-batches).
        shape: Model and precision.

    Raises:
        AssertionError: A loss or a parameter gradient differs beyond ``shape.tolerance``, or a layer did not get
            this package's manager.
    """
    want_losses, want_grads = _plain_steps(_gpt("alltoall", False, shape), rank)
    model = _gpt("deepepv2", True, shape)
    managers = {type(layer.mlp.token_dispatcher._comm_manager).__module__ for layer in model.decoder.layers}
    assert managers == {"megatron_deepepv2.mcore.manager"}, managers
    losses, grads = _overlapped_steps(model, rank)

    def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
        scale = float(expected.float().abs().max()) or 1.0
        torch.testing.assert_close(actual.float(), expected.float(), rtol=shape.tolerance,
                                   atol=shape.tolerance * scale, msg=lambda m: f"{what}: {m}")

    for index, (loss, want) in enumerate(zip(losses, want_losses)):
        close(loss, want, f"loss of micro-batch {index}")
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        close(grads[name], want, name)


def _overlap_case(rank: int, world: int, backend: str) -> None:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    dv2.install()
    if backend == "deepep":
        from tests.deepep_stand_in import use_stand_in_backend

        use_stand_in_backend()
    dv2.configure(backend=backend, validate=False)
    compare_overlap_with_alltoall(rank, CPU_SHAPE)


@pytest.mark.parametrize("backend", ["reference", "deepep"])
def test_combined_1f1b_schedule_matches_alltoall_without_overlap(backend: str) -> None:
    run_distributed(_overlap_case, 2, backend, timeout=240, env={"LOCAL_WORLD_SIZE": "2"})
