"""Coexistence with a megatron-core that ships its own ``deepepv2`` (a Megatron-LM source tree that has one).

Runs when ``MEGATRON_DEEPEPV2_NATIVE_TREE`` names the root of a Megatron-LM checkout whose ``megatron/core`` has a
native ``_DeepepV2Manager`` (Megatron-LM's ``dev`` branch since #4793): ``make test-native MEGATRON_LM=/path``.
Each rank, a fresh interpreter, puts that tree first on ``sys.path`` before importing Megatron. Checked: by default
deepepv2 layers get this package's manager and match the alltoall dispatcher (forward and every gradient); with
``MEGATRON_DEEPEPV2_MANAGER=native`` Megatron is left unpatched and its own manager is what a deepepv2 layer builds.
"""

from __future__ import annotations

import os

import pytest

from tests.distributed import run_distributed

TREE = os.environ.get("MEGATRON_DEEPEPV2_NATIVE_TREE", "")
_DISPATCHER = os.path.join(TREE, "megatron", "core", "transformer", "moe", "token_dispatcher.py")


def _has_native_manager() -> bool:
    try:
        with open(_DISPATCHER, encoding="utf-8") as source:
            return "class _DeepepV2Manager" in source.read()
    except OSError:
        return False


pytestmark = pytest.mark.skipif(
    not _has_native_manager(),
    reason="needs a Megatron-LM tree with a native _DeepepV2Manager: set MEGATRON_DEEPEPV2_NATIVE_TREE (or run "
           "`make test-native MEGATRON_LM=/path/to/Megatron-LM`, e.g. its dev branch)",
)


def _use_tree(tree: str) -> None:
    import sys

    assert "megatron" not in sys.modules, "Megatron was imported before the tree was put first on sys.path"
    sys.path.insert(0, tree)
    import megatron.core

    assert megatron.core.__file__.startswith(tree), megatron.core.__file__


def _plugin_by_default(rank: int, world: int, tree: str, layout: str) -> dict:
    _use_tree(tree)
    from megatron.core.transformer.moe import token_dispatcher

    from megatron_deepepv2.mcore import integration
    from megatron_deepepv2.mcore.manager import _DeepepV2Manager
    from tests.unit.test_megatron_integration import _parity

    assert hasattr(token_dispatcher, "_DeepepV2Manager")  # the tree's own
    result = _parity(rank, world, layout, [12, 8], None, 1)
    report = integration.installed()
    assert report.native_available and not report.native and report.manager == "plugin" and report.patches
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    layer = build_moe_layer(TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3), "deepepv2")
    assert type(layer.token_dispatcher._comm_manager) is _DeepepV2Manager
    assert token_dispatcher._DeepepV2Manager is not _DeepepV2Manager
    return result


@pytest.mark.parametrize("layout", ["expand", "compact"])
def test_deepepv2_layers_get_this_packages_manager_by_default(layout: str) -> None:
    outcomes = run_distributed(_plugin_by_default, 2, TREE, layout, timeout=240, fresh_interpreter=True)
    assert all(o["rows"] > 0 for o in outcomes)


def _native_on_request(rank: int, world: int, tree: str) -> str:
    _use_tree(tree)
    from megatron.core.transformer.moe import moe_layer, token_dispatcher

    import megatron_deepepv2
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    install_cpu_shims()
    original = moe_layer.MoEFlexTokenDispatcher
    with megatron_deepepv2.settings_override(manager="native"):
        report = megatron_deepepv2.install()
    assert report.native and report.patches == [] and moe_layer.MoEFlexTokenDispatcher is original
    # Megatron's own manager needs DeepEP v2 (absent on CPU): building the layer reaches it, not ours.
    try:
        layer = build_moe_layer(TinyMoEConfig(hidden=32, ffn=48, num_experts=8, topk=3), "deepepv2")
    except Exception as error:  # noqa: BLE001 - what the native manager raises without deep_ep
        return f"native raised {type(error).__name__}: {error}"
    manager = layer.token_dispatcher._comm_manager
    assert type(manager) is token_dispatcher._DeepepV2Manager, type(manager)
    return "native manager built"


def test_native_manager_on_request_leaves_megatron_alone() -> None:
    outcomes = run_distributed(_native_on_request, 2, TREE, timeout=240, fresh_interpreter=True)
    assert all(o == "native manager built" or "deep" in o.lower() for o in outcomes), outcomes
