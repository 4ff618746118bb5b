"""The receive bound (``--moe-expert-rank-capacity-factor``) on CPU: its memory, and Megatron's budget protocols.

A deepepv2 ``MoELayer`` (reference backend, gloo) with the bound must hand its experts bound-sized tensors of their
own, restore into the dispatch's worst-case tensor instead of a new one, reuse the combine backward's gradient only
when nothing else holds it, and compute what the unbounded layer computes with the rows past the bound zeroed.
Megatron's own over-budget rerun (``PagedStashRunner``) and its pipeline schedule's ``finalize_model_grads_func``
call drive the layer as they drive HybridEP's.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2.testing.moe_model import dispatch_stages
from tests.distributed import run_distributed
from tests.unit.test_no_host_sync import _per_expert_names, no_host_reads

SHAPE = dict(hidden=32, ffn=48, num_experts=8, topk=3)
CAPACITY = 16  # num_max_tokens_per_rank: worst case 2 ranks x 16 x min(3, 4) = 96 rows
TOKENS = [12, 5]


def _megatron_has(field: str) -> bool:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return field in TransformerConfig.__dataclass_fields__


needs_factor = pytest.mark.skipif(not _megatron_has("moe_expert_rank_capacity_factor"),
                                  reason="this megatron-core has no moe_expert_rank_capacity_factor (added in 0.19)")


def _setup() -> None:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    dv2.install()


def _layers(factor: float, no_host_sync: bool):
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    dv2.configure(host_sync=not no_host_sync, num_max_tokens_per_rank=CAPACITY, validate=False)
    plain = build_moe_layer(TinyMoEConfig(**SHAPE), "deepepv2", sync_free_experts=True)
    bounded = build_moe_layer(TinyMoEConfig(**SHAPE, extra={"moe_expert_rank_capacity_factor": factor}),
                              "deepepv2", sync_free_experts=True)
    bounded.load_state_dict(plain.state_dict())
    return plain, bounded


def _step(layer, x: torch.Tensor, grad: torch.Tensor, hold_expert_grad: bool = False) -> dict:
    """One forward + backward, stage by stage, recording what the bound's memory contract is about."""
    from megatron_deepepv2 import ops

    record: dict = {}
    dispatch_forward, combine_backward, dispatch_backward = (
        ops.DispatchFunction.forward, ops.CombineFunction.backward, ops.DispatchFunction.backward)

    def on_dispatch_forward(ctx, *args):
        outputs = dispatch_forward(ctx, *args)  # (recv_x, recv_weights, recv_scales, recv_idx, handle)
        recv_x = outputs[0]
        record["recv_ptr"], record["recv_nbytes"] = recv_x.untyped_storage().data_ptr(), recv_x.untyped_storage().nbytes()
        return outputs

    def on_combine_backward(ctx, grad_out):
        result = combine_backward(ctx, grad_out)
        record["combine_grad_ptr"] = result[0].untyped_storage().data_ptr()
        return result

    def on_dispatch_backward(ctx, grad_recv_x, grad_recv_weights, *grads_of_the_rest):
        record["dispatch_grad_ptr"] = grad_recv_x.untyped_storage().data_ptr()
        record["dispatch_grad_rows"] = grad_recv_x.shape[0]
        return dispatch_backward(ctx, grad_recv_x, grad_recv_weights, *grads_of_the_rest)

    guard = contextlib.nullcontext if layer.token_dispatcher._comm_manager.dispatch_config.host_sync else no_host_reads
    ops.DispatchFunction.forward = staticmethod(on_dispatch_forward)
    ops.CombineFunction.backward = staticmethod(on_combine_backward)
    ops.DispatchFunction.backward = staticmethod(on_dispatch_backward)
    try:
        xin = x.clone().requires_grad_()
        layer.zero_grad()
        probs, routing_map = layer.router(xin)
        dispatcher = layer.token_dispatcher
        with guard():
            hidden, tokens_per_expert, probs = dispatch_stages(dispatcher, xin, routing_map, probs)
        record["expert_rows"] = hidden.shape[0]
        record["expert_nbytes"] = hidden.untyped_storage().nbytes()
        record["expert_probs_nbytes"] = probs.untyped_storage().nbytes()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out, _ = layer.experts(hidden, tokens_per_expert, probs)
        # While the experts run, the worst-case receive is alive (the restore reuses it): a saved view of it shows.
        record["saved_views_of_receive"] = sum(
            t.untyped_storage().data_ptr() == record["recv_ptr"] for t in saved if t.untyped_storage().nbytes())
        held = []
        if hold_expert_grad:  # what a delayed weight gradient does: keep the experts' output gradient past backward
            out.register_hook(lambda g: held.append((g, g.clone())))
        with guard():
            restored = dispatcher.combine_preprocess(out)
            record["restored_rows"] = restored.shape[0]
            record["restored_ptr"] = restored.untyped_storage().data_ptr()
            y = dispatcher.combine_postprocess(dispatcher.token_combine(restored))
            (y * grad).sum().backward()
        if held:
            record["held_grad_intact"] = torch.equal(held[0][0], held[0][1])
    finally:
        ops.DispatchFunction.forward = staticmethod(dispatch_forward)
        ops.CombineFunction.backward = staticmethod(combine_backward)
        ops.DispatchFunction.backward = staticmethod(dispatch_backward)
    record["y"], record["x_grad"] = y.detach(), xin.grad
    record["grads"] = _per_expert_names({n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None})
    return record


def _bound_memory(rank: int, world: int, factor: float, no_host_sync: bool, hold_expert_grad: bool) -> dict:
    _setup()
    plain, bounded = _layers(factor, no_host_sync)
    manager = bounded.token_dispatcher._comm_manager
    x = torch.randn(TOKENS[rank], 1, SHAPE["hidden"], generator=torch.Generator().manual_seed(rank))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(50 + rank))
    for layer in (plain, bounded):
        layer(x)[0].sum().backward()  # builds the buffers outside the checked region
    bound = int(TOKENS[rank] * SHAPE["topk"] * factor)  # HybridEP's budget, alignment 1

    def drop_past_bound(module, inputs, output):
        out, bias = output  # the oracle of a drop: the expert output of the rows past the bound is zero
        keep = (torch.arange(out.shape[0]) < bound).unsqueeze(1)
        return torch.where(keep, out, 0), bias

    unbounded = _step(plain, x, grad)
    hook = plain.experts.register_forward_hook(drop_past_bound)
    expected = _step(plain, x, grad)
    hook.remove()
    bounded.token_dispatcher.reset_over_budget()
    actual = _step(bounded, x, grad, hold_expert_grad)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(actual["y"], expected["y"], **tol)
    torch.testing.assert_close(actual["x_grad"], expected["x_grad"], **tol)
    assert actual["grads"].keys() == expected["grads"].keys()
    for name in expected["grads"]:
        torch.testing.assert_close(actual["grads"][name], expected["grads"][name], **tol, msg=name)
    dropped_anywhere = manager.dropped_rows.clone()
    torch.distributed.all_reduce(dropped_anywhere)  # a drop on any rank changes tokens of every rank
    if int(dropped_anywhere) == 0:  # nothing dropped: exactly the unbounded layer
        torch.testing.assert_close(actual["y"], unbounded["y"], **tol)
        torch.testing.assert_close(actual["x_grad"], unbounded["x_grad"], **tol)
    row_bytes = SHAPE["hidden"] * x.element_size()
    return {
        "bound": bound,
        "unbounded_rows": unbounded["expert_rows"],
        "worst_nbytes": unbounded["recv_nbytes"],
        "expert_rows": actual["expert_rows"],
        "expert_nbytes": actual["expert_nbytes"],
        "expert_probs_nbytes": actual["expert_probs_nbytes"],
        "row_bytes": row_bytes,
        "saved_views_of_receive": actual["saved_views_of_receive"],
        "restored_rows": actual["restored_rows"],
        "restored_into_receive": actual["restored_ptr"] == actual["recv_ptr"],
        "dispatch_grad_rows": actual["dispatch_grad_rows"],
        "backward_reused_combine_grad": actual["dispatch_grad_ptr"] == actual["combine_grad_ptr"],
        "held_grad_intact": actual.get("held_grad_intact"),
        "dropped": int(manager.dropped_rows),
        "dropped_anywhere": int(dropped_anywhere),
    }


@needs_factor
@pytest.mark.parametrize("no_host_sync", [True, False])
def test_bound_keeps_bound_sized_rows_and_restores_into_the_receive(no_host_sync: bool) -> None:
    """The experts get (and save) a bound-sized tensor of their own; the restore writes into the dispatch's
    worst-case tensor and the dispatch backward into the combine backward's gradient: no worst-case tensor is made
    per call. Outputs and gradients are the unbounded layer's with the rows past the bound zeroed."""
    reports = run_distributed(_bound_memory, 2, 0.25, no_host_sync, False, timeout=180)
    assert any(r["dropped"] > 0 for r in reports), reports  # the case exercises a drop
    for r in reports:
        assert r["expert_rows"] == r["bound"] < r["unbounded_rows"], r
        assert r["expert_nbytes"] == r["bound"] * r["row_bytes"] < r["worst_nbytes"], r
        assert r["expert_probs_nbytes"] == r["bound"] * 4, r
        assert r["saved_views_of_receive"] == 0, r
        assert r["restored_rows"] == r["unbounded_rows"] and r["restored_into_receive"], r
        assert r["dispatch_grad_rows"] == r["unbounded_rows"] and r["backward_reused_combine_grad"], r


@needs_factor
def test_bound_that_drops_nothing_computes_what_the_unbounded_layer_computes() -> None:
    reports = run_distributed(_bound_memory, 2, 3.0, True, False, timeout=180)
    assert any(r["expert_rows"] < r["unbounded_rows"] for r in reports), reports  # a bound that cuts rows
    for r in reports:
        assert r["dropped_anywhere"] == 0, r
        assert r["expert_rows"] == min(r["bound"], r["unbounded_rows"]), r
        assert r["expert_rows"] == r["unbounded_rows"] or r["backward_reused_combine_grad"], r


@needs_factor
def test_bound_backward_leaves_a_held_expert_gradient_alone() -> None:
    """A delayed weight gradient keeps the experts' output gradient (a view of the combine backward's gradient) past
    the experts' backward: the dispatch backward must then not write into it."""
    for r in run_distributed(_bound_memory, 2, 0.25, True, True, timeout=180):
        assert r["held_grad_intact"] is True and not r["backward_reused_combine_grad"], r


# ----------------------------------------------------------------------------------------------
# Megatron's over-budget rerun, its reset and the paged-stash refusal
# ----------------------------------------------------------------------------------------------
SEQ, VOCAB = 8, 32


def _gpt(factor, seed: int = 7):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    from megatron_deepepv2.mcore.experts import with_sync_free_experts
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=2)
    extra = dict(hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2)
    if factor is not None:
        extra["moe_expert_rank_capacity_factor"] = factor
    config = transformer_config(TinyMoEConfig(**SHAPE, extra=extra), "deepepv2")
    torch.manual_seed(seed)
    spec = with_sync_free_experts(get_gpt_layer_local_spec(num_experts=SHAPE["num_experts"], moe_grouped_gemm=False))
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ)
    model.zero_grad_buffer = lambda: model.zero_grad(set_to_none=True)  # what Megatron's DDP wrapper provides
    return model, config


def _batches(rank: int, count: int):
    for index in range(count):
        tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=torch.Generator().manual_seed(10 * index + rank))
        yield {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(SEQ).unsqueeze(0),
               "attention_mask": torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)}


def _forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(batch["input_ids"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"loss": loss.detach()}

    return output, loss_func


def _rerun(rank: int, world: int, factor: float) -> dict:
    _setup()
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe import paged_stash

    from megatron_deepepv2.testing import cpu_shims

    # The paged stash's own flags are made on "cuda" (the stash is off here): on the CPU instead. The budget side --
    # check_over_budget, the rerun, clearing and restoring the factor, reset_over_budget -- is Megatron's code.
    paged_stash.torch = cpu_shims._TorchOnCpu()
    dv2.configure(host_sync=False, num_max_tokens_per_rank=CAPACITY, validate=False)
    model, config = _gpt(factor)
    oracle, _ = _gpt(None)  # the same parameters, dropless
    dispatcher = model.decoder.layers[0].mlp.token_dispatcher
    manager = dispatcher._comm_manager
    megatron_step = get_forward_backward_func()
    attempts = []

    def forward_backward(**kwargs):
        attempts.append(manager.moe_expert_rank_capacity_factor)
        return megatron_step(**kwargs)

    runner = paged_stash.PagedStashRunner(config, False, [model], None, forward_backward)
    args = dict(forward_step_func=_forward_step, num_microbatches=2, seq_length=SEQ, micro_batch_size=1,
                forward_only=False)
    losses = runner(model=[model], data_iterator=_batches(rank, 2), **args)
    expected = megatron_step(model=[oracle], data_iterator=_batches(rank, 2), **args)
    for got, want in zip(losses, expected):
        torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    oracle_grads = {n: p.grad for n, p in oracle.named_parameters()}
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, oracle_grads[name], rtol=1e-5, atol=1e-6, msg=name)
    return {"attempts": attempts, "factor_after": manager.moe_expert_rank_capacity_factor,
            "over_budget": bool(dispatcher.check_over_budget()), "dropped": int(manager.dropped_rows)}


@needs_factor
def test_megatrons_over_budget_rerun_drives_a_deepepv2_layer() -> None:
    """PagedStashRunner (what megatron.training wraps around every step when the factor is set): a step that dropped
    tokens on any rank is rerun dropless (factor None, counters reset) and the factor comes back afterwards; a step
    that dropped none runs once. The rerun's losses and gradients are the dropless layer's."""
    dropping = run_distributed(_rerun, 2, 0.25, timeout=240)
    for report in dropping:
        assert report["attempts"] == [0.25, None], report
        assert report["factor_after"] == 0.25 and not report["over_budget"] and report["dropped"] == 0, report
    fitting = run_distributed(_rerun, 2, 8.0, timeout=240)
    for report in fitting:
        assert report["attempts"] == [8.0] and report["factor_after"] == 8.0 and not report["over_budget"], report


def _reset(rank: int, world: int) -> list:
    _setup()
    _, bounded = _layers(0.25, True)
    x = torch.randn(TOKENS[rank], 1, SHAPE["hidden"], generator=torch.Generator().manual_seed(rank))
    bounded(x)[0].sum().backward()
    manager = bounded.token_dispatcher._comm_manager
    before = (int(manager.dropped_rows), bool(manager.over_budget))
    bounded.token_dispatcher.reset_over_budget()  # Megatron's hook on the dispatcher
    return [before, (int(manager.dropped_rows), bool(manager.over_budget))]


@needs_factor
def test_reset_over_budget_clears_the_dropped_count_too() -> None:
    reports = run_distributed(_reset, 2)
    assert any(before[0] > 0 and before[1] for before, _ in reports), reports
    for _, after in reports:
        assert after == (0, False)


def _dropped_selections(rank: int, world: int, alignment: int) -> dict:
    """Alignment pads each expert block: rows past the bound that are padding are not dropped selections."""
    _setup()
    from megatron.core.transformer.moe import moe_utils

    moe_utils.get_align_size_for_quantization = lambda config: alignment
    plain, bounded = _layers(0.25, True)
    x = torch.randn(TOKENS[rank], 1, SHAPE["hidden"], generator=torch.Generator().manual_seed(rank))
    seen = {}

    def probs_past(module, inputs, output):
        valid = int(plain.token_dispatcher._comm_manager.handle.num_valid_rows)
        seen["probs"] = inputs[2].detach()[:valid].clone()  # rows past the valid ones are unspecified

    hook = plain.experts.register_forward_hook(probs_past)
    plain(x)
    hook.remove()
    bounded(x)
    manager = bounded.token_dispatcher._comm_manager
    bound = -(-int(TOKENS[rank] * SHAPE["topk"] * 0.25) // alignment) * alignment
    return {"bound": bound, "dropped": int(manager.dropped_rows), "padded_rows_past_bound": seen["probs"][bound:].numel(),
            "selections_past_bound": int((seen["probs"][bound:] != 0).sum())}


@needs_factor
def test_dropped_rows_counts_selections_not_padding() -> None:
    reports = run_distributed(_dropped_selections, 2, 4)
    assert any(r["dropped"] > 0 for r in reports), reports
    assert any(r["padded_rows_past_bound"] > r["selections_past_bound"] for r in reports), reports  # padding cut
    for r in reports:
        assert r["dropped"] == r["selections_past_bound"], r


def _paged_stash(rank: int, world: int) -> str:
    _setup()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, transformer_config

    with pytest.raises(ValueError) as excinfo:
        transformer_config(TinyMoEConfig(extra={"moe_expert_rank_capacity_factor": 1.5, "moe_paged_stash": True}),
                           "deepepv2")
    return str(excinfo.value)


@pytest.mark.skipif(not _megatron_has("moe_paged_stash"), reason="this megatron-core has no moe_paged_stash")
def test_paged_stash_is_refused_saying_why() -> None:
    message = run_distributed(_paged_stash, 1)[0]
    assert "moe_paged_stash is not supported with moe_flex_dispatcher_backend='deepepv2'" in message
    assert "Transformer Engine grouped tensors" in message and "Drop --moe-paged-stash" in message


# ----------------------------------------------------------------------------------------------
# Retired buffers released once per training step
# ----------------------------------------------------------------------------------------------
def _finalize_hook(rank: int, world: int) -> dict:
    calls = []

    def builder_finalize(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
        calls.append("finalize")  # a builder-installed finalize function, bound before install() ran

    _setup()
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_deepepv2 import buffers

    buffers.release_retired_buffers = lambda: calls.append("release") or 0
    dv2.configure(num_max_tokens_per_rank=CAPACITY, validate=False)
    model, config = _gpt(None)
    config.finalize_model_grads_func = builder_finalize
    args = dict(model=[model], forward_step_func=_forward_step, num_microbatches=2, seq_length=SEQ,
                micro_batch_size=1)
    get_forward_backward_func()(data_iterator=_batches(rank, 2), forward_only=False, **args)
    training = list(calls)
    get_forward_backward_func()(data_iterator=_batches(rank, 2), forward_only=True, **args)
    import copy

    stored = copy.deepcopy(config).__dict__["finalize_model_grads_func"]  # copies carry the plain function
    return {"training": training, "evaluation": calls[len(training):], "stored_plain": stored is builder_finalize}


def test_retired_buffers_are_released_after_each_training_steps_gradient_finalisation() -> None:
    """Megatron's schedule calls config.finalize_model_grads_func once per training step: the release follows it
    (even for a function bound before install()), and an evaluation step (no finalisation) releases nothing."""
    for report in run_distributed(_finalize_hook, 2, timeout=180):
        assert report["training"] == ["finalize", "release"], report
        assert report["evaluation"] == [] and report["stored_plain"], report
