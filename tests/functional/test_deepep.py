"""Functional suite: the DeepEP v2 path against independent paths, on the GPUs there are.

Needs CUDA GPUs with DeepEP v2 (``deep_ep.ElasticBuffer``); skipped with the reason otherwise. One GPU runs every
case at EP=1 (a 1-rank group: every kernel, stream, event, graph and determinism property, no NVLink traffic);
two GPUs run them at EP2, with uneven tokens and an empty rank, and 4 or 8 at node size. Each test starts its own
``torchrun`` (one-GPU jobs share the GPU: :mod:`tests.gpu_jobs`), so it runs from ``pytest`` / ``make test`` with
``-n`` workers. The training comparison on the GPUs is ``make demo``, which ``tests/cli/test_readme.py`` runs.
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.gpu_jobs import run_gpu_job, torchrun_command


def skip_reason(min_gpus: int) -> str | None:
    if torch.cuda.device_count() < min_gpus:
        return f"needs >= {min_gpus} CUDA GPU(s) (found {torch.cuda.device_count()})"
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend

    return DeepEPBackend.unavailable_reason()


pytestmark = [pytest.mark.gpu]


#: Cases another suite runs in a job of its own at one or two GPUs: tests/determinism runs the replays.
OWN_JOB_CASES = ("moe_layer_replays_bit_exact_in_deterministic_mode",)


def run_case_file(path: str, nproc: int, timeout: float, options: tuple[str, ...] = ()) -> tuple[int, int]:
    """Runs a case file under ``torchrun`` on ``nproc`` GPUs and asserts no case failed.

    Args:
        path: The case file, relative to the repository root.
        nproc: Ranks (one per GPU).
        timeout: Seconds the job may run (waiting for the GPU-job lock not counted).
        options: The case runner's options (``--except=NAME``, ``--shard=I/N``).

    Returns:
        ``(passed, skipped)`` case counts.
    """
    done = run_gpu_job(torchrun_command(path, *options, nproc=nproc), timeout=timeout, gpus=nproc)
    print(done.stdout[-6000:])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = re.search(r"cases at world \d+: (\d+) passed, (\d+) skipped, (\d+) failed of (\d+)", done.stdout)
    assert summary, done.stdout[-4000:]
    passed, skipped, failed, total = map(int, summary.groups())
    assert failed == 0 and passed + skipped == total and "FAIL" not in done.stdout, done.stdout[-4000:]
    return passed, skipped


#: The one-GPU cases run in this many jobs, which share the GPU (tests/gpu_jobs.py): most of a case's first seconds are
#: DeepEP's JIT compilation on the host, which then overlaps.
ONE_GPU_SHARDS = 4


def _run_cases(nproc: int, timeout: float, shard: str | None = None) -> None:
    options = (*(f"--except={name}" for name in (OWN_JOB_CASES if nproc <= 2 else ())),
               *((f"--shard={shard}",) if shard else ()))
    run_case_file("tests/functional/deepep_cases.py", nproc, timeout, options)


@pytest.mark.skipif(skip_reason(1) is not None, reason=str(skip_reason(1)))
@pytest.mark.timeout(900)
@pytest.mark.parametrize("shard", range(ONE_GPU_SHARDS))
def test_deepep_cases_on_one_gpu(shard: int) -> None:
    """Every case at EP=1 (a 1-rank group), a shard each: only the ones that need two ranks skip, each saying why."""
    _run_cases(1, timeout=880, shard=f"{shard}/{ONE_GPU_SHARDS}")


@pytest.mark.skipif(skip_reason(2) is not None, reason=str(skip_reason(2)))
@pytest.mark.timeout(900)
def test_deepep_cases_under_torchrun() -> None:
    """Every case at EP2: uneven token counts with an empty rank, NVLink traffic between the GPUs."""
    _run_cases(2, timeout=880)


def _node_size() -> int:
    """The largest expert-parallel size above 2 this machine's GPUs make (8 or 4), or 0."""
    count = torch.cuda.device_count()
    return 8 if count >= 8 else 4 if count >= 4 else 0


@pytest.mark.skipif(skip_reason(4) is not None, reason=f"EP4/EP8: {skip_reason(4)}")
@pytest.mark.timeout(1800)
def test_deepep_cases_at_node_size() -> None:
    """The same cases at EP4 or EP8 (every GPU of the node), where tokens reach few of many ranks."""
    _run_cases(_node_size(), timeout=1780)

