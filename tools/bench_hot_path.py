#!/usr/bin/env python3
"""The dispatch + combine hot path on one GPU (EP=1): our ops against the raw DeepEP calls, as ratios in one run.

On a 1-rank NCCL group with DeepEP's ElasticBuffer, for each configuration (tokens T, hidden H, 64 experts, top-8,
BF16) and layout (compact; expand with alignment 16 and zero padding) it times one forward + backward step --
dispatch, combine and their backwards, the input and weight gradients taken with ``torch.autograd.grad`` -- as:

* ``raw``: the four ElasticBuffer calls our ops make (dispatch with host sync, combine, the cached dispatch of the
  output gradient, the combine of the received-row gradient with the weight gradient), called directly;
* ``raw_no_host_sync``: the same with ``do_cpu_sync=False`` (worst-case sizes), for reference;
* ``raw_autograd``: the same four calls inside two minimal ``torch.autograd.Function`` classes (dispatch: forward
  ``buffer.dispatch``, backward ``buffer.combine`` of the gradient with the weights' gradient; combine: forward
  ``buffer.combine``, backward the cached ``buffer.dispatch``), each call made as Megatron's ``fused_a2a`` makes it
  (``previous_event = buffer.capture()``, then the call with ``previous_event``, ``async_with_compute_stream`` and
  ``allocate_on_comm_stream``, then ``event.current_stream_wait()``), the gradients taken as the ops' are: the
  floor any autograd wrapper of these calls pays;
* ``ops_manager``: :func:`megatron_deepepv2.dispatch` / :func:`~megatron_deepepv2.combine` with a
  :class:`~megatron_deepepv2.DispatchConfig` as the Megatron manager resolves it (:func:`manager_config`: ids valid
  by construction: no id check; other ranks' weights left unmasked; rows past the valid ones left as they are), host
  sync;
* ``ops_manager_streams``: the same with Megatron's stream flags (``async_finish=True,
  allocate_on_comm_stream=True`` on dispatch and combine): what the flex dispatcher runs;
* ``ops_defaults``: the direct-call defaults (settings resolved from the arguments, the expert-id check on);
* ``ops_no_host_sync``: the manager's configuration without host sync, eager;
* ``graph_replay``: a CUDA-graph replay of the ``ops_no_host_sync`` step;
* ``kernel_time``: the GPU time of the kernels (and copies) of one ``ops_no_host_sync`` step, summed from a
  profile (the floor a replay can reach; the profile's per-launch host cost does not enter it).

Times are wall clock per step: ``--steps`` back-to-back steps and one synchronisation, median over ``--rounds``
rounds that interleave the variants. The targets are ratios: ``ops_manager_streams / raw_autograd`` <= 1.10,
``ops_defaults / raw_autograd`` <= 1.25, ``ops_no_host_sync / ops_manager`` <= 1.00, ``graph_replay / kernel_time``
<= 1.1; ``raw`` and ``ops_manager`` are reported beside them (``ops_manager / raw``, ``raw_autograd / raw``,
``ops_manager_streams / ops_manager``), not targets.

The run starts with the host cost of the GPU's elementary operations on this machine (an eager launch, a Triton
launch, an event record, a stream wait: microseconds per call), which turns the profiles' launch counts into
microseconds. The first configuration also gets a profile of each variant (kernels per step, host microseconds to
enqueue one step) and, with megatron-core, Megatron's dispatcher path (router -> dispatch stages -> identity experts
-> combine stages, forward + backward) for alltoall and deepepv2 (the expand layout, the one Megatron layers take)
with and without host sync (a layer the package or Megatron refuses to build is listed under ``not_run`` with the
reason).
``--isolate`` first times the host cost of single DeepEP calls made raw, through the package's adapter, and from
inside an autograd backward (as the ops' backwards make them). Prints progress and writes ``bench_hot_path.json``
and ``bench_hot_path.png`` to ``--out``::

    EP_DISABLE_GIN=1 python tools/bench_hot_path.py --out bench_out [--quick]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

logger = logging.getLogger("bench_hot_path")

NAME = "bench_hot_path"
LAYOUTS = {"compact": dict(layout="compact"), "expand": dict(layout="expand", expert_alignment=16)}
#: Ratio targets: numerator / denominator <= value.
TARGETS = {"ops_manager_streams/raw_autograd": 1.10, "ops_defaults/raw_autograd": 1.25,
           "ops_no_host_sync/ops_manager": 1.00, "graph_replay/kernel_time": 1.1}
#: Ratios reported beside the targets, without a target.
REPORTED_RATIOS = ("ops_manager/raw", "raw_autograd/raw", "ops_manager_streams/ops_manager")
#: The variants of a row, in the order they are timed and plotted (``kernel_time`` comes from a profile).
VARIANTS = ("raw", "raw_no_host_sync", "raw_autograd", "ops_manager", "ops_manager_streams", "ops_defaults",
            "ops_no_host_sync", "graph_replay", "kernel_time")


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


def manager_config(layout: str, tokens: int, sms: int, host_sync: bool, backend: str = "deepep") -> Any:
    """The dispatch configuration of a Megatron layer's manager
    (:func:`megatron_deepepv2.mcore.manager.dispatch_config_for`) for the layout and the shape this tool times:
    :data:`LAYOUTS`' layout, alignment and padding, the manager's switches (:func:`_bench.megatron_manager_overrides`),
    a buffer for ``tokens`` per rank and ``sms`` SMs.

    Args:
        layout: A key of :data:`LAYOUTS` (a Megatron layer's is ``expand``).
        tokens: Tokens per rank (``num_max_tokens_per_rank``).
        sms: SMs for DeepEP's kernels (0: DeepEP's choice).
        host_sync: Whether the dispatches wait on the host for exact sizes.
        backend: The backend's name.

    Returns:
        The resolved ``DispatchConfig``.
    """
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    return dv2.resolve_config(backend=backend, num_max_tokens_per_rank=tokens, num_sms=sms, host_sync=host_sync,
                              **LAYOUTS[layout], **_bench.megatron_manager_overrides(dv2))


def _raw_buffer(handle: Any) -> tuple[Any, dict[str, Any], int]:
    """The DeepEP buffer behind one of our dispatch handles: the one place that reads the DeepEP backend's internals.

    Args:
        handle: The handle of a dispatch on the DeepEP backend.

    Returns:
        The ``ElasticBuffer``, the extra keyword arguments the backend passes to every DeepEP dispatch (those of
        the installed DeepEP line), and the SM count its dispatches use.
    """
    backend = handle.buffer
    return backend.ep_buffer, dict(backend.line.dispatch_kwargs), backend.line.num_sms(handle.config.settings.num_sms)


@dataclass(frozen=True)
class _RawCalls:
    """What the raw steps pass to ElasticBuffer besides tensors and handles.

    Attributes:
        buffer: The ``ElasticBuffer``.
        fresh: Keyword arguments of a fresh dispatch (ids, expert count, capacity, alignment, SMs, layout).
        cached: Keyword arguments of a cached dispatch (layout, and the DeepEP line's extras).
    """

    buffer: Any
    fresh: dict[str, Any]
    cached: dict[str, Any]


def _megatron_streams(buffer: Any, call: Callable[..., tuple], *args: Any, **kwargs: Any) -> list:
    """One DeepEP call as Megatron's ``fused_a2a`` makes it: on the communication stream after an event captured on
    the current one, outputs allocated there, and the current stream made to wait for it afterwards.

    Returns:
        The call's outputs without its event.
    """
    previous_event = buffer.capture()
    *outputs, event = call(*args, previous_event=previous_event, async_with_compute_stream=True,
                           allocate_on_comm_stream=True, **kwargs)
    event.current_stream_wait()
    return outputs


class _RawDispatch(torch.autograd.Function):
    """Dispatch with host sync; its backward combines the rows' gradient with the weights' gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: torch.Tensor, raw: _RawCalls):  # type: ignore[override]
        recv_x, _, recv_weights, handle = _megatron_streams(raw.buffer, raw.buffer.dispatch, x,
                                                            topk_weights=topk_weights, do_cpu_sync=True, **raw.fresh)
        ctx.raw, ctx.handle = raw, handle
        return recv_x, recv_weights, handle

    @staticmethod
    def backward(ctx: Any, grad_x: torch.Tensor, grad_weights: torch.Tensor, _grad_handle: None):  # type: ignore[override]
        buffer = ctx.raw.buffer
        grad, grad_topk_weights = _megatron_streams(buffer, buffer.combine, grad_x, ctx.handle,
                                                    topk_weights=grad_weights, num_sms=ctx.handle.num_sms)
        return grad, grad_topk_weights, None


class _RawCombine(torch.autograd.Function):
    """Combine; its backward is the cached dispatch of the output gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: Any, raw: _RawCalls) -> torch.Tensor:  # type: ignore[override]
        combined, _ = _megatron_streams(raw.buffer, raw.buffer.combine, x, handle, num_sms=handle.num_sms)
        ctx.raw, ctx.handle = raw, handle
        return combined

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        raw = ctx.raw
        grad_rows = _megatron_streams(raw.buffer, raw.buffer.dispatch, grad, handle=ctx.handle,
                                      num_sms=ctx.handle.num_sms, **raw.cached)[0]
        return grad_rows, None, None


class Steps:
    """The step functions of one configuration and layout (see the module docstring)."""

    def __init__(self, cfg: HotPathConfig, layout: str, args: argparse.Namespace) -> None:
        import megatron_deepepv2 as dv2  # noqa: PLC0415

        self.dv2, self.cfg, self.kwargs = dv2, cfg, LAYOUTS[layout]
        self.expand = layout == "expand"
        self.x, self.idx, self.w = _bench.routed_tokens(cfg.tokens, cfg.hidden, cfg.experts, cfg.topk)
        self.x_req = self.x.clone().requires_grad_()
        self.w_req = self.w.clone().requires_grad_()
        self.grad_out = torch.randn_like(self.x)
        self.direct_kwargs = dict(backend="deepep", num_max_tokens_per_rank=cfg.tokens, num_sms=args.sms,
                                  **self.kwargs)
        self.manager = manager_config(layout, cfg.tokens, args.sms, host_sync=True)
        self.no_host_sync = manager_config(layout, cfg.tokens, args.sms, host_sync=False)
        # Build the buffer and take its ElasticBuffer for the raw calls.
        first = dv2.dispatch(self.x, self.idx, self.w, cfg.experts, config=self.manager)
        buffer, extra, num_sms = _raw_buffer(first.handle)
        self.raw = _RawCalls(
            buffer,
            fresh=dict(topk_idx=self.idx, num_experts=cfg.experts, num_max_tokens_per_rank=cfg.tokens,
                       expert_alignment=self.kwargs.get("expert_alignment", 1), num_sms=num_sms,
                       do_expand=self.expand, do_zero_padding=self.expand, **extra),
            cached=dict(do_expand=self.expand, do_zero_padding=self.expand, **extra))
        self.grad_w = {config: torch.ones_like(dv2.dispatch(self.x, self.idx, self.w, cfg.experts,
                                                            config=config).recv_topk_weights)
                       for config in (self.manager, self.no_host_sync)}
        self._ones: dict[tuple[int, ...], torch.Tensor] = {}
        del first

    def ones_like(self, tensor: torch.Tensor) -> torch.Tensor:
        """A weight gradient of ones, made once per shape (as the ops' steps have theirs)."""
        ones = self._ones.get(tuple(tensor.shape))
        if ones is None:
            ones = self._ones[tuple(tensor.shape)] = torch.ones_like(tensor)
        return ones

    def ops(self, config: Optional[Any] = None, streams: bool = False) -> _bench.Step:
        """Our ops' step: with ``config`` (None: the direct-call defaults), with Megatron's stream flags or not."""
        dv2, cfg = self.dv2, self.cfg
        kwargs = {} if config is not None else self.direct_kwargs
        flags = dict(async_finish=True, allocate_on_comm_stream=True) if streams else {}
        grad_w = self.grad_w[config or self.manager]

        def step():
            res = dv2.dispatch(self.x_req, self.idx, self.w_req, cfg.experts, config=config, **kwargs, **flags)
            out = dv2.combine(res.recv_x, res.handle, **flags)
            return torch.autograd.grad((out, res.recv_topk_weights), (self.x_req, self.w_req),
                                       (self.grad_out, grad_w))

        return step

    def raw_step(self, host_sync: bool) -> _bench.Step:
        """The four ElasticBuffer calls of the ops' step, made directly."""
        raw = self.raw
        buffer = raw.buffer

        def step():
            rx, _, rw, handle, _ = buffer.dispatch(self.x, topk_weights=self.w, do_cpu_sync=host_sync, **raw.fresh)
            out = buffer.combine(rx, handle, num_sms=handle.num_sms)[0]
            grad_rows = buffer.dispatch(self.grad_out, handle=handle, num_sms=handle.num_sms, **raw.cached)[0]
            grad = buffer.combine(grad_rows, handle, topk_weights=self.ones_like(rw), num_sms=handle.num_sms)
            return out, grad

        return step

    def raw_autograd_step(self) -> _bench.Step:
        """The four ElasticBuffer calls inside two minimal autograd functions, with Megatron's stream flags."""

        def step():
            recv_x, recv_w, handle = _RawDispatch.apply(self.x_req, self.w_req, self.raw)
            out = _RawCombine.apply(recv_x, handle, self.raw)
            return torch.autograd.grad((out, recv_w), (self.x_req, self.w_req),
                                       (self.grad_out, self.ones_like(recv_w)))

        return step


def capture(step: _bench.Step) -> torch.cuda.CUDAGraph:
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


def profile(step: _bench.Step, steps: int = 5) -> dict:
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
    host = [_bench.host_us(step, 1, _bench.cuda_synchronize) for _ in range(10)]
    return {"gpu_us_per_step": sum(k["us_per_step"] for k in kernels.values()),
            "launches_per_step": sum(k["per_step"] for k in kernels.values()),
            "host_enqueue_us": statistics.median(host),
            "kernels": dict(sorted(kernels.items(), key=lambda item: -item[1]["us_per_step"]))}


def interleaved_wall_us(variants: dict[str, _bench.Step], args: argparse.Namespace) -> dict[str, float]:
    """Median wall microseconds per step of each variant: ``--steps`` steps and one synchronisation per sample,
    ``--rounds`` interleaved rounds after ``--warmup`` calls each."""
    def timer(fn: _bench.Step) -> float:
        return _bench.wall_us(fn, args.steps, _bench.cuda_synchronize)

    return _bench.medians(_bench.interleave(variants, timer, rounds=args.rounds, warmup=args.warmup))


def ratios(times: dict[str, float], names: Any) -> dict[str, float]:
    """``a / b`` of ``times`` for every name ``"a/b"`` in ``names``."""
    return {name: times[a] / times[b] for name in names for a, b in [name.split("/")]}


def bench_layout(cfg: HotPathConfig, layout: str, args: argparse.Namespace, with_profiles: bool,
                 launch_us: Optional[float] = None) -> dict:
    """Times every variant of one configuration and layout; with ``with_profiles``, profiles them too."""
    steps = Steps(cfg, layout, args)
    variants = {"raw": steps.raw_step(True), "raw_no_host_sync": steps.raw_step(False),
                "raw_autograd": steps.raw_autograd_step(), "ops_manager": steps.ops(steps.manager),
                "ops_manager_streams": steps.ops(steps.manager, streams=True), "ops_defaults": steps.ops(),
                "ops_no_host_sync": steps.ops(steps.no_host_sync)}
    graph = capture(variants["ops_no_host_sync"])
    variants["graph_replay"] = graph.replay
    times = interleaved_wall_us(variants, args)
    no_sync_profile = profile(variants["ops_no_host_sync"])
    times["kernel_time"] = no_sync_profile["gpu_us_per_step"]
    row = {"config": asdict(cfg), "label": cfg.label, "layout": layout, "times_us": times,
           "ratios": ratios(times, TARGETS), "reported_ratios": ratios(times, REPORTED_RATIOS)}
    for name in VARIANTS:
        logger.info("   %-22s %9.1f us per step", name, times[name])
    for name, value in row["ratios"].items():
        logger.info("   %-34s %6.3f (target <= %.2f)%s", name, value, TARGETS[name],
                    "" if value <= TARGETS[name] else "  MISSED")
    for name, value in row["reported_ratios"].items():
        logger.info("   %-34s %6.3f", name, value)
    if with_profiles:
        row["profiles"] = {"ops_no_host_sync": no_sync_profile}
        for name in ("raw", "raw_no_host_sync", "raw_autograd", "ops_manager", "ops_manager_streams", "ops_defaults"):
            row["profiles"][name] = profile(variants[name])
        for name, prof in row["profiles"].items():
            launches = (f" (~{prof['launches_per_step'] * launch_us:.0f} us of bare launches)"
                        if launch_us is not None else "")
            logger.info("   profile %-20s %5.1f launches%s, GPU %7.1f us, host enqueue %7.1f us per step", name,
                        prof["launches_per_step"], launches, prof["gpu_us_per_step"], prof["host_enqueue_us"])
            for kernel, stats in list(prof["kernels"].items())[:14]:
                logger.info("      %5.1f x %8.1f us  %s", stats["per_step"], stats["us_per_step"], kernel)
    dv2 = steps.dv2
    del graph, variants, steps
    dv2.destroy_buffers()
    return row


class _RunInBackward(torch.autograd.Function):
    """Identity whose backward calls a function: a call made from the autograd engine, as the ops' backwards are."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, fn: _bench.Step) -> torch.Tensor:  # type: ignore[override]
        ctx.fn = fn
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.fn()
        return grad, None


def _adapter_calls(steps: Steps, ours: Any) -> dict[str, _bench.Step]:
    """Single calls through the DeepEP backend's contract (the package's adapter), as the ops make them."""
    handle = ours.handle
    backend = handle.buffer
    return {
        "adapter_dispatch_host_sync": lambda: backend.dispatch(steps.x, steps.idx, steps.w, handle.config,
                                                               steps.cfg.experts),
        "adapter_cached_dispatch": lambda: backend.cached_dispatch(steps.grad_out, handle),
        "adapter_combine": lambda: backend.combine(ours.recv_x, handle),
    }


def isolate_calls(cfg: HotPathConfig, layout: str, args: argparse.Namespace) -> dict[str, float]:
    """Host microseconds per single DeepEP call: made raw, through the package's adapter, and from inside an autograd
    backward, each against the same call's other forms (where the ops' host time over the raw calls comes from)."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    steps = Steps(cfg, layout, args)
    raw = steps.raw
    ours = dv2.dispatch(steps.x, steps.idx, steps.w, cfg.experts, config=steps.manager)
    leaf = torch.zeros(1, device="cuda", requires_grad=True)

    def raw_dispatch_host_sync():
        return raw.buffer.dispatch(steps.x, topk_weights=steps.w, do_cpu_sync=True, **raw.fresh)

    recv_x, _, _, handle, _ = raw_dispatch_host_sync()

    def raw_cached_dispatch():
        return raw.buffer.dispatch(steps.grad_out, handle=handle, num_sms=handle.num_sms, **raw.cached)

    def raw_combine():
        return raw.buffer.combine(recv_x, handle, num_sms=handle.num_sms)

    def in_backward(fn: _bench.Step) -> _bench.Step:
        return lambda: torch.autograd.grad(_RunInBackward.apply(leaf, fn), leaf, torch.ones_like(leaf))

    adapter = _adapter_calls(steps, ours)
    variants = {
        "raw_dispatch_host_sync": raw_dispatch_host_sync,
        "adapter_dispatch_host_sync": adapter["adapter_dispatch_host_sync"],
        "ops_dispatch_host_sync": lambda: dv2.dispatch(steps.x, steps.idx, steps.w, cfg.experts, config=steps.manager),
        "raw_cached_dispatch": raw_cached_dispatch,
        "adapter_cached_dispatch": adapter["adapter_cached_dispatch"],
        "raw_combine": raw_combine,
        "adapter_combine": adapter["adapter_combine"],
        "backward_nothing": in_backward(lambda: None),
        "backward_raw_cached_dispatch": in_backward(raw_cached_dispatch),
        "backward_raw_combine": in_backward(raw_combine),
    }

    def timer(fn: _bench.Step) -> float:
        return _bench.host_us(fn, 50, _bench.cuda_synchronize)

    times = _bench.medians(_bench.interleave(variants, timer, rounds=args.rounds, warmup=args.warmup))
    for name, value in times.items():
        logger.info("   %-32s %8.1f us host per call", name, value)
    del steps, ours, variants, adapter, handle, recv_x
    dv2.destroy_buffers()
    return times


def bench_dispatcher_paths(cfg: HotPathConfig, args: argparse.Namespace) -> dict[str, Any]:
    """Megatron's dispatcher path (identity experts), forward + backward, wall clock: alltoall against deepepv2 (the
    expand layout) with and without host sync.

    Returns:
        Microseconds per step by row, and under ``not_run`` the rows whose layer Megatron or the package refused
        to build, with the reason.
    """
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing import moe_model  # noqa: PLC0415

    dv2.install()  # --moe-flex-dispatcher-backend deepepv2
    shape = moe_model.TinyMoEConfig(hidden=cfg.hidden, ffn=1024, num_experts=cfg.experts, topk=cfg.topk,
                                    params_dtype=torch.bfloat16)
    x = torch.randn(cfg.tokens, 1, cfg.hidden, device="cuda").to(torch.bfloat16).requires_grad_()
    variants = {"path_alltoall": ("alltoall", True), "path_deepepv2_expand": ("deepepv2", True),
                "path_deepepv2_expand_no_host_sync": ("deepepv2", False)}
    steps: dict[str, _bench.Step] = {}
    not_run: dict[str, str] = {}
    for name, (dispatcher, host_sync) in variants.items():
        if dispatcher == "deepepv2":
            dv2.configure(backend="deepep", num_sms=args.sms, num_max_tokens_per_rank=cfg.tokens, host_sync=host_sync)
        layer = _bench.build_or_reason(
            name, lambda: moe_model.build_moe_layer(shape, dispatcher, seed=3, sync_free_experts=not host_sync),
            not_run)
        if layer is None:
            continue
        steps[name] = (lambda layer_=layer: moe_model.dispatcher_path_step(layer_, x))
    times: dict[str, Any] = interleaved_wall_us(steps, args)
    dv2.configure(host_sync=True)
    for name, value in times.items():
        logger.info("   %-36s %8.1f us (%.2fx alltoall)", name, value, value / times["path_alltoall"])
    steps = {}
    dv2.destroy_buffers()
    return {**times, "not_run": not_run} if not_run else times


def plot(result: dict, path: str) -> None:
    """Bars of every variant's time per row (configuration x layout)."""
    rows = result["rows"]
    fig, ax = _bench.new_figure(max(8, 1.8 * len(rows)), 5)
    _bench.grouped_bars(ax, [f"{row['label']}\n{row['layout']}" for row in rows],
                        {key: [row["times_us"][key] for row in rows] for key in VARIANTS if key != "raw_no_host_sync"},
                        fontsize=7, legend_columns=3)
    ax.set_ylabel("us per forward + backward step (wall clock)")
    ax.set_title("dispatch + combine on one H200, EP=1: our ops vs raw ElasticBuffer (lower is better)")
    _bench.save_figure(fig, path)


def _parse(argv: Optional[list[str]]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    return parser, parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    parser, args = _parse(argv)
    _bench.setup_logging()
    _bench.require_cuda(parser, "a CUDA GPU with DeepEP (python -m megatron_deepepv2.cli.doctor says what is missing)")
    configs = [HotPathConfig(*map(int, text.split("x"))) for text in args.configs]
    if args.quick:
        configs, args.rounds = configs[:1], 3
    with _bench.process_group("nccl"):
        result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ep": 1,
                                  "targets": TARGETS, "rows": [], "dispatcher_paths": None}

        def save() -> None:
            _bench.write_outputs(args.out, NAME, result, plot)

        logger.info("== host cost of the GPU's elementary operations")
        result["launch_costs_us"] = _bench.launch_costs_us()
        for name, value in result["launch_costs_us"].items():
            logger.info("   %-22s %6.2f us host per call", name, value)
        if args.isolate:
            logger.info("== single calls, %s %s", configs[0].label, args.layouts[0])
            result["isolated_calls_us"] = isolate_calls(configs[0], args.layouts[0], args)
            save()
        for index, cfg in enumerate(configs):
            for layout in args.layouts:
                logger.info("== %s %s", cfg.label, layout)
                result["rows"].append(bench_layout(cfg, layout, args, with_profiles=index == 0,
                                                   launch_us=result["launch_costs_us"]["eager_launch"]))
                save()
        if not args.skip_megatron:
            logger.info("== Megatron dispatcher path, %s", configs[0].label)
            result["dispatcher_paths"] = bench_dispatcher_paths(configs[0], args)
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
