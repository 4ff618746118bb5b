"""The preload lists (:mod:`megatron_deepepv2.testing.preload`): one shared list, in order (torch, the package, the
Megatron modules, ``frozen_preload`` last), which each server (the demo's CPU ranks, the tests' ranks, the tests'
preloaded ``python``) takes with only the changes it asks for."""

from __future__ import annotations

from megatron_deepepv2.testing.preload import MEGATRON_PRELOAD, server_preload

FROZEN = "megatron_deepepv2.testing.frozen_preload"


def test_the_shared_list_is_torch_the_package_the_megatron_modules_then_the_freeze() -> None:
    assert server_preload() == ["torch", "torch.distributed", "megatron_deepepv2", *MEGATRON_PRELOAD, FROZEN]
    assert server_preload(package=False, before_megatron=("first",), after_megatron=("second",), freeze=False) == [
        "torch", "torch.distributed", "first", *MEGATRON_PRELOAD, "second"]
    assert server_preload() is not server_preload()  # a new list each time: a caller may change its own
    assert "megatron.training" not in MEGATRON_PRELOAD  # importing it configures the root logger


def test_each_server_imports_the_shared_list_with_only_its_own_changes() -> None:
    from megatron_deepepv2.cli import demo
    from tests import distributed, preloaded_python

    assert demo._CPU_PRELOAD == ["torch", "torch.distributed", "megatron_deepepv2",
                                 "megatron_deepepv2.testing.cpu_shims", "megatron_deepepv2.testing.moe_model",
                                 *MEGATRON_PRELOAD, FROZEN]
    assert distributed.RANK_PRELOAD == ["torch", "torch.distributed", "megatron_deepepv2", *MEGATRON_PRELOAD,
                                        "megatron.core.models.gpt.fine_grained_callables", FROZEN]
    # The preloaded python reads the list from the file (importing the package would leave it imported in every run),
    # and freezes its imports itself.
    assert preloaded_python.PRELOAD == ("torch", "torch.distributed", "megatron.core", *MEGATRON_PRELOAD)
