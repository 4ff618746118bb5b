"""The experts' fused activation kernels: row-bounded, elementwise (Triton, CUDA only).

The experts' input can be the worst-case receive buffer of the no-host-sync mode: expert blocks first, then
rows no expert owns. The grouped GEMMs stop at the last expert block by themselves (``offs``); these kernels
do the same for the elementwise work between them. Each reads the row count of the blocks from the device
(``offsets[-1]``) and returns at once for rows past it, so their cost follows the rows in use, not the
buffer, and nothing reads the count on the host.

* :func:`activation_probs_forward` / :func:`activation_probs_backward`: the expert activation
  (:class:`FusedActivation`: SiLU, quick GELU or GELU, gated or not; gated with Megatron's clamp and linear offset,
  which GPT-OSS-style models use) times the router probability of each row, forward and backward (input gradient
  and probability gradient) in one pass each, computed in FP32.

Zeroing the rows past the blocks is :func:`megatron_deepepv2.kernels.zero_rows_from`, which a dispatch uses too, and
:data:`megatron_deepepv2.kernels.AVAILABLE` says whether Triton imports; callers use these kernels for CUDA tensors
only.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from megatron_deepepv2.kernels import AVAILABLE, BLOCK_COLS, BLOCK_ROWS, check_rows, tl, triton

#: Activation codes of the kernels (``FusedActivation.kind``).
_ACTIVATION_CODES = {"silu": 0, "quick_gelu": 1, "gelu": 2}


@dataclasses.dataclass(frozen=True)
class FusedActivation:
    """An expert activation the fused kernels compute, as Megatron's ``MLP`` defines it.

    Non-gated: ``act(h)``. Gated (FC1 output ``[gate, up]``): ``act(gate') * (up' + linear_offset)`` with
    ``gate' = min(gate, clamp)`` and ``up' = clamp(up, -clamp, clamp)`` when ``clamp`` is set.

    Attributes:
        kind: ``"silu"`` (x * sigmoid(x)), ``"quick_gelu"`` (x * sigmoid(1.702 x)) or ``"gelu"`` (erf form).
        gated: Gated linear unit (FC1 produces twice the FFN width).
        clamp: Megatron's ``activation_func_clamp_value`` (gated only), or None.
        linear_offset: Megatron's ``glu_linear_offset`` (gated only).
    """

    kind: str
    gated: bool
    clamp: Optional[float] = None
    linear_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in _ACTIVATION_CODES:
            raise ValueError(f"unknown fused activation {self.kind!r}; one of {sorted(_ACTIVATION_CODES)}")
        if not self.gated and (self.clamp is not None or self.linear_offset):
            raise ValueError("clamp and linear_offset apply to gated activations only (as in Megatron's MLP)")


if AVAILABLE:

    @triton.jit
    def _activation_and_derivative(x, ACT: tl.constexpr):
        """``act(x)`` and ``act'(x)`` in FP32 for the activation code ``ACT``."""
        if ACT == 2:  # GELU, erf form
            cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
            return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * 0.3989422804014327
        alpha = 1.702 if ACT == 1 else 1.0
        sig = tl.sigmoid(alpha * x)
        return x * sig, sig + alpha * x * sig * (1.0 - sig)

    @triton.jit
    def _activation_probs_forward_kernel(
        fc1_ptr, probs_ptr, out_ptr, total_ptr, ffn, fc1_row_stride, out_row_stride, clamp, linear_offset,
        ACT: tl.constexpr, GATED: tl.constexpr, HAS_CLAMP: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        total = tl.load(total_ptr).to(tl.int64)
        first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
        if first_row >= total:
            return
        rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < total
        mask = row_ok[:, None] & (cols[None, :] < ffn)
        gate_ptrs = fc1_ptr + rows[:, None] * fc1_row_stride + cols[None, :]
        gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
        prob = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if GATED:
            up = tl.load(gate_ptrs + ffn, mask=mask, other=0.0).to(tl.float32)
            if HAS_CLAMP:
                gate = tl.minimum(gate, clamp)
                up = tl.minimum(tl.maximum(up, -clamp), clamp)
            act, _ = _activation_and_derivative(gate, ACT)
            act = act * (up + linear_offset)
        else:
            act, _ = _activation_and_derivative(gate, ACT)
        act = act * prob[:, None]
        tl.store(out_ptr + rows[:, None] * out_row_stride + cols[None, :], act.to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _activation_probs_backward_kernel(
        grad_ptr, fc1_ptr, probs_ptr, grad_fc1_ptr, grad_probs_ptr, total_ptr, num_rows, ffn,
        grad_row_stride, fc1_row_stride, clamp, linear_offset, ACT: tl.constexpr, GATED: tl.constexpr,
        HAS_CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        total = tl.load(total_ptr).to(tl.int64)
        first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
        rows = first_row + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < total
        grad_prob = tl.zeros((BLOCK_M,), dtype=tl.float32)
        if first_row < total:
            prob = tl.load(probs_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            for start in range(0, ffn, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                mask = row_ok[:, None] & (cols[None, :] < ffn)
                grad = tl.load(grad_ptr + rows[:, None] * grad_row_stride + cols[None, :], mask=mask,
                               other=0.0).to(tl.float32)
                gate_ptrs = fc1_ptr + rows[:, None] * fc1_row_stride + cols[None, :]
                gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
                grad_act = grad * prob[:, None]
                out_ptrs = grad_fc1_ptr + rows[:, None] * fc1_row_stride + cols[None, :]
                if GATED:
                    up = tl.load(gate_ptrs + ffn, mask=mask, other=0.0).to(tl.float32)
                    gate_used = gate
                    up_used = up
                    if HAS_CLAMP:  # clamp passes the gradient where the input is within its bounds
                        gate_used = tl.minimum(gate, clamp)
                        up_used = tl.minimum(tl.maximum(up, -clamp), clamp)
                    act, act_grad = _activation_and_derivative(gate_used, ACT)
                    linear = up_used + linear_offset
                    grad_prob += tl.sum(act * linear * grad, axis=1)
                    grad_gate = grad_act * linear * act_grad
                    grad_up = grad_act * act
                    if HAS_CLAMP:
                        grad_gate = tl.where(gate <= clamp, grad_gate, 0.0)
                        grad_up = tl.where((up >= -clamp) & (up <= clamp), grad_up, 0.0)
                    tl.store(out_ptrs, grad_gate.to(grad_fc1_ptr.dtype.element_ty), mask=mask)
                    tl.store(out_ptrs + ffn, grad_up.to(grad_fc1_ptr.dtype.element_ty), mask=mask)
                else:
                    act, act_grad = _activation_and_derivative(gate, ACT)
                    grad_prob += tl.sum(act * grad, axis=1)
                    tl.store(out_ptrs, (grad_act * act_grad).to(grad_fc1_ptr.dtype.element_ty), mask=mask)
        # One float per row, tail rows included: their probability gradient is zero.
        tl.store(grad_probs_ptr + rows, grad_prob, mask=rows < num_rows)


def _activation_args(activation: FusedActivation) -> dict:
    return dict(clamp=float(activation.clamp or 0.0), linear_offset=float(activation.linear_offset),
                ACT=_ACTIVATION_CODES[activation.kind], GATED=activation.gated,
                HAS_CLAMP=activation.clamp is not None, BLOCK_M=BLOCK_ROWS, BLOCK_N=BLOCK_COLS)


def activation_probs_forward(fc1_out: torch.Tensor, probs: torch.Tensor, total: torch.Tensor,
                             activation: FusedActivation) -> torch.Tensor:
    """``activation(fc1_out) * probs[:, None]`` for the rows before ``total``.

    Args:
        fc1_out: ``[N, F]`` FC1 output (``[N, 2F]``, gate columns first, for a gated activation), rows contiguous.
        probs: ``[N]`` fp32 router probability of each row.
        total: 1-element int tensor on the device: rows in the expert blocks.
        activation: What to compute.

    Returns:
        ``[N, F]`` in ``fc1_out``'s dtype; rows from ``total`` on are left unwritten.
    """
    check_rows("fc1_out", fc1_out)
    num_rows = fc1_out.shape[0]
    ffn = fc1_out.shape[1] // 2 if activation.gated else fc1_out.shape[1]
    out = torch.empty((num_rows, ffn), dtype=fc1_out.dtype, device=fc1_out.device)
    grid = (triton.cdiv(num_rows, BLOCK_ROWS), triton.cdiv(ffn, BLOCK_COLS))
    if num_rows:
        _activation_probs_forward_kernel[grid](
            fc1_out, probs, out, total, ffn, fc1_out.stride(0), out.stride(0), **_activation_args(activation),
        )
    return out


def activation_probs_backward(
    grad_out: torch.Tensor, fc1_out: torch.Tensor, probs: torch.Tensor, total: torch.Tensor,
    activation: FusedActivation,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`activation_probs_forward` for the rows before ``total``.

    Args:
        grad_out: ``[N, F]`` gradient of the forward output, rows contiguous.
        fc1_out: The forward input.
        probs: ``[N]`` fp32 probabilities.
        total: See :func:`activation_probs_forward`.
        activation: The forward's activation.

    Returns:
        The gradient of ``fc1_out`` (rows from ``total`` on unwritten) and ``[N]`` fp32 gradient of ``probs`` (zero
        from ``total`` on).
    """
    check_rows("grad_out", grad_out)
    check_rows("fc1_out", fc1_out)
    num_rows, ffn = grad_out.shape
    grad_fc1 = torch.empty_like(fc1_out)
    grad_probs = torch.empty((num_rows,), dtype=torch.float32, device=grad_out.device)
    if num_rows:
        _activation_probs_backward_kernel[(triton.cdiv(num_rows, BLOCK_ROWS),)](
            grad_out, fc1_out, probs, grad_fc1, grad_probs, total, num_rows, ffn, grad_out.stride(0),
            fc1_out.stride(0), **_activation_args(activation),
        )
    return grad_fc1, grad_probs
