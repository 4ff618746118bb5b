"""The DeepEP installer's decisions, with the build steps injected (a fake machine that records every command).

The fake machine behaves like the GPU machine: PyTorch loads NCCL 2.28.9 from its pip package until a
``megatron_deepepv2_nccl.pth`` puts a newer one first; ``make`` writes an NCCL build; ``pip install`` of the
DeepEP tree installs a ``deep_ep`` whose extension links libstdc++ the way the chosen compiler does. The compiler
probe also runs for real with this machine's g++ (and a wrapper that links libstdc++ statically).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import types
import zipfile
from pathlib import Path
from typing import Any, Optional

import pytest

from megatron_deepepv2.cli import install_deepep
from megatron_deepepv2.cli.doctor import elf_needed_libraries
from megatron_deepepv2.cli.install_deepep import PTH_NAME, InstallError, Installer, InstallOptions, System, main

TORCH_NCCL = "/site/nvidia/nccl/lib/libnccl.so.2"


def make_deepep_tree(root: str, line: str = "2.1", with_fmt: bool = True) -> str:
    tree = os.path.join(root, "DeepEP")
    os.makedirs(os.path.join(tree, "deep_ep", "buffers"))
    with open(os.path.join(tree, "setup.py"), "w") as f:
        f.write("# setup\n")
    with open(os.path.join(tree, "deep_ep", "__init__.py"), "w") as f:
        f.write("__version__ = '2.5.0'\n" if line == "V2.5" else "__version__ = '2.1.0'\n")
    open(os.path.join(tree, "deep_ep", "buffers", "ep.py" if line == "V2.5" else "elastic.py"), "w").close()
    with open(os.path.join(tree, ".gitmodules"), "w") as f:
        f.write('[submodule "third-party/fmt"]\n\tpath = third-party/fmt\n\turl = https://github.com/fmtlib/fmt.git\n')
    os.makedirs(os.path.join(tree, "third-party", "fmt"))
    if with_fmt:
        open(os.path.join(tree, "third-party", "fmt", "CMakeLists.txt"), "w").close()
    return tree


def make_nccl_tree(root: str, version: tuple[int, int, int] = (2, 30, 7)) -> str:
    tree = os.path.join(root, "nccl")
    os.makedirs(os.path.join(tree, "makefiles"), exist_ok=True)
    with open(os.path.join(tree, "makefiles", "version.mk"), "w") as f:
        f.write("##### version\nNCCL_MAJOR   := {}\nNCCL_MINOR   := {}\nNCCL_PATCH   := {}\nNCCL_SUFFIX  :=\n".format(*version))
    return tree


class FakeMachine:
    """A GPU machine in miniature: records commands, answers probes from what the commands left behind."""

    def __init__(self, root: str, compilers: Optional[dict[str, bool]] = None, nvcc: tuple[int, int] = (13, 0),
                 torch_nccl: tuple[int, int, int] = (2, 28, 9), build_fails: bool = False,
                 prefix: Optional[str] = None, arch: str = "90", torch_version: str = "2.11.0+cu130") -> None:
        self.root = root
        self.prefix = prefix or os.path.join(root, "venv")
        self.site = os.path.join(self.prefix, "lib", "python3.12", "site-packages")
        os.makedirs(self.site)
        self.arch = arch
        self.torch_version = torch_version
        self.compilers = compilers if compilers is not None else {"/usr/bin/g++": True}
        self.nvcc = nvcc
        self.torch_nccl = torch_nccl
        self.build_fails = build_fails
        self.commands: list[list[str]] = []
        self.envs: list[dict[str, str]] = []
        self.deep_ep: Optional[dict[str, Any]] = None
        self.extension_dynamic = True
        self.registry_nccl: Optional[tuple[int, int, int]] = None
        self.wheel_builds = 0
        self.installed_wheels: list[str] = []
        self.compiled_with = ""
        self.compiled_buffers: list[str] = []

    def system(self) -> System:
        return System(env={"PATH": "/usr/bin", "HOME": self.root}, python="/venv/bin/python", run=self.run,
                      probe_python=self.probe_python, gpu_arch=lambda: self.arch, prefix=self.prefix,
                      find_nvcc=lambda env: "/usr/local/cuda/bin/nvcc", nvcc_version=lambda path: self.nvcc,
                      needed_libraries=self.needed_libraries, distribution=self.distribution,
                      has_distribution_like=lambda fragment: fragment == "nvidia-nvshmem",
                      which=self.which,
                      site_packages=lambda: self.site)

    def which(self, name: str) -> Optional[str]:
        path = name if name.startswith("/") else f"/usr/bin/{name}"
        return path if path in self.compilers else None

    # -- commands
    def run(self, cmd: list[str], env: dict[str, str], cwd: Optional[str], log: Optional[str]) -> int:
        self.commands.append(list(cmd))
        self.envs.append(dict(env))
        if log:
            with open(log, "w") as f:
                f.write("line 1\nerror: something broke\n" if self.build_fails else "ok\n")
        if cmd[0] in self.compilers:  # the compiler probe
            open(cmd[cmd.index("-o") + 1], "wb").close()
            return 0
        if cmd[0] == "make":
            if self.build_fails:
                return 2
            build = next(a.split("=", 1)[1] for a in cmd if a.startswith("BUILDDIR="))
            version = install_deepep.nccl_source_version(cmd[2])
            os.makedirs(os.path.join(build, "lib"), exist_ok=True)
            os.makedirs(os.path.join(build, "include"), exist_ok=True)
            with open(os.path.join(build, "lib", "libnccl.so.{}.{}.{}".format(*version)), "wb") as f:
                f.write("\x7fELF fake nccl {}.{}.{}".format(*version).encode())
            open(os.path.join(build, "include", "nccl.h"), "w").close()
            os.makedirs(os.path.join(build, "include", "nccl_device", "impl"), exist_ok=True)
            open(os.path.join(build, "include", "nccl_device", "impl", "barrier__funcs.h"), "w").close()
            return 0
        if cmd[1:4] == ["-m", "pip", "wheel"]:
            if self.build_fails:
                return 1
            self.wheel_builds += 1
            self.compiled_with = env["CXX"]
            self.compiled_buffers = self._buffers_of(cmd[-1])
            self._write_deep_ep_wheel(cmd[cmd.index("-w") + 1], env["EP_NCCL_ROOT_DIR"])
            return 0
        if cmd[1:4] == ["-m", "pip", "install"] and all(a.endswith(".whl") for a in cmd[4:] if not a.startswith("-")):
            for wheel in (a for a in cmd[4:] if a.endswith(".whl")):
                self._install_wheel(wheel)
            return 0
        if cmd[1:4] == ["-m", "pip", "install"]:
            if "nvidia-nccl-cu13>=2.30.4" in cmd or "nvidia-nccl-cu13>=2.32.3" in cmd:
                self.registry_nccl = (2, 32, 3)
                return 0
            if any(a.startswith("nvidia-cuda-nvcc") for a in cmd):
                return 0
            if self.build_fails:
                return 1
            extension = os.path.join(self.site, "deep_ep", "_C.cpython-312-x86_64-linux-gnu.so")
            os.makedirs(os.path.dirname(extension), exist_ok=True)
            open(extension, "wb").close()
            self.extension_dynamic = self.compilers.get(env["CXX"], False)
            self.deep_ep = {"version": "2.1.0+local", "files": [extension], "buffers": self._buffers_of(cmd[-1])}
            return 0
        return 0

    @staticmethod
    def _buffers_of(tree: str) -> list[str]:
        return ["EPBuffer"] if os.path.isfile(os.path.join(tree, "deep_ep", "buffers", "ep.py")) else ["ElasticBuffer", "Buffer"]

    def _write_deep_ep_wheel(self, folder: str, nccl_root: str) -> None:
        """What `pip wheel` of a DeepEP tree leaves: the package, its extension and the NCCL root it was built for."""
        with zipfile.ZipFile(os.path.join(folder, "deep_ep-2.1.0+local-cp312-cp312-linux_x86_64.whl"), "w") as wheel:
            wheel.writestr("deep_ep/_C.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
            wheel.writestr("deep_ep/envs.py", f"persistent_envs = {{'EP_NCCL_ROOT_DIR': {nccl_root!r}}}\n")
            wheel.writestr("deep_ep/buffers.json", json.dumps(self.compiled_buffers))
            wheel.writestr("deep_ep/cxx.txt", self.compiled_with)
            wheel.writestr("deep_ep-2.1.0+local.dist-info/METADATA", "Name: deep_ep\nVersion: 2.1.0+local\n")

    def _install_wheel(self, wheel_path: str) -> None:
        """pip's layout: ``*.data/data/`` under the prefix, ``*.dist-info`` kept aside, the rest in site-packages."""
        self.installed_wheels.append(os.path.basename(wheel_path))
        with zipfile.ZipFile(wheel_path) as wheel:
            for name in wheel.namelist():
                parts = name.split("/")
                if parts[0].endswith(".dist-info"):
                    continue
                if parts[0].endswith(".data"):
                    assert parts[1] == "data", name
                    target = os.path.join(self.prefix, *parts[2:])
                else:
                    target = os.path.join(self.site, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as out:
                    out.write(wheel.read(name))
            if "deep_ep/buffers.json" in wheel.namelist():
                self.extension_dynamic = self.compilers.get(wheel.read("deep_ep/cxx.txt").decode(), False)
                self.deep_ep = {"version": "2.1.0+local",
                                "files": [os.path.join(self.site, "deep_ep", "_C.cpython-312-x86_64-linux-gnu.so")],
                                "buffers": json.loads(wheel.read("deep_ep/buffers.json"))}

    # -- probes
    def needed_libraries(self, path: str) -> list[str]:
        if path.endswith("probe.so"):
            cxx = next(c for c in reversed(self.commands) if c[0] in self.compilers)[0]
            dynamic = self.compilers[cxx]
        else:
            dynamic = self.extension_dynamic
        return ["libnccl.so.2", "libc.so.6"] + (["libstdc++.so.6"] if dynamic else [])

    def distribution(self, name: str) -> Optional[dict[str, Any]]:
        if name == "deep_ep":
            return self.deep_ep
        if name == "nvidia-nccl-cu13":
            return {"version": "2.28.9", "files": []}
        return None

    def probe_python(self, python: str, import_deep_ep: bool, env: dict[str, str]) -> dict[str, Any]:
        pth = os.path.join(self.site, PTH_NAME)
        if os.path.isfile(pth):
            (line,) = [line for line in open(pth) if line.startswith("import ")]
            path = self._pth_path(line)  # the .pth line itself decides
            lib = os.path.join(path[0], "nvidia", "nccl", "lib")
            library = os.path.join(lib, "libnccl.so.2")
            version = open(library, "rb").read().decode().rsplit(" ", 1)[1]
            out = {"nccl": [int(x) for x in version.split(".")], "mapped": [library]}
        elif self.registry_nccl:
            out = {"nccl": list(self.registry_nccl), "mapped": [TORCH_NCCL]}
        else:
            out = {"nccl": list(self.torch_nccl), "mapped": [TORCH_NCCL]}
        out.update(cuda="13.0", torch=self.torch_version, python="3.12")
        if import_deep_ep:
            if self.deep_ep is None:
                out["error"] = "ModuleNotFoundError: No module named 'deep_ep'"
            else:
                out.update(deep_ep="2.1.0", buffers=self.deep_ep.get("buffers", []))
        return out

    def _pth_path(self, line: str) -> list[str]:
        """``sys.path`` after the ``.pth`` line ran in an interpreter of this machine's environment."""
        fake_sys = types.SimpleNamespace(prefix=self.prefix, path=["/elsewhere"])
        code = line.replace("import os, sys;", "import os;").replace("import sys;", "").strip()
        exec(code, {"__builtins__": __builtins__, "sys": fake_sys})  # noqa: S102 -- the file under test
        return fake_sys.path

    def ran(self, program: str) -> list[list[str]]:
        return [c for c in self.commands if c[0] == program or (program == "pip" and c[1:3] == ["-m", "pip"])]


def options(tmp_path, **changes) -> InstallOptions:
    fields = dict(work_dir=str(tmp_path / "work"), nccl_prefix=str(tmp_path / "prefix"), jobs=16)
    fields.update(changes)
    if "deepep_src" not in fields:
        default = os.path.join(str(tmp_path), "default", "DeepEP")
        fields["deepep_src"] = default if os.path.isdir(default) else make_deepep_tree(os.path.dirname(default))
    return InstallOptions(**fields)


def test_source_built_nccl_then_deepep_then_doctor_and_a_rerun_does_nothing(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)))
    assert Installer(opts, machine.system()).run() == 0
    make = machine.ran("make")
    assert len(make) == 1 and "NVCC_GENCODE=-gencode=arch=compute_90,code=sm_90" in make[0] and "-j16" in make[0]
    root = tmp_path / "prefix" / "nvidia" / "nccl"
    assert (root / "lib" / "libnccl.so.2.30.7").is_file() and (root / "include" / "nccl.h").is_file()
    assert (root / "include" / "nccl_device" / "impl" / "barrier__funcs.h").is_file()
    assert os.readlink(root / "lib" / "libnccl.so.2") == "libnccl.so.2.30.7"
    pth = open(os.path.join(machine.site, PTH_NAME)).read()
    assert f"sys.path.insert(0, '{tmp_path / 'prefix'}')" in pth and "Delete this file to undo" in pth
    (pip_deepep,) = [c for c in machine.ran("pip") if c[-1] == opts.deepep_src]
    assert "--no-build-isolation" in pip_deepep
    build_env = machine.envs[machine.commands.index(pip_deepep)]
    assert build_env["CXX"] == "/usr/bin/g++" and build_env["EP_NCCL_ROOT_DIR"] == str(root)
    assert build_env["TORCH_CUDA_ARCH_LIST"] == "9.0" and build_env["LDSHARED"] == "/usr/bin/g++ -shared"
    assert machine.commands[-1] == ["/venv/bin/python", "-m", "megatron_deepepv2.cli.doctor"]

    before = len(machine.commands)
    assert Installer(opts, machine.system()).run() == 0
    rerun = machine.commands[before:]
    assert not [c for c in rerun if c[0] == "make" or c[1:3] == ["-m", "pip"]], rerun


def test_a_removed_pth_is_rewritten_without_rebuilding_nccl(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)))
    Installer(opts, machine.system()).run()
    pth = os.path.join(machine.site, PTH_NAME)
    os.remove(pth)
    before = len(machine.commands)
    Installer(opts, machine.system()).run()
    assert not [c for c in machine.commands[before:] if c[0] == "make"] and os.path.isfile(pth)


def test_a_pth_that_does_not_win_fails_the_torch_nccl_step(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    system = machine.system()
    system.probe_python = lambda python, import_deep_ep, env: {"nccl": [2, 28, 9], "mapped": [TORCH_NCCL], "cuda": "13.0"}
    with pytest.raises(InstallError, match=r"torch-nccl.*PyTorch maps .*libnccl.so.2.*not only .*libnccl.so.2.30.7"):
        Installer(options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path))), system).run()


def test_a_changed_tree_rebuilds_deepep_but_not_nccl(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)))
    Installer(opts, machine.system()).run()
    with open(os.path.join(opts.deepep_src, "deep_ep", "buffers", "elastic.py"), "w") as f:
        f.write("# patched\n")
    before = len(machine.commands)
    Installer(opts, machine.system()).run()
    rerun = machine.commands[before:]
    assert not [c for c in rerun if c[0] == "make"]
    assert [c for c in rerun if c[-1] == opts.deepep_src]


def test_torch_nccl_new_enough_is_used_as_is(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path), torch_nccl=(2, 30, 7))
    nvidia = tmp_path / "site" / "nvidia" / "nccl"
    (nvidia / "lib").mkdir(parents=True)
    (nvidia / "include").mkdir()
    (nvidia / "include" / "nccl.h").touch()
    (nvidia / "lib" / "libnccl.so.2").touch()
    global TORCH_NCCL
    saved, TORCH_NCCL = TORCH_NCCL, str(nvidia / "lib" / "libnccl.so.2")
    try:
        Installer(options(tmp_path), machine.system()).run()
    finally:
        TORCH_NCCL = saved
    assert not machine.ran("make") and not os.path.exists(os.path.join(machine.site, PTH_NAME))
    (pip_deepep,) = [c for c in machine.ran("pip")]
    assert machine.envs[machine.commands.index(pip_deepep)]["EP_NCCL_ROOT_DIR"] == str(nvidia)


def test_registry_nccl_is_a_pip_upgrade_with_the_lines_minimum(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    Installer(options(tmp_path, nccl_from_registry=True), machine.system()).run()
    assert ["/venv/bin/python", "-m", "pip", "install", "--upgrade", "nvidia-nccl-cu13>=2.30.4"] in machine.commands
    assert not machine.ran("make") and not os.path.exists(os.path.join(machine.site, PTH_NAME))


def test_v2_5_tree_needs_nvcc_13_1_and_nccl_2_32_3(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    tree = make_deepep_tree(str(tmp_path), line="V2.5")
    with pytest.raises(InstallError, match=r"toolchain.*needs nvcc >= 13.1; found nvcc 13.0.*--nvcc-from-registry"):
        Installer(options(tmp_path, deepep_src=tree, nccl_from_registry=True), machine.system()).run()
    machine.nvcc = (13, 1)
    with pytest.raises(InstallError, match=r"source tree at .* is 2.30.7; DeepEP V2.5 needs >= 2.32.3"):
        Installer(options(tmp_path, deepep_src=tree, nccl_src=make_nccl_tree(str(tmp_path))), machine.system()).run()
    Installer(options(tmp_path, deepep_src=tree, nccl_from_registry=True), machine.system()).run()
    assert any(c[-1] == "nvidia-nccl-cu13>=2.32.3" for c in machine.ran("pip"))


def test_v2_5_nvcc_from_the_registry(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    nvcc = os.path.join(machine.site, "nvidia", "cu13", "bin", "nvcc")
    os.makedirs(os.path.dirname(nvcc))
    open(nvcc, "w").close()
    system = machine.system()
    system.nvcc_version = lambda path: (13, 1) if path == nvcc else (13, 0)
    tree = make_deepep_tree(str(tmp_path), line="V2.5")
    Installer(options(tmp_path, deepep_src=tree, nccl_from_registry=True, nvcc_from_registry=True), system).run()
    assert any(c[4:] == ["nvidia-cuda-nvcc>=13.1", "nvidia-nvvm>=13.1", "nvidia-cuda-crt>=13.1"] for c in machine.commands)
    (pip_deepep,) = [c for c in machine.ran("pip") if c[-1] == tree]
    assert machine.envs[machine.commands.index(pip_deepep)]["CUDA_HOME"] == os.path.join(machine.site, "nvidia", "cu13")


def test_old_nccl_without_a_way_to_get_a_new_one_says_both_options(tmp_path) -> None:
    with pytest.raises(InstallError, match=r"needs NCCL >= 2.30.4; PyTorch loads NCCL 2.28.9 .*--nccl-src PATH.*"
                                           r"--nccl-from-registry"):
        Installer(options(tmp_path), FakeMachine(str(tmp_path)).system()).run()


def test_static_compilers_are_skipped_and_named_when_none_is_left(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path), compilers={"/opt/gcc/bin/g++": False, "/usr/bin/g++": True})
    system = machine.system()
    system.env["CXX"] = "/opt/gcc/bin/g++"
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)))
    Installer(opts, system).run()
    (pip_deepep,) = [c for c in machine.ran("pip") if c[-1] == opts.deepep_src]
    assert machine.envs[machine.commands.index(pip_deepep)]["CXX"] == "/usr/bin/g++"
    machine.compilers["/usr/bin/g++"] = False
    before = len(machine.commands)
    with pytest.raises(InstallError, match=r"compiler.*/opt/gcc/bin/g\+\+: links libstdc\+\+ statically.*"
                                           r"/usr/bin/g\+\+: links libstdc\+\+ statically.*; c\+\+: not found"):
        Installer(options(tmp_path, nccl_src=opts.nccl_src, work_dir=str(tmp_path / "w2")), system).run()
    # "g++" on PATH is /usr/bin/g++ again: probed once
    assert [c[0] for c in machine.commands[before:] if c[0] in machine.compilers] == ["/opt/gcc/bin/g++", "/usr/bin/g++"]


def test_a_static_extension_fails_the_deep_ep_step(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    system = machine.system()
    original = machine.run

    def run(cmd, env, cwd, log):  # the build ignores CXX and links libstdc++ statically
        code = original(cmd, env, cwd, log)
        if cmd[-1].endswith("DeepEP"):
            machine.extension_dynamic = False
        return code

    system.run = run
    with pytest.raises(InstallError, match=r"deep_ep.*links libstdc\+\+ statically.*std::regex.*--cxx"):
        Installer(options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path))), system).run()


def test_a_foreign_deep_ep_is_replaced_only_when_asked(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    machine.deep_ep = {"version": "1.2.1+hybrid", "files": []}
    nccl = make_nccl_tree(str(tmp_path))
    with pytest.raises(InstallError, match=r"deep_ep 1.2.1\+hybrid that this installer did not install.*--replace-deep-ep"):
        Installer(options(tmp_path, nccl_src=nccl), machine.system()).run()
    assert not [c for c in machine.ran("pip")]
    Installer(options(tmp_path, nccl_src=nccl, replace_deep_ep=True), machine.system()).run()
    assert machine.deep_ep["version"] == "2.1.0+local"


def test_a_failing_build_names_the_step_and_the_log(tmp_path, capsys) -> None:
    machine = FakeMachine(str(tmp_path), build_fails=True)
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)))
    argv = ["--deepep-src", opts.deepep_src, "--nccl-src", opts.nccl_src, "--work-dir", opts.work_dir,
            "--nccl-prefix", opts.nccl_prefix]
    assert main(argv, machine.system()) == 2
    out = capsys.readouterr().out
    assert "step 'nccl' failed" in out and "exited with status 2" in out and "nccl-build.log" in out
    assert "error: something broke" in out and "[3/8] nccl ..." in out


def test_tree_problems_are_named(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    tree = make_deepep_tree(str(tmp_path / "a"), with_fmt=False)
    with pytest.raises(InstallError, match=r"lacks its submodule\(s\) third-party/fmt.*submodule update --init"):
        Installer(options(tmp_path, deepep_src=tree), machine.system()).run()
    v1 = make_deepep_tree(str(tmp_path / "b"))
    os.remove(os.path.join(v1, "deep_ep", "buffers", "elastic.py"))
    with pytest.raises(InstallError, match=r"not a DeepEP v2 source tree"):
        Installer(options(tmp_path, deepep_src=v1), machine.system()).run()
    with pytest.raises(InstallError, match=r"is not an NCCL source tree"):
        Installer(options(tmp_path, nccl_src=str(tmp_path)), machine.system()).run()


def test_two_mapped_nccls_fail_the_verification(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    system = machine.system()
    original = machine.probe_python

    def probe(python, import_deep_ep, env):
        out = original(python, import_deep_ep, env)
        if import_deep_ep:
            out["mapped"] = out["mapped"] + ["/preloaded/libnccl.so.2"]
        return out

    system.probe_python = probe
    with pytest.raises(InstallError, match=r"verify.*2 NCCL libraries are mapped"):
        Installer(options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path))), system).run()


def test_dry_run_changes_nothing(tmp_path, capsys) -> None:
    machine = FakeMachine(str(tmp_path))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)), dry_run=True)
    assert Installer(opts, machine.system()).run() == 0
    assert not [c for c in machine.commands if c[0] == "make" or c[1:3] == ["-m", "pip"]]
    assert not os.path.exists(os.path.join(machine.site, PTH_NAME)) and not os.path.exists(opts.nccl_prefix)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a C++ compiler (g++) on this machine")
def test_compiler_probe_on_this_machine_tells_static_from_dynamic(tmp_path) -> None:
    wrapper = tmp_path / "static-g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("g++")} -static-libstdc++ "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    installer = Installer(options(tmp_path), System())
    assert installer._probe_compiler(shutil.which("g++")) is None
    verdict = installer._probe_compiler(str(wrapper))
    assert verdict is not None and "statically" in verdict
    assert "cannot build" in installer._probe_compiler(str(tmp_path / "missing-g++"))
    # the verdicts come from the ELF reader on real objects
    assert installer.system.needed_libraries is elf_needed_libraries


def test_nccl_source_version_reads_the_makefile(tmp_path) -> None:
    assert install_deepep.nccl_source_version(make_nccl_tree(str(tmp_path), (2, 32, 3))) == (2, 32, 3)


# ---------------------------------------------------------------------------------------------- wheels


def build_with_wheels(tmp_path, wheel_dir: str) -> tuple[FakeMachine, InstallOptions]:
    """A source build on one fake machine with --wheel-dir, its NCCL under the environment (the default prefix)."""
    machine = FakeMachine(str(tmp_path / "build"), prefix=str(tmp_path / "env"))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)), nccl_prefix=None, wheel_dir=wheel_dir,
                   work_dir=str(tmp_path / "build-work"))
    assert Installer(opts, machine.system()).run() == 0
    return machine, opts


def another_machine(tmp_path, name: str, **changes) -> FakeMachine:
    """A second machine whose environment sits at the same path as the build's (the same image)."""
    shutil.rmtree(tmp_path / "env", ignore_errors=True)  # nothing of the build machine is there
    return FakeMachine(str(tmp_path / name), prefix=str(tmp_path / "env"), **changes)


def test_wheel_dir_builds_deepep_once_and_packs_the_nccl_it_built(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    machine, opts = build_with_wheels(tmp_path, str(wheels))
    assert machine.wheel_builds == 1
    assert not [c for c in machine.ran("pip") if c[-1] == opts.deepep_src and c[3] == "install"], \
        "DeepEP is built once, as a wheel, and installed from it"
    manifest = json.loads((wheels / install_deepep.WHEEL_MANIFEST).read_text())
    assert manifest["arch"] == "90" and manifest["line"] == "2.1" and manifest["torch"] == "2.11.0+cu130"
    relative = os.path.join("share", "megatron-deepepv2", "nccl-2.30.7-sm90")
    root = str(tmp_path / "env" / relative / "nvidia" / "nccl")
    assert manifest["nccl"] == {"kind": "source", "version": [2, 30, 7], "root": root, "prefix_relative": relative}
    assert machine.installed_wheels == [manifest["deep_ep_wheel"]]
    with zipfile.ZipFile(wheels / manifest["nccl_wheel"]) as nccl:
        names = nccl.namelist()
        data = "megatron_deepepv2_nccl-2.30.7+sm90.data/data/share/megatron-deepepv2/nccl-2.30.7-sm90/nvidia/nccl"
        assert nccl.read(f"{data}/lib/libnccl.so.2") == open(os.path.join(root, "lib", "libnccl.so.2.30.7"), "rb").read()
        assert f"{data}/include/nccl_device/impl/barrier__funcs.h" in names and PTH_NAME in names
        record = nccl.read("megatron_deepepv2_nccl-2.30.7+sm90.dist-info/RECORD").decode().splitlines()
        assert len(record) == len(names) and all(line.split(",")[0] in names for line in record)

    # a rerun builds nothing; a lost wheel is rebuilt alone (the installed deep_ep is this tree's)
    before = len(machine.commands)
    assert Installer(opts, machine.system()).run() == 0
    assert machine.wheel_builds == 1 and not [c for c in machine.commands[before:] if c[0] == "make"]
    os.remove(wheels / manifest["deep_ep_wheel"])
    assert Installer(opts, machine.system()).run() == 0
    assert machine.wheel_builds == 2 and machine.installed_wheels == [manifest["deep_ep_wheel"]]


def test_from_wheels_installs_on_a_bare_machine_without_building(tmp_path) -> None:
    wheels = str(tmp_path / "wheels")
    build_with_wheels(tmp_path, wheels)
    target = another_machine(tmp_path, "target")
    assert main(["--from-wheels", wheels, "--work-dir", str(tmp_path / "target-work")], target.system()) == 0
    assert not target.ran("make") and target.wheel_builds == 0
    assert [c[0] for c in target.commands if c[0] in target.compilers] == []
    (install,) = [c for c in target.ran("pip")]
    assert install[4:7] == ["--no-index", "--no-deps", "--force-reinstall"]
    assert [os.path.basename(w) for w in install[7:]] == target.installed_wheels
    assert target.installed_wheels[0].startswith("megatron_deepepv2_nccl-2.30.7+sm90-py3-none-linux_")
    # PyTorch there loads the wheel's NCCL, through the wheel's .pth, and deep_ep imports
    probe = target.probe_python("/venv/bin/python", True, {})
    assert probe["mapped"] == [str(tmp_path / "env" / "share" / "megatron-deepepv2" / "nccl-2.30.7-sm90" / "nvidia"
                                   / "nccl" / "lib" / "libnccl.so.2")]
    assert probe["nccl"] == [2, 30, 7] and probe["buffers"] == ["ElasticBuffer", "Buffer"]
    assert target.commands[-1] == ["/venv/bin/python", "-m", "megatron_deepepv2.cli.doctor"]


@pytest.mark.parametrize("change, message", [
    ({"arch": "100"}, r"the wheels were built for sm_90; this machine's GPU is sm_100"),
    ({"torch_version": "2.12.0+cu130"}, r"the wheels were built with PyTorch 2.11.0\+cu130; this environment has 2.12.0\+cu130"),
    ({"prefix": "elsewhere"}, r"deep_ep was built for the NCCL at .*/env/share/.*; its wheel would go to .*/elsewhere/share"),
])
def test_from_wheels_refuses_a_machine_the_wheels_do_not_fit(tmp_path, change, message) -> None:
    wheels = str(tmp_path / "wheels")
    build_with_wheels(tmp_path, wheels)
    if change.get("prefix") == "elsewhere":
        change = {"prefix": str(tmp_path / "elsewhere")}
        shutil.rmtree(tmp_path / "env")
        target = FakeMachine(str(tmp_path / "target"), **change)
    else:
        target = another_machine(tmp_path, "target", **change)
    with pytest.raises(InstallError, match=r"step 'wheels' failed: " + message):
        Installer(InstallOptions(from_wheels=wheels, work_dir=str(tmp_path / "w")), target.system()).run()
    assert not target.ran("pip"), "nothing is installed on a machine the wheels do not fit"


def test_from_wheels_needs_the_manifest_and_its_wheels(tmp_path) -> None:
    target = FakeMachine(str(tmp_path / "target"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InstallError, match=r"has no readable megatron-deepepv2-wheels.json .*--wheel-dir"):
        Installer(InstallOptions(from_wheels=str(empty), work_dir=str(tmp_path / "w")), target.system()).run()
    wheels = str(tmp_path / "wheels")
    build_with_wheels(tmp_path, wheels)
    manifest = json.loads(open(os.path.join(wheels, install_deepep.WHEEL_MANIFEST)).read())
    os.remove(os.path.join(wheels, manifest["nccl_wheel"]))
    with pytest.raises(InstallError, match=r"lacks the wheel\(s\) its manifest names: megatron_deepepv2_nccl-"):
        Installer(InstallOptions(from_wheels=wheels, work_dir=str(tmp_path / "w")), another_machine(tmp_path, "t2").system()).run()


def test_options_take_a_source_or_wheels(tmp_path, capsys) -> None:
    with pytest.raises(InstallError, match=r"either --deepep-src .* or --from-wheels"):
        Installer(InstallOptions(work_dir=str(tmp_path)), FakeMachine(str(tmp_path / "m")).system())
    with pytest.raises(InstallError, match=r"--wheel-dir writes .*--from-wheels installs"):
        Installer(InstallOptions(from_wheels="w", wheel_dir="w"), FakeMachine(str(tmp_path / "n")).system())
    with pytest.raises(SystemExit):
        main(["--deepep-src", "x", "--from-wheels", "y"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_wheel_of_an_nccl_outside_the_environment_is_refused(tmp_path) -> None:
    machine = FakeMachine(str(tmp_path))
    opts = options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path)), wheel_dir=str(tmp_path / "wheels"))
    with pytest.raises(InstallError, match=r"step 'wheels' failed: the NCCL was installed at .*/prefix, outside this "
                                           r"environment .*drop --nccl-prefix"):
        Installer(opts, machine.system()).run()


def test_the_nccl_wheel_installs_with_pip_and_its_pth_puts_the_library_first(tmp_path) -> None:
    """The wheel format itself, through this machine's real pip: files where the manifest says, the .pth working."""
    root = tmp_path / "built" / "nvidia" / "nccl"
    (root / "lib").mkdir(parents=True)
    (root / "include" / "nccl_device").mkdir(parents=True)
    (root / "lib" / "libnccl.so.2.30.7").write_bytes(b"\x7fELF nccl")
    os.symlink("libnccl.so.2.30.7", root / "lib" / "libnccl.so.2")
    (root / "include" / "nccl.h").write_text("// nccl\n")
    (root / "include" / "nccl_device" / "core.h").write_text("// device\n")
    relative = os.path.join("share", "megatron-deepepv2", "nccl-2.30.7-sm90")
    wheel = install_deepep.build_nccl_wheel(str(tmp_path), str(root), relative, (2, 30, 7), "90")
    target = tmp_path / "target"
    # --ignore-installed: where the installer already installed this NCCL wheel (a GPU machine), pip would find the
    # requirement satisfied and put nothing under the prefix.
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                           "--ignore-installed", "--disable-pip-version-check", "--prefix", str(target), wheel],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Where pip puts a --prefix install's data files and modules: the prefix scheme's paths (a distribution's Python
    # may prefer another scheme than posix_prefix, e.g. with a "local" level).
    paths = sysconfig.get_paths(sysconfig.get_preferred_scheme("prefix"), vars={"base": target, "platbase": target})
    installed = Path(paths["data"]) / relative / "nvidia" / "nccl"
    found = sorted(str(p.relative_to(target)) for p in target.rglob("*") if p.is_file())
    assert (installed / "lib" / "libnccl.so.2").is_file(), f"not at {installed}; pip installed {found}"
    assert (installed / "lib" / "libnccl.so.2").read_bytes() == b"\x7fELF nccl"
    assert (installed / "include" / "nccl_device" / "core.h").read_text() == "// device\n"
    (pth,) = Path(paths["purelib"]).glob(PTH_NAME)
    fake_sys = types.SimpleNamespace(prefix=str(target), path=["/site-packages"])
    line = pth.read_text().replace("import os, sys;", "import os;")
    exec(line, {"sys": fake_sys})  # noqa: S102 -- the installed file under test
    assert fake_sys.path == [str(target / relative), "/site-packages"]


def test_a_source_install_after_the_wheels_finds_nothing_to_build(tmp_path) -> None:
    """Wheels installed on a bare machine; then the README's command builds from the same tree (another copy of it,
    cloned with its submodule): PyTorch already loads the wheel's NCCL, and deep_ep is that tree's build, so nothing is
    built."""
    wheels = str(tmp_path / "wheels")
    _, opts = build_with_wheels(tmp_path, wheels)
    target = another_machine(tmp_path, "target")
    work = str(tmp_path / "target-work")
    assert Installer(InstallOptions(from_wheels=wheels, work_dir=work), target.system()).run() == 0
    copy = shutil.copytree(opts.deepep_src, tmp_path / "copy" / "DeepEP")
    # as `git clone --recursive` leaves it: git's folder at the top, a submodule's .git file
    (copy / ".git").mkdir()
    (copy / ".git" / "HEAD").write_text("dd758ca\n")
    (copy / "third-party" / "fmt").mkdir(parents=True, exist_ok=True)
    (copy / "third-party" / "fmt" / ".git").write_text("gitdir: ../../.git/modules/third-party/fmt\n")
    before = len(target.commands)
    assert Installer(InstallOptions(deepep_src=str(copy), nccl_src=opts.nccl_src, work_dir=work),
                     target.system()).run() == 0
    rerun = target.commands[before:]
    assert not [c for c in rerun if c[0] == "make" or c[1:3] == ["-m", "pip"]], rerun
    with open(os.path.join(copy, "deep_ep", "buffers", "elastic.py"), "w") as f:  # another tree: built
        f.write("# patched\n")
    Installer(InstallOptions(deepep_src=str(copy), nccl_src=opts.nccl_src, work_dir=work), target.system()).run()
    assert [c for c in target.commands if c[-1] == str(copy)]


def test_wheels_built_against_pytorchs_own_nccl_need_that_nccl_where_they_go(tmp_path) -> None:
    """No NCCL wheel when PyTorch's NCCL was new enough: the target must load that same NCCL, or the step says which."""
    global TORCH_NCCL
    nvidia = tmp_path / "env" / "site" / "nvidia" / "nccl"
    (nvidia / "lib").mkdir(parents=True)
    (nvidia / "include").mkdir()
    (nvidia / "include" / "nccl.h").touch()
    (nvidia / "lib" / "libnccl.so.2").touch()
    saved, TORCH_NCCL = TORCH_NCCL, str(nvidia / "lib" / "libnccl.so.2")
    try:
        machine = FakeMachine(str(tmp_path / "build"), prefix=str(tmp_path / "env"), torch_nccl=(2, 30, 7))
        wheels = str(tmp_path / "wheels")
        assert Installer(options(tmp_path, nccl_prefix=None, wheel_dir=wheels), machine.system()).run() == 0
        manifest = json.loads(open(os.path.join(wheels, install_deepep.WHEEL_MANIFEST)).read())
        assert manifest["nccl_wheel"] is None and manifest["nccl"] == {"kind": "torch", "version": [2, 30, 7]}
        old = FakeMachine(str(tmp_path / "old"), prefix=str(tmp_path / "env2"))  # PyTorch loads NCCL 2.28.9
        with pytest.raises(InstallError, match=r"step 'wheels' failed: deep_ep was built against NCCL 2.30.7, which "
                                               r"PyTorch loaded there; here it loads 2.28.9: install a PyTorch that"):
            Installer(InstallOptions(from_wheels=wheels, work_dir=str(tmp_path / "w")), old.system()).run()
        same = FakeMachine(str(tmp_path / "same"), prefix=str(tmp_path / "env3"), torch_nccl=(2, 30, 7))
        assert Installer(InstallOptions(from_wheels=wheels, work_dir=str(tmp_path / "w3")), same.system()).run() == 0
        assert same.installed_wheels == [manifest["deep_ep_wheel"]]
    finally:
        TORCH_NCCL = saved


class DoctorMachine(FakeMachine):
    """The fake machine with the real doctor at the end: a healthy GPU node's probes (:mod:`tests.cli.test_doctor`),
    the environment the installer runs it with, and no RDMA NIC."""

    def run(self, cmd: list[str], env: dict[str, str], cwd: Optional[str], log: Optional[str]) -> int:
        if cmd[1:] == ["-m", "megatron_deepepv2.cli.doctor"]:
            from megatron_deepepv2.cli import doctor
            from tests.cli.test_doctor import healthy

            self.commands.append(list(cmd))
            self.envs.append(dict(env))
            return doctor.main([], probes=healthy(env=dict(env), rdma_devices=lambda: []))
        return super().run(cmd, env, cwd, log)


def test_on_a_node_without_an_rdma_nic_the_install_as_written_ends_with_the_doctor_passing(
        tmp_path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture) -> None:
    """No EP_DISABLE_GIN anywhere: the verify step and the doctor decide GIN off from the hardware; exit status 0."""
    machine = DoctorMachine(str(tmp_path))
    system = machine.system()
    system.rdma_devices = lambda: []
    assert "EP_DISABLE_GIN" not in system.env
    caplog.set_level("INFO", logger="megatron_deepepv2.cli.install_deepep")
    assert Installer(options(tmp_path, nccl_src=make_nccl_tree(str(tmp_path))), system).run() == 0
    assert machine.commands[-1] == ["/venv/bin/python", "-m", "megatron_deepepv2.cli.doctor"]
    assert "EP_DISABLE_GIN" not in machine.envs[-1]  # the doctor ran with the environment as the user had it
    (verify,) = [r.getMessage() for r in caplog.records if "verify: deep_ep" in r.getMessage()]
    assert "GIN: no RDMA NIC" in verify and "GIN off" in verify, verify
    report = capsys.readouterr().out
    assert "No blocking problems." in report and "GIN off" in report, report
