"""Functional suite under Transformer Engine: ``tests/functional/te_cases.py`` (deepepv2 with TE layers, TE experts,
fused permute, TE's FP8 recipes, deterministic mode and CUDA graphs) on one GPU, and at EP2 on two.

Skipped with the reason without CUDA GPUs, DeepEP v2 or Transformer Engine. Where Transformer Engine is installed,
every case must run: none may skip.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.functional.test_deepep import run_case_file, skip_reason

pytestmark = [pytest.mark.gpu]

CASE_FILE = "tests/functional/te_cases.py"


def te_skip_reason(min_gpus: int) -> str | None:
    """Why the Transformer Engine cases cannot run on ``min_gpus`` GPUs here, or None."""
    if importlib.util.find_spec("transformer_engine") is None:
        return "needs Transformer Engine (transformer_engine is not installed)"
    return skip_reason(min_gpus)


@pytest.mark.skipif(te_skip_reason(1) is not None, reason=str(te_skip_reason(1)))
@pytest.mark.timeout(900)
def test_te_cases_on_one_gpu() -> None:
    """Every Transformer Engine case at EP=1: each runs (Transformer Engine is installed) and passes."""
    passed, skipped = run_case_file(CASE_FILE, 1, timeout=880)
    assert skipped == 0 and passed > 0, (passed, skipped)


@pytest.mark.skipif(te_skip_reason(2) is not None, reason=str(te_skip_reason(2)))
@pytest.mark.timeout(900)
def test_te_cases_under_torchrun() -> None:
    """Every Transformer Engine case at EP2: tokens cross NVLink to the other rank's experts."""
    passed, skipped = run_case_file(CASE_FILE, 2, timeout=880)
    assert skipped == 0 and passed > 0, (passed, skipped)
