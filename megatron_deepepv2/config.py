"""Process-wide settings of megatron-deepepv2: one place for every switch, read from the environment.

Each field has an environment variable (``MEGATRON_DEEPEPV2_<FIELD>``), read on first use. Code and
tests change settings with :func:`configure` or, temporarily, :func:`settings_override`.

Each field of :class:`DeepepV2Settings` is also an environment variable, ``MEGATRON_DEEPEPV2_`` and its name in
capitals (``MEGATRON_DEEPEPV2_LAYOUT=compact``, ``MEGATRON_DEEPEPV2_NO_HOST_SYNC=1``; ``MAX_TOKENS_PER_RANK`` too names
``num_max_tokens_per_rank``), parsed by the field's type; the class's docstring is the one list of them. A
``MEGATRON_DEEPEPV2_*`` variable that no setting reads (a misspelling, a removed setting) gets one WARNING naming the
closest setting's variable when the environment is read; :data:`OTHER_VARIABLES` lists the ones read elsewhere.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import logging
import os
from dataclasses import dataclass
import typing
from typing import Any, Iterator, Optional

from megatron_deepepv2.layout import ExpertLayout

#: SMs for DeepEP's kernels when neither Megatron's ``moe_flex_dispatcher_num_sms`` nor
#: ``MEGATRON_DEEPEPV2_NUM_SMS`` says otherwise. Chosen from ``tools/bench.py --sm-sweep`` on 2x H200 (NV18),
#: T4096 H4096 E64 top-8 BF16 expand (docs/benchmarks.md): dispatch bandwidth is flat from 16 SMs, but combine
#: keeps improving up to 64 (61 GB/s at 16, 81 at 32, 114 at 64 SMs of remote bandwidth), so dispatch +
#: combine is 30% faster at 64 than at 16 SMs. 0 asks DeepEP's analytic model instead.
DEFAULT_NUM_SMS = 64

#: Values of the ``manager`` setting.
MANAGERS = ("plugin", "native")
#: Values of the ``experts`` setting.
EXPERTS = ("spec", "sync_free")

_ENV_PREFIX = "MEGATRON_DEEPEPV2_"
#: The other name of ``num_max_tokens_per_rank``'s variable (read when ``MEGATRON_DEEPEPV2_NUM_MAX_TOKENS_PER_RANK``
#: is unset).
_ALIASES = {_ENV_PREFIX + "MAX_TOKENS_PER_RANK": "num_max_tokens_per_rank"}
#: ``MEGATRON_DEEPEPV2_*`` variables read outside the settings, which :meth:`DeepepV2Settings.from_env` does not warn
#: about: the test suite's Megatron-LM tree with a native deepepv2 (tests/unit/test_native_megatron.py) and the DeepEP
#: and NCCL trees of the README's GPU test (tests/unit/test_readme.py); and the node identity of
#: :mod:`megatron_deepepv2.topology`, which differs per node and so is read there, not as a setting.
OTHER_VARIABLES = ("MEGATRON_DEEPEPV2_NATIVE_TREE", "MEGATRON_DEEPEPV2_README_TREES", "MEGATRON_DEEPEPV2_NODE_ID")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

logger = logging.getLogger(__name__)


@dataclass
class DeepepV2Settings:
    """Switches of the deepepv2 path.

    Attributes:
        backend: ``"auto"``, ``"deepep"`` or ``"reference"``. An explicit choice never falls back.
        layout: Receive layout of Megatron layers: ``expand`` (per-expert rows, aligned, no permute), the only one
            they take; ``compact`` makes a deepepv2 layer raise naming expand (direct calls choose theirs).
        num_max_tokens_per_rank: Token capacity of the buffer, the same on every rank, used as given (it sizes
            the worst-case buffers without host sync). None: the maximum over ranks of the first batch, rounded
            up to a power of two.
        validate: Run the checks that need data on the host (expert ids in range, no duplicate expert
            in a row) and agree on errors across ranks, so bad input raises on every rank. Costs a
            device-to-host sync and a small all-reduce per call: meant for tests and debugging.
        check_ids: Check the expert ids of every direct dispatch (each in ``[-1, num_experts)``, no expert twice in
            one row). On CUDA one small kernel: with host sync its 4-byte flag is read on the host (the dispatch
            waits there anyway) and a bad id raises a ValueError naming the token; without host sync a device-side
            assert stops the process instead of corrupting the exchange. On CPU a ValueError. ``validate`` replaces
            it with the agreed host-side check. The Megatron manager's ids come from ``torch.topk`` and are valid by
            construction, so its layers skip this check (``validate`` still runs).
        growth_timeout_s: How long a rank waiting at a buffer build (a first build, or a batch above the learnt
            token capacity) waits for the other ranks, a backstop: peers that did not need the build make it fail
            within milliseconds over gloo and at DeepEP's timeout over NCCL, every rank naming the rank that grew.
        deterministic: Bit-exact run to run (DeepEP ``deterministic=True``, event waits, ordered
            reductions). The Megatron dispatcher is also deterministic when its config has
            ``deterministic_mode`` (``--deterministic-mode``).
        num_sms: SMs for DeepEP's communication kernels, used for dispatch, combine and their backward
            when Megatron's ``moe_flex_dispatcher_num_sms`` (``moe_deepep_num_sms`` before 0.19) is unset;
            0 = DeepEP's analytic model. Default :data:`DEFAULT_NUM_SMS`.
        allow_hybrid_mode: DeepEP hybrid (RDMA x NVLink) mode. None: only when the group spans nodes.
        no_host_sync: Dispatch without waiting on the host: outputs sized for the worst case from
            ``num_max_tokens_per_rank``, counts kept on the device, no ``.item()``/``.tolist()`` on the path,
            so a MoE layer can be captured in a CUDA graph. Needs the expand layout and experts that take
            device-side counts (see :mod:`megatron_deepepv2.experts`).
        fp8_dispatch: Dispatch the hidden states as e4m3 with one scale per 128 values (about half the bytes) and
            hand the experts BF16 rows again; combine and backward stay BF16 (:mod:`megatron_deepepv2.fp8`).
            Needs BF16 hidden states with a hidden size that is a multiple of 128.
        manager: Which ``_DeepepV2Manager`` deepepv2 layers get on a megatron-core that ships its own:
            ``plugin`` (this package's: expand layout, no host sync, CUDA graphs, determinism, DeepEP lines) or
            ``native`` (megatron-core's; :func:`megatron_deepepv2.install` then patches nothing). Read by
            ``install()``.
        experts: The experts module of every MoE layer, whatever its dispatcher (alltoall, allgather, flex):
            ``spec`` (what the layer spec says) or ``sync_free`` (Megatron's ``SequentialMLP``, which the local spec
            builds, becomes :class:`~megatron_deepepv2.experts.SyncFreeSequentialMLP`: the same parameters and
            checkpoints, two grouped GEMMs, and it takes device-side counts, as no host sync needs). Lets an
            unchanged training script such as ``pretrain_gpt.py`` run without host sync, and compare dispatchers with
            the same experts.
    """

    backend: str = "auto"
    layout: ExpertLayout = ExpertLayout.EXPAND
    num_max_tokens_per_rank: Optional[int] = None
    validate: bool = False
    check_ids: bool = True
    growth_timeout_s: float = 120.0
    deterministic: bool = False
    num_sms: int = DEFAULT_NUM_SMS
    allow_hybrid_mode: Optional[bool] = None
    no_host_sync: bool = False
    fp8_dispatch: bool = False
    manager: str = "plugin"
    experts: str = "spec"

    def __post_init__(self) -> None:
        self.layout = ExpertLayout.parse(self.layout)
        self.backend = str(self.backend).lower()
        self.manager = str(self.manager).lower()
        if self.manager not in MANAGERS:
            raise ValueError(f"manager={self.manager!r} is not one of {', '.join(MANAGERS)} (MEGATRON_DEEPEPV2_MANAGER: "
                             "'plugin' for this package's deepepv2, 'native' for megatron-core's own).")
        self.experts = str(self.experts).lower().replace("-", "_")
        if self.experts not in EXPERTS:
            raise ValueError(f"experts={self.experts!r} is not one of {', '.join(EXPERTS)} (MEGATRON_DEEPEPV2_EXPERTS: "
                             "'spec' for the layer spec's experts, 'sync_free' for SyncFreeSequentialMLP in place of "
                             "SequentialMLP).")
        if self.num_max_tokens_per_rank is not None and int(self.num_max_tokens_per_rank) <= 0:
            raise ValueError(
                f"num_max_tokens_per_rank={self.num_max_tokens_per_rank} must be a positive token count, "
                "or unset to take the largest first batch over the ranks."
            )
        if float(self.growth_timeout_s) <= 0:
            raise ValueError(f"growth_timeout_s={self.growth_timeout_s} must be a positive number of seconds.")
        if int(self.num_sms) < 0:
            raise ValueError(f"num_sms={self.num_sms} must be >= 0 (0 lets the backend choose).")

    @classmethod
    def from_env(cls, environ: Optional[dict[str, str]] = None) -> "DeepepV2Settings":
        """Builds settings from ``MEGATRON_DEEPEPV2_*`` variables.

        Args:
            environ: Mapping to read instead of ``os.environ``.

        Returns:
            Settings with every variable that is set applied over the defaults. Each ``MEGATRON_DEEPEPV2_*``
            variable of ``environ`` that no setting reads and :data:`OTHER_VARIABLES` does not list is logged as
            one WARNING naming the closest setting's variable.

        Raises:
            ValueError: If a variable holds a value its field cannot take.
        """
        environ = os.environ if environ is None else environ
        types = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = environ.get(_ENV_PREFIX + f.name.upper())
            if raw is None:
                raw = next((environ[alias] for alias, name in _ALIASES.items() if name == f.name and alias in environ),
                           None)
            if raw is not None:
                values[f.name] = _parse_env_value(_ENV_PREFIX + f.name.upper(), raw, types[f.name])
        _warn_unread_variables(environ)
        return cls(**values)


def setting_variables() -> list[str]:
    """The environment variables :meth:`DeepepV2Settings.from_env` reads, one per field, then the aliases."""
    return [_ENV_PREFIX + f.name.upper() for f in dataclasses.fields(DeepepV2Settings)] + list(_ALIASES)


def _warn_unread_variables(environ: typing.Mapping[str, str]) -> None:
    """Logs one WARNING for each ``MEGATRON_DEEPEPV2_*`` variable of ``environ`` that nothing reads."""
    known = setting_variables()
    for variable in sorted(environ):
        if not variable.startswith(_ENV_PREFIX) or variable in known or variable in OTHER_VARIABLES:
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
