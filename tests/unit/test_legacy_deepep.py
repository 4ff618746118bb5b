"""Megatron's own ``deepep`` backend next to DeepEP 2.1: ``install()`` lets Megatron's ``fused_a2a`` import 2.1's
legacy ``Buffer`` (``HAVE_DEEP_EP`` becomes true) and changes nothing else; too late (``fused_a2a`` imported first) it
says so and changes nothing. A stand-in ``deep_ep`` package has 2.1's layout of names (fresh interpreters where the
import order matters, this process otherwise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

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

PROBE = textwrap.dedent("""
    import json, sys
    import megatron_deepepv2
    order = sys.argv[1]
    report = megatron_deepepv2.install() if order == "install-first" else None
    from megatron.core.transformer.moe import fused_a2a, token_dispatcher
    import deep_ep.utils
    def names(module):  # each name's type and what it is: a plain value itself, else its qualified name
        return {k: (type(v).__name__, v if isinstance(v, (bool, int, float, str, type(None)))
                    else getattr(v, "__qualname__", None)) for k, v in vars(module).items() if not k.startswith("__")}
    print(json.dumps({"have": fused_a2a.HAVE_DEEP_EP, "dispatch": fused_a2a.fused_dispatch is not None,
                      "fused_a2a": names(fused_a2a), "token_dispatcher": names(token_dispatcher),
                      "utils": sorted(k for k in vars(deep_ep.utils) if not k.startswith("__")),
                      "same_class": getattr(deep_ep.utils, "EventOverlap", None) is getattr(deep_ep, "EventOverlap"),
                      "patches": report.patches if report else []}))
""")


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def _probe(site: Path, order: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", PROBE, order], capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1]), done.stderr


@pytest.fixture(scope="module")
def deep_ep_21(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("deep_ep_21"), DEEP_EP_21)


def test_install_lets_megatrons_deepep_import_deepep_21_and_changes_nothing_else(deep_ep_21: Path) -> None:
    before, _ = _probe(deep_ep_21, "no-install")
    after, _ = _probe(deep_ep_21, "install-first")
    assert (before["have"], before["dispatch"]) == (False, False)
    assert (after["have"], after["dispatch"]) == (True, True)
    assert any("legacy Buffer" in patch for patch in after["patches"]), after["patches"]
    # deep_ep.utils gained one name, the class deep_ep already had.
    assert set(after["utils"]) - set(before["utils"]) == {"EventOverlap"} and after["same_class"]
    # In Megatron's modules only what HAVE_DEEP_EP guards changed: the flag, the name whose import failed (Buffer and
    # EventHandle were bound before it), the functions that were None. token_dispatcher's own names are those it had (install rebinds moe_layer's dispatcher, not these).
    changed = {name for name in set(before["fused_a2a"]) | set(after["fused_a2a"])
               if before["fused_a2a"].get(name) != after["fused_a2a"].get(name)}
    assert changed == {"HAVE_DEEP_EP", "EventOverlap", "fused_dispatch", "fused_combine", "set_deepep_num_sms"}, changed
    changed_td = {name for name in set(before["token_dispatcher"]) | set(after["token_dispatcher"])
                  if before["token_dispatcher"].get(name) != after["token_dispatcher"].get(name)}
    assert changed_td <= {"fused_dispatch", "fused_combine", "set_deepep_num_sms"}, changed_td


def _stand_in_modules(monkeypatch: pytest.MonkeyPatch, site: Path) -> types.ModuleType:
    """Imports the stand-in ``deep_ep`` from ``site`` into this process for the test's duration; returns it."""
    for name in [name for name in sys.modules if name == "deep_ep" or name.startswith("deep_ep.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(site))
    import deep_ep.utils  # noqa: PLC0415

    for name in ("deep_ep", "deep_ep.utils", "deep_ep.utils.event"):
        monkeypatch.setitem(sys.modules, name, sys.modules[name])  # removed again at teardown
    return sys.modules["deep_ep"]


def test_after_megatron_imported_fused_a2a_it_warns_and_changes_nothing(
        deep_ep_21: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

    from megatron_deepepv2 import integration  # noqa: PLC0415

    assert fused_a2a.HAVE_DEEP_EP is False  # no DeepEP in the test environment
    deep_ep = _stand_in_modules(monkeypatch, deep_ep_21)
    assert integration._expose_legacy_deepep_to_megatron() is None
    assert not hasattr(deep_ep.utils, "EventOverlap") and fused_a2a.HAVE_DEEP_EP is False
    assert "Call install() before importing Megatron's MoE modules" in caplog.text


def test_a_deepep_without_the_legacy_buffer_is_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2 import integration  # noqa: PLC0415

    deep_ep = _stand_in_modules(monkeypatch, _write(tmp_path, DEEP_EP_25))
    monkeypatch.delitem(sys.modules, integration.FUSED_A2A, raising=False)  # as before Megatron is imported
    assert integration._expose_legacy_deepep_to_megatron() is None
    assert not hasattr(deep_ep.utils, "EventOverlap")
