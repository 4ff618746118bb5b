#!/usr/bin/env python3
"""Every MoE dispatcher side by side, on Megatron MoE layers shaped like popular models' (one run, one machine).

Per model shape and tokens per rank, each dispatcher variant builds the same megatron-core ``MoELayer`` (same
seed, so the same weights and routing) and reports:

* ``path_us``: the dispatcher path alone (router, dispatch stages, identity experts, combine stages), forward +
  backward, median, slowest rank;
* ``layer_us``: the whole layer forward + backward (``SequentialMLP`` experts; ``SyncFreeSequentialMLP`` for the
  deepepv2 rows that say so; the graph row is a CUDA-graph replay of it);
* ``peak_mib``: peak GPU memory of the layer steps above the layer's weights and buffers (CUDA only);
* ``max_rel_diff``: the layer output against Megatron's ``alltoall`` on the same input, relative to its largest
  magnitude (``matches`` when within the tolerance of the dtype), so that a fast row is also a right one.

Variants: Megatron's ``alltoall`` and ``allgather``; ``flex`` with ``deepep`` (DeepEP's v1 ``Buffer``) and
``hybridep`` where megatron-core finds them (otherwise the row says why not); ``flex`` + ``deepepv2`` (the expand
layout, the one Megatron layers take) with host sync, without host sync, and as a CUDA-graph replay. On GPUs deepepv2 runs on
ElasticBuffer (DeepEP v2); with ``--cpu`` (2 gloo processes, a smoke run of the tool itself) on the reference
backend, in FP32, without the graph row.

Prints progress, writes ``compare_dispatchers.json``, ``compare_dispatchers.png`` and ``compare_dispatchers.md``
(the tables, with each deepepv2 row's ratio against the best non-deepepv2 dispatcher) to ``--out``::

    EP_DISABLE_GIN=1 torchrun --nproc-per-node 2 tools/compare_dispatchers.py --out bench_out   # or 1 GPU: EP=1
    python tools/compare_dispatchers.py --cpu --models tiny --tokens 64 --out bench_out
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

logger = logging.getLogger("compare_dispatchers")


@dataclass(frozen=True)
class ModelShape:
    """A model's MoE layer: hidden size, routed experts, top-k, expert FFN size."""

    hidden: int
    experts: int
    topk: int
    ffn: int


MODELS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(hidden=7168, experts=256, topk=8, ffn=2048),
    "qwen3-30b-a3b": ModelShape(hidden=2048, experts=128, topk=8, ffn=768),
    "mixtral-8x7b": ModelShape(hidden=4096, experts=8, topk=2, ffn=14336),
    "tiny": ModelShape(hidden=64, experts=8, topk=2, ffn=64),  # the CPU smoke shape
}


@dataclass(frozen=True)
class Variant:
    """One dispatcher configuration.

    Attributes:
        name: Row name.
        dispatcher: What :func:`~megatron_deepepv2.testing.moe_model.build_moe_layer` takes (``alltoall``,
            ``allgather`` or a flex backend name).
        layout: deepepv2 receive layout, None for the other dispatchers.
        no_host_sync: deepepv2 without host sync (with ``SyncFreeSequentialMLP`` experts).
        graph: Time a CUDA-graph replay of the layer step (needs ``no_host_sync``).
        needs: The ``megatron.core.transformer.moe.fused_a2a`` flag the dispatcher needs, if any.
    """

    name: str
    dispatcher: str
    layout: Optional[str] = None
    no_host_sync: bool = False
    graph: bool = False
    needs: Optional[str] = None


VARIANTS = [
    Variant("alltoall", "alltoall"),
    Variant("allgather", "allgather"),
    Variant("flex-deepep-v1", "deepep", needs="HAVE_DEEP_EP"),
    Variant("flex-hybridep", "hybridep", needs="HAVE_HYBRIDEP"),
    Variant("deepepv2-expand", "deepepv2", "expand"),
    Variant("deepepv2-expand-no-host-sync", "deepepv2", "expand", no_host_sync=True),
    Variant("deepepv2-expand-graph", "deepepv2", "expand", no_host_sync=True, graph=True),
]


def unavailable_reason(variant: Variant, cuda: bool) -> Optional[str]:
    """Why ``variant`` cannot run in this process, or None."""
    if variant.needs is not None:
        from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

        if not getattr(fused_a2a, variant.needs, False):
            return f"megatron-core's fused_a2a.{variant.needs} is False here (the backend's package is not installed)"
        if not cuda:
            return "needs CUDA GPUs"
    if variant.graph and not cuda:
        return "CUDA-graph replay needs CUDA GPUs"
    return None


def _build_layer(variant: Variant, model: ModelShape, max_tokens: int, args: argparse.Namespace, cuda: bool):
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer  # noqa: PLC0415

    if variant.dispatcher == "deepepv2":
        dv2.configure(backend="deepep" if cuda else "reference", layout=variant.layout,
                      no_host_sync=variant.no_host_sync, num_max_tokens_per_rank=max_tokens,
                      num_sms=args.sms if cuda else 0)
    shape = TinyMoEConfig(hidden=model.hidden, ffn=model.ffn, num_experts=model.experts, topk=model.topk,
                          params_dtype=torch.bfloat16 if cuda else torch.float32)
    return build_moe_layer(shape, variant.dispatcher, seed=11, sync_free_experts=variant.no_host_sync)


def measure_variant(variant: Variant, model: ModelShape, tokens_list: list[int], references: dict[int, torch.Tensor],
                    args: argparse.Namespace, cuda: bool) -> list[dict]:
    """Builds the layer of ``variant`` once and times it at every token count.

    Args:
        variant: The dispatcher configuration.
        model: Layer shape.
        tokens_list: Tokens per rank to measure.
        references: Per token count, the ``alltoall`` layer output on this rank's input (filled in by the
            ``alltoall`` variant, which runs first).
        args: ``--iters``, ``--warmup``, ``--sms``.
        cuda: GPUs (BF16; ElasticBuffer for deepepv2) or CPU (FP32; reference backend).

    Returns:
        One row per token count. A layer Megatron refuses to build (the same on every rank) gives rows that say why.
    """
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import capture_layer_step, dispatcher_path_step, layer_step  # noqa: PLC0415

    try:
        layer = _build_layer(variant, model, max(tokens_list), args, cuda)
    except Exception as error:  # noqa: BLE001 - a configuration Megatron rejects: recorded, the run goes on
        dv2.configure(no_host_sync=False)
        return [{"variant": variant.name, "tokens": tokens, "unavailable": f"build failed: {type(error).__name__}: "
                 f"{str(error).splitlines()[0] if str(error) else ''}"} for tokens in tokens_list]
    dtype = next(layer.parameters()).dtype
    device = next(layer.parameters()).device

    def time_call(fn: _bench.Step) -> float:
        return _bench.median_us(fn, args.iters, args.warmup, cuda=cuda)

    rows = []
    for tokens in tokens_list:
        gen = torch.Generator().manual_seed(1000 * tokens + dist.get_rank())
        x = torch.randn(tokens, 1, model.hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        grad = torch.ones_like(x)
        row: dict = {"variant": variant.name, "tokens": tokens}
        layer.zero_grad(set_to_none=True)  # the peak is measured above the weights alone, at every token count
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        if not variant.graph:
            row["path_us"] = time_call(lambda: dispatcher_path_step(layer, x))
            row["layer_us"] = time_call(lambda: layer_step(layer, x, grad))
            output = layer_step(layer, x, grad).detach()
        else:
            graph, static_output = capture_layer_step(layer, x, grad)
            row["layer_us"] = time_call(graph.replay)
            graph.replay()
            output = static_output.detach().clone()
            del graph
        if cuda:
            torch.cuda.synchronize()
            row["peak_mib"] = _bench.max_over_ranks((torch.cuda.max_memory_allocated() - before) / 2**20, cuda)
        if variant.dispatcher == "alltoall":
            references[tokens] = output
        elif tokens in references:
            reference = references[tokens]
            scale = float(reference.float().abs().max()) or 1.0
            row["max_rel_diff"] = _bench.max_over_ranks(
                float((output.float() - reference.float()).abs().max()) / scale, cuda)
            row["matches"] = row["max_rel_diff"] <= (5e-2 if dtype == torch.bfloat16 else 1e-4)
        rows.append(row)
        logger.info("   %-30s T%-6d %s", variant.name, tokens, ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            if k not in ("variant", "tokens")))
    del layer
    dv2.destroy_buffers()
    dv2.configure(no_host_sync=False)
    return rows


def compare(args: argparse.Namespace, cuda: bool,
            after_model: Optional[Callable[[list[dict]], None]] = None) -> list[dict]:
    """All rows, models x variants x tokens (in an initialised process group with Megatron's EP state).

    ``after_model`` gets the rows so far after each model (the outputs are rewritten then, so that a run cut short
    keeps what it measured).
    """
    rows = []
    variants = [v for v in VARIANTS if args.variants is None or v.name in args.variants or v.name == "alltoall"]
    for model_name in args.models:
        model = MODELS[model_name]
        logger.info("== %s (hidden %d, %d experts, top-%d, FFN %d), tokens per rank %s", model_name, model.hidden,
                    model.experts, model.topk, model.ffn, args.tokens)
        base = {"model": model_name, **asdict(model)}
        references: dict[int, torch.Tensor] = {}
        for variant in variants:
            reason = unavailable_reason(variant, cuda)
            if reason is not None:
                logger.info("   %-30s not run: %s", variant.name, reason)
                measured = [{"variant": variant.name, "tokens": t, "unavailable": reason} for t in args.tokens]
            else:
                measured = measure_variant(variant, model, args.tokens, references, args, cuda)
            rows += [{**base, **row} for row in measured]
        if after_model is not None:
            after_model(rows)
    return rows


def markdown(rows: list[dict]) -> str:
    """The tables: one per (model, tokens), deepepv2 rows with their ratio against the best other dispatcher."""
    lines = []
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["tokens"]), []).append(row)
    for (model, tokens), group in groups.items():
        others = [r for r in group if "layer_us" in r and not r["variant"].startswith("deepepv2")]
        best_path = min((r["path_us"] for r in others if "path_us" in r), default=None)
        best_layer = min((r["layer_us"] for r in others), default=None)
        lines += [f"### {model}, {tokens} tokens per rank", "",
                  "| dispatcher | path fwd+bwd (us) | layer fwd+bwd (us) | peak (MiB) | vs best other: path / layer | "
                  "output vs alltoall |", "|---|---|---|---|---|---|"]
        for r in group:
            if "unavailable" in r:
                lines.append(f"| {r['variant']} | not run: {r['unavailable']} | | | | |")
                continue
            ratios = ""
            if r["variant"].startswith("deepepv2") and best_layer:
                path_ratio = f"{best_path / r['path_us']:.2f}x" if best_path and "path_us" in r else "-"
                ratios = f"{path_ratio} / {best_layer / r['layer_us']:.2f}x"
            match = "" if "max_rel_diff" not in r else f"{r['max_rel_diff']:.1e} ({'ok' if r['matches'] else 'DIFFERS'})"
            path_us = f"{r['path_us']:.0f}" if "path_us" in r else "-"
            peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
            lines.append(f"| {r['variant']} | {path_us} | {r['layer_us']:.0f} | {peak} | {ratios} | {match} |")
        lines.append("")
    return "\n".join(lines)


def plot(document: dict, path: str) -> None:
    """Bars of each variant's layer time per (model, tokens), in ms (0: not run)."""
    rows = document["rows"]
    where = f"{document.get('device', '')}, EP={document.get('world_size', '?')}"
    groups = sorted({(r["model"], r["tokens"]) for r in rows}, key=str)
    fig, ax = _bench.new_figure(max(8, 2.5 * len(groups)), 5)
    series = {variant.name: [next((r["layer_us"] / 1000 for r in rows if (r["model"], r["tokens"]) == group
                                   and r["variant"] == variant.name and "layer_us" in r), 0.0) for group in groups]
              for variant in VARIANTS}
    _bench.grouped_bars(ax, [f"{m}\nT{t}" for m, t in groups], series, fontsize=7, legend_columns=4)
    ax.set_ylabel("MoE layer forward + backward, ms (median; 0 = not run)")
    ax.set_title(f"Dispatchers side by side ({where}), lower is better", fontsize=10)
    _bench.save_figure(fig, path)


def write_outputs(rows: list[dict], out: str, meta: dict) -> None:
    """Writes the markdown tables, the JSON (``meta`` and the rows) and the PNG to ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare_dispatchers.md"), "w") as f:
        f.write(markdown(rows))
    _bench.write_outputs(out, "compare_dispatchers", {**meta, "rows": rows}, plot)


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["deepseek-v3", "qwen3-30b-a3b",
                                                                                 "mixtral-8x7b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=None,
                        help="a subset (alltoall always runs: it is the reference)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sms", type=int, default=24, help="SMs for DeepEP v2's kernels (0 = its default)")
    parser.add_argument("--cpu", action="store_true", help="2 gloo CPU processes, reference backend (smoke run)")
    parser.add_argument("--out", default="bench_out")
    return parser.parse_args(argv)


def run_rank(rank: int, args: argparse.Namespace, cuda: bool, meta: dict) -> list[dict]:
    """One rank's part, in an initialised process group: installs the plugin, sets up EP, compares; rank 0 writes
    the outputs (with ``meta``) after each model."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import init_expert_parallel  # noqa: PLC0415

    if not cuda:
        from megatron_deepepv2.testing.cpu_shims import install_cpu_shims  # noqa: PLC0415

        install_cpu_shims()
    dv2.install()
    init_expert_parallel()
    _bench.setup_logging(rank)
    return compare(args, cuda, (lambda rows: write_outputs(rows, args.out, meta)) if rank == 0 else None)


def _cpu_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        run_rank(rank, args, False, {"world_size": world, "device": "cpu (gloo, reference backend)"})
    finally:
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU ranks (spawned, they inherit it) must not see a GPU
        from megatron_deepepv2._dist import spawn_on_free_port  # noqa: PLC0415

        spawn_on_free_port(_cpu_worker, (args,), 2)
        return 0
    with _bench.process_group("nccl") as rank:
        run_rank(rank, args, True, {"world_size": dist.get_world_size(), "device": torch.cuda.get_device_name()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
