"""The DeepEP release lines this package knows, what each needs, and how the backend's calls differ on them.

Two lines provide the expert-parallel buffer the backends drive:

* **2.1** (``deep_ep.ElasticBuffer``, the 2.1.0 release): NCCL >= 2.30.4 at build and run time, NVSHMEM at
  build time (its legacy v1 kernels), nvcc at run time for the JIT.
* **V2.5** (``deep_ep.EPBuffer``, DeepEP main since 2026-09-29): NCCL >= 2.32.3, nvcc >= 13.1 for its JIT (the
  DeepJIT submodule, cache in ``$HOME/.dj``); no NVSHMEM, no v1 ``Buffer``.

A ``deep_ep`` that exports only ``Buffer`` is DeepEP v1 (or HybridEP, which installs a module of the same name).
:data:`LINES` is the one table of these facts; the doctor, the installer and the backend's checks read it
(:mod:`.probes` asks what this process has installed). Plain data: this module imports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

Version = tuple[int, ...]


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


def line_of_module(deep_ep: Any) -> Optional[DeepEPLine]:
    """The line an imported ``deep_ep`` belongs to, from the buffer it exports (None: v1 or not DeepEP)."""
    for line in LINES:
        if hasattr(deep_ep, line.buffer_class):
            return line
    return None
