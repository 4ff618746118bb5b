"""Megatron checkpoints of a GPT-MoE with deepepv2 layers: save mid-run, resume in a new model, continue bit for bit.

Two gloo CPU ranks (EP 2) train a small GPT with MoE layers (local spec, experts built as ``SyncFreeSequentialMLP``
by ``MEGATRON_DEEPEPV2_EXPERTS=sync_free``, deterministic) for two steps, save a Megatron distributed checkpoint of
the model and of the optimizer as Megatron's optimizers shard it (``dist_checkpointing``, the ``torch_dist`` format
``pretrain_gpt.py`` writes: each optimizer state sharded like its parameter), and train two more steps. Then every
deepepv2 buffer is destroyed, a model with other initial weights is built, the checkpoint loaded, and the two steps
run again: losses and the final parameters must equal the uninterrupted run's bit for bit.
Nothing of the dispatcher is saved or restored by hand: the buffer and the dispatch configuration come back by
themselves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed

SEQ, VOCAB, HIDDEN, EXPERTS, TOPK = 8, 32, 32, 8, 2


def _model(seed: int):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    config = transformer_config(TinyMoEConfig(hidden=HIDDEN, ffn=48, num_experts=EXPERTS, topk=TOPK, extra=dict(
        num_layers=2, expert_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, add_bias_linear=False)), "deepepv2")
    torch.manual_seed(seed)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(num_experts=EXPERTS,
                                                                                    moe_grouped_gemm=False),
                     vocab_size=VOCAB, max_sequence_length=SEQ)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _step(model, optimizer, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=gen)
    optimizer.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:], position_ids=torch.arange(SEQ).expand(2, SEQ),
                 attention_mask=torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)).float().mean()
    loss.backward()
    # Data parallelism of the dense parameters (both ranks are its replicas; each hosts its own experts), as
    # Megatron's DDP does: replicas stay equal, which a checkpoint's single copy of them assumes.
    for name, parameter in model.named_parameters():
        if ".experts." not in name:
            torch.distributed.all_reduce(parameter.grad)
            parameter.grad /= torch.distributed.get_world_size()
    optimizer.step()
    return loss.detach()


def _megatron(optimizer: torch.optim.Adam):
    """Megatron's optimizer around ``optimizer`` (its FP32 variant: the mixed-precision ones need CUDA), for the
    checkpoint: Megatron maps every optimizer parameter to the model's sharded entry over it and shards its states
    the same way."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    class CpuFP32Optimizer(FP32Optimizer):
        def __init__(self, inner: torch.optim.Optimizer, config: OptimizerConfig, init_state_fn) -> None:
            MegatronOptimizer.__init__(self, inner, config, init_state_fn)  # FP32Optimizer's puts a scale on CUDA
            self._scale, self.is_stub_optimizer = torch.ones(1), False

    def adam_states(inner: torch.optim.Optimizer, config=None) -> None:  # Megatron's Adam init_state_fn
        for group in inner.param_groups:
            for param in group["params"]:
                if not inner.state[param]:
                    inner.state[param].update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param))

    return CpuFP32Optimizer(optimizer, OptimizerConfig(optimizer="adam", lr=1e-2), adam_states)


def _resume(rank: int, world: int, directory: str) -> dict:
    from megatron.core import dist_checkpointing

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims
    from megatron_deepepv2.testing.moe_model import init_expert_parallel

    install_cpu_shims()
    dv2.install()
    init_expert_parallel()
    dv2.configure(experts="sync_free", deterministic=True, validate=False)
    checkpoint = Path(directory) / "step2"
    model, optimizer = _model(seed=1)
    assert all(type(layer.mlp.experts) is SyncFreeSequentialMLP for layer in model.decoder.layers)
    for step in (1, 2):
        _step(model, optimizer, step, rank)
    if rank == 0:
        checkpoint.mkdir(parents=True)
    torch.distributed.barrier()
    model_shards = model.sharded_state_dict()
    dist_checkpointing.save({"model": model_shards, "optimizer": _megatron(optimizer).sharded_state_dict(model_shards)},
                            str(checkpoint))
    uninterrupted = [_step(model, optimizer, step, rank) for step in (3, 4)]
    final = {name: p.detach().clone() for name, p in model.named_parameters()}

    dv2.destroy_buffers()  # what a new process starts with
    model, optimizer = _model(seed=2)
    assert any(not torch.equal(p, final[n]) for n, p in model.named_parameters())  # other weights before loading
    model_shards, megatron_optimizer = model.sharded_state_dict(), _megatron(optimizer)
    optimizer_shards = megatron_optimizer.sharded_state_dict(model_shards, is_loading=True)
    loaded = dist_checkpointing.load({"model": model_shards, "optimizer": optimizer_shards}, str(checkpoint))
    model.load_state_dict(loaded["model"])
    megatron_optimizer.load_state_dict(loaded["optimizer"])
    resumed = [_step(model, optimizer, step, rank) for step in (3, 4)]
    for step, (a, b) in enumerate(zip(resumed, uninterrupted), start=3):
        assert torch.equal(a, b), f"step {step}: resumed loss {a.item()!r} != uninterrupted {b.item()!r}"
    differing = [n for n, p in model.named_parameters() if not torch.equal(p, final[n])]
    assert not differing, f"parameters differ after the resumed steps: {differing}"
    return {"losses": [float(v) for v in resumed], "experts": sum("experts" in n for n in final)}


def test_resumed_training_equals_the_uninterrupted_run_bit_for_bit(tmp_path: Path) -> None:
    pytest.importorskip("psutil", reason="Megatron's checkpoint writer needs psutil (pip install -e '.[test]')")
    reports = run_distributed(_resume, 2, str(tmp_path), timeout=240)
    assert all(r["experts"] > 0 and len(r["losses"]) == 2 for r in reports), reports
