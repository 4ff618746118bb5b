"""pytest plugin: runs Megatron-Core's own flex-dispatcher tests against the ``deepepv2`` backend.

Loaded with ``-p megatron_deepepv2_conformance`` into a pytest that collects a Megatron-LM tree's
``tests/unit_tests/transformer/moe/test_token_dispatcher.py`` (``tools/megatron_conformance.py`` puts this folder on
``PYTHONPATH`` and runs it under ``torchrun``). The tests run unchanged except for two parametrizations, rewritten at
collection:

* ``moe_flex_dispatcher_backend``: ``["deepepv2"]`` in place of Megatron's backends (``deepep``, ``hybridep``,
  ``ncclep``); the class-level skip "Deep EP and Hybrid EP are not available" (about Megatron's own backends) goes too.
* ``tp_size,ep_size``: upstream's pairs that this world runs (``tp * ep`` divides ``WORLD_SIZE``); where none does
  (upstream's all need 8 ranks), ``(1, WORLD_SIZE)``, and ``(WORLD_SIZE, 1)`` with more than one rank.

What the backend is and whether a dispatch waits on the host come from the package's settings
(``MEGATRON_DEEPEPV2_BACKEND``, ``MEGATRON_DEEPEPV2_NO_HOST_SYNC``). With ``MEGATRON_DEEPEPV2_BACKEND=deepep`` and no
usable DeepEP every case skips with DeepEP's reason, not a failure.

Two kinds of upstream case are not the flex backend's to pass, and say so: a case that builds a dispatcher of
Megatron's own (:data:`OTHER_BACKEND_CASES`) skips with what it builds; a case that trains FP8 experts
(:data:`FP8_CASES`), where the experts are ``SyncFreeSequentialMLP`` (``MEGATRON_DEEPEPV2_EXPERTS=sync_free``, as
without host sync), must fail with the package's refusal of FP8 for those experts (a strict ``xfail``: if it ran,
that would fail the run).

Megatron's ``tests/unit_tests/conftest.py`` downloads its CI datasets when its tests start (``requests`` with no timeout,
and ``click`` imported for it); the dispatcher tests need no data, so its downloader is replaced by one that says so.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any, Iterable, Optional

import pytest

#: The backend Megatron's flex parametrization gets instead of its own.
BACKEND = "deepepv2"
#: The reason of the class-level skip about Megatron's own backends, dropped with them.
MEGATRON_BACKENDS_SKIP = "Deep EP and Hybrid EP are not available"
_DOWNLOADER = "tests.test_utils.python_scripts.download_unit_tests_dataset"
#: Upstream cases that build a dispatcher of Megatron's own rather than the parametrized flex backend, and why.
OTHER_BACKEND_CASES = {
    "test_forward_backward_zero_copy": "tests Megatron's NCCL-EP dispatcher: it sets moe_flex_dispatcher_backend="
                                       "'ncclep' and moe_ncclep_static_shape itself, not the flex parametrization",
}
#: Upstream cases that train FP8 experts (Transformer Engine's FP8 recipes).
FP8_CASES = ("test_router_padding_for_fp8_forward_backward",)
#: The package's refusal of FP8 for SyncFreeSequentialMLP (megatron_deepepv2.mcore.megatron_config), which those cases
#: meet.
SYNC_FREE_FP8_REFUSAL = "SyncFreeSequentialMLP runs BF16/FP32 grouped GEMMs"


def world_size() -> int:
    """Ranks of this run (``WORLD_SIZE``, as torchrun sets it; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def runnable_pairs(upstream: Iterable[tuple[int, int]], world: int) -> list[tuple[int, int]]:
    """The ``(tp, ep)`` pairs a world of ``world`` ranks runs.

    Args:
        upstream: Megatron's pairs.
        world: Ranks in the run.

    Returns:
        Upstream's pairs whose ``tp * ep`` divides ``world``, in upstream's order; where none does, ``(1, world)`` and,
        for ``world > 1``, ``(world, 1)``.
    """
    fitting = [(tp, ep) for tp, ep in upstream if world % (tp * ep) == 0]
    if fitting:
        return fitting
    return [(1, world)] + ([(world, 1)] if world > 1 else [])


def _rewritten(mark: pytest.Mark, world: int) -> Optional[pytest.Mark]:
    """``mark`` as this run needs it: a new parametrize mark, None to drop it, or ``mark`` itself."""
    if mark.name == "skipif" and MEGATRON_BACKENDS_SKIP in str(mark.kwargs.get("reason", "")):
        return None
    if mark.name != "parametrize" or not mark.args:
        return mark
    names = str(mark.args[0]).replace(" ", "")
    if names == "moe_flex_dispatcher_backend":
        return pytest.mark.parametrize(mark.args[0], [BACKEND], **mark.kwargs).mark
    if names == "tp_size,ep_size":
        return pytest.mark.parametrize(mark.args[0], runnable_pairs(mark.args[1], world), **mark.kwargs).mark
    return mark


def rewrite_marks(obj: Any, world: int) -> None:
    """Rewrites ``obj.pytestmark`` in place for this run (see the module docstring).

    Args:
        obj: A test function or class.
        world: Ranks in the run.
    """
    marks = getattr(obj, "pytestmark", None)
    if isinstance(marks, list):
        obj.pytestmark = [mark for mark in (_rewritten(mark, world) for mark in marks) if mark is not None]


def _replace_downloader() -> None:
    module = types.ModuleType(_DOWNLOADER)

    def download_and_extract_asset(assets_dir: Any) -> bool:
        raise ImportError("not downloaded: Megatron's dispatcher tests need no CI data (megatron-deepepv2 conformance)")

    module.download_and_extract_asset = download_and_extract_asset  # type: ignore[attr-defined]
    sys.modules.setdefault(_DOWNLOADER, module)


def pytest_configure(config: pytest.Config) -> None:
    import megatron_deepepv2  # noqa: PLC0415

    megatron_deepepv2.install()
    # Each rank writes its own report (the runner reads them all).
    xml = getattr(config.option, "xmlpath", None)
    if xml and "{rank}" in xml:
        config.option.xmlpath = xml.replace("{rank}", os.environ.get("RANK", "0"))
    config.addinivalue_line("markers", "internal: Megatron's marker for its internal tests")
    config.addinivalue_line("markers", "flaky_in_dev: Megatron's marker for tests flaky on its dev branch")


@pytest.hookimpl(hookwrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: Any):
    if isinstance(obj, type) or callable(obj):
        rewrite_marks(obj, world_size())
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """FP8 cases with ``SyncFreeSequentialMLP`` experts must fail with the package's refusal (strict xfail)."""
    from megatron_deepepv2.config import get_settings  # noqa: PLC0415

    if get_settings().experts != "sync_free":
        return
    for item in items:
        if getattr(item, "originalname", item.name) in FP8_CASES:
            item.add_marker(pytest.mark.xfail(
                strict=True, raises=ValueError,
                reason=f"MEGATRON_DEEPEPV2_EXPERTS=sync_free refuses FP8 experts ('{SYNC_FREE_FP8_REFUSAL}...'); "
                       "FP8 experts are TEGroupedMLP with host sync"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Cases of another backend skip saying what they build; cases of the deepep backend skip with DeepEP's reason
    where it is not usable (no CUDA, no DeepEP)."""
    other = OTHER_BACKEND_CASES.get(getattr(item, "originalname", item.name))
    if other:
        pytest.skip(f"not a deepepv2 case: {other}")
    callspec = getattr(item, "callspec", None)
    if callspec is None or callspec.params.get("moe_flex_dispatcher_backend") != BACKEND:
        return
    from megatron_deepepv2.config import get_settings  # noqa: PLC0415

    if get_settings().backend == "deepep":
        from megatron_deepepv2.backends.deepep.backend import DeepEPBackend  # noqa: PLC0415

        reason = DeepEPBackend.unavailable_reason()
        if reason:
            pytest.skip(f"MEGATRON_DEEPEPV2_BACKEND=deepep: {reason}")


_replace_downloader()
