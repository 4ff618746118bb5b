#!/usr/bin/env python3
"""Cost of the default input checks of a dispatch, on one GPU.

Times, per routing shape (tokens per rank, experts, top-k), the checks a dispatch runs at default settings: the
static checks (:func:`megatron_deepepv2.validation.dispatch_inputs_problem`, host only; a layer runs them at its first
call and whenever its inputs' types, dtypes, devices or trailing shapes change, so counting them per dispatch, as the
totals here do, is an upper bound) and the device-side expert-id check
(:func:`megatron_deepepv2.expert_ids.assert_expert_ids_on_device`: one Triton kernel and a device-side assert), and,
for comparison, the host-synchronising check of the ``validate`` setting. Device time is the median over
CUDA-event-timed batches of calls; host time is the wall time per call with the GPU kept busy, so that it measures
launching, not waiting. Each cost is stated against a reference dispatch + combine time (``--reference-us``, default:
forward dispatch + combine of our ops on 2x H200 at T4096 H4096 E64 top-8 BF16 expand, docs/benchmarks.md) and the
same ops forward + backward (``--fwd-bwd-us``); the check runs once per dispatch forward. The launch times compare
with ``launch_costs_us``, the host cost of a bare eager launch, a Triton launch, an event record and a stream wait on
the same machine, timed first. Prints progress, writes ``bench_checks.json`` and ``bench_checks.png`` to ``--out``::

    python tools/bench_checks.py --out bench_out
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

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


def _keep_gpu_busy(matmuls: int) -> None:
    """Queues ``matmuls`` 8192^3 BF16 matrix products (about 1.4 ms each on an H200) on the current stream."""
    import torch

    busy = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(matmuls):
        busy @ busy


def _device_us(fn: _bench.Step, repeats: int, calls: int) -> float:
    """GPU time per call: the calls are queued behind matmuls, so they run back to back, not at launch speed."""
    times = []
    for _ in range(repeats):
        _keep_gpu_busy(6)  # ~8 ms of GPU work, longer than launching the calls
        times.append(_bench.event_us(fn, calls))
    return statistics.median(times)


def _host_us(fn: _bench.Step, calls: int) -> float:
    """Host time per call to launch ``calls`` calls while the GPU is busy, so that launches never wait."""
    _bench.cuda_synchronize()
    _keep_gpu_busy(3)
    elapsed = _bench.host_us(fn, calls)  # no synchronisation before the clock: it would wait the matmuls out
    _bench.cuda_synchronize()
    return elapsed


def measure(args: argparse.Namespace) -> dict:
    """Runs every shape; returns the JSON document."""
    import torch

    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2 import expert_ids
    from megatron_deepepv2.expert_ids import assert_expert_ids_on_device, expert_ids_problem
    from megatron_deepepv2.validation import dispatch_inputs_problem

    rows = []
    hidden = 4096
    for number, (num_tokens, num_experts, top_k) in enumerate(SHAPES, 1):
        idx = _routing(num_tokens, num_experts, top_k)
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
        weights = torch.rand(num_tokens, top_k, device="cuda")

        def static_checks():
            return dispatch_inputs_problem(x, idx, weights, limits=DeepEPBackend.limits, num_experts=num_experts)

        def device_check():
            assert_expert_ids_on_device(idx, num_experts)

        def host_check():
            expert_ids_problem(idx, num_experts)

        def kernel_only():
            expert_ids.clear_flag_on_bad_ids(idx, num_experts, ok)

        def assert_only():
            torch._assert_async(ok, "bench")

        problem = static_checks()
        if problem is not None:  # the checks would stop at it instead of running to the end
            raise RuntimeError(f"The benchmark's own inputs fail the static checks: {problem}")
        device_check()  # creates the per-device flag the parts below use
        ok = expert_ids._ok_flags[idx.device]
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
            # The host check synchronises by itself: its host time is its wall time.
            "validate_check_wall_us": _bench.host_us(host_check, max(args.calls // 10, 1), _bench.cuda_synchronize),
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


def plot(document: dict, path: str) -> None:
    """Bars of the default checks' cost per shape against the reference dispatch + combine."""
    rows = document["rows"]
    labels = [f"T{r['tokens']}\nE{r['experts']} k{r['top_k']}" for r in rows]
    fig, ax = _bench.new_figure(8, 4)
    ax.bar(labels, [r["default_checks_pct_of_reference"] for r in rows], color="tab:blue")
    ax.axhline(2.0, color="tab:red", linestyle="--", label="target 2%")
    ax.set_ylabel(f"% of a {document['reference_us']:.0f} us dispatch + combine")
    ax.set_title(f"Default input checks of a dispatch ({document['device']})")
    ax.legend()
    _bench.save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reference-us", type=float, default=DEFAULT_REFERENCE_US,
                        help="forward dispatch + combine to compare with (us)")
    parser.add_argument("--fwd-bwd-us", type=float, default=DEFAULT_FWD_BWD_US,
                        help="dispatch + combine forward and backward to compare with (us)")
    args = parser.parse_args(argv)
    _bench.setup_logging()
    _bench.require_cuda(parser)
    document: dict[str, Any] = {"launch_costs_us": _bench.launch_costs_us()}
    logger.info("host cost per call: %s", ", ".join(f"{name} {value:.2f} us"
                                                     for name, value in document["launch_costs_us"].items()))
    document.update(measure(args))
    _bench.write_outputs(args.out, "bench_checks", document, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
