"""Megatron's own ``deepep`` backend next to DeepEP 2.1: ``install()`` lets Megatron's ``fused_a2a`` import 2.1's
legacy ``Buffer`` (``HAVE_DEEP_EP`` becomes true) and changes nothing else; too late (``fused_a2a`` imported first) it
says so and changes nothing. A stand-in ``deep_ep`` package has 2.1's layout of names (fresh interpreters where the
import order matters, this process otherwise)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Callable, Iterator

import pytest

# DeepEP 2.1's layout of names: the legacy Buffer, ElasticBuffer and both events in deep_ep; deep_ep.utils re-exports
# EventHandle only.
DEEP_EP_21 = {
    "deep_ep/__init__.py": """
        class Buffer: ...
        class ElasticBuffer: ...
        from deep_ep.utils.event import EventHandle, EventOverlap
    """,
    "deep_ep/utils/__init__.py": "from deep_ep.utils.event import EventHandle\n",
    "deep_ep/utils/event.py": """
        class EventHandle: ...
        class EventOverlap: ...
    """,
}
# V2.5: the legacy Buffer is gone, so Megatron's deepep cannot run on it whatever the names.
DEEP_EP_25 = {**DEEP_EP_21, "deep_ep/__init__.py": """
        class EPBuffer: ...
        from deep_ep.utils.event import EventHandle, EventOverlap
    """}

# install() first, as `python -m megatron_deepepv2.cli.run` does: Megatron's modules are imported after it.
PROBE = textwrap.dedent("""
    import json, megatron_deepepv2
    report = megatron_deepepv2.install()
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher
    print(json.dumps({"have": fused_a2a.HAVE_DEEP_EP, "dispatch": token_dispatcher.fused_dispatch is not None,
                      "patches": report.patches}))
""")


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


@pytest.fixture(scope="module")
def deep_ep_21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("deep_ep_21"), DEEP_EP_21)


def test_install_exposes_the_legacy_buffer_before_megatron_is_imported(deep_ep_21: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(deep_ep_21), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert (found["have"], found["dispatch"]) == (True, True), found
    assert any("legacy Buffer" in patch for patch in found["patches"]), found["patches"]


def _fresh_fused_a2a() -> types.ModuleType:
    """Megatron's ``fused_a2a`` executed anew (a module object of its own), as a first import would."""
    from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

    spec = importlib.util.spec_from_file_location("fresh_fused_a2a", fused_a2a.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _names(module: types.ModuleType) -> dict[str, tuple]:
    """Each name's type and what it is: a plain value itself, else its qualified name."""
    return {name: (type(value).__name__, value if isinstance(value, (bool, int, float, str, type(None)))
                   else getattr(value, "__qualname__", None))
            for name, value in vars(module).items() if not name.startswith("__")}


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], types.ModuleType]]:
    """Imports a stand-in ``deep_ep`` from a folder into this process; at teardown the stand-in is gone and a
    ``deep_ep`` imported before (a GPU machine's) is back."""
    def is_deep_ep(name: str) -> bool:
        return name == "deep_ep" or name.startswith("deep_ep.")

    def load(site: Path) -> types.ModuleType:
        for name in [name for name in sys.modules if is_deep_ep(name)]:
            monkeypatch.delitem(sys.modules, name)  # restored at teardown
        monkeypatch.syspath_prepend(str(site))
        import deep_ep.utils  # noqa: PLC0415

        return sys.modules["deep_ep"]

    yield load
    for name in [name for name in sys.modules if is_deep_ep(name)]:
        del sys.modules[name]


def test_megatrons_import_of_deepep_21_succeeds_once_exposed_and_nothing_else_changes(
        deep_ep_21: Path, stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.mcore import integration  # noqa: PLC0415

    deep_ep = stand_in(deep_ep_21)
    before, utils_before = _names(_fresh_fused_a2a()), set(vars(deep_ep.utils))
    monkeypatch.delitem(sys.modules, integration.FUSED_A2A)  # as before anything imported Megatron
    assert "legacy Buffer" in integration._expose_legacy_deepep_to_megatron()
    after = _names(_fresh_fused_a2a())
    assert (before["HAVE_DEEP_EP"], after["HAVE_DEEP_EP"]) == (("bool", False), ("bool", True))
    # deep_ep.utils gained one name, the class deep_ep already had.
    assert set(vars(deep_ep.utils)) - utils_before == {"EventOverlap"}
    assert deep_ep.utils.EventOverlap is deep_ep.EventOverlap
    # Only what HAVE_DEEP_EP guards changed: the flag, the name whose import failed (Buffer and EventHandle were bound
    # before it), and the functions that were None.
    changed = {name for name in set(before) | set(after) if before.get(name) != after.get(name)}
    assert changed == {"HAVE_DEEP_EP", "EventOverlap", "fused_dispatch", "fused_combine", "set_deepep_num_sms"}, changed


def test_after_megatron_imported_fused_a2a_it_warns_and_changes_nothing(
        deep_ep_21: Path, stand_in, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

    from megatron_deepepv2.mcore import integration  # noqa: PLC0415

    monkeypatch.setattr(fused_a2a, "HAVE_DEEP_EP", False)  # imported when DeepEP 2.1's names did not import for it
    deep_ep = stand_in(deep_ep_21)
    assert integration._expose_legacy_deepep_to_megatron() is None
    assert not hasattr(deep_ep.utils, "EventOverlap") and fused_a2a.HAVE_DEEP_EP is False
    assert "Call install() before importing Megatron's MoE modules" in caplog.text


def test_a_deepep_without_the_legacy_buffer_is_left_alone(tmp_path: Path, stand_in,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.mcore import integration  # noqa: PLC0415

    deep_ep = stand_in(_write(tmp_path, DEEP_EP_25))
    monkeypatch.delitem(sys.modules, integration.FUSED_A2A, raising=False)  # as before Megatron is imported
    assert integration._expose_legacy_deepep_to_megatron() is None
    assert not hasattr(deep_ep.utils, "EventOverlap")
