"""``tools/_bench.py``, the benchmarks' shared machinery, on the CPU: interleaving and medians, the timers' clocks,
the 1-rank process group, the JSON + PNG outputs, and the Megatron manager's switches on this checkout and older ones."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.git_checkout import not_own_checkout
from tools import _bench

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def _recording_variants(calls: list[str], names: str = "ab") -> dict[str, _bench.Step]:
    return {name: (lambda name=name: calls.append(name)) for name in names}


def test_interleave_times_the_variants_in_turn_after_warmup_and_settling() -> None:
    calls: list[str] = []
    timed: list[str] = []

    def timer(fn: _bench.Step) -> float:
        fn()
        timed.append(calls[-1])
        return float(len(timed))

    samples = _bench.interleave(_recording_variants(calls), timer, rounds=3, warmup=2, settle=1)
    # Warm-up first (each variant on its own), then per round each variant settles once and is timed once.
    assert calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b"] * 3
    assert timed == ["a", "b"] * 3
    assert samples == {"a": [1.0, 3.0, 5.0], "b": [2.0, 4.0, 6.0]}  # in round order


def test_interleaving_charges_a_drifting_machine_to_every_variant_alike() -> None:
    # The machine slows down during the run: a later sample of the same work reads larger.
    clock = iter(range(1000))

    def drifting_timer(fn: _bench.Step) -> float:
        fn()
        return 100.0 + 10.0 * next(clock)

    calls: list[str] = []
    times = _bench.medians(_bench.interleave(_recording_variants(calls), drifting_timer, rounds=9))
    # Variants of equal cost come out equal up to one slot of drift, not a whole block of rounds apart.
    assert times["b"] - times["a"] == pytest.approx(10.0)


def test_medians_are_the_middle_sample_of_each_variant() -> None:
    # Not the mean: one slow outlier (a sample hit by the rest of the machine) does not move it.
    assert _bench.medians({"odd": [90.0, 1.0, 2.0], "even": [40.0, 1.0, 3.0, 2.0], "one": [7.0]}) == {
        "odd": 2.0, "even": 2.5, "one": 7.0}


def test_median_us_warms_up_then_takes_the_median_of_single_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    samples = iter([5.0, 1.0, 90.0, 7.0, 3.0])
    monkeypatch.setattr(_bench, "wall_us", lambda fn, n, synchronize=None: (fn(), next(samples))[1])
    assert _bench.median_us(lambda: calls.append("call"), iters=5, warmup=2, cuda=False) == 5.0
    assert len(calls) == 7


def test_wall_clock_includes_the_final_synchronisation_and_host_time_does_not() -> None:
    syncs: list[float] = []

    def slow_synchronize() -> None:  # a device still busy for 50 ms
        syncs.append(time.perf_counter())
        time.sleep(0.05)

    assert _bench.wall_us(lambda: None, 2, slow_synchronize) >= 0.05 / 2 * 1e6
    assert len(syncs) == 2  # once before the clock starts, once inside it
    assert _bench.host_us(lambda: None, 2, slow_synchronize) < 0.05 / 2 * 1e6
    assert len(syncs) == 4


def test_a_one_rank_gloo_group_runs_collectives_and_keeps_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch.distributed as dist

    for name in _bench.MULTICAST_OFF:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # a value already set is kept as it is
    monkeypatch.delenv("RANK", raising=False)
    with _bench.process_group("gloo") as rank:
        assert rank == 0 and dist.get_world_size() == 1
        total = torch.ones(2)
        dist.all_reduce(total)
        assert total.tolist() == [1.0, 1.0]
        assert _bench.max_over_ranks(3.5, cuda=False) == 3.5
    assert not dist.is_initialized()
    assert {name: os.environ[name] for name in _bench.MULTICAST_OFF} == _bench.MULTICAST_OFF


def test_outputs_are_written_as_json_and_handed_to_the_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    document = {"rows": [{"label": "T4096", "times_us": {"raw": 101.5}}], "device": "cpu"}
    drawn: list[tuple[dict, str]] = []

    def plot(doc: dict, path: str) -> None:
        drawn.append((doc, path))
        Path(path).write_bytes(b"png")

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "matplotlib" else None)
    _bench.write_outputs(str(tmp_path / "new"), "bench_x", document, plot)
    assert json.loads((tmp_path / "new" / "bench_x.json").read_text()) == document
    assert drawn == [(document, str(tmp_path / "new" / "bench_x.png"))]
    assert (tmp_path / "new" / "bench_x.png").read_bytes() == b"png"


def test_without_matplotlib_the_json_is_written_and_a_warning_says_how_to_get_the_plot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with caplog.at_level(logging.WARNING):
        _bench.write_outputs(str(tmp_path), "bench_x", {"rows": []}, lambda doc, path: pytest.fail("plotted"))
    assert json.loads((tmp_path / "bench_x.json").read_text()) == {"rows": []}
    assert not (tmp_path / "bench_x.png").exists()
    assert "megatron-deepepv2[bench]" in caplog.text


@pytest.mark.skipif(not HAS_MATPLOTLIB, reason="the PNG needs matplotlib (the bench extra)")
def test_grouped_bars_are_drawn_into_a_png(tmp_path: Path) -> None:
    def plot(document: dict, path: str) -> None:
        fig, ax = _bench.new_figure(6, 4)
        _bench.grouped_bars(ax, document["groups"], document["series"], value_format="%.1f")
        assert [bar.get_height() for bar in ax.patches] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        assert [label.get_text() for label in ax.get_xticklabels()] == document["groups"]
        # Each group's label is centred under its bars (the patches run series by series).
        centres = [sum(bar.get_x() + bar.get_width() / 2 for bar in ax.patches[group::2]) / 3 for group in range(2)]
        assert ax.get_xticks().tolist() == pytest.approx(centres)
        _bench.save_figure(fig, path)

    document = {"groups": ["first", "second"], "series": {"a": [1.0, 2.0], "b": [3.0, 4.0], "c": [5.0, 6.0]}}
    _bench.write_outputs(str(tmp_path), "bench_x", document, plot)
    assert (tmp_path / "bench_x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_refused_configuration_is_reported_and_other_errors_propagate() -> None:
    not_run: dict[str, str] = {}
    assert _bench.build_or_reason("built", lambda: "layer", not_run) == "layer"

    def refused() -> None:
        raise ValueError("compact: Megatron layers dispatch in the expand layout only\nmore lines")

    assert _bench.build_or_reason("path_compact", refused, not_run) is None
    assert not_run == {"path_compact": "ValueError: compact: Megatron layers dispatch in the expand layout only\n"
                                       "more lines"}
    with pytest.raises(RuntimeError):
        _bench.build_or_reason("broken", lambda: (_ for _ in ()).throw(RuntimeError("bug")), not_run)


def test_provenance_names_the_commit_from_git_or_from_the_environment(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_bench.REVISION_ENV, raising=False)
    here = _bench.provenance()
    if not_own_checkout() is None:  # in a copy inside another repository the commit is unknown (test_provenance)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip()
        assert here["git_commit"] == head and isinstance(here["git_dirty"], bool)
    assert here["date"].endswith("Z")
    assert _bench.provenance(str(tmp_path))["git_commit"] is None  # no checkout, no setting: unknown
    # A copy of the tree (a remote machine's) may carry the .git of an earlier commit: the setting wins.
    monkeypatch.setenv(_bench.REVISION_ENV, "abc1234-dirty")
    assert (_bench.provenance()["git_commit"], _bench.provenance()["git_dirty"]) == ("abc1234", True)
    monkeypatch.setenv(_bench.REVISION_ENV, "abc1234")
    assert (_bench.provenance(str(tmp_path))["git_commit"], _bench.provenance()["git_dirty"]) == ("abc1234", False)


def test_the_manager_switches_are_those_the_checkouts_resolver_takes() -> None:
    import megatron_deepepv2 as dv2

    # This checkout resolves with resolve_config: configuration and settings fields alike, not the settings object.
    fields = _bench.resolver_fields(dv2)
    assert {"layout", "expert_alignment", "clear_tail", "host_sync", "check_ids", "num_sms"} <= fields
    assert "settings" not in fields
    overrides = _bench.megatron_manager_overrides(dv2)
    assert overrides == {"check_ids": False, "mask_foreign_weights": False, "clear_tail": False}
    config = dv2.resolve_config(backend="reference", **overrides)
    assert (config.settings.check_ids, config.mask_foreign_weights, config.clear_tail) == (False, False, False)

    # Older checkouts: DispatchConfig.resolve taking its fields as **overrides, or named parameters; one that
    # predates a switch does not get it.
    @dataclass
    class FieldsConfig:
        layout: str = "compact"
        check_ids: bool = True
        mask_foreign_weights: bool = True

        @classmethod
        def resolve(cls, **overrides):
            return cls(**overrides)

    class NamedConfig:
        @classmethod
        def resolve(cls, *, layout=None, mask_foreign_weights=None):
            return cls()

    older = SimpleNamespace(DispatchConfig=FieldsConfig)
    assert _bench.resolver_fields(older) == {"layout", "check_ids", "mask_foreign_weights"}
    assert _bench.megatron_manager_overrides(older) == {"check_ids": False, "mask_foreign_weights": False}
    oldest = SimpleNamespace(DispatchConfig=NamedConfig)
    assert _bench.resolver_fields(oldest) == {"layout", "mask_foreign_weights"}
    assert _bench.megatron_manager_overrides(oldest) == {"mask_foreign_weights": False}


def test_recorded_nccl_is_the_library_loaded_not_the_one_torch_was_built_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepEP v2 setups load a newer NCCL than PyTorch was built with; a record names the loaded one."""
    import torch

    from megatron_deepepv2.backends.deepep import probes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 9))  # what torch was built with
    monkeypatch.setattr(probes, "mapped_nccl_libraries", lambda: ["/stand-in/libnccl.so.2"])

    class LoadedNccl:
        """``ncclGetVersion`` of a loaded NCCL 2.30.7 (its code is major * 10000 + minor * 100 + patch)."""

        @staticmethod
        def ncclGetVersion(pointer) -> int:  # noqa: N802 - NCCL's name
            pointer._obj.value = 23007
            return 0

    monkeypatch.setattr(probes.ctypes, "CDLL", lambda path: LoadedNccl())
    versions = _bench.software_versions(packages=("torch",))
    assert versions["nccl"] == "2.30.7", versions
