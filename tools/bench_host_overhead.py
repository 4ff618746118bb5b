#!/usr/bin/env python3
"""Host time the deepepv2 layer adds per dispatch + combine (forward + backward), over a zero-cost backend.

The backend moves nothing (it hands its inputs back as its outputs), so what is timed is the
package's own host work per step: settings, backend and buffer resolution, input checks, the autograd ops and
handle bookkeeping. Runs on the CPU in one process (a 1-rank gloo group), on tiny tensors, interleaving the
variants round by round, and reports the median and the minimum microseconds per step of:

* ``ops_resolved_per_call``: ``dispatch(..., layout=..., expert_alignment=...)`` -- settings resolved every call;
* ``ops_config``: ``dispatch(..., config=resolve_config(...))`` -- resolved once, as the Megatron manager
  does (skipped on trees that predate ``DispatchConfig``);
* ``ops_config_no_id_check``: the same with the default expert-id check off (``check_ids=False``; trees that
  predate the check have none), which tells the check's cost from the rest;
* ``ops_megatron_config``: ``DispatchConfig`` as the Megatron manager resolves it: other ranks' weights not zeroed
  (``mask_foreign_weights=False``: its multihot conversion ignores them), no id check (``check_ids=False``: its ids
  come from ``torch.topk``, valid by construction) and, on trees that have the switch, no clearing of the rows past
  the valid ones (``clear_tail=False``);
* ``backend_floor``: two minimal autograd functions that call the zero-cost backend's contract directly, with
  none of the package's configuration, checks, buffer lookup or handle records: the least any dispatch + combine
  over this backend costs, ours or not;
* ``autograd_floor``: two identity autograd functions in place of dispatch and combine: what PyTorch charges any
  Python-level differentiable dispatch + combine, the part of the layer no code of ours can remove;
* ``bare_tensor_ops``: the step's own tensor ops without the layer. ``layer_min`` = a variant's minimum minus
  this one's: the layer's host time.

The step hands the layer's output a dense upstream gradient (what the model above an MoE layer hands back) and
keeps its process group resolved (as the Megatron manager does); each round warms its variant up before timing it.

Prints progress, writes ``bench_host_overhead.json`` and ``bench_host_overhead.png`` to ``--out``. ``--tree``
measures another checkout of the package (e.g. an older commit in a git worktree) with the same harness;
``--compare`` measures several, each in its own process, alternating them ``--processes`` times, and keeps each
one's smallest and median layer time over its processes (what docs/benchmarks.md reports)::

    python tools/bench_host_overhead.py --out bench_out [--tree /path/to/older/checkout --label before]
    taskset -c 5 python tools/bench_host_overhead.py --out bench_out --compare before=/path/to/older now=.

``--instructions`` counts the CPU instructions of one step of each variant instead (valgrind's callgrind, each
variant in its own process), which do not change with the machine's load: it writes
``bench_host_instructions.json`` and ``.png``::

    python tools/bench_host_overhead.py --out bench_out --instructions --compare before=/path/to/older now=.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import gc
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable, Collection, Optional

#: This checkout: its ``tools`` are imported from here; its package is measured unless ``--tree`` names another.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tools import _bench  # noqa: E402  (imports no package: another checkout's may be measured)

logger = logging.getLogger("bench_host_overhead")


def _zero_cost_backend(base: Any) -> type:
    """A backend that returns its inputs as its outputs: no communication, no copies, no tensor op (autograd
    itself makes an output that is an input a view, as it must for any differentiable op).

    Written against the backend contract of the measured checkout: the current one (the layer's
    :class:`DispatchConfig` and the expert count per call), the earlier one of :class:`Routing` (the expert count
    inside it), or the earliest (keyword arguments per call, events returned, counts carried by the handle).

    Args:
        base: The checkout's ``megatron_deepepv2.backends.base`` module.

    Returns:
        The backend class, registered as ``zero-cost`` by the caller.
    """
    if hasattr(base, "DispatchResult"):
        return _zero_cost_backend_on_config(base)
    if hasattr(base, "Routing"):
        return _zero_cost_backend_on_routing(base)
    return _zero_cost_backend_on_keywords(base)


def _zero_cost_backend_on_config(base: Any) -> type:
    """:func:`_zero_cost_backend` for the current contract: ``dispatch(x, topk_idx, topk_weights, config,
    num_experts, streams)``, :class:`DispatchResult` returned."""
    import torch

    counts_by_shape: dict = {}

    class ZeroCostBackend(base.DispatchBackend):
        name = "zero-cost"
        limits = base.BackendLimits(dispatch_dtypes=(torch.float32,), combine_dtypes=(torch.float32,))

        def dispatch(self, x, topk_idx, topk_weights, config, num_experts, streams=base.SYNC):
            local = num_experts // self.group_size
            num_tokens = x.shape[0]
            counts = counts_by_shape.get((num_tokens, local))
            if counts is None:  # made once per shape: the backend itself costs nothing per call
                host = [num_tokens] + [0] * (local - 1)
                counts = counts_by_shape[(num_tokens, local)] = (host, (torch.tensor(host), torch.tensor(num_tokens)))
            # The handle carries its counts, so neither device_counts nor host_counts is asked.
            handle = base.DispatchHandle(self, config, None, num_tokens, topk_idx.shape[1], num_tokens,
                                         device_counts=counts[1], host_counts=counts[0])
            # One rank holds every expert, so the global ids are the local ones: no op to rewrite them.
            recv_idx = topk_idx if local == num_experts else topk_idx.clamp(max=local - 1)
            return base.DispatchResult(x, recv_idx, topk_weights, handle)

        def cached_dispatch(self, x, handle, topk_weights=None, streams=base.SYNC):
            return base.DispatchResult(x, None, topk_weights, handle)

        def combine(self, x, handle, topk_weights=None, streams=base.SYNC):
            return base.CombineOutput(x, topk_weights)

        def device_counts(self, handle):
            raise AssertionError("the zero-cost backend's handles carry their counts")

        def host_counts(self, handle):
            raise AssertionError("the zero-cost backend's handles carry their counts")

    return ZeroCostBackend


def _zero_cost_backend_on_routing(base: Any) -> type:
    """:func:`_zero_cost_backend` for the earlier contract of :class:`Routing` and :class:`Streams`."""
    import torch

    counts_by_shape: dict = {}

    class ZeroCostBackend(base.DispatchBackend):
        name = "zero-cost"
        limits = base.BackendLimits(dispatch_dtypes=(torch.float32,), combine_dtypes=(torch.float32,))

        def dispatch(self, x, topk_idx, topk_weights, routing, streams=base.SYNC):
            local = routing.num_experts // self.group_size
            handle = base.DispatchHandle(self, routing, None, x.shape[0], topk_idx.shape[1], x.shape[0])
            # One rank holds every expert, so the global ids are the local ones: no op to rewrite them.
            recv_idx = topk_idx if local == routing.num_experts else topk_idx.clamp(max=local - 1)
            return base.DispatchOutput(x, recv_idx, topk_weights, handle)

        def cached_dispatch(self, x, handle, topk_weights=None, streams=base.SYNC):
            return base.DispatchOutput(x, None, topk_weights, handle)

        def combine(self, x, handle, topk_weights=None, streams=base.SYNC):
            return base.CombineOutput(x, topk_weights)

        def _counts(self, handle) -> tuple[list[int], tuple]:
            key = (handle.num_tokens, handle.routing.num_experts // self.group_size)
            counts = counts_by_shape.get(key)
            if counts is None:  # made once per shape: the backend itself costs nothing per call
                tokens, local = key
                host = [tokens] + [0] * (local - 1)
                counts = counts_by_shape[key] = (host, (torch.tensor(host), torch.tensor(tokens)))
            return counts

        def device_counts(self, handle):
            return self._counts(handle)[1]

        def host_counts(self, handle):
            return self._counts(handle)[0]

    return ZeroCostBackend


def _zero_cost_backend_on_keywords(base: Any) -> type:
    """:func:`_zero_cost_backend` for the earliest contract: keyword arguments per call, events returned."""
    DispatchBackend, BackendLimits, CompletedEvent = base.DispatchBackend, base.BackendLimits, base.CompletedEvent
    DispatchOutput, CombineOutput, handle_cls = base.DispatchOutput, base.CombineOutput, base.DispatchHandle
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
            return DispatchOutput(x, recv_idx, topk_weights, handle, CompletedEvent())

        @staticmethod
        def _handle_fields(num_tokens, num_topk, num_experts, local, layout, expert_alignment, zero_padding,
                           host_sync):
            counts = [num_tokens] + [0] * (local - 1)
            fields = dict(layout=layout, num_experts=num_experts, num_local_experts=local,
                          expert_alignment=expert_alignment, zero_padding=zero_padding, num_tokens=num_tokens,
                          num_topk=num_topk, num_recv_rows=num_tokens, tokens_per_expert_list=counts,
                          host_sync=host_sync, native=None)
            # Older trees' handles carry fields that later ones dropped: pass those the compared tree has.
            fields = {name: value for name, value in fields.items() if name in handle_cls.__dataclass_fields__}
            count_tensors = (torch.tensor(counts), torch.tensor(num_tokens))
            if "device_counts" in handle_cls.__dataclass_fields__:
                fields["device_counts"] = lambda: count_tensors
            else:  # trees before lazily derived counts
                fields["tokens_per_expert"], fields["num_valid_rows"] = count_tensors
            return fields

        def cached_dispatch(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                            previous_event=None):
            return DispatchOutput(x, None, topk_weights, handle, CompletedEvent())

        def combine(self, x, handle, topk_weights=None, *, async_finish=False, allocate_on_comm_stream=False,
                    previous_event=None):
            return CombineOutput(x, topk_weights, CompletedEvent())

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


def _backend_only_functions():
    """A dispatch and a combine that call the backend contract directly, with none of the package's work around it
    (no configuration, checks, buffer lookup, handle records): what any autograd dispatch + combine over this backend
    costs at the least. Each takes the buffer it calls (the handle's name for it differs between checkouts)."""
    import torch

    class BackendDispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weights, call):
            dispatch, buffer, handles = call  # dispatch(x, weights): the buffer's dispatch in its contract's form
            out = dispatch(x, weights)
            ctx.buffer, ctx.handle = buffer, out.handle
            handles.append(out.handle)
            return out.recv_x, out.recv_topk_weights

        @staticmethod
        def backward(ctx, grad_x, grad_weights):
            out = ctx.buffer.combine(grad_x, ctx.handle, grad_weights)
            return out.x, out.topk_weights, None

    class BackendCombine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, buffer, handle):
            ctx.buffer, ctx.handle = buffer, handle
            return buffer.combine(x, handle).x

        @staticmethod
        def backward(ctx, grad):
            return ctx.buffer.cached_dispatch(grad, ctx.handle).recv_x, None, None

    return BackendDispatch, BackendCombine


#: The calls per timed sample, and the untimed calls before each (see :func:`_bench.interleave`'s ``settle``: a
#: ~15 us bias on ten calls without them).
CALLS, SETTLE = 10, 3
#: Variants that need no package, which every checkout therefore has (counting only these lists no checkout).
PACKAGE_FREE_VARIANTS = ("autograd_floor", "bare_tensor_ops")


@dataclasses.dataclass(frozen=True)
class _StepInputs:
    """The tensors every variant's step uses: 128 tokens, hidden 64, top-4 of 8 experts, FP32 on the CPU."""

    x: Any
    idx: Any
    w: Any
    upstream_grad: Any
    experts: int

    @classmethod
    def make(cls) -> "_StepInputs":
        import torch

        tokens, hidden, experts, topk = 128, 64, 8, 4
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
        w = torch.rand(tokens, topk, generator=gen).requires_grad_()
        # What the layer's output gets back from the model above it: a dense gradient (a loss's
        # ``sum().backward()`` would hand back a stride-0 one, whose contiguous copy before the cached dispatch no
        # model pays).
        upstream_grad = torch.randn(tokens, hidden, generator=gen)
        return cls(x, idx, w, upstream_grad, experts)


def _package_variants(inputs: _StepInputs) -> dict[str, Callable[[], None]]:
    """The variants that run the package on ``sys.path`` (those the checkout has) and ``backend_floor``."""
    import torch.distributed as dist

    import megatron_deepepv2 as dv2
    from megatron_deepepv2.backends import base

    dv2.register_backend(_zero_cost_backend(base))
    dv2.configure(validate=False)
    x, idx, w, upstream_grad, experts = (inputs.x, inputs.idx, inputs.w, inputs.upstream_grad, inputs.experts)
    group = dist.group.WORLD  # resolved once, as the Megatron manager holds its group
    kwargs = dict(layout="compact", backend="zero-cost", num_sms=0, host_sync=True, deterministic=False)

    def step(**dispatch_kwargs) -> None:
        out = dv2.dispatch(x, idx, w, experts, group=group, **dispatch_kwargs)
        y = dv2.combine(out.recv_x * out.recv_topk_weights[:, :1], out.handle)
        y.backward(upstream_grad)

    variants = {"ops_resolved_per_call": lambda: step(**kwargs)}
    config = None
    if hasattr(dv2, "DispatchConfig"):
        resolve = dv2.resolve_config if hasattr(dv2, "resolve_config") else dv2.DispatchConfig.resolve  # older trees
        config = resolve(**kwargs)
        variants["ops_config"] = lambda: step(config=config)
        if "check_ids" in _bench.resolver_fields(dv2):
            # Without the default expert-id check (trees before it had none), to tell its cost from the rest.
            unchecked = resolve(**kwargs, check_ids=False)
            variants["ops_config_no_id_check"] = lambda: step(config=unchecked)
        manager_overrides = _bench.megatron_manager_overrides(dv2)
        if "check_ids" in manager_overrides:  # trees before the id check have no manager configuration of their own
            megatron = resolve(**kwargs, **manager_overrides)
            variants["ops_megatron_config"] = lambda: step(config=megatron)
    # The backend contract called directly: the least any dispatch + combine over this backend costs.
    handle = dv2.dispatch(x, idx, w, experts, group=group, **kwargs).handle
    buffer = handle.buffer if hasattr(base, "DispatchResult") else handle.backend  # older trees: handle.backend
    backend_dispatch, backend_combine = _backend_only_functions()
    if hasattr(base, "DispatchResult"):

        def dispatch(x_, w_):
            return buffer.dispatch(x_, idx, w_, config, experts)
    elif hasattr(base, "Routing"):
        routing = base.Routing(experts, base.ExpertLayout.COMPACT)

        def dispatch(x_, w_):
            return buffer.dispatch(x_, idx, w_, routing)
    else:  # the earliest contract: the routing as keyword arguments

        def dispatch(x_, w_):
            return buffer.dispatch(x_, idx, w_, num_experts=experts, layout=base.ExpertLayout.COMPACT)

    def backend_floor() -> None:
        handles: list = []
        recv_x, recv_w = backend_dispatch.apply(x, w, (dispatch, buffer, handles))
        backend_combine.apply(recv_x * recv_w[:, :1], buffer, handles[0]).backward(upstream_grad)

    variants["backend_floor"] = backend_floor
    return variants


def _package_free_variants(inputs: _StepInputs) -> dict[str, Callable[[], None]]:
    """:data:`PACKAGE_FREE_VARIANTS`: what PyTorch charges any differentiable dispatch + combine, and the step's own
    tensor ops."""
    x, w, upstream_grad = inputs.x, inputs.w, inputs.upstream_grad
    dispatch_fn, combine_fn = _identity_functions()

    def autograd_floor() -> None:
        recv_x, recv_w = dispatch_fn.apply(x, w, None)
        combine_fn.apply(recv_x * recv_w[:, :1], None, None).backward(upstream_grad)

    # The same step without our layer: the two autograd-free tensor ops the step does itself.
    return {"autograd_floor": autograd_floor, "bare_tensor_ops": lambda: (x * w[:, :1]).backward(upstream_grad)}


def build_variants(only: Optional[Collection[str]] = None) -> dict[str, Callable[[], None]]:
    """The steps to time, one per variant (see the module docstring), over the package on ``sys.path``; the last one
    is ``bare_tensor_ops``, which the others' layer time is relative to.

    Args:
        only: Build only these (those of them the checkout has); None builds every variant. Asking for
            :data:`PACKAGE_FREE_VARIANTS` alone imports no package (a callgrind run then spends no time on it).

    Returns:
        The steps by variant name, in the module docstring's order.
    """
    inputs = _StepInputs.make()
    variants: dict[str, Callable[[], None]] = {}
    if only is None or not set(only) <= set(PACKAGE_FREE_VARIANTS):
        variants.update(_package_variants(inputs))
    variants.update(_package_free_variants(inputs))
    return variants if only is None else {name: step for name, step in variants.items() if name in only}


def measure(args: argparse.Namespace) -> dict:
    """Times every variant in this process, interleaved, ``--iters`` rounds of :data:`CALLS` calls each.

    Returns:
        Per variant: the ``median`` and the ``min`` microseconds per step over the rounds (the minimum is the cost
        without interference from the rest of the machine), and ``layer_min`` = its minimum minus bare's.
    """
    import megatron_deepepv2 as dv2

    variants = build_variants()
    logger.info("timing %s, interleaved (package at %s)", ", ".join(variants), os.path.dirname(dv2.__file__))
    samples = _bench.interleave(variants, lambda fn: _bench.wall_us(fn, CALLS), rounds=args.iters, warmup=args.warmup,
                                settle=SETTLE)
    results = {name: {"median": statistics.median(values), "min": min(values)} for name, values in samples.items()}
    bare = results["bare_tensor_ops"]["min"]
    for name, result in results.items():
        if name != "bare_tensor_ops":
            result["layer_min"] = result["min"] - bare
        logger.info("   %-22s median %.1f us, min %.1f us%s", name, result["median"], result["min"],
                    f", layer (min - bare min) {result['layer_min']:.1f} us" if "layer_min" in result else "")
    return results


def plot(rows: dict, path: str, key: str = "layer_min") -> None:
    """Bars of ``key`` per (label, variant): layer microseconds, or (``layer_instructions``) thousands of
    instructions."""
    labels, values = [], []
    for label, result in rows.items():
        for variant, value in result.items():
            if key in value:
                labels.append(f"{label}\n{variant}")
                values.append(value[key] / 1000 if key == "layer_instructions" else value[key])
    fig, ax = _bench.new_figure(max(6, 1.2 * len(labels)), 4)
    bars = ax.bar(range(len(values)), values)
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(values)), labels, fontsize=6, rotation=60, ha="right")
    if key == "layer_instructions":
        ax.set_ylabel("layer CPU instructions per step, thousands\n(dispatch + combine, forward + backward)", fontsize=9)
        ax.set_title("deepepv2 host work over a zero-cost backend (callgrind; step minus bare; lower is better)",
                     fontsize=9)
    else:
        ax.set_ylabel("layer host us (dispatch + combine,\nforward + backward)", fontsize=9)
        ax.set_title("deepepv2 host time over a zero-cost backend (CPU; min over rounds [and processes] minus bare; "
                     "lower is better)", fontsize=9)
    _bench.save_figure(fig, path)


def summarise_processes(samples: dict[str, dict[str, list[float]]]) -> dict:
    """Per label and variant, the layer times of several processes summarised.

    Args:
        samples: Per label, per variant, the ``layer_min`` of each process, in process order.

    Returns:
        Per label, per variant: ``layer_min`` (the smallest over the processes), ``layer_median`` and
        ``processes`` (the list).
    """
    return {label: {variant: {"layer_min": min(values), "layer_median": statistics.median(values),
                              "processes": list(values)}
                    for variant, values in variants.items()} for label, variants in samples.items()}


def compare_trees(trees: list[tuple[str, str]], processes: int, args: argparse.Namespace) -> dict:
    """Runs this tool once per tree, ``processes`` times, alternating the trees, and keeps per tree and variant the
    smallest and the median layer time over the processes.

    A process of its own per measurement, because two checkouts of the package cannot share one interpreter; many
    alternating processes, because a machine that changes speed over minutes (this one's CPU does, by up to 2x) then
    slows every tree alike, and the smallest of the processes is each tree's cost without that interference.

    Returns:
        Per label, per variant: see :func:`summarise_processes`.
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
    rows = summarise_processes(samples)
    for label, variants in rows.items():
        for variant, result in variants.items():
            logger.info("%-10s %-24s layer: smallest %.1f us, median %.1f us over %d processes", label, variant,
                        result["layer_min"], result["layer_median"], len(result["processes"]))
    return rows


def run_counted_steps(args: argparse.Namespace) -> None:
    """Child of :func:`count_instructions`, running under callgrind with instrumentation off: warms up the variant
    ``args.count_variant``, then runs ``args.steps`` steps and ``3 * args.steps`` more, dumping the counts after
    each batch (``callgrind_control`` switches the instrumentation on and off around them)."""
    variants = build_variants({args.count_variant})
    if args.count_variant not in variants:
        raise SystemExit(f"--count-variant: {args.count_variant!r} is not a variant of this checkout")
    step = variants[args.count_variant]
    for _ in range(args.warmup):
        step()
    gc.collect()

    def control(*options: str) -> None:
        subprocess.run(["callgrind_control", *options, str(os.getpid())], check=True, capture_output=True)

    control("--instr=on")
    for _ in range(args.steps):
        step()
    control("--dump=first")
    for _ in range(3 * args.steps):
        step()
    control("--dump=second")
    control("--instr=off")


def _run_child(command: list[str], what: str) -> str:
    """Runs ``command``; returns its stdout, or raises with the end of its stderr when it fails."""
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
    return run.stdout


def _dumped_instructions(path: str) -> int:
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"{path} holds no instruction total: is it a callgrind dump?")


def count_instructions(trees: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    """CPU instructions per step of every variant of every tree, counted by valgrind's callgrind.

    Unlike time, the count does not change with the machine's load or clock: it tells apart differences of a few
    percent that the timing's noise hides. Each (tree, variant) runs in its own process; only the steps are
    counted (between two dumps, ``steps`` and ``3 * steps`` steps after warm-up, so that what the dumps themselves
    cost cancels), and a variant's ``layer_instructions`` is its count minus ``bare_tensor_ops``'s. Asked for
    :data:`PACKAGE_FREE_VARIANTS` alone, it lists no checkout's variants (every checkout has those).

    Returns:
        Per label, per variant: ``instructions`` and ``layer_instructions`` per step.
    """
    for needed in ("valgrind", "callgrind_control"):
        if shutil.which(needed) is None:
            raise SystemExit(f"--instructions needs valgrind's {needed} on PATH (e.g. apt-get install valgrind).")
    tool = os.path.abspath(__file__)
    jobs = []
    for label, tree in trees:
        tree_args = [] if tree == "." else ["--tree", tree]
        if args.variants and set(args.variants) <= set(PACKAGE_FREE_VARIANTS):
            variants = list(PACKAGE_FREE_VARIANTS)
        else:
            listed = _run_child([sys.executable, tool, "--list-variants", *tree_args],
                                f"listing the variants of {label}")
            variants = json.loads(listed.splitlines()[-1])
        if args.variants:
            unknown = sorted(set(args.variants) - set(variants))
            if unknown:
                raise SystemExit(f"--variants: {unknown} are not variants of {label} ({', '.join(variants)})")
            variants = [variant for variant in variants if variant in args.variants]
        jobs += [(label, tree_args, variant) for variant in variants]

    def count(job: tuple[str, list[str], str]) -> tuple[str, str, float]:
        label, tree_args, variant = job
        with tempfile.TemporaryDirectory() as scratch:
            out_file = os.path.join(scratch, "callgrind.out")
            _run_child(["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out_file}",
                        sys.executable, tool, "--count-variant", variant, "--steps", str(args.steps), "--warmup",
                        str(args.warmup), *tree_args], f"counting {label} {variant}")
            first, second = (_dumped_instructions(f"{out_file}.{part}") for part in (1, 2))
        per_step = (second - first) / (2 * args.steps)
        logger.info("%-10s %-24s %9.0f instructions per step", label, variant, per_step)
        return label, variant, per_step

    logger.info("counting %d (tree, variant) runs under callgrind, %d at a time", len(jobs), args.jobs)
    rows: dict[str, dict[str, dict[str, float]]] = {label: {} for label, _ in trees}
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for label, variant, per_step in pool.map(count, jobs):
            rows[label][variant] = {"instructions": per_step}
    return layer_instructions(rows)


def layer_instructions(rows: dict) -> dict:
    """Adds ``layer_instructions`` (its count minus ``bare_tensor_ops``'s) to every variant but bare, per label.

    Returns:
        ``rows``, updated in place.
    """
    for variants in rows.values():
        if "bare_tensor_ops" not in variants:
            continue  # counted without it (--variants): no layer counts
        bare = variants["bare_tensor_ops"]["instructions"]
        for variant, result in variants.items():
            if variant != "bare_tensor_ops":
                result["layer_instructions"] = result["instructions"] - bare
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
    parser.add_argument("--instructions", action="store_true",
                        help="count CPU instructions per step under valgrind's callgrind instead of timing (writes "
                             "bench_host_instructions.json/png; with --compare, for every checkout)")
    parser.add_argument("--steps", type=int, default=100, help="with --instructions: steps per counted batch")
    parser.add_argument("--jobs", type=int, default=2, help="with --instructions: callgrind runs at a time")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="with --instructions: count only these variants (the layer counts need bare_tensor_ops)")
    parser.add_argument("--no-plot", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--list-variants", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--count-variant", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    _bench.setup_logging()
    if args.list_variants or args.count_variant:  # children of --instructions
        in_one_rank_group(args, lambda: print(json.dumps(list(build_variants()))) if args.list_variants
                          else run_counted_steps(args))
        return 0
    trees = []
    for item in args.compare or []:
        label, sep, tree = item.partition("=")
        if not sep or not label or not tree:
            parser.error(f"--compare takes LABEL=TREE items; got {item!r}")
        trees.append((label, tree))
    for tree in [tree for _, tree in trees] + ([args.tree] if args.tree else []):
        if not os.path.isdir(os.path.join(tree, "megatron_deepepv2")):
            parser.error(f"{tree!r} is not a checkout of this package (it has no megatron_deepepv2/ folder)")
    name = "bench_host_instructions" if args.instructions else "bench_host_overhead"
    path = os.path.join(args.out, f"{name}.json")
    rows = json.load(open(path)) if os.path.exists(path) else {}  # earlier labels are kept
    if args.instructions:
        rows.update(count_instructions(trees or [(args.label, args.tree or ".")], args))
    elif trees:
        rows.update(compare_trees(trees, args.processes, args))
    else:
        rows[args.label] = in_one_rank_group(args, lambda: measure(args))
    key = "layer_instructions" if args.instructions else "layer_min"
    _bench.write_outputs(args.out, name, rows, None if args.no_plot else functools.partial(plot, key=key))
    return 0


def in_one_rank_group(args: argparse.Namespace, work: Callable[[], Any]) -> Any:
    """Runs ``work`` over the tree ``args.tree`` (default: this checkout) in this process, on a 1-rank gloo group
    and one CPU thread."""
    sys.path.insert(0, os.path.abspath(args.tree) if args.tree else ROOT)
    import torch

    torch.set_num_threads(1)
    with _bench.process_group("gloo", one_rank=True):
        return work()


if __name__ == "__main__":
    sys.exit(main())
