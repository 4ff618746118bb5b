"""The command-line tools live in ``megatron_deepepv2.cli``, the only place they run from (the old
``python -m megatron_deepepv2.X`` commands are gone), each also installed as a ``megatron-deepepv2-TOOL`` command, and
importing one tool loads no other tool and not Megatron."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests import preloaded_python

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("install_deepep", "doctor", "demo", "run")


def _help(module: str) -> subprocess.CompletedProcess:
    # Forked from the preloaded interpreter: the help texts are the same, the torch import is not paid per run.
    return subprocess.run([preloaded_python.python(), "-m", module, "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("tool", TOOLS)
def test_each_command_prints_its_help_and_the_old_command_is_gone(tool: str) -> None:
    """``python -m megatron_deepepv2.cli.TOOL --help`` exits 0 with a usage text. Every tool has ``--help``:
    argparse's for the installer, the doctor and the demo (it exits before anything runs), and the launch entry's own
    (its usage and docstring on stderr, before anything is imported or installed). ``megatron_deepepv2.TOOL``, the
    old command's module, no longer exists."""
    new = _help(f"megatron_deepepv2.cli.{tool}")
    assert new.returncode == 0, new.stdout[-2000:] + new.stderr[-3000:]
    text = new.stdout + new.stderr
    assert "usage:" in text, text[-2000:]
    assert importlib.util.find_spec(f"megatron_deepepv2.{tool}") is None


def test_each_tool_is_an_installed_command_running_its_main() -> None:
    """``[project.scripts]`` declares ``megatron-deepepv2-TOOL`` (``_`` read as ``-``) for each tool and nothing else,
    each the tool's ``main``; pip installed each where this interpreter's commands go, and the doctor's command runs
    (``--help``)."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    expected = {f"megatron-deepepv2-{tool.replace('_', '-')}": f"megatron_deepepv2.cli.{tool}:main" for tool in TOOLS}
    assert declared == expected
    bin_dir = Path(sysconfig.get_path("scripts"))  # where pip installs this interpreter's commands
    for command, target in declared.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), target
        assert (bin_dir / command).is_file(), (f"{command} is not installed in {bin_dir}: reinstall the package "
                                               "(pip install -e .)")
    done = subprocess.run([str(bin_dir / "megatron-deepepv2-doctor"), "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


# What ``import megatron_deepepv2`` and then ``import MODULE`` load, from a fresh interpreter.
_LOADED = """
import json, sys
import megatron_deepepv2
package = set(sys.modules)
__import__(sys.argv[1])
print(json.dumps({"package": sorted(package), "after": sorted(sys.modules)}))
"""


@pytest.mark.parametrize("tool", ["doctor", "install_deepep"])
def test_importing_a_tool_loads_no_other_tool_nor_megatron_nor_the_dispatch_path(tool: str) -> None:
    """``import megatron_deepepv2.cli.TOOL`` in a fresh interpreter imports neither ``megatron.core``, nor another tool of
    ``cli`` (``cli/__init__.py`` imports nothing), nor any library module beyond what ``import megatron_deepepv2`` itself
    loads: in particular not ``megatron_deepepv2.ops`` unless the package's own ``__init__`` imports it."""
    module = f"megatron_deepepv2.cli.{tool}"
    done = subprocess.run([sys.executable, "-c", _LOADED, module], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    package, after = set(loaded["package"]), set(loaded["after"])
    assert module in after
    megatron = sorted(name for name in after if name == "megatron" or name.startswith("megatron."))
    assert not megatron, megatron
    other_tools = {f"megatron_deepepv2.cli.{other}" for other in TOOLS} - {module}
    if tool == "install_deepep":
        other_tools.discard("megatron_deepepv2.cli.doctor")  # the installer uses the doctor's probes
    assert not other_tools & after, sorted(other_tools & after)
    added = sorted(name for name in after - package if name.startswith("megatron_deepepv2."))
    allowed = {"megatron_deepepv2.cli", module, "megatron_deepepv2.cli.doctor",
               "megatron_deepepv2.backends.deepep.lines", "megatron_deepepv2.backends.deepep.probes"}
    assert set(added) <= allowed, added
    assert "megatron_deepepv2.ops" not in after - package
