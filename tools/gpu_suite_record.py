"""The record of one or more ``make test`` runs on a GPU machine: pytest's outcome, the whole run's time and each
GPU job's wait and hold, as a JSON document (and a PNG of the GPU jobs' times) for ``docs/``.

A run is given as ``LABEL=JUNIT_XML,GPU_JOB_LOG[,SECONDS]``: pytest's ``--junitxml`` file, the GPU-job log the test
suite writes (``$TMPDIR/megatron_deepepv2_gpu_job.log``, one line per job: when it ended, the test, whether it shared
the GPU, the seconds it waited for the GPU and held it) and, optionally, what ``make test`` took end to end (the
environment check and the determinism gate before pytest included)::

    python tools/gpu_suite_record.py --out docs --name gpu_suite_h100_ep1 --target-s 300 --device "1x H100" \\
        plain=junit-plain.xml,gpu-job-plain.log,229 te=junit-te.xml,gpu-job-te.log,213

The provenance (commit, date) is this checkout's, or ``BENCH_GIT_REVISION``'s: run it from the tree that was tested.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ElementTree
from typing import Any, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools._bench import new_figure, provenance, save_figure, setup_logging, write_outputs  # noqa: E402

#: One line of the GPU-job log (tests/gpu_jobs.py writes it when a job lets the GPU go).
_JOB_LINE = re.compile(r"^(?P<ended>\d\d:\d\d:\d\d) (?P<test>.+?) \[(?P<gpus>\d+) GPUs?, (?P<mode>shared|alone)\]: "
                       r"waited (?P<waited>[\d.]+) s, held (?P<held>[\d.]+) s$")


def pytest_outcome(junit_xml: str) -> dict[str, Any]:
    """Counts and time of a pytest run from its JUnit XML (every ``testsuite`` summed), with the failed tests' ids and
    when it started.

    Raises:
        ValueError: The file holds no ``testsuite``.
    """
    root = ElementTree.parse(junit_xml).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    if not suites:
        raise ValueError(f"{junit_xml}: no <testsuite> element; is it pytest's --junitxml output?")
    total = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}" for suite in suites for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    return {"passed": total["tests"] - total["failures"] - total["errors"] - total["skipped"],
            "failed": total["failures"] + total["errors"], "skipped": total["skipped"],
            "pytest_s": round(sum(float(suite.get("time", 0.0)) for suite in suites), 1), "failed_tests": failed,
            "started": suites[0].get("timestamp")}


def gpu_jobs(log_path: str) -> list[dict[str, Any]]:
    """The GPU jobs of a run's GPU-job log, in the order they ended.

    Raises:
        ValueError: A line that is not a GPU-job line (named with its number).
    """
    jobs = []
    with open(log_path, encoding="utf-8") as log:
        for number, line in enumerate(log, 1):
            if not line.strip():
                continue
            match = _JOB_LINE.match(line.strip())
            if match is None:
                raise ValueError(f"{log_path}:{number}: not a GPU-job line: {line.strip()!r}")
            jobs.append({"test": match["test"].removesuffix(" (call)"), "ended": match["ended"],
                         "gpus": int(match["gpus"]), "shared": match["mode"] == "shared",
                         "waited_s": float(match["waited"]), "held_s": float(match["held"])})
    return jobs


def parse_run(text: str) -> tuple[str, str, str, Optional[float]]:
    """``LABEL=JUNIT_XML,GPU_JOB_LOG[,SECONDS]`` as its parts.

    Raises:
        ValueError: Not of that form.
    """
    label, _, rest = text.partition("=")
    parts = rest.split(",")
    if not label or len(parts) not in (2, 3):
        raise ValueError(f"{text!r}: expected LABEL=JUNIT_XML,GPU_JOB_LOG[,SECONDS]")
    return label, parts[0], parts[1], float(parts[2]) if len(parts) == 3 else None


def record(runs: Sequence[str], target_s: Optional[float], device: Optional[str] = None) -> dict[str, Any]:
    """The document of ``runs`` (see :func:`parse_run`): each run's outcome, start, time, GPU jobs, and whether it met
    ``target_s`` (seconds of ``make test``, else of pytest, when no end-to-end time was given).

    Args:
        runs: ``LABEL=JUNIT_XML,GPU_JOB_LOG[,SECONDS]`` each.
        target_s: The most seconds a run may take, or None.
        device: The GPU machine the runs ran on, in words (the files do not say).

    Returns:
        ``{"provenance", "device", "target_s", "runs": {label: {...}}}``.
    """
    document: dict[str, Any] = {"provenance": provenance(), "device": device, "target_s": target_s, "runs": {}}
    for text in runs:
        label, junit_xml, log_path, seconds = parse_run(text)
        outcome = pytest_outcome(junit_xml)
        jobs = gpu_jobs(log_path)
        took = seconds if seconds is not None else outcome["pytest_s"]
        document["runs"][label] = {
            **outcome, "make_test_s": seconds, "gpu_jobs": jobs,
            "longest_wait_s": max((job["waited_s"] for job in jobs), default=0.0),
            "green": outcome["failed"] == 0,
            "met": None if target_s is None else outcome["failed"] == 0 and took <= target_s}
    return document


def plot(document: dict[str, Any], path: str) -> None:
    """Each run's GPU jobs as bars: the seconds each waited for the GPU, then held it."""
    rows = [(f"{label}: {job['test'].rsplit('::', 1)[-1][:48]}", job["waited_s"], job["held_s"])
            for label, run in document["runs"].items() for job in run["gpu_jobs"]]
    fig, ax = new_figure(10, 0.3 * len(rows) + 1.5)
    positions = range(len(rows))  # by position: a test holding the GPU twice (one job after another) is two bars
    ax.barh(positions, [row[1] for row in rows], color="#bbbbbb", label="waited for the GPU")
    ax.barh(positions, [row[2] for row in rows], left=[row[1] for row in rows], color="#4477aa", label="held the GPU")
    ax.set_yticks(list(positions), [row[0] for row in rows])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title("make test on a GPU machine: each GPU job's wait and hold")
    ax.legend(loc="lower right")
    save_figure(fig, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="LABEL=JUNIT_XML,GPU_JOB_LOG[,SECONDS]")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--name", default="gpu_suite", help="output file name without extension")
    parser.add_argument("--target-s", type=float, default=None, help="the most seconds a run may take")
    parser.add_argument("--device", default=None, help="the GPU machine the runs ran on, in words")
    args = parser.parse_args(argv)
    setup_logging()
    try:
        document = record(args.runs, args.target_s, args.device)
    except (OSError, ValueError, ElementTree.ParseError) as error:
        parser.error(str(error))
    write_outputs(args.out, args.name, document, plot)
    return 0 if all(run["green"] and run["met"] is not False for run in document["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
