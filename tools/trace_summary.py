#!/usr/bin/env python3
"""Where a training step goes: a summary of ``torch.profiler`` chrome traces, and the difference between two runs.

Reads traces written by ``tools/train_gpt.py record --profile FIRST:LAST`` (or any ``torch.profiler`` trace whose
steps are marked ``ProfilerStep#N``; ``.json`` or ``.json.gz``) and reports, per step (means over the traced steps):

* ``wall_ms``: the step's wall clock on the host (one ``ProfilerStep`` range);
* ``gpu_busy_ms``: the union of GPU activity (kernels, copies, memsets) inside the step, and ``gpu_idle_ms``;
* ``kernels``: kernel launches, and the kernels with the most GPU time;
* ``runtime``: CUDA runtime calls by name (count and host time), the synchronising ones (``*Synchronize``,
  blocking ``cudaMemcpy``) first: time the host spent waiting for the GPU;
* ``sync_sites``: where those waits were called from (the innermost Python frames of Megatron, this package, DeepEP
  and PyTorch's autograd), with their count and time;
* ``ops``: PyTorch operators (``aten::...``) by inclusive host time and count;
* ``python``: inclusive host time of the Python functions of Megatron and this package (as ``file(line): name``).

With two or more traces, ``diff`` puts each run's figures beside the first one's: the Python functions and runtime
calls whose time differs most. Prints the tables, writes ``<name>.json`` and ``<name>.png`` to ``--out``::

    python tools/trace_summary.py --out docs --name trace_h200_ep1 alltoall=a.json.gz deepepv2=b.json.gz

Profiling adds 10-20 us to every launch: read the figures as where time goes, not as step times.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import logging
import os
import re
import sys
from typing import Any, Iterable, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools._bench import new_figure, provenance, save_figure, setup_logging, write_outputs  # noqa: E402

logger = logging.getLogger("trace_summary")

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
#: Runtime calls after which the host has waited for the GPU.
SYNC_CALL = re.compile(r"Synchronize|^cudaMemcpy$|^cudaMemcpy2D$|^cuMemcpyDtoH")
#: Python frames worth naming in a call site (the rest is the interpreter's plumbing).
SITE_FRAME = re.compile(r"megatron|deep_ep|torch/autograd|torch/_dynamo|pretrain_gpt|train_gpt")
STEP_MARK = re.compile(r"^ProfilerStep#(\d+)$")


def load_trace(path: str) -> list[dict]:
    """The complete (``ph == "X"``) events of a chrome trace."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        document = json.load(f)
    events = document["traceEvents"] if isinstance(document, dict) else document
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union_length(intervals: Iterable[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _clip(start: float, stop: float, window: tuple[float, float]) -> Optional[tuple[float, float]]:
    lo, hi = max(start, window[0]), min(stop, window[1])
    return (lo, hi) if hi > lo else None


def _call_sites(python: list[dict], calls: list[dict], depth: int, frames: re.Pattern) -> list[str]:
    """The innermost ``depth`` interesting Python frames around each call (same thread), innermost last.

    One sweep per thread over frames and calls by start time, with the stack of open frames (frames nest).
    """
    items_by_thread: dict[Any, list[tuple]] = collections.defaultdict(list)
    for frame in python:  # at one start time: longer (outer) frames first, then calls
        items_by_thread[frame["tid"]].append((frame["ts"], 0, -frame["dur"], frame))
    for index, call in enumerate(calls):
        items_by_thread[call["tid"]].append((call["ts"], 1, index, call))
    sites = ["(no Python frame)"] * len(calls)
    for items in items_by_thread.values():
        items.sort(key=lambda item: item[:3])
        stack: list[dict] = []
        for ts, kind, key, event in items:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < ts + (event["dur"] if kind else 0):
                stack.pop()
            if kind == 0:
                stack.append(event)
                continue
            names = [f["name"] for f in stack if frames.search(f["name"])]
            if names:
                sites[key] = " > ".join(_short(n) for n in names[-depth:])
    return sites


def _short(frame: str) -> str:
    """``.../megatron/core/transformer/moe/moe_layer.py(312): forward`` -> ``moe/moe_layer.py(312): forward``."""
    match = re.match(r"(?P<path>.*?)\((?P<line>\d+)\): (?P<name>.*)", frame)
    if not match:
        return frame
    parts = match["path"].replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}({match['line']}): {match['name']}"


def summarise(events: list[dict], top: int = 25, site_depth: int = 4, frames: re.Pattern = SITE_FRAME) -> dict:
    """The per-step summary of one trace (see the module docstring); figures are means over its steps, in ms.

    Args:
        events: The trace's complete events (:func:`load_trace`).
        top: Rows per table.
        site_depth: Python frames named per call site.
        frames: Which Python frames count (call sites and the ``python`` table), by file path.

    Returns:
        The summary.

    Raises:
        ValueError: If the trace marks no steps.
    """
    steps = sorted(((e["ts"], e["ts"] + e["dur"], int(STEP_MARK.match(e["name"])[1]))
                    for e in events if e.get("cat") == "user_annotation" and STEP_MARK.match(e["name"])))
    if not steps:
        raise ValueError("the trace has no ProfilerStep#N ranges: profile with torch.profiler and call step() "
                         "(tools/train_gpt.py record --profile does)")
    count = len(steps)
    starts = [s[0] for s in steps]

    def step_of(event: dict) -> Optional[tuple[float, float]]:
        index = bisect.bisect_right(starts, event["ts"]) - 1
        if index < 0 or event["ts"] >= steps[index][1]:
            return None
        return steps[index][0], steps[index][1]

    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    busy = 0.0
    for start, stop, _ in steps:
        busy += _union_length(c for e in gpu if (c := _clip(e["ts"], e["ts"] + e["dur"], (start, stop))))
    wall = sum(stop - start for start, stop, _ in steps)
    kernels = [e for e in events if e.get("cat") == "kernel" and step_of(e)]
    kernel_time: dict[str, float] = collections.Counter()
    for e in kernels:
        kernel_time[e["name"][:90]] += e["dur"]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and step_of(e)]
    runtime_calls: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in runtime:
        runtime_calls[e["name"]][0] += 1
        runtime_calls[e["name"]][1] += e["dur"]
    syncs = [e for e in runtime if SYNC_CALL.search(e["name"])]
    python = [e for e in events if e.get("cat") == "python_function" and step_of(e)]
    site_time: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for call, site in zip(syncs, _call_sites(python, syncs, site_depth, frames)):
        site_time[f"{call['name']} @ {site}"][0] += 1
        site_time[f"{call['name']} @ {site}"][1] += call["dur"]
    op_time: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("cat") == "cpu_op" and step_of(e):
            op_time[e["name"]][0] += 1
            op_time[e["name"]][1] += e["dur"]
    python_time: dict[str, float] = collections.Counter()
    python_calls: dict[str, int] = collections.Counter()
    for e in python:
        if frames.search(e["name"]):
            python_time[_short(e["name"])] += e["dur"]
            python_calls[_short(e["name"])] += 1

    def per_step_ms(value: float) -> float:
        return round(value / count / 1e3, 3)

    return {
        "steps": [number for _, _, number in steps],
        "wall_ms": per_step_ms(wall),
        "gpu_busy_ms": per_step_ms(busy),
        "gpu_idle_ms": per_step_ms(wall - busy),
        "kernels": round(len(kernels) / count, 1),
        "sync_wait_ms": per_step_ms(sum(e["dur"] for e in syncs)),
        "syncs": round(len(syncs) / count, 1),
        "top_kernels_ms": {name: per_step_ms(t) for name, t in kernel_time.most_common(top)},
        "runtime": {name: {"calls": round(n / count, 1), "ms": per_step_ms(t)}
                    for name, (n, t) in sorted(runtime_calls.items(), key=lambda kv: -kv[1][1])[:top]},
        "sync_sites": {site: {"calls": round(n / count, 1), "ms": per_step_ms(t)}
                       for site, (n, t) in sorted(site_time.items(), key=lambda kv: -kv[1][1])[:top]},
        "ops": {name: {"calls": round(n / count, 1), "ms": per_step_ms(t)}
                for name, (n, t) in sorted(op_time.items(), key=lambda kv: -kv[1][1])[:top]},
        "python": {name: {"calls": round(python_calls[name] / count, 1), "ms": per_step_ms(t)}
                   for name, t in python_time.most_common(4 * top)},
    }


def diff(summaries: dict[str, dict], top: int = 30) -> dict:
    """Each run beside the first: step figures, and the Python functions, runtime calls and operators that differ
    most (ms)."""
    labels = list(summaries)
    base = summaries[labels[0]]
    out: dict[str, Any] = {"baseline": labels[0], "runs": {}}
    for label in labels[1:]:
        run = summaries[label]
        row: dict[str, Any] = {key: [base[key], run[key], round(run[key] - base[key], 3)]
                               for key in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms", "sync_wait_ms", "syncs", "kernels")}
        for section in ("python", "runtime", "ops"):
            names = set(base[section]) | set(run[section])
            rows = [(name, base[section].get(name, {}).get("ms", 0.0), run[section].get(name, {}).get("ms", 0.0))
                    for name in names]
            rows.sort(key=lambda r: -abs(r[2] - r[1]))
            row[section] = {name: [a, b, round(b - a, 3)] for name, a, b in rows[:top]}
        out["runs"][label] = row
    return out


def plot(document: dict, path: str) -> None:
    """Per run: step wall clock split into GPU busy and GPU idle, and the host's wait in synchronising calls."""
    runs = document["summaries"]
    labels = list(runs)
    fig, ax = new_figure(max(6, 1.6 * len(labels)), 4.2)
    xs = range(len(labels))
    busy = [runs[label]["gpu_busy_ms"] for label in labels]
    idle = [runs[label]["gpu_idle_ms"] for label in labels]
    ax.bar(xs, busy, label="GPU busy")
    ax.bar(xs, idle, bottom=busy, label="GPU idle")
    ax.plot(xs, [runs[label]["sync_wait_ms"] for label in labels], "k_", markersize=30, label="host waits in syncs")
    ax.set_xticks(list(xs), labels, rotation=15, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (profiled)")
    ax.set_title("where a training step goes")
    ax.legend(fontsize=8)
    save_figure(fig, path)


def _print(summaries: dict[str, dict], differences: dict) -> None:
    for label, s in summaries.items():
        logger.info("== %s: steps %s", label, s["steps"])
        logger.info("   wall %.2f ms, GPU busy %.2f, idle %.2f, %s kernels, %s syncs waiting %.2f ms", s["wall_ms"],
                    s["gpu_busy_ms"], s["gpu_idle_ms"], s["kernels"], s["syncs"], s["sync_wait_ms"])
        for site, value in list(s["sync_sites"].items())[:8]:
            logger.info("   sync %6.2f ms x%-5s %s", value["ms"], value["calls"], site)
    for label, row in differences.get("runs", {}).items():
        logger.info("== %s against %s (ms per step: baseline, run, difference)", label, differences["baseline"])
        for key in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms", "sync_wait_ms"):
            logger.info("   %-14s %9.2f %9.2f %+9.2f", key, *row[key])
        for name, (a, b, d) in list(row["python"].items())[:15]:
            logger.info("   %9.2f %9.2f %+9.2f  %s", a, b, d, name)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", help="LABEL=TRACE (.json or .json.gz); the first is the baseline")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", default="trace_summary", help="output file name without extension")
    parser.add_argument("--top", type=int, default=25, help="rows per table")
    parser.add_argument("--frames", default=SITE_FRAME.pattern, help="regex: the Python frames (file paths) to count")
    args = parser.parse_args(argv)
    setup_logging()
    summaries = {}
    for item in args.traces:
        label, _, path = item.rpartition("=")
        label = label or os.path.basename(path).split(".")[0]
        logger.info("reading %s (%s)", path, label)
        summaries[label] = summarise(load_trace(path), top=args.top, frames=re.compile(args.frames))
    document = {"summaries": summaries, "diff": diff(summaries, top=args.top) if len(summaries) > 1 else {},
                "provenance": provenance()}
    _print(summaries, document["diff"])
    write_outputs(args.out, args.name, document, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
