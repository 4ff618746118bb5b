"""The rules on dispatch and combine inputs, each written once, each error naming the
argument, its value and the fix; all run before any communication (a rank raising inside a collective would leave its
peers waiting). The rules on settings and dispatch configurations are theirs, run when they are built
(:meth:`~megatron_deepepv2.config.DeepepV2Settings.check`,
:meth:`~megatron_deepepv2.backends.base.DispatchConfig.check`); a Megatron configuration's are
:mod:`megatron_deepepv2.mcore.megatron_config`'s.

Naming: ``check_*`` raises; ``*_problem`` returns the exception to raise, or None; ``*_error`` builds one exception.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch

from megatron_deepepv2.fp8 import BLOCK as FP8_BLOCK
from megatron_deepepv2.layout import split_hidden

if TYPE_CHECKING:
    from megatron_deepepv2.backends.base import BackendLimits, DispatchHandle
    from megatron_deepepv2.layout import HiddenStates

_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    """``dtypes`` for a message: ``"bfloat16, float32"``."""
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_binding(num_experts: int, group_size: int) -> None:
    """Checks that every rank of a group of ``group_size`` ranks hosts the same number of experts.

    Args:
        num_experts: Global number of experts.
        group_size: Ranks of the expert-parallel group.

    Raises:
        ValueError: If ``num_experts`` is not a positive multiple of ``group_size``.
    """
    if not isinstance(num_experts, int) or num_experts <= 0 or num_experts % group_size:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the expert-parallel group size "
                         f"{group_size} so that every rank hosts the same number of experts.")


def fp8_hidden_size_problem(hidden: int) -> Optional[ValueError]:
    """A ValueError when ``hidden`` is not a multiple of FP8 dispatch's 128-value scale block, else None."""
    if hidden % FP8_BLOCK:
        return ValueError(f"FP8 dispatch scales blocks of {FP8_BLOCK} values: hidden size {hidden} is not a multiple "
                          f"of {FP8_BLOCK}. Turn FP8 dispatch off (MEGATRON_DEEPEPV2_FP8_DISPATCH=0) for this model.")
    return None


def host_sync_capture_error() -> RuntimeError:
    """Returns the error of a dispatch with host sync inside CUDA-graph capture."""
    return RuntimeError(
        "deepepv2 dispatch with host sync inside CUDA-graph capture: the dispatch waits on the host for sizes that "
        "captured kernels never produce (the backend would wait until its timeout). Capture dispatches without "
        "host sync: host_sync=False, or MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 for Megatron layers.")


def dispatch_inputs_problem(x: "HiddenStates", topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], *,
                            limits: "BackendLimits", fp8_dispatch: bool = False,
                            num_max_tokens_per_rank: Optional[int] = None) -> Optional[Exception]:
    """Checks the static properties of dispatch arguments (types, dtypes, shapes, devices; the ids' values are
    :mod:`megatron_deepepv2.expert_ids`'s) against the backend's ``limits``, FP8 dispatch and the token limit.

    Args:
        x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])``.
        topk_idx: ``[T, K]`` int64 global expert ids.
        topk_weights: ``[T, K]`` fp32 weights, or None.
        limits: The backend's static limits.
        fp8_dispatch: Whether the dispatch quantises ``x`` (which must then be BF16, ``H % 128 == 0``).
        num_max_tokens_per_rank: The configured token limit, or None.

    Returns:
        A ``TypeError`` or ``ValueError`` describing the first problem, or None when all is well.
    """
    problem = _hidden_problem(x, limits, fp8_dispatch)
    if problem is None:
        data = split_hidden(x)[0]
        problem = _routing_problem(data, topk_idx, topk_weights, limits)
    if problem is None and num_max_tokens_per_rank is not None and topk_idx.shape[0] > num_max_tokens_per_rank:
        problem = ValueError(f"This rank dispatches {topk_idx.shape[0]} tokens but num_max_tokens_per_rank="
                             f"{num_max_tokens_per_rank}. Raise num_max_tokens_per_rank "
                             "(MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK) to at least the largest per-rank token count; "
                             "it must be the same on every rank.")
    return problem


def _hidden_problem(x: "HiddenStates", limits: "BackendLimits", fp8_dispatch: bool) -> Optional[Exception]:
    """The first problem of a dispatch's hidden states (see :func:`dispatch_inputs_problem`), or None."""
    is_fp8 = isinstance(x, tuple)
    if is_fp8 and (len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x)):  # split_hidden's test, first
        return TypeError(f"x must be a tensor [T, H] or an FP8 pair (x_fp8 [T, H], scales [T, S]); got a tuple of "
                         f"{len(x)} item(s) of types {[type(t).__name__ for t in x]}.")
    if not is_fp8 and not isinstance(x, torch.Tensor):
        return TypeError(f"x must be a torch.Tensor [T, H] or an FP8 pair; got {type(x).__name__}.")
    if fp8_dispatch and is_fp8:
        return TypeError("FP8 dispatch quantises BF16 hidden states itself; pass the BF16 tensor, not an FP8 pair "
                         "(or turn FP8 dispatch off to pass pairs through).")
    data, scales = split_hidden(x)
    if data.dim() != 2:
        return ValueError(f"x must be 2-D [num_tokens, hidden]; got shape {tuple(data.shape)}. Flatten leading dims "
                          "with x.view(-1, hidden).")
    num_tokens, hidden = data.shape
    if fp8_dispatch and data.dtype != torch.bfloat16:
        return TypeError(f"FP8 dispatch quantises BF16 hidden states; got {data.dtype}. Train in BF16 (--bf16) or turn "
                         "FP8 dispatch off (MEGATRON_DEEPEPV2_FP8_DISPATCH=0).")
    if fp8_dispatch and hidden % FP8_BLOCK:
        return fp8_hidden_size_problem(hidden)
    if is_fp8 and data.dtype not in _FP8_DTYPES:
        return TypeError(f"x[0] of an FP8 pair must have an FP8 dtype ({_dtype_names(_FP8_DTYPES)}); got {data.dtype}.")
    if is_fp8 and (scales.dim() != 2 or scales.shape[0] != num_tokens or scales.element_size() != 4):
        return ValueError(f"FP8 scales must be [T={num_tokens}, S] with 4-byte elements (fp32 scales or packed UE8M0 "
                          f"int32); got shape {tuple(scales.shape)} dtype {scales.dtype}.")
    if is_fp8 and hidden % limits.fp8_hidden_multiple:
        return ValueError(f"FP8 dispatch needs hidden % {limits.fp8_hidden_multiple} == 0; got hidden={hidden}. Pad "
                          "the hidden size or dispatch in BF16.")
    if not is_fp8 and data.dtype not in limits.dispatch_dtypes:
        return TypeError(f"x has dtype {data.dtype}; this backend dispatches {_dtype_names(limits.dispatch_dtypes)} "
                         "(or an FP8 pair). Cast it, e.g. x.to(torch.bfloat16).")
    if hidden % limits.combine_hidden_multiple:
        return ValueError(f"hidden={hidden} is not a multiple of {limits.combine_hidden_multiple}, which this "
                          "backend's combine (also run by dispatch backward) requires. Use a hidden size that is a "
                          f"multiple of {limits.combine_hidden_multiple}, or a backend without this rule.")
    if limits.requires_cuda and not data.is_cuda:
        return ValueError(f"x is on {data.device}; this backend needs CUDA tensors. Move inputs with .cuda().")
    return None


def _routing_problem(data: torch.Tensor, topk_idx: Any, topk_weights: Any,
                     limits: "BackendLimits") -> Optional[Exception]:
    """The first problem of a dispatch's routing for the ``[T, H]`` rows ``data`` (see
    :func:`dispatch_inputs_problem`), or None."""
    num_tokens = data.shape[0]
    if not isinstance(topk_idx, torch.Tensor):
        return TypeError(f"topk_idx must be a torch.Tensor [T, K]; got {type(topk_idx).__name__}.")
    if topk_idx.dtype != torch.int64:
        return TypeError(f"topk_idx has dtype {topk_idx.dtype}; it must be int64. Convert with topk_idx.long().")
    if topk_idx.dim() != 2 or topk_idx.shape[0] != num_tokens:
        return ValueError(f"topk_idx must be [T={num_tokens}, K] to match x; got shape {tuple(topk_idx.shape)}.")
    if not 1 <= topk_idx.shape[1] <= limits.max_topk:
        return ValueError(f"top-k={topk_idx.shape[1]} is out of range; this backend supports 1 <= K <= "
                          f"{limits.max_topk}.")
    if topk_idx.device != data.device:
        return ValueError(f"topk_idx is on {topk_idx.device} but x is on {data.device}; put both on one device.")
    if topk_weights is not None:
        if not isinstance(topk_weights, torch.Tensor):
            return TypeError(f"topk_weights must be a torch.Tensor or None; got {type(topk_weights).__name__}.")
        if topk_weights.dtype != torch.float32:
            return TypeError(f"topk_weights has dtype {topk_weights.dtype}; it must be float32. Convert with "
                             "topk_weights.float() (Megatron: --moe-router-dtype fp32).")
        if tuple(topk_weights.shape) != tuple(topk_idx.shape):
            return ValueError(f"topk_weights has shape {tuple(topk_weights.shape)}; it must match topk_idx "
                              f"{tuple(topk_idx.shape)}.")
        if topk_weights.device != data.device:
            return ValueError(f"topk_weights is on {topk_weights.device} but x is on {data.device}.")
    return None


def not_a_handle_error(handle: Any) -> TypeError:
    """Returns the error of a combine given ``handle``, something else than a dispatch's handle."""
    return TypeError(f"handle must be the DispatchHandle returned by dispatch; got {type(handle).__name__}.")


def combine_inputs_problem(x: torch.Tensor, handle: "DispatchHandle") -> Optional[Exception]:
    """Checks combine arguments against the handle of the dispatch being reversed (its backend's limits apply).

    Args:
        x: ``[handle.num_recv_rows, H]`` rows in one of the backend's combine dtypes.
        handle: The dispatch's handle.

    Returns:
        A ``TypeError`` or ``ValueError`` describing the first problem, or None.
    """
    limits, rows = handle.buffer.limits, handle.num_recv_rows
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        return ValueError(f"combine input must be a 2-D tensor [rows, hidden]; got {shape}.")
    if x.shape[0] != rows:
        return ValueError(f"combine input has {x.shape[0]} rows but the dispatch delivered {rows} "
                          f"({handle.config.layout.value} layout); pass rows in the dispatch's receive layout.")
    if x.dtype not in limits.combine_dtypes:
        return TypeError(f"combine input has dtype {x.dtype}; this backend combines "
                         f"{_dtype_names(limits.combine_dtypes)}. Cast with .to(torch.bfloat16).")
    if x.shape[1] % limits.combine_hidden_multiple:
        return ValueError(f"combine hidden={x.shape[1]} is not a multiple of {limits.combine_hidden_multiple}, which "
                          "this backend requires.")
    return None

