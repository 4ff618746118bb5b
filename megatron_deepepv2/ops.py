"""Differentiable dispatch and combine: the autograd ops every caller (the Megatron manager included) uses.

=========  ==========================================  ==========================================
op         forward                                     backward
=========  ==========================================  ==========================================
dispatch   backend dispatch (fresh routing)            combine of the gradient, weights alongside
combine    backend combine                             cached dispatch of the gradient
=========  ==========================================  ==========================================

Ordering rule (Megatron-LM#5153 review): every kernel that produces a communication input --
``.contiguous()``, the fp32 cast of weights or gradients -- is enqueued *before* the event the
communication stream waits on is captured. Otherwise the communication stream can read unwritten memory.

FP8 dispatch (the configuration's ``fp8_dispatch``): the forward quantises ``x`` just before the backend's dispatch
and dequantises the received rows just after (:mod:`megatron_deepepv2.fp8`), so the backward is the BF16 one -- a
straight-through estimator for ``x``.

In the compact layout, weights received for experts of other ranks (``recv_topk_idx == -1``) are returned
as zero. Their gradient is therefore exactly zero, which is what combine-as-backward computes: it gathers
each top-k slot's weight gradient from the rank that owns the slot's expert only.

Host time per call (``tools/bench_host_overhead.py``): the configuration is resolved once (a
:class:`DispatchConfig`, or once per distinct arguments and settings), the static checks once per input signature,
the buffer is found by one tuple lookup, and each autograd function takes its non-differentiable arguments as one
object; what remains per call is the backend call, the handle and its weak record, and PyTorch's own cost of two
Python autograd functions.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

import torch
import torch.distributed as dist

from megatron_deepepv2 import _dist, buffers, fp8, validation
from megatron_deepepv2._dist import group_size
from megatron_deepepv2.backends import DispatchBackend, DispatchHandle, ExpertLayout, HiddenStates, resolve_backend
from megatron_deepepv2.config import get_settings


class DispatchResult(NamedTuple):
    """Output of :func:`dispatch` (a named tuple: building it costs a fraction of a dataclass's).

    Attributes:
        recv_x: Received rows (an FP8 pair when one was dispatched).
        recv_topk_idx: Compact: ``[N, K]`` local expert ids (-1 = other rank). Expand: None.
        recv_topk_weights: Compact: ``[N, K]`` fp32, zero where ``recv_topk_idx`` is -1 (unless the
            configuration's ``mask_foreign_weights`` is off). Expand: ``[N]`` fp32, zero on padding rows. None
            when no weights were dispatched.
        handle: Handle for :func:`combine` (``handle.num_valid_rows``: rows holding data, on the device).
    """

    recv_x: HiddenStates
    recv_topk_idx: Optional[torch.Tensor]
    recv_topk_weights: Optional[torch.Tensor]
    handle: DispatchHandle

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """``[E_local]`` int64 alignment-padded rows per local expert, on the rows' device.

        With host sync they are derived on first access only (``handle.tokens_per_expert_list`` already has
        them on the host); without, they were computed by the dispatch.
        """
        return self.handle.tokens_per_expert


@dataclass(frozen=True)
class DispatchConfig:
    """Everything about a dispatch that stays the same from call to call, resolved once.

    A caller that dispatches repeatedly with the same settings (the Megatron manager: one per MoE layer)
    resolves this once with :meth:`resolve` and passes it to every :func:`dispatch`; the backend choice, the
    settings and the backend's mode checks are then not redone per call.

    Attributes:
        backend: Backend class (a registered, usable backend).
        layout: Receive layout.
        expert_alignment: Expand layout: each expert block is padded to a multiple of this.
        zero_padding: Expand layout: padding rows are zero-filled.
        num_sms: SMs for the communication kernels (0 = backend's choice).
        host_sync: Whether the dispatch may wait on the host for exact sizes.
        deterministic: Bit-exact run to run.
        num_max_tokens_per_rank: Configured token capacity, or None for the largest first batch.
        validate: Host-side value checks agreed over the group (the ``validate`` setting).
        check_ids: Expert-id checks without a host sync when ``validate`` is off (the ``check_ids`` setting).
        growth_timeout_s: How long a capacity growth waits for the other ranks (the ``growth_timeout_s`` setting).
        mask_foreign_weights: Compact layout: zero the received weights of other ranks' experts. A caller that
            ignores those entries (Megatron's multihot conversion does) turns it off and saves a pass.
        fp8_dispatch: Quantise BF16 hidden states to e4m3 with 1x128 scales for the dispatch and hand back BF16
            rows (:mod:`megatron_deepepv2.fp8`); gradients stay BF16.
        passed_static_checks: Not a setting: the input signatures whose static checks passed under this
            configuration, so that they are not redone per call.
    """

    backend: type[DispatchBackend]
    layout: ExpertLayout = ExpertLayout.COMPACT
    expert_alignment: int = 1
    zero_padding: bool = False
    num_sms: int = 0
    host_sync: bool = True
    deterministic: bool = False
    num_max_tokens_per_rank: Optional[int] = None
    validate: bool = False
    check_ids: bool = True
    growth_timeout_s: float = 120.0
    mask_foreign_weights: bool = True
    fp8_dispatch: bool = False
    #: Input signatures (types, shapes, dtypes, devices, experts, group) whose static checks passed with this
    #: configuration: not a setting, a memo (a configuration made by replace() starts with none).
    passed_static_checks: set = field(default_factory=set, init=False, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> "DispatchConfig":
        # Immutable but for the memo, a cache that copies may share: a deep copy of a Megatron TransformerConfig
        # that carries this configuration gets the same object (the memo holds process groups, which cannot be
        # copied).
        return self

    def __getstate__(self) -> dict:
        # Pickled without the memo (its signatures hold process groups, which cannot be pickled); it starts empty.
        state = dict(self.__dict__)
        state.pop("passed_static_checks", None)
        return state

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "passed_static_checks", set())

    def remember_static_pass(self, signature: tuple) -> None:
        """Records that inputs of ``signature`` passed the static checks (bounded: callers whose shapes change every
        call, e.g. variable-length batches, start over past 256 signatures)."""
        if len(self.passed_static_checks) >= 256:
            self.passed_static_checks.clear()
        self.passed_static_checks.add(signature)

    @classmethod
    def resolve(
        cls,
        *,
        backend: Optional[str] = None,
        layout: Union[str, ExpertLayout] = ExpertLayout.COMPACT,
        expert_alignment: int = 1,
        zero_padding: bool = False,
        num_max_tokens_per_rank: Optional[int] = None,
        num_sms: Optional[int] = None,
        host_sync: Optional[bool] = None,
        deterministic: Optional[bool] = None,
        mask_foreign_weights: bool = True,
        check_ids: Optional[bool] = None,
        fp8_dispatch: Optional[bool] = None,
    ) -> "DispatchConfig":
        """Resolves the arguments of :func:`dispatch` (None = the process-wide setting) into a configuration.

        ``check_ids=False`` is for callers whose expert ids are valid by construction (the Megatron manager's come
        from ``torch.topk``); the ``validate`` setting checks them all the same.

        Raises:
            ValueError: For an unknown backend or layout, or a mode the backend cannot run.
            ImportError: An explicitly requested backend cannot run here.
        """
        settings = get_settings()
        config = cls(
            backend=resolve_backend(backend or settings.backend),
            layout=ExpertLayout.parse(layout),
            expert_alignment=int(expert_alignment),
            zero_padding=bool(zero_padding),
            num_sms=settings.num_sms if num_sms is None else int(num_sms),
            host_sync=not settings.no_host_sync if host_sync is None else bool(host_sync),
            deterministic=settings.deterministic if deterministic is None else bool(deterministic),
            num_max_tokens_per_rank=num_max_tokens_per_rank or settings.num_max_tokens_per_rank,
            validate=settings.validate,
            check_ids=settings.check_ids if check_ids is None else bool(check_ids),
            growth_timeout_s=float(settings.growth_timeout_s),
            mask_foreign_weights=bool(mask_foreign_weights),
            fp8_dispatch=settings.fp8_dispatch if fp8_dispatch is None else bool(fp8_dispatch),
        )
        problem = config.backend.preflight(host_sync=config.host_sync, deterministic=config.deterministic)
        if problem is not None:
            raise problem
        return config


class _DispatchCall(NamedTuple):
    """The non-differentiable arguments of one dispatch, handed to :class:`_DispatchFunction` as one object.

    (Autograd's ``apply`` inspects each argument on every call: one tuple costs less than seven.)
    """

    scales: Optional[torch.Tensor]
    topk_idx: torch.Tensor
    backend: DispatchBackend
    num_experts: int
    config: DispatchConfig
    async_finish: bool
    allocate_on_comm_stream: bool
    #: Filled by the forward with the outputs that take no gradient (received scales, received ids, handle): they
    #: leave through here rather than as autograd outputs, which each cost a wrapping.
    side_outputs: list


class _DispatchFunction(torch.autograd.Function):
    """Autograd dispatch; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, topk_weights: Optional[torch.Tensor], call: _DispatchCall):  # type: ignore[override]
        backend, config = call.backend, call.config
        if config.fp8_dispatch:  # quantised here, so that the backward is the BF16 one (straight through for x)
            data = fp8.quantize_e4m3_1x128(x)
        else:
            data = x if call.scales is None else (x, call.scales)
        out = backend.dispatch(
            data,
            call.topk_idx,
            topk_weights,
            num_experts=call.num_experts,
            layout=config.layout,
            expert_alignment=config.expert_alignment,
            zero_padding=config.zero_padding,
            async_finish=call.async_finish,
            allocate_on_comm_stream=call.allocate_on_comm_stream,
            # DeepEP accepts a previous event only together with allocate_on_comm_stream.
            previous_event=backend.capture_event() if call.allocate_on_comm_stream else None,
            host_sync=config.host_sync,
        )
        if call.async_finish:  # else the backend returned a completed event (the contract): nothing to wait for
            out.event.wait()
        if config.fp8_dispatch:
            recv_x, recv_scales = fp8.dequantize_e4m3_1x128(
                *out.recv_x, dtype=x.dtype, num_valid_rows=None if config.host_sync else out.handle.num_valid_rows), None
        elif call.scales is None:
            recv_x, recv_scales = out.recv_x, None
        else:
            recv_x, recv_scales = out.recv_x
            ctx.mark_non_differentiable(recv_x)
        recv_idx, recv_weights = out.recv_topk_idx, out.recv_topk_weights
        if recv_weights is not None and recv_idx is not None and config.mask_foreign_weights:
            recv_weights = recv_weights.masked_fill(recv_idx < 0, 0.0)
        ctx.set_materialize_grads(False)  # unused outputs give None, not zeros of an FP8 dtype
        # What the backward needs, and no more (keeping ``call`` would keep its ids and scales alive until then).
        ctx.handle = out.handle
        ctx.streams = (call.async_finish, call.allocate_on_comm_stream)
        ctx.device = call.topk_idx.device
        call.side_outputs.extend((recv_scales, recv_idx, out.handle))
        return recv_x, recv_weights

    @staticmethod
    def backward(ctx: Any, grad_recv_x, grad_recv_weights):
        handle: DispatchHandle = ctx.handle
        backend = handle.backend
        async_finish, allocate_on_comm_stream = ctx.streams
        if grad_recv_x is None:
            grad_recv_x = torch.zeros(
                (handle.num_recv_rows, backend.spec.hidden), dtype=torch.bfloat16, device=ctx.device
            )
        # Materialise every communication input before the event is captured.
        grad_recv_x = grad_recv_x.contiguous()
        grad_weights = None
        if ctx.needs_input_grad[1]:  # weights were dispatched and want a gradient
            if grad_recv_weights is None:
                shape = (handle.num_recv_rows,) if handle.layout is ExpertLayout.EXPAND else (
                    handle.num_recv_rows, handle.num_topk)
                grad_recv_weights = torch.zeros(shape, dtype=torch.float32, device=grad_recv_x.device)
            grad_weights = grad_recv_weights.float().contiguous()
        out = backend.combine(
            grad_recv_x,
            handle,
            grad_weights,
            async_finish=async_finish,
            allocate_on_comm_stream=allocate_on_comm_stream,
            previous_event=backend.capture_event() if allocate_on_comm_stream else None,
        )
        if async_finish:
            out.event.wait()
        return out.x, out.topk_weights, None


def _apply_dispatch(
    buffer: DispatchBackend,
    data: torch.Tensor,
    scales: Optional[torch.Tensor],
    topk_idx: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    num_experts: int,
    config: DispatchConfig,
    streams: tuple[bool, bool],
) -> tuple[Any, ...]:
    """Runs :class:`_DispatchFunction` on ``buffer`` with checked inputs.

    Returns:
        ``(recv_x, recv_weights, recv_scales, recv_idx, handle)``.
    """
    call = _DispatchCall(scales, topk_idx, buffer, num_experts, config, *streams, [])
    recv_x, recv_weights = _DispatchFunction.apply(data, topk_weights, call)
    return (recv_x, recv_weights, *call.side_outputs)


class _CombineFunction(torch.autograd.Function):
    """Autograd combine; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, handle: DispatchHandle, streams: tuple[bool, bool]):  # type: ignore[override]
        backend = handle.backend
        async_finish, allocate_on_comm_stream = streams
        out = backend.combine(
            x, handle, None, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
            previous_event=backend.capture_event() if allocate_on_comm_stream else None,
        )
        if async_finish:
            out.event.wait()
        ctx.handle = handle
        ctx.streams = streams
        return out.x

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        handle: DispatchHandle = ctx.handle
        backend = handle.backend
        async_finish, allocate_on_comm_stream = ctx.streams
        grad_out = grad_out.contiguous()  # before the event capture
        out = backend.cached_dispatch(
            grad_out, handle, None, async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
            previous_event=backend.capture_event() if allocate_on_comm_stream else None,
        )
        if async_finish:
            out.event.wait()
        return out.recv_x, None, None


def dispatch(
    x: HiddenStates,
    topk_idx: torch.Tensor,
    topk_weights: Optional[torch.Tensor],
    num_experts: int,
    *,
    group: Optional[dist.ProcessGroup] = None,
    layout: Union[str, ExpertLayout] = ExpertLayout.COMPACT,
    expert_alignment: int = 1,
    zero_padding: bool = False,
    backend: Optional[str] = None,
    num_max_tokens_per_rank: Optional[int] = None,
    num_sms: Optional[int] = None,
    async_finish: bool = False,
    allocate_on_comm_stream: bool = False,
    host_sync: Optional[bool] = None,
    deterministic: Optional[bool] = None,
    fp8_dispatch: Optional[bool] = None,
    config: Optional[DispatchConfig] = None,
) -> DispatchResult:
    """Sends tokens to the ranks of their experts (differentiable in ``x`` and ``topk_weights``).

    Args:
        x: ``[T, H]`` hidden states, or an FP8 pair ``(x_fp8 [T, H], scales [T, S])`` (not differentiable).
        topk_idx: ``[T, K]`` int64 global expert ids, -1 = no selection.
        topk_weights: ``[T, K]`` floating routing weights (cast to fp32), or None.
        num_experts: Global number of experts, a multiple of the group size.
        group: Expert-parallel process group (default: the world).
        layout: ``"compact"`` or ``"expand"``.
        expert_alignment: Expand layout: pad each expert's block to a multiple of this.
        zero_padding: Expand layout: zero-fill padding rows.
        backend: ``"auto"``, ``"deepep"`` or ``"reference"`` (default: the ``backend`` setting).
        num_max_tokens_per_rank: Token capacity, the same on every rank (default: the setting, else the
            largest first batch). A batch larger than an explicit value raises.
        num_sms: SMs for the communication kernels (default: the ``num_sms`` setting; 0 = backend's choice).
        async_finish: Let communication finish asynchronously (the op still orders the current stream
            after it before returning, as Megatron's fused ops do).
        allocate_on_comm_stream: Allocate outputs on the communication stream (DeepEP).
        host_sync: Let the dispatch wait on the host for exact output sizes (default: on unless the
            ``no_host_sync`` setting is set). False: worst-case sizes from the buffer capacity, valid rows
            first, counts on the device, no device-to-host copy in forward or backward (CUDA-graph
            capturable once the buffer exists). Rows past ``handle.num_valid_rows`` have expert id -1
            and weight 0.
        deterministic: Bit-exact run to run (default: the ``deterministic`` setting); the buffer is rebuilt
            when this changes.
        fp8_dispatch: Send BF16 ``x`` as e4m3 with 1x128 scales and receive BF16 rows (default: the
            ``fp8_dispatch`` setting); differentiable as without it (:mod:`megatron_deepepv2.fp8`).
        config: A configuration from :meth:`DispatchConfig.resolve` to use instead of ``layout`` ...
            ``deterministic`` (leave those at their defaults): what repeated callers pass, so nothing is
            resolved per call.

    Returns:
        The received rows, routing, tokens per local expert and the handle.

    Raises:
        TypeError, ValueError: Bad input, raised before any communication (with the ``validate``
            setting on, on every rank of the group; else on the rank that has it, and the others' communication
            then fails with a RuntimeError naming it, see :mod:`megatron_deepepv2.validation`).
        ImportError: An explicitly requested backend cannot run here.
    """
    arguments = (backend, layout, expert_alignment, zero_padding, num_max_tokens_per_rank, num_sms, host_sync,
                 deterministic, fp8_dispatch)
    if config is None:
        config = _config_for_arguments(arguments)
    elif arguments != _CONFIG_ARGUMENT_DEFAULTS:
        raise TypeError("dispatch() takes either config= or the settings it resolves (layout, expert_alignment, "
                        "zero_padding, backend, num_max_tokens_per_rank, num_sms, host_sync, deterministic, "
                        "fp8_dispatch), not both.")
    group = group if group is not None else dist.group.WORLD
    _dist.count_call(group)
    if topk_weights is not None and isinstance(topk_weights, torch.Tensor) and topk_weights.is_floating_point():
        topk_weights = topk_weights.float().contiguous()
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
    # Reading ids costs nothing on CPU tensors, so there the default id check is the host check naming the token --
    # except without host sync, which promises no host read of device data, CPU or not. On CUDA the check is a
    # kernel: with host sync its flag is read on the host (a ValueError, as on CPU), without it a device assert.
    host_id_check = config.validate or (config.check_ids and config.host_sync and isinstance(topk_idx, torch.Tensor)
                                        and not topk_idx.is_cuda)
    device_id_check = config.check_ids and not host_id_check
    if config.host_sync and isinstance(topk_idx, torch.Tensor) and topk_idx.is_cuda \
            and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "deepepv2 dispatch with host sync inside CUDA-graph capture: the dispatch waits on the host for sizes "
            "that captured kernels never produce (DeepEP would spin until its CPU timeout). Capture dispatches "
            "without host sync: host_sync=False, or MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 for Megatron layers."
        )
    # The static checks depend on the inputs' types, shapes, dtypes and devices only: a signature that passed once
    # passes again (plain tensors only; anything else is checked in full every call).
    signature = None
    if type(x) is torch.Tensor and type(topk_idx) is torch.Tensor and (
            topk_weights is None or type(topk_weights) is torch.Tensor):
        signature = (x.shape, x.dtype, x.device, topk_idx.shape, topk_idx.dtype, topk_idx.device, num_experts, group,
                     None if topk_weights is None else (topk_weights.shape, topk_weights.dtype, topk_weights.device))
    if signature is not None and signature in config.passed_static_checks:
        problem = validation.check_expert_ids(topk_idx, num_experts) if host_id_check else None
    else:
        problem = validation.check_dispatch_inputs(
            x,
            topk_idx,
            topk_weights,
            num_experts=num_experts,
            group_size=group_size(group),
            limits=config.backend.limits,
            layout=config.layout,
            expert_alignment=config.expert_alignment,
            zero_padding=config.zero_padding,
            num_max_tokens_per_rank=config.num_max_tokens_per_rank,
            check_values=host_id_check,
        )
        if problem is None and config.fp8_dispatch:
            problem = fp8.fp8_dispatch_problem(x)
        if problem is None and signature is not None:
            config.remember_static_pass(signature)
    if problem is None and device_id_check and config.host_sync:
        problem = validation.check_expert_ids_with_flag(topk_idx, num_experts)
    if problem is None and not config.validate:
        max_tokens = topk_idx.shape[0]  # the common case: nothing to raise, nothing to agree on
    else:
        num_tokens = topk_idx.shape[0] if problem is None else 0
        alike = None
        if config.validate:  # every rank sends the same fields; one with a problem sends zeros
            data = x[0] if isinstance(x, tuple) else x
            alike = dict(zip(validation.DISPATCH_ALIKE, (validation.dtype_code(data.dtype), data.shape[1],
                                                         topk_idx.shape[1], int(isinstance(x, tuple) or config.fp8_dispatch))
                             if problem is None else (0, 0, 0, 0)))
        max_tokens = validation.raise_on_every_rank(problem, group, agree=config.validate, num_tokens=num_tokens,
                                                    alike=alike)
    topk_idx = topk_idx.contiguous()
    if device_id_check and not config.host_sync:
        validation.assert_expert_ids_on_device(topk_idx, num_experts, group)

    data, scales = x if isinstance(x, tuple) else (x, None)
    try:
        buffer = buffers.get_buffer(
            config.backend,
            group,
            hidden=data.shape[1],
            num_topk=topk_idx.shape[1],
            use_fp8=scales is not None or config.fp8_dispatch,
            num_tokens=max_tokens,
            configured_capacity=config.num_max_tokens_per_rank,
            deterministic=config.deterministic,
            num_sms=config.num_sms,
            growth_timeout_s=config.growth_timeout_s,
            host_sync=config.host_sync,
        )
        recv_x, recv_weights, recv_scales, recv_idx, handle = _apply_dispatch(
            buffer, data, scales, topk_idx, topk_weights, num_experts, config, (async_finish, allocate_on_comm_stream))
    except Exception as error:
        raise _with_peer_failures(error, group) from error
    handle.validate = config.validate  # combine agrees on its errors as the dispatch did
    buffers.track_handle(handle)  # keeps its buffer alive through a rebuild until the handle is gone
    if scales is not None:
        recv_x = (recv_x, recv_scales)
    return DispatchResult(recv_x, recv_idx, recv_weights, handle)


def _with_peer_failures(error: Exception, group: dist.ProcessGroup) -> Exception:
    """``error``, or one naming the peers that announced a failure first (the likely cause of ``error``)."""
    failures = _dist.announced_failures(group)
    if not failures:
        return error
    causes = "; ".join(f"rank {rank}: {message}" for rank, message in sorted(failures.items()))
    return RuntimeError(f"Rank(s) {sorted(failures)} of the expert-parallel group rejected their dispatch or combine "
                        f"and stopped ({causes}); this rank's communication then failed: {type(error).__name__}: "
                        f"{error}")


#: The arguments of dispatch() that a DispatchConfig replaces, in the order dispatch() packs them, and their defaults
#: (read from its signature, so that they cannot drift from it).
_ARGUMENT_NAMES = ("backend", "layout", "expert_alignment", "zero_padding", "num_max_tokens_per_rank", "num_sms",
                   "host_sync", "deterministic", "fp8_dispatch")
_CONFIG_ARGUMENT_DEFAULTS = tuple(inspect.signature(dispatch).parameters[name].default for name in _ARGUMENT_NAMES)
#: Configurations resolved for dispatch() calls without ``config=``, per argument tuple, under the settings object
#: they were resolved with (configure() replaces that object, which empties the cache).
_resolved_configs: dict[tuple, DispatchConfig] = {}
_resolved_under: list = [None]


def _config_for_arguments(arguments: tuple) -> DispatchConfig:
    """:meth:`DispatchConfig.resolve` of dispatch()'s arguments, resolved once per distinct arguments and settings.

    The resolution is a function of the arguments, the process-wide settings and the backend registry (whose names,
    once registered, never change class), so a caller that passes the same arguments each step gets the same
    configuration without redoing it.
    """
    settings = get_settings()
    if _resolved_under[0] is not settings:
        _resolved_configs.clear()
        _resolved_under[0] = settings
    try:
        config = _resolved_configs.get(arguments)
        hashable = True
    except TypeError:  # an unhashable argument: resolve it uncached (and let resolve say what is wrong with it)
        config, hashable = None, False
    if config is None:
        config = DispatchConfig.resolve(**dict(zip(_ARGUMENT_NAMES, arguments)))
        if hashable:
            if len(_resolved_configs) >= 64:  # callers with ever-changing arguments: keep the cache bounded
                _resolved_configs.clear()
            _resolved_configs[arguments] = config
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
        TypeError, ValueError: If ``x`` does not fit ``handle`` or the backend.
    """
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"handle must be the DispatchHandle returned by dispatch; got {type(handle).__name__}.")
    _dist.count_call(handle.backend.group)
    # The backend's mode checks ran when the dispatch's configuration was resolved.
    problem = validation.check_combine_inputs(x, handle, None)
    if problem is not None or handle.validate:
        validation.raise_on_every_rank(problem, handle.backend.group, agree=handle.validate)
    try:
        return _CombineFunction.apply(x.contiguous(), handle, (async_finish, allocate_on_comm_stream))
    except Exception as error:
        raise _with_peer_failures(error, handle.backend.group) from error
