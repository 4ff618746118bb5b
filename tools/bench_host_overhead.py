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
* ``ops_megatron_config``: ``DispatchConfig`` as the Megatron manager resolves it: other ranks' weights not zeroed
  (``mask_foreign_weights=False``: its multihot conversion ignores them) and no id check (``check_ids=False``: its ids
  come from ``torch.topk``, valid by construction);
* ``autograd_floor``: two identity autograd functions in place of dispatch and combine: what PyTorch charges any
  Python-level differentiable dispatch + combine, the part of the layer no code of ours can remove;
* ``bare_tensor_ops``: the step's own tensor ops without the layer. ``layer_min`` = a variant's minimum minus
  this one's: the layer's host time.

Prints progress, writes ``bench_host_overhead.json`` and ``bench_host_overhead.png`` to ``--out``. ``--tree``
measures another checkout of the package (e.g. an older commit in a git worktree) with the same harness;
``--compare`` measures several, each in its own process, alternating them ``--processes`` times, and keeps each
one's smallest and median layer time over its processes (what docs/benchmarks.md reports)::

    python tools/bench_host_overhead.py --out bench_out [--tree /path/to/older/checkout --label before]
    taskset -c 5 python tools/bench_host_overhead.py --out bench_out --compare before=/path/to/older now=.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

logger = logging.getLogger("bench_host_overhead")


def _zero_cost_backend(base, handle_cls, outputs):
    """A backend that returns its inputs as the received rows: no communication, no copies."""
    DispatchBackend, BackendLimits, CompletedEvent = base
    DispatchOutput, CombineOutput = outputs
    import torch

    handle_fields: dict = {}

    class ZeroCostBackend(DispatchBackend):
        name = "zero-cost"
        limits = BackendLimits(dispatch_dtypes=(torch.float32,), combine_dtypes=(torch.float32,))

        def dispatch(self, x, topk_idx, topk_weights, *, num_experts, layout, expert_alignment=1,
                     zero_padding=False, async_finish=False, allocate_on_comm_stream=False, previous_event=None,
                     host_sync=True):
            local = num_experts // self.group_size
            key = (x.shape[0], topk_idx.shape[1], local, layout, expert_alignment, zero_padding, host_sync)
            fields = handle_fields.get(key)
            if fields is None:  # made once per shape: the backend itself costs nothing per call
                fields = handle_fields[key] = self._handle_fields(x.shape[0], topk_idx.shape[1], num_experts, local,
                                                                   layout, expert_alignment, zero_padding, host_sync)
            handle = handle_cls(backend=self, **fields)
            # One rank holds every expert, so the global ids are the local ones: no op to rewrite them.
            recv_idx = topk_idx if local == num_experts else topk_idx.clamp(max=local - 1)
            return DispatchOutput(x.view_as(x), recv_idx, topk_weights, handle, CompletedEvent())

        @staticmethod
        def _handle_fields(num_tokens, num_topk, num_experts, local, layout, expert_alignment, zero_padding,
                           host_sync):
            counts = [num_tokens] + [0] * (local - 1)
            fields = dict(layout=layout, num_experts=num_experts, num_local_experts=local,
                          expert_alignment=expert_alignment, zero_padding=zero_padding, num_tokens=num_tokens,
                          num_topk=num_topk, num_recv_rows=num_tokens, tokens_per_expert_list=counts,
                          host_sync=host_sync, native=None)
            count_tensors = (torch.tensor(counts), torch.tensor(num_tokens))
            if "device_counts" in handle_cls.__dataclass_fields__:
                fields["device_counts"] = lambda: count_tensors
            else:  # trees before lazily derived counts
                fields["tokens_per_expert"], fields["num_valid_rows"] = count_tensors
            return fields

        def cached_dispatch(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                            previous_event=None):
            return DispatchOutput(x.view_as(x), None, topk_weights, handle, CompletedEvent())

        def combine(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                    previous_event=None):
            return CombineOutput(x.view_as(x), topk_weights, CompletedEvent())

    return ZeroCostBackend


def _identity_functions():
    """Two autograd functions that return their inputs (as views): a dispatch and a combine that do nothing."""
    import torch

    class IdentityDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weights, call):
            ctx.call = call
            return x.view_as(x), weights.view_as(weights)

        @staticmethod
        def backward(ctx, grad_x, grad_weights):
            return grad_x, grad_weights, None

    class IdentityCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, handle, streams):
            ctx.handle = handle
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad, None, None

    return IdentityDispatch, IdentityCombine


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
        resolve_parameters = inspect.signature(dv2.DispatchConfig.resolve).parameters
        if "check_ids" in resolve_parameters:
            # As the Megatron manager resolves it: its multihot conversion ignores other ranks' weights (not
            # zeroed), its ids come from torch.topk (valid by construction, not checked).
            megatron = dv2.DispatchConfig.resolve(**kwargs, mask_foreign_weights=False, check_ids=False)
            variants["ops_megatron_config"] = lambda: step(config=megatron)
    # What any differentiable dispatch + combine pays in PyTorch: two identity autograd functions in their place.
    dispatch_fn, combine_fn = _identity_functions()

    def autograd_floor() -> None:
        recv_x, recv_w = dispatch_fn.apply(x, w, None)
        combine_fn.apply(recv_x * recv_w[:, :1], None, None).sum().backward()

    variants["autograd_floor"] = autograd_floor
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
    ax.set_ylabel("layer host us (dispatch + combine,\nforward + backward)", fontsize=9)
    ax.set_title("deepepv2 host time over a zero-cost backend (CPU; min over rounds [and processes] minus bare; "
                 "lower is better)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare_trees(trees: list[tuple[str, str]], processes: int, args) -> dict:
    """Runs this tool once per tree, ``processes`` times, alternating the trees, and keeps per tree and variant the
    smallest and the median layer time over the processes.

    A process of its own per measurement, because two checkouts of the package cannot share one interpreter; many
    alternating processes, because a machine that changes speed over minutes (this one's CPU does, by up to 2x) then
    slows every tree alike, and the smallest of the processes is each tree's cost without that interference.

    Returns:
        Per label, per variant: ``layer_min`` (the smallest over the processes), ``layer_median`` and the list.
    """
    samples: dict[str, dict[str, list[float]]] = {label: {} for label, _ in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for index in range(processes):
            for label, tree in trees:
                out = os.path.join(scratch, f"{label}-{index}")
                command = [sys.executable, os.path.abspath(__file__), "--out", out, "--label", label, "--iters",
                           str(args.iters), "--warmup", str(args.warmup), "--no-plot"]
                if tree != ".":
                    command += ["--tree", tree]
                logger.info("process %d/%d: %s (%s)", index + 1, processes, label, tree)
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
                with open(os.path.join(out, "bench_host_overhead.json")) as f:
                    for variant, result in json.load(f)[label].items():
                        if "layer_min" in result:
                            samples[label].setdefault(variant, []).append(result["layer_min"])
    rows = {label: {variant: {"layer_min": min(values), "layer_median": statistics.median(values), "processes": values}
                    for variant, values in variants.items()} for label, variants in samples.items()}
    for label, variants in rows.items():
        for variant, result in variants.items():
            logger.info("%-10s %-24s layer: smallest %.1f us, median %.1f us over %d processes", label, variant,
                        result["layer_min"], result["layer_median"], len(result["processes"]))
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--tree", default=None, help="checkout whose megatron_deepepv2 to measure")
    parser.add_argument("--label", default="current")
    parser.add_argument("--compare", nargs="+", metavar="LABEL=TREE", default=None,
                        help="measure these checkouts ('.' = this one) in alternating processes instead")
    parser.add_argument("--processes", type=int, default=6, help="with --compare: processes per checkout")
    parser.add_argument("--iters", type=int, default=30, help="rounds of 10 calls per variant")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_host_overhead.json")
    rows = json.load(open(path)) if os.path.exists(path) else {}
    if args.compare:
        trees = []
        for item in args.compare:
            label, sep, tree = item.partition("=")
            if not sep or not label or not tree:
                parser.error(f"--compare takes LABEL=TREE items; got {item!r}")
            trees.append((label, tree))
        rows.update(compare_trees(trees, args.processes, args))
    else:
        rows[args.label] = measure_in_this_process(args)
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    logger.info("wrote %s", path)
    if not args.no_plot:
        try:
            plot(rows, os.path.join(args.out, "bench_host_overhead.png"))
        except ImportError:
            logger.warning("no PNG: matplotlib is missing (pip install 'megatron-deepepv2[bench]')")
    return 0


def measure_in_this_process(args) -> dict:
    """Measures the tree ``args.tree`` (default: this checkout) in this process, on a 1-rank gloo group."""
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return measure(args)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    # Not megatron_deepepv2._dist.free_port: this process may measure another checkout, whose package it imports
    # only once the tree is on the path (and older trees lack that helper).
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
