#!/usr/bin/env python3
"""Host time the deepepv2 layer adds per dispatch + combine (forward + backward), over a zero-cost backend.

The backend moves nothing (its dispatch hands the tokens back as received rows), so what is timed is the
package's own host work per step: settings, backend and buffer resolution, input checks, the autograd ops and
handle bookkeeping. Runs on the CPU in one process (a 1-rank gloo group), on tiny tensors, interleaving the
variants round by round, and reports the median and the minimum microseconds per step of:

* ``ops_resolved_per_call``: ``dispatch(..., layout=..., expert_alignment=...)`` -- settings resolved every call;
* ``ops_config``: ``dispatch(..., config=DispatchConfig.resolve(...))`` -- resolved once, as the Megatron manager
  does (skipped on trees that predate ``DispatchConfig``);
* ``ops_config_no_id_check``: the same with the default expert-id check off (``check_ids=False``; trees that
  predate the check have none), which tells the check's cost from the rest;
* ``bare_tensor_ops``: the step's own tensor ops without the layer. ``layer_min`` = a variant's minimum minus
  this one's: the layer's host time.

Prints progress, writes ``bench_host_overhead.json`` and ``bench_host_overhead.png`` to ``--out``. ``--tree``
measures another checkout of the package (e.g. an older commit in a git worktree) with the same harness::

    python tools/bench_host_overhead.py --out bench_out [--tree /path/to/older/checkout --label before]
"""

from __future__ import annotations

import argparse
import dataclasses
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


def time_variants(variants: dict[str, Callable[[], None]], rounds: int, warmup: int,
                  calls: int = 10) -> dict[str, dict[str, float]]:
    """Microseconds per call of each variant: ``rounds`` rounds of ``calls`` calls, the variants interleaved round
    by round, so that a machine that changes speed during the run slows them all alike.

    Returns:
        Per variant, the ``median`` and the ``min`` over the rounds (the minimum is the cost without interference
        from the rest of the machine; it is what the comparison uses).
    """
    for step in variants.values():
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, step in variants.items():
            start = time.perf_counter()
            for _ in range(calls):
                step()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: {"median": statistics.median(values), "min": min(values)} for name, values in samples.items()}


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

    variants = {"ops_resolved_per_call": lambda: step(**kwargs)}
    if hasattr(dv2, "DispatchConfig"):
        config = dv2.DispatchConfig.resolve(**kwargs)
        variants["ops_config"] = lambda: step(config=config)
        if "check_ids" in getattr(dv2.DispatchConfig, "__dataclass_fields__", {}):
            # Without the default expert-id check (trees before it had none), to tell its cost from the rest.
            unchecked = dataclasses.replace(config, check_ids=False)
            variants["ops_config_no_id_check"] = lambda: step(config=unchecked)
    # The same step without our layer: the two autograd-free tensor ops the step does itself.
    variants["bare_tensor_ops"] = lambda: (x * w[:, :1]).sum().backward()
    logger.info("timing %s, interleaved (package at %s)", ", ".join(variants), os.path.dirname(dv2.__file__))
    results = time_variants(variants, args.iters, args.warmup)
    bare = results["bare_tensor_ops"]["min"]
    for name, result in results.items():
        if name != "bare_tensor_ops":
            result["layer_min"] = result["min"] - bare
        logger.info("   %-22s median %.1f us, min %.1f us%s", name, result["median"], result["min"],
                    f", layer (min - bare min) {result['layer_min']:.1f} us" if "layer_min" in result else "")
    return results


def plot(rows: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels, values = [], []
    for label, result in rows.items():
        for key, value in result.items():
            if "layer_min" in value:
                labels.append(f"{label}\n{key}")
                values.append(value["layer_min"])
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    bars = ax.bar(range(len(values)), values)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=6, rotation=60, ha="right")
    ax.set_ylabel("layer host us per dispatch + combine, fwd + bwd")
    ax.set_title("deepepv2 host time over a zero-cost backend (CPU; min over rounds minus bare; lower is better)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tree", default=None, help="checkout whose megatron_deepepv2 to measure")
    parser.add_argument("--label", default="current")
    parser.add_argument("--iters", type=int, default=30, help="rounds of 10 calls per variant")
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
