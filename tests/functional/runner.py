"""What the GPU functional case files (``deepep_cases.py``, ``te_cases.py``) share: a registry of named cases, the
rank-0 log, the bitwise comparison, and ``main``, which runs the selected cases under ``torchrun`` (one process per
GPU), prints ``PASS name`` / ``SKIP name: reason`` / ``FAIL name`` per case and one summary line, and with
``--json=PATH`` records the run (each case's outcome, seconds and log lines; commit, date, GPU and versions)."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

RANK = int(os.environ.get("RANK", 0))

Case = Callable[[], None]
#: What :func:`log` printed since the running case started (rank 0), for the run's record.
_case_log: list[str] = []


def log(message: str) -> None:
    """Prints ``message`` on rank 0 (and keeps it for the running case's record)."""
    if RANK == 0:
        print(message, flush=True)
        _case_log.append(message)


def exact(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    """Asserts ``a`` and ``b`` have the same dtype, shape and bits (FP8 compared as bytes).

    Raises:
        AssertionError: Naming ``name`` and the largest difference.
    """
    assert a.dtype == b.dtype and a.shape == b.shape, f"{name}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                       b.view(torch.uint8) if b.element_size() == 1 else b):
        diff = (a.float() - b.float()).abs().max().item()
        raise AssertionError(f"{name}: not bitwise equal (max abs diff {diff:.3e})")


class CaseRegistry:
    """The cases of one file, in definition order, and the smallest world each needs."""

    def __init__(self) -> None:
        self.cases: dict[str, Case] = {}
        self.min_world: dict[str, tuple[int, str]] = {}

    def case(self, fn: Case) -> Case:
        """Registers ``fn`` as a case named after it."""
        self.cases[fn.__name__] = fn
        return fn

    def needs_world(self, size: int, reason: str) -> Callable[[Case], Case]:
        """Marks a case that runs only on ``size`` or more ranks, saying why."""
        def mark(fn: Case) -> Case:
            self.min_world[fn.__name__] = (size, reason)
            return fn
        return mark

    def select(self, argv: list[str]) -> list[str]:
        """The cases ``argv`` chooses, in definition order: those named (all when none is named), less each
        ``--except=NAME``; with ``--shard=I/N``, every N-th of them from the I-th on (the N shards partition them).

        Raises:
            SystemExit: A named case does not exist, or the shard is not ``I/N`` with ``0 <= I < N``.
        """
        excepted = {arg.removeprefix("--except=") for arg in argv if arg.startswith("--except=")}
        named = [arg for arg in argv if not arg.startswith("--")]
        unknown = [name for name in [*named, *excepted] if name not in self.cases]
        if unknown:
            raise SystemExit(f"unknown case(s) {unknown}; the cases are {list(self.cases)}")
        selected = [name for name in self.cases if (name in named or not named) and name not in excepted]
        for arg in argv:
            if arg.startswith("--shard="):
                selected = selected[slice(*_shard(arg.removeprefix("--shard=")))]
        return selected

    def main(self, argv: list[str], skip_all: Optional[str] = None, what: str = "") -> int:
        """Runs the cases :meth:`select` chooses from ``argv``; ``--json=PATH`` writes the run's record on rank 0.

        Each rank initialises an NCCL group over its GPU and Megatron's expert-parallel state first. After a failure
        on two or more ranks the run stops (the peers may be inside a collective); on one rank it goes on.

        Args:
            argv: Case names, ``--except=NAME``, ``--shard=I/N`` and ``--json=PATH`` options.
            skip_all: A reason every case is skipped for (e.g. a missing dependency), or None.
            what: One sentence for the record: what the case file checks.

        Returns:
            The exit status: 1 when a case failed, else 0.
        """
        from megatron_deepepv2 import destroy_buffers  # noqa: PLC0415
        from megatron_deepepv2.testing.moe_model import init_expert_parallel  # noqa: PLC0415

        selected = self.select(argv)  # a bad argument fails here, before any GPU work
        options = {arg.split("=", 1)[0]: arg.split("=", 1)[-1] for arg in argv if arg.startswith("--")}
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        init_expert_parallel()
        records: dict[str, dict[str, Any]] = {}
        world = dist.get_world_size()
        for name in selected:
            min_world, reason = self.min_world.get(name, (1, ""))
            why = skip_all or (f"needs {min_world}+ ranks ({reason})" if world < min_world else None)
            if why:
                records[name] = {"outcome": "skipped", "reason": why}
                log(f"SKIP {name}: {why}")
                continue
            _case_log.clear()
            start = time.perf_counter()
            try:
                self.cases[name]()
                dist.barrier()
            except Exception:  # noqa: BLE001 - reported per case
                failure = traceback.format_exc()
                records[name] = {"outcome": "failed", "seconds": round(time.perf_counter() - start, 1),
                                 "log": list(_case_log), "traceback": failure[-4000:]}
                print(f"FAIL {name} on rank {RANK}\n{failure}", flush=True)
                destroy_buffers()
                if world > 1:
                    break  # peers may be inside a collective; stop instead of hanging
                continue
            records[name] = {"outcome": "passed", "seconds": round(time.perf_counter() - start, 1),
                             "log": list(_case_log)}
            log(f"PASS {name} ({records[name]['seconds']:.1f}s)")
        counts = {outcome: sum(r["outcome"] == outcome for r in records.values())
                  for outcome in ("passed", "skipped", "failed")}
        summary = (f"cases at world {world}: {counts['passed']} passed, {counts['skipped']} skipped, "
                   f"{counts['failed']} failed of {len(selected)}")
        log(summary)
        if "--json" in options and RANK == 0:
            _write_record(options["--json"], what, world, summary, records)
        destroy_buffers()
        dist.destroy_process_group()
        return 1 if counts["failed"] else 0


def _shard(spec: str) -> tuple[int, None, int]:
    """``I/N`` as the slice ``I::N`` (the I-th of N shards, counting from 0).

    Raises:
        SystemExit: ``spec`` is not two integers with ``0 <= I < N``.
    """
    index, _, count = spec.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise SystemExit(f"--shard={spec}: expected I/N with 0 <= I < N, e.g. --shard=0/4")
    return int(index), None, int(count)


def _write_record(path: str, what: str, world: int, summary: str, records: dict[str, dict[str, Any]]) -> None:
    """Writes a run's record: what ran, its commit and date, the GPU, the versions and every case's outcome."""
    from tools import _bench  # noqa: PLC0415

    document = {"what": what, "command": " ".join(sys.argv), **_bench.provenance(__file__),
                "hardware": f"{world}x {torch.cuda.get_device_name()}", "versions": _bench.software_versions(),
                "summary": summary, "cases": records}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    sys.exit("run a case file (tests/functional/deepep_cases.py, tests/functional/te_cases.py) instead")
