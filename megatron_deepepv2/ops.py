"""Differentiable dispatch and combine: one bound :class:`Dispatcher` per layer, one autograd Function per op.

========  =====================================  =====================================
op        forward                                backward
========  =====================================  =====================================
dispatch  backend dispatch (fresh routing)       combine of the gradient, weights alongside
combine   backend combine                        cached dispatch of the gradient
========  =====================================  =====================================

What stays the same from call to call is resolved once: a :class:`DispatchConfig` (a layer's settings) and a
:class:`Dispatcher` binding it to a group and an expert count, which keeps the input signature that passed the static
checks and the buffer it leases (until a rebuild retires it). A call checks nothing it checked before and makes one
backend call per op; the Megatron manager reaches DeepEP through three frames of this package (its ``dispatch``, the
Function's ``forward``, the backend's ``dispatch``). Every kernel producing a communication input (``.contiguous()``,
fp32 casts) is enqueued before the backend captures the event its communication stream waits on (Megatron-LM#5153).

**Failures.** Every path that communicates -- the buffer build, both forwards and both backwards -- passes its errors
through :func:`peer_failure` (:func:`megatron_deepepv2.failures.peer_failure`), and the backwards count their calls like
the forwards: a rank that fails announces its error for the peers of that call, and a peer raises naming that rank and
its error (at once over gloo, where waits watch for it; when its own wait fails elsewhere, e.g. at DeepEP's timeout).

FP8 dispatch (``fp8_dispatch``) quantises ``x`` just before the backend's dispatch and dequantises just after
(:mod:`megatron_deepepv2.fp8`): the backward is the BF16 one, a straight-through estimator for ``x``.

Passes only direct callers need are switches, on by default and off in the Megatron manager, whose consumers never
read what they write: ``mask_foreign_weights`` (compact: zero the received weights of other ranks' experts; their
gradient is zero either way), ``clear_tail`` (without host sync: expert id -1 and weight 0 past the valid rows, and
zero rows past them in a combine's input gradient) and ``check_ids`` (expert ids in range and distinct).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
import torch.distributed as dist

from megatron_deepepv2 import _dist, buffers, failures, expert_kernels, fp8, validation
from megatron_deepepv2.failures import peer_failure
from megatron_deepepv2.backends import (
    BufferSpec,
    DispatchBackend,
    DispatchHandle,
    ExpertLayout,
    HiddenStates,
    Routing,
    Streams,
    resolve_backend,
)
from megatron_deepepv2.config import DeepepV2Settings, get_settings
from megatron_deepepv2.layout import rows_past_valid

#: The switches of a caller whose consumers read only what a dispatch defines -- the Megatron manager: its ids come
#: from ``torch.topk`` (valid by construction), its multihot conversion ignores other ranks' weights, its experts stop
#: at the counts and combine ignores the rows past them: every pass only direct callers need is off.
WITHOUT_DIRECT_CALL_PASSES = {"check_ids": False, "mask_foreign_weights": False, "clear_tail": False}

#: The stream modes by (async_finish, allocate_on_comm_stream): built once, passed on every call.
STREAMS = {(a, b): Streams(a, b) for a in (False, True) for b in (False, True)}


class DispatchResult(NamedTuple):
    """Output of a dispatch.

    Attributes:
        recv_x: Received rows (an FP8 pair when one was dispatched).
        recv_topk_idx: Compact: ``[N, K]`` local expert ids (-1 = other rank). Expand: None.
        recv_topk_weights: Compact ``[N, K]`` / expand ``[N]`` fp32 (zero where the id is -1 with
            ``mask_foreign_weights``, and on expand padding rows), or None if none were dispatched.
        handle: Handle for :func:`combine` (``handle.num_valid_rows``: rows holding data, on the device).
    """

    recv_x: HiddenStates
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 alignment-padded rows per local expert, on the rows' device."""
        return self.handle.tokens_per_expert


@dataclass(frozen=True)
class DispatchConfig:
    """Everything about a dispatch that stays the same from call to call: one per layer, resolved once
    (:meth:`resolve` takes the fields it is not given from the settings of the same name, ``host_sync`` from
    ``no_host_sync``, else from the defaults here).

    Attributes:
        backend: Backend class (a registered, usable backend).
        layout: Receive layout (compact by default; Megatron layers use expand).
        expert_alignment: Expand layout: each expert block is padded to a multiple of this.
        zero_padding: Expand layout: zero-fill the padding rows and their weights. None (the default): whenever
            blocks are padded (``expert_alignment`` > 1). False is rejected there: the rows would hold whatever the
            memory held before, and a grouped GEMM's weight gradient reads them.
        num_sms: SMs for the communication kernels (0 = backend's choice).
        host_sync: Whether the dispatch may wait on the host for exact sizes.
        deterministic: Bit-exact run to run.
        num_max_tokens_per_rank: Configured token capacity, or None for the largest first batch.
        validate: Host-side value checks agreed over the group.
        check_ids: Expert-id checks when ``validate`` is off (see :mod:`megatron_deepepv2.validation`).
        growth_timeout_s: How long a capacity growth waits for the other ranks.
        mask_foreign_weights: Compact: zero the received weights of other ranks' experts.
        clear_tail: Without host sync: expert id -1 and weight 0 past the valid rows, zero rows past them in a
            combine's input gradient (a consumer may reduce over every row).
        fp8_dispatch: Send BF16 hidden states as e4m3 with 1x128 scales, hand back BF16 rows; gradients stay BF16.
        allow_hybrid_mode: DeepEP hybrid (RDMA x NVLink) mode; None: only when the group spans nodes.
    """

    backend: type[DispatchBackend]
    layout: ExpertLayout = ExpertLayout.COMPACT
    expert_alignment: int = 1
    zero_padding: Optional[bool] = None
    num_sms: int = 0
    host_sync: bool = True
    deterministic: bool = False
    num_max_tokens_per_rank: Optional[int] = None
    validate: bool = False
    check_ids: bool = True
    growth_timeout_s: float = 120.0
    mask_foreign_weights: bool = True
    clear_tail: bool = True
    fp8_dispatch: bool = False
    allow_hybrid_mode: Optional[bool] = None
    #: Not a setting: the dispatchers bound to this configuration, per (group, experts).
    dispatchers: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "DispatchConfig":
        # Immutable but for the bound dispatchers, which copies may share (they hold process groups, which cannot be
        # copied): a deep copy of a Megatron TransformerConfig that carries this configuration gets the same object.
        return self

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("dispatchers", None)  # process groups cannot be pickled; a loaded configuration binds anew
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "dispatchers", {})

    @classmethod
    def resolve(cls, **overrides: Any) -> "DispatchConfig":
        """Resolves a configuration: ``overrides`` (None = the setting) over the process-wide settings.

        Args:
            **overrides: Field names of this class and their values (``backend`` and ``layout`` may be names).

        Returns:
            The configuration.

        Raises:
            TypeError: For a name that is not a field.
            ValueError: For an unknown backend or layout, or a mode the backend cannot run.
            ImportError: An explicitly requested backend cannot run here.
        """
        unknown = sorted(set(overrides) - set(_FIELDS))
        if unknown:
            raise TypeError(f"Unknown dispatch setting(s) {unknown}; known: {sorted(_FIELDS)}.")
        settings = get_settings()
        values = {name: getattr(settings, name) for name in _FROM_SETTINGS}
        values["host_sync"] = not settings.no_host_sync
        values.update((name, value) for name, value in overrides.items() if value is not None)
        backend = values["backend"]
        values["backend"] = backend if isinstance(backend, type) else resolve_backend(backend)
        values["layout"] = ExpertLayout.parse(values.get("layout", ExpertLayout.COMPACT))
        config = cls(**values)
        problem = config.backend.preflight(host_sync=config.host_sync, deterministic=config.deterministic)
        if problem is not None:
            raise problem
        return config

    def dispatcher(self, group: dist.ProcessGroup, num_experts: int) -> "Dispatcher":
        """The :class:`Dispatcher` of this configuration for ``group`` and ``num_experts`` (bound on first use)."""
        bound = self.dispatchers.get((group, num_experts))
        if bound is None:
            bound = self.dispatchers[(group, num_experts)] = Dispatcher(self, group, num_experts)
        return bound


_FIELDS = tuple(f.name for f in dataclasses.fields(DispatchConfig) if f.init)
#: The fields a process-wide setting of the same name fills (the layout setting is the Megatron manager's).
_FROM_SETTINGS = tuple(name for name in _FIELDS
                       if name in {f.name for f in dataclasses.fields(DeepepV2Settings)} and name != "layout")


class Dispatcher:
    """One layer's dispatches, bound once: its configuration, group, experts, leased buffer and checked inputs.

    Args:
        config: The configuration.
        group: Expert-parallel process group.
        num_experts: Global number of experts.
    """

    __slots__ = ("config", "group", "routing", "_signature", "_buffer", "_buffer_spec")

    def __init__(self, config: DispatchConfig, group: dist.ProcessGroup, num_experts: int) -> None:
        self.config = config
        self.group = group
        # Padding rows are zeroed whenever there are any (zero_padding=False there fails the checks in prepare).
        padded = config.layout is ExpertLayout.EXPAND and config.expert_alignment > 1
        self.routing = Routing(num_experts, config.layout, config.expert_alignment, padded, config.host_sync)
        #: The input signature whose static checks passed last (:func:`_static_signature`: all they depend on but the
        #: token count, which varies from batch to batch and is checked by integer compares).
        self._signature: Any = None
        self._buffer: Optional[DispatchBackend] = None
        self._buffer_spec: Optional[BufferSpec] = None

    def prepare(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> DispatchBackend:
        """Checks a dispatch's inputs (what was not checked before) and returns the buffer to dispatch on.

        Raises:
            TypeError, ValueError: Bad input, raised before any communication (with ``validate``, on every rank of
                the group; else on the rank that has it, and the others raise a PeerFailure naming it, see
                :mod:`megatron_deepepv2.validation`).
            RuntimeError: A host-sync dispatch inside CUDA-graph capture.
            PeerFailure: A peer failed in this call's buffer build (:func:`peer_failure`).
        """
        config, group = self.config, self.group
        failures.count_call(group)
        data = x[0] if type(x) is tuple else x
        signature, num_tokens = _static_signature(x, topk_idx, topk_weights)
        capacity = config.num_max_tokens_per_rank
        problem = None
        # The static checks are a function of the signature and the token count T; what they check of T (every input
        # has T rows, T within a configured capacity) is integer compares, here and in _static_signature.
        if (signature is None or signature != self._signature or config.validate
                or (capacity is not None and num_tokens > capacity)):
            problem = validation.check_dispatch_inputs(
                x, topk_idx, topk_weights, num_experts=self.routing.num_experts, group_size=_dist.group_size(group),
                limits=config.backend.limits, layout=config.layout, expert_alignment=config.expert_alignment,
                zero_padding=config.zero_padding, num_max_tokens_per_rank=capacity, check_values=config.validate)
            if problem is None and config.fp8_dispatch:
                problem = fp8.fp8_dispatch_problem(x)
            if problem is None and signature != self._signature:  # another shape key: lease anew
                self._signature, self._buffer, self._buffer_spec = signature, None, None
        on_cuda = problem is None and topk_idx.is_cuda
        if config.host_sync and on_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "deepepv2 dispatch with host sync inside CUDA-graph capture: the dispatch waits on the host for sizes "
                "that captured kernels never produce (DeepEP would spin until its CPU timeout). Capture dispatches "
                "without host sync: host_sync=False, or MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 for Megatron layers.")
        num_experts = self.routing.num_experts
        if problem is None and config.check_ids and not config.validate:
            if not config.host_sync:  # nothing may read the device: a device-side assert (CPU: tensor ops)
                validation.assert_expert_ids_on_device(topk_idx, num_experts, group)
            elif on_cuda:  # the dispatch waits on the host anyway: one 4-byte read, a ValueError naming the token
                problem = validation.check_expert_ids_with_flag(topk_idx, num_experts)
            else:  # host tensors: read them
                problem = validation.check_expert_ids(topk_idx, num_experts)
        num_tokens = topk_idx.shape[0] if problem is None else 0
        if config.validate:  # every rank sends the same fields; one with a problem sends zeros
            alike = dict(zip(validation.DISPATCH_ALIKE, (validation.dtype_code(data.dtype), data.shape[1],
                                                         topk_idx.shape[1], int(type(x) is tuple or config.fp8_dispatch))
                             if problem is None else (0, 0, 0, 0)))
            num_tokens = validation.raise_on_every_rank(problem, group, agree=True, num_tokens=num_tokens, alike=alike)
        elif problem is not None:
            validation.raise_on_every_rank(problem, group, agree=False)
        buffer = self._buffer
        if buffer is None or buffer.retired or num_tokens > buffer.spec.num_max_tokens_per_rank:
            if self._buffer_spec is None:
                self._buffer_spec = BufferSpec(data.shape[1], topk_idx.shape[1], type(x) is tuple or config.fp8_dispatch,
                                               0, config.deterministic, config.num_sms, config.allow_hybrid_mode)
            try:
                buffer = self._buffer = buffers.get_buffer(
                    config.backend, group, self._buffer_spec, num_tokens,
                    configured_capacity=config.num_max_tokens_per_rank, growth_timeout_s=config.growth_timeout_s)
            except Exception as error:
                raise peer_failure(error, group) from error
        return buffer

    def dispatch(self, x: HiddenStates, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 streams: Streams) -> DispatchResult:
        """:func:`dispatch` on this binding (see there)."""
        buffer = self.prepare(x, topk_idx, topk_weights)
        data, scales = x if type(x) is tuple else (x, None)
        side: list = []
        try:
            recv_x, recv_weights = DispatchFunction.apply(data, topk_weights, (self, buffer, topk_idx, scales, streams, side))
        except Exception as error:
            raise peer_failure(error, self.group) from error
        recv_scales, recv_idx, handle = side
        return DispatchResult(recv_x if scales is None else (recv_x, recv_scales), recv_idx, recv_weights, handle)


def _static_signature(x: Any, topk_idx: Any, topk_weights: Any) -> tuple[Optional[tuple], int]:
    """What the static checks of a dispatch depend on but for its token count, and that count ``T``.

    The signature holds the types, dtypes, devices and trailing shapes of the inputs (hidden size, top-k, FP8 scale
    columns, whether weights come); it is None, so that the checks run and say what is wrong, when the inputs are not
    tensors or their row counts differ. A few attribute reads and tuple compares: it runs on every dispatch.
    """
    try:
        if type(x) is tuple:
            if len(x) != 2:
                return None, 0
            data, scales = x
            num_tokens = data.shape[0]
            if scales.shape[0] != num_tokens:
                return None, 0
            scales_key = (type(scales), scales.dtype, scales.shape[1:])
        else:
            data, scales_key = x, None
            num_tokens = data.shape[0]
        if topk_idx.shape[0] != num_tokens:
            return None, 0
        weights_key = None
        if topk_weights is not None:
            if topk_weights.shape[0] != num_tokens:
                return None, 0
            weights_key = (type(topk_weights), topk_weights.dtype, topk_weights.device, topk_weights.shape[1:])
        return ((type(data), data.dtype, data.device, data.shape[1:], scales_key,
                 type(topk_idx), topk_idx.dtype, topk_idx.device, topk_idx.shape[1:], weights_key), num_tokens)
    except (AttributeError, IndexError, TypeError, ValueError):  # not tensors (or 0-dim): the checks say what is wrong
        return None, 0


class DispatchFunction(torch.autograd.Function):
    """Autograd dispatch; see the module docstring. Its non-differentiable inputs come as one tuple (autograd's
    ``apply`` inspects each argument), and the outputs that take no gradient (received scales and ids, the handle)
    leave through the tuple's list rather than as autograd outputs, which each cost a wrapping."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: Optional[torch.Tensor], call: tuple):  # type: ignore[override]
        dispatcher, buffer, topk_idx, scales, streams, side = call
        config, routing = dispatcher.config, dispatcher.routing
        if config.fp8_dispatch:
            data = fp8.quantize_e4m3_1x128(x)
        else:
            data = x if scales is None else (x, scales)
        try:
            recv_x, recv_idx, recv_weights, handle = buffer.dispatch(data, topk_idx, topk_weights, routing, streams)
        except Exception as error:
            raise peer_failure(error, buffer.group) from error
        handle.config = config
        buffers.track_handle(handle)  # keeps its buffer alive through a rebuild until the handle is gone
        recv_scales = None
        if config.fp8_dispatch:
            recv_x = fp8.dequantize_e4m3_1x128(
                *recv_x, dtype=x.dtype, num_valid_rows=None if routing.host_sync else handle.num_valid_rows)
        elif scales is not None:
            recv_x, recv_scales = recv_x
            ctx.mark_non_differentiable(recv_x)
        if config.clear_tail and not routing.host_sync and (recv_idx is not None or recv_weights is not None):
            past = rows_past_valid(handle.num_recv_rows, handle.num_valid_rows)
            if recv_idx is not None:
                recv_idx = recv_idx.masked_fill(past.unsqueeze(1), -1)
            if recv_weights is not None:
                recv_weights = recv_weights.masked_fill(past if recv_weights.dim() == 1 else past.unsqueeze(1), 0.0)
        if config.mask_foreign_weights and recv_weights is not None and recv_idx is not None:
            recv_weights = recv_weights.masked_fill(recv_idx < 0, 0.0)
        ctx.set_materialize_grads(False)  # unused outputs give None, not zeros of an FP8 dtype
        ctx.handle, ctx.streams, ctx.hidden = handle, streams, x.shape[1]
        side.extend((recv_scales, recv_idx, handle))
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx: Any, grad_recv_x: Optional[torch.Tensor], grad_recv_weights: Optional[torch.Tensor]):
        handle: DispatchHandle = ctx.handle
        group = handle.backend.group
        failures.count_call(group)  # a call like the forward ones: failures of this backward are scoped to it
        try:  # the whole body: an error before the combine would leave the peers waiting in it
            rows = handle.num_recv_rows
            if grad_recv_x is None:
                # Only the weights want a gradient here (else backward would not run): its device is theirs.
                grad_recv_x = torch.zeros((rows, ctx.hidden), dtype=torch.bfloat16, device=grad_recv_weights.device)
            grad_weights = None
            if ctx.needs_input_grad[1]:  # weights were dispatched and want a gradient
                if grad_recv_weights is None:
                    shape = (rows,) if handle.routing.layout is ExpertLayout.EXPAND else (rows, handle.num_topk)
                    grad_recv_weights = torch.zeros(shape, dtype=torch.float32, device=grad_recv_x.device)
                grad_weights = grad_recv_weights.float().contiguous()  # before the backend captures its event
            grad_x, grad_topk_weights = handle.backend.combine(grad_recv_x.contiguous(), handle, grad_weights,
                                                               ctx.streams)
        except Exception as error:
            raise peer_failure(error, group) from error
        return grad_x, grad_topk_weights, None


class CombineFunction(torch.autograd.Function):
    """Autograd combine; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: DispatchHandle, streams: Streams):  # type: ignore[override]
        ctx.handle, ctx.streams = handle, streams
        try:
            return handle.backend.combine(x, handle, None, streams).x
        except Exception as error:
            raise peer_failure(error, handle.backend.group) from error

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        handle: DispatchHandle = ctx.handle
        group = handle.backend.group
        failures.count_call(group)  # a call like the forward ones: failures of this backward are scoped to it
        try:
            grad = handle.backend.cached_dispatch(grad_out.contiguous(), handle, None, ctx.streams).recv_x
        except Exception as error:
            raise peer_failure(error, group) from error
        if not handle.routing.host_sync and (handle.config is None or handle.config.clear_tail):
            # The rows past the valid extent are unspecified: zero them for a consumer that reduces over every row,
            # writing only those rows (a masked fill would read and write the whole worst-case buffer).
            if expert_kernels.AVAILABLE and grad.is_cuda:
                expert_kernels.zero_rows_from(grad, handle.num_valid_rows)
            else:
                grad = grad.masked_fill(rows_past_valid(grad.shape[0], handle.num_valid_rows).unsqueeze(1), 0)
        return grad, None, None


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
        config: A configuration from :meth:`DispatchConfig.resolve`: what repeated callers pass, so nothing is
            resolved per call. Without it, ``settings`` are resolved (once per distinct value).
        async_finish: Let communication finish asynchronously (the op still orders the current stream after it
            before returning, as Megatron's fused ops do).
        allocate_on_comm_stream: Allocate outputs on the communication stream (DeepEP, with ``async_finish``).
        **settings: Fields of :class:`DispatchConfig` (``layout="expand"``, ``expert_alignment``, ``zero_padding``,
            ``backend``, ``num_max_tokens_per_rank``, ``num_sms``, ``host_sync``, ``deterministic``, ``fp8_dispatch``,
            ...; unset ones come from the process-wide settings). ``host_sync=False``: worst-case sizes from the
            buffer capacity, valid rows first, counts on the device, no device-to-host copy in forward or backward
            (CUDA-graph capturable once the buffer exists); rows past ``handle.num_valid_rows`` have expert id -1
            and weight 0.

    Returns:
        The received rows, routing and the handle.

    Raises:
        TypeError, ValueError: Bad input or settings, raised before any communication (with the ``validate``
            setting on, on every rank of the group; see :mod:`megatron_deepepv2.validation`).
        ImportError: An explicitly requested backend cannot run here.
        PeerFailure: A RuntimeError naming each peer of the group that failed in this call (or waits at a buffer
            build this rank did not need) and its error; the group is unusable after it (see :func:`peer_failure`).
    """
    if config is None:
        config = _config_for(settings)
    elif settings:
        raise TypeError(f"dispatch() takes either config= or the settings it resolves ({sorted(settings)}), not both.")
    if isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point():
        topk_weights = topk_weights.float().contiguous()
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
    if isinstance(topk_idx, torch.Tensor):
        topk_idx = topk_idx.contiguous()
    bound = config.dispatcher(group if group is not None else dist.group.WORLD, num_experts)
    return bound.dispatch(x, topk_idx, topk_weights, STREAMS[bool(async_finish), bool(allocate_on_comm_stream)])


#: Configurations resolved for dispatch() calls without ``config=``, per settings, under the settings object they
#: were resolved with (configure() replaces that object, which empties the cache).
_resolved: dict[frozenset, DispatchConfig] = {}
_resolved_under: list = [None]


def _config_for(settings: dict[str, Any]) -> DispatchConfig:
    """:meth:`DispatchConfig.resolve` of ``settings``, resolved once per distinct settings and process settings."""
    if _resolved_under[0] is not get_settings():
        _resolved.clear()
        _resolved_under[0] = get_settings()
    try:
        key = frozenset(settings.items())
    except TypeError:  # an unhashable value: resolve it uncached (and let resolve say what is wrong with it)
        return DispatchConfig.resolve(**settings)
    config = _resolved.get(key)
    if config is None:
        if len(_resolved) >= 64:  # callers with ever-changing arguments: keep the cache bounded
            _resolved.clear()
        config = _resolved[key] = DispatchConfig.resolve(**settings)
    return config


def combine(
    x: torch.Tensor,
    handle: DispatchHandle,
    *,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
) -> torch.Tensor:
    """Sums each token's expert outputs back on its source rank (differentiable in ``x``).

    Args:
        x: Rows in the receive layout of ``handle``: compact ``[N, H]`` (each row the sum of the token's
            local experts' weighted outputs), expand ``[N_expanded, H]`` (one row per selection).
        handle: The handle returned by :func:`dispatch`.
        async_finish: See :func:`dispatch`.
        allocate_on_comm_stream: See :func:`dispatch`.

    Returns:
        ``[T, H]`` combined rows in ``x``'s dtype.

    Raises:
        TypeError, ValueError: If ``x`` does not fit ``handle`` or the backend (with ``validate``, on every rank).
        PeerFailure: A peer failed in this call; see :func:`dispatch`.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle returned by dispatch; got {type(handle).__name__}.")
    group = handle.backend.group
    failures.count_call(group)
    validate = handle.config is not None and handle.config.validate
    problem = validation.check_combine_inputs(x, handle, None)
    if problem is not None or validate:
        validation.raise_on_every_rank(problem, group, agree=validate)
    try:
        return CombineFunction.apply(x.contiguous(), handle, STREAMS[bool(async_finish), bool(allocate_on_comm_stream)])
    except Exception as error:
        raise peer_failure(error, group) from error
