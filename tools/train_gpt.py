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
(warm-up: DeepEP's JIT, CUDA-graph capture).
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

from tools._bench import new_figure, save_figure, setup_logging, write_outputs  # noqa: E402

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
    """

    def __init__(self, path: str, label: str) -> None:
        self.path, self.label = path, label
        self._last: Optional[float] = None
        self._file = None

    def _header(self) -> dict:
        from megatron.training import get_args  # noqa: PLC0415

        args = get_args()
        return {"label": self.label, "global_batch_size": args.global_batch_size, "seq_length": args.seq_length,
                "tokens_per_step": args.global_batch_size * args.seq_length, "world_size": args.world_size,
                "argv": sys.argv[1:], "environment": {k: v for k, v in os.environ.items()
                                                        if k.startswith(("MEGATRON_DEEPEPV2_", "NCCL_ALGO"))}}

    def wrap(self, training_log: Any) -> Any:
        """Returns ``training_log`` with the recording around it."""
        import torch.distributed as dist  # noqa: PLC0415

        @functools.wraps(training_log)
        def recorded(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
            now = time.perf_counter()
            if not dist.is_initialized() or dist.get_rank() == 0:
                self._write(iteration, loss_dict, grad_norm, learning_rate, skipped_iter, now)
            return training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                                skipped_iter, grad_norm, *args, **kwargs)

        return recorded

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


def record(out: str, label: str, target: Sequence[str]) -> int:
    """Runs ``python -m megatron_deepepv2.run TARGET...`` with a :class:`StepRecorder` on Megatron's training log.

    Args:
        out: The JSON-lines file.
        label: The run's name.
        target: ``[SCRIPT, ARGS...]`` as for ``megatron_deepepv2.run``.

    Returns:
        The runner's exit status.
    """
    import megatron_deepepv2  # noqa: PLC0415
    from megatron_deepepv2 import run  # noqa: PLC0415

    megatron_deepepv2.install()  # before Megatron's training modules are imported (run.main's install is then a no-op)
    import megatron.training.training as training  # noqa: PLC0415

    training.training_log = StepRecorder(out, label).wrap(training.training_log)
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
            "median_step_ms": None if step_s is None else step_s * 1e3,
            "tokens_per_s": None if not step_s or not tokens else tokens / step_s,
            "first_loss": steps[0]["losses"].get("lm loss") if steps else None,
            "last_loss": steps[-1]["losses"].get("lm loss") if steps else None,
            "loss": {str(s["iteration"]): s["losses"].get("lm loss") for s in steps},
            "environment": run["header"].get("environment", {})}


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


def report(paths: Sequence[str], baseline: Optional[str], equal: Sequence[str], skip: int) -> dict:
    """The comparison document of recorded runs.

    Args:
        paths: Runs to summarise (JSON-lines files).
        baseline: Label of the run the others' loss gaps are taken against, or None.
        equal: ``A.jsonl:B.jsonl`` pairs that must be bitwise equal where their iterations overlap.
        skip: Warm-up steps left out of the step time.

    Returns:
        ``{"runs": [...], "loss_gap": {label: ...}, "bitwise": [...]}``.
    """
    runs = [load(p) for p in paths]
    by_label = {r["label"]: r for r in runs}
    document: dict = {"runs": [summarise(r, skip) for r in runs], "skip": skip}
    if baseline is not None:
        if baseline not in by_label:
            raise ValueError(f"baseline {baseline!r} is not one of the runs' labels: {sorted(by_label)}.")
        document["baseline"] = baseline
        document["loss_gap"] = {r["label"]: loss_gap(r, by_label[baseline]) for r in runs if r["label"] != baseline}
    document["bitwise"] = []
    for pair in equal:
        first, _, second = pair.partition(":")
        a, b = load(first), load(second)
        document["bitwise"].append({"runs": [a["label"], b["label"]], **bitwise_equal(a, b)})
    return document


def plot(document: dict, path: str) -> None:
    """Loss per step of every run (left) and tokens/s per run (right)."""
    fig, _ = new_figure(12, 4.2)
    fig.clf()
    left, right = fig.subplots(1, 2)
    for run in document["runs"]:
        steps = sorted(run["loss"], key=int)
        left.plot([int(s) for s in steps], [run["loss"][s] for s in steps], label=run["label"], linewidth=1)
    left.set_xlabel("iteration")
    left.set_ylabel("lm loss")
    left.set_yscale("log")
    left.legend(fontsize=8)
    left.set_title("loss per step")
    timed = [r for r in document["runs"] if r["tokens_per_s"]]
    bars = right.bar(range(len(timed)), [r["tokens_per_s"] / 1e3 for r in timed])
    right.bar_label(bars, fmt="%.0f", fontsize=7)
    right.set_xticks(range(len(timed)), [r["label"] for r in timed], rotation=20, ha="right", fontsize=7)
    right.set_ylabel("thousand tokens / s")
    right.set_title("throughput (median step)")
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run a training script, recording every step")
    rec.add_argument("--out", required=True, help="JSON-lines file")
    rec.add_argument("--label", default=None, help="the run's name (default: the file name)")
    rec.add_argument("target", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    rep = commands.add_parser("report", help="compare recorded runs: JSON + PNG")
    rep.add_argument("runs", nargs="+", help="JSON-lines files")
    rep.add_argument("--out", required=True, help="output folder")
    rep.add_argument("--name", default="training", help="output file name without extension")
    rep.add_argument("--baseline", default=None, help="label of the run to take loss gaps against")
    rep.add_argument("--equal", action="append", default=[], help="A.jsonl:B.jsonl, bitwise equal where they overlap")
    rep.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the step time")
    args = parser.parse_args(argv)
    if args.command == "record":
        target = args.target[1:] if args.target[:1] == ["--"] else args.target
        if not target:
            parser.error("record needs the script to run: record --out FILE -- SCRIPT [ARGS...]")
        label = args.label or os.path.splitext(os.path.basename(args.out))[0]
        return record(args.out, label, target)
    setup_logging()
    document = report(args.runs, args.baseline, args.equal, args.skip)
    for run in document["runs"]:
        logger.info("%-28s %4d steps  loss %.4f -> %.4f  %8.1f ms/step  %9.0f tokens/s", run["label"], run["steps"],
                    run["first_loss"] or float("nan"), run["last_loss"] or float("nan"),
                    run["median_step_ms"] or float("nan"), run["tokens_per_s"] or float("nan"))
    for label, gap in document.get("loss_gap", {}).items():
        logger.info("loss gap %s vs %s: %s", label, document["baseline"], gap)
    for check in document["bitwise"]:
        logger.info("bitwise %s: %s", " vs ".join(check["runs"]), check)
    write_outputs(args.out, args.name, document, plot)
    return 0 if all(check["equal"] for check in document["bitwise"]) else 1


if __name__ == "__main__":
    sys.exit(main())
