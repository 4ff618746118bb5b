"""The rules on settings, configurations and dispatch/combine inputs, each written once, each error naming the
argument, its value and the fix; all run before any communication (a rank raising inside a collective would leave its
peers waiting). :func:`raise_on_every_rank` raises a rank's problem alone (announced to its peers) or, with
``validate``, on every rank together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_deepepv2.expert_ids import check_expert_ids
from megatron_deepepv2.failures import agreed, all_gather_ints, all_reduce_max, announce_failure, announced_failures
from megatron_deepepv2.fp8 import BLOCK as FP8_BLOCK
from megatron_deepepv2.layout import ExpertLayout

if TYPE_CHECKING:
    from megatron_deepepv2.backends.base import BackendLimits, DispatchConfig, DispatchHandle
    from megatron_deepepv2.config import DeepepV2Settings
    from megatron_deepepv2.layout import HiddenStates

_FP8_DTYPES = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name))
MANAGERS = ("plugin", "native")  # the values of the manager and experts settings
EXPERTS = ("spec", "sync_free")


def _dtype_names(dtypes: Sequence[torch.dtype]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_settings(settings: "DeepepV2Settings") -> None:
    """Checks the values of ``settings``.

    Raises:
        ValueError: For a value its setting cannot take, naming the setting's environment variable.
    """
    if settings.manager not in MANAGERS:
        raise ValueError(f"manager={settings.manager!r} is not one of {', '.join(MANAGERS)} "
                         "(MEGATRON_DEEPEPV2_MANAGER: 'plugin' for this package's deepepv2, 'native' for "
                         "megatron-core's own).")
    if settings.experts not in EXPERTS:
        raise ValueError(f"experts={settings.experts!r} is not one of {', '.join(EXPERTS)} (MEGATRON_DEEPEPV2_EXPERTS: "
                         "'spec' for the layer spec's experts, 'sync_free' for SyncFreeSequentialMLP in place of "
                         "SequentialMLP).")
    if settings.num_max_tokens_per_rank is not None and int(settings.num_max_tokens_per_rank) <= 0:
        raise ValueError(f"num_max_tokens_per_rank={settings.num_max_tokens_per_rank} must be a positive token "
                         "count, or unset to take the largest first batch over the ranks "
                         "(MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK).")
    if float(settings.growth_timeout_s) <= 0:
        raise ValueError(f"growth_timeout_s={settings.growth_timeout_s} must be a positive number of seconds "
                         "(MEGATRON_DEEPEPV2_GROWTH_TIMEOUT_S).")
    if int(settings.num_sms) < 0:
        raise ValueError(f"num_sms={settings.num_sms} must be >= 0, 0 letting the backend choose "
                         "(MEGATRON_DEEPEPV2_NUM_SMS).")


def check_dispatch_config(config: "DispatchConfig") -> None:
    """Checks a dispatch configuration and its settings (run once, when it is resolved).

    Raises:
        ValueError: For a setting out of range, an alignment below 1, zero padding outside the expand layout, padded
            expand blocks without zero padding, or deterministic mode where the backend cannot order
            the received rows (``deterministic_order_problem``).
    """
    check_settings(config.settings)
    alignment = config.expert_alignment
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise ValueError(f"expert_alignment={alignment!r} must be an integer >= 1 (1 = no padding).")
    if config.zero_padding and config.layout is not ExpertLayout.EXPAND:
        raise ValueError("zero_padding=True only applies to layout='expand'; compact rows have no padding.")
    if config.zero_padding is False and config.layout is ExpertLayout.EXPAND and alignment > 1:
        raise ValueError(f"zero_padding=False with layout='expand' and expert_alignment={alignment} would leave the "
                         "padding rows holding whatever the memory held (NaN or -inf included), and a grouped GEMM's "
                         "weight gradient reads them. Leave zero_padding unset (it zero-fills whenever blocks are "
                         "padded), or use expert_alignment=1 for blocks without padding.")
    settings = config.settings
    problem = settings.deterministic and config.backend.deterministic_order_problem(settings.host_sync)
    if problem:
        mode, or_sync = ("", "") if settings.host_sync else (" without host sync", ", or MEGATRON_DEEPEPV2_NO_HOST_SYNC")
        raise ValueError(f"Deterministic mode{mode} is not available on the {config.backend.name} backend as installed: "
                         f"{problem} Install DeepEP 2.1.0 or V2.5, or turn off deterministic mode "
                         f"(MEGATRON_DEEPEPV2_DETERMINISTIC / Megatron's --deterministic-mode){or_sync}.")


def check_binding(num_experts: int, group_size: int) -> None:
    """Checks that every rank of a group of ``group_size`` ranks hosts the same number of experts.

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


def check_megatron_config(config: Any) -> None:
    """Raises a ValueError, saying what to change, for a ``TransformerConfig`` selecting deepepv2 in a combination it
    does not support."""
    if getattr(config, "moe_enable_deepep", False):
        raise ValueError(
            "moe_enable_deepep=True selects the DeepEP v1 backend but moe_flex_dispatcher_backend='deepepv2' "
            "was also given. Drop --moe-enable-deepep (deprecated) and keep --moe-flex-dispatcher-backend deepepv2.")
    rank_capacity_factor = getattr(config, "moe_expert_rank_capacity_factor", None)
    if rank_capacity_factor is not None and not rank_capacity_factor > 0:
        raise ValueError(f"moe_expert_rank_capacity_factor={rank_capacity_factor} must be a positive factor of the "
                         "per-rank receive (tokens per rank x top-k), or unset for a dropless receive.")
    if getattr(config, "moe_paged_stash", False):
        raise ValueError(
            "moe_paged_stash is not supported with moe_flex_dispatcher_backend='deepepv2'. Megatron's paged stash "
            "pages only the Transformer Engine grouped tensors that TEGroupedMLP's op-fuser path saves for backward "
            "(--use-transformer-engine-op-fuser --moe-grouped-gemm), a path that has never run with deepepv2: its "
            "tested experts (SyncFreeSequentialMLP, SequentialMLP) save plain tensors, which paged stash leaves in "
            "place. Drop --moe-paged-stash: --moe-expert-rank-capacity-factor alone bounds the experts' receive, and "
            "Megatron's over-budget rerun (a dropless rerun of a step that dropped tokens) works with deepepv2.")
    if config.num_moe_experts is None:
        return
    if config.moe_token_dispatcher_type != "flex":
        raise ValueError(
            f"moe_flex_dispatcher_backend='deepepv2' requires moe_token_dispatcher_type='flex' (got "
            f"{config.moe_token_dispatcher_type!r}); pass --moe-token-dispatcher-type flex.")
    if config.moe_pad_expert_input_to_capacity:
        raise ValueError(
            "Flex token dispatcher with the deepepv2 backend does not support moe_pad_expert_input_to_capacity; "
            "drop --moe-pad-expert-input-to-capacity (capacity dropping with --moe-expert-capacity-factor works).")


def check_fp8_model(config: Any) -> None:
    """Raises for a ``TransformerConfig`` whose layers dispatch in FP8: a TypeError if the model does not train in
    BF16, a ValueError if its hidden size is not a multiple of 128."""
    bf16 = bool(getattr(config, "bf16", False)) or getattr(config, "params_dtype", None) == torch.bfloat16
    if not bf16:
        raise TypeError("FP8 dispatch (MEGATRON_DEEPEPV2_FP8_DISPATCH=1) quantises BF16 hidden states; this model "
                        "does not train in BF16. Add --bf16 or turn FP8 dispatch off.")
    problem = fp8_hidden_size_problem(config.hidden_size)
    if problem is not None:
        raise problem


def check_sync_free_experts(config: Any, expert_tp_size: int) -> None:
    """Raises a ValueError for what a ``TransformerConfig`` asks of ``SyncFreeSequentialMLP`` experts that they lack:
    expert tensor parallelism, biases, FP8/FP4, delayed weight gradients or TE's activation."""
    if expert_tp_size > 1:
        raise ValueError("SyncFreeSequentialMLP supports expert tensor parallel size 1; set "
                         "--expert-tensor-parallel-size 1.")
    if config.add_bias_linear:
        raise ValueError("SyncFreeSequentialMLP supports experts without bias; pass --disable-bias-linear.")
    if config.fp8 or config.fp4:
        raise ValueError("SyncFreeSequentialMLP runs BF16/FP32 grouped GEMMs; drop --fp8-format / --fp4-format for "
                         "its experts. (FP8/FP4 experts without host sync would be TEGroupedMLP with "
                         "--use-transformer-engine-op-fuser, which has never run with deepepv2.)")
    if getattr(config, "delay_wgrad_compute", False):
        raise ValueError("SyncFreeSequentialMLP computes weight gradients in backward; unset --delay-wgrad-compute.")
    if getattr(config, "use_te_activation_func", False):
        raise ValueError("SyncFreeSequentialMLP applies config.activation_func itself; unset --use-te-activation-func.")


def host_sync_capture_problem() -> RuntimeError:
    """The error of a dispatch with host sync inside CUDA-graph capture."""
    return RuntimeError(
        "deepepv2 dispatch with host sync inside CUDA-graph capture: the dispatch waits on the host for sizes that "
        "captured kernels never produce (DeepEP would spin until its CPU timeout). Capture dispatches without host "
        "sync: host_sync=False, or MEGATRON_DEEPEPV2_NO_HOST_SYNC=1 for Megatron layers.")


def check_dispatch_inputs(x: "HiddenStates", topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], *,
                          limits: "BackendLimits", fp8_dispatch: bool = False,
                          num_max_tokens_per_rank: Optional[int] = None, num_experts: int = 0,
                          check_values: bool = False) -> Optional[Exception]:
    """Checks dispatch arguments (``x`` ``[T, H]`` or an FP8 pair, ``topk_idx`` int64 ``[T, K]``, ``topk_weights``
    fp32 ``[T, K]`` or None) against the backend's ``limits``, FP8 dispatch (``x`` BF16) and the token limit; with
    ``check_values`` also the ids' values (read on the host).

    Returns:
        A ``TypeError`` or ``ValueError`` describing the first problem, or None when all is well.
    """
    is_fp8 = isinstance(x, tuple)
    if is_fp8 and (len(x) != 2 or not all(isinstance(t, torch.Tensor) for t in x)):
        return TypeError(f"x must be a tensor [T, H] or an FP8 pair (x_fp8 [T, H], scales [T, S]); got a tuple of "
                         f"{len(x)} item(s) of types {[type(t).__name__ for t in x]}.")
    if not is_fp8 and not isinstance(x, torch.Tensor):
        return TypeError(f"x must be a torch.Tensor [T, H] or an FP8 pair; got {type(x).__name__}.")
    if fp8_dispatch and is_fp8:
        return TypeError("FP8 dispatch quantises BF16 hidden states itself; pass the BF16 tensor, not an FP8 pair "
                         "(or turn FP8 dispatch off to pass pairs through).")
    data, scales = x if is_fp8 else (x, None)
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
                          f"multiple of {limits.combine_hidden_multiple}, or the reference backend.")
    if limits.requires_cuda and not data.is_cuda:
        return ValueError(f"x is on {data.device}; this backend needs CUDA tensors. Move inputs with .cuda().")
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
    if num_max_tokens_per_rank is not None and num_tokens > num_max_tokens_per_rank:
        return ValueError(f"This rank dispatches {num_tokens} tokens but num_max_tokens_per_rank="
                          f"{num_max_tokens_per_rank}. Raise num_max_tokens_per_rank "
                          "(MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK) to at least the largest per-rank token count; it "
                          "must be the same on every rank.")
    return check_expert_ids(topk_idx, num_experts) if check_values else None


def not_a_handle(handle: Any) -> TypeError:  # the error of a combine given something else than a handle
    return TypeError(f"handle must be the DispatchHandle returned by dispatch; got {type(handle).__name__}.")


def check_combine_inputs(x: torch.Tensor, handle: "DispatchHandle",
                         topk_weights: Optional[torch.Tensor]) -> Optional[Exception]:
    """Checks combine arguments against the handle of the dispatch being reversed (its backend's limits apply):
    ``x`` is ``[handle.num_recv_rows, H]``; ``topk_weights`` float32 ``[rows]`` (expand) or ``[rows, K]``, or None.

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
    expected = (rows,) if handle.config.layout is ExpertLayout.EXPAND else (rows, handle.num_topk)
    if topk_weights is not None and (topk_weights.dtype != torch.float32 or tuple(topk_weights.shape) != expected):
        return ValueError(f"combine topk_weights must be float32 of shape {expected}; got {topk_weights.dtype} "
                          f"{tuple(topk_weights.shape)}.")
    return None


#: What every rank's dispatch inputs must share, in the order :func:`raise_on_every_rank` agrees on them.
DISPATCH_ALIKE = ("dtype", "hidden size", "top-k", "FP8")
#: dtypes by a small code, for the cross-rank agreement (0: any other dtype).
_DTYPE_CODES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming ``dtype`` the same on every rank (see :func:`raise_on_every_rank`)."""
    return _DTYPE_CODES.index(dtype) + 1 if dtype in _DTYPE_CODES else 0


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPE_CODES[value - 1]).removeprefix("torch.") if 0 < value <= len(_DTYPE_CODES) else "another"
    if field in ("FP8", "allow_hybrid_mode"):
        return "auto" if value < 0 else "yes" if value else "no"
    return str(value)


def raise_on_every_rank(problem: Optional[Exception], group: dist.ProcessGroup, *, agree: bool, num_tokens: int = 0,
                        alike: Optional[dict[str, int]] = None) -> int:
    """Raises ``problem``; with ``agree``, first makes every rank of ``group`` raise together.

    With ``agree`` this is collective: one small all-reduce (error flags, token count, range of each ``alike`` value),
    plus an all-gather only when values differ. Without it, ``problem`` is announced to the peers, then raised.

    Args:
        problem, group: This rank's problem (or None) and the dispatch's process group.
        agree: Share the outcome over ``group``.
        num_tokens, alike: This rank's token count (maximised over the group) and the integer-coded values every
            rank must share (``dtype`` as :func:`dtype_code`), or None.

    Returns:
        The largest token count over the group (``num_tokens`` itself without ``agree``).

    Raises:
        TypeError, ValueError: ``problem``; with ``agree``, on the other ranks a ValueError naming each rank that had
            one and its error, or each rank's differing values; each marked by ``failures.agreed``.
    """
    if not agree:
        if problem is not None:
            announce_failure(group, problem)  # for the peers, whose next collective fails without this rank
            raise problem
        return num_tokens
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    flags = [0] * world
    flags[rank] = int(problem is not None)
    fields = list((alike or {}).items())  # the same names on every rank (a rank with a problem sends zeros)
    values = [value for _, value in fields]
    if problem is not None:  # before the all-reduce, so that every peer can read it once the flags arrive
        announce_failure(group, problem, interrupt=False)
    outcome = all_reduce_max(flags + [num_tokens] + values + [-value for value in values], group)
    if problem is not None:
        raise agreed(problem)
    if any(outcome[:world]):
        ranks = dist.get_process_group_ranks(group)
        failed = [ranks[r] for r in range(world) if outcome[r]]
        errors = announced_failures(group)
        said = "; ".join(f"rank {r}: {errors[r]}" for r in failed if r in errors)
        unsaid = [r for r in failed if r not in errors]
        if unsaid:  # the store could not be read: the errors are only on those ranks
            said += f"{'; ' if said else ''}rank(s) {unsaid}: their error is raised there"
        raise agreed(ValueError(f"Rank(s) {failed} of the expert-parallel group rejected their dispatch or combine "
                                f"inputs ({said}); this rank's inputs were valid but it stops too instead of waiting."))
    count = len(values)
    highs, lows = outcome[world + 1:world + 1 + count], [-v for v in outcome[world + 1 + count:]]
    differing = [name for (name, _), high, low in zip(fields, highs, lows) if high != low]
    if differing:
        ranks = dist.get_process_group_ranks(group)
        every = all_gather_ints(values, group)
        described = "; ".join(
            f"rank {ranks[r]}: " + ", ".join(f"{name} {_describe(name, v)}" for (name, _), v in zip(fields, every[r])
                                             if name in differing)
            for r in range(world))
        raise agreed(ValueError(
            f"The ranks of the expert-parallel group dispatch inputs whose {', '.join(differing)} differ "
            f"({described}). Every rank must dispatch the same dtype, hidden size, top-k and FP8-ness with the same "
            "determinism and SM count: they fix the layout of the exchange. Give every rank the same model "
            "configuration and settings."))
    return outcome[world]
