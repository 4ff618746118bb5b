"""The settings of megatron-deepepv2: every switch declared once, read from the environment.

:class:`DeepepV2Settings` is the one declaration of each switch: its name, type, default and meaning. Each field is
also an environment variable, ``MEGATRON_DEEPEPV2_`` and its name in capitals (``host_sync`` is
``MEGATRON_DEEPEPV2_NO_HOST_SYNC``, inverted; ``num_max_tokens_per_rank`` is also
``MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK``), parsed by the field's type on first use. A ``MEGATRON_DEEPEPV2_*``
variable that no setting reads gets one WARNING naming the closest setting's variable (or, for a removed setting, what
to do instead); :data:`OTHER_VARIABLES` lists the ones read elsewhere. Code and tests change settings with
:func:`configure` or, for a block, :func:`settings_override`. Settings check their values when they are built
(:meth:`DeepepV2Settings.check`), so a bad value raises where it is given. A layer's dispatch configuration
(:class:`~megatron_deepepv2.backends.base.DispatchConfig`) carries the settings it was resolved with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

_ENV_PREFIX = "MEGATRON_DEEPEPV2_"
#: ``MEGATRON_DEEPEPV2_*`` variables read outside the settings, which :meth:`DeepepV2Settings.from_env` does not warn
#: about: the test suite's Megatron-LM tree with a native deepepv2 and the DeepEP and NCCL trees of the README's GPU
#: test; and the node identity of :mod:`megatron_deepepv2.topology`, which differs per node.
OTHER_VARIABLES = ("MEGATRON_DEEPEPV2_NATIVE_TREE", "MEGATRON_DEEPEPV2_README_TREES", "MEGATRON_DEEPEPV2_NODE_ID")
#: Variables of settings that are gone, and what to do instead (their WARNING says so).
REMOVED_VARIABLES = {
    "MEGATRON_DEEPEPV2_LAYOUT": "Megatron layers always dispatch in the expand layout, and direct callers pass layout= "
                                "to megatron_deepepv2.dispatch(); unset it",
}
#: The values of the ``manager`` and ``experts`` settings.
MANAGERS = ("plugin", "native")
EXPERTS = ("spec", "sync_free")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeepepV2Settings:
    """The switches of the deepepv2 path (immutable: :func:`configure` replaces the process-wide object).

    Attributes:
        backend: ``"auto"``, ``"deepep"`` or ``"reference"``. An explicit choice never falls back.
        num_max_tokens_per_rank: Tokens any rank dispatches in one call at most, the same on every rank; it sizes the
            buffer and, without host sync, every receive. None: the largest first batch over the ranks, rounded up to a
            power of two, grown collectively when the ranks exceed it together.
        validate: Check values on the host (expert ids in range and distinct) and agree on errors over the group, so
            bad input raises on every rank: a device-to-host sync and a small all-reduce per call, for debugging.
        check_ids: Check the expert ids of every direct dispatch (see :mod:`megatron_deepepv2.expert_ids`). Megatron
            layers skip it: their ids come from ``torch.topk``.
        growth_timeout_s: Seconds a rank waits at a buffer build for the other ranks before it raises.
        deterministic: Bit-exact run to run: received rows in a fixed order (DeepEP's deterministic sort with host sync,
            :mod:`megatron_deepepv2.receive_order` without), ordered reductions. Megatron's ``--deterministic-mode``
            turns it on for its layers.
        num_sms: SMs for the communication kernels (dispatch, combine and their backward), when Megatron's
            ``moe_flex_dispatcher_num_sms`` (``moe_deepep_num_sms`` before 0.19) is unset; 0 = DeepEP's choice. A
            per-call argument of DeepEP, not of its buffer: dispatches with different SM counts share one buffer.
        allow_hybrid_mode: DeepEP hybrid (RDMA x NVLink) mode; None: only when the group spans nodes.
        host_sync: Whether a dispatch waits on the host for exact sizes. False (``MEGATRON_DEEPEPV2_NO_HOST_SYNC=1``):
            outputs sized for the worst case from ``num_max_tokens_per_rank``, counts on the device, nothing read on
            the host, so a MoE layer can be captured in a CUDA graph (its experts must take device-side counts).
        fp8_dispatch: Send BF16 hidden states as e4m3 with one scale per 128 values, hand back BF16 rows; gradients
            stay BF16 (:mod:`megatron_deepepv2.fp8`). Needs a hidden size that is a multiple of 128.
        manager: Which ``_DeepepV2Manager`` deepepv2 layers get on a megatron-core that ships its own: ``plugin``
            (this package's) or ``native`` (megatron-core's; :func:`megatron_deepepv2.install` then patches nothing).
        experts: The experts of every MoE layer: ``spec`` (the layer spec's) or ``sync_free`` (Megatron's
            ``SequentialMLP`` becomes :class:`~megatron_deepepv2.experts.SyncFreeSequentialMLP`: the same parameters
            and checkpoints, grouped GEMMs, device-side counts).
    """

    backend: str = "auto"
    num_max_tokens_per_rank: Optional[int] = None
    validate: bool = False
    check_ids: bool = True
    growth_timeout_s: float = 120.0
    deterministic: bool = False
    num_sms: int = 64
    allow_hybrid_mode: Optional[bool] = None
    host_sync: bool = field(default=True, metadata={"variable": "NO_HOST_SYNC", "inverted": True})
    fp8_dispatch: bool = False
    manager: str = "plugin"
    experts: str = "spec"

    def __post_init__(self) -> None:
        # Names are compared in one spelling.
        object.__setattr__(self, "backend", str(self.backend).lower())
        object.__setattr__(self, "manager", str(self.manager).lower())
        object.__setattr__(self, "experts", str(self.experts).lower().replace("-", "_"))
        self.check()

    def check(self) -> None:
        """Checks the values (run when the settings are built).

        Raises:
            ValueError: For a value its setting cannot take, naming the setting's environment variable.
        """
        if self.manager not in MANAGERS:
            raise ValueError(f"manager={self.manager!r} is not one of {', '.join(MANAGERS)} "
                             "(MEGATRON_DEEPEPV2_MANAGER: 'plugin' for this package's deepepv2, 'native' for "
                             "megatron-core's own).")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts={self.experts!r} is not one of {', '.join(EXPERTS)} (MEGATRON_DEEPEPV2_EXPERTS:"
                             " 'spec' for the layer spec's experts, 'sync_free' for SyncFreeSequentialMLP in place of "
                             "SequentialMLP).")
        if self.num_max_tokens_per_rank is not None and int(self.num_max_tokens_per_rank) <= 0:
            raise ValueError(f"num_max_tokens_per_rank={self.num_max_tokens_per_rank} must be a positive token "
                             "count, or unset to take the largest first batch over the ranks "
                             "(MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK).")
        if float(self.growth_timeout_s) <= 0:
            raise ValueError(f"growth_timeout_s={self.growth_timeout_s} must be a positive number of seconds "
                             "(MEGATRON_DEEPEPV2_GROWTH_TIMEOUT_S).")
        if int(self.num_sms) < 0:
            raise ValueError(f"num_sms={self.num_sms} must be >= 0, 0 letting the backend choose "
                             "(MEGATRON_DEEPEPV2_NUM_SMS).")

    @classmethod
    def from_env(cls, environ: Optional[typing.Mapping[str, str]] = None) -> "DeepepV2Settings":
        """Builds settings from ``MEGATRON_DEEPEPV2_*`` variables.

        Args:
            environ: Mapping to read instead of ``os.environ``.

        Returns:
            Settings with every variable that is set applied over the defaults. Each ``MEGATRON_DEEPEPV2_*`` variable
            that no setting reads and :data:`OTHER_VARIABLES` does not list is logged as one WARNING.

        Raises:
            ValueError: If a variable holds a value its field cannot take.
        """
        environ = os.environ if environ is None else environ
        types = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            for variable in _variables(f):
                if variable in environ:
                    value = _parse_env_value(variable, environ[variable], types[f.name])
                    values[f.name] = (not value) if f.metadata.get("inverted") else value
                    break
        _warn_unread_variables(environ)
        return cls(**values)


def _variables(f: dataclasses.Field) -> list[str]:
    """The environment variables of a settings field, the first one set wins."""
    names = [_ENV_PREFIX + f.metadata.get("variable", f.name.upper())]
    if f.name == "num_max_tokens_per_rank":
        names.append(_ENV_PREFIX + "MAX_TOKENS_PER_RANK")
    return names


def setting_variables() -> list[str]:
    """The environment variables :meth:`DeepepV2Settings.from_env` reads."""
    return [variable for f in dataclasses.fields(DeepepV2Settings) for variable in _variables(f)]


def _warn_unread_variables(environ: typing.Mapping[str, str]) -> None:
    """Logs one WARNING for each ``MEGATRON_DEEPEPV2_*`` variable of ``environ`` that nothing reads."""
    known = setting_variables()
    for variable in sorted(environ):
        if not variable.startswith(_ENV_PREFIX) or variable in known or variable in OTHER_VARIABLES:
            continue
        if variable in REMOVED_VARIABLES:
            logger.warning("%s is set, but no megatron_deepepv2 setting reads it any more: %s.", variable,
                           REMOVED_VARIABLES[variable])
            continue
        # Compared without the common prefix, which would make every pair look alike.
        closest = difflib.get_close_matches(variable[len(_ENV_PREFIX):], [k[len(_ENV_PREFIX):] for k in known], n=1,
                                            cutoff=0.0)
        logger.warning("%s is set, but no megatron_deepepv2 setting reads it, so it has no effect; the closest "
                       "setting's variable is %s%s (docs/usage.md lists the settings).", variable, _ENV_PREFIX,
                       closest[0])


def _parse_env_value(variable: str, raw: str, kind: Any) -> Any:
    """``raw`` as a value of the field type ``kind`` (``Optional[X]``: empty or ``auto`` is None)."""
    text = raw.strip().lower()
    optional = type(None) in typing.get_args(kind)
    if optional:
        if text in ("", "auto"):
            return None
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    if kind is bool:
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise ValueError(f"{variable}={raw!r} is not a boolean; use 1 or 0.")
    if kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            noun = "an integer" if kind is int else "a number"
            raise ValueError(f"{variable}={raw!r} is not {noun}.") from None
    return raw.strip()


_settings: Optional[DeepepV2Settings] = None


def get_settings() -> DeepepV2Settings:
    """Returns the process-wide settings, reading the environment on first use."""
    global _settings
    if _settings is None:
        _settings = DeepepV2Settings.from_env()
    return _settings


def configure(**changes: Any) -> DeepepV2Settings:
    """Changes process-wide settings.

    Args:
        **changes: Field names of :class:`DeepepV2Settings` and their new values.

    Returns:
        The new settings.

    Raises:
        TypeError: If a name is not a settings field.
    """
    global _settings
    known = {f.name for f in dataclasses.fields(DeepepV2Settings)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise TypeError(f"Unknown deepepv2 setting(s) {unknown}; known settings: {sorted(known)}.")
    _settings = dataclasses.replace(get_settings(), **changes)
    return _settings


@contextlib.contextmanager
def settings_override(**changes: Any) -> Iterator[DeepepV2Settings]:
    """Applies :func:`configure` for the duration of a ``with`` block, then restores the settings."""
    global _settings
    saved = get_settings()
    try:
        yield configure(**changes)
    finally:
        _settings = saved
