#!/usr/bin/env python3
"""Host time the deepepv2 layer adds per dispatch + combine (forward + backward), over a zero-cost backend.

The backend moves nothing (its dispatch hands the tokens back as received rows), so what is timed is the
package's own host work per step: settings, backend and buffer resolution, input checks, the autograd ops and
handle bookkeeping. Runs on the CPU in one process (a 1-rank gloo group), on tiny tensors, and reports the
median microseconds per step of:

* ``ops_resolved_per_call``: ``dispatch(..., layout=..., expert_alignment=...)`` -- settings resolved every call;
* ``ops_config``: ``dispatch(..., config=DispatchConfig.resolve(...))`` -- resolved once, as the Megatron manager
  does (skipped on trees that predate ``DispatchConfig``).

Prints progress, writes ``bench_host_overhead.json`` and ``bench_host_overhead.png`` to ``--out``. ``--tree``
measures another checkout of the package (e.g. an older commit in a git worktree) with the same harness::

    python tools/bench_host_overhead.py --out bench_out [--tree /path/to/older/checkout --label before]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from typing import Callable, Optional

logger = logging.getLogger("bench_host_overhead")


def _zero_cost_backend(base, handle_cls, outputs):
    """A backend that returns its inputs as the received rows: no communication, no copies."""
    DispatchBackend, BackendLimits, CompletedEvent = base
    DispatchOutput, CombineOutput = outputs
    import torch

    count_tensors: dict = {}

    class ZeroCostBackend(DispatchBackend):
        name = "zero-cost"
        limits = BackendLimits(dispatch_dtypes=(torch.float32,), combine_dtypes=(torch.float32,))

        def dispatch(self, x, topk_idx, topk_weights, *, num_experts, layout, expert_alignment=1,
                     zero_padding=False, async_finish=False, allocate_on_comm_stream=False, previous_event=None,
                     host_sync=True):
            local = num_experts // self.group_size
            counts = [x.shape[0]] + [0] * (local - 1)
            fields = dict(backend=self, layout=layout, num_experts=num_experts, num_local_experts=local,
                          expert_alignment=expert_alignment, zero_padding=zero_padding, num_tokens=x.shape[0],
                          num_topk=topk_idx.shape[1], num_recv_rows=x.shape[0], tokens_per_expert_list=counts,
                          host_sync=host_sync, native=None)
            key = (x.shape[0], local)
            if key not in count_tensors:  # made once: the backend itself costs nothing per call
                count_tensors[key] = (torch.tensor(counts), torch.tensor(x.shape[0]))
            if "device_counts" in handle_cls.__dataclass_fields__:
                fields["device_counts"] = lambda: count_tensors[key]
            else:  # trees before lazily derived counts
                fields["tokens_per_expert"], fields["num_valid_rows"] = count_tensors[key]
            handle = handle_cls(**fields)
            return DispatchOutput(x.view_as(x), topk_idx.clamp(max=local - 1), topk_weights, handle, CompletedEvent())

        def cached_dispatch(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                            previous_event=None):
            return DispatchOutput(x.view_as(x), None, topk_weights, handle, CompletedEvent())

        def combine(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                    previous_event=None):
            return CombineOutput(x.view_as(x), topk_weights, CompletedEvent())

    return ZeroCostBackend


def time_steps(step: Callable[[], None], iters: int, warmup: int) -> float:
    """Median microseconds of ``step`` over ``iters`` rounds of 10 calls (after ``warmup`` calls)."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        for _ in range(10):
            step()
        samples.append((time.perf_counter() - start) / 10 * 1e6)
    return statistics.median(samples)


def measure(args) -> dict:
    import torch
    import torch.distributed as dist

    import megatron_deepepv2 as dv2
    from megatron_deepepv2 import backends
    from megatron_deepepv2.backends import base

    backend_cls = _zero_cost_backend((base.DispatchBackend, base.BackendLimits, base.CompletedEvent),
                                     base.DispatchHandle, (base.DispatchOutput, base.CombineOutput))
    backends.register_backend(backend_cls)
    dv2.configure(validate=False)
    tokens, hidden, experts, topk = 128, 64, 8, 4
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
    w = torch.rand(tokens, topk, generator=gen).requires_grad_()
    kwargs = dict(layout="compact", backend="zero-cost", num_sms=0, host_sync=True, deterministic=False)

    def step(**dispatch_kwargs) -> None:
        out = dv2.dispatch(x, idx, w, experts, group=dist.group.WORLD, **dispatch_kwargs)
        y = dv2.combine(out.recv_x * out.recv_topk_weights[:, :1], out.handle)
        y.sum().backward()

    results = {}
    logger.info("timing %s (package at %s)", "ops_resolved_per_call", os.path.dirname(dv2.__file__))
    results["ops_resolved_per_call"] = time_steps(lambda: step(**kwargs), args.iters, args.warmup)
    logger.info("   %.1f us per step", results["ops_resolved_per_call"])
    if hasattr(dv2, "DispatchConfig"):
        config = dv2.DispatchConfig.resolve(**kwargs)
        logger.info("timing ops_config")
        results["ops_config"] = time_steps(lambda: step(config=config), args.iters, args.warmup)
        logger.info("   %.1f us per step", results["ops_config"])
    # The same step without our layer: the two autograd-free tensor ops the step does itself.
    bare = lambda: (x * w[:, :1]).sum().backward()  # noqa: E731
    results["bare_tensor_ops"] = time_steps(bare, args.iters, args.warmup)
    logger.info("   bare tensor ops of the step: %.1f us", results["bare_tensor_ops"])
    return results


def plot(rows: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels, values = [], []
    for label, result in rows.items():
        for key, value in result.items():
            labels.append(f"{label}\n{key}")
            values.append(value)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4))
    bars = ax.bar(range(len(values)), values)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=7)
    ax.set_ylabel("host us per dispatch + combine, fwd + bwd")
    ax.set_title("deepepv2 host overhead over a zero-cost backend (CPU, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tree", default=None, help="checkout whose megatron_deepepv2 to measure")
    parser.add_argument("--label", default="current")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=20)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        results = measure(args)
    finally:
        dist.destroy_process_group()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_host_overhead.json")
    rows = json.load(open(path)) if os.path.exists(path) else {}
    rows[args.label] = results
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    plot(rows, os.path.join(args.out, "bench_host_overhead.png"))
    logger.info("wrote %s", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
