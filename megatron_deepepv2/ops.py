"""Differentiable dispatch and combine: :func:`resolve_config` (a dispatch configuration from the settings), the
bound :class:`DispatchBinding`, and one autograd Function per op (dispatch's backward is a combine of the gradient,
combine's a cached dispatch), which the Megatron manager and :func:`dispatch` / :func:`combine` call. Every call runs
in its group's :class:`~megatron_deepepv2.failures.GroupCall`, so a peer raises naming the rank that failed first.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2 import buffers, expert_ids, fp8, kernels, validation
from megatron_deepepv2.agreement import DISPATCH_AGREEMENT, DispatchFacts, raise_on_every_rank
from megatron_deepepv2.backends.base import (SYNC, BufferSpec, DispatchBackend, DispatchConfig, DispatchHandle,
                                             DispatchResult, Streams)
from megatron_deepepv2.backends.registry import resolve_backend
from megatron_deepepv2.config import SETTING_NAMES, DeepepV2Settings, get_settings
from megatron_deepepv2.groups import GroupState, state_of
from megatron_deepepv2.layout import ExpertLayout, HiddenStates, rows_past_valid, split_hidden

#: Fields of :class:`~megatron_deepepv2.backends.base.DispatchConfig` a caller sets beside the settings.
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(DispatchConfig)) - {"settings"}
#: Arguments that are gone, and why.
_REMOVED_ARGUMENTS = {"zero_padding": "the expand layout's padding rows are always zero; drop it"}


def resolve_config(**overrides: Any) -> DispatchConfig:
    """Resolves a dispatch configuration: ``overrides`` over the process-wide settings (checked as it is built).

    Args:
        **overrides: Fields of :class:`~megatron_deepepv2.backends.base.DispatchConfig` (``backend`` and ``layout``
            may be names) and of :class:`~megatron_deepepv2.config.DeepepV2Settings`; None leaves a field unset.

    Returns:
        The configuration.

    Raises:
        TypeError: For a name that is neither.
        ValueError: For an unknown backend or layout, or a value the settings or the configuration reject.
        ImportError: An explicitly named backend cannot run here.
    """
    overrides = {name: value for name, value in overrides.items() if value is not None}
    unknown = sorted(set(overrides) - _CONFIG_FIELDS - SETTING_NAMES)
    if unknown:
        removed = "".join(f" {name}: {_REMOVED_ARGUMENTS[name]}." for name in unknown if name in _REMOVED_ARGUMENTS)
        raise TypeError(f"Unknown dispatch setting(s) {unknown}; known: {sorted(_CONFIG_FIELDS | SETTING_NAMES)}."
                        + removed)
    # ``backend`` is both: the setting names the backend, the configuration holds the class that runs.
    changes = {name: overrides.pop(name) for name in list(overrides) if name in SETTING_NAMES and name != "backend"}
    settings = dataclasses.replace(get_settings(), **changes) if changes else get_settings()
    backend = overrides.pop("backend", settings.backend)
    layout = ExpertLayout.parse(overrides.pop("layout", ExpertLayout.COMPACT))
    return DispatchConfig(backend if isinstance(backend, type) else resolve_backend(backend), settings, layout,
                          **overrides)


@functools.lru_cache(maxsize=64)
def _resolved(arguments: frozenset, settings: DeepepV2Settings) -> DispatchConfig:
    """:func:`resolve_config` of hashable ``arguments``, cached per ``settings`` (the process-wide ones they use)."""
    return resolve_config(**dict(arguments))


def _config_for(arguments: dict[str, Any]) -> DispatchConfig:
    """:func:`resolve_config` of a dispatch() call's ``arguments``, once per arguments and process-wide settings."""
    try:
        return _resolved(frozenset(arguments.items()), get_settings())
    except TypeError:  # an unhashable value (or an unknown name): resolve uncached, which says what is wrong
        return resolve_config(**arguments)


def bind(config: DispatchConfig, group: dist.ProcessGroup, num_experts: int) -> "DispatchBinding":
    """Returns the :class:`DispatchBinding` of ``config`` on ``group`` for ``num_experts`` experts, made on first use.

    Args:
        config, group, num_experts: The dispatches' configuration, expert-parallel group and global expert count.

    Raises:
        ValueError: If ``num_experts`` is not a positive multiple of the group size.
    """
    return _bound(config, state_of(group), num_experts)


def _bound(config: DispatchConfig, state: GroupState, num_experts: int) -> "DispatchBinding":
    """:func:`bind` on the group's ``state``."""
    binding = state.bindings.get((config, num_experts))
    if binding is None:
        binding = state.bindings[config, num_experts] = DispatchBinding(config, state, num_experts)
    return binding


def _static_signature(x: Any, topk_idx: Any, topk_weights: Any) -> tuple[Optional[tuple], int]:
    """What the static checks of a dispatch depend on but its token count ``T`` (types, dtypes, devices, trailing
    shapes), and ``T``; None when the inputs are not tensors or their row counts differ (the checks then say why)."""
    try:
        data, scales = split_hidden(x)
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


class DispatchBinding:
    """The dispatches of ``config`` on the expert-parallel group of ``state`` for ``num_experts`` global experts (see
    :func:`bind`): the group's state, the last input signature whose checks passed and the buffer spec it leases with.

    The inputs whose static checks passed are remembered in the group's ``checked_inputs`` (one memo for dispatch and
    combine), by signature: a repeated signature is not checked again unless ``validate`` or the token limit asks.

    Args:
        config, state, num_experts: The dispatches' configuration, the state of their expert-parallel group
            (:func:`~megatron_deepepv2.groups.state_of`) and the global expert count.

    Raises:
        ValueError: If ``num_experts`` is not a positive multiple of the group size.
    """

    __slots__ = ("config", "state", "num_experts", "_checked", "_signature", "_spec")

    def __init__(self, config: DispatchConfig, state: GroupState, num_experts: int) -> None:
        self.state = state  # its call is the context of every call: counted, failures attributed
        validation.check_binding(num_experts, self.state.size)
        self.config, self.num_experts = config, num_experts
        self._checked = self.state.checked_inputs
        self._signature: Any = None
        self._spec: Optional[BufferSpec] = None

    def prepare(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> DispatchBackend:
        """Checks what was not checked before and returns the buffer to dispatch on (run in the call's
        :class:`~megatron_deepepv2.failures.GroupCall`).

        Args:
            x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])``.
            topk_idx: ``[T, K]`` int64 global expert ids, -1 = no selection.
            topk_weights: ``[T, K]`` fp32 weights, or None.

        Returns:
            The buffer with room for this call's tokens (built or grown collectively when needed).

        Raises:
            TypeError, ValueError: Bad input, before any communication (with ``validate`` on every rank, else here and
                a PeerFailure on the peers).
            RuntimeError: A dispatch with host sync in CUDA-graph capture.
        """
        settings = self.config.settings
        signature, num_tokens = _static_signature(x, topk_idx, topk_weights)
        spec = self._spec if signature is not None and signature == self._signature else None
        if spec is None and signature is not None:  # another signature that passed before
            spec = self._checked.get((self.config, signature))
        limit = settings.num_max_tokens_per_rank
        problem = None
        # The static checks depend on T only through integer compares, made here and in _static_signature.
        if spec is None or settings.validate or (limit is not None and num_tokens > limit):
            problem = validation.dispatch_inputs_problem(x, topk_idx, topk_weights, limits=self.config.backend.limits,
                                                         fp8_dispatch=settings.fp8_dispatch,
                                                         num_max_tokens_per_rank=limit)
        if problem is None:
            if settings.host_sync and topk_idx.is_cuda and torch.cuda.is_current_stream_capturing():
                raise validation.host_sync_capture_error()
            if settings.check_ids or settings.validate:
                problem = expert_ids.routing_ids_problem(topk_idx, self.num_experts, settings, self.state)
        if problem is not None or settings.validate:
            num_tokens = self._raise_or_agree(problem, x, topk_idx, num_tokens)
        if spec is None:
            data, scales = split_hidden(x)
            # The token limit is decided at the build (buffers.get_buffer), from the group's token counts.
            spec = self._checked[self.config, signature] = BufferSpec(
                hidden=data.shape[1], num_topk=topk_idx.shape[1], num_max_tokens_per_rank=0, settings=settings,
                fp8=scales is not None or settings.fp8_dispatch, backend=self.config.backend)
        self._signature, self._spec = signature, spec
        return buffers.get_buffer(self.config.backend, self.state, spec, num_tokens)

    def _raise_or_agree(self, problem: Optional[Exception], x: HiddenStates, topk_idx: torch.Tensor,
                        num_tokens: int) -> int:
        """Raises ``problem`` (announced to the peers); with ``validate``, agrees over the group first on errors, the
        largest token count and :data:`~megatron_deepepv2.agreement.DISPATCH_AGREEMENT`.

        Args:
            problem: This rank's problem with its inputs, or None.
            x, topk_idx: The dispatch's hidden states and ``[T, K]`` ids, valid when ``problem`` is None.
            num_tokens: This rank's token count ``T``.

        Returns:
            The token count the buffer must hold: the group's largest with ``validate``, else ``num_tokens``.

        Raises:
            TypeError, ValueError: ``problem``, or with ``validate`` a peer's (each rank raises together).
        """
        settings = self.config.settings
        values = ()
        if problem is None:  # called with validate (a rank with a problem sends zeros)
            data, scales = split_hidden(x)
            facts = DispatchFacts(dtype=data.dtype, hidden=data.shape[1], num_topk=topk_idx.shape[1],
                                  fp8=scales is not None or settings.fp8_dispatch, num_sms=settings.num_sms)
            values = [field.encode(facts) for field in DISPATCH_AGREEMENT]
        return raise_on_every_rank(problem, self.state, agree=settings.validate, num_tokens=num_tokens,
                                   fields=DISPATCH_AGREEMENT, values=values)


def _masked_routing(handle: DispatchHandle, recv_idx: Optional[torch.Tensor],
                    recv_weights: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The received ids and weights with what the configuration asks masked: without host sync (``clear_tail``) id -1
    and weight 0 past the valid rows; compact (``mask_foreign_weights``) weight 0 for other ranks' experts."""
    config = handle.config
    if config.clear_tail and not config.host_sync and (recv_idx is not None or recv_weights is not None):
        past = rows_past_valid(handle.num_recv_rows, handle.num_valid_rows)
        if recv_idx is not None:
            recv_idx = recv_idx.masked_fill(past.unsqueeze(1), -1)
        if recv_weights is not None:
            recv_weights = recv_weights.masked_fill(past if recv_weights.dim() == 1 else past.unsqueeze(1), 0.0)
    if config.mask_foreign_weights and recv_weights is not None and recv_idx is not None:
        recv_weights = recv_weights.masked_fill(recv_idx < 0, 0.0)
    return recv_idx, recv_weights


class DispatchFunction(torch.autograd.Function):
    """``apply(x, topk_weights, binding, topk_idx, scales, streams)`` -> ``(recv_x, recv_topk_weights,
    recv_scales, recv_topk_idx, handle)``.

    Inputs: ``x`` ``[T, H]``; ``topk_weights`` ``[T, K]`` fp32 or None; ``binding`` a :class:`DispatchBinding`;
    ``topk_idx`` ``[T, K]`` int64; ``scales`` ``[T, S]`` of an FP8 pair ``(x, scales)`` or None; ``streams`` a
    :class:`~megatron_deepepv2.backends.base.Streams`. Outputs as in
    :class:`~megatron_deepepv2.backends.base.DispatchResult`, ``recv_scales`` ``[N, S]`` for an FP8 pair (its rows and
    scales then not differentiable). Differentiable in ``x`` and ``topk_weights``; with ``fp8_dispatch`` the backward
    is BF16. Raises as :meth:`DispatchBinding.prepare`, and a PeerFailure for a peer's failure.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: Optional[torch.Tensor],  # type: ignore[override]
                binding: DispatchBinding, topk_idx: torch.Tensor, scales: Optional[torch.Tensor], streams: Streams):
        config = binding.config
        call = binding.state.call
        with call:
            buffer = binding.prepare(x if scales is None else (x, scales), topk_idx, topk_weights)
            data = fp8.quantize_e4m3_1x128(x) if config.settings.fp8_dispatch else x if scales is None else (x, scales)
            recv_x, recv_idx, recv_weights, handle = buffer.dispatch(data, topk_idx, topk_weights, config,
                                                                     binding.num_experts, streams)
            buffers.track_handle(handle)  # keeps its buffer alive through a rebuild until the handle is gone
            recv_scales = None
            if config.settings.fp8_dispatch:  # BF16 rows for the experts (the valid ones only, without host sync)
                valid = None if config.host_sync else handle.num_valid_rows
                recv_x = fp8.dequantize_e4m3_1x128(*split_hidden(recv_x), dtype=x.dtype, num_valid_rows=valid)
            elif scales is not None:  # a pair passed through comes back a pair, not differentiable
                recv_x, recv_scales = split_hidden(recv_x)
                ctx.mark_non_differentiable(recv_x, recv_scales)
            if config.clear_tail or config.mask_foreign_weights:
                recv_idx, recv_weights = _masked_routing(handle, recv_idx, recv_weights)
        ctx.set_materialize_grads(False)  # unused outputs give None, not zeros of an FP8 dtype
        ctx.handle, ctx.streams, ctx.hidden, ctx.call = handle, streams, x.shape[1], call
        return recv_x, recv_weights, recv_scales, recv_idx, handle

    @staticmethod
    def backward(ctx: Any, grad_recv_x: Optional[torch.Tensor], grad_recv_weights: Optional[torch.Tensor], *_):
        handle: DispatchHandle = ctx.handle
        # The whole body: an error before the combine would leave the peers waiting in it.
        with ctx.call:
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
            grad_x, grad_topk_weights = handle.buffer.combine(grad_recv_x.contiguous(), handle,
                                                              topk_weights=grad_weights, streams=ctx.streams)
        return grad_x, grad_topk_weights, None, None, None, None


class CombineFunction(torch.autograd.Function):
    """``apply(x, handle, streams)`` -> ``[T, H]``: the rows ``x`` (``[handle.num_recv_rows, H]``, in the receive
    layout of ``handle``) summed back on the tokens' source ranks, in ``x``'s dtype; differentiable in ``x``. Raises
    TypeError or ValueError for an ``x`` that does not fit ``handle`` (with ``validate`` on every rank), and a
    PeerFailure for a peer's failure."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: DispatchHandle, streams: Streams):  # type: ignore[override]
        if type(handle) is not DispatchHandle:
            raise validation.not_a_handle_error(handle)
        state, validate = handle.buffer.state, handle.config.settings.validate
        call = ctx.call = state.call
        with call:
            checked = state.checked_inputs
            key = (handle.config, x.shape[1], x.dtype, x.device) if type(x) is torch.Tensor and x.dim() == 2 else None
            if key is None or key not in checked or x.shape[0] != handle.num_recv_rows or validate:
                problem = validation.combine_inputs_problem(x, handle)
                if problem is not None or validate:
                    raise_on_every_rank(problem, state, agree=validate)
                if key is not None:
                    checked[key] = True
            ctx.handle, ctx.streams = handle, streams
            return handle.buffer.combine(x.contiguous(), handle, streams=streams).x

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        handle: DispatchHandle = ctx.handle
        with ctx.call:
            grad = handle.buffer.cached_dispatch(grad_out.contiguous(), handle, streams=ctx.streams).recv_x
        if not handle.config.host_sync and handle.config.clear_tail:
            # Rows past the valid extent are unspecified: zero them, writing only those rows.
            if kernels.AVAILABLE and grad.is_cuda:
                kernels.zero_rows_from(grad, handle.num_valid_rows)
            else:
                grad = grad.masked_fill(rows_past_valid(grad.shape[0], handle.num_valid_rows).unsqueeze(1), 0)
        return grad, None, None


def _streams(async_finish: bool, allocate_on_comm_stream: bool) -> Streams:
    """The :class:`~megatron_deepepv2.backends.base.Streams` of a call's flags (the shared :data:`SYNC` for none)."""
    return SYNC if not (async_finish or allocate_on_comm_stream) else Streams(bool(async_finish),
                                                                             bool(allocate_on_comm_stream))


def _as_function_inputs(x: Any, topk_idx: Any, topk_weights: Any, binding: DispatchBinding) -> tuple:
    """:class:`DispatchFunction`'s inputs but the streams, from a :func:`dispatch` call's: contiguous tensors, floating
    weights in fp32; anything else passed on for the checks to name."""
    if isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point():
        topk_weights = topk_weights.float().contiguous()
    if isinstance(topk_idx, torch.Tensor):
        topk_idx = topk_idx.contiguous()
    try:
        data, scales = split_hidden(x)
    except ValueError:  # a tuple that is no pair: the checks say what is wrong
        data, scales = x, None
    if isinstance(data, torch.Tensor):
        data = data.contiguous()
    return data, topk_weights, binding, topk_idx, scales


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
    state = state_of(group if group is not None else dist.group.WORLD)
    try:
        if config is None:
            config = _config_for(settings)
        elif settings:
            raise TypeError(f"dispatch() takes either config= or the settings it resolves ({sorted(settings)}), "
                            "not both.")
        binding = _bound(config, state, num_experts)
    except (TypeError, ValueError) as problem:
        # Raised in the call the peers are making, so that they stop too instead of waiting for this rank.
        validate = settings.get("validate") if config is None else config.settings.validate
        validate = get_settings().validate if validate is None else validate
        with state.call:
            raise_on_every_rank(problem, state, agree=bool(validate), fields=DISPATCH_AGREEMENT)
    recv_x, recv_weights, recv_scales, recv_idx, handle = DispatchFunction.apply(
        *_as_function_inputs(x, topk_idx, topk_weights, binding), _streams(async_finish, allocate_on_comm_stream))
    return DispatchResult(recv_x if recv_scales is None else (recv_x, recv_scales), recv_idx, recv_weights, handle)


def combine(x: torch.Tensor, handle: DispatchHandle, *, async_finish: bool = False,
            allocate_on_comm_stream: bool = False) -> torch.Tensor:
    """Sums each token's expert outputs back on its source rank (differentiable in ``x``).

    Args:
        x: Rows in the receive layout of ``handle`` (compact ``[N, H]``, expand ``[N_expanded, H]``).
        handle: The handle returned by :func:`dispatch`.
        async_finish, allocate_on_comm_stream: See :func:`dispatch`.

    Returns:
        ``[T, H]`` combined rows in ``x``'s dtype.

    Raises:
        TypeError, ValueError: ``x`` does not fit ``handle`` or the backend (with ``validate``, on every rank).
        PeerFailure: As :func:`dispatch`.
    """
    return CombineFunction.apply(x, handle, _streams(async_finish, allocate_on_comm_stream))
