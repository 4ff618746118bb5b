#!/usr/bin/env python3
"""Soak of the buffer lifecycle: many steps with the token count changing, two micro-batches in flight.

Runs ``--steps`` dispatch + combine forward/backward steps on ``--ranks`` gloo processes (reference backend, CPU;
``--backend`` picks another registered backend on a machine that has it), changing the tokens per rank every
``--change-every`` steps through a schedule that grows and shrinks. Each step keeps the previous micro-batch in
flight (forward of step ``i``, then backward of step ``i - 1``), as 1F1B pipelines do, so a rebuild always has a
pending backward. Every ``--change-every`` steps it records the process's resident memory, the builds, the
retired buffers, and checks each step's result against a dense oracle on a sample of steps.

Passes when: at most one rebuild per change of the token count, no buffer left behind (a superseded buffer is
released at a later build once no handle uses it, so at the end every one is released but the last one superseded),
and resident memory after the last change within ``--memory-slack-mib`` of its level after the first growth to the
largest size. Prints progress, writes ``soak_buffers.json`` and ``soak_buffers.png`` to ``--out``::

    python tools/soak_buffers.py --out bench_out [--steps 1000 --change-every 100]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

logger = logging.getLogger("soak_buffers")

#: Tokens per rank, one entry per change: grows, shrinks, grows past the largest, and comes back.
SCHEDULE = [64, 256, 32, 128, 512, 16, 512, 200, 64, 300]
HIDDEN, EXPERTS, TOPK = 64, 8, 4


def _resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank_main(rank: int, world: int, args) -> dict:
    import torch

    _bench.setup_logging(rank, all_ranks=True)

    import megatron_deepepv2 as dv2
    from megatron_deepepv2 import buffers

    torch.manual_seed(1234)
    dv2.configure(backend=args.backend, validate=False)
    experts = (torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN**0.5).requires_grad_()
    mine = slice(rank * EXPERTS // world, (rank + 1) * EXPERTS // world)
    samples, pending = [], None
    checked = 0

    def forward(step: int):
        tokens = SCHEDULE[(step // args.change_every) % len(SCHEDULE)]
        gen = torch.Generator().manual_seed(step * 97 + rank)
        x = torch.randn(tokens, HIDDEN, generator=gen).requires_grad_()
        idx = torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOPK]
        w = torch.rand(tokens, TOPK, generator=gen)
        out = dv2.dispatch(x, idx, w, EXPERTS, layout="expand", expert_alignment=4)
        local = experts[mine]
        blocks = torch.split(out.recv_x, out.handle.tokens_per_expert_list)
        probs = torch.split(out.recv_topk_weights, out.handle.tokens_per_expert_list)
        y = torch.cat([(b @ local[e]) * p.unsqueeze(1) for e, (b, p) in enumerate(zip(blocks, probs))])
        combined = dv2.combine(y, out.handle)
        return x, idx, w, combined

    for step in range(args.steps):
        current = forward(step)
        if pending is not None:
            x, idx, w, combined = pending
            combined.sum().backward()
            if step % args.check_every == 0:  # dense oracle: y[t] = sum_k w x W_k, on this rank's experts
                oracle = torch.zeros_like(combined)
                for k in range(TOPK):
                    oracle += w[:, k : k + 1] * torch.einsum("th,thj->tj", x.detach(), experts.detach()[idx[:, k]])
                torch.testing.assert_close(combined.detach(), oracle, rtol=1e-4, atol=1e-4)
                checked += 1
        pending = current
        if (step + 1) % args.change_every == 0:
            stats = buffers.buffer_stats()
            samples.append({"step": step + 1, "rss_mib": _resident_mib(), "builds": stats.builds,
                            "released": stats.released, "retired": len(buffers.retired_buffers()),
                            "capacity": max(b.spec.num_max_tokens_per_rank for b in buffers.active_buffers())})
            if rank == 0:
                logger.info("step %5d: %6.1f MiB resident, %d builds, %d released, %d retired, capacity %d",
                            *[samples[-1][k] for k in ("step", "rss_mib", "builds", "released", "retired",
                                                       "capacity")])
    pending[3].sum().backward()
    del pending, current
    stats = buffers.buffer_stats()
    return {"samples": samples, "retired_at_end": len(buffers.retired_buffers()), "checked_steps": checked,
            "builds": stats.builds, "rebuilds": stats.rebuilds, "released": stats.released}


def verdict(report: dict, args) -> dict:
    """The soak's pass/fail criteria over one rank's report."""
    changes = min(args.steps // args.change_every, len(SCHEDULE))
    samples = report["samples"]
    largest_at = next(i for i, s in enumerate(samples) if s["capacity"] == max(x["capacity"] for x in samples))
    growth = samples[-1]["rss_mib"] - samples[largest_at]["rss_mib"]
    return {
        "rebuilds_at_most_one_per_change": report["builds"] <= changes,
        # Every superseded buffer is released, but the last one (released at the next build, which never comes).
        "no_buffer_left_behind": report["retired_at_end"] <= 1
        and report["released"] + report["retired_at_end"] == report["rebuilds"],
        "memory_flat": growth <= args.memory_slack_mib,
        "memory_growth_mib": growth,
        "changes": changes,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--change-every", type=int, default=100)
    parser.add_argument("--check-every", type=int, default=25)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--memory-slack-mib", type=float, default=16.0)
    args = parser.parse_args(argv)
    _bench.setup_logging()
    from tests.distributed import run_distributed

    reports = run_distributed(_rank_main, args.ranks, args, timeout=3600)
    verdicts = [verdict(report, args) for report in reports]
    _bench.write_outputs(args.out, "soak_buffers", {"args": vars(args), "schedule": SCHEDULE, "reports": reports,
                                                    "verdicts": verdicts}, _plot)
    for rank, v in enumerate(verdicts):
        logger.info("rank %d: %s", rank, v)
    ok = all(v["rebuilds_at_most_one_per_change"] and v["no_buffer_left_behind"] and v["memory_flat"]
             for v in verdicts)
    logger.info("soak %s", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def _plot(document: dict, path: str) -> None:
    """Resident memory per rank and the buffer capacity over the steps."""
    reports = document["reports"]
    fig, ax = _bench.new_figure(8, 4)
    for rank, report in enumerate(reports):
        steps = [s["step"] for s in report["samples"]]
        ax.plot(steps, [s["rss_mib"] for s in report["samples"]], marker="o", label=f"rank {rank} resident MiB")
    ax2 = ax.twinx()
    ax2.step([s["step"] for s in reports[0]["samples"]], [s["capacity"] for s in reports[0]["samples"]],
             color="gray", where="post", label="buffer capacity (tokens)")
    ax.set_xlabel("step")
    ax.set_ylabel("resident memory (MiB)")
    ax2.set_ylabel("capacity (tokens per rank)")
    ax.set_title("Buffer lifecycle soak (two micro-batches in flight)")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    _bench.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
