"""SyncFreeSequentialMLP against Megatron's SequentialMLP: numerics, the worst-case tail, checkpoints, the spec helper.

The oracle is Megatron's own ``SequentialMLP`` built with the same seed (one ``MLP`` per expert, host split),
so every comparison is against code this package does not contain. The CUDA cases (the fused Triton
kernels) run on a GPU machine and skip elsewhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megatron.core.activations import quick_gelu

from megatron_deepepv2.mcore.expert_kernels import FusedActivation
from tests.distributed import run_distributed

HIDDEN, FFN, EXPERTS = 64, 96, 4
COUNTS = [5, 0, 17, 9]  # an expert without rows included
TAIL = 13  # worst-case rows past the blocks

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _require(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (the fused Triton kernels)")


def _build(kind: str, activation: str, dtype: torch.dtype, device: str, seed: int = 7, **config_fields):
    """One expert module of ``kind`` ("sequential" or "sync_free") on a 1-rank world (``config_fields`` over the
    TransformerConfig's)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, init_expert_parallel, transformer_config

    init_expert_parallel(1)
    extra = {
        "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
        "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
        "clamped_swiglu": dict(gated_linear_unit=True, activation_func=F.silu, activation_func_clamp_value=0.5,
                               glu_linear_offset=1.0),
        # GPT-OSS-style: quick GELU gated, clamped, with the linear offset.
        "clamped_quick_geglu": dict(gated_linear_unit=True, activation_func=quick_gelu,
                                    activation_func_clamp_value=2.0, glu_linear_offset=1.0),
        "relu": dict(gated_linear_unit=False, activation_func=F.relu),  # not fused: PyTorch ops on CUDA too
    }[activation]
    # Weights large enough that the activation works in its non-linear range (Megatron's default std 0.02 keeps
    # FC1 outputs near 0, where a wrong SiLU derivative would hide inside the tolerance).
    extra = {**extra, "init_method_std": 0.3, **config_fields}
    shape = TinyMoEConfig(hidden=HIDDEN, ffn=FFN, num_experts=EXPERTS, topk=2, params_dtype=dtype, extra=extra)
    config = transformer_config(shape, "alltoall")
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    submodules = (mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules).experts
    mlp_submodules = submodules.keywords["submodules"] if hasattr(submodules, "keywords") else submodules.submodules
    cls = SequentialMLP if kind == "sequential" else SyncFreeSequentialMLP
    torch.manual_seed(seed)
    module = cls(EXPERTS, config, mlp_submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    return module.to(device)


def _inputs(dtype: torch.dtype, device: str, tail: int):
    gen = torch.Generator().manual_seed(3)
    rows = sum(COUNTS)
    x = torch.randn(rows + tail, HIDDEN, generator=gen).to(dtype)
    probs = torch.rand(rows + tail, generator=gen)
    if tail:
        x[rows:] = float("nan")  # the worst-case tail holds whatever the buffer held
        probs[rows:] = float("nan")
    grad = torch.randn(rows + tail, HIDDEN, generator=gen).to(dtype)
    return x.to(device), probs.to(device), grad.to(device)


def _step(module, x, probs, counts, grad):
    x = x.clone().requires_grad_(True)
    probs = probs.clone().requires_grad_(True)
    for p in module.parameters():
        p.grad = None
    out, bias = module(x, counts, probs)
    assert bias is None
    out.backward(grad)
    return out.detach(), x.grad, probs.grad


def _expert_grads(module) -> tuple[torch.Tensor, torch.Tensor]:
    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP

    if isinstance(module, SyncFreeSequentialMLP):
        return module.weight1.grad, module.weight2.grad
    return (torch.stack([e.linear_fc1.weight.grad for e in module.local_experts]),
            torch.stack([e.linear_fc2.weight.grad for e in module.local_experts]))


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    # Relative to the tensor's scale: BF16 rounding of the GEMM inputs and outputs, FP32 for the FP32 case.
    scale = float(expected.float().abs().max()) or 1.0
    rel = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(actual.float(), expected.float(), atol=rel * scale, rtol=rel,
                               msg=lambda m: f"{what}: {m}")


def _compare_case(rank: int, world: int, activation: str, dtype: torch.dtype, device: str, host_counts: bool,
                  tail: int) -> None:
    rows = sum(COUNTS)
    ref = _build("sequential", activation, dtype, device)
    new = _build("sync_free", activation, dtype, device)
    x, probs, grad = _inputs(dtype, device, tail)
    counts = torch.tensor(COUNTS)
    ref_out, ref_dx, ref_dp = _step(ref, x[:rows], probs[:rows], counts, grad[:rows])
    new_counts = counts if host_counts else counts.to(device)
    out, dx, dp = _step(new, x, probs, new_counts, grad)
    _close(out[:rows], ref_out, dtype, "output")
    _close(dx[:rows], ref_dx, dtype, "input gradient")
    _close(dp[:rows], ref_dp, dtype, "probability gradient")
    for name, got, want in zip(("fc1", "fc2"), _expert_grads(new), _expert_grads(ref)):
        _close(got, want, dtype, f"{name} weight gradient")
    if tail:  # rows past the blocks: zero output and zero gradients, whatever they held
        for name, tensor in (("output", out), ("input gradient", dx), ("probability gradient", dp)):
            assert torch.equal(tensor[rows:], torch.zeros_like(tensor[rows:])), f"{name} past the blocks is not zero"


ACTIVATIONS = ["swiglu", "gelu", "clamped_swiglu", "clamped_quick_geglu", "relu"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_matches_sequential_mlp_with_host_counts(activation: str, device: str) -> None:
    _require(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    run_distributed(_compare_case, 1, activation, dtype, device, True, 0, cuda=device == "cuda")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_worst_case_tail_is_neither_read_nor_left_nonzero(activation: str, device: str) -> None:
    _require(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    run_distributed(_compare_case, 1, activation, dtype, device, False, TAIL, cuda=device == "cuda")


FUSED = {
    "swiglu": FusedActivation("silu", gated=True),
    "gelu": FusedActivation("gelu", gated=False),
    "clamped_swiglu": FusedActivation("silu", gated=True, clamp=0.5, linear_offset=1.0),
    "clamped_quick_geglu": FusedActivation("quick_gelu", gated=True, clamp=2.0, linear_offset=1.0),
    "relu": None,
}


def _fused_case(rank: int, world: int, activation: str) -> None:
    assert _build("sync_free", activation, torch.float32, "cpu")._fused_activation == FUSED[activation]


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_fused_kernels_cover_silu_quick_gelu_and_gelu_with_clamp_and_offset(activation: str) -> None:
    run_distributed(_fused_case, 1, activation)


def test_fused_activation_rejects_what_megatron_does_not_define() -> None:
    with pytest.raises(ValueError, match="unknown fused activation"):
        FusedActivation("relu", gated=False)
    with pytest.raises(ValueError, match="gated activations only"):
        FusedActivation("gelu", gated=False, clamp=1.0)


def test_bfloat16_on_cpu_matches_sequential_mlp() -> None:
    run_distributed(_compare_case, 1, "swiglu", torch.bfloat16, "cpu", True, TAIL)


def _checkpoint_case(rank: int, world: int, directory: str) -> None:
    ref = _build("sequential", "swiglu", torch.float32, "cpu", seed=11)
    new = _build("sync_free", "swiglu", torch.float32, "cpu", seed=11)
    ref_sd, new_sd = ref.state_dict(), new.state_dict()
    assert sorted(new_sd) == sorted(ref_sd), (sorted(new_sd), sorted(ref_sd))
    for key, value in ref_sd.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(new_sd[key], value), f"{key} differs after the same initialisation"
    # SequentialMLP -> SyncFree (strict), with other values.
    other = _build("sequential", "swiglu", torch.float32, "cpu", seed=12)
    new.load_state_dict(other.state_dict(), strict=True)
    for key, value in other.state_dict().items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(new.state_dict()[key], value), f"{key} not loaded"
    # SyncFree -> SequentialMLP (strict).
    ref.load_state_dict(new.state_dict(), strict=True)
    assert torch.equal(ref.local_experts[2].linear_fc2.weight, new.weight2[2])
    # A state dict missing one expert's weight is refused by strict loading, not half-loaded.
    broken = other.state_dict()
    del broken["local_experts.1.linear_fc1.weight"]
    before = new.weight1.detach().clone()
    with pytest.raises(RuntimeError, match="local_experts"):
        new.load_state_dict(broken, strict=True)
    assert torch.equal(new.weight1, before)
    # Megatron's distributed checkpoint: built, the same shards as SequentialMLP's (keys, global shapes, offsets,
    # replica ids, values), and every parameter has an entry over itself, which Megatron's optimizers need to shard
    # their states like the parameters.
    assert _built_shards(new) == _built_shards(ref)
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    mapped = get_param_id_to_sharded_param_map(new.sharded_state_dict(), new.parameters())
    assert sorted(mapped) == list(range(len(list(new.parameters())))), mapped
    # Flattened shards (a distributed optimizer's 'fully_sharded_model_space' format) are refused, saying why.
    with pytest.raises(NotImplementedError, match="cannot be saved flattened"):
        dataclasses.replace(new.sharded_state_dict()["weight1"], flattened_range=slice(0, 8)).build()
    # A checkpoint written by one module loads into the other, and back.
    from megatron.core import dist_checkpointing

    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()  # Megatron's checkpoint writer synchronises CUDA
    round_trips = {"to_sequential": (new, _build("sequential", "swiglu", torch.float32, "cpu", seed=13)),
                   "to_sync_free": (ref, _build("sync_free", "swiglu", torch.float32, "cpu", seed=14))}
    for name, (source, target) in round_trips.items():
        folder = Path(directory) / name
        folder.mkdir()
        dist_checkpointing.save(source.sharded_state_dict(), str(folder))
        target.load_state_dict(dist_checkpointing.load(target.sharded_state_dict(), str(folder)), strict=True)
        loaded = target.state_dict()
        for key, value in source.state_dict().items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[key], value), (name, key)
    # After the sharded view, the experts again have no weight of their own (one copy of each parameter).
    assert {name for name, _ in new.named_parameters()} == {"weight1", "weight2"}


def _built_shards(module) -> list[tuple]:
    """The module's distributed-checkpoint shards as Megatron writes them (factories built), in a stable order."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import apply_factories

    entries = module.sharded_state_dict()
    apply_factories(entries)
    return sorted((type(t).__name__, t.key, t.global_shape, t.global_offset, t.replica_id,
                   t.data.tolist() if isinstance(t.data, torch.Tensor) else None) for t in nested_values(entries))


def test_checkpoints_move_between_sequential_mlp_and_sync_free(tmp_path: Path) -> None:
    run_distributed(_checkpoint_case, 1, str(tmp_path))


def _attributes_case(rank: int, world: int) -> tuple[dict, dict]:
    with pytest.raises(ValueError, match="without bias; pass --disable-bias-linear"):  # the module runs the rules
        _build("sync_free", "swiglu", torch.float32, "cpu", add_bias_linear=True)
    new = _build("sync_free", "swiglu", torch.float32, "cpu")
    with pytest.raises(ValueError, match="one row count per local expert"):
        new(torch.zeros(4, HIDDEN), torch.tensor([4]), torch.ones(4))
    ref = _build("sequential", "swiglu", torch.float32, "cpu")
    expected = {"weight1": vars(ref.local_experts[0].linear_fc1.weight),
                "weight2": vars(ref.local_experts[0].linear_fc2.weight)}
    got = {name: {k: getattr(p, k, None) for k in expected[name]} for name, p in new.named_parameters()}
    return got, expected


def test_stacked_weights_are_expert_parameters_and_counts_are_checked() -> None:
    ((attributes, expected),) = run_distributed(_attributes_case, 1)
    # Megatron's DDP sorts parameters into dense / expert-data-parallel buffers by `allreduce`; the stacked weights
    # carry the experts' attributes (partition_dim one to the right, past the expert dimension).
    assert all("allreduce" in attrs for attrs in expected.values())
    shifted = {name: {k: v + 1 if k == "partition_dim" else v for k, v in attrs.items()}
               for name, attrs in expected.items()}
    assert attributes == shifted


def _experts_entry(spec):
    mlp = spec.submodules.mlp
    experts = (mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules).experts
    return getattr(experts, "func", getattr(experts, "module", None))


def test_spec_helper_puts_sync_free_experts_into_a_copy_of_the_spec() -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP, with_sync_free_experts

    original = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    changed = with_sync_free_experts(original)
    assert _experts_entry(changed) is SyncFreeSequentialMLP
    assert _experts_entry(original).__name__ == "SequentialMLP"
    with pytest.raises(ValueError, match="MoE layer"):
        with_sync_free_experts(get_gpt_layer_local_spec())
