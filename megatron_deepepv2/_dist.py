"""Facts of a ``torch.distributed`` process group asked on the hot path, each asked once per group."""

from __future__ import annotations

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


def next_power_of_two(value: int) -> int:
    """Smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (int(value) - 1).bit_length()
