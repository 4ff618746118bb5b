#!/usr/bin/env python3
"""What FP8 dispatch costs and saves, on popular models' MoE shapes (one process; one GPU, EP=1).

Per model shape, token count and layout (compact, expand with alignment 16) it measures, on the same BF16 hidden
states (median, CUDA events on a GPU):

* ``quantize_us``: :func:`megatron_deepepv2.fp8.quantize_e4m3_1x128` of the ``[T, H]`` rows on the sending side
  (the fused kernel on a GPU), and ``quantize_torch_us``, the same bits in PyTorch ops;
* ``dequantize_us``: :func:`~megatron_deepepv2.fp8.dequantize_e4m3_1x128` of the rows an FP8 dispatch of that
  layout received (``recv_rows``: ``T`` in compact at EP=1, one row per (token, expert) plus padding in expand), and
  ``dequantize_torch_us``;
* ``dispatch_combine_us``: a BF16 forward dispatch + combine through :func:`megatron_deepepv2.dispatch` /
  :func:`~megatron_deepepv2.combine` (host sync) on a 1-rank group -- DeepEP's ElasticBuffer on a GPU with DeepEP,
  else the reference backend -- and ``overhead``, the quantise + dequantise time over it;
* ``bf16_bytes`` / ``fp8_bytes``: the bytes of the rows each dispatch sends (values, plus the fp32 scales for FP8);
  ``quantize_GBs`` / ``dequantize_GBs``: the bytes each kernel reads and writes per second.

At EP=1 a dispatch moves no bytes between GPUs: its time is its own HBM traffic and launch costs, which FP8 cannot
shrink, so ``overhead`` here is an upper bound of what FP8 costs where the dispatch crosses NVLink.

Prints progress and writes ``bench_fp8.json`` and, where matplotlib is, ``bench_fp8.png`` to ``--out``::

    EP_DISABLE_GIN=1 python tools/bench_fp8.py --out bench_out        # one GPU
    python tools/bench_fp8.py --cpu --models qwen3-30b-a3b --tokens 16 --iters 2 --out bench_out   # smoke run
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402
from tools.compare_dispatchers import MODELS  # noqa: E402

logger = logging.getLogger("bench_fp8")


LAYOUTS = {"compact": dict(layout="compact"),
           "expand": dict(layout="expand", expert_alignment=16)}


def measure(model_name: str, tokens: int, args: argparse.Namespace, cuda: bool) -> list[dict]:
    """One row per layout: quantise, dequantise and BF16 dispatch + combine times, and the bytes of both dispatches."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2 import fp8  # noqa: PLC0415

    model = MODELS[model_name]
    device = "cuda" if cuda else "cpu"
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, model.hidden, generator=gen).to(device=device, dtype=torch.bfloat16)
    idx = torch.rand(tokens, model.experts, generator=gen).argsort(dim=1)[:, :model.topk].to(device)
    weights = torch.rand(tokens, model.topk, generator=gen).to(device)
    pair = fp8.quantize_e4m3_1x128(x)
    capacity = max(args.tokens)

    def time_call(fn: _bench.Step) -> float:
        return _bench.median_us(fn, args.iters, args.warmup, cuda=cuda)

    quantize_us = time_call(lambda: fp8.quantize_e4m3_1x128(x))
    quantize_torch_us = time_call(lambda: fp8.quantize_e4m3_1x128_torch(x))
    bf16_bytes = x.numel() * x.element_size()
    fp8_bytes = pair[0].numel() * pair[0].element_size() + pair[1].numel() * pair[1].element_size()
    rows = []
    for layout, kwargs in LAYOUTS.items():
        received = dv2.dispatch(pair, idx, weights, model.experts, num_max_tokens_per_rank=capacity, **kwargs).recv_x

        def dispatch_and_combine() -> torch.Tensor:
            out = dv2.dispatch(x, idx, weights, model.experts, num_max_tokens_per_rank=capacity, **kwargs)
            return dv2.combine(out.recv_x, out.handle)

        recv_rows = received[0].shape[0]
        row = {"model": model_name, "hidden": model.hidden, "tokens": tokens, "layout": layout,
               "recv_rows": recv_rows, "quantize_us": quantize_us, "quantize_torch_us": quantize_torch_us,
               "dequantize_us": time_call(lambda: fp8.dequantize_e4m3_1x128(*received)),
               "dequantize_torch_us": time_call(lambda: fp8.dequantize_e4m3_1x128_torch(*received)),
               "dispatch_combine_us": time_call(dispatch_and_combine),
               "bf16_bytes": bf16_bytes, "fp8_bytes": fp8_bytes, "backend": dv2.get_settings().backend}
        row["overhead"] = (row["quantize_us"] + row["dequantize_us"]) / row["dispatch_combine_us"]
        # Bytes moved through memory: BF16 in, FP8 + scales out (quantise); the reverse on the received rows.
        row["quantize_GBs"] = (bf16_bytes + fp8_bytes) / row["quantize_us"] / 1e3
        row["dequantize_GBs"] = recv_rows * (fp8_bytes + bf16_bytes) / tokens / row["dequantize_us"] / 1e3
        logger.info("%-14s T%-6d %-7s quantise %7.1f us (PyTorch ops %7.1f), dequantise %6d rows %7.1f us (%7.1f), "
                    "BF16 dispatch + combine %8.1f us: %.1f%%; bytes %d -> %d (%.2fx)", model_name, tokens, layout,
                    row["quantize_us"], row["quantize_torch_us"], recv_rows, row["dequantize_us"],
                    row["dequantize_torch_us"], row["dispatch_combine_us"], 100 * row["overhead"], bf16_bytes,
                    fp8_bytes, fp8_bytes / bf16_bytes)
        rows.append(row)
    dv2.destroy_buffers()
    return rows


def plot(document: dict, path: str) -> None:
    """Bars of the quantise + dequantise time per row, as a share of the BF16 dispatch + combine."""
    rows = document["rows"]
    labels = [f"{r['model']}\nT{r['tokens']} {r['layout']}" for r in rows]
    fig, ax = _bench.new_figure(max(6, 1.6 * len(rows)), 4.5)
    ax.bar(labels, [100 * r["overhead"] for r in rows], color="tab:purple")
    ax.axhline(10, color="gray", linestyle="--", linewidth=1, label="10% target")
    ax.set_ylabel("quantise + dequantise, % of BF16 dispatch + combine")
    ax.set_title(f"FP8 dispatch overhead ({document.get('device', '')})", fontsize=10)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=8)
    _bench.save_figure(fig, path)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=[m for m, s in MODELS.items() if s.hidden % 128 == 0],
                        default=["deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="time on the CPU, reference backend (smoke run)")
    parser.add_argument("--out", default="bench_out")
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    _bench.setup_logging()
    cuda = not args.cpu and torch.cuda.is_available()
    with _bench.process_group("nccl" if cuda else "gloo"):
        import megatron_deepepv2 as dv2  # noqa: PLC0415

        if not cuda:
            dv2.configure(backend="reference")
        try:
            rows = []
            for model_name in args.models:
                for tokens in args.tokens:
                    rows.extend(measure(model_name, tokens, args, cuda))
            document = {"device": torch.cuda.get_device_name() if cuda else "cpu", "ep": 1, "rows": rows}
            _bench.write_outputs(args.out, "bench_fp8", document, plot)
        finally:
            dv2.destroy_buffers()
    return 0


if __name__ == "__main__":
    sys.exit(main())
