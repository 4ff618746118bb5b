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
  ``[E, out, in]``, autograd backward: the GEMM work alone, the target's denominator.

Activations: Megatron's SwiGLU, its default non-gated GELU, and the clamped quick-GeGLU of GPT-OSS-style models
(``quick_gelu`` gated, ``activation_func_clamp_value`` 7, ``glu_linear_offset`` 1).

Prints progress, checks the outputs against ``SequentialMLP``, writes ``bench_experts.json`` and
``bench_experts.png`` to ``--out``::

    python tools/bench_experts.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass
from typing import Optional

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
    """

    experts: int
    hidden: int
    ffn: int
    selections: int
    worst_rows: int
    alignment: int = 128
    activation: str = "swiglu"

    @property
    def label(self) -> str:
        return f"E{self.experts} H{self.hidden} F{self.ffn} {self.activation}"


def _activations() -> dict[str, dict]:
    from megatron.core.activations import quick_gelu  # noqa: PLC0415

    return {
        "swiglu": dict(gated_linear_unit=True, activation_func=F.silu),
        "gelu": dict(gated_linear_unit=False, activation_func=F.gelu),
        "clamped_quick_geglu": dict(gated_linear_unit=True, activation_func=quick_gelu,
                                    activation_func_clamp_value=7.0, glu_linear_offset=1.0),
    }


#: Activation names: TransformerConfig fields (resolved when Megatron is importable).
ACTIVATIONS = ("swiglu", "gelu", "clamped_quick_geglu")

# T4096 H4096 64 experts top-8 at EP2: 32 local experts, 32,768 selections, 65,536 worst-case rows.
_EP2_SHAPE = dict(experts=32, hidden=4096, ffn=1024, selections=32768, worst_rows=65536)
SHAPES = [
    *(ExpertShape(**_EP2_SHAPE, activation=activation) for activation in ACTIVATIONS),
    # DeepSeek-V3-like expert: H7168, FFN 2048, 128 local experts.
    ExpertShape(experts=128, hidden=7168, ffn=2048, selections=32768, worst_rows=65536),
]


def aligned_counts(shape: ExpertShape, seed: int = 0) -> torch.Tensor:
    """Per-expert row counts, each padded to the alignment (int64, host)."""
    gen = torch.Generator().manual_seed(seed)
    skew = torch.rand(shape.experts, generator=gen) + 0.5  # uneven load, as routers produce
    picks = torch.multinomial(skew, shape.selections, replacement=True, generator=gen)
    counts = torch.bincount(picks, minlength=shape.experts)
    return (counts + shape.alignment - 1) // shape.alignment * shape.alignment


def build_experts(kind: str, shape: ExpertShape, seed: int = 1):
    """``SequentialMLP`` or ``SyncFreeSequentialMLP`` of ``shape`` on the GPU, BF16, no bias."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_deepepv2.mcore.experts import SyncFreeSequentialMLP
    from megatron_deepepv2.testing.moe_model import init_expert_parallel

    init_expert_parallel(1)
    config = TransformerConfig(
        num_layers=1, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn, moe_ffn_hidden_size=shape.ffn,
        num_attention_heads=8, num_moe_experts=shape.experts, moe_router_topk=8, **_activations()[shape.activation],
        add_bias_linear=False, bf16=True, params_dtype=torch.bfloat16,
        gradient_accumulation_fusion=False, moe_grouped_gemm=False,
    )
    mlp = get_gpt_layer_local_spec(num_experts=shape.experts, moe_grouped_gemm=False).submodules.mlp
    experts = (mlp.keywords["submodules"] if hasattr(mlp, "keywords") else mlp.submodules).experts
    submodules = experts.keywords["submodules"] if hasattr(experts, "keywords") else experts.submodules
    cls = SequentialMLP if kind == "sequential" else SyncFreeSequentialMLP
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)  # Megatron initialises expert weights on the GPU from its RNG tracker
    with torch.device("cuda"):
        return cls(shape.experts, config, submodules, pg_collection=ProcessGroupCollection.use_mpu_process_groups())


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

    def timed(name: str, fn) -> None:
        times[name] = _bench.median_us(fn, args.iters, args.warmup, cuda=True) / 1000.0
        logger.info("   %-22s %8.3f ms", name, times[name])

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
    }
    logger.info("   exact / GEMM pair %.3fx (target <= 1.15), worst case / exact %.3fx (target <= 1.05); tail zero %s, "
                "worst == exact %s", row["exact_over_gemm_pair"], row["worst_case_over_exact"], tail_zero, worst_equal)
    if "sequential_mlp" in times:
        logger.info("   SequentialMLP / exact %.2fx, max |diff| vs SequentialMLP %.3g (outputs up to %.3g)",
                    row["sequential_over_exact"], max_diff, ref_scale)
    return row


def plot(document: dict, path: str) -> None:
    """Bars of each variant's time per shape, with their values."""
    rows = document["rows"]
    keys = ["sequential_mlp", "sync_free_exact", "sync_free_worst_case", "grouped_gemm_pair"]
    fig, ax = _bench.new_figure(9, 4.5)
    _bench.grouped_bars(ax, [row["config"] for row in rows],
                        {key: [row["times_ms"].get(key, 0.0) for row in rows] for key in keys}, value_format="%.2f")
    ax.set_ylabel("ms, forward + backward (median)")
    ax.set_title("Expert compute on one H200 (BF16; lower is better)")
    _bench.save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out", help="folder for bench_experts.json / .png")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="first shape only, fewer iterations")
    parser.add_argument("--skip-sequential", action="store_true", help="do not time SequentialMLP (slow)")
    args = parser.parse_args(argv)
    _bench.setup_logging()
    _bench.require_cuda(parser)
    if args.quick:
        args.iters, args.warmup = 5, 2
    with _bench.process_group("nccl"):
        document = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
        shapes = SHAPES[:1] if args.quick else SHAPES
        for number, shape in enumerate(shapes, 1):
            document["rows"].append(bench_shape(shape, args))
            _bench.write_outputs(args.out, "bench_experts", document, plot if number == len(shapes) else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
