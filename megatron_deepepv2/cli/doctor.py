"""Environment doctor: ``python -m megatron_deepepv2.cli.doctor [--json]``.

Checks what the DeepEP v2 path needs, each finding with a fix: Python, torch and megatron-core versions;
CUDA and the SM architecture; ``deep_ep`` importable and which line it is (2.1 ``ElasticBuffer`` or V2.5
``EPBuffer``, :mod:`megatron_deepepv2.backends.deepep.lines`); the NCCL runtime actually loaded (that line's minimum:
2.30.4 / 2.32.3, and exactly one ``libnccl`` mapped); ``deep_ep._C`` linking libstdc++ dynamically (a static copy
crashes inside ``std::regex`` at the first dispatch); ``nvcc`` (V2.5's JIT needs >= 13.1) against the driver's CUDA
version (a newer nvcc's cubins load on an older driver, its PTX does not) and a writable JIT cache; NVLink, and
NCCL GIN as the library decides it from the hardware
(:func:`megatron_deepepv2.backends.deepep.topology.decide_gin`: off through ``EP_DISABLE_GIN=1`` on a node without an
RDMA NIC); the NVLink-multicast guard variables; the torchrun environment.

Exit status: 1 when a blocking problem (``fail``) was found, else 0. Every probe of the system goes through
:class:`Probes`, so tests inject facts instead of needing a GPU.

The launchers (``python -m megatron_deepepv2.cli.run``, the demo) apply the same decision before the training code
runs, through :func:`disable_gin_without_rdma`, so that the processes it starts inherit the variable.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import logging
import os
import shutil
import re
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, MutableMapping, Optional

from megatron_deepepv2.backends.deepep.lines import DEEPEP_2_1, LINES, DeepEPLine, Version
from megatron_deepepv2.backends.deepep.probes import parse_version, version_text
from megatron_deepepv2.backends.deepep.topology import (GIN_VARIABLE, decide_gin, find_rdma_devices, launch_num_nodes,
                                                      set_gin_variable)

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
MULTICAST_GUARDS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")

logger = logging.getLogger(__name__)


@dataclass
class Finding:
    """One check's outcome.

    Attributes:
        check: Short name of the check.
        status: ``ok``, ``warn``, ``fail`` (blocking) or ``skip``.
        detail: What was observed.
        fix: How to fix it (empty when nothing is to be done).
    """

    check: str
    status: str
    detail: str
    fix: str = ""


def elf_needed_libraries(path: str) -> list[str]:
    """``DT_NEEDED`` entries of a 64-bit little-endian ELF shared object (what ``readelf -d`` lists).

    Args:
        path: Path of the shared object.

    Returns:
        The needed library names.

    Raises:
        ValueError: If the file is not a 64-bit little-endian ELF.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    needed = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, entsize or 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:
                break
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strtab_offset + value)
                needed.append(data[strtab_offset + value:end].decode())
    return needed


def links_libstdcxx_dynamically(needed: list[str]) -> bool:
    """Whether ELF ``NEEDED`` entries include the shared libstdc++ (a static copy crashes DeepEP's ``std::regex``)."""
    return any(lib.startswith("libstdc++.so") for lib in needed)


def _default_nccl_version() -> Optional[tuple[int, ...]]:
    import torch  # noqa: F401,PLC0415 - loads torch's libnccl before asking it

    from megatron_deepepv2.backends.deepep.probes import runtime_nccl_version  # noqa: PLC0415

    return runtime_nccl_version()


def _default_mapped_nccl() -> list[str]:
    from megatron_deepepv2.backends.deepep.probes import mapped_nccl_libraries  # noqa: PLC0415

    return mapped_nccl_libraries()


def _default_deep_ep() -> dict[str, Any]:
    try:
        import deep_ep  # noqa: PLC0415
    except (ImportError, AssertionError) as error:
        return {"error": f"{type(error).__name__}: {error}"}
    ext = glob.glob(os.path.join(os.path.dirname(deep_ep.__file__), "_C*.so"))
    return {"version": getattr(deep_ep, "__version__", "unknown"),
            "buffers": [name for name in ("EPBuffer", "ElasticBuffer", "Buffer") if hasattr(deep_ep, name)],
            "extension": ext[0] if ext else None}


def _default_cuda() -> dict[str, Any]:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return {"available": False}
    return {"available": True, "count": torch.cuda.device_count(), "capability": torch.cuda.get_device_capability(),
            "name": torch.cuda.get_device_name()}


def _default_nvlink() -> Optional[bool]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return " NV" in out


def _default_versions() -> dict[str, Optional[str]]:
    from importlib import metadata  # noqa: PLC0415

    versions: dict[str, Optional[str]] = {"python": ".".join(map(str, sys.version_info[:3]))}
    for name in ("torch", "megatron-core"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _default_transformer_engine() -> dict[str, Any]:
    """Where ``transformer_engine`` would import from, without importing it: ``installed`` (found at all), its
    distribution's ``version`` (None without one) and whether it is a regular package (a folder with no
    ``__init__.py``, which pip leaves behind when it uninstalls Transformer Engine, imports as an empty namespace)."""
    import importlib.util  # noqa: PLC0415
    from importlib import metadata  # noqa: PLC0415

    spec = importlib.util.find_spec("transformer_engine")
    if spec is None:
        return {"installed": False}
    try:
        version: Optional[str] = metadata.version("transformer_engine")
    except metadata.PackageNotFoundError:
        version = None
    return {"installed": True, "version": version, "regular": spec.origin is not None,
            "locations": list(spec.submodule_search_locations or [])}


def find_nvcc(env: dict[str, str]) -> Optional[str]:
    """The nvcc DeepEP's JIT would use: ``EP_JIT_NVCC_COMPILER``, ``$CUDA_HOME`` / ``$CUDA_PATH``, ``PATH``, then
    ``/usr/local/cuda`` (None when there is none)."""
    for var in ("EP_JIT_NVCC_COMPILER",):
        if env.get(var) and os.path.exists(env[var]):
            return env[var]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var) and os.path.exists(os.path.join(env[var], "bin", "nvcc")):
            return os.path.join(env[var], "bin", "nvcc")
    found = shutil.which("nvcc", path=env.get("PATH"))
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None


def nvcc_version(nvcc: str) -> Optional[Version]:
    """``(major, minor)`` of an nvcc, from ``nvcc --version`` (None when it does not run)."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"release (\d+)\.(\d+)", out)
    return (int(found.group(1)), int(found.group(2))) if found else None


def _default_driver_cuda() -> Optional[Version]:
    """The CUDA version the driver supports (``cuDriverGetVersion``), None without a driver."""
    try:
        import ctypes  # noqa: PLC0415

        code = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(code)) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return code.value // 1000, (code.value % 1000) // 10


def disable_gin_without_rdma(environ: Optional[MutableMapping[str, str]] = None,
                             rdma_devices: Optional[Callable[[], list[str]]] = None) -> bool:
    """Sets ``EP_DISABLE_GIN=1`` on a node without an RDMA NIC, unless the variable is set already: the library's
    decision (:func:`megatron_deepepv2.backends.deepep.topology.set_gin_variable`), applied by a launcher for the
    processes it starts.

    A launch that spans several nodes is left to the library, which decides per expert-parallel group when it builds
    DeepEP's buffer (a group within one node needs no GIN; one across nodes without RDMA is refused with the fix).
    Logs one INFO line when it sets the variable.

    Args:
        environ: The environment to change (default: ``os.environ``, which child processes inherit).
        rdma_devices: The RDMA probe (default: :func:`find_rdma_devices`, the doctor's ``gin`` check's probe).

    Returns:
        True when it set the variable.
    """
    environ = os.environ if environ is None else environ
    if launch_num_nodes(environ) > 1:
        return False
    had = environ.get(GIN_VARIABLE)
    decision = set_gin_variable(1, environ, rdma_devices or find_rdma_devices, log=logger)
    return decision.automatic and had is None


def _writable_dir(path: str) -> bool:
    probe = path
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            return False
        probe = parent
    return os.access(probe, os.W_OK)


@dataclass
class Probes:
    """Everything the doctor reads from the system; replace fields in tests."""

    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    versions: Callable[[], dict[str, Optional[str]]] = _default_versions
    cuda: Callable[[], dict[str, Any]] = _default_cuda
    nccl_version: Callable[[], Optional[tuple[int, ...]]] = _default_nccl_version
    mapped_nccl: Callable[[], list[str]] = _default_mapped_nccl
    deep_ep: Callable[[], dict[str, Any]] = _default_deep_ep
    needed_libraries: Callable[[str], list[str]] = elf_needed_libraries
    nvcc_path: Callable[[dict[str, str]], Optional[str]] = find_nvcc
    nvcc_version: Callable[[str], Optional[Version]] = nvcc_version
    driver_cuda: Callable[[], Optional[Version]] = _default_driver_cuda
    writable_dir: Callable[[str], bool] = _writable_dir
    nvlink: Callable[[], Optional[bool]] = _default_nvlink
    rdma_devices: Callable[[], list[str]] = find_rdma_devices
    transformer_engine: Callable[[], dict[str, Any]] = _default_transformer_engine


def _check_deep_ep(p: Probes, deep_ep: dict[str, Any], add: Callable[[Finding], None]) -> Optional[DeepEPLine]:
    """The ``deep_ep`` import and ``deep_ep._C``'s libstdc++ linkage; returns the installed line (None: unusable)."""
    if "error" in deep_ep:
        add(Finding("deep_ep", FAIL, f"import deep_ep failed: {deep_ep['error']}",
                    "Install DeepEP v2 (2.1 with ElasticBuffer, or V2.5 with EPBuffer) built against the NCCL torch "
                    "loads: python -m megatron_deepepv2.cli.install_deepep --deepep-src PATH."))
        return None
    buffers = deep_ep.get("buffers") or []
    line = next((candidate for candidate in LINES if candidate.buffer_class in buffers), None)
    if line is None:
        kind = "DeepEP v1 or HybridEP" if "Buffer" in buffers else "not DeepEP"
        add(Finding("deep_ep", FAIL, f"deep_ep {deep_ep.get('version')} exports {buffers or 'no buffer'} ({kind}): "
                    "neither ElasticBuffer (DeepEP 2.1) nor EPBuffer (V2.5)",
                    "Install DeepEP v2 (2.1 or V2.5); HybridEP and DeepEP v1 install a module named deep_ep too."))
        return None
    add(Finding("deep_ep", OK, f"deep_ep {deep_ep.get('version')}: DeepEP {line.name} line with {line.buffer_class} "
                f"(needs NCCL >= {version_text(line.min_nccl)}"
                + (f", nvcc >= {version_text(line.min_nvcc)})" if line.min_nvcc else ")")))
    extension = deep_ep.get("extension")
    if extension:
        try:
            needed = p.needed_libraries(extension)
        except (OSError, ValueError) as error:
            add(Finding("libstdc++-linkage", WARN, f"cannot read {extension}: {error}"))
        else:
            dynamic = links_libstdcxx_dynamically(needed)
            add(Finding("libstdc++-linkage", OK if dynamic else FAIL,
                        f"{os.path.basename(extension)} NEEDED: {', '.join(needed)}",
                        "" if dynamic else "deep_ep._C has libstdc++ linked statically and will crash inside "
                        "std::regex at the first dispatch; rebuild it with a compiler that links libstdc++ "
                        "dynamically (install_deepep picks one; or CXX=/usr/bin/g++)."))
    return line


def _check_nvcc(p: Probes, line: DeepEPLine, add: Callable[[Finding], None]) -> None:
    """nvcc for the JIT: present, new enough for ``line``, and what a driver older than it can load."""
    nvcc = p.nvcc_path(p.env)
    if not nvcc:
        add(Finding("nvcc", FAIL, "nvcc: not found", "DeepEP JIT-compiles its kernels at first use: install a CUDA "
                    "toolkit and set CUDA_HOME (or EP_JIT_NVCC_COMPILER)."))
        return
    version = p.nvcc_version(nvcc)
    too_old = line.min_nvcc is not None and (version is None or version < line.min_nvcc)
    add(Finding("nvcc", FAIL if too_old else OK, f"nvcc {version_text(version)} at {nvcc}",
                f"DeepEP {line.name}'s JIT needs nvcc >= {version_text(line.min_nvcc)}: install that CUDA toolkit "
                "(or the pip wheels nvidia-cuda-nvcc, nvidia-nvvm, nvidia-cuda-crt) and point CUDA_HOME at it."
                if too_old else ""))
    driver = p.driver_cuda()
    if version is None or driver is None:
        return
    if tuple(version[:2]) <= tuple(driver[:2]):
        add(Finding("nvcc-driver", OK, f"driver supports CUDA {version_text(driver)} >= nvcc {version_text(version)}: "
                    "cubins and PTX both load"))
    else:
        add(Finding("nvcc-driver", WARN, f"nvcc {version_text(version)} is newer than the driver's CUDA "
                    f"{version_text(driver)}: the cubins it builds load (DeepEP's JIT builds cubins), its PTX does not "
                    "(CUDA_ERROR_UNSUPPORTED_PTX_VERSION)",
                    f"Fine for DeepEP; code that JIT-compiles PTX through the driver needs a driver for CUDA "
                    f">= {version_text(version)}."))


def _check_gin(p: Probes, add: Callable[[Finding], None]) -> None:
    """NCCL GIN as the library will decide it when it builds DeepEP's buffer (:func:`decide_gin`), for this launch."""
    rdma = p.rdma_devices()
    try:
        decision = decide_gin(launch_num_nodes(p.env), p.env, lambda: rdma)
    except RuntimeError as error:  # the launch spans nodes: only a group across them needs GIN
        add(Finding("gin", WARN, "no RDMA NIC on a launch across nodes: an expert-parallel group that spans nodes "
                    "cannot be built", str(error)))
        return
    if not rdma and decision.gin_on:
        add(Finding("gin", FAIL, f"no RDMA NIC, but {decision.reason} (GIN on): ElasticBuffer asserts 'NCCL GIN is "
                    "unavailable'", f"Unset {GIN_VARIABLE} (it is decided from the hardware) or set it to 1."))
        return
    add(Finding("gin", OK, decision.reason))


def _check_transformer_engine(p: Probes, add: Callable[[Finding], None]) -> None:
    """Transformer Engine is optional; a half-removed one breaks Megatron's own import."""
    te = p.transformer_engine()
    if not te.get("installed"):
        add(Finding("transformer-engine", SKIP, "not installed: Megatron's local layers run; TE layers, TEGroupedMLP "
                    "and TE's FP8 need it"))
    elif te.get("regular") and te.get("version"):
        add(Finding("transformer-engine", OK, f"Transformer Engine {te['version']}"))
    else:
        where = ", ".join(te.get("locations") or []) or "on sys.path"
        add(Finding("transformer-engine", FAIL, f"transformer_engine at {where} has no package of its own (what an "
                    "uninstall leaves behind)", "Megatron imports it and fails ('module transformer_engine has no "
                    "attribute __version__'): remove that folder, or reinstall Transformer Engine."))


def _check_versions(p: Probes, add: Callable[[Finding], None]) -> None:
    """Python, torch and megatron-core against the versions DeepEP v2 and this package need.

    Args:
        p: System probes.
        add: Receives each finding.
    """
    versions = p.versions()
    python = parse_version(versions.get("python"))
    add(Finding("python", OK if python >= (3, 12) else FAIL, f"Python {versions.get('python')}",
                "" if python >= (3, 12) else "megatron-core >= 0.17 needs Python >= 3.12."))
    torch_version = versions.get("torch")
    ok_torch = torch_version is not None and parse_version(torch_version) >= (2, 10)
    add(Finding("torch", OK if ok_torch else FAIL, f"torch {torch_version}",
                "" if ok_torch else "Install torch >= 2.10 (DeepEP v2 requirement)."))
    mcore = versions.get("megatron-core")
    mcore_version = parse_version(mcore)[:2] if mcore else ()
    if not mcore or mcore_version < (0, 17):
        add(Finding("megatron-core", FAIL, f"megatron-core {mcore}",
                    "Install megatron-core >= 0.17 (tested: 0.17 - 0.19.x)."))
    elif mcore_version >= (0, 20):
        add(Finding("megatron-core", WARN, f"megatron-core {mcore}: newer than the tested releases (0.17 - 0.19.x)",
                    "install() warns and applies its patches; each raises naming itself if this release changed it."))
    else:
        add(Finding("megatron-core", OK, f"megatron-core {mcore}"))


def _check_cuda(p: Probes, add: Callable[[Finding], None]) -> None:
    """A visible CUDA device of an architecture DeepEP v2 targets, and what one GPU alone can run.

    Args:
        p: System probes.
        add: Receives each finding.
    """
    cuda = p.cuda()
    if not cuda.get("available"):
        add(Finding("cuda", FAIL, "no CUDA device visible",
                    "DeepEP needs SM90/SM100 GPUs; on CPU use MEGATRON_DEEPEPV2_BACKEND=reference."))
        return
    major = cuda["capability"][0]
    arch_ok = major in (9, 10)
    add(Finding("cuda", OK if arch_ok else FAIL,
                f"{cuda['count']} x {cuda.get('name', 'GPU')}, SM{major}{cuda['capability'][1]}",
                "" if arch_ok else "DeepEP v2 kernels target sm_90a / sm_100a; use Hopper or Blackwell GPUs."))
    if cuda["count"] == 1:
        add(Finding("gpu-count", OK, "1 GPU visible: EP=1 (a 1-rank group) runs every DeepEP kernel, stream, "
                    "event, CUDA-graph and determinism path; NVLink traffic between GPUs and EP >= 2 need 2+ GPUs"))


def _check_nccl(p: Probes, requirements: DeepEPLine, add: Callable[[Finding], None]) -> None:
    """The NCCL runtime torch loads: new enough for ``requirements`` and the only ``libnccl`` mapped.

    Args:
        p: System probes.
        requirements: The DeepEP line whose minimum NCCL applies.
        add: Receives each finding.
    """
    nccl = p.nccl_version()
    if nccl is None:
        add(Finding("nccl-version", FAIL, "torch reports no NCCL", "Use a CUDA build of torch with NCCL."))
    else:
        nccl_ok = tuple(nccl) >= requirements.min_nccl
        add(Finding("nccl-version", OK if nccl_ok else FAIL, f"NCCL {version_text(tuple(nccl))} loaded by torch",
                    "" if nccl_ok else f"DeepEP {requirements.name} needs NCCL >= "
                    f"{version_text(requirements.min_nccl)} at run time: make torch load that libnccl and build "
                    "DeepEP against the same one (python -m megatron_deepepv2.cli.install_deepep does both)."))
    mapped = p.mapped_nccl()
    add(Finding("nccl-single-library", OK if len(mapped) <= 1 else FAIL,
                f"libnccl mapped: {', '.join(mapped) or 'none yet'}",
                "" if len(mapped) <= 1 else "Exactly one libnccl may be mapped (DeepEP asserts at import); drop "
                "LD_PRELOAD of a second NCCL and replace the one torch loads instead."))


def _check_jit_cache(p: Probes, add: Callable[[Finding], None]) -> None:
    """DeepEP's JIT cache directory (``EP_JIT_CACHE_DIR``, else ``~/.deep_ep``) is writable.

    Args:
        p: System probes.
        add: Receives each finding.
    """
    env = p.env
    cache = env.get("EP_JIT_CACHE_DIR") or os.path.join(env.get("HOME", "/root"), ".deep_ep")
    writable = p.writable_dir(cache)
    add(Finding("jit-cache", OK if writable else FAIL,
                f"JIT cache {cache} {'writable' if writable else 'not writable'}",
                "" if writable else "Set EP_JIT_CACHE_DIR to a writable directory."))


def _check_nvlink(p: Probes, add: Callable[[Finding], None]) -> None:
    """NVLink between the GPUs, which DeepEP's intranode path expects.

    Args:
        p: System probes.
        add: Receives each finding.
    """
    nvlink = p.nvlink()
    add(Finding("nvlink", OK if nvlink else (SKIP if nvlink is None else WARN),
                {True: "NVLink between GPUs", False: "no NVLink between GPUs", None: "nvidia-smi unavailable"}[nvlink],
                "" if nvlink else "DeepEP's intranode path expects NVLink; PCIe-only GPUs are not supported."))


def _check_launch_environment(p: Probes, add: Callable[[Finding], None]) -> None:
    """The NVLink-multicast guard variables and the torchrun environment.

    Args:
        p: System probes.
        add: Receives each finding.
    """
    env = p.env
    unset = [f"{k}={v}" for k, v in MULTICAST_GUARDS.items() if env.get(k) != v]
    add(Finding("multicast-guard", OK if not unset else WARN,
                "NVLink multicast disabled" if not unset else f"not set: {', '.join(unset)}",
                "" if not unset else "Where NVLink multicast must stay off, export " + " ".join(unset) + "."))
    missing = [v for v in TORCHRUN_VARS if v not in env]
    add(Finding("torchrun", OK if not missing else SKIP,
                "torchrun environment present" if not missing
                else f"not under torchrun (missing {', '.join(missing)})"))


def run_checks(probes: Optional[Probes] = None) -> list[Finding]:
    """Runs every check.

    Args:
        probes: System probes (default: the real system).

    Returns:
        The findings, in a fixed order.
    """
    p = probes or Probes()
    findings: list[Finding] = []
    add = findings.append
    _check_versions(p, add)
    _check_cuda(p, add)
    line = _check_deep_ep(p, p.deep_ep(), add)
    # Requirements of the installed line; without a usable deep_ep, the 2.1 line's (the lower ones).
    requirements = line or DEEPEP_2_1
    _check_nccl(p, requirements, add)
    _check_nvcc(p, requirements, add)
    _check_transformer_engine(p, add)
    _check_jit_cache(p, add)
    _check_nvlink(p, add)
    _check_gin(p, add)
    _check_launch_environment(p, add)
    return findings


def main(argv: Optional[list[str]] = None, probes: Optional[Probes] = None) -> int:
    """Prints the findings; returns 1 when any is blocking."""
    parser = argparse.ArgumentParser(description="Check the environment for megatron-deepepv2 with DeepEP v2.")
    parser.add_argument("--json", action="store_true", help="print findings as JSON")
    args = parser.parse_args(argv)
    findings = run_checks(probes)
    if args.json:
        print(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f"[{f.status:>4}] {f.check:<20} {f.detail}" + (f"\n{'':27}fix: {f.fix}" if f.fix else ""))
    blocking = [f for f in findings if f.status == FAIL]
    if not args.json:
        print(f"\n{len(blocking)} blocking problem(s)." if blocking else "\nNo blocking problems.")
    return 1 if blocking else 0


if __name__ == "__main__":
    sys.exit(main())
