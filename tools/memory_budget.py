"""Device memory one MoE layer's dispatch holds per rank, from DeepEP's buffer arithmetic (no GPU needed).

For a model shape and expert-parallel sizes, prints and writes (JSON + PNG) the bytes of
:func:`megatron_deepepv2.backends.deepep.sizing.layer_memory`: the communication buffer, the received rows the
experts keep for backward, and the peak while the dispatch runs; with host sync (exact receive, a balanced router),
without host sync (the worst case), and without host sync under a receive bound (Megatron's
``--moe-expert-rank-capacity-factor``)::

    python tools/memory_budget.py --shape deepseek-v3 --ep 8 64 --tokens 4096 --out docs

Groups larger than 8 ranks are laid out as nodes of 8 in DeepEP's hybrid mode (the mode the backend picks for a group
that spans nodes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_deepepv2.backends.deepep.sizing import Topology, layer_memory  # noqa: E402
from tools._bench import grouped_bars, new_figure, provenance, save_figure, setup_logging, write_outputs  # noqa: E402

logger = logging.getLogger("memory_budget")

#: (hidden, top-k, experts) of the shapes people train.
SHAPES = {
    "deepseek-v3": (7168, 8, 256),
    "qwen3-30b-a3b": (2048, 8, 128),
    "mixtral-8x7b": (4096, 2, 8),
    "gpt-oss-120b": (2880, 4, 128),
}
GPUS_PER_NODE = 8
MiB = 2**20


def _rows(shape: str, group_sizes: list[int], tokens: int, alignment: int, factor: float) -> list[dict[str, Any]]:
    hidden, topk, experts = SHAPES[shape]
    rows = []
    for group_size in group_sizes:
        nodes = max(1, group_size // GPUS_PER_NODE)
        topology = Topology.for_group(nodes, group_size // nodes, allow_hybrid_mode=nodes > 1)
        for mode, host_sync, bound in (("host sync", True, None), ("no host sync", False, None),
                                       (f"no host sync, bound {factor:g}", False, factor)):
            memory = layer_memory(group_size=group_size, num_max_tokens_per_rank=tokens, hidden=hidden, num_topk=topk,
                                  num_experts=experts, expert_alignment=alignment, host_sync=host_sync,
                                  rank_capacity_factor=bound, topology=topology)
            rows.append({"ep": group_size, "mode": mode, "buffer_mib": memory.buffer / MiB,
                         "received_mib": memory.received / MiB, "kept_mib": memory.kept / MiB,
                         "peak_mib": memory.peak / MiB})
            logger.info("EP%-3d %-26s buffer %8.0f MiB  received %8.0f MiB  kept %8.0f MiB  peak %8.0f MiB",
                        group_size, mode, *(rows[-1][k] for k in ("buffer_mib", "received_mib", "kept_mib",
                                                                   "peak_mib")))
    return rows


def _plot(document: dict[str, Any], path: str) -> None:
    rows = document["rows"]
    groups = [f"EP{row['ep']}\n{row['mode']}" for row in rows]
    fig, ax = new_figure(max(6.0, 1.2 * len(rows)), 4.0)
    grouped_bars(ax, groups, {"kept until backward": [row["kept_mib"] / 1024 for row in rows],
                              "peak during dispatch": [row["peak_mib"] / 1024 for row in rows]},
                 value_format="%.1f", fontsize=7)
    ax.set_ylabel("GiB per rank, one layer")
    ax.set_title(f"{document['shape']}: T {document['tokens']} per rank (model of DeepEP 2.1's arithmetic)")
    save_figure(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="deepseek-v3")
    parser.add_argument("--ep", type=int, nargs="+", default=[8, 64], help="expert-parallel group sizes")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank (the buffer's capacity)")
    parser.add_argument("--alignment", type=int, default=1, help="expand-layout expert alignment")
    parser.add_argument("--factor", type=float, default=1.5, help="moe_expert_rank_capacity_factor of the bound rows")
    parser.add_argument("--out", default=None, help="folder for memory_<shape>.json / .png (default: print only)")
    args = parser.parse_args()
    setup_logging()
    bad = [size for size in args.ep if size > GPUS_PER_NODE and size % GPUS_PER_NODE]
    if bad:
        parser.error(f"--ep {bad}: groups larger than a node must be whole nodes of {GPUS_PER_NODE}")
    rows = _rows(args.shape, args.ep, args.tokens, args.alignment, args.factor)
    if args.out:
        hidden, topk, experts = SHAPES[args.shape]
        document = {"shape": args.shape, "hidden": hidden, "topk": topk, "experts": experts, "tokens": args.tokens,
                    "alignment": args.alignment, "factor": args.factor, "computed_not_measured": True,
                    "provenance": provenance(), "rows": rows}
        write_outputs(args.out, f"memory_{args.shape.replace('-', '_')}", document, _plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
