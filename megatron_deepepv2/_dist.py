"""Small ``torch.distributed`` helpers shared by the buffer lifecycle, validation and backends."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def collective_device(group: dist.ProcessGroup) -> torch.device:
    """Returns the device whose tensors collectives over ``group`` take (CUDA for NCCL, else CPU)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
