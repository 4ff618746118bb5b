"""Small ``torch.distributed`` helpers shared by the buffer lifecycle, validation and backends."""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Returns the device whose tensors collectives over ``group`` take (CUDA for NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_group_sizes: dict[dist.ProcessGroup, int] = {}


def group_size(group: dist.ProcessGroup) -> int:
    """``dist.get_world_size(group)``, asked once per group (the call costs tens of microseconds per dispatch)."""
    size = _group_sizes.get(group)
    if size is None:
        size = _group_sizes[group] = dist.get_world_size(group)
    return size


def all_reduce_max(values: Sequence[int], group: dist.ProcessGroup) -> list[int]:
    """Element-wise maximum of integer vectors over ``group`` (one small all-reduce, a host sync).

    Args:
        values: This rank's integers; every rank passes the same length.
        group: Process group.

    Returns:
        The element-wise maxima, the same on every rank.
    """
    tensor = torch.tensor(list(values), dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def next_power_of_two(value: int) -> int:
    """Smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()


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
