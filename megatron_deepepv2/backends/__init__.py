"""Backend registry and configuration resolution: maps a backend name to its class, resolves ``auto``, and resolves a
dispatch configuration from the settings (:func:`resolve_config`).

Backends register here by name; nothing else in the package branches on backend names.

* ``deepep`` -- :class:`~megatron_deepepv2.backends.deepep.DeepEPBackend` over ``deep_ep.ElasticBuffer``.
* ``reference`` -- :class:`~megatron_deepepv2.backends.reference.ReferenceBackend` over
  ``torch.distributed`` (gloo or NCCL).
* ``auto`` -- ``deepep`` when it is usable (DeepEP v2 importable, CUDA), else ``reference``; the choice
  is logged once: as a WARNING when it falls back to ``reference`` on a machine with a GPU (the run works, on the
  slower portable path), else as INFO. An explicit name never falls back: if that backend cannot run, an ImportError
  says why.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional

import torch

from megatron_deepepv2.backends.base import (
    SYNC,
    BackendLimits,
    BufferSpec,
    CombineOutput,
    DispatchBackend,
    DispatchConfig,
    DispatchHandle,
    DispatchResult,
    Streams,
)
from megatron_deepepv2.backends.deepep import DeepEPBackend
from megatron_deepepv2.backends.reference import ReferenceBackend
from megatron_deepepv2 import validation
from megatron_deepepv2.config import DeepepV2Settings, get_settings
from megatron_deepepv2.layout import ExpertLayout, HiddenStates

logger = logging.getLogger(__name__)

AUTO = "auto"

_REGISTRY: dict[str, type[DispatchBackend]] = {}
_auto_choice_logged: Optional[str] = None


def register_backend(backend_cls: type[DispatchBackend]) -> type[DispatchBackend]:
    """Registers ``backend_cls`` under ``backend_cls.name`` (usable as a class decorator).

    Raises:
        ValueError: If another class already holds that name.
    """
    existing = _REGISTRY.get(backend_cls.name)
    if existing is not None and existing is not backend_cls:
        raise ValueError(f"Backend name {backend_cls.name!r} is already taken by {existing.__qualname__}.")
    _REGISTRY[backend_cls.name] = backend_cls
    return backend_cls


def backend_names() -> list[str]:
    """Names accepted by :func:`resolve_backend`, ``auto`` first."""
    return [AUTO, *sorted(_REGISTRY)]


def resolve_backend(name: str) -> type[DispatchBackend]:
    """Returns the backend class for ``name``.

    Args:
        name: ``"auto"`` or a registered backend name.

    Returns:
        The backend class, usable in this process.

    Raises:
        ValueError: If ``name`` is not known.
        ImportError: If an explicitly named backend cannot run here (the message says why and how to fix it).
    """
    global _auto_choice_logged
    key = str(name).lower()
    if key == AUTO:
        deepep_problem = DeepEPBackend.unavailable_reason()
        chosen = DeepEPBackend if deepep_problem is None else ReferenceBackend
        if _auto_choice_logged != chosen.name:
            reason = "" if deepep_problem is None else f" (deepep unavailable: {deepep_problem})"
            # A GPU without a usable DeepEP: the portable backend runs, which is rarely what a GPU run wants.
            fell_back_on_gpu = deepep_problem is not None and torch.cuda.is_available()
            logger.log(logging.WARNING if fell_back_on_gpu else logging.INFO,
                       "deepepv2 backend 'auto' resolved to %r%s", chosen.name, reason)
            _auto_choice_logged = chosen.name
        return chosen
    if key not in _REGISTRY:
        raise ValueError(f"Unknown deepepv2 backend {name!r}; choose one of {backend_names()}.")
    backend_cls = _REGISTRY[key]
    problem = backend_cls.unavailable_reason()
    if problem is not None:
        raise ImportError(f"deepepv2 backend {key!r} was requested but cannot run here: {problem}")
    return backend_cls


#: Fields of :class:`~megatron_deepepv2.backends.base.DispatchConfig` a caller sets beside the settings (``settings`` itself is resolved).
_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(DispatchConfig)) - {"settings"}
_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(DeepepV2Settings))


def resolve_config(**overrides: Any) -> DispatchConfig:
    """Resolves a dispatch configuration: ``overrides`` over the process-wide settings, then checks it once.

    Args:
        **overrides: Fields of :class:`~megatron_deepepv2.backends.base.DispatchConfig` (``backend`` and ``layout``
            may be names) and of :class:`~megatron_deepepv2.config.DeepepV2Settings`; None leaves a field unset.
            ``zero_padding`` unset means: whenever expand blocks are padded.

    Returns:
        The configuration.

    Raises:
        TypeError: For a name that is neither.
        ValueError: For an unknown backend or layout, or a value :func:`~megatron_deepepv2.validation.
            check_dispatch_config` rejects.
        ImportError: An explicitly named backend cannot run here.
    """
    overrides = {name: value for name, value in overrides.items() if value is not None}
    unknown = sorted(set(overrides) - _CONFIG_FIELDS - _SETTING_FIELDS)
    if unknown:
        raise TypeError(f"Unknown dispatch setting(s) {unknown}; known: {sorted(_CONFIG_FIELDS | _SETTING_FIELDS)}.")
    # ``backend`` is both: the setting names the backend, the configuration holds the class that runs.
    changes = {name: overrides.pop(name) for name in list(overrides) if name in _SETTING_FIELDS and name != "backend"}
    settings = dataclasses.replace(get_settings(), **changes) if changes else get_settings()
    backend = overrides.pop("backend", settings.backend)
    layout = ExpertLayout.parse(overrides.pop("layout", ExpertLayout.COMPACT))
    alignment = overrides.pop("expert_alignment", 1)
    config = DispatchConfig(backend if isinstance(backend, type) else resolve_backend(backend), settings, layout,
                            alignment, overrides.pop("zero_padding", None), **overrides)
    validation.check_dispatch_config(config)
    return config


register_backend(ReferenceBackend)
register_backend(DeepEPBackend)

__all__ = [
    "AUTO",
    "SYNC",
    "BackendLimits",
    "BufferSpec",
    "CombineOutput",
    "DeepEPBackend",
    "DispatchBackend",
    "DispatchConfig",
    "DispatchHandle",
    "DispatchResult",
    "ExpertLayout",
    "HiddenStates",
    "ReferenceBackend",
    "Streams",
    "backend_names",
    "register_backend",
    "resolve_backend",
    "resolve_config",
]
