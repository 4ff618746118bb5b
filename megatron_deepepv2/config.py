"""The settings of megatron-deepepv2: every switch declared once, read from the environment.

:class:`DeepepV2Settings` is the one declaration of each switch: its name, type, default and meaning. Each field is
also an environment variable, ``MEGATRON_DEEPEPV2_`` and its name in capitals (``host_sync`` is
``MEGATRON_DEEPEPV2_NO_HOST_SYNC``, inverted; ``num_max_tokens_per_rank`` is also
``MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK``), parsed by the field's type on first use. A ``MEGATRON_DEEPEPV2_*``
variable that no setting reads gets one WARNING naming the closest setting's variable (or, for a removed setting, what
to do instead); :data:`OTHER_VARIABLES` lists the ones read elsewhere. Code and tests change settings with
:func:`configure` or, for a block, :func:`settings_override`. Settings check their values when they are built
(:meth:`DeepepV2Settings.check`), so a bad value raises where it is given: each field by its annotation and metadata
(:func:`check_fields`), with one helper per kind of value (:func:`checked_bool`, :func:`checked_int`,
:func:`checked_positive_number`, :func:`checked_choice`, :func:`checked_name`, :func:`checked_instance`), which
:class:`~megatron_deepepv2.backends.base.DispatchConfig` uses too. A layer's dispatch configuration carries the
settings it was resolved with.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import logging
import operator
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

_ENV_PREFIX = "MEGATRON_DEEPEPV2_"
#: ``MEGATRON_DEEPEPV2_*`` variables read outside the settings, which :meth:`DeepepV2Settings.from_env` does not warn
#: about: the test suite's Megatron-LM tree with a native deepepv2 and the DeepEP and NCCL trees of the README's GPU
#: test and how many one-GPU test jobs share a GPU; and the node identity of
#: :mod:`megatron_deepepv2.backends.deepep.topology`, which differs per node.
OTHER_VARIABLES = ("MEGATRON_DEEPEPV2_NATIVE_TREE", "MEGATRON_DEEPEPV2_README_TREES", "MEGATRON_DEEPEPV2_NODE_ID",
                   "MEGATRON_DEEPEPV2_GPU_JOB_SLOTS")
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
            :mod:`megatron_deepepv2.backends.deepep.receive_order` without), ordered reductions. Megatron's
            ``--deterministic-mode`` turns it on for its layers.
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
            ``SequentialMLP`` becomes :class:`~megatron_deepepv2.mcore.experts.SyncFreeSequentialMLP`: the same
            parameters and checkpoints, grouped GEMMs, device-side counts).

    Raises:
        ValueError: At construction, as :meth:`check`.
    """

    backend: str = "auto"
    num_max_tokens_per_rank: Optional[int] = field(
        default=None, metadata={"minimum": 1, "note": "None for the largest first batch over the ranks"})
    validate: bool = False
    check_ids: bool = True
    growth_timeout_s: float = field(default=120.0, metadata={"note": "seconds a rank waits at a buffer build"})
    deterministic: bool = False
    num_sms: int = field(default=64, metadata={"minimum": 0, "note": "0 for the backend's choice"})
    allow_hybrid_mode: Optional[bool] = field(default=None,
                                              metadata={"note": "None for hybrid only when the group spans nodes"})
    host_sync: bool = field(default=True, metadata={"variable": "NO_HOST_SYNC", "inverted": True})
    fp8_dispatch: bool = False
    manager: str = field(default="plugin", metadata={
        "choices": MANAGERS, "note": "'plugin' for this package's deepepv2, 'native' for megatron-core's own"})
    experts: str = field(default="spec", metadata={
        "choices": EXPERTS,
        "note": "'spec' for the layer spec's experts, 'sync_free' for SyncFreeSequentialMLP in place of SequentialMLP"})

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Checks every field by its annotation and metadata, converting names to their one spelling (run when the
        settings are built, so a bad value raises where it is given).

        Raises:
            ValueError: For a value of the wrong type or out of range, naming the setting, the value, what it
                accepts and the setting's environment variable.
        """
        check_fields(self, _how_to_set_setting)

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
        values: dict[str, Any] = {}
        for f, kind, optional in _field_kinds(cls):
            for variable in _variables(f):
                if variable in environ:
                    value = _parse_env_value(variable, environ[variable], kind, optional)
                    values[f.name] = (not value) if f.metadata.get("inverted") else value
                    break
        _warn_unread_variables(environ)
        return cls(**values)


def _rejected(label: str, value: Any, accepted: str, how: str) -> ValueError:
    """The error for ``value`` of the field ``label``: the value, its type, what the field accepts and how to set it."""
    return ValueError(f"{label}={value!r} {accepted}; got {type(value).__name__}.{' ' + how if how else ''}")


def checked_bool(label: str, value: Any, *, optional: bool = False, how: str = "") -> bool:
    """Returns ``value`` if it is a real bool.

    Args:
        label: The field, as ``Owner.field``, for the error.
        value: The value given.
        optional: Whether the field also takes None, for the error (:func:`checked_value` returns None itself).
        how: How to set the field (and what its values mean), for the error.

    Returns:
        ``value``.

    Raises:
        ValueError: For anything else, strings and the ints 0 and 1 included.
    """
    if isinstance(value, bool):
        return value
    raise _rejected(label, value, "must be True, False or None" if optional else "must be True or False", how)


def checked_int(label: str, value: Any, *, minimum: int, optional: bool = False, how: str = "") -> int:
    """Returns ``value`` as an int if it is an integer (an int or what ``operator.index`` takes, not a bool) of at
    least ``minimum``.

    Args:
        label, optional, how: As :func:`checked_bool`.
        value: The value given.
        minimum: The smallest value accepted.

    Returns:
        ``value`` as an int.

    Raises:
        ValueError: For a bool, a float, a string or another non-integer, or an integer below ``minimum``.
    """
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            number = None
        if number is not None and number >= minimum:
            return number
    raise _rejected(label, value, f"must be an integer >= {minimum}{' or None' if optional else ''}", how)


def checked_positive_number(label: str, value: Any, *, how: str = "") -> float:
    """Returns ``value`` as a float if it is a real number (an int or a float, not a bool) greater than 0.

    Args:
        label, how: As :func:`checked_bool`.
        value: The value given.

    Returns:
        ``float(value)``.

    Raises:
        ValueError: For a bool, a string or another non-number, or a number that is not > 0 (NaN included).
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    raise _rejected(label, value, "must be a number > 0", how)


def checked_choice(label: str, value: Any, choices: Iterable[Any], *, how: str = "") -> Any:
    """Returns the member of ``choices`` that ``value`` names: the member itself, or its string value in any case
    (``-`` read as ``_``).

    Args:
        label, how: As :func:`checked_bool`.
        value: The value given.
        choices: The accepted values: an :class:`enum.Enum` class or strings.

    Returns:
        The member of ``choices`` (an enum member for an enum, the string for strings).

    Raises:
        ValueError: For a string that names no member, or a value that is neither a member nor a string.
    """
    options = list(choices)
    if isinstance(value, str):
        key = value.strip().lower().replace("-", "_")
        for option in options:
            if option is value or getattr(option, "value", option) == key:
                return option
    names = ", ".join(str(getattr(option, "value", option)) for option in options)
    raise _rejected(label, value, f"is not one of {names}", how)


def checked_name(label: str, value: Any, *, how: str = "") -> str:
    """Returns ``value`` in lower case if it is a non-empty string (a name looked up later, like a backend's).

    Args:
        label, how: As :func:`checked_bool`.
        value: The value given.

    Returns:
        ``value`` stripped and in lower case.

    Raises:
        ValueError: For anything but a non-empty string.
    """
    if isinstance(value, str) and value.strip():
        return value.strip().lower()
    raise _rejected(label, value, "must be a non-empty name (a str)", how)


def checked_instance(label: str, value: Any, kind: Any, *, how: str = "") -> Any:
    """Returns ``value`` if it is an instance of the class ``kind``, or for ``kind`` ``type[X]`` a subclass of ``X``.

    Args:
        label, how: As :func:`checked_bool`.
        value: The value given.
        kind: A class, or ``type[X]``.

    Returns:
        ``value``.

    Raises:
        ValueError: For anything else.
    """
    if typing.get_origin(kind) is type:
        base = typing.get_args(kind)[0]
        if isinstance(value, type) and issubclass(value, base):
            return value
        raise _rejected(label, value, f"must be a subclass of {base.__name__}", how)
    if isinstance(value, kind):
        return value
    raise _rejected(label, value, f"must be a {kind.__name__}", how)


def checked_value(label: str, value: Any, kind: Any, optional: bool, metadata: typing.Mapping[str, Any],
                  how: str = "") -> Any:
    """Checks ``value`` against a field's annotation ``kind`` and ``metadata`` (``choices``, ``minimum``, ``note``)
    with the helper of its kind of value: bool, integer, positive number, choice (an enum, or ``choices``), name
    (``str``), or class.

    Args:
        label: The field, as ``Owner.field``.
        value: The value given.
        kind: The field's resolved annotation (``X`` of an ``Optional[X]``).
        optional: Whether the field is ``Optional[X]``: it also takes None.
        metadata: The field's metadata; its ``note`` (what the values mean) follows ``how`` in the error.
        how: How to set the field, for the error.

    Returns:
        The value converted to the field's one spelling (an enum member, a lower-case name, an int, a float).

    Raises:
        ValueError: For a value the field does not accept.
    """
    if optional and value is None:
        return None
    hint = ": ".join(part for part in (how, metadata.get("note", "")) if part)
    how = hint + "." if hint else ""
    if "choices" in metadata or (isinstance(kind, type) and issubclass(kind, enum.Enum)):
        return checked_choice(label, value, metadata.get("choices", kind), how=how)
    if kind is bool:
        return checked_bool(label, value, optional=optional, how=how)
    if kind is int:
        return checked_int(label, value, minimum=metadata.get("minimum", 0), optional=optional, how=how)
    if kind is float:
        return checked_positive_number(label, value, how=how)
    if kind is str:
        return checked_name(label, value, how=how)
    return checked_instance(label, value, kind, how=how)


@functools.lru_cache(maxsize=None)
def _field_kinds(cls: type) -> tuple[tuple[dataclasses.Field, Any, bool], ...]:
    """Each field of the dataclass ``cls`` with its resolved annotation (``X`` of ``Optional[X]``) and whether it is
    optional: the one source of its type."""
    hints = typing.get_type_hints(cls)
    return tuple((f, *_without_none(hints[f.name])) for f in dataclasses.fields(cls))


def _without_none(kind: Any) -> tuple[Any, bool]:
    """``(X, True)`` for ``Optional[X]``, else ``(kind, False)``."""
    args = typing.get_args(kind)
    return (next(arg for arg in args if arg is not type(None)), True) if type(None) in args else (kind, False)


def check_fields(instance: Any, how: Callable[[dataclasses.Field], str]) -> None:
    """Checks every field of the frozen dataclass ``instance`` (:func:`checked_value`), storing converted values.

    Args:
        instance: A frozen dataclass being built (called from its ``__post_init__``).
        how: Says how to set a field, for the errors.

    Raises:
        ValueError: For the first field whose value it does not accept, naming it as ``Class.field``.
    """
    owner = type(instance).__name__
    for f, kind, optional in _field_kinds(type(instance)):
        value = getattr(instance, f.name)
        converted = checked_value(f"{owner}.{f.name}", value, kind, optional, f.metadata, how(f))
        if converted is not value:
            object.__setattr__(instance, f.name, converted)


def _how_to_set_setting(f: dataclasses.Field) -> str:
    """How a setting is given, for its errors: in code and through its environment variable."""
    variables = " or ".join(_variables(f))
    inverted = " (its inverse)" if f.metadata.get("inverted") else ""
    return f"Give it as configure({f.name}=...), or set {variables}{inverted}"


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


def _parse_env_value(variable: str, raw: str, kind: Any, optional: bool) -> Any:
    """``raw`` as a value of the field type ``kind`` (an ``optional`` one: empty or ``auto`` is None)."""
    text = raw.strip().lower()
    if optional and text in ("", "auto"):
        return None
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
#: The names of the settings.
SETTING_NAMES = frozenset(f.name for f in dataclasses.fields(DeepepV2Settings))


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
    unknown = sorted(set(changes) - SETTING_NAMES)
    if unknown:
        raise TypeError(f"Unknown deepepv2 setting(s) {unknown}; known settings: {sorted(SETTING_NAMES)}.")
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
