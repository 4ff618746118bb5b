#!/usr/bin/env python3
"""Cost of the default input checks of a dispatch, on one GPU.

Times, per routing shape (tokens per rank, experts, top-k), the checks a dispatch runs at default settings: the
static checks (:func:`megatron_deepepv2.validation.check_dispatch_inputs`, host only) and the device-side
expert-id check (:func:`megatron_deepepv2.validation.assert_expert_ids_on_device`: one Triton kernel and a
device-side assert), and, for comparison, the host-synchronising check of the ``validate`` setting. Device time is
the median over CUDA-event-timed batches of calls; host time is the wall time per call with the GPU kept busy, so
that it measures launching, not waiting. Each cost is stated against a reference dispatch + combine time
(``--reference-us``, default: forward dispatch + combine of our ops on 2x H200 at T4096 H4096 E64 top-8 BF16
expand, docs/benchmarks.md) and the same ops forward + backward (``--fwd-bwd-us``); the check runs once per
dispatch forward. Prints progress, writes ``bench_checks.json`` and ``bench_checks.png`` to ``--out``::

    python tools/bench_checks.py --out bench_out
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

logger = logging.getLogger("bench_checks")

#: (tokens per rank, experts, top-k): DeepSeek-V3, Qwen3-30B-A3B and Mixtral-like routing at two batch sizes.
SHAPES = [(4096, 256, 8), (8192, 256, 8), (4096, 128, 8), (8192, 128, 8), (4096, 8, 2), (8192, 8, 2)]
#: Forward dispatch + combine of our ops on 2x H200, T4096 H4096 E64 top-8 BF16 expand (266 + 541 us raw).
DEFAULT_REFERENCE_US = 807.0
#: The same ops forward + backward (dispatch, combine, their backward passes) on 2x H200.
DEFAULT_FWD_BWD_US = 1780.0


def _routing(num_tokens: int, num_experts: int, top_k: int):
    import torch

    scores = torch.rand(num_tokens, num_experts, device="cuda")
    return scores.topk(top_k, dim=1).indices.contiguous()


def _device_us(fn, repeats: int, calls: int) -> float:
    """GPU time per call: the calls are queued behind matmuls, so they run back to back, not at launch speed."""
    import torch

    busy = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(repeats):
        for _ in range(6):  # ~8 ms of GPU work, longer than launching the calls
            busy @ busy
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def _host_us(fn, calls: int) -> float:
    import torch

    busy = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(3):
        busy @ busy  # keeps the GPU busy so that launches never wait
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - started
    torch.cuda.synchronize()
    return elapsed * 1e6 / calls


def measure(args) -> dict:
    """Runs every shape; returns the JSON document."""
    import torch

    from megatron_deepepv2.backends import DeepEPBackend, ExpertLayout
    from megatron_deepepv2 import validation
    from megatron_deepepv2.validation import assert_expert_ids_on_device, check_dispatch_inputs, check_expert_ids

    rows = []
    hidden = 4096
    for number, (num_tokens, num_experts, top_k) in enumerate(SHAPES, 1):
        idx = _routing(num_tokens, num_experts, top_k)
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights = torch.rand(num_tokens, top_k, device="cuda")

        def static_checks():
            check_dispatch_inputs(x, idx, weights, num_experts=num_experts, group_size=2,
                                  limits=DeepEPBackend.limits, layout=ExpertLayout.EXPAND, expert_alignment=128,
                                  zero_padding=False)

        def device_check():
            assert_expert_ids_on_device(idx, num_experts)

        def host_check():
            check_expert_ids(idx, num_experts)

        def kernel_only():
            validation.clear_flag_on_bad_ids(idx, num_experts, ok)

        def assert_only():
            torch._assert_async(ok, "bench")

        device_check()  # creates the per-device flag the parts below use
        ok = validation._ok_flags[idx.device]
        for fn in (static_checks, device_check, host_check, kernel_only, assert_only):
            fn()
        torch.cuda.synchronize()
        row = {
            "tokens": num_tokens, "experts": num_experts, "top_k": top_k,
            "device_check_device_us": _device_us(device_check, args.repeats, args.calls),
            "device_check_host_us": _host_us(device_check, args.calls),
            "kernel_launch_host_us": _host_us(kernel_only, args.calls),
            "assert_launch_host_us": _host_us(assert_only, args.calls),
            "static_checks_host_us": _host_us(static_checks, args.calls),
            "validate_check_wall_us": _host_us_synced(host_check, args.calls // 10),
        }
        # On the critical path: the host time to launch (the GPU runs the kernels while the host goes on) unless the
        # GPU time is larger.
        default_us = max(row["device_check_device_us"], row["device_check_host_us"]) + row["static_checks_host_us"]
        row["default_checks_us"] = default_us
        row["default_checks_pct_of_reference"] = 100 * default_us / args.reference_us
        row["default_checks_pct_of_fwd_bwd"] = 100 * default_us / args.fwd_bwd_us
        rows.append(row)
        logger.info("[%d/%d] T%d E%d top-%d: device check %.1f us on the GPU, %.1f us to launch (kernel %.1f, assert "
                    "%.1f); static checks %.1f us; default total %.1f us = %.2f%% of a %.0f us dispatch + combine, "
                    "%.2f%% of %.0f us fwd+bwd; validate check %.0f us",
                    number, len(SHAPES), num_tokens, num_experts, top_k, row["device_check_device_us"],
                    row["device_check_host_us"], row["kernel_launch_host_us"], row["assert_launch_host_us"],
                    row["static_checks_host_us"], default_us, row["default_checks_pct_of_reference"],
                    args.reference_us, row["default_checks_pct_of_fwd_bwd"], args.fwd_bwd_us,
                    row["validate_check_wall_us"])
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hidden": hidden,
            "reference_us": args.reference_us, "fwd_bwd_us": args.fwd_bwd_us, "rows": rows}


def _host_us_synced(fn, calls: int) -> float:
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(max(calls, 1)):
        fn()
    return (time.perf_counter() - started) * 1e6 / max(calls, 1)


def plot(document: dict, path: str) -> None:
    """Bars of the default checks' cost per shape against the reference dispatch + combine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = document["rows"]
    labels = [f"T{r['tokens']}\nE{r['experts']} k{r['top_k']}" for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(labels, [r["default_checks_pct_of_reference"] for r in rows], color="tab:blue")
    ax.axhline(2.0, color="tab:red", linestyle="--", label="target 2%")
    ax.set_ylabel(f"% of a {document['reference_us']:.0f} us dispatch + combine")
    ax.set_title(f"Default input checks of a dispatch ({document['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reference-us", type=float, default=DEFAULT_REFERENCE_US,
                        help="forward dispatch + combine to compare with (us)")
    parser.add_argument("--fwd-bwd-us", type=float, default=DEFAULT_FWD_BWD_US,
                        help="dispatch + combine forward and backward to compare with (us)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    import torch

    if not torch.cuda.is_available():
        logger.error("needs a CUDA GPU")
        return 1
    os.makedirs(args.out, exist_ok=True)
    document = measure(args)
    with open(os.path.join(args.out, "bench_checks.json"), "w") as out:
        json.dump(document, out, indent=2)
    plot(document, os.path.join(args.out, "bench_checks.png"))
    logger.info("wrote %s/bench_checks.json and .png", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
