"""Shared pytest configuration: value validation is on and torch.compile off in every test process and rank; long
tests start first; waiting for the GPU-job lock does not count against a test's timeout."""

import gc
import os

import pytest

from tests import gpu_jobs

# The documented switch (megatron_deepepv2.config): host-side checks plus cross-rank agreement on errors.
os.environ.setdefault("MEGATRON_DEEPEPV2_VALIDATE", "1")
# torch.compile off: Megatron's jit_fuser compiles activations such as quick_gelu at first use, about 25 s in every
# fresh process on a 2-core machine; these tests compare numerics, not the compiler. (GPU jobs drop both settings.)
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

# Tests that take many seconds (most start interpreters of their own, which import torch and Megatron), by node-id
# prefix, with a rough cost in seconds on a 2-core machine. Under pytest-xdist they start first, longest first, and
# tests are handed out one at a time, so that a long test never starts last while the other workers have run out of
# tests. A stale entry only changes the order tests start in.
LONG_TESTS = {
    "tests/tools/test_bench_host_overhead.py::test_instructions_counts_the_steps_under_callgrind": 60,
    "tests/tools/test_bench_host_overhead.py::test_compare_measures_each_tree_in_its_own_processes": 30,
    "tests/cli/test_readme.py::test_make_targets_run_as_written": 12,
    "tests/cli/test_run_entry_point.py::test_without_the_plugin_megatron_rejects_deepepv2": 11,
    "tests/cli/test_demo.py::": 10,
    "tests/unit/test_spawn_on_free_port.py::": 4,
    "tests/unit/test_legacy_deepep.py::test_install_exposes_the_legacy_buffer": 5,
    "tests/tools/test_megatron_conformance.py::test_runner_fails_on_a_failed_case": 12,
    "tests/cli/test_readme.py::test_python_blocks_run": 8,
    "tests/cli/test_run_entry_point.py::test_example_launch_parses_and_validates": 8,
    "tests/unit/test_checkpoints.py::": 12,
    "tests/cli/test_readme.py::test_gpu_launch_arguments_parse_and_validate_here": 8,
    "tests/tools/test_bench_fp8.py::": 8,
    "tests/harness/test_distributed_harness.py::"
    "test_forked_ranks_start_with_megatron_imported_and_fresh_ones_without": 7,
    "tests/cli/test_install_deepep.py::test_compiler_probe_on_this_machine_tells_static_from_dynamic": 5,
    "tests/unit/test_validation.py::test_each_failure_is_reported_with_its_own_cause": 5,
    "tests/tools/test_bench_hot_path.py::test_without_a_gpu_it_says_what_it_needs": 4,
    "tests/harness/test_distributed_harness.py::test_a_hung_rank_fails_after_the_timeout_with_its_stack": 4,
    "tests/harness/test_gpu_jobs.py::test_waiting_for_the_lock_does_not_count_against_the_timeout": 3,
    "tests/unit/test_megatron_integration.py::test_deepepv2_dispatch_preprocess_is_not_compiled": 18,
    "tests/tools/test_train_gpt.py::test_rounds_launch_each_model_and_variant": 17,
    "tests/cli/test_run_entry_point.py::test_example_deepseek_v3_router_model": 14,
    "tests/tools/test_train_gpt.py::test_recorder_ends_the_process": 6,
    "tests/cli/test_cli_entry_points.py::test_importing_a_tool_loads_no_other_tool": 6,
    # GPU jobs (skipped at once without GPUs): the GPU must be busy from the start. The README's GPU blocks come first:
    # their installer runs alone (tests/gpu_jobs.py), before the jobs that share the GPU.
    "tests/cli/test_readme.py::test_gpu_blocks_run_on_a_gpu_machine": 1100,
    "tests/functional/test_deepep.py::": 1000,
    "tests/functional/test_transformer_engine.py::": 950,
    "tests/determinism/test_replay.py::test_elastic_buffer_moe_layer_replays_under_torchrun": 800,
}


def _expected_seconds(nodeid: str) -> float:
    return max((seconds for prefix, seconds in LONG_TESTS.items() if nodeid.startswith(prefix)), default=0.0)


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist's load scheduling hands out consecutive chunks of a quarter of each worker's share by default: the
    # long tests, first in the order below, would all go to the first worker. One at a time, they spread.
    if getattr(config.option, "maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
    # GPU jobs share the GPU or run alone (tests/gpu_jobs.py): a test's timeout stops while it waits for their lock.
    config.pluginmanager.register(gpu_jobs, "gpu_jobs")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Stable: every other test keeps its place (and every xdist worker collects the same order, as it must).
    items.sort(key=lambda item: -_expected_seconds(item.nodeid))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish() -> None:
    # The process exits next. Its final garbage collection would walk every object torch and Megatron created (about
    # two seconds in each xdist worker, which the run waits for); frozen objects are skipped.
    gc.freeze()
