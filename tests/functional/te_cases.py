"""Functional cases for deepepv2 under Transformer Engine, as Megatron users train: TE layers with ``TEGroupedMLP``
experts, TE's op-fuser grouped MLP, fused permute, TE's FP8 recipes (with and without FP8 dispatch),
``--deterministic-mode`` and a whole TE layer in a CUDA graph, on one or more GPUs under ``torchrun``.

Each case compares deepepv2 on ElasticBuffer with Megatron's alltoall dispatcher on the same TE configuration (the
same parameters, inputs and experts), or a run with itself replayed. Every case is skipped, saying why, without
Transformer Engine. ``tests/functional/test_transformer_engine.py`` launches this file; by hand::

    EP_DISABLE_GIN=1 torchrun --nproc-per-node 1 tests/functional/te_cases.py [CASE ...] [--except=CASE ...]
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import megatron_deepepv2 as dv2  # noqa: E402
from megatron_deepepv2.backends.deepep.backend import DeepEPBackend  # noqa: E402
from megatron_deepepv2.testing.moe_model import (  # noqa: E402
    TinyMoEConfig,
    build_moe_layer,
    build_transformer_layer,
    capture_layer_step,
    layer_step,
    transformer_config,
)
from tests.functional.runner import RANK, CaseRegistry, log  # noqa: E402

# Read by cuBLAS when its handle is created; torch's deterministic algorithms (a case below) require it.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
CASES = CaseRegistry()
case = CASES.case

TOKENS = 512
#: Relative L2 error allowed between two BF16 runs of one layer that differ only in the dispatcher: both feed the
#: experts the same rows and differ in the order of sums (BF16 keeps 8 significant bits: 2**-8 = 3.9e-3 a rounding).
BF16_RELATIVE_ERROR = 1e-2
#: An FP8 run's relative L2 error against the BF16 run of the same layer, for deepepv2, may exceed alltoall's under the
#: same recipe by this factor (plus BF16_RELATIVE_ERROR / 5 of slack for tensors where both are tiny); with FP8
#: dispatch the rows cross once more as e4m3 before TE quantises them, so the bound doubles.
FP8_ERROR_FACTOR, FP8_DISPATCH_ERROR_FACTOR = 1.25, 2.5


def transformer_engine_missing() -> Optional[str]:
    """Why these cases cannot run here, or None."""
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415
    except Exception as error:  # noqa: BLE001 - TE raises more than ImportError when its libraries do not load
        return f"needs Transformer Engine ({type(error).__name__}: {error})"
    return DeepEPBackend.unavailable_reason()


def _shape(**extra) -> TinyMoEConfig:
    return TinyMoEConfig(hidden=1024, ffn=512, num_experts=16, topk=4, params_dtype=torch.bfloat16,
                         extra={"moe_grouped_gemm": True, **extra})


def _input(shape: TinyMoEConfig, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + RANK)
    return torch.randn(TOKENS, 1, shape.hidden, generator=gen).to(torch.bfloat16).cuda()


@contextlib.contextmanager
def _fp8_autocast(config) -> Iterator[None]:
    """Megatron's FP8 context for ``config`` (a no-op when the config trains without FP8)."""
    from megatron.core.fp8_utils import get_fp8_context  # noqa: PLC0415

    with get_fp8_context(config) if config.fp8 else contextlib.nullcontext():
        yield


def _step(layer: torch.nn.Module, x0: torch.Tensor) -> dict[str, torch.Tensor]:
    """One forward and backward (loss ``sum(y**2)``: gradients of order one, which FP8's first delayed-scaling step,
    at scale one, represents): the output, the input gradient and every parameter gradient."""
    x = x0.clone().requires_grad_()
    with _fp8_autocast(layer.config):
        y, _ = layer(x)
    y.float().pow(2).sum().backward()
    torch.cuda.synchronize()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters() if p.grad is not None}
    return {"output": y.detach(), "grad_input": x.grad, **grads}


def _run(build: Callable[[str], torch.nn.Module], dispatcher: str, x0: torch.Tensor) -> dict[str, torch.Tensor]:
    layer = build(dispatcher)
    if dispatcher == "deepepv2":
        config = layer.token_dispatcher._comm_manager.dispatch_config if hasattr(layer, "token_dispatcher") \
            else layer.mlp.token_dispatcher._comm_manager.dispatch_config
        assert config.backend is DeepEPBackend, config
    result = _step(layer, x0)
    del layer
    dv2.destroy_buffers()
    return result


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def _compare(tag: str, got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
             bound: float = BF16_RELATIVE_ERROR) -> float:
    """Asserts the same tensors, each within ``bound`` relative L2 error of ``want``'s; returns the largest error."""
    assert got.keys() == want.keys(), (tag, sorted(got.keys() ^ want.keys()))
    errors = {name: _relative_error(got[name], want[name]) for name in want}
    worst = max(errors, key=errors.get)
    log(f"  {tag}: {len(want)} tensors, largest relative error {errors[worst]:.2e} ({worst})")
    assert errors[worst] <= bound, f"{tag} {worst}: relative error {errors[worst]:.3e} > {bound:.1e}"
    return errors[worst]


def _as_accurate_as(tag: str, got: dict[str, torch.Tensor], baseline: dict[str, torch.Tensor],
                    exact_run: dict[str, torch.Tensor], factor: float) -> None:
    """Asserts ``got`` is within ``factor`` times ``baseline``'s relative error against ``exact_run``, tensor by
    tensor (both quantised runs of one layer, ``exact_run`` its BF16 run)."""
    assert got.keys() == baseline.keys() == exact_run.keys(), tag
    slack = BF16_RELATIVE_ERROR / 5
    ratios = {}
    for name in exact_run:
        error = _relative_error(got[name], exact_run[name])
        baseline_error = _relative_error(baseline[name], exact_run[name])
        ratios[name] = (error, baseline_error)
        assert baseline_error < 0.25, \
            f"{tag} {name}: alltoall's FP8 run is {baseline_error:.2e} from BF16: not one layer"
        assert error <= factor * baseline_error + slack, \
            f"{tag} {name}: relative error {error:.3e} against BF16, alltoall's {baseline_error:.3e}"
    worst = max(ratios, key=lambda name: ratios[name][0])
    log(f"  {tag}: largest relative error against BF16 {ratios[worst][0]:.2e} ({worst}; alltoall "
        f"{ratios[worst][1]:.2e})")


def _against_alltoall(tag: str, build: Callable[[str], torch.nn.Module], x0: torch.Tensor) -> dict[str, torch.Tensor]:
    want = _run(build, "alltoall", x0)
    _compare(tag, _run(build, "deepepv2", x0), want)
    return want


def _builder(build: Callable[..., torch.nn.Module], shape: TinyMoEConfig, **kwargs) -> Callable[[str], torch.nn.Module]:
    """``dispatcher -> layer`` for ``build(shape, dispatcher, **kwargs)``."""
    return lambda dispatcher: build(shape, dispatcher, **kwargs)


@case
def te_layer_with_grouped_mlp_matches_alltoall() -> None:
    """A whole TE ``TransformerLayer`` (TE attention, TE linear layers) with ``TEGroupedMLP`` experts and host sync:
    deepepv2 against alltoall, output and every gradient."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP  # noqa: PLC0415

    dv2.configure(backend="deepep", host_sync=True)
    shape = _shape()
    build = _builder(build_transformer_layer, shape, seed=3)
    assert isinstance(build("deepepv2").mlp.experts, TEGroupedMLP)
    dv2.destroy_buffers()
    _against_alltoall("TE layer, TEGroupedMLP", build, _input(shape))


@case
def te_op_fuser_grouped_mlp_with_and_without_host_sync() -> None:
    """``TEGroupedMLP`` through TE's op fuser (``use_transformer_engine_op_fuser``; on Hopper Megatron fuses only the
    weighted squared ReLU): deepepv2 with host sync against alltoall. Without host sync, where TE's GroupedLinear
    would split the rows on the host, building the layer raises naming what works; elsewhere it matches alltoall."""
    from megatron.core.activations import squared_relu  # noqa: PLC0415

    from megatron_deepepv2.mcore.experts import te_op_fuser_host_split_reason  # noqa: PLC0415

    shape = _shape(use_transformer_engine_op_fuser=True, activation_func=squared_relu,
                   use_fused_weighted_squared_relu=True)
    build = _builder(build_moe_layer, shape, seed=4, transformer_engine=True)
    x0 = _input(shape)
    dv2.configure(backend="deepep", host_sync=True)
    want = _against_alltoall("op fuser, host sync", build, x0)
    dv2.configure(host_sync=False, num_max_tokens_per_rank=TOKENS)
    try:
        reason = te_op_fuser_host_split_reason(transformer_config(shape, "deepepv2"))
        log(f"  op fuser without host sync here: {reason or 'graph-safe grouped-tensor path'}")
        if reason is None:
            _compare("op fuser, no host sync", _run(build, "deepepv2", x0), want)
        else:
            try:
                build("deepepv2")
            except ValueError as error:
                assert reason in str(error) and "SyncFreeSequentialMLP" in str(error), error
            else:
                raise AssertionError("a no-host-sync layer with op-fuser experts that split on the host was built")
    finally:
        dv2.configure(host_sync=True, num_max_tokens_per_rank=None)
        dv2.destroy_buffers()


@case
def permute_fusion_matches_alltoall() -> None:
    """``moe_permute_fusion`` (``--moe-permute-fusion``) with TE experts: deepepv2 against alltoall with TE's fused
    permute."""
    shape = _shape(moe_permute_fusion=True)
    dv2.configure(backend="deepep", host_sync=True)
    _against_alltoall("permute fusion", _builder(build_moe_layer, shape, seed=5, transformer_engine=True),
                      _input(shape))


FP8_RECIPES = ("delayed", "tensorwise", "blockwise")


@case
def te_fp8_recipes_as_accurate_as_alltoall() -> None:
    """TE FP8 training (``fp8='hybrid'``) with each recipe Hopper runs: against the BF16 run of the same layer, deepepv2
    is as accurate as alltoall under the same recipe; with FP8 dispatch too (its e4m3 rows are dequantised once to
    BF16, which TE's quantised GEMMs take)."""
    dv2.configure(backend="deepep", host_sync=True)
    x0 = _input(_shape())
    exact_run = _run(_builder(build_moe_layer, _shape(), seed=6, transformer_engine=True), "alltoall", x0)
    for recipe in FP8_RECIPES:
        build = _builder(build_moe_layer, _shape(fp8="hybrid", fp8_recipe=recipe), seed=6, transformer_engine=True)
        baseline = _run(build, "alltoall", x0)
        _as_accurate_as(f"FP8 {recipe}", _run(build, "deepepv2", x0), baseline, exact_run, FP8_ERROR_FACTOR)
        dv2.configure(fp8_dispatch=True)
        try:
            _as_accurate_as(f"FP8 {recipe} + FP8 dispatch", _run(build, "deepepv2", x0), baseline, exact_run,
                            FP8_DISPATCH_ERROR_FACTOR)
        finally:
            dv2.configure(fp8_dispatch=False)


@case
def te_layer_deterministic_mode_replays_bit_exact() -> None:
    """``--deterministic-mode`` with a whole TE layer and ``TEGroupedMLP``: on each dispatcher three replays under
    contention equal bit for bit; deepepv2 and alltoall, whose combines sum in another order, agree within BF16
    tolerance (how many tensors differ bitwise is logged)."""
    from tests.determinism.harness import assert_replays_bit_exact, moe_layer_replay  # noqa: PLC0415

    shape = _shape(deterministic_mode=True)
    x0 = _input(shape)
    saved = os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"  # what --deterministic-mode asks of TE attention
    torch.use_deterministic_algorithms(True)
    dv2.configure(backend="deepep", host_sync=True)
    try:
        results = {}
        for dispatcher in ("deepepv2", "alltoall"):
            layer = build_transformer_layer(shape, dispatcher, seed=7)
            results[dispatcher] = assert_replays_bit_exact(moe_layer_replay(layer, x0), replays=3)
            del layer
            dv2.destroy_buffers()
        differing = [name for name in results["alltoall"]
                     if not torch.equal(results["deepepv2"][name], results["alltoall"][name])]
        log(f"  deepepv2 and alltoall differ bitwise in {len(differing)} of {len(results['alltoall'])} tensors"
            f"{': ' + ', '.join(differing) if differing else ''}")
        _compare("deterministic, deepepv2 vs alltoall", results["deepepv2"], results["alltoall"])
    finally:
        torch.use_deterministic_algorithms(False)
        if saved is None:
            del os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"]
        else:
            os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = saved


@case
def te_layer_cuda_graph_replay_equals_eager() -> None:
    """No host sync: a whole TE ``TransformerLayer`` (TE attention, ``SyncFreeSequentialMLP`` experts) forward and
    backward captured in one CUDA graph replays equal to eager steps on new inputs (BF16 tolerance: TE's attention
    backward and DeepEP's receive order are not bitwise deterministic)."""
    shape = _shape(moe_grouped_gemm=False)  # SequentialMLP in the TE spec, which the sync-free experts replace
    dv2.configure(backend="deepep", host_sync=False, num_max_tokens_per_rank=TOKENS)
    try:
        layer = build_transformer_layer(shape, "deepepv2", seed=8, sync_free_experts=True)
        inputs = [_input(shape, seed) for seed in (10, 11, 12)]
        grad = _input(shape, 13)
        static_x = inputs[0].clone().requires_grad_()
        layer_step(layer, static_x, grad)
        graph, static_y = capture_layer_step(layer, static_x, grad)
        static = {"output": static_y, "grad_input": static_x.grad,
                  **{n: p.grad for n, p in layer.named_parameters() if p.grad is not None}}
        for index, x_new in enumerate(inputs[1:]):
            eager_x = x_new.clone().requires_grad_()
            eager_y = layer_step(layer, eager_x, grad)
            eager = {"output": eager_y.detach().clone(), "grad_input": eager_x.grad.clone(),
                     **{n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}}
            static_x.data.copy_(x_new)
            graph.replay()
            torch.cuda.synchronize()
            _compare(f"graph replay {index}", {k: v.detach() for k, v in static.items()}, eager)
    finally:
        dv2.configure(host_sync=True, num_max_tokens_per_rank=None)
        dv2.destroy_buffers()


if __name__ == "__main__":
    dv2.install()
    sys.exit(CASES.main(sys.argv[1:], skip_all=transformer_engine_missing(), what=__doc__.split("\n\n")[0]))
