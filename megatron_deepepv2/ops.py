"""Differentiable dispatch and combine: the bound :class:`Dispatcher` and one autograd Function per op (dispatch's
backward is a combine of the gradient, combine's a cached dispatch), which the Megatron manager and :func:`dispatch` /
:func:`combine` call. Every path that communicates passes its errors through
:func:`~megatron_deepepv2.failures.peer_failure`, so a peer raises naming the rank that failed first.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2 import buffers, expert_ids, expert_kernels, fp8, validation
from megatron_deepepv2._dist import group_size
from megatron_deepepv2.backends import (
    SYNC,
    BufferSpec,
    DispatchBackend,
    DispatchConfig,
    DispatchHandle,
    DispatchResult,
    ExpertLayout,
    HiddenStates,
    Streams,
    resolve_config,
)
from megatron_deepepv2.config import DeepepV2Settings, get_settings
from megatron_deepepv2.failures import count_call, peer_failure
from megatron_deepepv2.layout import rows_past_valid

#: The dispatchers bound so far, per (configuration, group, experts).
_dispatchers: dict[tuple, "Dispatcher"] = {}


def bind(config: DispatchConfig, group: dist.ProcessGroup, num_experts: int) -> "Dispatcher":
    """The :class:`Dispatcher` of ``config`` on ``group`` for ``num_experts`` experts, made on first use; raises a
    ValueError if ``num_experts`` is not a positive multiple of the group size."""
    key = (config, group, num_experts)
    dispatcher = _dispatchers.get(key)
    if dispatcher is None:
        dispatcher = _dispatchers[key] = Dispatcher(config, group, num_experts)
    return dispatcher


class Dispatcher:
    """The dispatches of ``config`` on the expert-parallel ``group`` for ``num_experts`` global experts: the input
    signature whose checks passed and the buffer spec it leases with (see :func:`bind`)."""

    __slots__ = ("config", "group", "num_experts", "_signature", "_spec", "_specs")

    def __init__(self, config: DispatchConfig, group: dist.ProcessGroup, num_experts: int) -> None:
        validation.check_dispatch_config(config)  # once per binding: also a configuration built directly
        validation.check_binding(num_experts, group_size(group))
        self.config = config
        self.group = group
        self.num_experts = num_experts
        #: The input signature whose checks passed last, its buffer spec, and every passed signature's spec.
        self._signature: Any = None
        self._spec: Optional[BufferSpec] = None
        self._specs: dict[tuple, BufferSpec] = {}

    def prepare(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> DispatchBackend:
        """Counts the call, checks what was not checked before and returns the buffer to dispatch on. Raises
        TypeError or ValueError for bad input before any communication (with ``validate`` on every rank, else here
        and a PeerFailure on the peers), RuntimeError for host sync in CUDA-graph capture, PeerFailure for a peer's."""
        config, group, settings = self.config, self.group, self.config.settings
        count_call(group)
        signature, num_tokens = _static_signature(x, topk_idx, topk_weights)
        limit = settings.num_max_tokens_per_rank
        problem = None
        checked = signature is not None and signature == self._signature
        if not checked and signature is not None and signature in self._specs:  # another one that passed before
            self._signature, self._spec, checked = signature, self._specs[signature], True
        # The static checks depend on T only through integer compares, made here and in _static_signature.
        if not checked or settings.validate or (limit is not None and num_tokens > limit):
            problem = validation.check_dispatch_inputs(
                x, topk_idx, topk_weights, limits=config.backend.limits, fp8_dispatch=settings.fp8_dispatch,
                num_max_tokens_per_rank=limit, num_experts=self.num_experts, check_values=settings.validate)
            if problem is None and not checked:
                self._signature, self._spec = signature, None
        on_cuda = problem is None and topk_idx.is_cuda
        if settings.host_sync and on_cuda and torch.cuda.is_current_stream_capturing():
            raise validation.host_sync_capture_problem()
        if problem is None and settings.check_ids and not settings.validate:
            if not settings.host_sync:  # nothing may read the device: a device-side assert
                expert_ids.assert_expert_ids_on_device(topk_idx, self.num_experts, group)
            elif on_cuda:  # the dispatch waits on the host anyway: one 4-byte read, a ValueError naming the token
                problem = expert_ids.check_expert_ids_with_flag(topk_idx, self.num_experts)
            else:
                problem = expert_ids.check_expert_ids(topk_idx, self.num_experts)
        data = x[0] if type(x) is tuple else x
        if settings.validate:  # every rank sends the same fields; one with a problem sends zeros
            alike = (validation.dtype_code(data.dtype), data.shape[1], topk_idx.shape[1],
                     int(type(x) is tuple or settings.fp8_dispatch)) if problem is None else (0, 0, 0, 0)
            num_tokens = validation.raise_on_every_rank(problem, group, agree=True, num_tokens=num_tokens,
                                                        alike=dict(zip(validation.DISPATCH_ALIKE, alike)))
        elif problem is not None:
            validation.raise_on_every_rank(problem, group, agree=False)
        if self._spec is None:
            fp8 = type(x) is tuple or settings.fp8_dispatch
            self._spec = self._specs[signature] = BufferSpec(data.shape[1], topk_idx.shape[1], 0, settings, fp8=fp8)
        try:
            return buffers.get_buffer(config.backend, group, self._spec, num_tokens)
        except Exception as error:
            raise peer_failure(error, group) from error


def _static_signature(x: Any, topk_idx: Any, topk_weights: Any) -> tuple[Optional[tuple], int]:
    """What the static checks of a dispatch depend on but its token count ``T`` (types, dtypes, devices, trailing
    shapes), and ``T``; None when the inputs are not tensors or their row counts differ (the checks then say why)."""
    try:
        data, scales = x if type(x) is tuple else (x, None)  # a tuple of another length raises: no signature
        num_tokens = data.shape[0]
        if (topk_idx.shape[0] != num_tokens or (scales is not None and scales.shape[0] != num_tokens)
                or (topk_weights is not None and topk_weights.shape[0] != num_tokens)):
            return None, 0
        return ((type(data), data.dtype, data.device, data.shape[1:],
                 None if scales is None else (type(scales), scales.dtype, scales.shape[1:]),
                 type(topk_idx), topk_idx.dtype, topk_idx.device, topk_idx.shape[1:],
                 None if topk_weights is None else (type(topk_weights), topk_weights.dtype, topk_weights.device,
                                                    topk_weights.shape[1:])), num_tokens)
    except (AttributeError, IndexError, TypeError, ValueError):  # not tensors (or 0-dim): the checks say what is wrong
        return None, 0


class DispatchFunction(torch.autograd.Function):
    """``apply(x [T, H], topk_weights [T, K] fp32 | None, dispatcher, topk_idx [T, K] int64, scales [T, S] | None,
    streams)`` -> ``(recv_x, recv_topk_weights, recv_scales, recv_topk_idx, handle)`` as in
    :class:`~megatron_deepepv2.backends.base.DispatchResult` (``scales``: of an FP8 pair, passed through, then not
    differentiable). Differentiable in ``x`` and ``topk_weights``; with ``fp8_dispatch`` the backward is BF16."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: Optional[torch.Tensor],  # type: ignore[override]
                dispatcher: Dispatcher, topk_idx: torch.Tensor, scales: Optional[torch.Tensor], streams: Streams):
        buffer = dispatcher.prepare(x if scales is None else (x, scales), topk_idx, topk_weights)
        config = dispatcher.config
        host_sync, fp8_dispatch = config.settings.host_sync, config.settings.fp8_dispatch
        try:
            data = fp8.quantize_e4m3_1x128(x) if fp8_dispatch else x if scales is None else (x, scales)
            recv_x, recv_idx, recv_weights, handle = buffer.dispatch(data, topk_idx, topk_weights, config,
                                                                     dispatcher.num_experts, streams)
            buffers.track_handle(handle)  # keeps its buffer alive through a rebuild until the handle is gone
            recv_scales = None
            if fp8_dispatch:
                recv_x = fp8.dequantize_e4m3_1x128(*recv_x, dtype=x.dtype,
                                                   num_valid_rows=None if host_sync else handle.num_valid_rows)
            elif scales is not None:
                recv_x, recv_scales = recv_x
                ctx.mark_non_differentiable(recv_x, recv_scales)
            if config.clear_tail and not host_sync and (recv_idx is not None or recv_weights is not None):
                past = rows_past_valid(handle.num_recv_rows, handle.num_valid_rows)
                if recv_idx is not None:
                    recv_idx = recv_idx.masked_fill(past.unsqueeze(1), -1)
                if recv_weights is not None:
                    recv_weights = recv_weights.masked_fill(past if recv_weights.dim() == 1 else past.unsqueeze(1), 0.0)
            if config.mask_foreign_weights and recv_weights is not None and recv_idx is not None:
                recv_weights = recv_weights.masked_fill(recv_idx < 0, 0.0)
        except Exception as error:
            raise peer_failure(error, dispatcher.group) from error
        ctx.set_materialize_grads(False)  # unused outputs give None, not zeros of an FP8 dtype
        ctx.handle, ctx.streams, ctx.hidden = handle, streams, x.shape[1]
        return recv_x, recv_weights, recv_scales, recv_idx, handle

    @staticmethod
    def backward(ctx: Any, grad_recv_x: Optional[torch.Tensor], grad_recv_weights: Optional[torch.Tensor], *_):
        handle: DispatchHandle = ctx.handle
        group = handle.buffer.group
        count_call(group)  # failures of this backward are scoped to it, as a forward call's are
        try:  # the whole body: an error before the combine would leave the peers waiting in it
            rows = handle.num_recv_rows
            if grad_recv_x is None:  # only the weights want a gradient: its device is theirs
                grad_recv_x = torch.zeros((rows, ctx.hidden), dtype=torch.bfloat16, device=grad_recv_weights.device)
            grad_weights = None
            if ctx.needs_input_grad[1]:
                if grad_recv_weights is None:
                    shape = (rows,) if handle.config.layout is ExpertLayout.EXPAND else (rows, handle.num_topk)
                    grad_recv_weights = torch.zeros(shape, dtype=torch.float32, device=grad_recv_x.device)
                # Made before the backend captures the event its communication stream waits on.
                grad_weights = grad_recv_weights.float().contiguous()
            grad_x, grad_topk_weights = handle.buffer.combine(grad_recv_x.contiguous(), handle, grad_weights,
                                                              ctx.streams)
        except Exception as error:
            raise peer_failure(error, group) from error
        return grad_x, grad_topk_weights, None, None, None, None


#: Combine inputs whose static checks passed: (configuration, hidden, dtype, device).
_combine_checked: set[tuple] = set()


class CombineFunction(torch.autograd.Function):
    """``apply(x, handle, streams)`` -> ``[T, H]``: the rows ``x`` (in the receive layout of ``handle``) summed back
    on the tokens' source ranks, in ``x``'s dtype; differentiable in ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: DispatchHandle, streams: Streams):  # type: ignore[override]
        if type(handle) is not DispatchHandle:
            raise validation.not_a_handle(handle)
        group, validate = handle.buffer.group, handle.config.settings.validate
        count_call(group)
        key = (handle.config, x.shape[1], x.dtype, x.device) if type(x) is torch.Tensor and x.dim() == 2 else None
        if key is None or key not in _combine_checked or x.shape[0] != handle.num_recv_rows or validate:
            problem = validation.check_combine_inputs(x, handle, None)
            if problem is not None or validate:
                validation.raise_on_every_rank(problem, group, agree=validate)
            _combine_checked.add(key)
        ctx.handle, ctx.streams = handle, streams
        try:
            return handle.buffer.combine(x.contiguous(), handle, None, streams).x
        except Exception as error:
            raise peer_failure(error, group) from error

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        handle: DispatchHandle = ctx.handle
        group = handle.buffer.group
        count_call(group)
        try:
            grad = handle.buffer.cached_dispatch(grad_out.contiguous(), handle, None, ctx.streams).recv_x
        except Exception as error:
            raise peer_failure(error, group) from error
        if not handle.config.host_sync and handle.config.clear_tail:
            # Rows past the valid extent are unspecified: zero them, writing only those rows.
            if expert_kernels.AVAILABLE and grad.is_cuda:
                expert_kernels.zero_rows_from(grad, handle.num_valid_rows)
            else:
                grad = grad.masked_fill(rows_past_valid(grad.shape[0], handle.num_valid_rows).unsqueeze(1), 0)
        return grad, None, None


def _streams(async_finish: bool, allocate_on_comm_stream: bool) -> Streams:
    return SYNC if not (async_finish or allocate_on_comm_stream) else Streams(bool(async_finish),
                                                                             bool(allocate_on_comm_stream))


def dispatch(
    x: HiddenStates,
    topk_idx: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    num_experts: int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    config: Optional[DispatchConfig] = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
    **settings: Any,
) -> DispatchResult:
    """Sends tokens to the ranks of their experts (differentiable in ``x`` and ``topk_weights``).

    Args:
        x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])`` (not differentiable).
        topk_idx: ``[T, K]`` int64 global expert ids, -1 = no selection.
        topk_weights: ``[T, K]`` floating routing weights (cast to fp32), or None.
        num_experts: Global number of experts, a multiple of the group size.
        group: Expert-parallel process group (default: the world).
        config: A configuration from :func:`resolve_config`: what repeated callers pass. Without it, ``settings``
            are resolved (once per distinct value).
        async_finish: Run the communication asynchronously (the op still orders the current stream after it).
        allocate_on_comm_stream: Allocate outputs on the communication stream (DeepEP, with ``async_finish``).
        **settings: What :func:`resolve_config` takes (``layout="expand"``, ``expert_alignment``, ``host_sync``, ...).
            ``host_sync=False``: worst-case sizes, counts on the device, no device-to-host copy in forward or
            backward; rows past ``handle.num_valid_rows`` have expert id -1 and weight 0.

    Returns:
        The received rows, routing and the handle.

    Raises:
        TypeError, ValueError: Bad input or settings, raised before any communication (with ``validate``, on every
            rank of the group).
        ImportError: An explicitly requested backend cannot run here.
        PeerFailure: A peer of the group failed in this call (or waits at a buffer build this rank did not need),
            named with its error; the group is unusable after it.
    """
    group = group if group is not None else dist.group.WORLD
    try:
        if config is None:
            config = _config_for(settings)
        elif settings:
            raise TypeError(f"dispatch() takes either config= or the settings it resolves ({sorted(settings)}), "
                            "not both.")
        dispatcher = bind(config, group, num_experts)
    except (TypeError, ValueError) as problem:
        # Raised in the call the peers are making, so that they stop too instead of waiting for this rank.
        count_call(group)
        validate = settings.get("validate") if config is None else config.settings.validate
        validate = get_settings().validate if validate is None else validate
        validation.raise_on_every_rank(problem, group, agree=bool(validate), alike=dict.fromkeys(
            validation.DISPATCH_ALIKE, 0))
    if isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point():
        topk_weights = topk_weights.float().contiguous()
    if isinstance(topk_idx, torch.Tensor):
        topk_idx = topk_idx.contiguous()
    data, scales = x if type(x) is tuple and len(x) == 2 else (x, None)
    if isinstance(data, torch.Tensor):
        data = data.contiguous()
    recv_x, recv_weights, recv_scales, recv_idx, handle = DispatchFunction.apply(
        data, topk_weights, dispatcher, topk_idx, scales, _streams(async_finish, allocate_on_comm_stream))
    return DispatchResult(recv_x if recv_scales is None else (recv_x, recv_scales), recv_idx, recv_weights, handle)


@functools.lru_cache(maxsize=64)
def _resolved(arguments: frozenset, settings: DeepepV2Settings) -> DispatchConfig:
    return resolve_config(**dict(arguments))


def _config_for(arguments: dict[str, Any]) -> DispatchConfig:
    """:func:`resolve_config` of a dispatch() call's ``arguments``, once per arguments and process-wide settings."""
    try:
        return _resolved(frozenset(arguments.items()), get_settings())
    except TypeError:  # an unhashable value (or an unknown name): resolve uncached, which says what is wrong
        return resolve_config(**arguments)


def combine(x: torch.Tensor, handle: DispatchHandle, *, async_finish: bool = False,
            allocate_on_comm_stream: bool = False) -> torch.Tensor:
    """Sums each token's expert outputs back on its source rank (differentiable in ``x``).

    Args:
        x: Rows in the receive layout of ``handle`` (compact ``[N, H]``, expand ``[N_expanded, H]``).
        handle: The handle returned by :func:`dispatch`.
        async_finish, allocate_on_comm_stream: See :func:`dispatch`.

    Returns ``[T, H]`` combined rows in ``x``'s dtype. Raises TypeError or ValueError if ``x`` does not fit ``handle``
    or the backend (with ``validate``, on every rank), and PeerFailure as :func:`dispatch`.
    """
    return CombineFunction.apply(x, handle, _streams(async_finish, allocate_on_comm_stream))
