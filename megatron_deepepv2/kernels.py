"""The Triton import the package's kernels share, and the row-zeroing kernel a dispatch and the experts share (CUDA
only).

:data:`triton` and :data:`tl` are None where Triton does not import; :data:`AVAILABLE` says which. The FP8 quantiser
(:mod:`megatron_deepepv2.fp8`), the expert-id check (:mod:`megatron_deepepv2.expert_ids`) and the experts' kernels
(:mod:`megatron_deepepv2.mcore.expert_kernels`) write theirs over this import.

:func:`zero_rows_from` zeroes the rows past a count held on the device, writing only those rows and reading the count
on the device: a combine's input gradient without host sync (:mod:`megatron_deepepv2.ops`) and the experts' outputs
past their blocks use it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with every CUDA build of PyTorch on Linux
    triton = None
    tl = None

#: Whether Triton kernels can be used (for CUDA tensors).
AVAILABLE = triton is not None

#: The tile of the row-bounded kernels: rows and columns per program.
BLOCK_ROWS = 16
BLOCK_COLS = 256


if AVAILABLE:

    @triton.jit
    def _zero_rows_from_kernel(x_ptr, total_ptr, num_rows, num_cols, row_stride,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        total = tl.load(total_ptr).to(tl.int64)
        first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
        if first_row + BLOCK_M <= total:
            return
        rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = ((rows >= total) & (rows < num_rows))[:, None] & (cols[None, :] < num_cols)
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=x_ptr.dtype.element_ty)
        tl.store(x_ptr + rows[:, None] * row_stride + cols[None, :], zeros, mask=mask)


def check_rows(name: str, tensor: torch.Tensor) -> None:
    """Checks that ``tensor`` is 2-D with contiguous rows, as the row-bounded kernels read it.

    Raises:
        ValueError: Naming ``name``, its shape and its strides.
    """
    if tensor.dim() != 2 or tensor.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor with contiguous rows; got shape {tuple(tensor.shape)} "
                         f"and strides {tensor.stride()}.")


def zero_rows_from(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """Zeroes ``x[total:]`` in place, writing only those rows.

    Args:
        x: ``[N, C]`` CUDA tensor with contiguous rows.
        total: 1-element int tensor on the device.

    Returns:
        ``x``.
    """
    check_rows("x", x)
    num_rows, num_cols = x.shape
    if num_rows:
        grid = (triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(num_cols, BLOCK_COLS))
        _zero_rows_from_kernel[grid](x, total, num_rows, num_cols, x.stride(0), BLOCK_M=BLOCK_ROWS,
                                     BLOCK_N=BLOCK_COLS)
    return x
