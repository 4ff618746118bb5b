"""The DeepEP release lines this package knows, what each needs, and how to tell them apart.

Two lines provide the expert-parallel buffer the backends drive:

* **2.1** (``deep_ep.ElasticBuffer``, the 2.1.0 release): NCCL >= 2.30.4 at build and run time, NVSHMEM at
  build time (its legacy v1 kernels), nvcc at run time for the JIT.
* **V2.5** (``deep_ep.EPBuffer``, DeepEP main since 2026-09-29): NCCL >= 2.32.3, nvcc >= 13.1 for its JIT (the
  DeepJIT submodule, cache in ``$HOME/.dj``); no NVSHMEM, no v1 ``Buffer``.

A ``deep_ep`` that exports only ``Buffer`` is DeepEP v1 (or HybridEP, which installs a module of the same name).
The doctor, the installer and the backend's import check all ask this module, so the requirements live in one place;
:func:`import_deep_ep` and :func:`deepep_unavailable_reason` are the backend's import and availability checks, and
:func:`handle_order_unavailable_reason` says whether the installed handle allows deterministic mode. What every DeepEP
buffer and call needs of PyTorch is here too: :func:`ensure_nccl_communicator` before a build, :func:`fill_guard`
around each call.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2.groups import collective_device

Version = tuple[int, ...]
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepEPLine:
    """One DeepEP release line, its requirements, and how the backend's calls differ on it.

    Attributes:
        name: The line's name as users know it (``"2.1"``, ``"V2.5"``).
        buffer_class: The ``deep_ep`` attribute of its expert-parallel buffer.
        min_nccl: The oldest NCCL it builds and runs with.
        min_nvcc: The oldest nvcc its JIT accepts, or None when any CUDA 12.3+ toolkit does.
        needs_nvshmem: Whether its build needs NVSHMEM.
        dispatch_kwargs: Keyword arguments every dispatch passes on this line.
        even_num_sms: An explicit SM count is rounded up to even.
        keeps_topk_idx: The handle keeps the caller's ``topk_idx``, not a copy.
        ran_on_gpu: Whether this package has run on a GPU with the line (else a WARNING once per process).
    """

    name: str
    buffer_class: str
    min_nccl: Version
    min_nvcc: Optional[Version]
    needs_nvshmem: bool
    dispatch_kwargs: tuple[tuple[str, Any], ...] = ()
    even_num_sms: bool = False
    keeps_topk_idx: bool = False
    ran_on_gpu: bool = True

    def num_sms(self, requested: int) -> int:
        """Returns the SM count the line runs with for ``requested`` (0 = DeepEP's choice)."""
        return requested + (requested % 2) if self.even_num_sms else requested


DEEPEP_2_1 = DeepEPLine(name="2.1", buffer_class="ElasticBuffer", min_nccl=(2, 30, 4), min_nvcc=None,
                        needs_nvshmem=True)
DEEPEP_2_5 = DeepEPLine(name="V2.5", buffer_class="EPBuffer", min_nccl=(2, 32, 3), min_nvcc=(13, 1),
                        needs_nvshmem=False, dispatch_kwargs=(("do_handle_copy", False),), even_num_sms=True,
                        keeps_topk_idx=True, ran_on_gpu=False)
#: Newest first: a module exporting both buffers is taken as the newer line.
LINES = (DEEPEP_2_5, DEEPEP_2_1)


#: The paths a buffer build can take that have never run on a GPU with this package, each warned about once per
#: process when taken.
NEVER_RUN = {
    "line": "DeepEP {line}'s {buffer_class} has never run on a GPU with megatron-deepepv2 (it is tested on CPU against "
            "a stand-in written from its sources): compare the first steps with a run you trust (e.g. "
            "MEGATRON_DEEPEPV2_BACKEND=reference or the alltoall dispatcher) before relying on it",
    "hybrid": "DeepEP's hybrid mode (a group across nodes, RDMA x NVLink) has never run on a GPU with "
              "megatron-deepepv2 (its choice is tested over gloo ranks): compare the first steps with a run you trust "
              "before relying on it",
}
_warned_never_run: set[str] = set()


def log_buffer_built(line: DeepEPLine, hybrid: bool, why: str) -> None:
    """Logs the buffer a backend built (its line, class and mode, and why that mode) and, once per process, a WARNING
    for each path of :data:`NEVER_RUN` the build took.

    Args:
        line: The DeepEP line of the buffer.
        hybrid: Whether the buffer runs in hybrid mode.
        why: Why that mode, for the log.
    """
    logger.info("DeepEP %s %s: %s mode (%s)", line.name, line.buffer_class, "hybrid (RDMA x NVLink)" if hybrid
                else "direct", why)
    for path, taken in (("line", not line.ran_on_gpu), ("hybrid", hybrid)):
        if taken and path not in _warned_never_run:
            _warned_never_run.add(path)
            logger.warning(NEVER_RUN[path].format(line=line.name, buffer_class=line.buffer_class))


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


def ensure_nccl_communicator(group: dist.ProcessGroup) -> None:
    """Makes PyTorch create the NCCL communicator of ``group`` (the expert-parallel group) now, by one all-reduce:
    DeepEP reuses it (``EP_REUSE_NCCL_COMM=1``, its default) and segfaults on the null pointer of a lazy one."""
    probe = torch.zeros(1, device=collective_device(group))
    dist.all_reduce(probe, group=group)


class _FillOff:
    """Turns ``torch.utils.deterministic.fill_uninitialized_memory`` off for a block, then restores it."""

    def __enter__(self) -> None:
        self.was_fill = torch.utils.deterministic.fill_uninitialized_memory
        torch.utils.deterministic.fill_uninitialized_memory = False

    def __exit__(self, *exc_info: Any) -> None:
        torch.utils.deterministic.fill_uninitialized_memory = self.was_fill


_FILL_OFF, _NO_GUARD = _FillOff(), contextlib.nullcontext()


def fill_guard() -> contextlib.AbstractContextManager:
    """The context of every DeepEP call: the fill off while deterministic algorithms are on, as DeepEP asserts (the
    fill kernels could overlap its communication; nothing here reads uninitialised rows); else nothing."""
    return _FILL_OFF if torch.are_deterministic_algorithms_enabled() else _NO_GUARD
