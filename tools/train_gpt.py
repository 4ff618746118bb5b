"""Megatron-LM training runs, step by step: record a ``pretrain_gpt.py`` launch, then compare runs.

Two subcommands:

* ``record``: the launch of ``python -m megatron_deepepv2.run`` (installs the plugin, runs the script as
  ``__main__``), with every training step's exact losses, gradient norm and wall-clock time appended to a JSON-lines
  file by rank 0. Use it as the runner of ``examples/pretrain_gpt_moe_deepepv2.sh``::

      RUNNER="tools/train_gpt.py record --out runs/deepepv2.jsonl --" \\
          examples/pretrain_gpt_moe_deepepv2.sh /path/to/Megatron-LM 1 --train-iters 200 --log-interval 1

  Steps are taken from Megatron's ``training_log``, which runs once per iteration; values are kept both as numbers
  and as ``float.hex`` strings, so that two runs can be compared bit for bit.

* ``report``: runs against a baseline (loss gap per step, step time, tokens/s), runs that must be bitwise equal
  (two deterministic runs; a run resumed from a checkpoint against the uninterrupted one), written as
  ``<out>/<name>.json`` and a PNG (loss per step of every run; tokens/s per run)::

      python tools/train_gpt.py report --out docs --name training_h200_ep1 --baseline alltoall \\
          runs/alltoall.jsonl runs/deepepv2.jsonl --equal det_a.jsonl:det_b.jsonl --equal resumed.jsonl:det_a.jsonl

A step's time is the wall clock between two consecutive ``training_log`` calls (Megatron reads the loss on the host
every step, so each call follows the step's end); the report takes the median over the steps after ``--skip``
(warm-up: DeepEP's JIT, CUDA-graph capture). Runs that share a label (repeats of one configuration, e.g. interleaved
pairs) are reported one by one and together: the median of their medians and their spread.

``record --profile FIRST:LAST --profile-out TRACE.json.gz`` also traces steps FIRST to LAST with ``torch.profiler``
(host with Python stacks, and GPU), each step marked ``ProfilerStep#N`` from one ``training_log`` to the next, for
``tools/trace_summary.py``. Profiled steps run slower: time runs without it.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools._bench import new_figure, provenance, save_figure, setup_logging, write_outputs  # noqa: E402

logger = logging.getLogger("train_gpt")


# --------------------------------------------------------------------------------------------------- record


def _number(value: Any) -> Optional[float]:
    """A logged value as a Python float: a tensor (a ``[sum, count]`` pair is divided), a number, or None."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float().cpu() if value.dtype.is_floating_point else value.detach().cpu()
        flat = value.flatten().tolist()
        if len(flat) == 2:  # megatron-core's (sum, count) loss pairs
            return flat[0] / flat[1] if flat[1] else None
        return float(flat[0]) if flat else None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = (_number(v) for v in value)
        return total / count if count else None
    return float(value)


class StepRecorder:
    """Wraps ``megatron.training.training.training_log``: each call appends one step to a JSON-lines file.

    Args:
        path: The JSON-lines file (rewritten at the start).
        label: The run's name, written in the first line.
        profile: ``(FIRST, LAST)`` iterations to trace with ``torch.profiler`` on rank 0, or None.
        profile_out: Where the trace goes (``.json`` or ``.json.gz``).
    """

    def __init__(self, path: str, label: str, profile: Optional[tuple[int, int]] = None,
                 profile_out: Optional[str] = None) -> None:
        self.path, self.label = path, label
        self._last: Optional[float] = None
        self._file = None
        self._profile, self._profile_out = profile, profile_out
        self._profiler: Any = None
        self._step_range: Any = None

    def _header(self) -> dict:
        from megatron.training import get_args  # noqa: PLC0415

        args = get_args()
        return {"label": self.label, "global_batch_size": args.global_batch_size, "seq_length": args.seq_length,
                "tokens_per_step": args.global_batch_size * args.seq_length, "world_size": args.world_size,
                "argv": sys.argv[1:], "environment": {k: v for k, v in os.environ.items()
                                                        if k.startswith(("MEGATRON_DEEPEPV2_", "NCCL_ALGO"))},
                "provenance": provenance()}

    def wrap(self, training_log: Any) -> Any:
        """Returns ``training_log`` with the recording around it."""
        import torch.distributed as dist  # noqa: PLC0415

        @functools.wraps(training_log)
        def recorded(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
            now = time.perf_counter()
            if not dist.is_initialized() or dist.get_rank() == 0:
                self._write(iteration, loss_dict, grad_norm, learning_rate, skipped_iter, now)
                if self._profile is not None:
                    self._profile_step(int(iteration))
            return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                                skipped_iter, grad_norm, *args, **kwargs)

        return recorded

    def _profile_step(self, iteration: int) -> None:
        """Called at the end of each iteration: starts, marks and stops the trace of iterations FIRST to LAST."""
        import torch  # noqa: PLC0415

        first, last = self._profile
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if iteration == first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()
        if self._profiler is None:
            return
        if first - 1 <= iteration < last:
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{iteration + 1}")
            self._step_range.__enter__()
            return
        self._profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(self._profile_out)), exist_ok=True)
        self._profiler.export_chrome_trace(self._profile_out)
        logger.info("traced iterations %d-%d into %s", first, last, self._profile_out)
        self._profiler, self._profile = None, None

    def _write(self, iteration: int, loss_dict: dict, grad_norm: Any, learning_rate: Any, skipped: Any,
               now: float) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "w")
            self._file.write(json.dumps(self._header()) + "\n")
        losses = {key: _number(value) for key, value in loss_dict.items()}
        norm = _number(grad_norm)
        step = {"iteration": int(iteration), "losses": losses,
                "losses_hex": {k: (v.hex() if v is not None else None) for k, v in losses.items()},
                "grad_norm": norm, "grad_norm_hex": None if norm is None else norm.hex(),
                "learning_rate": _number(learning_rate), "skipped": int(_number(skipped) or 0),
                "seconds": None if self._last is None else now - self._last}
        self._last = now
        self._file.write(json.dumps(step) + "\n")
        self._file.flush()


def record(out: str, label: str, target: Sequence[str], profile: Optional[tuple[int, int]] = None,
           profile_out: Optional[str] = None) -> int:
    """Runs ``python -m megatron_deepepv2.run TARGET...`` with a :class:`StepRecorder` on Megatron's training log.

    Args:
        out: The JSON-lines file.
        label: The run's name.
        target: ``[SCRIPT, ARGS...]`` as for ``megatron_deepepv2.run``.
        profile: Iterations ``(FIRST, LAST)`` to trace, or None.
        profile_out: The trace file.

    Returns:
        The runner's exit status.
    """
    import megatron_deepepv2  # noqa: PLC0415
    from megatron_deepepv2 import run  # noqa: PLC0415

    megatron_deepepv2.install()  # before Megatron's training modules are imported (run.main's install is then a no-op)
    import megatron.training.training as training  # noqa: PLC0415

    training.training_log = StepRecorder(out, label, profile, profile_out).wrap(training.training_log)
    return run.main(list(target))


# --------------------------------------------------------------------------------------------------- report


def load(path: str) -> dict:
    """A recorded run: its header, and its steps by iteration (the last record of an iteration wins)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty: the run recorded no step (did it fail before training?).")
    header, steps = lines[0], {step["iteration"]: step for step in lines[1:]}
    return {"path": path, "label": header.get("label") or os.path.splitext(os.path.basename(path))[0],
            "header": header, "steps": steps}


def summarise(run: dict, skip: int) -> dict:
    """Step time (median after ``skip`` steps), tokens/s and the loss curve of a run."""
    steps = [run["steps"][i] for i in sorted(run["steps"])]
    times = [s["seconds"] for s in steps[skip:] if s["seconds"] is not None]
    step_s = statistics.median(times) if times else None
    tokens = run["header"].get("tokens_per_step")
    return {"label": run["label"], "steps": len(steps), "first_iteration": steps[0]["iteration"] if steps else None,
            "last_iteration": steps[-1]["iteration"] if steps else None,
            "median_step_ms": None if step_s is None else step_s * 1e3, "tokens_per_step": tokens,
            "tokens_per_s": None if not step_s or not tokens else tokens / step_s,
            "first_loss": steps[0]["losses"].get("lm loss") if steps else None,
            "last_loss": steps[-1]["losses"].get("lm loss") if steps else None,
            "loss": {str(s["iteration"]): s["losses"].get("lm loss") for s in steps},
            "environment": run["header"].get("environment", {}),
            "provenance": run["header"].get("provenance")}


def loss_gap(run: dict, baseline: dict) -> dict:
    """Largest and last absolute ``lm loss`` difference over the iterations both runs have."""
    common = sorted(set(run["steps"]) & set(baseline["steps"]))
    gaps = [abs(run["steps"][i]["losses"]["lm loss"] - baseline["steps"][i]["losses"]["lm loss"]) for i in common]
    if not gaps:
        return {"iterations": 0}
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"iterations": len(common), "max_abs": gaps[worst], "at_iteration": common[worst], "last_abs": gaps[-1],
            "mean_abs": statistics.fmean(gaps)}


def bitwise_equal(run: dict, other: dict) -> dict:
    """Whether the iterations both runs have carry bit-identical losses and gradient norms; the first difference."""
    common = sorted(set(run["steps"]) & set(other["steps"]))
    for i in common:
        a, b = run["steps"][i], other["steps"][i]
        if a["losses_hex"] != b["losses_hex"] or a["grad_norm_hex"] != b["grad_norm_hex"]:
            return {"iterations": len(common), "equal": False, "first_difference": i,
                    "values": [[a["losses"], a["grad_norm"]], [b["losses"], b["grad_norm"]]]}
    return {"iterations": len(common), "equal": bool(common), "range": [common[0], common[-1]] if common else None}


def configurations(summaries: Sequence[dict]) -> dict:
    """Runs grouped by label: each configuration's runs, the median of their median step times, and their spread."""
    groups: dict[str, list[dict]] = {}
    for run in summaries:
        groups.setdefault(run["label"], []).append(run)
    out = {}
    for label, runs in groups.items():
        each = [r["median_step_ms"] for r in runs if r["median_step_ms"] is not None]
        if not each:
            continue
        median = statistics.median(each)
        tokens = runs[0]["tokens_per_step"]
        out[label] = {"runs": [r["run"] for r in runs], "median_step_ms_each": each, "median_step_ms": median,
                      "spread_pct": (max(each) - min(each)) / median * 100,
                      "tokens_per_s": tokens / (median / 1e3) if tokens else None}
    return out


def target_ratios(groups: dict, targets: Sequence[str]) -> list[dict]:
    """``RUN:BASELINE:LIMIT`` targets: the ratio of the two configurations' median step times against ``LIMIT``, and
    the ratio within each pair of runs (the k-th run of each: interleaved pairs), so the spread is seen."""
    results = []
    for target in targets:
        parts = target.split(":")
        if len(parts) != 3:
            raise ValueError(f"target {target!r}: give RUN:BASELINE:LIMIT (labels and a ratio, e.g. deepepv2:alltoall:1.0)")
        run, baseline, limit = parts[0], parts[1], float(parts[2])
        missing = [label for label in (run, baseline) if label not in groups]
        if missing:
            raise ValueError(f"target {target!r}: no runs labelled {missing}; labels: {sorted(groups)}")
        a, b = groups[run]["median_step_ms_each"], groups[baseline]["median_step_ms_each"]
        pairs = [x / y for x, y in zip(a, b)]
        ratio = groups[run]["median_step_ms"] / groups[baseline]["median_step_ms"]
        results.append({"run": run, "baseline": baseline, "limit": limit, "ratio": ratio, "met": ratio <= limit,
                        "pair_ratios": pairs, "met_in_every_pair": bool(pairs) and all(r <= limit for r in pairs)})
    return results


def report(paths: Sequence[str], baseline: Optional[str], equal: Sequence[str], skip: int,
           targets: Sequence[str] = ()) -> dict:
    """The comparison document of recorded runs.

    Runs that share a label are repeats of one configuration: each is reported as ``LABEL#k`` (k from 1, in the order
    given), and ``configurations`` puts them together.

    Args:
        paths: Runs to summarise (JSON-lines files).
        baseline: Label of the configuration whose first run the others' loss gaps are taken against, or None.
        equal: ``A.jsonl:B.jsonl`` pairs that must be bitwise equal where their iterations overlap.
        skip: Warm-up steps left out of the step time.
        targets: ``RUN:BASELINE:LIMIT`` step-time ratios to check (see :func:`target_ratios`).

    Returns:
        ``{"runs": [...], "configurations": {...}, "targets": [...], "loss_gap": {run: ...}, "bitwise": [...]}``.

    Raises:
        ValueError: For a baseline or target naming no run.
    """
    runs = [load(p) for p in paths]
    counts: dict[str, int] = {}
    for run in runs:
        counts[run["label"]] = counts.get(run["label"], 0) + 1
    seen: dict[str, int] = {}
    for run in runs:
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        run["run"] = run["label"] if counts[run["label"]] == 1 else f"{run['label']}#{seen[run['label']]}"
    summaries = [{"run": r["run"], **summarise(r, skip)} for r in runs]
    document: dict = {"runs": summaries, "skip": skip, "configurations": configurations(summaries)}
    document["targets"] = target_ratios(document["configurations"], targets)
    if baseline is not None:
        reference = next((r for r in runs if r["label"] == baseline), None)
        if reference is None:
            raise ValueError(f"baseline {baseline!r} is not one of the runs' labels: {sorted(counts)}.")
        document["baseline"] = baseline
        document["loss_gap"] = {r["run"]: loss_gap(r, reference) for r in runs if r is not reference}
    document["bitwise"] = []
    for pair in equal:
        first, _, second = pair.partition(":")
        a, b = load(first), load(second)
        document["bitwise"].append({"runs": [a["label"], b["label"]], **bitwise_equal(a, b)})
    return document


def throughput_bars(configurations: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Thousand tokens/s of each configuration (its median step) and the error bars spanning its runs: how far the
    slowest run's tokens/s lies below and the fastest run's above, never below zero (with one run the two sides
    differ only by rounding)."""
    tokens = [g["tokens_per_s"] / 1e3 for g in configurations]
    lows = [max(0.0, t - t * g["median_step_ms"] / max(g["median_step_ms_each"])) for t, g in zip(tokens, configurations)]
    highs = [max(0.0, t * g["median_step_ms"] / min(g["median_step_ms_each"]) - t) for t, g in zip(tokens, configurations)]
    return tokens, lows, highs


def plot(document: dict, path: str) -> None:
    """Loss per step of every run (left) and tokens/s per run (right)."""
    fig, _ = new_figure(12, 4.2)
    fig.clf()
    left, right = fig.subplots(1, 2)
    for run in document["runs"]:
        steps = sorted(run["loss"], key=int)
        left.plot([int(s) for s in steps], [run["loss"][s] for s in steps], label=run.get("run", run["label"]),
                  linewidth=1)
    left.set_xlabel("iteration")
    left.set_ylabel("lm loss")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("loss per step")
    groups = [(label, g) for label, g in document.get("configurations", {}).items() if g["tokens_per_s"]]
    tokens, lows, highs = throughput_bars([g for _, g in groups])
    bars = right.bar(range(len(groups)), tokens, yerr=[lows, highs], capsize=3)
    right.bar_label(bars, fmt="%.0f", fontsize=7)
    right.set_xticks(range(len(groups)), [f"{label} (x{len(g['runs'])})" for label, g in groups], rotation=20,
                     ha="right", fontsize=7)
    right.set_ylabel("thousand tokens / s")
    right.set_title("throughput (median step; bars: runs' range)")
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run a training script, recording every step")
    rec.add_argument("--out", required=True, help="JSON-lines file")
    rec.add_argument("--label", default=None, help="the run's name (default: the file name)")
    rec.add_argument("--profile", default=None, metavar="FIRST:LAST", help="trace these iterations (torch.profiler)")
    rec.add_argument("--profile-out", default=None, help="the trace file (.json or .json.gz)")
    rec.add_argument("target", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    rep = commands.add_parser("report", help="compare recorded runs: JSON + PNG")
    rep.add_argument("runs", nargs="+", help="JSON-lines files")
    rep.add_argument("--out", required=True, help="output folder")
    rep.add_argument("--name", default="training", help="output file name without extension")
    rep.add_argument("--baseline", default=None, help="label of the run to take loss gaps against")
    rep.add_argument("--equal", action="append", default=[], help="A.jsonl:B.jsonl, bitwise equal where they overlap")
    rep.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the step time")
    rep.add_argument("--target", action="append", default=[], metavar="RUN:BASELINE:LIMIT",
                     help="a step-time ratio to check, e.g. deepepv2:alltoall:1.0 (labels; repeats are pooled)")
    args = parser.parse_args(argv)
    if args.command == "record":
        target = args.target[1:] if args.target[:1] == ["--"] else args.target
        if not target:
            parser.error("record needs the script to run: record --out FILE -- SCRIPT [ARGS...]")
        label = args.label or os.path.splitext(os.path.basename(args.out))[0]
        profile = None
        if args.profile:
            first, _, last = args.profile.partition(":")
            if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
                parser.error(f"--profile {args.profile}: give FIRST:LAST iterations, 1 <= FIRST <= LAST")
            if not args.profile_out:
                parser.error("--profile needs --profile-out TRACE.json.gz")
            profile = (int(first), int(last))
        return record(args.out, label, target, profile, args.profile_out)
    setup_logging()
    document = report(args.runs, args.baseline, args.equal, args.skip, args.target)
    for run in document["runs"]:
        logger.info("%-30s %4d steps  loss %.4f -> %.4f  %8.1f ms/step  %9.0f tokens/s", run["run"], run["steps"],
                    run["first_loss"] or float("nan"), run["last_loss"] or float("nan"),
                    run["median_step_ms"] or float("nan"), run["tokens_per_s"] or float("nan"))
    for label, group in document["configurations"].items():
        logger.info("%-30s %d run(s): median %.1f ms/step (each %s, spread %.1f%%)", label, len(group["runs"]),
                    group["median_step_ms"], ", ".join(f"{v:.1f}" for v in group["median_step_ms_each"]),
                    group["spread_pct"])
    for target in document["targets"]:
        logger.info("target %s / %s = %.3f (limit %.2f: %s; pairs %s)", target["run"], target["baseline"],
                    target["ratio"], target["limit"], "met" if target["met"] else "NOT met",
                    ", ".join(f"{r:.3f}" for r in target["pair_ratios"]))
    for label, gap in document.get("loss_gap", {}).items():
        logger.info("loss gap %s vs %s: %s", label, document["baseline"], gap)
    for check in document["bitwise"]:
        logger.info("bitwise %s: %s", " vs ".join(check["runs"]), check)
    write_outputs(args.out, args.name, document, plot)
    return 0 if all(check["equal"] for check in document["bitwise"]) else 1


if __name__ == "__main__":
    sys.exit(main())
