"""FP8 dispatch: the hidden states travel as e4m3 with one float scale per 128 values (DeepSeek-V3's recipe).

The sending rank quantises its BF16 rows (:func:`quantize_e4m3_1x128`), the dispatch moves the ``(fp8, scales)``
pair -- about half the bytes of BF16 -- and the receiving rank hands the experts BF16 rows again
(:func:`dequantize_e4m3_1x128`). The combine and every backward stay BF16: the quantisation is a straight-through
estimator for ``x`` (its gradient is the BF16 combine of the received rows' gradient, exactly as without FP8), and
routing weights get exact gradients. :mod:`megatron_deepepv2.ops` applies both ends inside the dispatch's autograd
function when the dispatch configuration's ``fp8_dispatch`` is on (the ``fp8_dispatch`` setting,
``MEGATRON_DEEPEPV2_FP8_DISPATCH=1``).

Scales are ``amax / 448`` per block of 128 values of a row (448 is e4m3's largest finite value), with the block's
amax floored at ``1e-4`` so that an all-zero block gets a finite scale and zero values.

On CUDA each end is one fused Triton kernel (no host sync, no temporaries): the quantiser reads the BF16 rows once
and writes the e4m3 values and the scales; the dequantiser reads the pair once and writes the BF16 rows, zeroing
rows past the valid count and treating non-finite scales as zero in the same pass. Both are bitwise equal to the
PyTorch formulation they replace (:func:`quantize_e4m3_1x128_torch` / :func:`dequantize_e4m3_1x128_torch`, used on
the CPU and as the tests' oracle): both divide with IEEE rounding (scale = amax / 448, value / scale), and the e4m3
cast rounds to nearest even as PyTorch's does for values within e4m3's range (all are, by construction).
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_deepepv2.layout import rows_past_valid
from megatron_deepepv2.kernels import AVAILABLE as TRITON_AVAILABLE
from megatron_deepepv2.kernels import tl, triton

#: Values per scale.
BLOCK = 128
#: e4m3's largest finite value.
E4M3_MAX = 448.0
#: Smallest block amax a scale is computed from (an all-zero block would otherwise divide by zero).
AMAX_FLOOR = 1e-4


#: Scale blocks per Triton program (a [blocks, 128] tile of one row) and rows per program.
_KERNEL_BLOCKS = 8
_KERNEL_ROWS = 4


if TRITON_AVAILABLE:

    @triton.jit
    def _row_tile(num_blocks, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        """This program's scale blocks of a row, which of them exist, and their columns (``[BLOCKS, BLOCK_SIZE]``)."""
        blocks = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
        return blocks, blocks < num_blocks, blocks[:, None] * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)[None, :]

    @triton.jit
    def _quantize_kernel(x_ptr, q_ptr, scales_ptr, num_rows, num_blocks, x_row_stride, q_row_stride,
                         scales_row_stride, AMAX_MIN: tl.constexpr, FP8_MAX: tl.constexpr,
                         ROWS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        blocks, block_ok, cols = _row_tile(num_blocks, BLOCKS, BLOCK_SIZE)
        for r in tl.static_range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            mask = block_ok & (row < num_rows)
            x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask[:, None], other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(x), axis=1)
            scale = tl.math.div_rn(tl.maximum(amax, AMAX_MIN), FP8_MAX)
            q = tl.math.div_rn(x, scale[:, None]).to(q_ptr.dtype.element_ty)
            tl.store(q_ptr + row * q_row_stride + cols, q, mask=mask[:, None])
            tl.store(scales_ptr + row * scales_row_stride + blocks, scale, mask=mask)

    @triton.jit
    def _dequantize_kernel(q_ptr, scales_ptr, out_ptr, num_valid_ptr, num_rows, num_blocks, q_row_stride,
                           scales_row_stride, scales_col_stride, out_row_stride, HAS_NUM_VALID: tl.constexpr,
                           ROWS: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
        num_valid = num_rows
        if HAS_NUM_VALID:
            num_valid = tl.load(num_valid_ptr).to(tl.int64)
        blocks, block_ok, cols = _row_tile(num_blocks, BLOCKS, BLOCK_SIZE)
        for r in tl.static_range(ROWS):
            row = tl.program_id(0).to(tl.int64) * ROWS + r
            mask = block_ok & (row < num_rows)
            # Rows past the valid count were never written: skip their loads and write zeros.
            load_mask = mask & (row < num_valid)
            scale = tl.load(scales_ptr + row * scales_row_stride + blocks * scales_col_stride, mask=load_mask,
                            other=0.0)
            scale = tl.where((scale == scale) & (tl.abs(scale) < float("inf")), scale, 0.0)  # non-finite: 0
            q = tl.load(q_ptr + row * q_row_stride + cols, mask=load_mask[:, None], other=0.0).to(tl.float32)
            out = q * scale[:, None]
            tl.store(out_ptr + row * out_row_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask[:, None])


def _fused(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for ``x`` (CUDA, Triton importable, rows contiguous)."""
    return TRITON_AVAILABLE and x.is_cuda and x.dim() == 2 and x.stride(1) == 1


def quantize_e4m3_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantises ``[T, H]`` BF16 rows to e4m3 with one fp32 scale per 128 values.

    One fused kernel on CUDA; :func:`quantize_e4m3_1x128_torch` elsewhere (the same bits).

    Args:
        x: ``[T, H]`` hidden states with contiguous rows, ``H`` a multiple of 128.

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32)``, both contiguous.
    """
    if not _fused(x):
        return quantize_e4m3_1x128_torch(x)
    num_rows, hidden = x.shape
    num_blocks = hidden // BLOCK
    x_fp8 = torch.empty((num_rows, hidden), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=x.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, _KERNEL_ROWS), triton.cdiv(num_blocks, _KERNEL_BLOCKS))
        _quantize_kernel[grid](x, x_fp8, scales, num_rows, num_blocks, x.stride(0), x_fp8.stride(0),
                               scales.stride(0), AMAX_MIN=AMAX_FLOOR, FP8_MAX=E4M3_MAX, ROWS=_KERNEL_ROWS,
                               BLOCKS=_KERNEL_BLOCKS, BLOCK_SIZE=BLOCK)
    return x_fp8, scales


def dequantize_e4m3_1x128(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          num_valid_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BF16 rows back from a received ``(x_fp8, scales)`` pair.

    One fused kernel on CUDA; :func:`dequantize_e4m3_1x128_torch` elsewhere (the same bits).

    Args:
        x_fp8: ``[N, H]`` float8_e4m3fn rows.
        scales: ``[N, H / 128]`` fp32 scales (non-finite ones, of rows nobody wrote, count as zero).
        dtype: Output dtype.
        num_valid_rows: Without host sync, the rows holding data (a 1-element device tensor): rows past it were
            never written, so they come back as zeros whatever their bytes (garbage scales could make them NaN).

    Returns:
        ``[N, H]`` rows of ``dtype``.
    """
    if not _fused(x_fp8):
        return dequantize_e4m3_1x128_torch(x_fp8, scales, dtype, num_valid_rows)
    num_rows, hidden = x_fp8.shape
    num_blocks = hidden // BLOCK
    out = torch.empty((num_rows, hidden), dtype=dtype, device=x_fp8.device)
    if num_rows:
        grid = (triton.cdiv(num_rows, _KERNEL_ROWS), triton.cdiv(num_blocks, _KERNEL_BLOCKS))
        _dequantize_kernel[grid](x_fp8, scales, out, num_valid_rows if num_valid_rows is not None else scales,
                                 num_rows, num_blocks, x_fp8.stride(0), scales.stride(0), scales.stride(1),
                                 out.stride(0), HAS_NUM_VALID=num_valid_rows is not None, ROWS=_KERNEL_ROWS,
                                 BLOCKS=_KERNEL_BLOCKS, BLOCK_SIZE=BLOCK)
    return out


def quantize_e4m3_1x128_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_e4m3_1x128` in PyTorch ops (any device; several kernels on CUDA)."""
    blocks = x.float().view(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1).clamp_(min=AMAX_FLOOR)
    # A true division on every device: PyTorch's CUDA kernels divide by a Python scalar as a multiplication by its
    # reciprocal, which rounds differently from the CPU (and from the fused kernel) in the last bit.
    scales = amax / torch.full_like(amax, E4M3_MAX)
    x_fp8 = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(x.shape)
    return x_fp8, scales


def dequantize_e4m3_1x128_torch(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                                num_valid_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`dequantize_e4m3_1x128` in PyTorch ops (any device; several kernels on CUDA)."""
    # Padding rows arrive as zeros, but their scales may never have been written: a non-finite one would turn the
    # zeros into NaNs, which reach the expert weight gradients (padding rows get zero gradients, and 0 * NaN = NaN).
    scales = torch.nan_to_num(scales, nan=0.0, posinf=0.0, neginf=0.0)
    rows = x_fp8.float().view(x_fp8.shape[0], x_fp8.shape[1] // BLOCK, BLOCK) * scales.unsqueeze(-1)
    if num_valid_rows is not None:
        rows = rows.masked_fill(rows_past_valid(rows.shape[0], num_valid_rows).view(-1, 1, 1), 0.0)
    return rows.view(x_fp8.shape).to(dtype)
