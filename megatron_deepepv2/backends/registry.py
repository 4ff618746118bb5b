"""The backend registry: backend classes by name, and the choice of ``auto``.

Backends register themselves with :func:`register_backend` when their module is imported (the package imports the
built-in ones); nothing else in the package branches on backend names.

* ``deepep`` -- :class:`~megatron_deepepv2.backends.deepep.backend.DeepEPBackend` over ``deep_ep.ElasticBuffer``.
* ``reference`` -- :class:`~megatron_deepepv2.backends.reference.ReferenceBackend` over ``torch.distributed`` (gloo or
  NCCL).
* ``auto`` -- the usable backend of lowest :attr:`~megatron_deepepv2.backends.base.DispatchBackend.auto_preference`:
  ``deepep`` when DeepEP v2 imports and CUDA is there, else ``reference``. The choice is logged once: as a WARNING when
  a preferred backend is unusable on a machine with a GPU (the run works, on a slower path), else as INFO. An explicit
  name never falls back: if that backend cannot run, an ImportError says why.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from megatron_deepepv2.backends.base import DispatchBackend

logger = logging.getLogger(__name__)

AUTO = "auto"

_REGISTRY: dict[str, type["DispatchBackend"]] = {}
#: The backend ``auto`` was last logged as resolving to (logged again only when the choice changes).
_auto_choice_logged: Optional[str] = None


def register_backend(backend_cls: type["DispatchBackend"]) -> type["DispatchBackend"]:
    """Registers ``backend_cls`` under ``backend_cls.name`` (usable as a class decorator).

    Args:
        backend_cls: A :class:`~megatron_deepepv2.backends.base.DispatchBackend` subclass.

    Returns:
        ``backend_cls``.

    Raises:
        ValueError: If another class already holds that name, or the name is ``auto``.
    """
    existing = _REGISTRY.get(backend_cls.name)
    if backend_cls.name == AUTO or (existing is not None and existing is not backend_cls):
        taken = "reserved" if backend_cls.name == AUTO else f"already taken by {existing.__qualname__}"
        raise ValueError(f"Backend name {backend_cls.name!r} is {taken}.")
    _REGISTRY[backend_cls.name] = backend_cls
    return backend_cls


def backend_names() -> list[str]:
    """Returns the names :func:`resolve_backend` accepts, ``auto`` first."""
    return [AUTO, *sorted(_REGISTRY)]


def resolve_backend(name: str) -> type["DispatchBackend"]:
    """Returns the backend class for ``name``.

    Args:
        name: ``"auto"`` or a registered backend name (any case).

    Returns:
        The backend class, usable in this process.

    Raises:
        ValueError: If ``name`` is not known.
        ImportError: If an explicitly named backend cannot run here, or (``auto``) none can; the message says why.
    """
    key = str(name).lower()
    if key == AUTO:
        return _resolve_auto()
    if key not in _REGISTRY:
        raise ValueError(f"Unknown deepepv2 backend {name!r}; choose one of {backend_names()}.")
    backend_cls = _REGISTRY[key]
    reason = backend_cls.unavailable_reason()
    if reason is not None:
        raise ImportError(f"deepepv2 backend {key!r} was requested but cannot run here: {reason}")
    return backend_cls


def _resolve_auto() -> type["DispatchBackend"]:
    """The usable backend ``auto`` stands for, its choice logged when it changes."""
    global _auto_choice_logged
    passed_over: list[str] = []
    for backend_cls in sorted(_REGISTRY.values(), key=lambda cls: (cls.auto_preference, cls.name)):
        reason = backend_cls.unavailable_reason()
        if reason is None:
            break
        passed_over.append(f"{backend_cls.name} unavailable: {reason}")
    else:
        raise ImportError(f"deepepv2 backend 'auto' found no usable backend ({'; '.join(passed_over)}).")
    if _auto_choice_logged != backend_cls.name:
        # A GPU without a usable preferred backend: a slower portable one runs, which is rarely what a GPU run wants.
        level = logging.WARNING if passed_over and torch.cuda.is_available() else logging.INFO
        why = f" ({'; '.join(passed_over)})" if passed_over else ""
        logger.log(level, "deepepv2 backend 'auto' resolved to %r%s", backend_cls.name, why)
        _auto_choice_logged = backend_cls.name
    return backend_cls
