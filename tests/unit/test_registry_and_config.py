"""Backend registry (explicit choice never falls back) and settings parsing."""

from __future__ import annotations

import logging
import re
import subprocess
from pathlib import Path

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2.backends import registry
from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
from megatron_deepepv2.backends.reference import ReferenceBackend
from megatron_deepepv2.backends.registry import register_backend, resolve_backend
from megatron_deepepv2.backends.deepep.probes import import_deep_ep
from megatron_deepepv2.config import OTHER_VARIABLES, REMOVED_VARIABLES, DeepepV2Settings, setting_variables
from tests.deepep_stand_in import DEEPEP_V1_EXPORTS, install_fake_deep_ep
from tests.git_checkout import not_own_checkout

ROOT = Path(__file__).resolve().parents[2]
PREFIX = "MEGATRON_DEEPEPV2_"  # misspelt names below are built from it, so the repository names none of them


def test_auto_resolves_to_deepep_when_usable_else_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = DeepEPBackend if DeepEPBackend.unavailable_reason() is None else ReferenceBackend
    assert resolve_backend("auto") is expected  # whatever this machine has
    monkeypatch.setattr(DeepEPBackend, "unavailable_reason", classmethod(lambda cls: "no deep_ep here"))
    assert resolve_backend("auto") is ReferenceBackend
    monkeypatch.setattr(DeepEPBackend, "unavailable_reason", classmethod(lambda cls: None))
    assert resolve_backend("auto") is DeepEPBackend
    assert resolve_backend("reference") is ReferenceBackend
    assert resolve_backend("REFERENCE") is ReferenceBackend


_DEEPEP_USABLE = DeepEPBackend.unavailable_reason() is None
needs_no_deepep = pytest.mark.skipif(_DEEPEP_USABLE, reason="DeepEP is usable here; these check the messages "
                                     "a machine without it shows")


@needs_no_deepep
def test_explicit_deepep_raises_import_error_with_instructions() -> None:
    with pytest.raises(ImportError) as info:
        resolve_backend("deepep")
    message = str(info.value)
    assert "deepepv2 backend 'deepep' was requested but cannot run here" in message
    assert "NCCL >= 2.30.4" in message and "MEGATRON_DEEPEPV2_BACKEND=reference" in message


@needs_no_deepep
def test_import_deep_ep_explains_what_is_missing() -> None:
    with pytest.raises(ImportError, match="deep_ep is not importable"):
        import_deep_ep()


def test_unknown_backend_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"choose one of \['auto', 'deepep', 'reference'\]"):
        resolve_backend("nccl")


def test_registering_a_taken_name_is_refused() -> None:
    class Impostor(ReferenceBackend):
        name = "reference"

    class Auto(ReferenceBackend):
        name = "auto"

    with pytest.raises(ValueError, match="already taken"):
        register_backend(Impostor)
    with pytest.raises(ValueError, match="'auto' is reserved"):
        register_backend(Auto)


def test_auto_takes_the_usable_backend_of_lowest_preference_without_naming_any(monkeypatch: pytest.MonkeyPatch,
                                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A registered backend takes part in ``auto`` by its ``auto_preference`` alone: preferred and usable, it is
    chosen; preferred and unusable, it is passed over, its reason logged; nothing usable is an ImportError."""
    class Preferred(ReferenceBackend):
        name = "preferred-stand-in"
        auto_preference = -1

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_auto_choice_logged", None)
    register_backend(Preferred)
    assert resolve_backend("auto") is Preferred
    monkeypatch.setattr(Preferred, "unavailable_reason", classmethod(lambda cls: "no stand-in here"))
    monkeypatch.setattr(DeepEPBackend, "unavailable_reason", classmethod(lambda cls: "no deep_ep here"))
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.backends")
    assert resolve_backend("auto") is ReferenceBackend
    said = [r.getMessage() for r in caplog.records if "resolved to 'reference'" in r.getMessage()]
    assert said and "preferred-stand-in unavailable: no stand-in here" in said[0] and "deepep unavailable" in said[0]
    monkeypatch.setattr(ReferenceBackend, "unavailable_reason", classmethod(lambda cls: "no gloo here"))
    with pytest.raises(ImportError, match="found no usable backend.*reference unavailable: no gloo here"):
        resolve_backend("auto")


def test_settings_from_environment() -> None:
    settings = DeepepV2Settings.from_env(
        {
            "MEGATRON_DEEPEPV2_BACKEND": "Reference",
            "MEGATRON_DEEPEPV2_NO_HOST_SYNC": "1",
            "MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK": "4096",
            "MEGATRON_DEEPEPV2_VALIDATE": "1",
            "MEGATRON_DEEPEPV2_DETERMINISTIC": "true",
            "MEGATRON_DEEPEPV2_NUM_SMS": "24",
            "MEGATRON_DEEPEPV2_ALLOW_HYBRID_MODE": "auto",
        }
    )
    assert settings == DeepepV2Settings(
        backend="reference", host_sync=False, num_max_tokens_per_rank=4096, validate=True,
        deterministic=True, num_sms=24, allow_hybrid_mode=None,
    )
    assert DeepepV2Settings.from_env({}) == DeepepV2Settings()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MEGATRON_DEEPEPV2_VALIDATE": "maybe"}, "is not a boolean"),
        ({"MEGATRON_DEEPEPV2_NUM_SMS": "many"}, "is not an integer"),
        ({"MEGATRON_DEEPEPV2_NO_HOST_SYNC": "perhaps"}, "MEGATRON_DEEPEPV2_NO_HOST_SYNC='perhaps' is not a boolean"),
        ({"MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK": "-5"},
         r"num_max_tokens_per_rank=-5 must be an integer >= 1 or None.*MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK"),
        ({"MEGATRON_DEEPEPV2_NUM_SMS": "-1"},
         r"num_sms=-1 must be an integer >= 0; .*MEGATRON_DEEPEPV2_NUM_SMS: 0 for the backend's choice\."),
        ({"MEGATRON_DEEPEPV2_NUM_SMS": "1.5"}, r"MEGATRON_DEEPEPV2_NUM_SMS='1.5' is not an integer"),
        ({"MEGATRON_DEEPEPV2_MANAGER": "mine"}, "is not one of plugin, native.*MEGATRON_DEEPEPV2_MANAGER"),
    ],
)
def test_bad_environment_values_are_rejected_when_read(env: dict, message: str) -> None:
    """A value its type cannot parse, or one out of range, raises when the settings are read, naming the variable."""
    with pytest.raises(ValueError, match=message):
        DeepepV2Settings.from_env(env)


@pytest.mark.parametrize("change", [{"num_sms": -1}, {"growth_timeout_s": 0}, {"experts": "dense"},
                                    {"num_max_tokens_per_rank": 0}, {"manager": "mine"}])
def test_settings_are_checked_when_built_and_a_bad_change_leaves_them_as_they_were(change: dict) -> None:
    """configure(), settings_override() and a settings object built directly all refuse a bad value at once; the
    process-wide settings stay what they were."""
    before = dv2.get_settings()
    name = next(iter(change))
    for build in (lambda: dv2.configure(**change), lambda: dv2.settings_override(**change).__enter__(),
                  lambda: DeepepV2Settings(**change)):
        with pytest.raises(ValueError, match=f"{name}="):
            build()
        assert dv2.get_settings() == before


def test_the_no_host_sync_variable_is_the_inverse_of_host_sync() -> None:
    assert DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_NO_HOST_SYNC": "0"}).host_sync is True
    assert DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_NO_HOST_SYNC": "1"}).host_sync is False
    assert [v for v in setting_variables() if "HOST_SYNC" in v] == ["MEGATRON_DEEPEPV2_NO_HOST_SYNC"]


def test_configure_and_override() -> None:
    before = dv2.get_settings()
    with dv2.settings_override(num_sms=8) as settings:
        assert settings.host_sync is True and dv2.get_settings().num_sms == 8
    assert dv2.get_settings() == before
    with pytest.raises(TypeError, match="Unknown deepepv2 setting"):
        dv2.configure(colour="blue")


def test_dispatch_without_config_resolves_once_per_arguments_and_settings() -> None:
    from megatron_deepepv2 import ops

    arguments = {"backend": "reference", "layout": "compact"}
    first = ops._config_for(arguments)
    assert ops._config_for(dict(arguments)) is first  # resolved once, then carried
    assert first.settings.num_sms == dv2.get_settings().num_sms
    expand = ops._config_for({"backend": "reference", "layout": "expand", "expert_alignment": 4})
    assert expand.layout is dv2.ExpertLayout.EXPAND and expand.expert_alignment == 4
    # A settings change is seen by the next call (the cache belongs to the settings it was resolved under).
    with dv2.settings_override(num_sms=7, check_ids=False):
        changed = ops._config_for(arguments)
        assert changed.settings.num_sms == 7 and changed.settings.check_ids is False
    assert ops._config_for(arguments).settings.num_sms == first.settings.num_sms
    # What resolve rejects is still rejected on every call.
    for _ in range(2):
        with pytest.raises(ValueError, match="not a known expert layout"):
            ops._config_for({"backend": "reference", "layout": "sideways"})
        with pytest.raises(TypeError, match=r"Unknown dispatch setting\(s\) \['colour'\]"):
            ops._config_for({"colour": "blue"})


@pytest.mark.parametrize(
    ("exports", "phrase"),
    [
        (DEEPEP_V1_EXPORTS, "deep_ep 1.2.1 (from "),
        ({"Buffer": object}, "has Buffer but neither ElasticBuffer (DeepEP 2.1) nor EPBuffer (V2.5): it is DeepEP v1"),
        ({"HybridEPBuffer": object}, "exports ['HybridEPBuffer']"),
    ],
)
def test_import_deep_ep_names_the_deepep_line_it_found(monkeypatch: pytest.MonkeyPatch, exports: dict,
                                                       phrase: str) -> None:
    install_fake_deep_ep(monkeypatch, **exports)
    with pytest.raises(ImportError) as info:
        import_deep_ep()
    assert phrase in str(info.value), str(info.value)
    assert "MEGATRON_DEEPEPV2_BACKEND=reference" in str(info.value)


@pytest.mark.parametrize("buffer", ["EPBuffer", "ElasticBuffer"])
def test_import_deep_ep_accepts_both_deepep_v2_lines(monkeypatch: pytest.MonkeyPatch, buffer: str) -> None:
    module = install_fake_deep_ep(monkeypatch, **{buffer: object})
    assert import_deep_ep() is module


@pytest.mark.parametrize("deepep_problem,gpu,chosen,level", [
    ("no deep_ep here", True, ReferenceBackend, logging.WARNING),  # a GPU run on the portable backend
    ("no deep_ep here", False, ReferenceBackend, logging.INFO),  # a CPU machine: reference is the only choice
    (None, True, DeepEPBackend, logging.INFO),
])
def test_auto_warns_when_it_falls_back_to_reference_on_a_gpu_machine(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture,
                                                                     deepep_problem, gpu, chosen, level) -> None:
    monkeypatch.setattr(registry, "_auto_choice_logged", None)
    monkeypatch.setattr(DeepEPBackend, "unavailable_reason", classmethod(lambda cls: deepep_problem))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.backends")
    assert resolve_backend("auto") is chosen
    assert resolve_backend("auto") is chosen  # logged once
    records = [r for r in caplog.records if "deepepv2 backend 'auto' resolved to" in r.getMessage()]
    assert [(r.levelno, f"resolved to {chosen.name!r}" in r.getMessage()) for r in records] == [(level, True)]
    assert deepep_problem is None or deepep_problem in records[0].getMessage()


def test_an_unread_variable_gets_one_warning_naming_the_closest_setting(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="megatron_deepepv2.config")
    environ = {
        PREFIX + "NO_HOSTSYNC": "1",  # misspelt: no effect, one warning
        PREFIX + "FP8_DISPATCH": "1",
        PREFIX + "MAX_TOKENS_PER_RANK": "512",  # the capacity's second name
        **{name: "/somewhere" for name in OTHER_VARIABLES},  # read by the test suite, not by a setting
        "EP_DISABLE_GIN": "1",
    }
    assert DeepepV2Settings.from_env(environ) == DeepepV2Settings(fp8_dispatch=True, num_max_tokens_per_rank=512)
    records = [r for r in caplog.records if r.name == "megatron_deepepv2.config"]
    assert [r.levelno for r in records] == [logging.WARNING], [r.getMessage() for r in records]
    message = records[0].getMessage()
    assert message.startswith(PREFIX + "NO_HOSTSYNC is set, but no megatron_deepepv2 setting reads it"), message
    assert f"the closest setting's variable is {PREFIX}NO_HOST_SYNC " in message, message


@pytest.mark.parametrize("suffix,closest", [("EXPERT", "EXPERTS"), ("NUMSMS", "NUM_SMS"), ("DETERMINISM", "DETERMINISTIC"),
                                            ("VALIDATION", "VALIDATE")])
def test_the_warning_names_the_closest_setting(caplog: pytest.LogCaptureFixture, suffix: str, closest: str) -> None:
    caplog.set_level(logging.WARNING, logger="megatron_deepepv2.config")
    DeepepV2Settings.from_env({PREFIX + suffix: "1"})
    (record,) = [r for r in caplog.records if r.name == "megatron_deepepv2.config"]
    assert f"closest setting's variable is {PREFIX}{closest} " in record.getMessage()


def test_every_variable_the_repository_names_is_read_by_something() -> None:
    """Each ``MEGATRON_DEEPEPV2_*`` name in the repository's files (code, tests, tools, docs) is a setting's variable
    or one of ``OTHER_VARIABLES``, so none of them draws the unread-variable warning."""
    reason = not_own_checkout(ROOT)
    if reason:
        pytest.skip(reason)
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    names = set()
    for relative in filter(None, listed.stdout.split("\0")):
        path = ROOT / relative
        if path.is_file() and path.suffix in (".py", ".md", ".sh", ".json", ".toml", ".yml", ".yaml", ""):
            names.update(re.findall(PREFIX + r"[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")))
    assert {PREFIX + "BACKEND", PREFIX + "EXPERTS", PREFIX + "README_TREES"} <= names  # the scan sees them
    unread = sorted(names - set(setting_variables()) - set(OTHER_VARIABLES) - set(REMOVED_VARIABLES))
    assert not unread, f"named in the repository but read by no setting and not in config.OTHER_VARIABLES: {unread}"


def test_a_removed_variable_says_what_to_do_instead(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="megatron_deepepv2.config"):
        settings = DeepepV2Settings.from_env({"MEGATRON_DEEPEPV2_LAYOUT": "compact"})
    assert settings == DeepepV2Settings()
    assert "MEGATRON_DEEPEPV2_LAYOUT is set, but no megatron_deepepv2 setting reads it any more: Megatron layers " \
           "always dispatch in the expand layout" in caplog.text, caplog.text
    assert not set(REMOVED_VARIABLES) & set(setting_variables())


# ------------------------------------------------------------------------------------------------
# Types and enums of settings and configurations, checked where they are built
# ------------------------------------------------------------------------------------------------
def _every_way_to_give(change: dict) -> list:
    """Each way code gives settings: a settings object, configure(), settings_override() and resolve_config() (which
    reads None as "unset" and a backend as the configuration's)."""
    ways = [lambda: DeepepV2Settings(**change), lambda: dv2.configure(**change),
            lambda: dv2.settings_override(**change).__enter__()]
    if None not in change.values() and "backend" not in change:
        ways.append(lambda: dv2.resolve_config(backend="reference", **change))
    return ways


def _assert_refused(change: dict, accepted: str) -> None:
    """Every way of giving ``change`` (one setting) raises a ValueError naming the setting, the value, its type,
    ``accepted`` and how to give it (in code and its variable), and leaves the process-wide settings as they were."""
    ((name, value),) = change.items()
    variable = PREFIX + ("NO_HOST_SYNC" if name == "host_sync" else name.upper())
    before = dv2.get_settings()
    for give in _every_way_to_give(change):
        with pytest.raises(ValueError) as info:
            give()
        message = str(info.value)
        assert message.startswith(f"DeepepV2Settings.{name}={value!r} {accepted}; got {type(value).__name__}. "
                                  f"Give it as configure({name}=...), or set {variable}"), message
        assert dv2.get_settings() == before


@pytest.mark.parametrize("name", ["validate", "check_ids", "deterministic", "host_sync", "fp8_dispatch"])
@pytest.mark.parametrize("value", ["no", "False", "", 0, 1, None, 1.0])
def test_a_bool_setting_takes_only_a_bool(name: str, value) -> None:
    """``validate="no"`` would be truthy: strings, ints and None are refused, True and False kept as given."""
    _assert_refused({name: value}, "must be True or False")
    for flag in (True, False):
        assert getattr(DeepepV2Settings(**{name: flag}), name) is flag


@pytest.mark.parametrize("value", ["no", "auto", 0, 1])
def test_allow_hybrid_mode_takes_a_bool_or_none(value) -> None:
    """The setting Megatron's first build turned into ``int("no")``: refused where it is given."""
    _assert_refused({"allow_hybrid_mode": value}, "must be True, False or None")
    for mode in (None, True, False):
        assert DeepepV2Settings(allow_hybrid_mode=mode).allow_hybrid_mode is mode


@pytest.mark.parametrize("value", [1.5, 24.0, True, False, -1, -64, "24", None])
def test_an_sm_count_is_a_non_negative_int(value) -> None:
    """Floats (even whole ones), bools, negatives, strings and None are refused; 0 stays DeepEP's own choice."""
    _assert_refused({"num_sms": value}, "must be an integer >= 0")
    for count in (0, 1, 24, 132):
        settings = DeepepV2Settings(num_sms=count)
        assert settings.num_sms == count and type(settings.num_sms) is int


@pytest.mark.parametrize("value", [0, -5, 2.5, 4096.0, True, "4096"])
def test_a_token_capacity_is_a_positive_int_or_none(value) -> None:
    _assert_refused({"num_max_tokens_per_rank": value}, "must be an integer >= 1 or None")
    assert DeepepV2Settings(num_max_tokens_per_rank=None).num_max_tokens_per_rank is None
    assert DeepepV2Settings(num_max_tokens_per_rank=4096).num_max_tokens_per_rank == 4096


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True, "120", None])
def test_a_timeout_is_a_positive_number(value) -> None:
    _assert_refused({"growth_timeout_s": value}, "must be a number > 0")
    assert DeepepV2Settings(growth_timeout_s=5).growth_timeout_s == 5.0


@pytest.mark.parametrize(("name", "value", "accepted"), [
    ("manager", "megatron", "is not one of plugin, native"),
    ("manager", None, "is not one of plugin, native"),
    ("experts", "dense", "is not one of spec, sync_free"),
    ("experts", 1, "is not one of spec, sync_free"),
    ("backend", 3, "must be a non-empty name (a str)"),
    ("backend", "", "must be a non-empty name (a str)"),
])
def test_a_named_setting_takes_a_string_of_its_names(name: str, value, accepted: str) -> None:
    """Enum settings take their names in any case (``-`` for ``_``) and nothing else; the backend any name, looked up
    when a configuration is resolved."""
    _assert_refused({name: value}, accepted)


def test_named_settings_are_stored_in_one_spelling() -> None:
    settings = DeepepV2Settings(manager="NATIVE", experts="Sync-Free", backend=" Reference ")
    assert (settings.manager, settings.experts, settings.backend) == ("native", "sync_free", "reference")


def test_a_type_error_in_a_setting_is_refused_before_any_communication() -> None:
    """dispatch() names the setting (the process has no group here: the error comes before any collective)."""
    with pytest.raises(ValueError, match=r"DeepepV2Settings\.num_sms=1\.5 must be an integer >= 0"):
        dv2.resolve_config(backend="reference", layout="expand", num_sms=1.5)


def test_settings_and_dispatch_config_fields_overlap_only_in_the_backend() -> None:
    """resolve_config() routes each keyword by name to the settings or to the configuration: a name in both would
    reach one of them silently. The one shared name is ``backend``, which resolve_config() handles on its own (the
    setting names the backend, the configuration holds the class that runs)."""
    import dataclasses

    from megatron_deepepv2.backends.base import DispatchConfig

    settings = {f.name for f in dataclasses.fields(DeepepV2Settings)}
    config = {f.name for f in dataclasses.fields(DispatchConfig)}
    assert settings & config == {"backend"}, f"fields in both DeepepV2Settings and DispatchConfig: {settings & config}"
    resolved = dv2.resolve_config(backend="reference", layout="expand")
    assert resolved.backend is ReferenceBackend


@pytest.mark.parametrize("spelling", ["expand", "EXPAND", " Expand", dv2.ExpertLayout.EXPAND])
def test_a_layout_name_becomes_the_enum_member_where_the_config_is_built(spelling) -> None:
    """The backends compare layouts with ``is``: a string must not survive construction. The string and enum
    configurations are then the same configuration (equal, same hash), as they dispatch alike."""
    from megatron_deepepv2.backends.base import DispatchConfig

    config = DispatchConfig(ReferenceBackend, layout=spelling, expert_alignment=16)
    assert config.layout is dv2.ExpertLayout.EXPAND and config.padded
    assert DispatchConfig(ReferenceBackend, layout="compact").layout is dv2.ExpertLayout.COMPACT
    enum_config = DispatchConfig(ReferenceBackend, layout=dv2.ExpertLayout.EXPAND, expert_alignment=16)
    assert config == enum_config and hash(config) == hash(enum_config)
    assert dv2.resolve_config(backend="reference", layout=spelling).layout is dv2.ExpertLayout.EXPAND


@pytest.mark.parametrize(("change", "accepted"), [
    ({"layout": "sideways"}, "is not one of compact, expand"),
    ({"layout": 1}, "is not one of compact, expand"),
    ({"layout": None}, "is not one of compact, expand"),
    ({"expert_alignment": 2.0}, "must be an integer >= 1"),
    ({"mask_foreign_weights": "no"}, "must be True or False"),
    ({"clear_tail": 0}, "must be True or False"),
    ({"settings": {"num_sms": 8}}, "must be a DeepepV2Settings"),
])
def test_a_dispatch_config_checks_each_field_when_built(change: dict, accepted: str) -> None:
    from megatron_deepepv2.backends.base import DispatchConfig

    ((name, value),) = change.items()
    with pytest.raises(ValueError) as info:
        DispatchConfig(ReferenceBackend, **change)
    assert str(info.value).startswith(f"DispatchConfig.{name}={value!r} {accepted}"), str(info.value)
    assert f"; got {type(value).__name__}." in str(info.value)


@pytest.mark.parametrize("backend", ["reference", object, None])
def test_a_dispatch_config_takes_a_backend_class(backend) -> None:
    from megatron_deepepv2.backends.base import DispatchConfig

    with pytest.raises(ValueError, match=r"DispatchConfig\.backend=.* must be a subclass of DispatchBackend"):
        DispatchConfig(backend)


def test_worst_case_rows_read_a_layout_name_as_its_layout() -> None:
    from megatron_deepepv2.layout import worst_case_recv_rows

    sizes = dict(group_size=2, num_max_tokens_per_rank=8, num_topk=3, num_local_experts=4, expert_alignment=4)
    assert worst_case_recv_rows("compact", **sizes) == 2 * 8  # G * T_max
    assert worst_case_recv_rows("expand", **sizes) == 2 * 8 * 3 + 3 * 4  # G * T_max * min(K, E_local) + 3 * E_local
    with pytest.raises(ValueError, match="not a known expert layout"):
        worst_case_recv_rows("sideways", **sizes)
