#!/usr/bin/env python3
"""Benchmark of the deepepv2 path on GPUs (run under torchrun, one process per GPU).

For each configuration (tokens per rank T, hidden H, experts E, top-k, BF16 or FP8 dispatch) it times, with
CUDA events after warm-up (DeepEP's JIT excluded), the median of ``--iters`` iterations, slowest rank:

* ``raw_dispatch`` / ``raw_combine``: DeepEP ``ElasticBuffer.dispatch`` (expand layout) and ``combine``;
* ``ops_fwd_bwd``: our autograd dispatch + combine, forward and backward (DeepEP backend);
* ``raw_fwd_bwd``: the same four ElasticBuffer calls without our layer (the 1.05x target's denominator);
* ``reference_fwd_bwd``: our ops on the reference backend (NCCL all_to_all_single);
* ``path_<dispatcher>``: Megatron's dispatcher path (router -> dispatch stages -> identity experts ->
  combine stages), forward + backward, for alltoall, allgather and deepepv2-expand (the one layout Megatron layers
  take; a layer the package or Megatron refuses to build is listed under the row's ``not_run`` with the reason; every
  other dispatcher, DeepEP v1 and hybridep included, side by side on model shapes: ``tools/compare_dispatchers.py``);
* ``layer_<dispatcher>``: a full MoELayer (SequentialMLP experts) forward + backward (BF16 configs only);
* ``layer_syncfree_*``: the deepepv2 MoELayer with :class:`~megatron_deepepv2.mcore.experts.SyncFreeSequentialMLP`
  experts with host sync, without (eager), and without host sync captured in a CUDA graph (replay);
* ``layer_shared_serial`` / ``layer_shared_overlap``: with a shared expert, ``moe_shared_expert_overlap``
  off / on; the summary derives how much of the communication (``raw_fwd_bwd``) stays exposed;
* ``--sm-sweep``: raw dispatch / combine bandwidth per SM count on the first configuration, and the
  smallest SM count within 5% of the best bandwidth (where more SMs stop paying);
* ``nvlink_peak``: a 1 GiB peer-to-peer send, the NVLink reference in the same run.

Reports microseconds, logical GB/s (bytes received per rank incl. its own tokens) and remote GB/s (bytes
from the other ranks), and ratios against raw ElasticBuffer, the best stock dispatcher and the NVLink peak;
writes ``bench.json`` and ``bench.png`` to ``--out``::

    EP_DISABLE_GIN=1 torchrun --nproc-per-node 2 tools/bench.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402
from tools.bench_hot_path import _raw_buffer  # noqa: E402  (the one reader of the DeepEP backend's internals)

logger = logging.getLogger("bench")


@dataclass
class BenchConfig:
    """One benchmark configuration."""

    tokens: int
    hidden: int
    experts: int
    topk: int
    fp8: bool

    @property
    def label(self) -> str:
        return f"T{self.tokens} H{self.hidden} E{self.experts} top{self.topk} {'FP8' if self.fp8 else 'BF16'}"


class LoggedTimes(dict):
    """Results dict that logs every timing as it is stored (partial results survive a crash or timeout)."""

    def __setitem__(self, key: str, value: float) -> None:
        super().__setitem__(key, value)
        if not key.endswith("_bytes"):
            logger.info("   %-30s %10.1f us", key, value)


def time_op(fn: Callable[[], object], args: argparse.Namespace) -> float:
    """Median CUDA-event microseconds of ``fn`` over ``--iters`` calls after ``--warmup``, the slowest rank's."""
    return _bench.median_us(fn, args.iters, args.warmup, cuda=True)


def nvlink_peak_gbs(num_bytes: int = 1 << 30, iters: int = 10) -> float:
    """One-way peer-to-peer bandwidth rank 0 -> rank 1 (GB/s), shared with every rank."""
    rank = dist.get_rank()
    buf = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    gbs = torch.zeros(1, device="cuda")
    if rank in (0, 1):
        for i in range(iters + 2):
            if i == 2:
                torch.cuda.synchronize()
                start = time.perf_counter()
            dist.send(buf, 1) if rank == 0 else dist.recv(buf, 0)
        torch.cuda.synchronize()
        gbs[0] = num_bytes * iters / (time.perf_counter() - start) / 1e9
    dist.all_reduce(gbs, op=dist.ReduceOp.MAX)
    return float(gbs.item())


def received_rows(idx: torch.Tensor, cfg: BenchConfig) -> tuple[float, float]:
    """(all, remote) token rows a rank receives in a compact dispatch, maximised over ranks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    local = cfg.experts // world
    dest = torch.zeros(cfg.tokens, world, dtype=torch.bool, device="cuda")
    dest.scatter_(1, idx // local, True)
    per_rank = dest.sum(dim=0).to(torch.float64)  # rows this rank sends to each rank
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    incoming = torch.stack(gathered)[:, rank]  # rows received from each source
    totals = torch.stack([incoming.sum(), incoming.sum() - incoming[rank]])
    dist.all_reduce(totals, op=dist.ReduceOp.MAX)
    return float(totals[0]), float(totals[1])


def bench_ops(cfg: BenchConfig, args, results: dict) -> None:
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2 import buffers  # noqa: PLC0415

    x, idx, w = _bench.routed_tokens(cfg.tokens, cfg.hidden, cfg.experts, cfg.topk, seed=dist.get_rank())
    data = x
    if cfg.fp8:
        scales = torch.ones(cfg.tokens, cfg.hidden // 128, device="cuda")
        data = (x.to(torch.float8_e4m3fn), scales)
    capacity = cfg.tokens
    with dv2.settings_override(num_sms=args.sms):
        out = dv2.dispatch(data, idx, w, cfg.experts, layout="expand", expert_alignment=128,
                           backend="deepep", num_max_tokens_per_rank=capacity)
        raw, extra, _ = _raw_buffer(out.handle)

        def raw_dispatch():
            return raw.dispatch(data, topk_idx=idx, topk_weights=w, num_experts=cfg.experts,
                                num_max_tokens_per_rank=capacity, expert_alignment=128, num_sms=args.sms,
                                do_expand=True, do_zero_padding=True, **extra)

        recv_x, _, recv_w, handle, _ = raw_dispatch()
        rows = (recv_x[0] if isinstance(recv_x, tuple) else recv_x)
        y = torch.ones(rows.shape[0], cfg.hidden, dtype=torch.bfloat16, device="cuda")

        def raw_combine():
            return raw.combine(y, handle, topk_weights=recv_w)

        grad_out = torch.ones(cfg.tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda")

        def raw_fwd_bwd():
            # The four ElasticBuffer calls our ops make: dispatch, combine, cached dispatch, weighted combine.
            rx, _, rw, h, _ = raw_dispatch()
            raw.combine(rx, h)
            grad_rows = raw.dispatch(grad_out, handle=h, num_sms=h.num_sms, do_expand=True, do_zero_padding=True,
                                     **extra)[0]
            raw.combine(grad_rows, h, topk_weights=rw)

        x_req = x.clone().requires_grad_(not cfg.fp8)
        w_req = w.clone().requires_grad_()

        def ops_fwd_bwd(backend: str = "deepep"):
            inp = x_req if not cfg.fp8 else data
            res = dv2.dispatch(inp, idx, w_req, cfg.experts, layout="expand", expert_alignment=128, backend=backend, num_max_tokens_per_rank=capacity)
            rx = res.recv_x
            if cfg.fp8:  # FP8 rows carry no gradient; the weights' gradient still flows through combine
                rx = res.recv_x[0].to(torch.bfloat16) * res.recv_topk_weights.unsqueeze(1).to(torch.bfloat16)
            out_ = dv2.combine(rx, res.handle)
            out_.backward(grad_out)

        results["raw_dispatch"] = time_op(raw_dispatch, args)
        results["raw_combine"] = time_op(raw_combine, args)
        if not cfg.fp8:
            results["raw_fwd_bwd"] = time_op(raw_fwd_bwd, args)
        results["ops_fwd_bwd"] = time_op(ops_fwd_bwd, args)
        if not args.skip_reference:
            results["reference_fwd_bwd"] = time_op(lambda: ops_fwd_bwd("reference"), args)
    logical_rows, remote_rows = received_rows(idx, cfg)
    dispatch_elem = 1 + 4 / 128 if cfg.fp8 else 2  # FP8 rows carry one fp32 scale per 128 values
    results["dispatch_logical_bytes"] = logical_rows * cfg.hidden * dispatch_elem
    results["dispatch_remote_bytes"] = remote_rows * cfg.hidden * dispatch_elem
    results["combine_logical_bytes"] = logical_rows * cfg.hidden * 2  # combine is BF16
    results["combine_remote_bytes"] = remote_rows * cfg.hidden * 2
    buffers.destroy_buffers()


def bench_megatron(cfg: BenchConfig, args, results: dict) -> dict[str, str]:
    """Megatron's dispatcher path and (unless ``--skip-layer``) the whole layer per dispatcher, into ``results``.

    Returns:
        The rows whose layer Megatron or the package refused to build, with the reason.
    """
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer, dispatcher_path_step  # noqa: PLC0415

    shape = TinyMoEConfig(hidden=cfg.hidden, ffn=args.ffn, num_experts=cfg.experts, topk=cfg.topk,
                          params_dtype=torch.bfloat16)
    x0 = torch.randn(cfg.tokens, 1, cfg.hidden, device="cuda").to(torch.bfloat16)
    variants = [("alltoall", "alltoall"), ("allgather", "allgather"), ("deepepv2_expand", "deepepv2")]
    not_run: dict[str, str] = {}
    for name, dispatcher in variants:
        if dispatcher == "deepepv2":
            dv2.configure(backend="deepep", num_sms=args.sms, num_max_tokens_per_rank=cfg.tokens)
        layer = _bench.build_or_reason(name, lambda: build_moe_layer(shape, dispatcher, seed=3), not_run)
        if layer is None:
            continue
        x = x0.clone().requires_grad_()

        def path():
            dispatcher_path_step(layer, x)

        def whole_layer():
            y, _ = layer(x)
            y.backward(torch.ones_like(y))

        results[f"path_{name}"] = time_op(path, args)
        if not args.skip_layer:
            results[f"layer_{name}"] = time_op(whole_layer, args)
        layer = None  # free the layer (and its buffer references) before the next variant
        dv2.destroy_buffers()
    return not_run


def _time_layer_graph(layer, x, grad, args) -> float:
    """Median microseconds of a CUDA-graph replay of the layer's forward + backward (captured after a side-stream
    warm-up, after the eager rows ran on the default stream)."""
    from megatron_deepepv2.testing.moe_model import capture_layer_step  # noqa: PLC0415

    graph, _ = capture_layer_step(layer, x, grad)
    elapsed = time_op(graph.replay, args)
    del graph
    return elapsed


def bench_sync_free_and_overlap(cfg: BenchConfig, args, results: dict) -> None:
    """No host sync (eager and CUDA graph) and shared-expert overlap, on full deepepv2 MoELayers."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer  # noqa: PLC0415

    x0 = torch.randn(cfg.tokens, 1, cfg.hidden, device="cuda").to(torch.bfloat16)
    grad = torch.ones_like(x0)
    common = dict(backend="deepep", num_sms=args.sms, num_max_tokens_per_rank=cfg.tokens)
    shape = TinyMoEConfig(hidden=cfg.hidden, ffn=args.ffn, num_experts=cfg.experts, topk=cfg.topk,
                          params_dtype=torch.bfloat16)

    def eager(layer):
        x = x0.clone().requires_grad_()

        def step():
            y, _ = layer(x)
            y.backward(grad)

        return step

    for name, host_sync in (("layer_syncfree_host_sync", True), ("layer_syncfree_no_host_sync", False)):
        dv2.configure(host_sync=host_sync, **common)
        layer = build_moe_layer(shape, "deepepv2", seed=3, sync_free_experts=True)
        results[name] = time_op(eager(layer), args)
        if not host_sync and not args.skip_graph:
            results["layer_syncfree_graph"] = _time_layer_graph(layer, x0.clone().requires_grad_(), grad, args)
        layer = None  # free the layer (and its buffer references) before the next variant
        dv2.destroy_buffers()
    dv2.configure(host_sync=True)

    for name, overlap in (("layer_shared_serial", False), ("layer_shared_overlap", True)):
        shared = TinyMoEConfig(hidden=cfg.hidden, ffn=args.ffn, num_experts=cfg.experts, topk=cfg.topk,
                               params_dtype=torch.bfloat16,
                               extra=dict(moe_shared_expert_intermediate_size=args.shared_ffn,
                                          moe_shared_expert_overlap=overlap))
        dv2.configure(**common)
        layer = build_moe_layer(shared, "deepepv2", seed=3)
        results[name] = time_op(eager(layer), args)
        layer = None  # free the layer (and its buffer references) before the next variant
        dv2.destroy_buffers()


def bench_sm_sweep(cfg: BenchConfig, args) -> list[dict]:
    """Raw ElasticBuffer dispatch / combine (expand, BF16) per SM count; bandwidth in remote GB/s."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    x, idx, w = _bench.routed_tokens(cfg.tokens, cfg.hidden, cfg.experts, cfg.topk, seed=dist.get_rank())
    _, remote_rows = received_rows(idx, cfg)
    remote_bytes = remote_rows * cfg.hidden * 2
    out = dv2.dispatch(x, idx, w, cfg.experts, layout="expand", expert_alignment=128,
                       backend="deepep", num_max_tokens_per_rank=cfg.tokens)
    raw, extra, _ = _raw_buffer(out.handle)
    sweep = []
    for sms in args.sm_sweep:
        def dispatch():
            return raw.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=cfg.experts,
                                num_max_tokens_per_rank=cfg.tokens, expert_alignment=128, num_sms=sms,
                                do_expand=True, do_zero_padding=True, **extra)

        recv_x, _, recv_w, handle, _ = dispatch()
        y = torch.ones(recv_x.shape[0], cfg.hidden, dtype=torch.bfloat16, device="cuda")
        dispatch_us = time_op(dispatch, args)
        combine_us = time_op(lambda: raw.combine(y, handle, topk_weights=recv_w, num_sms=sms), args)
        sweep.append({"sms": sms, "dispatch_us": dispatch_us, "combine_us": combine_us,
                      "dispatch_remote_GBs": remote_bytes / dispatch_us / 1e3,
                      "combine_remote_GBs": remote_bytes / combine_us / 1e3})
        logger.info("   SMs %3d: dispatch %7.1f us %6.1f GB/s | combine %7.1f us %6.1f GB/s", sms, dispatch_us,
                    sweep[-1]["dispatch_remote_GBs"], combine_us, sweep[-1]["combine_remote_GBs"])
    dv2.destroy_buffers()
    return sweep


def sm_knee(sweep: list[dict], tolerance: float = 0.05) -> int:
    """Smallest SM count whose dispatch and combine bandwidths are both within ``tolerance`` of the best."""
    best_d = max(row["dispatch_remote_GBs"] for row in sweep)
    best_c = max(row["combine_remote_GBs"] for row in sweep)
    for row in sorted(sweep, key=lambda r: r["sms"]):
        if row["dispatch_remote_GBs"] >= (1 - tolerance) * best_d and row["combine_remote_GBs"] >= (1 - tolerance) * best_c:
            return row["sms"]
    return max(row["sms"] for row in sweep)


def summarise(cfg: BenchConfig, r: dict, peak: float) -> dict:
    s = {}
    if "raw_dispatch" in r:
        s["dispatch_logical_GBs"] = r["dispatch_logical_bytes"] / r["raw_dispatch"] / 1e3
        s["dispatch_remote_GBs"] = r["dispatch_remote_bytes"] / r["raw_dispatch"] / 1e3
        s["combine_remote_GBs"] = r["combine_remote_bytes"] / r["raw_combine"] / 1e3
        s["dispatch_fraction_of_nvlink_peak"] = s["dispatch_remote_GBs"] / peak
        s["combine_fraction_of_nvlink_peak"] = s["combine_remote_GBs"] / peak
    if "raw_fwd_bwd" in r:
        s["ops_vs_raw"] = r["ops_fwd_bwd"] / r["raw_fwd_bwd"]
    stock_paths = [r[k] for k in ("path_alltoall", "path_allgather") if k in r]
    if stock_paths and "path_deepepv2_expand" in r:
        s["path_speedup_expand_vs_best_stock"] = min(stock_paths) / r["path_deepepv2_expand"]
    stock_layers = [r[k] for k in ("layer_alltoall", "layer_allgather") if k in r]
    if stock_layers and "layer_deepepv2_expand" in r:
        s["layer_speedup_expand_vs_best_stock"] = min(stock_layers) / r["layer_deepepv2_expand"]
    if "layer_syncfree_graph" in r:
        s["no_host_sync_speedup_eager"] = r["layer_syncfree_host_sync"] / r["layer_syncfree_no_host_sync"]
        s["no_host_sync_speedup_graph"] = r["layer_syncfree_host_sync"] / r["layer_syncfree_graph"]
    if "layer_shared_overlap" in r and "raw_fwd_bwd" in r:
        hidden_us = r["layer_shared_serial"] - r["layer_shared_overlap"]
        s["shared_overlap_speedup"] = r["layer_shared_serial"] / r["layer_shared_overlap"]
        s["shared_overlap_exposed_comm_fraction"] = max(0.0, r["raw_fwd_bwd"] - hidden_us) / r["raw_fwd_bwd"]
    return s


def plot(document: dict, path: str) -> None:
    """Bars of every timed row per configuration, in ms (0: not run)."""
    rows = document["rows"]
    keys = ["path_alltoall", "path_allgather", "path_deepepv2_expand", "layer_alltoall", "layer_deepepv2_expand",
            "layer_syncfree_host_sync", "layer_syncfree_no_host_sync", "layer_syncfree_graph", "layer_shared_serial",
            "layer_shared_overlap", "ops_fwd_bwd", "raw_fwd_bwd", "reference_fwd_bwd"]
    fig, ax = _bench.new_figure(12, 5)
    _bench.grouped_bars(ax, [row["config"] for row in rows],
                        {key: [row["times_us"].get(key, 0) / 1000 for row in rows] for key in keys}, fontsize=7,
                        legend_columns=3)
    ax.set_ylabel("ms (median, forward + backward where applicable)")
    ax.set_title("deepepv2 benchmark (lower is better)")
    _bench.save_figure(fig, path)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    parser.add_argument("--experts", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--fp8", choices=["both", "on", "off"], default="both")
    parser.add_argument("--ffn", type=int, default=1024)
    parser.add_argument("--sms", type=int, default=16, help="SMs for DeepEP's kernels")
    parser.add_argument("--sm-sweep", type=int, nargs="*", default=[], metavar="SMS",
                        help="also sweep raw dispatch/combine over these SM counts (first configuration)")
    parser.add_argument("--shared-ffn", type=int, default=2048, help="shared-expert FFN size of the overlap rows")
    parser.add_argument("--skip-graph", action="store_true", help="no CUDA-graph replay row")
    parser.add_argument("--skip-features", action="store_true", help="no no-host-sync / graph / overlap rows")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--skip-layer", action="store_true")
    parser.add_argument("--skip-megatron", action="store_true")
    parser.add_argument("--quick", action="store_true", help="T4096 H4096 E64 BF16 only")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)

    with _bench.process_group("nccl") as rank:
        _bench.setup_logging(rank)
        run(args)
    return 0


def run(args: argparse.Namespace) -> None:
    """Every configuration, the Megatron rows and the SM sweep, in a process group; rank 0 writes the outputs."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import init_expert_parallel  # noqa: PLC0415

    dv2.install()
    init_expert_parallel()
    peak = nvlink_peak_gbs()
    logger.info("NVLink peer-to-peer peak (1 GiB send): %.1f GB/s", peak)
    fp8_values = {"both": (False, True), "on": (True,), "off": (False,)}[args.fp8]
    if args.quick:
        args.tokens, args.hidden, args.experts, fp8_values = [4096], [4096], [64], (False,)
    rows = []
    for tokens, hidden, experts, fp8 in itertools.product(args.tokens, args.hidden, args.experts, fp8_values):
        cfg = BenchConfig(tokens, hidden, experts, args.topk, fp8)
        logger.info("== %s", cfg.label)
        times: dict = LoggedTimes()
        bench_ops(cfg, args, times)
        not_run: dict[str, str] = {}
        if not args.skip_megatron and not fp8:
            not_run = bench_megatron(cfg, args, times)
            if not args.skip_features:
                bench_sync_free_and_overlap(cfg, args, times)
        summary = summarise(cfg, times, peak)
        rows.append({"config": cfg.label, **asdict(cfg), "sms": args.sms,
                     "times_us": {k: v for k, v in times.items() if not k.endswith("_bytes")},
                     "bytes": {k: v for k, v in times.items() if k.endswith("_bytes")}, "summary": summary,
                     "not_run": not_run})
        for key, value in summary.items():
            logger.info("   %-34s %8.3f", key, value)
    sm_sweep, knee = [], None
    if args.sm_sweep:
        first = BenchConfig(args.tokens[0], args.hidden[0], args.experts[0], args.topk, False)
        logger.info("== SM sweep on %s", first.label)
        sm_sweep = bench_sm_sweep(first, args)
        knee = sm_knee(sm_sweep)
        logger.info("   bandwidth within 5%% of the best from %d SMs on", knee)
    if dist.get_rank() == 0:
        _bench.write_outputs(args.out, "bench", {"nvlink_peak_GBs": peak, "world_size": dist.get_world_size(),
                                                 "device": torch.cuda.get_device_name(), "rows": rows,
                                                 "sm_sweep": sm_sweep, "sm_knee": knee}, plot)
    dv2.destroy_buffers()


if __name__ == "__main__":
    sys.exit(main())
