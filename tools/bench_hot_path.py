#!/usr/bin/env python3
"""The dispatch + combine hot path on one GPU (EP=1): our ops against the raw DeepEP calls, as ratios in one run.

On a 1-rank NCCL group with DeepEP's ElasticBuffer, for each configuration (tokens T, hidden H, 64 experts, top-8,
BF16) and layout (compact; expand with alignment 16 and zero padding) it times one forward + backward step --
dispatch, combine and their backwards, the input and weight gradients taken with ``torch.autograd.grad`` -- as:

* ``raw``: the four ElasticBuffer calls our ops make (dispatch with host sync, combine, the cached dispatch of the
  output gradient, the combine of the received-row gradient with the weight gradient), called directly;
* ``raw_no_host_sync``: the same with ``do_cpu_sync=False`` (worst-case sizes), for reference;
* ``ops_manager``: :func:`megatron_deepepv2.dispatch` / :func:`~megatron_deepepv2.combine` with a
  :class:`~megatron_deepepv2.ops.DispatchConfig` as the Megatron manager resolves it (ids valid by construction:
  no id check; other ranks' weights left unmasked), host sync;
* ``ops_defaults``: the direct-call defaults (settings resolved from the arguments, the expert-id check on);
* ``ops_no_host_sync``: the manager's configuration without host sync, eager;
* ``graph_replay``: a CUDA-graph replay of the ``ops_no_host_sync`` step;
* ``kernel_time``: the GPU time of the kernels (and copies) of one ``ops_no_host_sync`` step, summed from a
  profile (the floor a replay can reach; the profile's per-launch host cost does not enter it).

Times are wall clock per step: ``--steps`` back-to-back steps and one synchronisation, median over ``--rounds``
rounds that interleave the variants. The targets are ratios: ``ops_manager / raw`` <= 1.2, ``ops_defaults / raw``
<= 1.35, ``ops_no_host_sync / ops_manager`` <= 1.05, ``graph_replay / kernel_time`` <= 1.1. The first
configuration also gets a profile of each variant (kernels per step, host microseconds to enqueue one step) and,
with megatron-core, Megatron's dispatcher path (router -> dispatch stages -> identity experts -> combine stages,
forward + backward) for alltoall and deepepv2. ``--isolate`` first times the host cost of single DeepEP calls made
raw, through the package's adapter, and from inside an autograd backward (as the ops' backwards make them). Prints
progress and writes ``bench_hot_path.json`` and ``bench_hot_path.png`` to ``--out``::

    EP_DISABLE_GIN=1 python tools/bench_hot_path.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

logger = logging.getLogger("bench_hot_path")

LAYOUTS = {"compact": dict(layout="compact"), "expand": dict(layout="expand", expert_alignment=16, zero_padding=True)}
TARGETS = {"ops_manager/raw": 1.2, "ops_defaults/raw": 1.35, "ops_no_host_sync/ops_manager": 1.05,
           "graph_replay/kernel_time": 1.1}


@dataclass(frozen=True)
class HotPathConfig:
    """One configuration: tokens per rank, hidden size, experts, top-k."""

    tokens: int
    hidden: int
    experts: int = 64
    topk: int = 8

    @property
    def label(self) -> str:
        return f"T{self.tokens} H{self.hidden} E{self.experts} top{self.topk}"


def make_inputs(cfg: HotPathConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """BF16 hidden states, top-k expert ids (distinct per token) and fp32 weights on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(cfg.tokens, cfg.hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, idx = torch.rand(cfg.tokens, cfg.experts, device="cuda", generator=gen).topk(cfg.topk, dim=1)
    return x, idx.contiguous(), weights.float().contiguous()


class Steps:
    """The step functions of one configuration and layout (see the module docstring)."""

    def __init__(self, cfg: HotPathConfig, layout: str, args: argparse.Namespace) -> None:
        import megatron_deepepv2 as dv2  # noqa: PLC0415
        from megatron_deepepv2.ops import DispatchConfig  # noqa: PLC0415

        self.dv2, self.cfg, self.kwargs = dv2, cfg, LAYOUTS[layout]
        self.expand = layout == "expand"
        self.x, self.idx, self.w = make_inputs(cfg)
        self.x_req = self.x.clone().requires_grad_()
        self.w_req = self.w.clone().requires_grad_()
        self.grad_out = torch.randn_like(self.x)
        capacity = cfg.tokens
        common = dict(backend="deepep", num_max_tokens_per_rank=capacity, num_sms=args.sms, **self.kwargs)
        self.direct_kwargs = common
        self.manager = DispatchConfig.resolve(check_ids=False, mask_foreign_weights=False, host_sync=True, **common)
        self.no_host_sync = DispatchConfig.resolve(check_ids=False, mask_foreign_weights=False, host_sync=False,
                                                   **common)
        # Build the buffer and take its ElasticBuffer for the raw calls.
        first = dv2.dispatch(self.x, self.idx, self.w, cfg.experts, config=self.manager)
        backend = first.handle.backend
        self.raw, self.raw_kwargs, self.num_sms = backend.buffer, dict(backend._dispatch_kwargs), backend.num_sms
        self.grad_w = {config: torch.ones_like(dv2.dispatch(self.x, self.idx, self.w, cfg.experts,
                                                            config=config).recv_topk_weights)
                       for config in (self.manager, self.no_host_sync)}
        del first

    def ops(self, config=None) -> Callable[[], object]:
        dv2, cfg = self.dv2, self.cfg
        kwargs = {} if config is not None else self.direct_kwargs
        grad_w = self.grad_w[config or self.manager]

        def step():
            res = dv2.dispatch(self.x_req, self.idx, self.w_req, cfg.experts, config=config, **kwargs)
            out = dv2.combine(res.recv_x, res.handle)
            return torch.autograd.grad((out, res.recv_topk_weights), (self.x_req, self.w_req),
                                       (self.grad_out, grad_w))

        return step

    def raw_step(self, host_sync: bool) -> Callable[[], object]:
        raw, cfg, expand = self.raw, self.cfg, self.expand
        ones: dict[tuple, torch.Tensor] = {}  # the weight gradient, made once per shape (as the ops' step has it)

        def step():
            rx, _, rw, handle, _ = raw.dispatch(
                self.x, topk_idx=self.idx, topk_weights=self.w, num_experts=cfg.experts,
                num_max_tokens_per_rank=cfg.tokens, expert_alignment=self.kwargs.get("expert_alignment", 1),
                num_sms=self.num_sms, do_expand=expand, do_zero_padding=expand, do_cpu_sync=host_sync,
                **self.raw_kwargs)
            out = raw.combine(rx, handle, num_sms=handle.num_sms)[0]
            grad_rows = raw.dispatch(self.grad_out, handle=handle, num_sms=handle.num_sms, do_expand=expand,
                                     do_zero_padding=expand, **self.raw_kwargs)[0]
            grad_w = ones.get(tuple(rw.shape))
            if grad_w is None:
                grad_w = ones[tuple(rw.shape)] = torch.ones_like(rw)
            grad = raw.combine(grad_rows, handle, topk_weights=grad_w, num_sms=handle.num_sms)
            return out, grad

        return step


def wall_us(fn: Callable[[], object], steps: int) -> float:
    """Wall-clock microseconds per step of ``steps`` back-to-back calls, synchronised once at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def interleaved(variants: dict[str, Callable[[], object]], args: argparse.Namespace,
                timer: Optional[Callable[[Callable[[], object]], float]] = None) -> dict[str, float]:
    """Median over rounds of each variant's time (``timer``, default: wall time per step of ``--steps`` steps), the
    variants interleaved round by round."""
    timer = timer or (lambda fn: wall_us(fn, args.steps))
    for fn in variants.values():
        for _ in range(args.warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            samples[name].append(timer(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def capture(step: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``step`` after a side-stream warm-up."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    return graph


def profile(step: Callable[[], object], steps: int = 5) -> dict:
    """GPU time per step (kernels, copies, sets), the kernels per step by name, and the host time to enqueue a step."""
    from torch.profiler import ProfilerActivity  # noqa: PLC0415
    from torch.profiler import profile as torch_profile  # noqa: PLC0415

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.key_averages():
        if event.self_device_time_total > 0:
            kernels[event.key[:90]] = {"per_step": event.count / steps,
                                       "us_per_step": event.self_device_time_total / steps}
    # Host time to enqueue one step, outside the profiler (which adds its own cost per launch).
    host = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return {"gpu_us_per_step": sum(k["us_per_step"] for k in kernels.values()),
            "launches_per_step": sum(k["per_step"] for k in kernels.values()),
            "host_enqueue_us": statistics.median(host),
            "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["us_per_step"]))}


def bench_layout(cfg: HotPathConfig, layout: str, args: argparse.Namespace, with_profiles: bool) -> dict:
    steps = Steps(cfg, layout, args)
    variants = {"raw": steps.raw_step(True), "raw_no_host_sync": steps.raw_step(False),
                "ops_manager": steps.ops(steps.manager), "ops_defaults": steps.ops(),
                "ops_no_host_sync": steps.ops(steps.no_host_sync)}
    graph = capture(variants["ops_no_host_sync"])
    variants["graph_replay"] = graph.replay
    times = interleaved(variants, args)
    no_sync_profile = profile(variants["ops_no_host_sync"])
    times["kernel_time"] = no_sync_profile["gpu_us_per_step"]
    row = {"config": asdict(cfg), "label": cfg.label, "layout": layout, "times_us": times,
           "ratios": {name: times[a] / times[b] for name in TARGETS for a, b in [name.split("/")]}}
    for name, value in row["ratios"].items():
        logger.info("   %-30s %6.3f (target <= %.2f)%s", name, value, TARGETS[name],
                    "" if value <= TARGETS[name] else "  MISSED")
    if with_profiles:
        row["profiles"] = {"ops_no_host_sync": no_sync_profile}
        for name in ("raw", "raw_no_host_sync", "ops_manager", "ops_defaults"):
            row["profiles"][name] = profile(variants[name])
        for name, prof in row["profiles"].items():
            logger.info("   profile %-18s %5.1f launches, GPU %7.1f us, host enqueue %7.1f us per step", name,
                        prof["launches_per_step"], prof["gpu_us_per_step"], prof["host_enqueue_us"])
            for kernel, stats in list(prof["kernels"].items())[:14]:
                logger.info("      %5.1f x %8.1f us  %s", stats["per_step"], stats["us_per_step"], kernel)
    del graph, variants, steps
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    dv2.destroy_buffers()
    return row


def host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host microseconds per call to enqueue ``calls`` back-to-back calls (timed before the final synchronisation)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward calls a function: a call made from the autograd engine, as the ops' backwards are."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, fn: Callable[[], object]) -> torch.Tensor:  # type: ignore[override]
        ctx.fn = fn
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.fn()
        return grad, None


def isolate_calls(cfg: HotPathConfig, layout: str, args: argparse.Namespace) -> dict[str, float]:
    """Host microseconds per single DeepEP call: made raw, through the package's adapter, and from inside an autograd
    backward, each against the same call's other forms (where the ops' host time over the raw calls comes from)."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    steps = Steps(cfg, layout, args)
    raw, expand, kwargs = steps.raw, steps.expand, steps.raw_kwargs
    ours = dv2.dispatch(steps.x, steps.idx, steps.w, cfg.experts, config=steps.manager)
    backend, handle = ours.handle.backend, ours.handle.native
    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    def raw_dispatch_host_sync():
        return raw.dispatch(steps.x, topk_idx=steps.idx, topk_weights=steps.w, num_experts=cfg.experts,
                            num_max_tokens_per_rank=cfg.tokens, expert_alignment=steps.manager.expert_alignment,
                            num_sms=steps.num_sms, do_expand=expand, do_zero_padding=expand, do_cpu_sync=True, **kwargs)

    def raw_cached_dispatch():
        return raw.dispatch(steps.grad_out, handle=handle, num_sms=handle.num_sms, do_expand=expand,
                            do_zero_padding=expand, **kwargs)

    def raw_combine():
        return raw.combine(ours.recv_x, handle, num_sms=handle.num_sms)

    def in_backward(fn: Callable[[], object]) -> Callable[[], object]:
        return lambda: torch.autograd.grad(_RunInBackward.apply(leaf, fn), leaf, torch.ones_like(leaf))

    variants = {
        "raw_dispatch_host_sync": raw_dispatch_host_sync,
        "adapter_dispatch_host_sync": lambda: backend.dispatch(
            steps.x, steps.idx, steps.w, num_experts=cfg.experts, layout=steps.manager.layout,
            expert_alignment=steps.manager.expert_alignment, zero_padding=steps.manager.zero_padding),
        "ops_dispatch_host_sync": lambda: dv2.dispatch(steps.x, steps.idx, steps.w, cfg.experts, config=steps.manager),
        "raw_cached_dispatch": raw_cached_dispatch,
        "adapter_cached_dispatch": lambda: backend.cached_dispatch(steps.grad_out, ours.handle),
        "raw_combine": raw_combine,
        "adapter_combine": lambda: backend.combine(ours.recv_x, ours.handle),
        "backward_nothing": in_backward(lambda: None),
        "backward_raw_cached_dispatch": in_backward(raw_cached_dispatch),
        "backward_raw_combine": in_backward(raw_combine),
    }
    times = interleaved(variants, args, timer=host_us)
    for name, value in times.items():
        logger.info("   %-32s %8.1f us host per call", name, value)
    del steps, ours, variants
    dv2.destroy_buffers()
    return times


def bench_dispatcher_paths(cfg: HotPathConfig, args: argparse.Namespace) -> dict[str, float]:
    """Megatron's dispatcher path (identity experts), forward + backward, for alltoall and deepepv2, wall clock."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing import moe_model  # noqa: PLC0415

    dv2.install()  # --moe-flex-dispatcher-backend deepepv2
    shape = moe_model.TinyMoEConfig(hidden=cfg.hidden, ffn=1024, num_experts=cfg.experts, topk=cfg.topk,
                          params_dtype=torch.bfloat16)
    x = torch.randn(cfg.tokens, 1, cfg.hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    variants = {"path_alltoall": ("alltoall", None, False), "path_deepepv2_expand": ("deepepv2", "expand", False),
                "path_deepepv2_compact": ("deepepv2", "compact", False),
                "path_deepepv2_expand_no_host_sync": ("deepepv2", "expand", True)}
    steps = {}
    for name, (dispatcher, layout, no_host_sync) in variants.items():
        if layout:
            dv2.configure(layout=layout, backend="deepep", num_sms=args.sms, num_max_tokens_per_rank=cfg.tokens,
                          no_host_sync=no_host_sync)
        layer = moe_model.build_moe_layer(shape, dispatcher, seed=3, sync_free_experts=no_host_sync)
        steps[name] = (lambda layer_=layer: moe_model.dispatcher_path_step(layer_, x))
    times = interleaved(steps, args)
    dv2.configure(no_host_sync=False)
    for name, value in times.items():
        logger.info("   %-36s %8.1f us (%.2fx alltoall)", name, value, value / times["path_alltoall"])
    steps = None
    dv2.destroy_buffers()
    return times


def plot(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    keys = ["raw", "ops_manager", "ops_defaults", "ops_no_host_sync", "graph_replay", "kernel_time"]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(rows)), 5))
    width = 0.8 / len(keys)
    for k, key in enumerate(keys):
        ax.bar([i + k * width for i in range(len(rows))], [row["times_us"][key] for row in rows], width, label=key)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))],
                  [f"{row['label']}\n{row['layout']}" for row in rows], fontsize=7)
    ax.set_ylabel("us per forward + backward step (wall clock)")
    ax.set_title("dispatch + combine on one H200, EP=1: our ops vs raw ElasticBuffer (lower is better)")
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_outputs(result: dict, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_hot_path.json"), "w") as f:
        json.dump(result, f, indent=1)
    logger.info("wrote %s/bench_hot_path.json", out)
    try:
        plot(result["rows"], os.path.join(out, "bench_hot_path.png"))
        logger.info("wrote %s/bench_hot_path.png", out)
    except ImportError as error:
        logger.warning("no plot: %s. pip install 'megatron-deepepv2[bench]' (matplotlib) for it.", error)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["4096x4096", "1024x4096", "16384x4096", "4096x7168"],
                        metavar="TxH", help="tokens x hidden (64 experts, top-8)")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--sms", type=int, default=0, help="SMs for DeepEP's kernels (0: DeepEP's choice)")
    parser.add_argument("--steps", type=int, default=20, help="back-to-back steps per timed sample")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--skip-megatron", action="store_true", help="no dispatcher-path rows")
    parser.add_argument("--quick", action="store_true", help="first configuration only, fewer rounds")
    parser.add_argument("--isolate", action="store_true",  # the first layout of --layouts
                        help="first, the host time of single DeepEP calls: raw, through the adapter, in a backward")
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU with DeepEP (python -m megatron_deepepv2.doctor says what is missing)")
    configs = [HotPathConfig(*map(int, text.split("x"))) for text in args.configs]
    if args.quick:
        configs, args.rounds = configs[:1], 3
    from megatron_deepepv2._dist import free_port  # noqa: PLC0415

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ep": 1, "targets": TARGETS,
              "rows": [], "dispatcher_paths": None}
    try:
        if args.isolate:
            logger.info("== single calls, %s %s", configs[0].label, args.layouts[0])
            result["isolated_calls_us"] = isolate_calls(configs[0], args.layouts[0], args)
            write_outputs(result, args.out)
        for index, cfg in enumerate(configs):
            for layout in args.layouts:
                logger.info("== %s %s", cfg.label, layout)
                result["rows"].append(bench_layout(cfg, layout, args, with_profiles=index == 0))
                write_outputs(result, args.out)
        if not args.skip_megatron:
            logger.info("== Megatron dispatcher path, %s", configs[0].label)
            result["dispatcher_paths"] = bench_dispatcher_paths(configs[0], args)
            write_outputs(result, args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
