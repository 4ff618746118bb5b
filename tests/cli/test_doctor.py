"""The environment doctor, with injected probes (no GPU needed)."""

from __future__ import annotations

import glob
import json
import logging

import pytest

from megatron_deepepv2.cli.doctor import (
    FAIL,
    OK,
    Probes,
    disable_gin_without_rdma,
    elf_needed_libraries,
    find_rdma_devices,
    main,
    run_checks,
)

HEALTHY_ENV = {"EP_DISABLE_GIN": "1", "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
               "NVSHMEM_DISABLE_NVLS": "1", "HOME": "/root", "PATH": "/usr/bin"}


def healthy(**changes) -> Probes:
    probes = Probes(
        env=dict(HEALTHY_ENV),
        versions=lambda: {"python": "3.12.3", "torch": "2.11.0+cu130", "megatron-core": "0.19.2"},
        cuda=lambda: {"available": True, "count": 2, "capability": (9, 0), "name": "NVIDIA H200"},
        nccl_version=lambda: (2, 30, 7),
        mapped_nccl=lambda: ["/site/nvidia/nccl/lib/libnccl.so.2"],
        deep_ep=lambda: {"version": "2.1.0", "buffers": ["ElasticBuffer", "Buffer"], "extension": "/site/deep_ep/_C.so"},
        needed_libraries=lambda path: ["libnccl.so.2", "libstdc++.so.6", "libc.so.6"],
        nvcc_path=lambda env: "/usr/local/cuda/bin/nvcc",
        nvcc_version=lambda nvcc: (13, 0),
        driver_cuda=lambda: (13, 0),
        writable_dir=lambda path: True,
        nvlink=lambda: True,
        rdma_devices=lambda: [],
        transformer_engine=lambda: {"installed": True, "version": "2.20.2", "regular": True, "locations": ["/site/te"]},
    )
    for name, value in changes.items():
        setattr(probes, name, value)
    return probes


def status(findings, check: str) -> str:
    return next(f for f in findings if f.check == check).status


def test_healthy_machine_has_no_blocking_problem(capsys: pytest.CaptureFixture) -> None:
    assert main([], probes=healthy()) == 0
    assert "No blocking problems." in capsys.readouterr().out


@pytest.mark.parametrize(
    "changes,check,phrase",
    [
        ({"nccl_version": lambda: (2, 28, 9)}, "nccl-version", "needs NCCL >= 2.30.4"),
        ({"mapped_nccl": lambda: ["/a/libnccl.so.2", "/b/libnccl.so.2"]}, "nccl-single-library", "Exactly one libnccl"),
        ({"needed_libraries": lambda p: ["libnccl.so.2", "libc.so.6"]}, "libstdc++-linkage", "std::regex"),
        ({"deep_ep": lambda: {"error": "ModuleNotFoundError: No module named 'deep_ep'"}}, "deep_ep", "Install DeepEP v2"),
        ({"deep_ep": lambda: {"version": "1.2.1", "buffers": ["Buffer"]}}, "deep_ep", "HybridEP and DeepEP v1"),
        ({"deep_ep": lambda: {"version": "2.5.0", "buffers": ["EPBuffer"]}}, "nccl-version", "needs NCCL >= 2.32.3"),
        ({"deep_ep": lambda: {"version": "2.5.0", "buffers": ["EPBuffer"]}, "nccl_version": lambda: (2, 32, 3)},
         "nvcc", "needs nvcc >= 13.1"),
        ({"cuda": lambda: {"available": True, "count": 2, "capability": (8, 0), "name": "A100"}}, "cuda", "sm_90a"),
        ({"cuda": lambda: {"available": False}}, "cuda", "MEGATRON_DEEPEPV2_BACKEND=reference"),
        ({"nvcc_path": lambda env: None}, "nvcc", "CUDA_HOME"),
        ({"writable_dir": lambda path: False}, "jit-cache", "EP_JIT_CACHE_DIR"),
        ({"env": {**HEALTHY_ENV, "EP_DISABLE_GIN": "0"}}, "gin", "Unset EP_DISABLE_GIN"),  # GIN forced on, no NIC
        ({"versions": lambda: {"python": "3.11.7", "torch": "2.11.0", "megatron-core": "0.19.2"}}, "python", "3.12"),
        ({"versions": lambda: {"python": "3.12.1", "torch": "2.9.1", "megatron-core": "0.19.2"}}, "torch", "2.10"),
        ({"versions": lambda: {"python": "3.12.1", "torch": "2.11.0", "megatron-core": "0.16.1"}}, "megatron-core", ">= 0.17"),
    ],
)
def test_each_blocking_problem_is_reported_with_a_fix(changes, check, phrase) -> None:
    findings = run_checks(healthy(**changes))
    finding = next(f for f in findings if f.check == check)
    assert finding.status == FAIL and phrase in finding.fix
    assert main([], probes=healthy(**changes)) == 1


def test_v2_5_line_with_its_requirements_is_healthy() -> None:
    probes = healthy(deep_ep=lambda: {"version": "2.5.0", "buffers": ["EPBuffer"], "extension": "/site/deep_ep/_C.so"},
                     nccl_version=lambda: (2, 32, 3), nvcc_version=lambda nvcc: (13, 1))
    findings = run_checks(probes)
    deep_ep = next(f for f in findings if f.check == "deep_ep")
    assert deep_ep.status == OK and "V2.5" in deep_ep.detail and "EPBuffer" in deep_ep.detail
    assert not [f for f in findings if f.status == FAIL]


@pytest.mark.parametrize("nvcc,driver,expected,phrase", [
    ((13, 1), (13, 0), "warn", "cubins it builds load"),
    ((13, 0), (13, 0), "ok", "cubins and PTX both load"),
    ((12, 9), (13, 0), "ok", "cubins and PTX both load"),
])
def test_doctor_says_whether_a_newer_nvcc_than_the_driver_can_run(nvcc, driver, expected, phrase) -> None:
    findings = run_checks(healthy(nvcc_version=lambda path: nvcc, driver_cuda=lambda: driver))
    finding = next(f for f in findings if f.check == "nvcc-driver")
    assert finding.status == expected and phrase in finding.detail


def test_a_newer_megatron_core_is_a_warning_not_a_failure() -> None:
    findings = run_checks(healthy(versions=lambda: {"python": "3.12.3", "torch": "2.11.0", "megatron-core": "0.20.1"}))
    finding = next(f for f in findings if f.check == "megatron-core")
    assert finding.status == "warn" and "newer than the tested" in finding.detail


def test_rdma_nic_makes_gin_fine_without_the_variable() -> None:
    env = {k: v for k, v in HEALTHY_ENV.items() if k != "EP_DISABLE_GIN"}
    findings = run_checks(healthy(env=env, rdma_devices=lambda: ["/sys/class/infiniband/mlx5_0"]))
    assert status(findings, "gin") == OK


def test_gin_check_passes_without_an_rdma_nic_and_without_the_variable(capsys: pytest.CaptureFixture) -> None:
    """A single node without RDMA, EP_DISABLE_GIN unset (the README's install as written): GIN off, decided as the
    library decides it when it builds DeepEP's buffer, and no blocking problem."""
    env = {k: v for k, v in HEALTHY_ENV.items() if k != "EP_DISABLE_GIN"}
    probes = healthy(env=env, rdma_devices=lambda: [])
    gin = next(f for f in run_checks(probes) if f.check == "gin")
    assert gin.status == OK and "no RDMA NIC" in gin.detail and "GIN off" in gin.detail, gin
    assert "EP_DISABLE_GIN" not in probes.env  # the doctor reports; it changes no environment
    assert main([], probes=probes) == 0
    assert "No blocking problems." in capsys.readouterr().out


def test_gin_check_on_a_launch_across_nodes_without_an_rdma_nic_warns_with_the_fix() -> None:
    env = {k: v for k, v in HEALTHY_ENV.items() if k != "EP_DISABLE_GIN"}
    findings = run_checks(healthy(env={**env, "GROUP_WORLD_SIZE": "2"}, rdma_devices=lambda: []))
    gin = next(f for f in findings if f.check == "gin")
    assert gin.status == "warn" and "no RDMA NIC" in gin.fix and "To fix" in gin.fix, gin


def test_json_output(capsys: pytest.CaptureFixture) -> None:
    assert main(["--json"], probes=healthy(nccl_version=lambda: (2, 28, 9))) == 1
    rows = json.loads(capsys.readouterr().out)
    assert {"check", "status", "detail", "fix"} <= rows[0].keys()
    assert any(r["check"] == "nccl-version" and r["status"] == "fail" for r in rows)


def test_real_probes_run_on_this_machine() -> None:
    # On the CPU CI machine the doctor must run and report the missing GPU/DeepEP as blocking.
    findings = run_checks()
    assert status(findings, "python") == OK
    assert {f.check for f in findings} >= {"cuda", "deep_ep", "nccl-version", "nvcc", "gin"}


def test_elf_reader_lists_needed_libraries() -> None:
    import torch

    lib = next(iter(glob.glob(torch.__path__[0] + "/lib/libtorch_cpu.so")), None)
    if lib is None:
        pytest.skip("libtorch_cpu.so not found")
    needed = elf_needed_libraries(lib)
    assert any(name.startswith("libc10") for name in needed)
    with pytest.raises(ValueError, match="not a 64-bit little-endian ELF"):
        elf_needed_libraries(__file__)


def test_one_gpu_is_a_supported_configuration_and_says_what_it_cannot_show() -> None:
    findings = run_checks(healthy(cuda=lambda: {"available": True, "count": 1, "capability": (9, 0), "name": "H200"}))
    one_gpu = next(f for f in findings if f.check == "gpu-count")
    assert one_gpu.status == OK and "EP=1" in one_gpu.detail and "NVLink" in one_gpu.detail
    assert all(f.status == OK for f in findings if f.check != "torchrun"), [f for f in findings if f.status != OK]


NIC = ["/sys/class/infiniband/mlx5_0"]


def _gin_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "megatron_deepepv2.cli.doctor" and "EP_DISABLE_GIN=1" in r.getMessage()]


@pytest.mark.parametrize("environ,nics,expected", [
    ({}, [], "1"),  # no NIC, unset: set, once
    ({}, NIC, None),  # a NIC: GIN stays on
    ({"EP_DISABLE_GIN": "0"}, [], "0"),  # the user's value, either one, stays
    ({"EP_DISABLE_GIN": "1"}, [], "1"),
    ({"EP_DISABLE_GIN": "0"}, NIC, "0"),
])
def test_launchers_disable_gin_only_on_a_node_without_an_rdma_nic(caplog: pytest.LogCaptureFixture, environ: dict,
                                                                   nics: list, expected) -> None:
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.cli.doctor")
    env = dict(environ)
    set_here = "EP_DISABLE_GIN" not in environ and not nics
    for _ in range(2):  # a second call (a launcher inside a launcher) changes nothing and says nothing
        disable_gin_without_rdma(env, lambda: nics)
        assert env.get("EP_DISABLE_GIN") == expected
    lines = _gin_lines(caplog)
    assert len(lines) == (1 if set_here else 0) and all(r.levelno == logging.INFO for r in lines), lines
    if set_here:  # what the launcher leaves is what the doctor's gin check asks for
        without = {k: v for k, v in HEALTHY_ENV.items() if k != "EP_DISABLE_GIN"}
        assert status(run_checks(healthy(env={**without, **env})), "gin") == OK


def test_the_launchers_and_the_doctor_ask_one_rdma_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.cli import doctor

    assert Probes().rdma_devices is find_rdma_devices
    monkeypatch.setattr(doctor, "find_rdma_devices", lambda: NIC)  # the default probe is looked up at each call
    env: dict = {}
    assert disable_gin_without_rdma(env) is False and env == {}
    monkeypatch.setattr(doctor, "find_rdma_devices", lambda: [])
    assert disable_gin_without_rdma(env) is True and env == {"EP_DISABLE_GIN": "1"}


def test_launchers_leave_a_launch_across_nodes_to_the_library() -> None:
    """torchrun across two nodes without an RDMA NIC: nothing set and no error at launch; each expert-parallel group
    is decided where its buffer is built (one within a node gets GIN off, one across nodes the error)."""
    env = {"GROUP_WORLD_SIZE": "2", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"}
    assert disable_gin_without_rdma(env, lambda: []) is False
    assert "EP_DISABLE_GIN" not in env


@pytest.mark.parametrize("found, expected, phrase", [
    ({"installed": False}, "skip", "not installed: Megatron's local layers run"),
    ({"installed": True, "version": "2.20.2", "regular": True, "locations": ["/s/transformer_engine"]}, "ok",
     "Transformer Engine 2.20.2"),
    ({"installed": True, "version": None, "regular": False, "locations": ["/s/transformer_engine"]}, "fail",
     "transformer_engine at /s/transformer_engine has no package of its own"),
])
def test_transformer_engine_is_optional_but_a_leftover_of_one_is_a_blocking_problem(found, expected, phrase) -> None:
    findings = run_checks(healthy(transformer_engine=lambda: found))
    (finding,) = [f for f in findings if f.check == "transformer-engine"]
    assert finding.status == expected and phrase in finding.detail, finding
    if expected == "fail":
        assert "remove that folder, or reinstall Transformer Engine" in finding.fix
        assert main([], probes=healthy(transformer_engine=lambda: found)) == 1


def test_the_transformer_engine_probe_tells_a_leftover_folder_from_a_package(tmp_path, monkeypatch) -> None:
    """An uninstall leaves ``transformer_engine/`` without ``__init__.py``: it imports as an empty namespace. A regular
    package anywhere on the path wins over such a folder (as the import would), so the probe reports that one."""
    import importlib
    import sys

    from megatron_deepepv2.cli import doctor

    leftover_dir, installed_dir = tmp_path / "leftover", tmp_path / "installed"
    (leftover_dir / "transformer_engine" / "pytorch").mkdir(parents=True)
    # Only these folders on the path: whether this machine has Transformer Engine installed or not.
    monkeypatch.setattr(sys, "path", [str(leftover_dir)])
    monkeypatch.delitem(sys.modules, "transformer_engine", raising=False)
    importlib.invalidate_caches()
    leftover = doctor._default_transformer_engine()
    assert leftover["installed"] and not leftover["regular"] and leftover["version"] is None, leftover
    assert leftover["locations"] == [str(leftover_dir / "transformer_engine")]

    (installed_dir / "transformer_engine").mkdir(parents=True)
    (installed_dir / "transformer_engine" / "__init__.py").write_text("")
    dist_info = installed_dir / "transformer_engine-2.20.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.20.2\n")
    monkeypatch.setattr(sys, "path", [str(leftover_dir), str(installed_dir)])
    importlib.invalidate_caches()
    installed = doctor._default_transformer_engine()
    assert installed["regular"] and installed["version"] == "2.20.2", installed
    assert installed["locations"] == [str(installed_dir / "transformer_engine")]
