"""Several models' training rounds side by side: each model's step time per configuration, its targets, and what a
trace says each target can reach at best.

Reads the reports ``tools/train_gpt.py report`` writes (one per model, from ``rounds`` with ``--target``) and,
optionally, the ``tools/trace_summary.py`` summary of a model's traced runs (``rounds --profile-last``)::

    python tools/rounds_summary.py --out docs --name training_rounds_te_h100_ep1 \\
        gpt-moe=docs/training_rounds_gpt_moe_te_h100_ep1.json,docs/training_rounds_gpt_moe_te_h100_ep1_trace.json \\
        qwen3-moe-router=docs/training_rounds_qwen3_moe_router_te_h100_ep1.json

For a target whose run was traced, ``gpu_floor_ratio`` is the run's GPU-busy time per step in the trace (kernels,
copies and memsets, their union) over the baseline's median step: the ratio the run would reach if it lost every
microsecond its GPU sat idle and kept its own GPU work. A target below it needs less GPU work, not less host work.
The profiler adds host time to every launch; the GPU-busy time is read from the traced steps as an estimate of the
untraced ones'.

Writes ``<name>.json`` and ``<name>.png`` (each model's median step per configuration, every round's run as a dot).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import train_gpt  # noqa: E402
from tools._bench import new_panels, provenance, save_figure, setup_logging, write_outputs  # noqa: E402

logger = logging.getLogger("rounds_summary")


def _load(path: str) -> dict:
    """The JSON document at ``path``."""
    with open(path) as f:
        return json.load(f)


def model_summary(report_path: str, trace_path: Optional[str] = None) -> dict[str, Any]:
    """:func:`_model_summary`, a report or trace without a field it reads raising ValueError (naming both files)."""
    try:
        return _model_summary(report_path, trace_path)
    except (KeyError, TypeError) as error:
        raise ValueError(f"{report_path} (trace {trace_path}) lacks {error}: give the JSONs tools/train_gpt.py report "
                         "and tools/trace_summary.py write") from error


def _model_summary(report_path: str, trace_path: Optional[str] = None) -> dict[str, Any]:
    """One model's rounds: its configurations (median step, each round's, experts, graphs, first step), its targets
    (with ``gpu_floor_ratio`` where the target's run was traced), its machine and commits.

    Args:
        report_path: A ``tools/train_gpt.py report`` JSON.
        trace_path: A ``tools/trace_summary.py`` JSON of some of the report's configurations (labels as in the
            report), or None.

    Returns:
        ``{"report", "trace", "machine", "provenance", "configurations", "targets"}``: ``provenance`` as the report
        recorded it.

    Raises:
        ValueError: The report has no configurations or no targets, or the trace names a configuration the report
            lacks; (:func:`model_summary`) a field it reads is missing.
    """
    report = _load(report_path)
    recorded = report.get("provenance") or {}
    if not report.get("configurations") or not report.get("targets"):
        raise ValueError(f"{report_path}: no configurations or no targets; give tools/train_gpt.py report the "
                         "runs of rounds and --target")
    configurations = {label: {key: entry.get(key) for key in ("experts", "median_step_ms", "median_step_ms_each",
                                                              "rounds", "spread_pct", "first_step_s_each",
                                                              "cuda_graphs")}
                      for label, entry in report["configurations"].items()}
    traced = _load(trace_path)["summaries"] if trace_path else {}
    unknown = sorted(set(traced) - set(configurations))
    if unknown:
        raise ValueError(f"{trace_path}: traces {unknown} are not among {report_path}'s configurations "
                         f"{sorted(configurations)}; label each trace as its configuration")
    for label, trace in traced.items():
        configurations[label]["traced"] = {key: trace[key] for key in ("wall_ms", "gpu_busy_ms", "gpu_idle_ms")}
    targets = []
    for target in report["targets"]:
        entry = {key: target[key] for key in ("run", "baseline", "experts", "limit", "round_limit", "ratio",
                                              "round_ratios", "min_ratio", "max_ratio", "met")}
        if target["run"] in traced:
            entry["gpu_floor_ratio"] = (traced[target["run"]]["gpu_busy_ms"]
                                        / configurations[target["baseline"]]["median_step_ms"])
        targets.append(entry)
    return {"report": report_path, "trace": trace_path, "machine": report.get("machine"),
            "provenance": recorded, "configurations": configurations, "targets": targets}


def summarise(models: dict[str, tuple[str, Optional[str]]]) -> dict[str, Any]:
    """Puts the models' rounds side by side.

    Args:
        models: Per model, its report and its trace summary (or None), as :func:`parse_model` gives them.

    Returns:
        ``{"provenance", "models", "targets"}``: :func:`model_summary` per model; per target (``RUN/BASELINE``) its
        limit and each model's ratio, whether it was met and its GPU-busy floor, in the order given; the runs'
        provenance (:func:`runs_provenance`).

    Raises:
        ValueError: As :func:`model_summary`, or when two models judge one target against different limits.
    """
    summaries = {model: model_summary(report, trace) for model, (report, trace) in models.items()}
    by_target: dict[str, dict[str, Any]] = {}
    for model, summary in summaries.items():
        for target in summary["targets"]:
            key = f"{target['run']}/{target['baseline']}"
            row = by_target.setdefault(key, {"limit": target["limit"], "round_limit": target["round_limit"]})
            if (row["limit"], row["round_limit"]) != (target["limit"], target["round_limit"]):
                raise ValueError(f"{model} judges {key} against {target['limit']} (rounds {target['round_limit']}), "
                                 f"an earlier model against {row['limit']} (rounds {row['round_limit']}): report "
                                 "every model with the same --target")
            row[model] = {"ratio": target["ratio"], "met": target["met"],
                          "gpu_floor_ratio": target.get("gpu_floor_ratio")}
    return {"provenance": runs_provenance(summaries), "models": summaries, "targets": by_target}


def runs_provenance(summaries: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where the figures come from: the reports' runs (:func:`tools.train_gpt.runs_provenance` over the reports'
    provenances), and ``summarised_by``, this checkout's own provenance.

    Args:
        summaries: :func:`model_summary` per model.
    """
    return {**train_gpt.runs_provenance(list(summaries.values())), "summarised_by": provenance()}


def plot(document: dict, path: str) -> None:
    """One panel per model: the median step per configuration (bars, each target's baseline beside its run), each
    round's run (dots), a traced run's GPU-busy time (dashed), and the targets' median ratios in the title.

    Args:
        document: As :func:`summarise` returns it.
        path: The PNG file.
    """
    models = document["models"]
    fig, axes = new_panels(5.0 * len(models), 4.2, len(models))
    for ax, (model, summary) in zip(axes, models.items()):
        paired = [label for t in summary["targets"] for label in (t["baseline"], t["run"])]
        labels = list(dict.fromkeys([*paired, *summary["configurations"]]))
        for i, label in enumerate(labels):
            entry = summary["configurations"][label]
            ax.bar(i, entry["median_step_ms"], color="tab:orange" if label.startswith("deepepv2") else "tab:blue")
            ax.plot([i] * len(entry["median_step_ms_each"]), entry["median_step_ms_each"], "k.", markersize=4)
            ax.annotate(f"{entry['median_step_ms']:.1f}", (i, entry["median_step_ms"]), ha="center", va="bottom",
                        fontsize=7)
            if "traced" in entry:
                busy = entry["traced"]["gpu_busy_ms"]
                ax.plot([i - 0.4, i + 0.4], [busy, busy], "k--", linewidth=1)
                ax.annotate(f"GPU busy {busy:.1f}", (i, busy), ha="center", va="top", fontsize=6)
        ax.set_xticks(range(len(labels)), [f"{label}\n{summary['configurations'][label]['experts']}"
                                           for label in labels], rotation=20, ha="right", fontsize=6)
        ratios = "\n".join(f"{t['run']} / {t['baseline']}: {t['ratio']:.2f}x (limit {t['limit']:.2f})"
                           for t in summary["targets"])
        ax.set_title(f"{model}\n{ratios}", fontsize=7)
        ax.set_ylabel("median step (ms)")
    save_figure(fig, path)


def parse_model(argument: str) -> tuple[str, tuple[str, Optional[str]]]:
    """``MODEL=REPORT[,TRACE]`` as ``(model, (report, trace))``.

    Raises:
        ValueError: Not of that form.
    """
    model, _, files = argument.partition("=")
    paths = files.split(",") if files else []
    if not model or len(paths) not in (1, 2) or not all(paths):
        raise ValueError(f"{argument!r}: give MODEL=REPORT.json or MODEL=REPORT.json,TRACE.json")
    return model, (paths[0], paths[1] if len(paths) == 2 else None)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", metavar="MODEL=REPORT[,TRACE]",
                        help="a model's train_gpt.py report and, optionally, the trace_summary.py JSON of its traces")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", default="rounds_summary", help="output file name without extension")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        parsed = [parse_model(argument) for argument in args.models]
        repeated = sorted({model for model, _ in parsed if [m for m, _ in parsed].count(model) > 1})
        if repeated:
            raise ValueError(f"models given more than once: {repeated}; give each model one REPORT[,TRACE]")
        models = dict(parsed)
        document = summarise(models)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    for target, row in document["targets"].items():
        logger.info("%s (limit %.2f):", target, row["limit"])
        for model in models:
            if model in row:
                floor = row[model]["gpu_floor_ratio"]
                logger.info("  %-20s %.3f %s%s", model, row[model]["ratio"], "met" if row[model]["met"] else "NOT met",
                            f"; GPU-busy floor {floor:.3f}" if floor is not None else "")
    write_outputs(args.out, args.name, document, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
