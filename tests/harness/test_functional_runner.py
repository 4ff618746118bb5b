"""The GPU case runner's choice of cases, on CPU: names, exceptions and shards that partition the cases."""

from __future__ import annotations

import pytest

from tests.functional.runner import CaseRegistry

NAMES = [f"case_{letter}" for letter in "abcdefg"]


def _registry() -> CaseRegistry:
    registry = CaseRegistry()
    for name in NAMES:
        def case() -> None:
            """A case that does nothing (the registry names a case after its function)."""
        case.__name__ = name
        registry.case(case)
    return registry


def test_named_and_excepted_cases_keep_the_definition_order() -> None:
    registry = _registry()
    assert registry.select([]) == NAMES
    assert registry.select(["case_d", "case_b"]) == ["case_b", "case_d"]
    assert registry.select(["--except=case_a", "--except=case_g"]) == NAMES[1:-1]
    assert registry.select(["case_a", "case_c", "--except=case_a"]) == ["case_c"]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 9])
def test_shards_partition_the_chosen_cases(count: int) -> None:
    registry = _registry()
    shards = [registry.select(["--except=case_c", f"--shard={index}/{count}"]) for index in range(count)]
    chosen = [name for name in NAMES if name != "case_c"]
    assert sorted(name for shard in shards for name in shard) == sorted(chosen)  # each case in exactly one shard
    assert max(map(len, shards)) - min(map(len, shards)) <= 1  # and the shards even
    assert all(shard == [name for name in chosen if name in shard] for shard in shards)


@pytest.mark.parametrize("argv, message", [
    (["case_z"], r"unknown case\(s\) \['case_z'\]; the cases are \['case_a'"),
    (["--except=case_z"], r"unknown case\(s\) \['case_z'\]"),
    (["--shard=4/4"], r"--shard=4/4: expected I/N with 0 <= I < N"),
    (["--shard=1"], r"--shard=1: expected I/N"),
    (["--shard=-1/2"], r"--shard=-1/2: expected I/N"),
])
def test_a_bad_choice_names_what_was_wrong(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        _registry().select(argv)
