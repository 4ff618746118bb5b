"""Megatron-Core's own flex-dispatcher tests, run against ``deepepv2``: the package's conformance to Megatron.

Runs ``TestFlexDispatcher`` of a Megatron-LM tree's ``tests/unit_tests/transformer/moe/test_token_dispatcher.py``
under ``torchrun`` (one rank per visible GPU), once per configuration: each backend (``deepep``: DeepEP's
``ElasticBuffer``; ``reference``: PyTorch collectives) with and without host sync. The tests are Megatron's, unchanged
except for the flex backend list and the ``(tp, ep)`` pairs (see ``tools/pytest_plugins/megatron_deepepv2_conformance.py``);
the tree's ``megatron`` package is the one imported, as in Megatron's CI.

::

    python tools/megatron_conformance.py --megatron-lm /path/to/Megatron-LM          # what `make test-megatron` runs
    python tools/megatron_conformance.py --megatron-lm ML --backends reference --host-sync on

Prints progress and, per configuration, each case's outcome and every skip with its reason; writes
``<out>/megatron_conformance.json``. Exit status 1 when a case failed or a run ended in error, 0 otherwise (a machine
without CUDA skips every case: Megatron's tests need GPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron_deepepv2.testing.spawn import free_port  # noqa: E402
from tools import _bench  # noqa: E402

logger = logging.getLogger("megatron_conformance")

TEST_FILE = "tests/unit_tests/transformer/moe/test_token_dispatcher.py"
TEST_CLASS = "TestFlexDispatcher"
PLUGIN = "megatron_deepepv2_conformance"
PLUGIN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pytest_plugins")
BACKENDS = ("deepep", "reference")
HOST_SYNC = ("on", "off")


@dataclasses.dataclass(frozen=True)
class Configuration:
    """One run of the tests: the package's backend and whether a dispatch waits on the host."""

    backend: str
    host_sync: bool

    @property
    def name(self) -> str:
        return f"{self.backend}-{'hostsync' if self.host_sync else 'nohostsync'}"

    def environment(self) -> dict[str, str]:
        """The package's settings for the run. Without host sync the experts must take device-side counts, and
        Megatron's tests build ``SequentialMLP`` from the local spec, so those runs swap in the sync-free experts as
        an unchanged training script does (``MEGATRON_DEEPEPV2_EXPERTS=sync_free``)."""
        settings = {"MEGATRON_DEEPEPV2_BACKEND": self.backend, "MEGATRON_DEEPEPV2_NO_HOST_SYNC": "0" if self.host_sync
                    else "1"}
        return settings if self.host_sync else {**settings, "MEGATRON_DEEPEPV2_EXPERTS": "sync_free"}


def visible_gpus() -> int:
    """CUDA devices this process sees (0 without CUDA)."""
    import torch  # noqa: PLC0415

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def read_reports(paths: list[str]) -> dict[str, dict[str, Any]]:
    """Per test case, its outcome over the ranks' JUnit reports.

    Args:
        paths: One JUnit XML file per rank.

    Returns:
        Case id -> ``{"outcome": "passed" | "failed" | "skipped", "detail": str, "seconds": float}``: failed when any
        rank failed or erred, skipped when rank 0 skipped (the detail is the reason), else passed.
    """
    cases: dict[str, dict[str, Any]] = {}
    for rank, path in enumerate(sorted(paths)):
        for case in ElementTree.parse(path).iter("testcase"):
            case_id = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
            failure = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            seen = cases.setdefault(case_id, {"outcome": "passed", "detail": "", "seconds": 0.0})
            seen["seconds"] = max(seen["seconds"], float(case.get("time", 0.0)))
            if failure is not None:
                seen.update(outcome="failed", detail=f"rank {rank}: {failure.get('message', '')[:500]}")
            elif skipped is not None and seen["outcome"] != "failed":
                seen.update(outcome="skipped", detail=skipped.get("message", ""))
    return cases


def run_configuration(config: Configuration, megatron_lm: str, nproc: int, out: str, timeout: float) -> dict[str, Any]:
    """Runs Megatron's flex-dispatcher tests under ``torchrun`` (one rank: in one process with its variables) with
    ``config``.

    Args:
        config: Backend and host-sync setting.
        megatron_lm: The Megatron-LM tree (its ``tests/`` and ``megatron/``).
        nproc: Ranks (one per GPU).
        out: Folder for the ranks' JUnit reports and the log.
        timeout: Seconds the run may take.

    Returns:
        ``exit`` (torchrun's status), ``seconds``, ``cases`` (see :func:`read_reports`) and ``log`` (its path).
    """
    reports = os.path.join(out, config.name)
    os.makedirs(reports, exist_ok=True)
    for stale in os.listdir(reports):
        os.remove(os.path.join(reports, stale))
    env = {**os.environ, **config.environment(),
           "PYTHONPATH": os.pathsep.join(filter(None, [megatron_lm, PLUGIN_DIR, os.environ.get("PYTHONPATH")]))}
    if nproc == 1:  # torchrun's variables for one rank, without its launcher process
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()))
        launcher = [sys.executable]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                    str(free_port())]
    command = [*launcher, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "-rs",
               f"--junitxml={os.path.join(reports, 'rank{rank}.xml')}", f"{TEST_FILE}::{TEST_CLASS}"]
    log_path = os.path.join(out, f"{config.name}.log")
    started = time.monotonic()
    with open(log_path, "w") as log:
        try:
            code = subprocess.run(command, cwd=megatron_lm, env=env, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = -1
            log.write(f"\nmegatron_conformance: killed after {timeout:.0f} s\n")
    xml = [os.path.join(reports, name) for name in os.listdir(reports) if name.endswith(".xml")]
    return {"exit": code, "seconds": round(time.monotonic() - started, 1), "cases": read_reports(xml) if xml else {},
            "log": log_path}


def verdict(runs: dict[str, dict[str, Any]]) -> Optional[str]:
    """Why the conformance run failed, or None: a failed case, or a run that ended in error or reported nothing."""
    problems = []
    for name, run in runs.items():
        failed = [case for case, result in run["cases"].items() if result["outcome"] == "failed"]
        if failed:
            problems.append(f"{name}: {len(failed)} failed ({', '.join(failed)})")
        elif run["exit"] != 0 or not run["cases"]:
            problems.append(f"{name}: exit {run['exit']} with {len(run['cases'])} cases reported; see {run['log']}")
    return "; ".join(problems) or None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM tree with tests/ and megatron/")
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--host-sync", nargs="+", choices=HOST_SYNC, default=list(HOST_SYNC))
    parser.add_argument("--nproc", type=int, help="ranks (default: one per visible GPU, at least 1; the JSON's gpus is "
                        "then null)")
    parser.add_argument("--out", default="runs/megatron-conformance", help="reports, logs and the JSON")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    args = parser.parse_args(argv)
    _bench.setup_logging()
    megatron_lm = os.path.abspath(args.megatron_lm)
    if not os.path.isfile(os.path.join(megatron_lm, TEST_FILE)):
        parser.error(f"{megatron_lm} has no {TEST_FILE}: point --megatron-lm at a Megatron-LM checkout (its tests/ "
                     "and megatron/)")
    gpus = None if args.nproc else visible_gpus()
    nproc = args.nproc or max(gpus, 1)
    from megatron_deepepv2.cli.doctor import disable_gin_without_rdma  # noqa: PLC0415

    disable_gin_without_rdma()  # as `python -m megatron_deepepv2.cli.run` does: the ranks inherit it
    configs = [Configuration(backend, sync == "on") for backend in args.backends for sync in args.host_sync]
    runs: dict[str, dict[str, Any]] = {}
    for config in configs:
        logger.info("%s: Megatron's %s on %d rank(s), %s", config.name, TEST_CLASS, nproc,
                    " ".join(f"{k}={v}" for k, v in config.environment().items()))
        run = runs[config.name] = run_configuration(config, megatron_lm, nproc, args.out, args.timeout)
        counts = {outcome: sum(r["outcome"] == outcome for r in run["cases"].values())
                  for outcome in ("passed", "failed", "skipped")}
        logger.info("%s: exit %d in %.0f s: %s", config.name, run["exit"], run["seconds"],
                    ", ".join(f"{n} {k}" for k, n in counts.items()))
        for case, result in run["cases"].items():
            logger.info("    %-7s %s%s", result["outcome"], case, f"  ({result['detail']})" if result["detail"] else "")
    problem = verdict(runs)
    document = {"megatron_lm": megatron_lm, "test": f"{TEST_FILE}::{TEST_CLASS}", "ranks": nproc, "gpus": gpus,
                **_bench.provenance(), "runs": runs, "verdict": problem or "every case that ran passed"}
    _bench.write_outputs(args.out, "megatron_conformance", document)
    if problem:
        logger.error("conformance: %s", problem)
        return 1
    ran = sum(r["outcome"] == "passed" for run in runs.values() for r in run["cases"].values())
    logger.info("conformance: %d case(s) passed over %d configuration(s)%s", ran, len(runs),
                "" if ran else "; none ran (Megatron's dispatcher tests need CUDA GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
