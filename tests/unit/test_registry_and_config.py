"""Backend registry (explicit choice never falls back) and settings parsing."""

from __future__ import annotations

import pytest

import megatron_deepepv2 as dv2
from megatron_deepepv2.backends import DeepEPBackend, ReferenceBackend, register_backend, resolve_backend
from megatron_deepepv2.backends.deepep import import_deep_ep
from megatron_deepepv2.config import DeepepV2Settings


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

    with pytest.raises(ValueError, match="already taken"):
        register_backend(Impostor)


def test_settings_from_environment() -> None:
    settings = DeepepV2Settings.from_env(
        {
            "MEGATRON_DEEPEPV2_BACKEND": "Reference",
            "MEGATRON_DEEPEPV2_LAYOUT": "compact",
            "MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK": "4096",
            "MEGATRON_DEEPEPV2_VALIDATE": "1",
            "MEGATRON_DEEPEPV2_DETERMINISTIC": "true",
            "MEGATRON_DEEPEPV2_NUM_SMS": "24",
            "MEGATRON_DEEPEPV2_ALLOW_HYBRID_MODE": "auto",
        }
    )
    assert settings == DeepepV2Settings(
        backend="reference", layout="compact", num_max_tokens_per_rank=4096, validate=True,
        deterministic=True, num_sms=24, allow_hybrid_mode=None,
    )
    assert DeepepV2Settings.from_env({}) == DeepepV2Settings()


@pytest.mark.parametrize(
    "env,message",
    [
        ({"MEGATRON_DEEPEPV2_VALIDATE": "maybe"}, "is not a boolean"),
        ({"MEGATRON_DEEPEPV2_NUM_SMS": "many"}, "is not an integer"),
        ({"MEGATRON_DEEPEPV2_LAYOUT": "diagonal"}, "not a known expert layout"),
        ({"MEGATRON_DEEPEPV2_MAX_TOKENS_PER_RANK": "-5"}, "must be a positive token count"),
    ],
)
def test_bad_environment_values_are_rejected(env: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DeepepV2Settings.from_env(env)


def test_configure_and_override() -> None:
    before = dv2.get_settings()
    with dv2.settings_override(layout="compact", num_sms=8) as settings:
        assert settings.layout is dv2.ExpertLayout.COMPACT and dv2.get_settings().num_sms == 8
    assert dv2.get_settings() == before
    with pytest.raises(TypeError, match="Unknown deepepv2 setting"):
        dv2.configure(colour="blue")


def test_dispatch_without_config_resolves_once_per_arguments_and_settings() -> None:
    from megatron_deepepv2 import ops

    arguments = {"backend": "reference", "layout": "compact"}
    first = ops._config_for(arguments)
    assert ops._config_for(dict(arguments)) is first  # resolved once, then carried
    assert first.num_sms == dv2.get_settings().num_sms
    expand = ops._config_for({"backend": "reference", "layout": "expand", "expert_alignment": 4, "zero_padding": True})
    assert expand.layout is dv2.ExpertLayout.EXPAND and expand.expert_alignment == 4
    # A settings change is seen by the next call (the cache belongs to the settings it was resolved under).
    with dv2.settings_override(num_sms=7, check_ids=False):
        changed = ops._config_for(arguments)
        assert changed.num_sms == 7 and changed.check_ids is False
    assert ops._config_for(arguments).num_sms == first.num_sms
    # What resolve rejects is still rejected on every call.
    for _ in range(2):
        with pytest.raises(ValueError, match="not a known expert layout"):
            ops._config_for({"backend": "reference", "layout": "sideways"})
        with pytest.raises(TypeError, match=r"Unknown dispatch setting\(s\) \['colour'\]"):
            ops._config_for({"colour": "blue"})


@pytest.mark.parametrize(
    ("exports", "phrase"),
    [
        ({"Buffer": object, "__version__": "1.2.1"}, "deep_ep 1.2.1 (from "),
        ({"Buffer": object}, "has Buffer but neither ElasticBuffer (DeepEP 2.1) nor EPBuffer (V2.5): it is DeepEP v1"),
        ({"HybridEPBuffer": object}, "exports ['HybridEPBuffer']"),
    ],
)
def test_import_deep_ep_names_the_deepep_line_it_found(monkeypatch: pytest.MonkeyPatch, exports: dict,
                                                       phrase: str) -> None:
    import sys
    import types

    module = types.ModuleType("deep_ep")
    for name, value in exports.items():
        setattr(module, name, value)
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    with pytest.raises(ImportError) as info:
        import_deep_ep()
    assert phrase in str(info.value), str(info.value)
    assert "MEGATRON_DEEPEPV2_BACKEND=reference" in str(info.value)


@pytest.mark.parametrize("buffer", ["EPBuffer", "ElasticBuffer"])
def test_import_deep_ep_accepts_both_deepep_v2_lines(monkeypatch: pytest.MonkeyPatch, buffer: str) -> None:
    import sys
    import types

    module = types.ModuleType("deep_ep")
    setattr(module, buffer, object)
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    assert import_deep_ep() is module
