"""The DeepEP release lines this package knows, what each needs, and how to tell them apart.

Two lines provide the expert-parallel buffer the backends drive:

* **2.1** (``deep_ep.ElasticBuffer``, the 2.1.0 release): NCCL >= 2.30.4 at build and run time, NVSHMEM at
  build time (its legacy v1 kernels), nvcc at run time for the JIT.
* **V2.5** (``deep_ep.EPBuffer``, DeepEP main since 2026-09-29): NCCL >= 2.32.3, nvcc >= 13.1 for its JIT (the
  DeepJIT submodule, cache in ``$HOME/.dj``); no NVSHMEM, no v1 ``Buffer``.

A ``deep_ep`` that exports only ``Buffer`` is DeepEP v1 (or HybridEP, which installs a module of the same name).
The doctor, the installer and the backend's import check all ask this module, so the requirements live in one place.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Optional

Version = tuple[int, ...]


@dataclass(frozen=True)
class DeepEPLine:
    """One DeepEP release line and its requirements.

    Attributes:
        name: The line's name as users know it (``"2.1"``, ``"V2.5"``).
        buffer_class: The ``deep_ep`` attribute of its expert-parallel buffer.
        min_nccl: The oldest NCCL it builds and runs with.
        min_nvcc: The oldest nvcc its JIT accepts, or None when any CUDA 12.3+ toolkit does.
        needs_nvshmem: Whether its build needs NVSHMEM.
    """

    name: str
    buffer_class: str
    min_nccl: Version
    min_nvcc: Optional[Version]
    needs_nvshmem: bool


DEEPEP_2_1 = DeepEPLine("2.1", "ElasticBuffer", (2, 30, 4), None, True)
DEEPEP_2_5 = DeepEPLine("V2.5", "EPBuffer", (2, 32, 3), (13, 1), False)
#: Newest first: a module exporting both buffers is taken as the newer line.
LINES = (DEEPEP_2_5, DEEPEP_2_1)


def version_text(version: Optional[Version]) -> str:
    """``(2, 30, 4)`` -> ``"2.30.4"`` (``"none"`` for None)."""
    return ".".join(map(str, version)) if version else "none"


def parse_version(text: Optional[str]) -> Version:
    """The leading numeric components of a version string (``"13.1.115+x"`` -> ``(13, 1, 115)``)."""
    parts = []
    for piece in (text or "").split("+")[0].split("."):
        digits = re.match(r"\d+", piece)
        if not digits:
            break
        parts.append(int(digits.group()))
    return tuple(parts)


def line_of_module(deep_ep: Any) -> Optional[DeepEPLine]:
    """The line an imported ``deep_ep`` belongs to, from the buffer it exports (None: v1 or not DeepEP)."""
    for line in LINES:
        if hasattr(deep_ep, line.buffer_class):
            return line
    return None


def line_of_source_tree(path: str) -> DeepEPLine:
    """The line a DeepEP source tree builds, from the buffer modules it contains.

    Args:
        path: Root of the DeepEP source tree (the folder holding ``setup.py``).

    Returns:
        The line.

    Raises:
        ValueError: If the tree holds neither ``deep_ep/buffers/ep.py`` (V2.5) nor ``deep_ep/buffers/elastic.py``
            (2.1), e.g. a DeepEP v1 or HybridEP tree.
    """
    buffers = os.path.join(path, "deep_ep", "buffers")
    if os.path.isfile(os.path.join(buffers, "ep.py")):
        return DEEPEP_2_5
    if os.path.isfile(os.path.join(buffers, "elastic.py")):
        return DEEPEP_2_1
    raise ValueError(f"{path} is not a DeepEP v2 source tree: it has neither deep_ep/buffers/ep.py (V2.5, EPBuffer) nor "
                     "deep_ep/buffers/elastic.py (2.1, ElasticBuffer). A v1 or HybridEP tree provides neither; check "
                     "out DeepEP's main branch (V2.5) or the v2.1.0 tag.")


def source_tree_version(path: str) -> str:
    """The ``__version__`` a DeepEP source tree declares in ``deep_ep/__init__.py`` (``"unknown"`` if none)."""
    try:
        with open(os.path.join(path, "deep_ep", "__init__.py"), encoding="utf-8") as init:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", init.read(), re.MULTILINE)
    except OSError:
        return "unknown"
    return found.group(1) if found else "unknown"
