"""Megatron's pipeline schedules over deepepv2: interleaved 1F1B (pipeline 2 x virtual 2 x EP 2) and plain 1F1B.

A small GPT with MoE layers (local spec) trains one step of several micro-batches on 4 gloo CPU ranks through
Megatron's own ``get_forward_backward_func`` -- the schedule keeps several micro-batches' backwards pending while
other micro-batches' forwards dispatch through the same buffer -- with deepepv2 and with Megatron's ``alltoall``
dispatcher (the oracle: no deepepv2 code on its path). Losses and every parameter gradient must match, and three
replays of the deepepv2 step must be bit-exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import megatron_deepepv2 as dv2
from tests.distributed import run_distributed

SEQ, VOCAB, HIDDEN, EXPERTS, TOPK = 8, 32, 32, 8, 2
MICRO_BATCHES = 4
LAYERS = 4  # 2 per pipeline stage: 1 per virtual stage with interleaving


def _setup(virtual_stages) -> None:
    from megatron.core import parallel_state

    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    dv2.install()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                                 virtual_pipeline_model_parallel_size=virtual_stages,
                                                 expert_model_parallel_size=2)


def _model_chunks(dispatcher: str, virtual_stages, sync_free: bool):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    config = transformer_config(TinyMoEConfig(hidden=HIDDEN, ffn=48, num_experts=EXPERTS, topk=TOPK, extra=dict(
        num_layers=LAYERS, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=virtual_stages,
        expert_model_parallel_size=2, pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        init_method_std=0.2, batch_p2p_comm=False)), dispatcher)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    if sync_free:  # no host sync needs experts that take device-side counts (both models get them)
        from megatron_deepepv2.mcore.experts import with_sync_free_experts

        spec = with_sync_free_experts(spec)
    chunks = []
    for stage in range(virtual_stages or 1):
        vp = stage if virtual_stages else None
        torch.manual_seed(1000 + 10 * parallel_state.get_pipeline_model_parallel_rank() + stage)
        chunks.append(GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                               pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                               post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                               vp_stage=vp))
    return chunks, config


def _batches(rank_in_data: int):
    for index in range(MICRO_BATCHES):
        gen = torch.Generator().manual_seed(100 * index + rank_in_data)
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=gen)
        yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ).unsqueeze(0),
               "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)}


def _step(chunks, config) -> tuple[list, dict]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for chunk in chunks:
        chunk.zero_grad(set_to_none=True)
    data_rank = parallel_state.get_expert_model_parallel_rank()
    iterators = [_batches(data_rank) for _ in chunks]

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(**batch)

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=MICRO_BATCHES, seq_length=SEQ,
        micro_batch_size=1, forward_only=False)
    losses = [r["loss"].clone() for r in results]
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()
             if p.grad is not None}
    return losses, grads


def _schedule_case(rank: int, world: int, virtual_stages, no_host_sync: bool) -> dict:
    from megatron.core import parallel_state

    _setup(virtual_stages)
    dv2.configure(host_sync=not no_host_sync, validate=False,
                  num_max_tokens_per_rank=SEQ if no_host_sync else None)
    want_losses, want_grads = _step(*_model_chunks("alltoall", virtual_stages, no_host_sync))
    chunks, config = _model_chunks("deepepv2", virtual_stages, no_host_sync)
    managers = {type(layer.mlp.token_dispatcher._comm_manager).__module__ for chunk in chunks
                for layer in chunk.decoder.layers}
    assert managers == {"megatron_deepepv2.mcore.manager"}, managers
    runs = [_step(chunks, config) for _ in range(3)]
    losses, grads = runs[0]
    for index, (loss, want) in enumerate(zip(losses, want_losses, strict=True)):
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6, msg=f"loss of micro-batch {index}")
    assert grads.keys() == want_grads.keys() and grads, (sorted(grads), sorted(want_grads))
    for name, want in want_grads.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)
    for replay in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(replay[0], losses, strict=True)), "a replay's loss differs"
        for name in grads:
            assert torch.equal(replay[1][name], grads[name]), f"a replay differs in {name}"
    return {"stage": parallel_state.get_pipeline_model_parallel_rank(), "losses": len(losses),
            "chunks": len(chunks), "expert_grads": sum("experts" in name for name in grads)}


@pytest.mark.parametrize("virtual_stages,no_host_sync", [
    (2, False), (2, True),  # interleaved 1F1B
    (None, False),  # 1F1B without interleaving
])
def test_pipeline_schedule_matches_alltoall_and_replays_bit_exact(virtual_stages, no_host_sync: bool) -> None:
    reports = run_distributed(_schedule_case, 4, virtual_stages, no_host_sync, timeout=300,
                              env={"LOCAL_WORLD_SIZE": "4"})
    # Pipeline rank 1 (the last stage) computes every micro-batch's loss; every rank has expert gradients.
    assert sorted(r["stage"] for r in reports) == [0, 0, 1, 1], reports
    assert all(r["losses"] == (MICRO_BATCHES if r["stage"] == 1 else 0) for r in reports), reports
    assert all(r["chunks"] == (virtual_stages or 1) and r["expert_grads"] > 0 for r in reports), reports
