"""DeepEP v2 installer: ``python -m megatron_deepepv2.cli.install_deepep --deepep-src PATH [--nccl-src PATH]``.

Takes a DeepEP source tree (the 2.1 line or V2.5) to an installed ``deep_ep`` that imports in this Python next to
PyTorch and passes ``python -m megatron_deepepv2.cli.doctor``. The steps, each printed with its time, each skipped when
an earlier run already did it with the same inputs (state in ``--work-dir``):

1. ``source``: the tree (cloned first when a git URL is given), its submodules, its line and version.
2. ``toolchain``: the GPU architecture and nvcc (V2.5's JIT needs nvcc >= 13.1; ``--nvcc-from-registry`` installs
   it from the package registry's ``nvidia-cuda-nvcc`` / ``nvidia-nvvm`` / ``nvidia-cuda-crt`` wheels, whose cubins
   run on a CUDA 13.0 driver).
3. ``nccl``: the NCCL DeepEP is built against and PyTorch loads, in this order: the one PyTorch loads already when it
   is new enough; one built from ``--nccl-src`` for the local GPU architecture only; ``nvidia-nccl-cuXX`` from the
   package registry with ``--nccl-from-registry``.
4. ``torch-nccl``: a source-built NCCL is installed under ``--nccl-prefix`` as ``nvidia/nccl/{lib,include}`` and one
   file, ``megatron_deepepv2_nccl.pth`` in site-packages, puts that prefix first on ``sys.path``, where PyTorch looks
   for ``nvidia/nccl/lib/libnccl.so.*`` (no other package's files change; delete the file to undo). A registry NCCL
   is an ordinary ``pip`` upgrade of the package PyTorch already loads (undo: reinstall the previous version).
5. ``compiler``: the first C++ compiler that links libstdc++ dynamically (``deep_ep._C`` with a static copy crashes
   inside ``std::regex`` at the first dispatch), found by building a probe and reading its ELF ``NEEDED`` entries.
6. ``deep_ep``: ``pip install --no-build-isolation`` of the tree with that compiler and NCCL, then the same ELF check
   on the built ``deep_ep/_C*.so``. A ``deep_ep`` this installer did not install (DeepEP v1 and HybridEP install a
   module of that name too) is replaced only with ``--replace-deep-ep``.
7. ``verify``: a fresh Python imports torch and ``deep_ep``: exactly one ``libnccl`` mapped, the expected one, and
   the line's buffer class present; and NCCL GIN as the library will decide it on this node
   (:func:`megatron_deepepv2.backends.deepep.topology.decide_gin`: off through ``EP_DISABLE_GIN=1`` without an RDMA
   NIC, unless set).
8. ``doctor``: the doctor's report; its exit status is the installer's. Its ``gin`` check makes the same decision, so
   a node without an RDMA NIC passes it without ``EP_DISABLE_GIN`` set.

A build depends on the tree's contents, the GPU architecture, the compiler and the NCCL (not on where the tree lies).

**Build once, install on every node.** With ``--wheel-dir DIR`` the build also leaves its results in ``DIR`` as
wheels: ``deep_ep`` is built as a wheel and installed from it (one build), a source-built NCCL is packed as the wheel
``megatron_deepepv2_nccl`` (library, headers and the ``.pth``), and ``megatron-deepepv2-wheels.json`` records what
they were built for (GPU architecture, Python, CUDA, NCCL, paths). ``--from-wheels DIR`` then installs them on
another machine with the same GPU architecture, CUDA and Python, without building anything: steps ``wheels`` (checks
the manifest against this machine), ``install`` (``pip install --no-index --no-deps`` of the wheels; PyTorch must
then load the wheel's NCCL), ``verify`` and ``doctor``. A later ``--deepep-src`` run with the same tree there finds
nothing to build.

Every action on the machine goes through :class:`System`, so tests inject the build steps.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import glob
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from megatron_deepepv2.backends.deepep.lines import DEEPEP_2_1, LINES, DeepEPLine, Version
from megatron_deepepv2.backends.deepep.probes import line_of_source_tree, source_tree_version, version_text
from megatron_deepepv2.cli.doctor import elf_needed_libraries, find_nvcc, links_libstdcxx_dynamically, nvcc_version
from megatron_deepepv2.backends.deepep.topology import decide_gin, find_rdma_devices

logger = logging.getLogger("megatron_deepepv2.cli.install_deepep")

PTH_NAME = "megatron_deepepv2_nccl.pth"
STATE_NAME = "state.json"
#: What ``--wheel-dir`` writes beside the wheels and ``--from-wheels`` reads first.
WHEEL_MANIFEST = "megatron-deepepv2-wheels.json"
#: The distribution name of the NCCL wheel.
NCCL_WHEEL_NAME = "megatron_deepepv2_nccl"
NVCC_WHEELS = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")
_PROBE_SOURCE = ('#include <regex>\n#include <string>\n'
                 'int probe(const char* s) { return std::regex_match(std::string(s), std::regex("a+b")); }\n')
_PYTHON_PROBE = """
import json, torch
from megatron_deepepv2.backends.deepep.probes import mapped_nccl_libraries, runtime_nccl_version
out = {"nccl": runtime_nccl_version(), "mapped": mapped_nccl_libraries(), "cuda": torch.version.cuda,
       "torch": torch.__version__, "python": "%d.%d" % __import__("sys").version_info[:2]}
if IMPORT_DEEP_EP:
    try:
        import deep_ep
        out["deep_ep"] = getattr(deep_ep, "__version__", "unknown")
        out["buffers"] = [name for name in ("EPBuffer", "ElasticBuffer", "Buffer") if hasattr(deep_ep, name)]
        out["mapped"] = mapped_nccl_libraries()
    except BaseException as error:
        out["error"] = f"{type(error).__name__}: {error}"
print("PROBE" + json.dumps(out))
"""


class InstallError(RuntimeError):
    """A step failed; the message says what was wrong and how to fix it."""

    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"step '{step}' failed: {message}")
        self.step = step


@dataclass(frozen=True)
class InstallOptions:
    """What the user asked for (one field per command-line option).

    Attributes:
        deepep_src: DeepEP source tree, or a git URL to clone (needs network). Exactly one of it and
            ``from_wheels``.
        nccl_src: NCCL source tree to build when no suitable NCCL is there.
        nccl_from_registry: Upgrade ``nvidia-nccl-cuXX`` from the package registry when no suitable NCCL is there.
        nvcc_from_registry: Install nvcc >= 13.1 from the package registry when the line needs it and it is missing.
        work_dir: Build folder and the installer's state (makes reruns skip finished steps).
        nccl_prefix: Where a source-built NCCL is installed (default: under ``sys.prefix``).
        cxx: The C++ compiler to use (default: the first of ``$CXX``, ``/usr/bin/g++``, ``g++``, ``c++`` that links
            libstdc++ dynamically).
        arch: GPU architecture as ``"90"`` (default: the visible GPU's).
        jobs: Parallel build jobs.
        replace_deep_ep: Replace a ``deep_ep`` this installer did not install.
        dry_run: Print the plan and the commands; change nothing.
        run_doctor: Finish with the doctor.
        wheel_dir: Also leave the build's results in this folder as wheels, with their manifest.
        from_wheels: Install the wheels a ``wheel_dir`` build left in this folder instead of building.
    """

    deepep_src: Optional[str] = None
    nccl_src: Optional[str] = None
    nccl_from_registry: bool = False
    nvcc_from_registry: bool = False
    work_dir: str = os.path.join(os.path.expanduser("~"), ".cache", "megatron-deepepv2", "install")
    nccl_prefix: Optional[str] = None
    cxx: Optional[str] = None
    arch: Optional[str] = None
    jobs: int = max(os.cpu_count() or 1, 1)
    replace_deep_ep: bool = False
    dry_run: bool = False
    run_doctor: bool = True
    wheel_dir: Optional[str] = None
    from_wheels: Optional[str] = None


def _run_command(cmd: list[str], env: dict[str, str], cwd: Optional[str], log_path: Optional[str]) -> int:
    """Runs ``cmd``; its output goes to ``log_path`` (else to ours). A program that cannot start gives 127."""
    try:
        if log_path is None:
            return subprocess.run(cmd, env=env, cwd=cwd, check=False).returncode
        with open(log_path, "w", encoding="utf-8") as log:
            return subprocess.run(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    except OSError as error:
        logger.error("    cannot start %s: %s", cmd[0], error)
        return 127


def _probe_python(python: str, import_deep_ep: bool, env: dict[str, str]) -> dict[str, Any]:
    """Runs the probe in a fresh interpreter (``.pth`` files and NCCL loading happen only at start-up)."""
    code = _PYTHON_PROBE.replace("IMPORT_DEEP_EP", str(bool(import_deep_ep)))
    done = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, check=False)
    for line in done.stdout.splitlines():
        if line.startswith("PROBE"):
            return json.loads(line[len("PROBE"):])
    return {"error": f"the probe interpreter failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}"}


def _gpu_arch() -> Optional[str]:
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"{major}{minor}"


def _distribution(name: str) -> Optional[dict[str, Any]]:
    """Version and files of an installed distribution (None when absent)."""
    from importlib import metadata  # noqa: PLC0415

    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None
    return {"version": dist.version, "files": [str(dist.locate_file(f)) for f in (dist.files or [])]}


def _has_distribution_like(fragment: str) -> bool:
    from importlib import metadata  # noqa: PLC0415

    return any(fragment in (d.metadata["Name"] or "").lower().replace("_", "-") for d in metadata.distributions())


@dataclass
class System:
    """Everything the installer reads from or does to the machine; tests replace fields.

    Attributes:
        env: The environment the commands run with.
        python: The interpreter to install into (this one).
        run: Runs a command (argv, env, cwd, log file or None) and returns its exit status.
        probe_python: Starts a fresh interpreter and reports the NCCL it loaded (``nccl``, ``mapped``, ``cuda``)
            and, when asked, what ``import deep_ep`` gave (``deep_ep``, ``buffers`` or ``error``).
        gpu_arch: The visible GPU's architecture (``"90"``), None without a GPU.
        find_nvcc: Locates nvcc from an environment.
        nvcc_version: ``(major, minor)`` of an nvcc.
        needed_libraries: ELF ``NEEDED`` entries of a shared object.
        distribution: Version and files of an installed distribution, None when absent.
        has_distribution_like: Whether a distribution whose name contains a fragment is installed.
        which: Locates an executable.
        site_packages: This environment's site-packages.
        prefix: This environment's ``sys.prefix`` (where a wheel's data files go).
        rdma_devices: This node's RDMA devices (empty without an RDMA NIC).
    """

    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    python: str = sys.executable
    run: Callable[[list[str], dict[str, str], Optional[str], Optional[str]], int] = _run_command
    probe_python: Callable[[str, bool, dict[str, str]], dict[str, Any]] = _probe_python
    gpu_arch: Callable[[], Optional[str]] = _gpu_arch
    find_nvcc: Callable[[dict[str, str]], Optional[str]] = find_nvcc
    nvcc_version: Callable[[str], Optional[Version]] = nvcc_version
    needed_libraries: Callable[[str], list[str]] = elf_needed_libraries
    distribution: Callable[[str], Optional[dict[str, Any]]] = _distribution
    has_distribution_like: Callable[[str], bool] = _has_distribution_like
    which: Callable[[str], Optional[str]] = shutil.which
    site_packages: Callable[[], str] = lambda: sysconfig.get_paths()["purelib"]
    prefix: str = sys.prefix
    rdma_devices: Callable[[], list[str]] = find_rdma_devices


def nccl_source_version(path: str) -> Version:
    """The version an NCCL source tree builds (``makefiles/version.mk``).

    Raises:
        ValueError: If ``path`` is not an NCCL source tree.
    """
    try:
        with open(os.path.join(path, "makefiles", "version.mk"), encoding="utf-8") as mk:
            text = mk.read()
    except OSError as error:
        raise ValueError(f"{path} is not an NCCL source tree (no makefiles/version.mk): {error}") from error
    parts = [re.search(rf"^NCCL_{key}\s*:=\s*(\d+)", text, re.MULTILINE) for key in ("MAJOR", "MINOR", "PATCH")]
    if not all(parts):
        raise ValueError(f"{path}/makefiles/version.mk does not state NCCL_MAJOR/MINOR/PATCH")
    return tuple(int(p.group(1)) for p in parts)  # type: ignore[union-attr]


def _tree_fingerprint(path: str) -> str:
    """Changes when any source file of a tree changes (relative paths and contents; build outputs and git's metadata
    excluded), and only then: the same tree copied elsewhere or to another machine, cloned with its submodules (whose
    ``.git`` is a file) or unpacked from archives, has the same fingerprint."""
    digest = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs
                         if d not in {"build", "dist", ".git", "__pycache__"} and not d.endswith(".egg-info"))
        for name in sorted(f for f in files if f != ".git"):
            file_path = os.path.join(root, name)
            digest.update(os.path.relpath(file_path, path).encode() + b"\0")
            if not os.path.islink(file_path):
                with open(file_path, "rb") as f:
                    digest.update(hashlib.sha256(f.read()).digest())
    return digest.hexdigest()[:16]


def write_wheel(wheel_dir: str, name: str, version: str, files: list[tuple[str, str]], summary: str) -> str:
    """Writes a wheel (``py3-none-linux_<machine>``, root is purelib) of ``files`` into ``wheel_dir``.

    Args:
        wheel_dir: Output folder.
        name: Distribution name (``[A-Za-z0-9_]``).
        version: Its version (a local label such as ``+sm90`` included).
        files: ``(path inside the wheel, file on disk)`` pairs; a path under ``<name>-<version>.data/data/`` is
            installed relative to the target environment's ``sys.prefix``.
        summary: One line for the metadata.

    Returns:
        The wheel's path.
    """
    dist_info = f"{name}-{version}.dist-info"
    tag = f"py3-none-linux_{platform.machine()}"
    path = os.path.join(wheel_dir, f"{name}-{version}-{tag}.whl")
    generated = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: {summary}\n",
        f"{dist_info}/WHEEL": f"Wheel-Version: 1.0\nGenerator: megatron_deepepv2.cli.install_deepep\n"
                              f"Root-Is-Purelib: true\nTag: {tag}\n",
    }
    record = []
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
        entries = [(arcname, None, source) for arcname, source in files]
        entries += [(arcname, text.encode(), None) for arcname, text in generated.items()]
        for arcname, data, source in entries:
            if data is None:
                with open(source, "rb") as f:
                    data = f.read()
            wheel.writestr(zipfile.ZipInfo(arcname, date_time=(2020, 1, 1, 0, 0, 0)), data,
                           compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{arcname},sha256={digest},{len(data)}")
        record.append(f"{dist_info}/RECORD,,")
        wheel.writestr(zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(2020, 1, 1, 0, 0, 0)),
                       "\n".join(record) + "\n", compress_type=zipfile.ZIP_DEFLATED)
    return path


def nccl_pth_line(prefix_relative: str) -> str:
    """The ``.pth`` line that puts ``<sys.prefix>/<prefix_relative>`` first on ``sys.path`` (PyTorch looks there for
    ``nvidia/nccl/lib/libnccl.so.*``)."""
    parts = ", ".join(repr(part) for part in prefix_relative.split(os.sep))
    return (f"import os, sys; p = os.path.join(sys.prefix, {parts}); "
            "sys.path.insert(0, p) if p not in sys.path else None\n")


def build_nccl_wheel(wheel_dir: str, nccl_root: str, prefix_relative: str, version: Version, arch: str) -> str:
    """Packs a source-built NCCL (``nccl_root`` = ``<prefix>/nvidia/nccl``) as the wheel ``megatron_deepepv2_nccl``.

    The wheel installs the library as ``lib/libnccl.so.<major>`` and the headers (DeepEP's JIT compiles against them at
    run time) under ``<sys.prefix>/<prefix_relative>/nvidia/nccl`` of the target environment, and the ``.pth`` that
    makes PyTorch load that library.

    Args:
        wheel_dir: Output folder.
        nccl_root: The installed NCCL (``lib/libnccl.so.<version>`` and ``include/``).
        prefix_relative: Its prefix relative to the environment's ``sys.prefix``.
        version: NCCL version.
        arch: The GPU architecture it was built for (``"90"``): the wheel's local version label.

    Returns:
        The wheel's path.
    """
    name = NCCL_WHEEL_NAME
    wheel_version = f"{version_text(version)}+sm{arch}"
    data = f"{name}-{wheel_version}.data/data/" + "/".join(prefix_relative.split(os.sep)) + "/nvidia/nccl"
    library = os.path.realpath(os.path.join(nccl_root, "lib", f"libnccl.so.{version_text(version)}"))
    files = [(f"{data}/lib/libnccl.so.{version[0]}", library)]
    include = os.path.join(nccl_root, "include")
    for folder, _, names in sorted(os.walk(include)):
        for file_name in sorted(names):
            path = os.path.join(folder, file_name)
            files.append((f"{data}/include/" + os.path.relpath(path, include).replace(os.sep, "/"), path))
    with tempfile.TemporaryDirectory() as tmp:
        pth = os.path.join(tmp, PTH_NAME)
        with open(pth, "w", encoding="utf-8") as out:
            out.write(nccl_pth_line(prefix_relative))
        files.append((PTH_NAME, pth))
        return write_wheel(wheel_dir, name, wheel_version, files,
                           f"NCCL {version_text(version)} built for sm_{arch} by megatron_deepepv2.cli.install_deepep")


@dataclass
class _Plan:
    """What the steps decided; later steps read it."""

    source: str = ""
    line: DeepEPLine = DEEPEP_2_1
    version: str = "unknown"
    arch: str = "90"
    cuda_home: str = ""
    nccl_kind: str = ""  # "torch" | "source" | "registry"
    nccl_root: str = ""
    nccl_version: Version = ()
    nccl_package: str = ""  # the registry package, for "registry"
    cxx: str = ""
    cc: Optional[str] = None


class Installer:
    """Runs the steps in order; see the module docstring.

    Args:
        options: What the user asked for.
        system: The machine (default: the real one).

    Raises:
        InstallError: If the options ask for neither or both of a source tree and wheels.
    """

    STEPS = ("source", "toolchain", "nccl", "torch-nccl", "compiler", "deep_ep", "verify", "doctor")
    #: With ``wheel_dir``: the wheels are written after the build, before the verification.
    WHEEL_DIR_STEPS = ("source", "toolchain", "nccl", "torch-nccl", "compiler", "deep_ep", "wheels", "verify", "doctor")
    #: With ``from_wheels``.
    FROM_WHEELS_STEPS = ("wheels", "install", "verify", "doctor")

    def __init__(self, options: InstallOptions, system: Optional[System] = None) -> None:
        if bool(options.deepep_src) == bool(options.from_wheels):
            raise InstallError("options", "give either --deepep-src (build) or --from-wheels (install wheels a "
                               "--wheel-dir build wrote), not both and not neither")
        if options.from_wheels and options.wheel_dir:
            raise InstallError("options", "--wheel-dir writes the wheels of a build; --from-wheels installs them: "
                               "give one")
        self.options = options
        self.system = system or System()
        self.plan = _Plan()
        self._state_path = os.path.join(options.work_dir, STATE_NAME)
        self._state: dict[str, Any] = {}
        self._manifest: dict[str, Any] = {}
        if options.from_wheels:
            self.steps = self.FROM_WHEELS_STEPS
        else:
            self.steps = self.WHEEL_DIR_STEPS if options.wheel_dir else self.STEPS

    # ------------------------------------------------------------------ driver
    def run(self) -> int:
        """Runs every step; returns the doctor's exit status (0 when doctor is skipped).

        Raises:
            InstallError: The first step that failed, with what to do.
        """
        os.makedirs(self.options.work_dir, exist_ok=True)
        self._load_state()
        status = 0
        started = time.monotonic()
        for number, name in enumerate(self.steps, 1):
            step_started = time.monotonic()
            logger.info("[%d/%d] %s ...", number, len(self.steps), name)
            step = name if name != "wheels" or not self.options.from_wheels else "check-wheels"
            outcome = getattr(self, "_step_" + step.replace("-", "_"))()
            if name == "doctor" and isinstance(outcome, int):
                status, outcome = outcome, f"exit status {outcome}"
            logger.info("[%d/%d] %s: %s (%.1f s)", number, len(self.steps), name, outcome,
                        time.monotonic() - step_started)
        logger.info("done in %.1f s%s", time.monotonic() - started, " (dry run: nothing changed)"
                    if self.options.dry_run else "")
        return status

    def _load_state(self) -> None:
        try:
            with open(self._state_path, encoding="utf-8") as state:
                self._state = json.load(state)
        except (OSError, ValueError):
            self._state = {}

    def _save_state(self, key: str, value: Any) -> None:
        self._state[key] = value
        if not self.options.dry_run:
            with open(self._state_path, "w", encoding="utf-8") as state:
                json.dump(self._state, state, indent=2, sort_keys=True)

    def _probe(self, *, import_deep_ep: bool) -> dict[str, Any]:
        """What a fresh interpreter of this environment reports (``System.probe_python``), importing ``deep_ep`` or
        not."""
        return self.system.probe_python(self.system.python, import_deep_ep, self.system.env)

    def _execute(self, step: str, cmd: list[str], env: Optional[dict[str, str]] = None, cwd: Optional[str] = None,
                 log_name: Optional[str] = None) -> None:
        """Runs one command of a step (only prints it in a dry run); a non-zero exit is the step's failure."""
        printable = " ".join(cmd)
        if self.options.dry_run:
            logger.info("    would run: %s", printable)
            return
        log_path = os.path.join(self.options.work_dir, log_name) if log_name else None
        logger.info("    running: %s%s", printable, f" (log: {log_path})" if log_path else "")
        code = self.system.run(cmd, env or self.system.env, cwd, log_path)
        if code != 0:
            tail = ""
            if log_path and os.path.exists(log_path):
                with open(log_path, encoding="utf-8", errors="replace") as log:
                    tail = "\n" + "".join(log.readlines()[-25:])
            raise InstallError(step, f"`{printable}` exited with status {code}"
                               + (f"; full log: {log_path}" if log_path else "") + tail)

    def _pip(self, step: str, *args: str, log_name: Optional[str] = None, env: Optional[dict[str, str]] = None) -> None:
        self._execute(step, [self.system.python, "-m", "pip", "install", *args], env=env, log_name=log_name)

    # ------------------------------------------------------------------ steps
    def _step_source(self) -> str:
        source = self.options.deepep_src
        if re.match(r"^(https?|ssh|git)://|^git@", source):
            target = os.path.join(self.options.work_dir, "DeepEP")
            if not os.path.isdir(target):
                self._execute("source", ["git", "clone", "--recursive", source, target])
            source = target
        source = os.path.abspath(source)
        if not os.path.isfile(os.path.join(source, "setup.py")) and not self.options.dry_run:
            raise InstallError("source", f"{source} has no setup.py: pass the root of a DeepEP checkout to "
                               "--deepep-src")
        if os.path.isdir(source):
            try:
                self.plan.line = line_of_source_tree(source)
            except ValueError as error:
                raise InstallError("source", str(error)) from error
            missing = [path for path in self._submodule_paths(source)
                       if not os.path.isdir(os.path.join(source, path)) or not os.listdir(os.path.join(source, path))]
            if missing:
                raise InstallError("source", f"the DeepEP tree at {source} lacks its submodule(s) "
                                   f"{', '.join(missing)}: run `git -C {source} submodule update --init --recursive` "
                                   "(or copy them in)")
        self.plan.source = source
        self.plan.version = source_tree_version(source)
        return f"DeepEP {self.plan.version} ({self.plan.line.name} line, {self.plan.line.buffer_class}) at {source}"

    @staticmethod
    def _submodule_paths(source: str) -> list[str]:
        try:
            with open(os.path.join(source, ".gitmodules"), encoding="utf-8") as modules:
                return re.findall(r"^\s*path\s*=\s*(\S+)", modules.read(), re.MULTILINE)
        except OSError:
            return []

    def _step_toolchain(self) -> str:
        line = self.plan.line
        arch = self.options.arch or self.system.gpu_arch()
        if arch is None:
            raise InstallError("toolchain", "no GPU is visible and --arch was not given: run on the GPU machine, or "
                               "pass --arch 90 (Hopper) / --arch 100 (Blackwell)")
        if arch not in ("90", "100"):
            raise InstallError("toolchain", f"GPU architecture sm_{arch} is not supported by DeepEP v2 (sm_90 Hopper "
                               "or sm_100 Blackwell)")
        self.plan.arch = arch
        nvcc = self.system.find_nvcc(self.system.env)
        version = self.system.nvcc_version(nvcc) if nvcc else None
        if line.min_nvcc and (version is None or version < line.min_nvcc):
            nvcc, version = self._nvcc_from_registry(nvcc, version)
        if nvcc is None:
            raise InstallError("toolchain", "nvcc not found (CUDA_HOME, CUDA_PATH, PATH, /usr/local/cuda): DeepEP "
                               "builds with it and JIT-compiles its kernels with it at run time; install a CUDA "
                               "toolkit")
        self.plan.cuda_home = os.path.dirname(os.path.dirname(nvcc))
        if line.needs_nvshmem and not (self.system.has_distribution_like("nvidia-nvshmem")
                                       or any(k in self.system.env for k in ("EP_NVSHMEM_ROOT_DIR", "NVSHMEM_DIR"))):
            raise InstallError("toolchain", f"DeepEP {line.name} builds its legacy kernels against NVSHMEM, which "
                               "is not installed: `pip install nvidia-nvshmem-cu13` (or -cu12), or set NVSHMEM_DIR")
        return f"sm_{arch}, nvcc {version_text(version)} at {nvcc}"

    def _nvcc_from_registry(self, nvcc: Optional[str],
                            version: Optional[Version]) -> tuple[Optional[str], Optional[Version]]:
        line = self.plan.line
        found = f"nvcc {version_text(version)} at {nvcc}" if nvcc else "no nvcc"
        if not self.options.nvcc_from_registry:
            raise InstallError("toolchain", f"DeepEP {line.name}'s JIT needs nvcc >= {version_text(line.min_nvcc)}; "
                               f"found {found}. Install a CUDA {version_text(line.min_nvcc)}+ toolkit and set "
                               "CUDA_HOME, or pass --nvcc-from-registry (pip wheels nvidia-cuda-nvcc / nvidia-nvvm / "
                               "nvidia-cuda-crt; their cubins run on a CUDA 13.0 driver, their PTX needs a newer one)")
        self._pip("toolchain", *[f"{name}>={version_text(line.min_nvcc)}" for name in NVCC_WHEELS])
        if self.options.dry_run:
            return os.path.join(self.system.site_packages(), "nvidia", "cu13", "bin", "nvcc"), line.min_nvcc
        candidates = sorted(glob.glob(os.path.join(self.system.site_packages(), "nvidia", "**", "bin", "nvcc"),
                                      recursive=True))
        for candidate in candidates:
            candidate_version = self.system.nvcc_version(candidate)
            if candidate_version and candidate_version >= line.min_nvcc:
                logger.info("    nvcc %s from the registry: set CUDA_HOME=%s for DeepEP's JIT at run time",
                            version_text(candidate_version), os.path.dirname(os.path.dirname(candidate)))
                return candidate, candidate_version
        raise InstallError("toolchain", f"installed {', '.join(NVCC_WHEELS)} but found no nvcc >= "
                           f"{version_text(line.min_nvcc)} under {self.system.site_packages()}/nvidia")

    def _step_nccl(self) -> str:
        minimum = self.plan.line.min_nccl
        probe = self._probe(import_deep_ep=False)
        loaded = tuple(probe.get("nccl") or ())
        mapped = probe.get("mapped") or []
        if loaded and loaded >= minimum and len(mapped) == 1:
            root = os.path.dirname(os.path.dirname(os.path.realpath(mapped[0])))
            if os.path.isfile(os.path.join(root, "include", "nccl.h")):
                self._set_nccl("torch", root, loaded)
                return f"PyTorch already loads NCCL {version_text(loaded)} from {mapped[0]}: nothing to build"
            logger.info("    NCCL %s loaded from %s has no headers next to it (%s/include/nccl.h)",
                        version_text(loaded), mapped[0], root)
        found = f"PyTorch loads NCCL {version_text(loaded)}" + (f" from {mapped[0]}" if mapped else "")
        if self.options.nccl_src:
            return self._nccl_from_source(found)
        if self.options.nccl_from_registry:
            return self._nccl_from_registry(probe, found)
        raise InstallError("nccl", f"DeepEP {self.plan.line.name} needs NCCL >= {version_text(minimum)}; {found}. "
                           "Pass --nccl-src PATH (an NCCL source tree, built here for this GPU only) or "
                           "--nccl-from-registry (pip upgrade of nvidia-nccl-cuXX; needs the package registry)")

    def _set_nccl(self, kind: str, root: str, version: Version) -> None:
        self.plan.nccl_kind, self.plan.nccl_root, self.plan.nccl_version = kind, root, version

    def _default_nccl_prefix(self, version: Version) -> str:
        return os.path.join(self.system.prefix, "share", "megatron-deepepv2",
                            f"nccl-{version_text(version)}-sm{self.plan.arch}")

    def _nccl_from_source(self, found: str) -> str:
        source = os.path.abspath(self.options.nccl_src or "")
        try:
            version = nccl_source_version(source)
        except ValueError as error:
            raise InstallError("nccl", str(error)) from error
        minimum = self.plan.line.min_nccl
        if version < minimum:
            raise InstallError("nccl", f"the NCCL source tree at {source} is {version_text(version)}; DeepEP "
                               f"{self.plan.line.name} needs >= {version_text(minimum)}: check out a newer NCCL "
                               "release")
        prefix = os.path.abspath(self.options.nccl_prefix or self._default_nccl_prefix(version))
        root = os.path.join(prefix, "nvidia", "nccl")
        stamp = {"version": list(version), "arch": self.plan.arch, "source": source}
        library = os.path.join(root, "lib", f"libnccl.so.{version_text(version)}")
        self._set_nccl("source", root, version)
        if self._state.get("nccl") == stamp and os.path.isfile(library):
            return f"{found}; NCCL {version_text(version)} for sm_{self.plan.arch} already built at {root}"
        build_dir = os.path.join(self.options.work_dir, f"nccl-build-{version_text(version)}-sm{self.plan.arch}")
        started = time.monotonic()
        self._execute("nccl", ["make", "-C", source, f"-j{self.options.jobs}", "src.build", f"BUILDDIR={build_dir}",
                               f"NVCC_GENCODE=-gencode=arch=compute_{self.plan.arch},code=sm_{self.plan.arch}",
                               f"CUDA_HOME={self.plan.cuda_home}"], log_name="nccl-build.log")
        built_seconds = time.monotonic() - started
        if self.options.dry_run:
            return f"{found}; would build NCCL {version_text(version)} for sm_{self.plan.arch} into {root}"
        self._install_nccl_build(build_dir, root, version)
        size = os.path.getsize(library) / 2**20
        self._save_state("nccl", stamp)
        return (f"{found}; built NCCL {version_text(version)} for sm_{self.plan.arch} in {built_seconds:.0f} s, "
                f"libnccl {size:.0f} MiB, installed at {root}")

    @staticmethod
    def _install_nccl_build(build_dir: str, root: str, version: Version) -> None:
        """Copies the shared library (with its soname links) and the headers of an NCCL build under ``root``."""
        built = os.path.join(build_dir, "lib", f"libnccl.so.{version_text(version)}")
        if not os.path.isfile(built):
            raise InstallError("nccl", f"the NCCL build finished but {built} is missing; see the build log")
        lib_dir, include_dir = os.path.join(root, "lib"), os.path.join(root, "include")
        os.makedirs(lib_dir, exist_ok=True)
        shutil.copy2(built, lib_dir)
        for link in (f"libnccl.so.{version[0]}", "libnccl.so"):
            target = os.path.join(lib_dir, link)
            if os.path.lexists(target):
                os.remove(target)
            os.symlink(os.path.basename(built), target)
        # The whole header tree: nccl_device.h includes nccl_device/impl/*.h.
        shutil.copytree(os.path.join(build_dir, "include"), include_dir, dirs_exist_ok=True)

    def _nccl_from_registry(self, probe: dict[str, Any], found: str) -> str:
        cuda = str(probe.get("cuda") or "")
        if not cuda:
            raise InstallError("nccl", "this PyTorch is not a CUDA build; install a CUDA build of torch first")
        package = f"nvidia-nccl-cu{cuda.split('.')[0]}"
        before = self.system.distribution(package)
        requirement = f"{package}>={version_text(self.plan.line.min_nccl)}"
        self._pip("nccl", "--upgrade", requirement)
        undo = f"`pip install {package}=={before['version']}`" if before else f"`pip uninstall {package}`"
        logger.info("    %s replaces the NCCL PyTorch pins (pip may warn that torch requires another version; "
                    "NCCL keeps its ABI across 2.x). Undo: %s", requirement, undo)
        if self.options.dry_run:
            return f"{found}; would install {requirement}"
        after = self._probe(import_deep_ep=False)
        mapped = after.get("mapped") or []
        version = tuple(after.get("nccl") or ())
        if not mapped or version < self.plan.line.min_nccl:
            raise InstallError("nccl", f"after installing {requirement} PyTorch loads NCCL {version_text(version)} "
                               f"({', '.join(mapped) or 'none mapped'}); another NCCL earlier on sys.path or "
                               "LD_LIBRARY_PATH wins: remove it")
        self._set_nccl("registry", os.path.dirname(os.path.dirname(os.path.realpath(mapped[0]))), version)
        self.plan.nccl_package = package
        return f"{found}; installed {package} {version_text(version)} from the registry (undo: {undo})"

    def _step_torch_nccl(self) -> str:
        pth = os.path.join(self.system.site_packages(), PTH_NAME)
        if self.plan.nccl_kind != "source":
            return "no change (PyTorch loads the NCCL DeepEP builds against)"
        prefix = os.path.dirname(os.path.dirname(self.plan.nccl_root))
        content = (f"# megatron-deepepv2 install_deepep: PyTorch loads the NCCL under {prefix}. "
                   "Delete this file to undo.\n"
                   f"import sys; sys.path.insert(0, {prefix!r}) if {prefix!r} not in sys.path else None\n")
        current = open(pth, encoding="utf-8").read() if os.path.isfile(pth) else None
        if current != content and not self.options.dry_run:
            with open(pth, "w", encoding="utf-8") as out:
                out.write(content)
        if self.options.dry_run:
            return f"would write {pth}"
        expected = os.path.join(self.plan.nccl_root, "lib", f"libnccl.so.{version_text(self.plan.nccl_version)}")
        self._check_torch_loads(expected, "torch-nccl", pth)
        return f"{'unchanged' if current == content else 'wrote'} {pth}: PyTorch loads {expected} (undo: delete {pth})"

    def _step_compiler(self) -> str:
        env = self.system.env
        names = [self.options.cxx] if self.options.cxx else [env.get("CXX"), "/usr/bin/g++", "g++", "c++"]
        verdicts, tried = [], set()
        for name in dict.fromkeys(n for n in names if n):
            path = self.system.which(name)  # absolute paths too: None unless an executable is there
            if not path:
                verdicts.append(f"{name}: not found")
                continue
            if path in tried:
                continue
            tried.add(path)
            verdict = self._probe_compiler(path)
            if verdict is None:
                self.plan.cxx = path
                self.plan.cc = self._matching_c_compiler(path)
                return f"{path} links libstdc++ dynamically" + (f" (C compiler {self.plan.cc})" if self.plan.cc else "")
            verdicts.append(f"{path}: {verdict}")
        raise InstallError("compiler", "no C++ compiler that links libstdc++ dynamically (deep_ep._C with a static "
                           "copy crashes inside std::regex at the first dispatch): " + "; ".join(verdicts)
                           + ". Install g++ (e.g. GCC 13 at /usr/bin/g++) and pass --cxx")

    def _probe_compiler(self, cxx: str) -> Optional[str]:
        """Builds a shared object that uses libstdc++ with ``cxx``; None when it links libstdc++ dynamically."""
        with tempfile.TemporaryDirectory() as tmp:
            source, output = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
            with open(source, "w", encoding="utf-8") as out:
                out.write(_PROBE_SOURCE)
            code = self.system.run([cxx, "-std=c++17", "-shared", "-fPIC", "-O0", source, "-o", output],
                                   self.system.env, tmp, os.path.join(tmp, "log"))
            if code != 0 or not os.path.isfile(output):
                return f"cannot build a shared object (exit {code})"
            needed = self.system.needed_libraries(output)
        if links_libstdcxx_dynamically(needed):
            return None
        return f"links libstdc++ statically (NEEDED: {', '.join(needed)})"

    def _matching_c_compiler(self, cxx: str) -> Optional[str]:
        base = os.path.basename(cxx)
        for cpp, c in (("g++", "gcc"), ("clang++", "clang"), ("c++", "cc")):
            if cpp in base:
                candidate = os.path.join(os.path.dirname(cxx), base.replace(cpp, c))
                if os.path.exists(candidate):
                    return candidate
        return None

    def _deep_ep_fingerprint(self) -> dict[str, Any]:
        """What a deep_ep build depends on: the tree's contents, the architecture, the compiler and the NCCL."""
        return {"tree": _tree_fingerprint(self.plan.source) if os.path.isdir(self.plan.source) else "",
                "version": self.plan.version, "arch": self.plan.arch, "cxx": self.plan.cxx,
                "nccl_root": self.plan.nccl_root, "nccl_version": list(self.plan.nccl_version)}

    def _installed_extension(self) -> tuple[Optional[dict[str, Any]], Optional[str]]:
        installed = self.system.distribution("deep_ep")
        if installed is None:
            return None, None
        extensions = [f for f in installed["files"] if re.search(r"deep_ep[/\\]_C[^/\\]*\.so$", f)]
        return installed, (extensions[0] if extensions else None)

    def _step_deep_ep(self) -> str:
        fingerprint = self._deep_ep_fingerprint()
        installed, extension = self._installed_extension()
        ours = self._state.get("deep_ep")
        if installed and ours == {**fingerprint, "installed_version": installed["version"]} and extension \
                and os.path.isfile(extension):
            self._check_extension(extension)
            done = f"deep_ep {installed['version']} already installed from this tree: {extension}"
            if self.options.wheel_dir and not self._current_deep_ep_wheel(fingerprint):
                self._build_deep_ep_wheel(fingerprint)  # the wheel alone: the installed build is this tree's
                done += "; its wheel built anew"
            return done
        if installed and not self.options.replace_deep_ep \
                and (ours or {}).get("installed_version") != installed["version"]:
            raise InstallError("deep_ep", f"a deep_ep {installed['version']} that this installer did not install is "
                               "already there (DeepEP v1, HybridEP and DeepEP v2 all install the module deep_ep): pass "
                               "--replace-deep-ep to replace it, or use another environment")
        started = time.monotonic()
        if self.options.wheel_dir:  # one build: the wheel, then this environment installs it
            wheel = self._build_deep_ep_wheel(fingerprint)
            self._pip("deep_ep", "--no-index", "--no-deps", "--force-reinstall", wheel, log_name="deep_ep-install.log")
        else:
            self._pip("deep_ep", "--no-build-isolation", "--no-deps", "--no-cache-dir", "-v", self.plan.source,
                      log_name="deep_ep-build.log", env=self._build_env())
        if self.options.dry_run:
            return f"would build DeepEP with {self.plan.cxx} against NCCL at {self.plan.nccl_root}"
        installed, extension = self._checked_extension("deep_ep", "deep_ep-build.log")
        self._save_state("deep_ep", {**fingerprint, "installed_version": installed["version"]})
        return f"built and installed deep_ep {installed['version']} in {time.monotonic() - started:.0f} s: {extension}"

    def _build_env(self) -> dict[str, str]:
        """The environment DeepEP builds with: the chosen compilers, CUDA, architecture and NCCL."""
        env = dict(self.system.env)
        env.update({"CXX": self.plan.cxx, "LDSHARED": f"{self.plan.cxx} -shared", "CUDA_HOME": self.plan.cuda_home,
                    "TORCH_CUDA_ARCH_LIST": f"{self.plan.arch[:-1]}.{self.plan.arch[-1]}",
                    "MAX_JOBS": str(self.options.jobs), "EP_NCCL_ROOT_DIR": self.plan.nccl_root})
        if self.plan.cc:
            env["CC"] = self.plan.cc
        return env

    def _current_deep_ep_wheel(self, fingerprint: dict[str, Any]) -> Optional[str]:
        """The deep_ep wheel an earlier run built from this tree into ``wheel_dir``, when it is still there."""
        built = self._state.get("deep_ep_wheel") or {}
        wheel = built.get("wheel")
        same_dir = wheel and os.path.dirname(wheel) == os.path.abspath(self.options.wheel_dir or "")
        if same_dir and built.get("fingerprint") == fingerprint and os.path.isfile(wheel):
            return wheel
        return None

    def _build_deep_ep_wheel(self, fingerprint: dict[str, Any]) -> str:
        """``pip wheel`` of the DeepEP tree into ``wheel_dir`` (its earlier deep_ep wheels are replaced)."""
        wheel_dir = os.path.abspath(self.options.wheel_dir or "")
        if not self.options.dry_run:
            os.makedirs(wheel_dir, exist_ok=True)
            for old in glob.glob(os.path.join(wheel_dir, "deep_ep-*.whl")):
                os.remove(old)
        self._execute("deep_ep", [self.system.python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                                  "--no-cache-dir", "-v", "-w", wheel_dir, self.plan.source],
                      env=self._build_env(), log_name="deep_ep-build.log")
        if self.options.dry_run:
            return os.path.join(wheel_dir, f"deep_ep-{self.plan.version}-*.whl")
        built = glob.glob(os.path.join(wheel_dir, "deep_ep-*.whl"))
        if len(built) != 1:
            raise InstallError("deep_ep", f"pip wheel finished but {wheel_dir} holds {len(built)} deep_ep wheels "
                               f"({', '.join(map(os.path.basename, built)) or 'none'}); see deep_ep-build.log")
        self._save_state("deep_ep_wheel", {"fingerprint": fingerprint, "wheel": built[0]})
        return built[0]

    # ------------------------------------------------------------------ wheels
    def _step_wheels(self) -> str:
        """Build mode: the NCCL wheel (for a source-built NCCL) and the manifest, beside the deep_ep wheel."""
        wheel_dir = os.path.abspath(self.options.wheel_dir or "")
        deep_ep_wheel = self._current_deep_ep_wheel(self._deep_ep_fingerprint())
        if self.options.dry_run:
            return f"would write the NCCL wheel and {WHEEL_MANIFEST} to {wheel_dir}"
        if deep_ep_wheel is None:
            raise InstallError("wheels", f"no deep_ep wheel of this tree in {wheel_dir}: rerun the installer with "
                               "--wheel-dir (it builds one)")
        nccl: dict[str, Any] = {"kind": self.plan.nccl_kind, "version": list(self.plan.nccl_version)}
        nccl_wheel = None
        if self.plan.nccl_kind == "source":
            prefix = os.path.dirname(os.path.dirname(self.plan.nccl_root))
            relative = os.path.relpath(prefix, self.system.prefix)
            if relative == os.pardir or relative.startswith(os.pardir + os.sep):
                raise InstallError("wheels", f"the NCCL was installed at {prefix}, outside this environment "
                                   f"({self.system.prefix}); its wheel installs it relative to the environment it goes "
                                   "into: drop --nccl-prefix so that it is built under the environment")
            for old in glob.glob(os.path.join(wheel_dir, f"{NCCL_WHEEL_NAME}-*.whl")):
                os.remove(old)
            nccl_wheel = build_nccl_wheel(wheel_dir, self.plan.nccl_root, relative, self.plan.nccl_version,
                                          self.plan.arch)
            nccl.update(root=self.plan.nccl_root, prefix_relative=relative)
        elif self.plan.nccl_kind == "registry":
            nccl["package"] = self.plan.nccl_package
        installed = self.system.distribution("deep_ep") or {}
        probe = self._probe(import_deep_ep=False)
        manifest = {"arch": self.plan.arch, "line": self.plan.line.name, "deep_ep_version": self.plan.version,
                    "deep_ep_installed_version": installed.get("version"),
                    "deep_ep_fingerprint": self._deep_ep_fingerprint(),
                    "deep_ep_wheel": os.path.basename(deep_ep_wheel),
                    "nccl_wheel": os.path.basename(nccl_wheel) if nccl_wheel else None, "nccl": nccl,
                    "python": probe.get("python"), "torch": probe.get("torch"), "cuda": probe.get("cuda"),
                    "built": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        with open(os.path.join(wheel_dir, WHEEL_MANIFEST), "w", encoding="utf-8") as out:
            json.dump(manifest, out, indent=2, sort_keys=True)
        wheels = [w for w in (nccl_wheel, deep_ep_wheel) if w]
        sizes = ", ".join(f"{os.path.basename(w)} ({os.path.getsize(w) / 2**20:.1f} MiB)" for w in wheels)
        return f"{sizes} and {WHEEL_MANIFEST} in {wheel_dir}: install elsewhere with --from-wheels {wheel_dir}"

    def _step_check_wheels(self) -> str:
        """Wheels mode: the manifest against this machine (GPU architecture, Python, torch, CUDA, NCCL, paths)."""
        folder = os.path.abspath(self.options.from_wheels or "")
        manifest = self._manifest = self._read_manifest(folder)
        lines = {line.name: line for line in LINES}
        if manifest.get("line") not in lines:
            raise InstallError("wheels", f"the manifest names DeepEP line {manifest.get('line')!r}; this installer "
                               f"knows {sorted(lines)}: upgrade megatron-deepepv2 or rebuild the wheels")
        self.plan.line = lines[manifest["line"]]
        self.plan.version = manifest.get("deep_ep_version", "unknown")
        arch = self.options.arch or self.system.gpu_arch()
        wanted = manifest.get("arch")
        if arch != wanted:
            raise InstallError("wheels", f"the wheels were built for sm_{wanted}; this machine's GPU is "
                               f"{'sm_' + arch if arch else 'not visible'}: build on (or for) this GPU with "
                               "--deepep-src")
        self.plan.arch = arch
        probe = self._probe(import_deep_ep=False)
        for key, what in (("python", "Python"), ("torch", "PyTorch"), ("cuda", "PyTorch's CUDA")):
            if manifest.get(key) and probe.get(key) and manifest[key] != probe[key]:
                raise InstallError("wheels", f"the wheels were built with {what} {manifest[key]}; this environment "
                                   f"has {probe[key]} (deep_ep._C is built against PyTorch's C++ ABI and CUDA): "
                                   "install them where the build ran's versions are, or build here with --deepep-src")
        where = self._adopt_wheels_nccl(manifest, probe)
        return (f"DeepEP {self.plan.version} ({self.plan.line.name} line) for sm_{arch}, "
                f"Python {manifest.get('python')}, torch {manifest.get('torch')}, CUDA {manifest.get('cuda')}, "
                f"{where}: this machine matches")

    @staticmethod
    def _read_manifest(folder: str) -> dict[str, Any]:
        """Wheels mode: the manifest a ``--wheel-dir`` build wrote to ``folder``, with every wheel it names there.

        Args:
            folder: The ``--from-wheels`` folder.

        Returns:
            The manifest.

        Raises:
            InstallError: If the manifest is missing or unreadable, or a wheel it names is not in ``folder``.
        """
        try:
            with open(os.path.join(folder, WHEEL_MANIFEST), encoding="utf-8") as manifest_file:
                manifest = json.load(manifest_file)
        except (OSError, ValueError) as error:
            raise InstallError("wheels", f"{folder} has no readable {WHEEL_MANIFEST} ({error}): point --from-wheels "
                               "at the folder an installer run with --wheel-dir wrote") from error
        missing = [name for name in (manifest.get("deep_ep_wheel"), manifest.get("nccl_wheel"))
                   if name and not os.path.isfile(os.path.join(folder, name))]
        if missing or not manifest.get("deep_ep_wheel"):
            raise InstallError("wheels", f"{folder} lacks the wheel(s) its manifest names: "
                               f"{', '.join(missing) or 'deep_ep'}")
        return manifest

    def _adopt_wheels_nccl(self, manifest: dict[str, Any], probe: dict[str, Any]) -> str:
        """Wheels mode: plans the NCCL the wheels' deep_ep was built against, where it will be on this machine.

        Args:
            manifest: The wheels' manifest; its ``nccl`` entry names the NCCL's kind, version, and the path or
                package it came from.
            probe: What a fresh Python of this environment reports (``System.probe_python``).

        Returns:
            Where that NCCL comes from, for the step's summary.

        Raises:
            InstallError: If a source-built NCCL's wheel would install elsewhere than where deep_ep looks for it, or
                PyTorch here loads another NCCL than the one the build ran against.
        """
        nccl = manifest.get("nccl") or {}
        version = tuple(nccl.get("version") or ())
        if nccl.get("kind") == "source":
            root = os.path.join(self.system.prefix, nccl["prefix_relative"], "nvidia", "nccl")
            if os.path.normpath(root) != os.path.normpath(nccl["root"]):
                raise InstallError("wheels", f"deep_ep was built for the NCCL at {nccl['root']}; its wheel would go "
                                   f"to {root} in this environment ({self.system.prefix}), and deep_ep looks for NCCL "
                                   "where it was built: install into an environment at the same path as the build's, "
                                   "or build here with --deepep-src")
            self._set_nccl("source", root, version)
            return f"NCCL {version_text(version)} from {manifest['nccl_wheel']}"
        loaded = tuple(probe.get("nccl") or ())
        if loaded != version:
            hint = (f"pip install '{nccl['package']}=={version_text(version)}'" if nccl.get("package")
                    else f"a PyTorch that loads NCCL {version_text(version)}")
            raise InstallError("wheels", f"deep_ep was built against NCCL {version_text(version)}, which PyTorch "
                               f"loaded there; here it loads {version_text(loaded)}: install {hint} first")
        mapped = probe.get("mapped") or [""]
        self._set_nccl(nccl.get("kind", "torch"), os.path.dirname(os.path.dirname(os.path.realpath(mapped[0]))),
                       version)
        return f"PyTorch's NCCL {version_text(version)}"

    def _step_install(self) -> str:
        """Wheels mode: ``pip install`` of the wheels, then PyTorch must load the wheel's NCCL."""
        folder = os.path.abspath(self.options.from_wheels or "")
        manifest = self._manifest
        installed, _ = self._installed_extension()
        if installed and installed["version"] != manifest.get("deep_ep_installed_version") \
                and not self.options.replace_deep_ep:
            raise InstallError("install", f"a deep_ep {installed['version']} is already installed here (DeepEP v1, "
                               "HybridEP and DeepEP v2 all install the module deep_ep): pass --replace-deep-ep to "
                               "replace it, or use another environment")
        wheels = [os.path.join(folder, manifest[key]) for key in ("nccl_wheel", "deep_ep_wheel") if manifest.get(key)]
        started = time.monotonic()
        self._pip("install", "--no-index", "--no-deps", "--force-reinstall", *wheels, log_name="wheels-install.log")
        if self.options.dry_run:
            return f"would install {', '.join(map(os.path.basename, wheels))}"
        installed, _ = self._checked_extension("install", "wheels-install.log")
        if self.plan.nccl_kind == "source":
            self._check_torch_loads(os.path.join(self.plan.nccl_root, "lib", f"libnccl.so.{self.plan.nccl_version[0]}"),
                                    "install", f"the {NCCL_WHEEL_NAME} wheel's .pth")
        if manifest.get("deep_ep_fingerprint"):  # a later build from the same tree here has nothing to do
            self._save_state("deep_ep", {**manifest["deep_ep_fingerprint"], "installed_version": installed["version"]})
        return f"installed {', '.join(map(os.path.basename, wheels))} in {time.monotonic() - started:.0f} s"

    def _check_torch_loads(self, library: str, step: str, cause: str) -> None:
        """Raises unless a fresh interpreter's PyTorch maps exactly ``library`` as its NCCL."""
        probe = self._probe(import_deep_ep=False)
        expected = os.path.realpath(library)
        mapped = [os.path.realpath(p) for p in probe.get("mapped") or []]
        if mapped != [expected]:
            raise InstallError(step, f"with {cause} in place PyTorch maps {mapped or 'no libnccl'}, not only "
                               f"{expected}. Something loads another NCCL first (LD_PRELOAD, LD_LIBRARY_PATH, an "
                               "earlier sys.path entry with nvidia/nccl/lib): remove it and rerun")

    def _checked_extension(self, step: str, log_name: str) -> tuple[dict[str, Any], str]:
        """The deep_ep a ``pip install`` just installed and its extension, checked (else the step fails)."""
        installed, extension = self._installed_extension()
        if installed is None or extension is None:
            raise InstallError(step, f"pip finished but no deep_ep/_C*.so is installed; see {log_name}")
        self._check_extension(extension)
        return installed, extension

    def _check_extension(self, extension: str) -> None:
        needed = self.system.needed_libraries(extension)
        if not links_libstdcxx_dynamically(needed):
            raise InstallError("deep_ep", f"{extension} links libstdc++ statically (NEEDED: {', '.join(needed)}) and "
                               "would crash inside std::regex at the first dispatch: rebuild with --cxx pointing at a "
                               "compiler that links it dynamically (e.g. /usr/bin/g++) and --replace-deep-ep")

    def _step_verify(self) -> str:
        if self.options.dry_run:
            return "skipped (dry run)"
        probe = self._probe(import_deep_ep=True)
        if "error" in probe:
            raise InstallError("verify", f"a fresh Python cannot import deep_ep: {probe['error']}")
        buffer = self.plan.line.buffer_class
        if buffer not in probe.get("buffers", []):
            raise InstallError("verify", f"deep_ep {probe.get('deep_ep')} imports but has no {buffer} "
                               f"(exports {probe.get('buffers')}): another deep_ep shadows it on sys.path")
        mapped = probe.get("mapped") or []
        if len(mapped) != 1:
            raise InstallError("verify", f"{len(mapped)} NCCL libraries are mapped ({', '.join(mapped)}); exactly "
                               "one may be (DeepEP asserts it): drop LD_PRELOAD / LD_LIBRARY_PATH entries of other "
                               "NCCLs")
        gin = decide_gin(1, self.system.env, self.system.rdma_devices)  # one node: the installer's
        return (f"deep_ep {probe.get('deep_ep')} imports with {buffer}; "
                f"NCCL {version_text(tuple(probe.get('nccl') or ()))} at {mapped[0]}; GIN: {gin.reason}")

    def _step_doctor(self) -> Any:
        if self.options.dry_run or not self.options.run_doctor:
            return "skipped"
        doctor = [self.system.python, "-m", "megatron_deepepv2.cli.doctor"]
        return self.system.run(doctor, self.system.env, None, None)  # in this directory, its output to ours


def build_parser() -> argparse.ArgumentParser:
    """The command line (one option per :class:`InstallOptions` field)."""
    defaults = InstallOptions()
    parser = argparse.ArgumentParser(prog="python -m megatron_deepepv2.cli.install_deepep",
                                     description="Build and install DeepEP v2 for megatron-deepepv2, ending with the "
                                                 "doctor.")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--deepep-src", help="DeepEP source tree (2.1 or V2.5), or a git URL to clone")
    source.add_argument("--from-wheels", metavar="DIR",
                        help="install the wheels a --wheel-dir build wrote to DIR instead of building (same GPU "
                             "architecture, Python, PyTorch and CUDA)")
    parser.add_argument("--wheel-dir", metavar="DIR",
                        help="also write the build's deep_ep (and source-built NCCL) as wheels to DIR, with a "
                             "manifest, for --from-wheels on other machines (DIR's earlier wheels of both are "
                             "replaced)")
    nccl = parser.add_mutually_exclusive_group()
    nccl.add_argument("--nccl-src", help="NCCL source tree to build (for this GPU only) when no suitable NCCL is there")
    nccl.add_argument("--nccl-from-registry", action="store_true",
                      help="upgrade nvidia-nccl-cuXX from the package registry when no suitable NCCL is there")
    parser.add_argument("--nvcc-from-registry", action="store_true",
                        help="install nvcc >= 13.1 from the package registry when DeepEP V2.5 needs it")
    parser.add_argument("--work-dir", default=defaults.work_dir, help="build folder and state (default: %(default)s)")
    parser.add_argument("--nccl-prefix", help="where a source-built NCCL goes (default: under sys.prefix/share)")
    parser.add_argument("--cxx", help="C++ compiler (default: the first that links libstdc++ dynamically)")
    parser.add_argument("--arch", help="GPU architecture, e.g. 90 (default: the visible GPU's)")
    parser.add_argument("--jobs", type=int, default=defaults.jobs, help="parallel build jobs (default: %(default)s)")
    parser.add_argument("--replace-deep-ep", action="store_true",
                        help="replace a deep_ep not installed by this command")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and commands, change nothing")
    parser.add_argument("--no-doctor", dest="run_doctor", action="store_false", help="do not run the doctor at the end")
    return parser


def main(argv: Optional[list[str]] = None, system: Optional[System] = None) -> int:
    """Command-line entry point; returns the exit status (2 when a step failed, else the doctor's)."""
    args = build_parser().parse_args(argv)
    options = InstallOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(InstallOptions)})
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("[install-deepep] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        return Installer(options, system).run()
    except InstallError as error:
        logger.error("%s", error)
        return 2
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


if __name__ == "__main__":
    sys.exit(main())
