"""megatron-deepepv2: DeepEP v2 (``deep_ep.ElasticBuffer``) for Megatron-Core's flex MoE token dispatcher.

Public API:

* :func:`dispatch` / :func:`combine` -- differentiable expert-parallel all-to-all, :func:`resolve_config` -- a
  configuration resolved once for repeated calls (:mod:`.ops`);
* :class:`ExpertLayout`, :class:`DispatchConfig`, :class:`DispatchHandle`, :class:`DispatchResult` -- the types they
  speak (:mod:`.layout`, :mod:`.backends.base`); :func:`register_backend`, :func:`resolve_backend`,
  :func:`backend_names` -- the backends by name (:mod:`.backends.registry`);
* :func:`configure`, :func:`settings_override`, :func:`get_settings` -- switches (:mod:`.config`);
* :func:`install` -- add ``--moe-flex-dispatcher-backend deepepv2`` to Megatron-Core (:mod:`.mcore.integration`);
* :func:`destroy_buffers` -- release communication buffers before shutdown, :func:`release_retired_buffers` --
  release superseded ones once per step (:mod:`.buffers`);
* :class:`PeerFailure` -- what a rank raises when another rank of its group failed first (:mod:`.failures`).
"""

# The built-in backends register themselves on import (megatron_deepepv2.backends.registry).
from megatron_deepepv2.backends.deepep import backend as _deepep  # noqa: F401
from megatron_deepepv2.backends import reference as _reference  # noqa: F401
from megatron_deepepv2.backends.base import DispatchConfig, DispatchHandle, DispatchResult
from megatron_deepepv2.backends.registry import backend_names, register_backend, resolve_backend
from megatron_deepepv2.buffers import destroy_buffers, release_retired_buffers
from megatron_deepepv2.config import DeepepV2Settings, configure, get_settings, settings_override
from megatron_deepepv2.failures import PeerFailure
from megatron_deepepv2.layout import ExpertLayout
from megatron_deepepv2.ops import combine, dispatch, resolve_config

__version__ = "0.1.0"


def install():
    """Teaches megatron-core the ``deepepv2`` flex-dispatcher backend (see :mod:`megatron_deepepv2.mcore.integration`).

    Idempotent. Imports Megatron, so it lives behind this function rather than at package import.

    Returns:
        An :class:`~megatron_deepepv2.mcore.integration.InstallReport`.
    """
    from megatron_deepepv2.mcore.integration import install as _install  # noqa: PLC0415

    return _install()


__all__ = [
    "DeepepV2Settings",
    "DispatchHandle",
    "DispatchConfig",
    "DispatchResult",
    "ExpertLayout",
    "PeerFailure",
    "__version__",
    "backend_names",
    "combine",
    "configure",
    "destroy_buffers",
    "dispatch",
    "get_settings",
    "install",
    "register_backend",
    "release_retired_buffers",
    "resolve_backend",
    "resolve_config",
    "settings_override",
]
