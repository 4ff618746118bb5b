"""``make test-megatron``'s runner and plugin on a Megatron-LM-shaped tree: the flex backend list becomes ``deepepv2``
and the ``(tp, ep)`` pairs those the world runs, the skip about Megatron's own backends goes, the package's settings
reach the tests, and a failed case on any rank fails the run while skips are listed with their reasons."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests import preloaded_python

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools" / "pytest_plugins"))
import megatron_deepepv2_conformance as plugin  # noqa: E402

from tools import megatron_conformance  # noqa: E402

# The shape of Megatron's TestFlexDispatcher: a class skipped for Megatron's own backends, cases parametrized over
# backends and (tp, ep) pairs that need 8 ranks. Each case records what it was given; one fails without host sync, one
# skips with its reason. Two are not the flex backend's to pass: one builds Megatron's NCCL-EP dispatcher itself (it
# would fail here), and an FP8 case, which SyncFreeSequentialMLP experts must refuse (one stand-in refuses, one not).
UPSTREAM_LIKE = textwrap.dedent("""
    import os
    import pytest

    @pytest.mark.skipif(True, reason="Deep EP and Hybrid EP are not available")
    class TestFlexDispatcher:
        @pytest.mark.parametrize("tp_size,ep_size", [(1, 8), (8, 1), (4, 2)])
        @pytest.mark.parametrize("moe_flex_dispatcher_backend", ["deepep", "hybridep"])
        @pytest.mark.parametrize("permute_fusion", [False])
        def test_forward_backward(self, tp_size, ep_size, moe_flex_dispatcher_backend, permute_fusion):
            assert moe_flex_dispatcher_backend == "deepepv2"
            assert os.environ["MEGATRON_DEEPEPV2_BACKEND"] == "reference"
            assert os.environ["MEGATRON_DEEPEPV2_NO_HOST_SYNC"] == "0", "fails without host sync"

        @pytest.mark.skipif(True, reason="TE 1.7.0 is required for MoE with FP8.")
        @pytest.mark.parametrize("tp_size,ep_size", [(1, 8)])
        def test_capacity_forward_backward(self, tp_size, ep_size):
            pass

        @pytest.mark.parametrize("tp_size,ep_size", [(1, 8)])
        def test_forward_backward_zero_copy(self, tp_size, ep_size):
            raise AssertionError("NCCL EP dispatcher requires TPxEP > 1")

        @pytest.mark.parametrize("tp_size,ep_size", [(1, 8)])
        @pytest.mark.parametrize("refuses", [True, False])
        def test_router_padding_for_fp8_forward_backward(self, tp_size, ep_size, refuses):
            if refuses and os.environ.get("MEGATRON_DEEPEPV2_EXPERTS") == "sync_free":
                raise ValueError("SyncFreeSequentialMLP runs BF16/FP32 grouped GEMMs; drop --fp8-format")
""")


@pytest.fixture
def megatron_tree(tmp_path: Path) -> Path:
    test_file = tmp_path / megatron_conformance.TEST_FILE
    test_file.parent.mkdir(parents=True)
    test_file.write_text(UPSTREAM_LIKE)
    return tmp_path


@pytest.mark.parametrize("world, pairs", [(1, [(1, 1)]), (2, [(1, 2), (2, 1)]), (8, [(1, 8), (8, 1), (4, 2)]),
                                          (16, [(1, 8), (8, 1), (4, 2)])])
def test_pairs_are_upstreams_that_fit_else_the_whole_world(world: int, pairs: list) -> None:
    assert plugin.runnable_pairs([(1, 8), (8, 1), (4, 2)], world) == pairs


def test_runner_fails_on_a_failed_case_and_lists_skips_with_reasons(megatron_tree: Path, tmp_path: Path) -> None:
    """One rank, with and without host sync: the flex class's cases get deepepv2 and (1, 1), and its class skip is
    gone; the configuration's settings reach the tests; a failure fails the run, a skip is listed with its reason; the
    NCCL-EP case skips saying what it builds; without host sync (sync-free experts) an FP8 case must fail with the
    package's refusal, and one that does not fails the run; with host sync FP8 cases run as they are."""
    out = tmp_path / "out"
    done = subprocess.run([preloaded_python.python(), str(ROOT / "tools" / "megatron_conformance.py"), "--megatron-lm",
                           str(megatron_tree), "--backends", "reference", "--host-sync", "on", "off", "--nproc", "1",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    document = json.loads((out / "megatron_conformance.json").read_text())
    assert sorted(document["runs"]) == ["reference-hostsync", "reference-nohostsync"], document["runs"]
    for name, run in document["runs"].items():
        cases = {case.split("::", 1)[1]: result for case, result in run["cases"].items()}
        assert sorted(cases) == ["test_capacity_forward_backward[1-1]", "test_forward_backward[False-deepepv2-1-1]",
                                 "test_forward_backward_zero_copy[1-1]",
                                 "test_router_padding_for_fp8_forward_backward[False-1-1]",
                                 "test_router_padding_for_fp8_forward_backward[True-1-1]"], run["cases"]
        capacity = cases["test_capacity_forward_backward[1-1]"]
        assert capacity == {**capacity, "outcome": "skipped", "detail": "TE 1.7.0 is required for MoE with FP8."}
        zero_copy = cases["test_forward_backward_zero_copy[1-1]"]
        assert zero_copy["outcome"] == "skipped" and "not a deepepv2 case: tests Megatron's NCCL-EP dispatcher" in \
            zero_copy["detail"], cases
        forward = cases["test_forward_backward[False-deepepv2-1-1]"]
        refusing, accepting = (cases[f"test_router_padding_for_fp8_forward_backward[{refuses}-1-1]"]
                               for refuses in ("True", "False"))
        if name == "reference-hostsync":
            assert forward["outcome"] == refusing["outcome"] == accepting["outcome"] == "passed", cases
        else:
            assert forward["outcome"] == "failed" and "fails without host sync" in forward["detail"], cases
            assert refusing["outcome"] == "skipped" and "refuses FP8 experts" in refusing["detail"], cases
            assert accepting["outcome"] == "failed", cases  # the refusal must happen
    assert "reference-nohostsync: 2 failed" in document["verdict"] and "2 failed" in done.stderr, document["verdict"]


def test_reports_fail_a_case_that_failed_on_any_rank(tmp_path: Path) -> None:
    def report(rank: int, body: str) -> str:
        path = tmp_path / f"rank{rank}.xml"
        path.write_text(f'<testsuites><testsuite><testcase classname="t.TestFlexDispatcher" name="a" time="1">{body}'
                        '</testcase></testsuite></testsuites>')
        return str(path)

    cases = megatron_conformance.read_reports([report(0, ""), report(1, '<failure message="boom"/>')])
    assert cases == {"TestFlexDispatcher::a": {"outcome": "failed", "detail": "rank 1: boom", "seconds": 1.0}}
    assert megatron_conformance.verdict({"x": {"cases": {}, "exit": 0, "log": "x.log"}}).startswith("x: exit 0 with 0")


def test_runs_without_host_sync_take_the_sync_free_experts() -> None:
    """Megatron's tests build SequentialMLP, which a layer without host sync refuses: those runs swap in the sync-free
    experts, as an unchanged script does; with host sync the layer spec's experts stay."""
    with_sync, without = (megatron_conformance.Configuration("deepep", sync).environment() for sync in (True, False))
    assert "MEGATRON_DEEPEPV2_EXPERTS" not in with_sync and with_sync["MEGATRON_DEEPEPV2_NO_HOST_SYNC"] == "0"
    assert without == {"MEGATRON_DEEPEPV2_BACKEND": "deepep", "MEGATRON_DEEPEPV2_NO_HOST_SYNC": "1",
                       "MEGATRON_DEEPEPV2_EXPERTS": "sync_free"}

