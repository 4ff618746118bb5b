#!/usr/bin/env python3
"""Benchmark of the expert compute on one GPU: SyncFreeSequentialMLP against SequentialMLP and bare grouped GEMMs.

For each shape (local experts E, hidden H, expert FFN F, activation, BF16) it builds the receive of one expand
dispatch -- per-expert row counts aligned to 128, drawn from a seeded multinomial -- and times forward +
backward (median of ``--iters`` after warm-up, CUDA events) of:

* ``sequential_mlp``: Megatron's ``SequentialMLP`` (what the local layer spec builds without Transformer Engine),
  host counts;
* ``sync_free_exact``: :class:`~megatron_deepepv2.mcore.experts.SyncFreeSequentialMLP` with host counts (the
  host-sync dispatch: exactly the aligned rows);
* ``sync_free_worst_case``: the same module on the no-host-sync worst-case buffer (``--worst-rows`` rows, the
  rest past the blocks) with device counts;
* ``grouped_gemm_pair``: two bare ``torch._grouped_mm`` calls (FC1, FC2) on weights already stacked
  ``[E, out, in]``, autograd backward: the GEMM work alone, the target's denominator;
* with Transformer Engine: ``te_grouped_mlp``, Megatron's ``TEGroupedMLP`` (what ``--moe-grouped-gemm`` builds from
  the TE spec), host counts; and, for squared ReLU (the one activation Megatron fuses on Hopper),
  ``te_op_fuser``: the same module through TE's op fuser (``use_transformer_engine_op_fuser``). Both get
  ``SyncFreeSequentialMLP``'s weights, so their outputs are checked against its. Without TE they are reported as not
  run, with the reason.

Activations: Megatron's SwiGLU, its default non-gated GELU, the clamped quick-GeGLU of GPT-OSS-style models
(``quick_gelu`` gated, ``activation_func_clamp_value`` 7, ``glu_linear_offset`` 1) and squared ReLU.

Shape sets (``--shapes``): ``dispatch``, the receive of the EP2 dispatch benchmarks' shapes and a DeepSeek-V3-like
expert; ``training``, the expert shapes of the example models of ``examples/pretrain_gpt_moe_deepepv2.sh`` at EP=1
(every expert local, top-8), as ``tools/train_gpt.py`` trains them.

``--trace`` adds to each variant a summary of a few profiled iterations (``torch.profiler``): GPU kernel time and
launches per forward + backward, the host's wall time per call, the synchronising CUDA calls and copies, and the
kernels that take the most GPU time. Profiling slows the launches: read it as counts and shares, the timings above as
times. The TE variants get the counts on the host, as with host sync; TE copies the split sizes to the GPU for its
grouped GEMM, a copy that a training step with device counts would not have.

Prints progress, checks the outputs against ``SequentialMLP``, writes ``NAME.json`` and ``NAME.png`` to ``--out``
(``bench_experts`` unless ``--name``)::

    python tools/bench_experts.py --out bench_out [--quick]
    python tools/bench_experts.py --out bench_out --shapes training --name bench_experts_training --trace
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

logger = logging.getLogger("bench_experts")


@dataclass
class ExpertShape:
    """One expert-compute shape.

    Attributes:
        experts: Local experts.
        hidden: Hidden size.
        ffn: Expert FFN hidden size (FC1 has ``2 * ffn`` outputs: SwiGLU).
        selections: Token selections this rank receives (before alignment padding).
        worst_rows: Rows of the no-host-sync worst-case buffer.
        alignment: Per-expert block alignment.
        activation: A key of :data:`ACTIVATIONS`.
        model: The example model the shape is of (``MODEL`` of the example script), or None.
    """

    experts: int
    hidden: int
    ffn: int
    selections: int
    worst_rows: int
    alignment: int = 128
    activation: str = "swiglu"
    model: Optional[str] = None

    @property
    def label(self) -> str:
        shape = f"E{self.experts} H{self.hidden} F{self.ffn} {self.activation}"
        return f"{self.model}: {shape}" if self.model else shape


def _activations() -> dict[str, dict]:
    from megatron.core.activations import quick_gelu, squared_relu  # noqa: PLC0415

    return {
        "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
        "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
        "clamped_quick_geglu": dict(gated_linear_unit=True, activation_func=quick_gelu,
                                    activation_func_clamp_value=7.0, glu_linear_offset=1.0),
        "squared_relu": dict(gated_linear_unit=False, activation_func=squared_relu),
    }


#: Activation names: TransformerConfig fields (resolved when Megatron is importable).
ACTIVATIONS = ("swiglu", "gelu", "clamped_quick_geglu", "squared_relu")

# T4096 H4096 64 experts top-8 at EP2: 32 local experts, 32,768 selections, 65,536 worst-case rows.
_EP2_SHAPE = dict(experts=32, hidden=4096, ffn=1024, selections=32768, worst_rows=65536)
SHAPES = [
    *(ExpertShape(**_EP2_SHAPE, activation=activation) for activation in ACTIVATIONS),
    # DeepSeek-V3-like expert: H7168, FFN 2048, 128 local experts.
    ExpertShape(experts=128, hidden=7168, ffn=2048, selections=32768, worst_rows=65536),
]


def training_shape(model: str, experts: int, hidden: int, ffn: int, tokens: int,
                   activation: str = "swiglu") -> ExpertShape:
    """An example model's experts at EP=1, top-8: every selection of ``tokens`` tokens is local; the worst-case buffer
    holds them all plus a block's padding per expert."""
    selections = 8 * tokens
    return ExpertShape(experts=experts, hidden=hidden, ffn=ffn, selections=selections,
                       worst_rows=selections + experts * 128, activation=activation, model=model)


#: The expert shapes of examples/pretrain_gpt_moe_deepepv2.sh's models (``--shapes training``); gpt-moe once more with
#: squared ReLU, the activation TE's op fuser takes on Hopper.
TRAINING_SHAPES = [
    training_shape("gpt-moe", experts=64, hidden=1024, ffn=256, tokens=4096),
    training_shape("gpt-moe-large", experts=64, hidden=2048, ffn=768, tokens=16384),
    training_shape("qwen3-moe-router", experts=128, hidden=1024, ffn=384, tokens=4096),
    training_shape("gpt-moe", experts=64, hidden=1024, ffn=256, tokens=4096, activation="squared_relu"),
]
SHAPE_SETS = {"dispatch": SHAPES, "training": TRAINING_SHAPES}


def aligned_counts(shape: ExpertShape, seed: int = 0) -> torch.Tensor:
    """Per-expert row counts, each padded to the alignment (int64, host)."""
    gen = torch.Generator().manual_seed(seed)
    skew = torch.rand(shape.experts, generator=gen) + 0.5  # uneven load, as routers produce
    picks = torch.multinomial(skew, shape.selections, replacement=True, generator=gen)
    counts = torch.bincount(picks, minlength=shape.experts)
    return (counts + shape.alignment - 1) // shape.alignment * shape.alignment


#: The expert modules :func:`build_experts` builds, by kind: Transformer Engine's need it installed.
KINDS = ("sequential", "sync_free", "te_grouped_mlp", "te_op_fuser")


def _expert_submodules(kind: str, experts: int):
    """The experts' submodules of Megatron's local spec, or of its TE spec with grouped GEMM for the TE kinds."""
    from megatron.core.models.gpt import gpt_layer_specs  # noqa: PLC0415

    if kind.startswith("te_"):
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=experts, moe_grouped_gemm=True)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False)
    mlp = spec.submodules.mlp
    module = (mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules).experts
    return module.keywords["submodules"] if hasattr(module, "keywords") else module.submodules


def build_experts(kind: str, shape: ExpertShape, seed: int = 1):
    """The expert module ``kind`` (one of :data:`KINDS`) of ``shape`` on the GPU, BF16, no bias.

    Raises:
        ValueError: A TE kind without Transformer Engine, or the op fuser with an activation it does not fuse.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP
    from megatron_deepepv2.testing.moe_model import init_expert_parallel

    if kind == "te_op_fuser" and shape.activation != "squared_relu":
        raise ValueError(f"TE's op fuser fuses squared ReLU only on Hopper, not {shape.activation}")
    if kind.startswith("te_") and importlib.util.find_spec("transformer_engine") is None:
        raise ValueError(f"{kind} needs Transformer Engine (transformer_engine is not installed)")
    init_expert_parallel(1)
    fuser = dict(use_transformer_engine_op_fuser=True, use_fused_weighted_squared_relu=True) \
        if kind == "te_op_fuser" else {}
    config = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, moe_ffn_hidden_size=shape.ffn,
        num_attention_heads=8, num_moe_experts=shape.experts, moe_router_topk=8, **_activations()[shape.activation],
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False, moe_grouped_gemm=kind.startswith("te_"), **fuser,
    )
    submodules = _expert_submodules(kind, shape.experts)
    cls = {"sequential": SequentialMLP, "sync_free": SyncFreeSequentialMLP}.get(kind, TEGroupedMLP)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)  # Megatron initialises expert weights on the GPU from its RNG tracker
    with torch.device("cuda"):
        return cls(shape.experts, config, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


def copy_expert_weights(weight1: torch.Tensor, weight2: torch.Tensor, te_experts: torch.nn.Module) -> None:
    """Gives a ``TEGroupedMLP`` the experts' weights stacked as ``SyncFreeSequentialMLP`` holds them (``weight1
    [E, fc1_out, H]``, ``weight2 [E, H, ffn]``); TE's grouped linear layers hold ``weight{i} [out, in]`` per expert."""
    with torch.no_grad():
        for linear, stacked in ((te_experts.linear_fc1, weight1), (te_experts.linear_fc2, weight2)):
            for expert in range(stacked.shape[0]):
                getattr(linear, f"weight{expert}").copy_(stacked[expert])


#: Host calls that wait for the GPU.
SYNCHRONISING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def kernel_summary(averages: Any, calls: int, host_s: float, top: int = 5) -> dict:
    """What a profiled run of ``calls`` forward + backward calls did, per call.

    Args:
        averages: ``torch.profiler.profile(...).key_averages()``: entries with ``key``, ``count``, ``device_type``
            and ``device_time_total`` (us; ``cuda_time_total`` on older PyTorch).
        calls: How many calls the profile holds.
        host_s: The host's wall time of issuing them, seconds.
        top: How many kernels to name.

    Returns:
        ``kernels`` and ``gpu_ms`` (kernel launches and their GPU time per call), ``host_ms`` per call,
        ``synchronising_calls`` and ``memcpy_calls`` (host calls) and ``gpu_copies`` (the GPU's memcpy and memset
        operations) per call, ``top_kernels`` (name, launches and ms per call, the largest GPU time first).
    """
    kernels: Counter = Counter()
    kernel_us: Counter = Counter()
    runtime: Counter = Counter()
    copies = 0
    for entry in averages:
        device_us = getattr(entry, "device_time_total", None)
        if device_us is None:
            device_us = getattr(entry, "cuda_time_total", 0.0)
        if entry.device_type != torch.autograd.DeviceType.CUDA:
            runtime[entry.key] += entry.count
        elif entry.key.startswith(("Memcpy", "Memset")):  # the GPU's copies and fills: not kernels
            copies += entry.count
        else:
            kernels[entry.key] += entry.count
            kernel_us[entry.key] += device_us
    ranked = sorted(kernel_us, key=lambda name: -kernel_us[name])[:top]
    return {"kernels": sum(kernels.values()) / calls, "gpu_ms": sum(kernel_us.values()) / calls / 1e3,
            "host_ms": host_s / calls * 1e3,
            "synchronising_calls": sum(runtime[name] for name in SYNCHRONISING_CALLS) / calls,
            "memcpy_calls": sum(n for name, n in runtime.items() if name.startswith("cudaMemcpy")) / calls,
            "gpu_copies": copies / calls,
            "top_kernels": [{"name": name[:120], "launches": kernels[name] / calls, "ms": kernel_us[name] / calls / 1e3}
                            for name in ranked]}


def profiled(fn: Callable[[], Any], calls: int = 3) -> dict:
    """:func:`kernel_summary` of ``calls`` calls of ``fn`` under ``torch.profiler`` (after one call outside it)."""
    fn()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        host_s = time.perf_counter() - started
        torch.cuda.synchronize()
    return kernel_summary(profile.key_averages(), calls, host_s)


def fwd_bwd(module, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor, grad: torch.Tensor):
    """One forward + backward from cleared gradients (no accumulation pass is timed); returns the output."""
    for tensor in (*module.parameters(), x, probs):
        tensor.grad = None
    out, _ = module(x, counts, probs)
    out.backward(grad)
    return out


def bench_shape(shape: ExpertShape, args) -> dict:
    """Times every variant of one shape; returns its results row."""
    counts = aligned_counts(shape)
    rows = int(counts.sum())
    logger.info("== %s: %d aligned rows (%d selections), worst case %d rows", shape.label, rows, shape.selections,
                shape.worst_rows)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(shape.worst_rows, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(shape.worst_rows, device="cuda", generator=gen)
    grad = torch.randn(shape.worst_rows, shape.hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    x_exact = x[:rows].detach().clone().requires_grad_(True)
    probs_exact = probs[:rows].detach().clone().requires_grad_(True)
    grad_exact = grad[:rows].contiguous()
    x_worst = x.detach().clone().requires_grad_(True)
    probs_worst = probs.detach().clone().requires_grad_(True)
    times: dict[str, float] = {}
    traces: dict[str, dict] = {}

    def timed(name: str, fn) -> None:
        times[name] = _bench.median_us(fn, args.iters, args.warmup, cuda=True) / 1000.0
        logger.info("   %-22s %8.3f ms", name, times[name])
        if args.trace:
            traces[name] = profiled(fn)
            logger.info("   %-22s traced: %.0f kernels, GPU %.3f ms, host %.3f ms, %.0f synchronising calls a call",
                        "", traces[name]["kernels"], traces[name]["gpu_ms"], traces[name]["host_ms"],
                        traces[name]["synchronising_calls"])

    sync_free = build_experts("sync_free", shape)
    timed("sync_free_exact", lambda: fwd_bwd(sync_free, x_exact, counts, probs_exact, grad_exact))
    out_exact = fwd_bwd(sync_free, x_exact, counts, probs_exact, grad_exact).detach()
    device_counts = counts.cuda()
    timed("sync_free_worst_case", lambda: fwd_bwd(sync_free, x_worst, device_counts, probs_worst, grad))
    out_worst = fwd_bwd(sync_free, x_worst, device_counts, probs_worst, grad).detach()
    tail_zero = bool((out_worst[rows:] == 0).all())
    worst_equal = bool(torch.equal(out_worst[:rows], out_exact))

    w1 = sync_free.weight1.detach().clone().requires_grad_(True)
    w2 = sync_free.weight2.detach().clone().requires_grad_(True)
    offsets = torch.cumsum(counts, 0).to(torch.int32).cuda()
    fc1_in = x_exact.detach().requires_grad_(True)
    # Bare pair: FC1 [rows, H] -> [rows, 2F] (gated) or [rows, F]; FC2 takes [rows, F].
    fc2_in = torch.randn(rows, shape.ffn, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(True)

    def gemm_pair():
        for tensor in (w1, w2, fc1_in, fc2_in):
            tensor.grad = None
        fc1 = torch._grouped_mm(fc1_in, w1.transpose(1, 2), offs=offsets)
        fc2 = torch._grouped_mm(fc2_in, w2.transpose(1, 2), offs=offsets)
        torch.autograd.backward([fc1, fc2], [torch.ones_like(fc1), grad_exact])

    timed("grouped_gemm_pair", gemm_pair)
    fc1_width = w1.shape[1]
    not_run: dict[str, str] = {}
    te_max_diff = {kind: _time_te_experts(kind, shape, sync_free, (x_exact, counts, probs_exact, grad_exact),
                                          out_exact, timed, not_run)
                   for kind in ("te_grouped_mlp", "te_op_fuser")}
    del sync_free, w1, w2
    torch.cuda.empty_cache()

    if not args.skip_sequential:
        sequential = build_experts("sequential", shape)
        timed("sequential_mlp", lambda: fwd_bwd(sequential, x_exact, counts, probs_exact, grad_exact))
        out_ref = fwd_bwd(sequential, x_exact, counts, probs_exact, grad_exact).detach()
        max_diff = float((out_ref.float() - out_exact.float()).abs().max())
        ref_scale = float(out_ref.float().abs().max())
        del sequential
        torch.cuda.empty_cache()
    else:
        max_diff = ref_scale = float("nan")

    flops = 3 * 2 * rows * shape.hidden * (fc1_width + shape.ffn)  # FC1 + FC2, forward and backward
    row = {
        "shape": asdict(shape),
        "config": shape.label,
        "aligned_rows": rows,
        "times_ms": times,
        "gemm_tflops": flops / (times["grouped_gemm_pair"] * 1e-3) / 1e12,
        "exact_over_gemm_pair": times["sync_free_exact"] / times["grouped_gemm_pair"],
        "worst_case_over_exact": times["sync_free_worst_case"] / times["sync_free_exact"],
        "sequential_over_exact": times.get("sequential_mlp", float("nan")) / times["sync_free_exact"],
        "max_abs_diff_vs_sequential": max_diff,
        "max_abs_sequential_output": ref_scale,
        "worst_case_tail_zero": tail_zero,
        "worst_case_equals_exact": worst_equal,
        "te_over_exact": {kind: times[kind] / times["sync_free_exact"] for kind in te_max_diff if kind in times},
        "max_abs_diff_vs_sync_free": {kind: diff for kind, diff in te_max_diff.items() if diff is not None},
        "not_run": not_run,
    }
    if traces:
        row["trace"] = traces
    logger.info("   exact / GEMM pair %.3fx (target <= 1.15), worst case / exact %.3fx (target <= 1.05); tail zero %s, "
                "worst == exact %s", row["exact_over_gemm_pair"], row["worst_case_over_exact"], tail_zero, worst_equal)
    if "sequential_mlp" in times:
        logger.info("   SequentialMLP / exact %.2fx, max |diff| vs SequentialMLP %.3g (outputs up to %.3g)",
                    row["sequential_over_exact"], max_diff, ref_scale)
    return row


def _time_te_experts(kind: str, shape: ExpertShape, sync_free: torch.nn.Module, inputs: tuple, out_exact: torch.Tensor,
                     timed: Callable[[str, Callable[[], Any]], None], not_run: dict[str, str]) -> Optional[float]:
    """Times the TE expert module ``kind`` on ``inputs`` (``x, counts, probs, grad``, host counts) with
    ``sync_free``'s weights; returns its output's largest difference from ``out_exact``, None when it did not run."""
    def build() -> torch.nn.Module:
        try:
            return build_experts(kind, shape)
        except AssertionError as error:  # Megatron asserts that its fused op-fuser path supports the configuration
            raise ValueError(f"Megatron refused {kind} here: {error}") from error

    te_experts = _bench.build_or_reason(kind, build, not_run)
    if te_experts is None:
        return None
    copy_expert_weights(sync_free.weight1, sync_free.weight2, te_experts)
    timed(kind, lambda: fwd_bwd(te_experts, *inputs))
    out = fwd_bwd(te_experts, *inputs).detach()
    diff = float((out.float() - out_exact.float()).abs().max())
    logger.info("   %s / exact: max |diff| %.3g", kind, diff)
    return diff


def plot(document: dict, path: str) -> None:
    """Bars of each variant's time per shape, with their values."""
    rows = document["rows"]
    keys = [key for key in ("sequential_mlp", "sync_free_exact", "sync_free_worst_case", "grouped_gemm_pair",
                            "te_grouped_mlp", "te_op_fuser") if any(key in row["times_ms"] for row in rows)]
    fig, ax = _bench.new_figure(9, 4.5)
    _bench.grouped_bars(ax, [row["config"] for row in rows],
                        {key: [row["times_ms"].get(key, 0.0) for row in rows] for key in keys}, value_format="%.2f")
    ax.set_ylabel("ms, forward + backward (median)")
    ax.set_title(f"Expert compute on one {document['device']} (BF16; lower is better)")
    _bench.save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="folder for bench_experts.json / .png")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="first shape only, fewer iterations")
    parser.add_argument("--skip-sequential", action="store_true", help="do not time SequentialMLP (slow)")
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="dispatch", help="the set of shapes")
    parser.add_argument("--name", default="bench_experts", help="output file name without extension")
    parser.add_argument("--trace", action="store_true", help="add each variant's profiled kernel summary")
    args = parser.parse_args(argv)
    _bench.setup_logging()
    _bench.require_cuda(parser)
    if args.quick:
        args.iters, args.warmup = 5, 2
    with _bench.process_group("nccl"):
        document = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "versions": _bench.software_versions(), "provenance": _bench.provenance(), "shapes": args.shapes,
                    "rows": []}
        shapes = SHAPE_SETS[args.shapes][:1] if args.quick else SHAPE_SETS[args.shapes]
        for number, shape in enumerate(shapes, 1):
            document["rows"].append(bench_shape(shape, args))
            _bench.write_outputs(args.out, args.name, document, plot if number == len(shapes) else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
