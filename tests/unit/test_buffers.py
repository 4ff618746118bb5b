"""Buffer lifecycle: one buffer per group, collective rebuilds on key change and growth, retired buffers released once
per step when no handle uses them, destroy; a layer's static checks run once whatever its token counts."""

from __future__ import annotations

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2 import buffers
from tests.distributed import run_distributed


def _dispatch(num_tokens: int, hidden: int, topk: int = 2, **kwargs):
    x = torch.randn(num_tokens, hidden)
    idx = torch.stack([torch.randperm(4)[:topk] for _ in range(num_tokens)]) if num_tokens else torch.zeros(0, topk, dtype=torch.long)
    return dv2.dispatch(x, idx, torch.rand(num_tokens, topk), 4, **kwargs)


def _lifecycle_worker(rank: int, world: int) -> dict:
    # On the DeepEP backend (over its stand-in), whose buffers are also kept apart by hybrid mode, a construction
    # argument it adds to what the ranks agree on at a build (DeepEPBackend.extra_agreement).
    from tests.deepep_stand_in import use_stand_in_backend

    use_stand_in_backend()
    dv2.configure(backend="deepep")
    stats = buffers.buffer_stats()
    # First build: capacity = largest first batch over the ranks (5 on rank 1), rounded to a power of two.
    first = _dispatch(3 + 2 * rank, hidden=8).handle.buffer
    assert first.spec.num_max_tokens_per_rank == 8
    assert stats.builds == 1
    # Steady state: same shape key and within capacity -> the same buffer, no build.
    for tokens in (1, 8, 0):
        assert _dispatch(tokens, hidden=8).handle.buffer is first
    assert stats.builds == 1
    # Every dispatch records its handle; the records of dropped handles are pruned, so they stay bounded.
    kept = [_dispatch(1, hidden=8) for _ in range(3)]
    for _ in range(300):
        _dispatch(1, hidden=8)
    records = first.handle_records.refs
    assert len(records) <= 2 * buffers._PRUNE_AT, len(records)
    assert {id(ref()) for ref in records if ref() is not None} == {id(result.handle) for result in kept}
    del kept
    # Another hidden size -> a buffer of its own (collective build); the first one stays in use for its layers.
    second = _dispatch(2, hidden=16).handle.buffer
    assert second is not first and second.spec.hidden == 16 and second.spec.num_max_tokens_per_rank == 8
    assert _dispatch(2, hidden=8).handle.buffer is first and stats.builds == 2
    # The SM count is a per-call argument, not a build argument: another one shares the buffer, builds nothing.
    assert _dispatch(2, hidden=8, num_sms=12).handle.buffer is first and stats.builds == 2
    # Hybrid mode is a construction argument (DeepEPBackend.extra_agreement): another value is a buffer of its own.
    hybrid_off = _dispatch(2, hidden=8, allow_hybrid_mode=False).handle.buffer
    assert hybrid_off is not first and hybrid_off.spec.key == (8, 2, False, False) and stats.builds == 3
    assert first.spec.key == (8, 2, False, None)  # hidden size, top-k, FP8, allow_hybrid_mode
    # Top-k is part of the key too.
    third = _dispatch(2, hidden=16, topk=3).handle.buffer
    assert third is not second and stats.builds == 4
    # A batch above the capacity on every rank grows that key's buffer to the max over ranks (power of two).
    fourth = _dispatch(9 + rank * 10, hidden=16, topk=3).handle.buffer
    assert fourth.spec.num_max_tokens_per_rank == 32 and stats.rebuilds == 1
    assert buffers.active_buffers() == [first, second, hybrid_off, fourth]
    # The superseded buffer is kept while handles use it (none here: the dispatch's result is gone); no dispatch
    # releases it (nothing runs per call for retired buffers), the next build on the group does, on every rank.
    assert buffers.retired_buffers() == [third]
    _dispatch(1, hidden=8)
    assert buffers.retired_buffers() == [third] and stats.released == 0
    _dispatch(1, hidden=32)
    assert buffers.retired_buffers() == [] and stats.released == 1
    dv2.destroy_buffers()
    assert buffers.active_buffers() == []
    return {"builds": stats.builds}


def _uneven_growth_worker(rank: int, world: int) -> None:
    # Only rank 0 exceeds the capacity: with validation on, the per-call agreement shares the count
    # and every rank grows together (no hang, no mismatched collectives).
    _dispatch(4, hidden=8)
    assert buffers.active_buffers()[0].spec.num_max_tokens_per_rank == 4
    result = _dispatch(20 if rank == 0 else 1, hidden=8)
    assert result.handle.buffer.spec.num_max_tokens_per_rank == 32


def _configured_capacity_worker(rank: int, world: int) -> None:
    with dv2.settings_override(num_max_tokens_per_rank=100):
        backend = _dispatch(3, hidden=8).handle.buffer
        assert backend.spec.num_max_tokens_per_rank == 100  # as configured: no power-of-two inflation
    # An explicit per-call capacity smaller than the batch is an input error on every rank.
    try:
        _dispatch(10, hidden=8, num_max_tokens_per_rank=8)
    except ValueError as error:
        assert "num_max_tokens_per_rank=8" in str(error)
    else:
        raise AssertionError("expected ValueError")


def test_buffer_reused_rebuilt_grown_and_destroyed() -> None:
    results = run_distributed(_lifecycle_worker, 2)
    assert results == [{"builds": 6}, {"builds": 6}]


def test_growth_with_one_rank_exceeding_under_validation() -> None:
    run_distributed(_uneven_growth_worker, 2)


def test_configured_capacity_is_used_exactly() -> None:
    run_distributed(_configured_capacity_worker, 2)


def _build_logs(rank: int, world: int, backend: str) -> list[str]:
    import logging

    if backend == "deepep":
        from tests.deepep_stand_in import use_stand_in_backend

        use_stand_in_backend()
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("megatron_deepepv2.buffers")
    logger.addHandler(Keep())
    logger.setLevel(logging.INFO)
    dv2.configure(backend=backend, validate=False)
    _dispatch(5, hidden=8)
    _dispatch(20, hidden=8)  # grows the capacity: a second build
    return [message for message in records if message.startswith("Built")]


def test_each_build_logs_its_memory_and_the_capacity_it_was_sized_for() -> None:
    """Users budget the buffers from these lines: bytes (DeepEP's buffer; 0 for the reference backend, which
    allocates per call) and the tokens per rank each build was sized for."""
    for backend, mib in (("reference", "0.0 MiB"), ("deepep", "2.0 MiB")):
        (logs, _) = run_distributed(_build_logs, 2, backend, env={"LOCAL_WORLD_SIZE": "2"})
        assert len(logs) == 2, logs
        assert logs[0] == f"Built the {backend} buffer: {mib} of device memory, sized for 8 tokens per rank " \
                          "(hidden 8, top-k 2, 2 ranks)", logs
        assert "sized for 32 tokens per rank" in logs[1], logs


# ---------------------------------------------------------------- static checks once, whatever the token count
def _memo_worker(rank: int, world: int, configured: bool) -> list[int]:
    import pytest

    from megatron_deepepv2 import validation

    checked: list[int] = []
    original = validation.dispatch_inputs_problem

    def counting(x, *args, **kwargs):
        checked.append(x.shape[0])
        return original(x, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validation, "dispatch_inputs_problem", counting)
        kwargs = {"num_max_tokens_per_rank": 32} if configured else {}
        # Variable-length batches (the same on every rank, so that a learnt capacity grows on all together).
        backends = [_dispatch(tokens, hidden=8, **kwargs).handle.buffer for tokens in (5, 17, 3, 32, 0, 11, 8)]
        assert checked == [5], checked  # the first call only: the others differ in the token count alone
        if configured:
            assert all(b is backends[0] for b in backends) and buffers.buffer_stats().builds == 1
        else:  # 5 -> capacity 8; 17 grows it to 32 on every rank; the rest fit
            assert backends[1:] == [backends[1]] * 6 and backends[1].spec.num_max_tokens_per_rank == 32
            assert buffers.buffer_stats().builds == 2
        # What the checks say of the token count is still checked on every call, by integer compares.
        x, idx, w = torch.randn(6, 8), torch.tensor([[0, 1]] * 6), torch.rand(6, 2)
        with pytest.raises(ValueError, match=r"topk_idx must be \[T=6, K\] to match x; got shape \(5, 2\)"):
            dv2.dispatch(x, idx[:5], w, 4, **kwargs)
        with pytest.raises(ValueError, match=r"topk_weights has shape \(5, 2\); it must match topk_idx \(6, 2\)"):
            dv2.dispatch(x, idx, w[:5], 4, **kwargs)
        if configured:
            with pytest.raises(ValueError, match="dispatches 33 tokens but num_max_tokens_per_rank=32"):
                _dispatch(33, hidden=8, **kwargs)
        # Other static facts change the signature: checked again, and a bad one raises its clear error.
        with pytest.raises(TypeError, match="topk_idx has dtype torch.int32"):
            dv2.dispatch(x, idx.int(), w, 4, **kwargs)
        assert _dispatch(9, hidden=8, **kwargs).handle.buffer is backends[-1]  # not checked again; the lease kept
    return checked


def test_static_checks_run_once_for_variable_token_counts_and_the_buffer_is_kept() -> None:
    for configured in (True, False):
        checked = run_distributed(_memo_worker, 2, configured, env={"MEGATRON_DEEPEPV2_VALIDATE": "0"})
        # Good inputs once, then each bad input; a failed check leaves the good signature in place.
        expected = [5, 6, 6] + ([33] if configured else []) + [6]
        assert checked == [expected, expected], (configured, checked)


# ---------------------------------------------------------------- retired buffers released once per step
def _release_worker(rank: int, world: int) -> dict:
    import pytest
    import torch.distributed as dist

    from megatron_deepepv2.backends.reference import ReferenceBackend

    reduces: list[int] = []
    destroyed: list[ReferenceBackend] = []
    all_reduce, destroy = dist.all_reduce, ReferenceBackend.destroy

    def counting_all_reduce(*args, **kwargs):
        reduces.append(1)
        return all_reduce(*args, **kwargs)

    def recording_destroy(self) -> None:
        destroyed.append(self)
        destroy(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dist, "all_reduce", counting_all_reduce)
        patch.setattr(ReferenceBackend, "destroy", recording_destroy)
        assert buffers.release_retired_buffers() == 0 and reduces == []  # nothing built: nothing to agree on
        first = _dispatch(4, hidden=8)  # capacity 4
        old = first.handle.buffer
        before = len(reduces)
        assert buffers.release_retired_buffers() == 0 and len(reduces) == before  # nothing retired: no collective
        grown = _dispatch(10, hidden=8)  # every rank exceeds: grows to 16, the old buffer retires
        assert grown.handle.buffer is not old and buffers.retired_buffers() == [old]
        dv2.combine(first.recv_x, first.handle)  # a handle of the retired buffer still works
        # Rank 0 still holds a handle of the old buffer (a pending backward): kept on every rank.
        if rank == 1:
            del first
        before = len(reduces)
        assert buffers.release_retired_buffers() == 0 and len(reduces) == before + 1  # one small all-reduce
        assert buffers.retired_buffers() == [old] and destroyed == []
        if rank == 0:
            del first
        assert buffers.release_retired_buffers() == 1 and destroyed == [old] and buffers.retired_buffers() == []
        before = len(reduces)
        assert buffers.release_retired_buffers() == 0 and len(reduces) == before  # nothing retired again
        assert buffers.active_buffers() == [grown.handle.buffer] and grown.handle.buffer not in destroyed
    return {"released": buffers.buffer_stats().released}


def test_retired_buffers_are_released_at_the_first_step_no_handle_uses_them() -> None:
    assert run_distributed(_release_worker, 2) == [{"released": 1}, {"released": 1}]


def test_what_the_ranks_agree_on_is_the_contracts_then_the_backends_own() -> None:
    """What keeps buffers apart and what the ranks agree on at a build is the contract's ``BUILD_AGREEMENT``, which
    every backend shares, then the backend's ``extra_agreement``: DeepEP's hybrid mode (a construction argument of
    its buffer) is part of the DeepEP backend's key and no other's; a spec without a backend has the contract's
    alone; a new backend adds its own fields the same way."""
    from megatron_deepepv2.backends.base import BUILD_AGREEMENT, BufferSpec, DispatchBackend
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.config import DeepepV2Settings
    from megatron_deepepv2.agreement import AgreedField

    assert [field.name for field in BUILD_AGREEMENT] == ["hidden size", "top-k", "FP8"]
    assert DispatchBackend.extra_agreement == () and ReferenceBackend.extra_agreement == ()
    off = DeepepV2Settings(allow_hybrid_mode=False)
    assert BufferSpec(8, 2, 0, off, backend=ReferenceBackend).key == (8, 2, False)
    assert BufferSpec(8, 2, 0, backend=ReferenceBackend).key == (8, 2, False)
    assert BufferSpec(8, 2, 0, off, backend=DeepEPBackend).key == (8, 2, False, False)
    spec = BufferSpec(8, 2, 0, backend=DeepEPBackend)
    assert [field.name for field in spec.agreed_fields] == ["hidden size", "top-k", "FP8", "allow_hybrid_mode"]
    assert spec.key == (8, 2, False, None) and [field.encode(spec) for field in spec.agreed_fields] == [8, 2, 0, -1]
    assert BufferSpec(8, 2, 0, off).agreed_fields == BUILD_AGREEMENT and BufferSpec(8, 2, 0, off).key == (8, 2, False)

    class WithTimeout(ReferenceBackend):  # not registered: a class of its own, as a new backend is
        extra_agreement = (AgreedField("growth timeout", lambda spec: spec.settings.growth_timeout_s),)

    spec = BufferSpec(8, 2, 0, DeepepV2Settings(growth_timeout_s=5.0), backend=WithTimeout)
    assert spec.key == (8, 2, False, 5.0) and [field.encode(spec) for field in spec.agreed_fields] == [8, 2, 0, 5]


def _hybrid_setting_worker(rank: int, world: int) -> tuple:
    # Rank 1 turns hybrid mode off: the reference backend has no such construction argument, so its ranks build alike.
    dv2.configure(backend="reference", validate=False, allow_hybrid_mode=False if rank == 1 else None)
    buffer = _dispatch(3, hidden=8).handle.buffer
    return buffer.spec.key, buffers.buffer_stats().builds


def test_a_deepep_setting_keeps_no_reference_buffers_apart() -> None:
    assert run_distributed(_hybrid_setting_worker, 2) == [((8, 2, False), 1), ((8, 2, False), 1)]


def _unlike_limits_worker(rank: int, world: int) -> tuple[str, str]:
    # Built directly, as buffers.get_buffer would never build them: rank 1 sized for twice the tokens.
    from megatron_deepepv2.backends.base import BufferSpec
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.groups import state_of

    try:
        ReferenceBackend(state_of(torch.distributed.group.WORLD),
                         BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=16 * (rank + 1)))
    except ValueError as error:
        return type(error).__name__, str(error)
    return "built", ""


def test_reference_buffers_sized_for_unlike_token_limits_raise_on_every_rank_naming_them() -> None:
    """The reference backend's construction is collective and agrees on the token limit: ranks that size a buffer
    for different limits raise together, each rank's limit named, instead of exchanging rows at unlike offsets."""
    for kind, message in run_distributed(_unlike_limits_worker, 2, timeout=60):
        assert kind == "ValueError", (kind, message)
        assert "reference buffer builds" in message and "num_max_tokens_per_rank differ" in message, message
        assert "rank 0: num_max_tokens_per_rank 16" in message and "rank 1: num_max_tokens_per_rank 32" in message


def test_a_backend_built_with_a_group_instead_of_its_state_says_what_to_pass() -> None:
    """The contract's constructor takes the group's state: a process group (or anything else) is refused at once,
    before any collective, naming the call that gives the state."""
    from megatron_deepepv2.backends.base import BufferSpec
    from megatron_deepepv2.backends.reference import ReferenceBackend

    with pytest.raises(TypeError, match=r"ReferenceBackend is built with the group's state, not object: pass "
                                        r"megatron_deepepv2\.groups\.state_of\(group\)"):
        ReferenceBackend(object(), BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=4))
