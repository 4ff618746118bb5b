"""What this process has of DeepEP, and whether the backend can run with it: the one place that asks.

:func:`import_deep_ep` imports ``deep_ep`` and checks it is DeepEP v2; :func:`deepep_unavailable_reason` says why the
backend cannot run here (no CUDA device, an older GPU, the NCCL that is loaded, the import), and
:func:`handle_order_unavailable_reason` whether the installed handle allows deterministic mode.
:func:`runtime_nccl_version` asks the loaded NCCL for its version; :func:`line_of_source_tree` and
:func:`source_tree_version` read a DeepEP source tree. The doctor, the installer and the backend all ask here, against
the requirements of :data:`~.lines.LINES`.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import os
import re
import sys
from typing import Any, Optional

import torch

from megatron_deepepv2.backends.deepep.lines import DEEPEP_2_1, DEEPEP_2_5, DeepEPLine, Version, line_of_module


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
    raise ValueError(f"{path} is not a DeepEP v2 source tree: it has neither deep_ep/buffers/ep.py (V2.5, EPBuffer) "
                     "nor deep_ep/buffers/elastic.py (2.1, ElasticBuffer). A v1 or HybridEP tree provides neither; "
                     "check out DeepEP's main branch (V2.5) or the v2.1.0 tag.")


def source_tree_version(path: str) -> str:
    """The ``__version__`` a DeepEP source tree declares in ``deep_ep/__init__.py`` (``"unknown"`` if none)."""
    try:
        with open(os.path.join(path, "deep_ep", "__init__.py"), encoding="utf-8") as init:
            found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", init.read(), re.MULTILINE)
    except OSError:
        return "unknown"
    return found.group(1) if found else "unknown"


INSTALL_HINT = (
    "Install DeepEP v2 -- the 2.1 line (deep_ep.ElasticBuffer, NCCL >= 2.30.4) or V2.5 (deep_ep.EPBuffer, NCCL >= "
    "2.32.3 and nvcc >= 13.1) -- built against the NCCL that PyTorch loads, on an SM90/SM100 GPU with nvcc at run "
    "time for its JIT: `python -m megatron_deepepv2.cli.install_deepep --deepep-src PATH` does it "
    "(see https://github.com/deepseek-ai/DeepEP). On single-node machines without an RDMA NIC also set "
    "EP_DISABLE_GIN=1. Or select the portable backend with MEGATRON_DEEPEPV2_BACKEND=reference. "
    "`python -m megatron_deepepv2.cli.doctor` checks every requirement."
)


def import_deep_ep() -> Any:
    """Imports ``deep_ep`` and checks that it is DeepEP v2 (the 2.1 or the V2.5 line).

    Returns:
        The ``deep_ep`` module.

    Raises:
        ImportError: If ``deep_ep`` is missing, fails its own import checks (DeepEP raises AssertionError for
            an NCCL mismatch, which is converted here), or has neither ``EPBuffer`` nor ``ElasticBuffer``; the
            message names what was found (v1's ``Buffer``, or another package's ``deep_ep``).
    """
    try:
        import deep_ep  # noqa: PLC0415 - optional dependency
    except ImportError as error:
        raise ImportError(f"deep_ep is not importable ({error}). {INSTALL_HINT}") from error
    except AssertionError as error:  # check_nccl_so(): duplicate or mismatched libnccl
        raise ImportError(f"deep_ep refused to import: {error}. {INSTALL_HINT}") from error
    if line_of_module(deep_ep) is None:
        raise ImportError(f"{_describe_deep_ep(deep_ep)} {INSTALL_HINT}")
    return deep_ep


def _describe_deep_ep(deep_ep: Any) -> str:
    """Says what a ``deep_ep`` without a DeepEP v2 buffer is, from what it exports."""
    version = getattr(deep_ep, "__version__", "of unknown version")
    where = getattr(deep_ep, "__file__", None) or "an unknown location"
    if hasattr(deep_ep, "Buffer"):
        return (f"deep_ep {version} (from {where}) has Buffer but neither ElasticBuffer (DeepEP 2.1) nor EPBuffer "
                "(V2.5): it is DeepEP v1 (or HybridEP, which installs a module of the same name).")
    found = sorted(name for name in vars(deep_ep) if not name.startswith("_"))
    return (f"deep_ep {version} (from {where}) has neither ElasticBuffer (DeepEP 2.1) nor EPBuffer (V2.5) nor Buffer "
            f"(v1); it exports {found[:12]}. Another package may own the name deep_ep (HybridEP installs one too).")


@functools.lru_cache(maxsize=1)
def deepep_unavailable_reason() -> Optional[str]:
    """Why DeepEP v2 cannot run in this process, or None (computed once)."""
    if not torch.cuda.is_available():
        return f"no CUDA device is visible. {INSTALL_HINT}"
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return f"DeepEP v2 needs an SM90 (Hopper) or SM100 GPU; this one is SM{major}x. {INSTALL_HINT}"
    nccl = runtime_nccl_version()
    if nccl is not None and nccl < DEEPEP_2_1.min_nccl:
        return f"PyTorch loaded NCCL {version_text(nccl)}; DeepEP v2 needs >= 2.30.4. {INSTALL_HINT}"
    try:
        line = line_of_module(import_deep_ep())
    except ImportError as error:
        return str(error)
    if nccl is not None and nccl < line.min_nccl:
        return (f"PyTorch loaded NCCL {version_text(nccl)}; DeepEP {line.name} ({line.buffer_class}) needs >= "
                f"{version_text(line.min_nccl)}. {INSTALL_HINT}")
    return None


#: What deterministic mode uses of DeepEP's ``EPHandle``, with host sync (DeepEP's own sort) and without (the metadata
#: :mod:`.receive_order` reads; constructor arguments; the layout of each is checked there).
HANDLE_ORDER_NEEDS = {True: ("deterministic_sort",),
                      False: ("recv_src_metadata", "psum_num_recv_tokens_per_scaleup_rank",
                              "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert",
                              "channel_linked_list")}


def handle_order_unavailable_reason(host_sync: bool) -> Optional[str]:
    """Why the installed DeepEP's dispatch handle cannot order received rows deterministically, with or without
    ``host_sync``, or None when it can (also when ``deep_ep`` is missing: :func:`deepep_unavailable_reason` says so).

    The handle class is the ``EPHandle`` of the module that defines the buffer class; what it exposes is its
    constructor's parameters and its attributes (:data:`HANDLE_ORDER_NEEDS`).
    """
    try:
        deep_ep = import_deep_ep()
    except ImportError:
        return None
    buffer_class = getattr(deep_ep, line_of_module(deep_ep).buffer_class)
    handle_class = getattr(sys.modules.get(buffer_class.__module__), "EPHandle", None)
    if handle_class is None:
        return (f"deep_ep has no EPHandle next to {buffer_class.__qualname__}, so its handle's layout is unknown: "
                "install DeepEP 2.1.0 or V2.5.")
    try:
        exposed = set(inspect.signature(handle_class).parameters)
    except (TypeError, ValueError):  # a compiled class: only its attributes are known
        exposed = set()
    exposed |= set(dir(handle_class))
    missing = [name for name in HANDLE_ORDER_NEEDS[host_sync] if name not in exposed]
    if not missing:
        return None
    return (f"deep_ep {getattr(deep_ep, '__version__', '(unknown version)')}'s {handle_class.__module__}.EPHandle "
            f"does not expose {', '.join(missing)} (DeepEP 2.1.0 and V2.5 do): install one of them.")


def mapped_nccl_libraries() -> list[str]:
    """Paths of the ``libnccl`` files mapped into this process (from ``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({line.split()[-1] for line in maps if "libnccl" in line and "/" in line})
    except OSError:
        return []


def runtime_nccl_version() -> Optional[tuple[int, int, int]]:
    """Version of the NCCL library actually loaded, asked from the library itself (``ncclGetVersion``).

    ``torch.cuda.nccl.version()`` reports the NCCL PyTorch was compiled against, which differs when the
    runtime library was replaced (as DeepEP v2 setups do to get NCCL >= 2.30.4).

    Returns:
        ``(major, minor, patch)``, or None when no NCCL is loaded or it cannot be asked.
    """
    for path in mapped_nccl_libraries():
        try:
            code = ctypes.c_int()
            if ctypes.CDLL(path).ncclGetVersion(ctypes.byref(code)) != 0:
                continue
        except (OSError, AttributeError):
            continue
        value = code.value  # NCCL >= 2.9: major * 10000 + minor * 100 + patch
        return value // 10000, (value % 10000) // 100, value % 100
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - torch without NCCL raises various errors
        return None
    return tuple(version) if isinstance(version, tuple) else None
