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
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_deepepv2.backends.base import valid_rows_mask

#: Values per scale.
BLOCK = 128
#: e4m3's largest finite value.
E4M3_MAX = 448.0
#: Smallest block amax a scale is computed from (an all-zero block would otherwise divide by zero).
AMAX_FLOOR = 1e-4


def fp8_dispatch_problem(x: object) -> Optional[Exception]:
    """Why ``x`` cannot be dispatched in FP8, or None.

    Args:
        x: What the caller passed as hidden states.

    Returns:
        A TypeError (not a BF16 tensor: an FP8 pair is quantised already) or ValueError (hidden size), or None.
    """
    if not isinstance(x, torch.Tensor):
        return TypeError("FP8 dispatch quantises BF16 hidden states itself; pass the BF16 tensor, not an FP8 pair "
                         "(or turn FP8 dispatch off to pass pairs through).")
    if x.dtype != torch.bfloat16:
        return TypeError(f"FP8 dispatch quantises BF16 hidden states; got {x.dtype}. Train in BF16 (--bf16) or turn "
                         "FP8 dispatch off (MEGATRON_DEEPEPV2_FP8_DISPATCH=0).")
    return fp8_hidden_size_problem(x.shape[-1])


def fp8_hidden_size_problem(hidden: int) -> Optional[ValueError]:
    """A ValueError when ``hidden`` is not a multiple of the 128-value scale block, else None."""
    if hidden % BLOCK:
        return ValueError(f"FP8 dispatch scales blocks of {BLOCK} values: hidden size {hidden} is not a multiple of "
                          f"{BLOCK}. Turn FP8 dispatch off (MEGATRON_DEEPEPV2_FP8_DISPATCH=0) for this model.")
    return None


def quantize_e4m3_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantises ``[T, H]`` BF16 rows to e4m3 with one fp32 scale per 128 values.

    Args:
        x: ``[T, H]`` contiguous hidden states, ``H`` a multiple of 128.

    Returns:
        ``(x_fp8 [T, H] float8_e4m3fn, scales [T, H / 128] float32)``, both contiguous.
    """
    blocks = x.float().view(x.shape[0], -1, BLOCK)
    scales = blocks.abs().amax(dim=-1).clamp_(min=AMAX_FLOOR).div_(E4M3_MAX)
    x_fp8 = (blocks / scales.unsqueeze(-1)).to(torch.float8_e4m3fn).view(x.shape)
    return x_fp8, scales


def dequantize_e4m3_1x128(x_fp8: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          num_valid_rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """BF16 rows back from a received ``(x_fp8, scales)`` pair.

    Args:
        x_fp8: ``[N, H]`` float8_e4m3fn rows.
        scales: ``[N, H / 128]`` fp32 scales (non-finite ones, of rows nobody wrote, count as zero).
        dtype: Output dtype.
        num_valid_rows: Without host sync, the rows holding data (on the device): rows past it were never
            written, so they come back as zeros whatever their bytes (garbage scales could make them NaN).

    Returns:
        ``[N, H]`` rows of ``dtype``.
    """
    # Padding rows arrive as zeros, but their scales may never have been written: a non-finite one would turn the
    # zeros into NaNs, which reach the expert weight gradients (padding rows get zero gradients, and 0 * NaN = NaN).
    scales = torch.nan_to_num(scales, nan=0.0, posinf=0.0, neginf=0.0)
    rows = x_fp8.float().view(x_fp8.shape[0], -1, BLOCK) * scales.unsqueeze(-1)
    if num_valid_rows is not None:
        rows = torch.where(valid_rows_mask(rows.shape[0], num_valid_rows).view(-1, 1, 1), rows, 0.0)
    return rows.view(x_fp8.shape).to(dtype)
