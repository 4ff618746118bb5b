"""Megatron-Core integration: every patch this package applies to Megatron, applied by one :func:`install`.

Megatron-Core 0.17 - 0.19.x picks flex-dispatcher backends by string comparisons spread over several
modules. ``install()`` makes each of them accept ``"deepepv2"``:

======================================  ===========================================================
place                                   change
======================================  ===========================================================
``TransformerConfig`` field type        ``Literal[...]`` gains ``'deepepv2'`` so the CLI accepts it
``TransformerConfig.__post_init__``     deepepv2 validated like deepep: flex required, pad-to-capacity
                                        rejected, TPxEP = 1 accepted (one rank runs the same path);
                                        ``moe_enable_deepep`` with deepepv2 is
                                        rejected instead of silently becoming deepep
``moe_layer.MoEFlexTokenDispatcher``    rebound to :class:`DeepepV2FlexTokenDispatcher`, which builds
                                        :class:`~megatron_deepepv2.mcore.manager._DeepepV2Manager` for
                                        deepepv2 (and runs its ``dispatch_preprocess`` without
                                        ``torch.compile``) and defers to Megatron for every other backend
``should_free_input``                   deepepv2 keeps the EP-overlap schedule's inputs like deepep, and
                                        (expand) the experts' input like hybridep
``build_transformer_layer_callables``   deepepv2 detaches probs across schedule nodes like deepep
``skip_routed_expert_padding``          experts skip their own padding when deepepv2 already padded
                                        (megatron-core >= 0.18; 0.17 has no such hook)
``MoELayer.__init__``                   ``MEGATRON_DEEPEPV2_EXPERTS=sync_free`` gives every MoE layer
                                        (any dispatcher) ``SyncFreeSequentialMLP`` experts; with no host
                                        sync, a deepepv2 layer checks that its experts take device-side
                                        token counts (:mod:`~megatron_deepepv2.mcore.experts`)
``MoEFlexTokenDispatcher.reset_``       deepepv2 clears the manager's ``dropped_rows`` with
``over_budget``                         ``over_budget`` (Megatron's over-budget rerun calls it)
``ModelParallelConfig.finalize_``       every call of ``config.finalize_model_grads_func`` (the
``model_grads_func``                    schedules call it once per training step, after backward)
                                        then releases retired deepepv2 buffers
                                        (``buffers.release_retired_buffers``)
``deep_ep.utils.EventOverlap``          with DeepEP 2.1 installed: the name Megatron's ``fused_a2a``
                                        imports (2.1 moved it to ``deep_ep``), so Megatron's own
                                        ``deepep`` backend finds 2.1's legacy ``Buffer``
======================================  ===========================================================

``moe_expert_rank_capacity_factor`` (megatron-core >= 0.19), which Megatron accepts for hybridep and ncclep only, is
accepted for deepepv2 too: the manager bounds the experts' receive with HybridEP's budget, and Megatron's over-budget
rerun (``PagedStashRunner``, which ``megatron.training`` wraps around the step whenever the factor is set) clears and
restores the manager's ``moe_expert_rank_capacity_factor`` as for HybridEP. ``moe_paged_stash`` is refused with
deepepv2 (:func:`validate_config` says why).

``install()`` is idempotent. Before 0.17 it raises; a release newer than the tested ones (0.17 - 0.19.x) gets a
warning, and a patch point such a release no longer has raises naming it.

**A megatron-core that ships its own ``deepepv2``** (Megatron-LM's dev branch since #4793; 0.20 lists it): one
switch, ``MEGATRON_DEEPEPV2_MANAGER`` (:mod:`megatron_deepepv2.config`), decides. ``plugin`` (the default) keeps
this package's manager for ``--moe-flex-dispatcher-backend deepepv2``, because it is a superset of the native one
(which syncs the host and all-reduces on every call, receives the compact layout only and cannot be captured in a
CUDA graph); ``native`` leaves Megatron unpatched. ``install()`` logs the choice, and the first deepepv2 layer logs
which manager it got.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import threading
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from packaging.version import Version

from megatron_deepepv2.mcore.megatron_config import check_megatron_config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

BACKEND_NAME = "deepepv2"
MIN_MEGATRON = Version("0.17.0")
#: Releases past the last tested one get a warning, not an error.
TESTED_BELOW = Version("0.20.0")
TESTED_RANGE = f">={MIN_MEGATRON.base_version},<{TESTED_BELOW.base_version}"


@dataclass
class InstallReport:
    """What :func:`install` did.

    Attributes:
        megatron_version: The installed megatron-core version.
        native: deepepv2 layers use megatron-core's own manager; nothing was patched.
        native_available: The installed megatron-core ships a deepepv2 of its own.
        manager: The ``manager`` setting that decided (``plugin`` or ``native``).
        patches: Names of the patches applied.
    """

    megatron_version: str
    native: bool = False
    native_available: bool = False
    manager: str = "plugin"
    patches: list[str] = field(default_factory=list)


_report: Optional[InstallReport] = None
_install_lock = threading.Lock()
_callables_lock = threading.Lock()


def megatron_version() -> Version:
    """Returns the installed megatron-core version."""
    from megatron.core import package_info  # noqa: PLC0415

    return Version(package_info.__version__)


def _config_class():
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    return TransformerConfig


def supports_deepepv2_natively() -> bool:
    """Whether the installed megatron-core ships a deepepv2 backend of its own."""
    if _report is not None:  # after install() the Literal holds our own addition
        return _report.native_available
    from megatron.core.transformer.moe import token_dispatcher  # noqa: PLC0415

    if hasattr(token_dispatcher, "_DeepepV2Manager"):
        return True
    backend_type = _config_class().__dataclass_fields__["moe_flex_dispatcher_backend"].type
    return BACKEND_NAME in typing.get_args(backend_type)


def is_deepepv2(config: Any) -> bool:
    """Whether ``config`` selects the flex dispatcher with the deepepv2 backend."""
    return (
        getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and getattr(config, "moe_flex_dispatcher_backend", None) == BACKEND_NAME
    )


class _AsDeepEP:
    """Read-only view of a config that reports backend ``deepep``: Megatron's deepep branches then apply."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        if name == "moe_flex_dispatcher_backend":
            return "deepep"
        return getattr(object.__getattribute__(self, "_config"), name)


# ----------------------------------------------------------------------------------------------
# Individual patches
# ----------------------------------------------------------------------------------------------
def _widen_backend_literal() -> None:
    base = _config_class()
    for cls in [base, *_all_subclasses(base)]:
        f = cls.__dataclass_fields__.get("moe_flex_dispatcher_backend")
        if f is None or BACKEND_NAME in typing.get_args(f.type):
            continue
        widened = typing.Literal[(*typing.get_args(f.type), BACKEND_NAME)]
        f.type = widened
        cls.__annotations__["moe_flex_dispatcher_backend"] = widened


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found.append(sub)
        found.extend(_all_subclasses(sub))
    return found


def validate_config(config: Any) -> None:
    """Checks a ``TransformerConfig`` that selects deepepv2 (run around Megatron's own checks).

    Raises:
        ValueError: For a combination deepepv2 does not support
            (:func:`megatron_deepepv2.mcore.megatron_config.check_megatron_config`).
    """
    if getattr(config, "moe_flex_dispatcher_backend", None) == BACKEND_NAME:
        check_megatron_config(config)


def _patch_config_validation() -> None:
    cls = _config_class()
    original = cls.__post_init__
    if getattr(original, "_deepepv2_plugin", False):
        return

    @functools.wraps(original)
    def __post_init__(self) -> None:
        deepepv2 = getattr(self, "moe_flex_dispatcher_backend", None) == BACKEND_NAME
        if deepepv2:
            # Before Megatron's checks: Megatron rewrites the backend to "deepep" under moe_enable_deepep, and would
            # answer moe_paged_stash with "requires moe_expert_rank_capacity_factor", which it does not see here.
            validate_config(self)
        # Megatron accepts moe_expert_rank_capacity_factor only for hybridep / ncclep; deepepv2 takes it too (a
        # static receive bound, see the manager), so Megatron's checks run without it and ours check it.
        rank_capacity_factor = getattr(self, "moe_expert_rank_capacity_factor", None) if deepepv2 else None
        if rank_capacity_factor is not None:
            self.moe_expert_rank_capacity_factor = None
        try:
            original(self)
        finally:
            if rank_capacity_factor is not None:
                self.moe_expert_rank_capacity_factor = rank_capacity_factor
        validate_config(self)

    __post_init__._deepepv2_plugin = True  # type: ignore[attr-defined]
    __post_init__._deepepv2_original = original  # type: ignore[attr-defined]
    cls.__post_init__ = __post_init__


def _make_dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import (  # noqa: PLC0415
        MoEFlexTokenDispatcher,
        MoETokenDispatcher,
    )

    from megatron_deepepv2.mcore.manager import _DeepepV2Manager  # noqa: PLC0415

    class DeepepV2FlexTokenDispatcher(MoEFlexTokenDispatcher):
        """Megatron's flex dispatcher with the ``deepepv2`` backend added; other backends unchanged."""

        def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None) -> None:
            if config.moe_flex_dispatcher_backend != BACKEND_NAME:
                super().__init__(num_local_experts, local_expert_indices, config, pg_collection=pg_collection)
                return
            MoETokenDispatcher.__init__(self, config=config, pg_collection=pg_collection)
            self.num_local_experts = num_local_experts
            self.local_expert_indices = local_expert_indices
            # TPxEP == 1 is supported: the same path on a 1-rank group (single-GPU debugging of a configuration that
            # uses the flex dispatcher at scale). Megatron's own deepep refuses it.
            self._comm_manager = _DeepepV2Manager(
                group=self.tp_ep_group,
                num_local_experts=self.num_local_experts,
                router_topk=self.tp_size * self.config.moe_router_topk,
                num_experts=self.tp_size * self.config.num_moe_experts,
                config=self.config,
            )
            _log_manager_once(self._comm_manager)
            self.cudagraph_attrs = ["_comm_manager.token_probs", "_comm_manager.token_indices"]

        def dispatch_preprocess(self, hidden_states, routing_map, probs):
            """Megatron's flex ``dispatch_preprocess`` for deepepv2, without ``torch.compile``.

            Megatron compiles the stage (``@jit_fuser``); for deepepv2 it is two views and the manager's ``topk``, for
            which the compiled function's guards and wrappers cost more host time than the work (a training step of
            many small layers is host-bound). Other backends keep Megatron's compiled stage.

            Args:
                hidden_states: ``[S, B, H]`` (or any ``[..., H]``) tokens.
                routing_map: ``[T, E]`` router map (only its token count is used).
                probs: ``[T, E]`` routing probabilities, zero where not selected.

            Returns:
                ``([T, H] tokens, [T, K] probabilities of the selected experts)``.
            """
            if self.config.moe_flex_dispatcher_backend != BACKEND_NAME:
                return super().dispatch_preprocess(hidden_states, routing_map, probs)
            return _deepepv2_dispatch_preprocess(self, hidden_states, routing_map, probs)

        def reset_over_budget(self) -> None:
            """Megatron's over-budget reset; for deepepv2 it also clears the manager's ``dropped_rows``."""
            if self.config.moe_flex_dispatcher_backend != BACKEND_NAME:
                return super().reset_over_budget()
            self._comm_manager.reset_over_budget()

    return DeepepV2FlexTokenDispatcher


def _deepepv2_dispatch_preprocess(dispatcher: Any, hidden_states: torch.Tensor, routing_map: torch.Tensor,
                                  probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepepv2 flex dispatcher's ``dispatch_preprocess``: two views and the manager's metadata, uncompiled.

    Args:
        dispatcher: The ``DeepepV2FlexTokenDispatcher`` (its ``hidden_shape`` is set for the combine).
        hidden_states: ``[S, B, H]`` (or any ``[..., H]``) tokens.
        routing_map: ``[T, E]`` router map (only its token count is used).
        probs: ``[T, E]`` routing probabilities, zero where not selected.

    Returns:
        ``([T, H] tokens, [T, K] probabilities of the selected experts)``.
    """
    dispatcher.hidden_shape = hidden_states.shape
    hidden_states = hidden_states.view(-1, dispatcher.hidden_shape[-1])
    # Probabilities over the TPxEP group, [T, ep, tp, E_local]: replicated over the TP ranks, as Megatron's
    # _initialize_metadata does (a view when tp == 1; the manager's reshape copies it otherwise).
    probs = probs.reshape(probs.shape[0], dispatcher.ep_size, 1, dispatcher.num_local_experts).expand(
        -1, -1, dispatcher.tp_size, -1)
    dispatcher._comm_manager.setup_metadata(routing_map, probs)
    return hidden_states, dispatcher._comm_manager.token_probs


_logged_managers: set[tuple[str, str]] = set()


def _log_manager_once(manager: Any) -> None:
    """Says which manager deepepv2 layers got (once per distinct dispatch configuration in the process)."""
    config = manager.dispatch_config
    key = (config.backend.name, config.layout.value)
    if key in _logged_managers:
        return
    _logged_managers.add(key)
    logger.info("deepepv2 layer: megatron-deepepv2 _DeepepV2Manager (backend %s, layout %s, host sync %s)%s",
                config.backend.name, config.layout.value, "on" if config.host_sync else "off",
                "; megatron-core's own is not used (MEGATRON_DEEPEPV2_MANAGER=native selects it)"
                if _report is not None and _report.native_available else "")


def _install_dispatcher() -> None:
    from megatron.core.transformer.moe import moe_layer  # noqa: PLC0415

    if getattr(moe_layer.MoEFlexTokenDispatcher, "_deepepv2_plugin", False):
        return
    dispatcher = _make_dispatcher_class()
    dispatcher._deepepv2_plugin = True
    dispatcher._deepepv2_original = moe_layer.MoEFlexTokenDispatcher
    moe_layer.MoEFlexTokenDispatcher = dispatcher


def _patch_moe_layer_expert_check() -> None:
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: PLC0415

    original = MoELayer.__init__
    if getattr(original, "_deepepv2_plugin", False):
        return

    @functools.wraps(original)
    def __init__(self, *args, **kwargs) -> None:
        from megatron_deepepv2.config import get_settings  # noqa: PLC0415
        from megatron_deepepv2.mcore.experts import (check_experts_take_device_counts,  # noqa: PLC0415
                                                     sync_free_submodules)
        from megatron_deepepv2.mcore.manager import dispatch_config_for  # noqa: PLC0415

        config = kwargs["config"] if "config" in kwargs else args[0]
        deepepv2 = is_deepepv2(config)
        if get_settings().experts == "sync_free":  # every dispatcher: comparisons hold the experts equal
            if kwargs.get("submodules") is not None:
                kwargs["submodules"] = sync_free_submodules(kwargs["submodules"])
            elif len(args) > 1 and args[1] is not None:
                args = (args[0], sync_free_submodules(args[1]), *args[2:])
        original(self, *args, **kwargs)
        if deepepv2 and not dispatch_config_for(self.config).host_sync:
            check_experts_take_device_counts(self.experts)

    __init__._deepepv2_plugin = True  # type: ignore[attr-defined]
    __init__._deepepv2_original = original  # type: ignore[attr-defined]
    MoELayer.__init__ = __init__


_FINALIZE = "finalize_model_grads_func"


def release_retired_buffers_after(finalize: Callable) -> Callable:
    """``finalize``, then ``megatron_deepepv2.buffers.release_retired_buffers()``: what every call of a config's
    ``finalize_model_grads_func`` runs once :func:`install` ran.

    Megatron's schedules call that function once per training step on every rank, after the step's last backward
    (no dispatch handle of the step is alive any more), so the release -- a collective over the groups that have
    retired buffers, none when none are -- runs at the same point on every rank.

    Args:
        finalize: The finalize function Megatron would call (its arguments and result pass through).

    Returns:
        The wrapped function (``_deepepv2_original`` is ``finalize``).
    """

    @functools.wraps(finalize)
    def finalize_model_grads(*args, **kwargs):
        result = finalize(*args, **kwargs)
        from megatron_deepepv2 import buffers  # noqa: PLC0415 - looked up at call time (tests replace it)

        buffers.release_retired_buffers()
        return result

    finalize_model_grads._deepepv2_plugin = True  # type: ignore[attr-defined]
    finalize_model_grads._deepepv2_original = finalize  # type: ignore[attr-defined]
    return finalize_model_grads


class _FinalizeWithRelease:
    """``ModelParallelConfig.finalize_model_grads_func`` as a data descriptor: the config stores what it is given (so
    copies, pickles and ``dataclasses.replace`` see the plain function) and hands out
    :func:`release_retired_buffers_after` of it. Hooking the attribute Megatron's schedules read, rather than the
    module-level ``finalize_model_grads``, also covers a function imported by name before :func:`install` ran and a
    builder-installed finalize function."""

    _deepepv2_plugin = True

    def __init__(self, default: Any) -> None:
        self.default = default
        self._wrapped: dict[Any, Callable] = {}

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self.default  # the dataclass default, as before
        finalize = obj.__dict__.get(_FINALIZE, self.default)
        if finalize is None:
            return None
        try:
            wrapped = self._wrapped.get(finalize)
            if wrapped is None:
                wrapped = self._wrapped[finalize] = release_retired_buffers_after(finalize)
        except TypeError:  # an unhashable callable: wrapped on every read
            wrapped = release_retired_buffers_after(finalize)
        return wrapped

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__[_FINALIZE] = getattr(value, "_deepepv2_original", value)


def _hook_finalize_model_grads() -> bool:
    """Installs :class:`_FinalizeWithRelease` on ``ModelParallelConfig``; False where the field does not exist."""
    from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: PLC0415

    if _FINALIZE not in getattr(ModelParallelConfig, "__dataclass_fields__", {}):
        return False
    current = ModelParallelConfig.__dict__.get(_FINALIZE)
    if not getattr(current, "_deepepv2_plugin", False):
        setattr(ModelParallelConfig, _FINALIZE, _FinalizeWithRelease(current))
    return True


def _replace_function(module_names: list[str], name: str, make_wrapper: Callable[[Callable], Callable]) -> bool:
    """Wraps function ``name`` in every listed module that defines or imported it; returns whether any did."""
    wrapped_any = False
    for module_name in module_names:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        original = getattr(module, name, None)
        if original is None or getattr(original, "_deepepv2_plugin", False):
            wrapped_any = wrapped_any or original is not None
            continue
        wrapper = functools.wraps(original)(make_wrapper(original))
        wrapper._deepepv2_plugin = True
        wrapper._deepepv2_original = original
        setattr(module, name, wrapper)
        wrapped_any = True
    return wrapped_any


def _wrap_should_free_input(original: Callable) -> Callable:
    def should_free_input(name, is_moe, config, num_local_experts):
        if not is_deepepv2(config):
            return original(name, is_moe, config, num_local_experts)
        if name == "mlp" and is_moe:
            # The expand layout: dispatch_postprocess is an identity (as for hybridep), so the mlp node's input is
            # the experts' GEMM input, saved for backward; only an FP8/FP4 cast copy lets it go.
            return getattr(config, "fp8", None) is not None or getattr(config, "fp4", None) is not None
        return original(name, is_moe, _AsDeepEP(config), num_local_experts)

    return should_free_input


def _wrap_build_callables(original: Callable) -> Callable:
    def build_transformer_layer_callables(layer, *args, **kwargs):
        config = layer.config
        if not is_deepepv2(config):
            return original(layer, *args, **kwargs)
        # The builder reads the backend string once, at its start; it sees "deepep" only while building.
        with _callables_lock:
            config.moe_flex_dispatcher_backend = "deepep"
            try:
                return original(layer, *args, **kwargs)
            finally:
                config.moe_flex_dispatcher_backend = BACKEND_NAME

    return build_transformer_layer_callables


def _wrap_skip_padding(original: Callable) -> Callable:
    def skip_routed_expert_padding(config):
        # deepepv2's expand layout hands the experts blocks DeepEP already aligned and zero-padded.
        return True if is_deepepv2(config) else original(config)

    return skip_routed_expert_padding


FUSED_A2A = "megatron.core.transformer.moe.fused_a2a"


def _expose_legacy_deepep_to_megatron() -> Optional[str]:
    """Lets megatron-core's own ``deepep`` backend import DeepEP 2.1's legacy ``Buffer``.

    Megatron's ``fused_a2a`` imports ``Buffer`` from ``deep_ep`` and ``EventHandle, EventOverlap`` from
    ``deep_ep.utils``; DeepEP 2.1 still ships the legacy ``Buffer`` (the same API) but exports ``EventOverlap`` from
    ``deep_ep`` only, so the import fails and Megatron reports DeepEP as not installed. Naming the same class in
    ``deep_ep.utils`` makes ``fused_a2a.HAVE_DEEP_EP`` true, so one install runs ``deepep`` (EP >= 2; Megatron refuses
    one rank) beside ``deepepv2``. Nothing is done without DeepEP, with a DeepEP whose ``deep_ep.utils`` already has the
    name (1.x), without the legacy ``Buffer`` (V2.5 removed it), or when ``deep_ep`` does not import (the deepep
    backend reports why when it is used). Megatron reads the names when ``fused_a2a`` is first imported: after that,
    a WARNING says to call :func:`install` earlier.

    Returns:
        What was done, or None when nothing was.
    """
    if importlib.util.find_spec("deep_ep") is None:
        return None
    fused_a2a = sys.modules.get(FUSED_A2A)
    if fused_a2a is not None and getattr(fused_a2a, "HAVE_DEEP_EP", False):
        return None
    try:
        import deep_ep  # noqa: PLC0415
        import deep_ep.utils  # noqa: PLC0415
    except Exception as error:  # noqa: BLE001 -- deep_ep raises AssertionError on an NCCL mismatch, not ImportError
        logger.debug("deep_ep does not import (%s): megatron-core's deepep backend stays unavailable", error)
        return None
    event_overlap = getattr(deep_ep, "EventOverlap", None)
    if getattr(deep_ep, "Buffer", None) is None or event_overlap is None or hasattr(deep_ep.utils, "EventOverlap"):
        return None
    if fused_a2a is not None:
        logger.warning(
            "megatron-core's %s was imported before megatron_deepepv2.install(), when DeepEP 2.1's legacy Buffer did "
            "not import for it, so Megatron's own deepep backend stays unavailable in this process (deepepv2 is not "
            "affected). Call install() before importing Megatron's MoE modules to have both.", FUSED_A2A)
        return None
    deep_ep.utils.EventOverlap = event_overlap
    return "deep_ep.utils.EventOverlap names DeepEP 2.1's, so megatron-core's deepep backend finds its legacy Buffer"


#: Module-level functions wrapped by install(): (modules that define or import it, name, wrapper, description).
#: A name missing from a release (e.g. skip_routed_expert_padding before 0.18) is skipped.
_FUNCTION_PATCHES: tuple[tuple[list[str], str, Callable[[Callable], Callable], str], ...] = (
    (
        ["megatron.core.models.common.utils", "megatron.core.models.gpt.fine_grained_callables"],
        "should_free_input",
        _wrap_should_free_input,
        "should_free_input treats deepepv2 like deepep",
    ),
    (
        ["megatron.core.models.gpt.fine_grained_callables", "megatron.core.models.common.fine_grained_callables"],
        "build_transformer_layer_callables",
        _wrap_build_callables,
        "build_transformer_layer_callables treats deepepv2 like deepep",
    ),
    (
        ["megatron.core.transformer.moe.moe_utils", "megatron.core.transformer.moe.experts"],
        "skip_routed_expert_padding",
        _wrap_skip_padding,
        "skip_routed_expert_padding: no second padding after deepepv2",
    ),
)


def _checked_megatron_version() -> Version:
    """The installed megatron-core's version, refused before 0.17 and warned about past the tested releases.

    Returns:
        The version.

    Raises:
        RuntimeError: If the installed megatron-core is older than 0.17.
    """
    version = megatron_version()
    if version < MIN_MEGATRON:
        raise RuntimeError(
            f"megatron-deepepv2 needs megatron-core >= {MIN_MEGATRON.base_version} (tested: {TESTED_RANGE}); "
            f"megatron-core {version} is installed. Upgrade it (pip install 'megatron-core{TESTED_RANGE}')."
        )
    if version >= TESTED_BELOW:
        logger.warning(
            "megatron-core %s is newer than the releases megatron-deepepv2 is tested with (%s); its patches are "
            "applied and each raises naming itself if this release changed what it patches.", version, TESTED_RANGE,
        )
    return version


def _uses_native_manager(report: InstallReport, version: Version) -> bool:
    """Applies the ``manager`` setting to a megatron-core that may ship its own deepepv2, logging the choice.

    Args:
        report: The install's report so far (its ``manager`` and ``native_available`` decide).
        version: The installed megatron-core's version, for the messages.

    Returns:
        True when deepepv2 layers use megatron-core's own manager and Megatron stays unpatched.

    Raises:
        RuntimeError: If ``MEGATRON_DEEPEPV2_MANAGER=native`` asks for a deepepv2 this megatron-core does not ship.
    """
    if report.manager == "native":
        if not report.native_available:
            raise RuntimeError(
                f"MEGATRON_DEEPEPV2_MANAGER=native asks for megatron-core's own deepepv2, but megatron-core "
                f"{version} has none. Unset it (or set 'plugin') to use megatron-deepepv2's.")
        logger.info(
            "MEGATRON_DEEPEPV2_MANAGER=native: deepepv2 layers use megatron-core %s's own _DeepepV2Manager; "
            "megatron-deepepv2 leaves Megatron unpatched.", version,
        )
        return True
    if report.native_available:
        logger.info(
            "megatron-core %s ships its own deepepv2; deepepv2 layers use megatron-deepepv2's _DeepepV2Manager "
            "instead (expand layout, no host sync, CUDA graphs, determinism). Set MEGATRON_DEEPEPV2_MANAGER=native "
            "for megatron-core's.", version,
        )
    return False


def _apply_patches(report: InstallReport) -> None:
    """Applies every patch of the module docstring's table to Megatron, each named in ``report.patches``.

    Args:
        report: The install's report; the patches applied are appended to its ``patches``.
    """
    _widen_backend_literal()
    report.patches.append("TransformerConfig.moe_flex_dispatcher_backend accepts 'deepepv2'")
    _patch_config_validation()
    report.patches.append("TransformerConfig.__post_init__ validates deepepv2")
    _install_dispatcher()
    report.patches.append("moe_layer.MoEFlexTokenDispatcher builds _DeepepV2Manager")
    _patch_moe_layer_expert_check()
    report.patches.append("MoELayer.__init__ builds the experts setting's module and checks no-host-sync support")
    if _hook_finalize_model_grads():
        report.patches.append("config.finalize_model_grads_func releases retired deepepv2 buffers after it runs")
    for modules, name, make_wrapper, description in _FUNCTION_PATCHES:
        if _replace_function(modules, name, make_wrapper):
            report.patches.append(description)


# ----------------------------------------------------------------------------------------------
def install() -> InstallReport:
    """Teaches the installed megatron-core the ``deepepv2`` flex-dispatcher backend.

    Idempotent and thread-safe; call it before Megatron parses arguments or builds models.

    Returns:
        What was done.

    Raises:
        RuntimeError: If the installed megatron-core is older than 0.17, or ``MEGATRON_DEEPEPV2_MANAGER=native``
            asks for a deepepv2 it does not ship.
        ValueError: If a ``MEGATRON_DEEPEPV2_*`` variable holds a value its setting cannot take.
    """
    global _report
    with _install_lock:
        if _report is not None:
            return _report
        # Before anything imports megatron.core, which imports fused_a2a: it reads deep_ep's names once.
        legacy_deepep = _expose_legacy_deepep_to_megatron()
        version = _checked_megatron_version()
        from megatron_deepepv2.config import get_settings  # noqa: PLC0415

        manager = get_settings().manager  # reading the settings checks them
        report = InstallReport(megatron_version=str(version), native_available=supports_deepepv2_natively(),
                               manager=manager)
        if legacy_deepep:  # a change to deep_ep, not to Megatron: made whichever manager deepepv2 layers get
            report.patches.append(legacy_deepep)
        if _uses_native_manager(report, version):
            report.native = True
        else:
            _apply_patches(report)
            logger.info("megatron-deepepv2 installed into megatron-core %s: %s", version, "; ".join(report.patches))
        _report = report
        return report


def installed() -> Optional[InstallReport]:
    """The report of the :func:`install` that ran in this process, or None."""
    return _report
