"""Bad input raises a clear error before any communication, on every rank, and loses nothing."""

from __future__ import annotations

import re

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
from megatron_deepepv2.backends.reference import ReferenceBackend
from megatron_deepepv2.validation import dispatch_inputs_problem
from tests.deepep_stand_in import EP_HANDLE_ORDER_FIELDS, handle_stand_in
from tests.distributed import run_distributed

T, H, E, K = 6, 8, 8, 2


def _good(rank: int):
    gen = torch.Generator().manual_seed(rank)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return torch.randn(T, H, generator=gen), idx, torch.rand(T, K, generator=gen)


def _mutate(case: str, x, idx, w):
    """Returns (x, idx, w, kwargs) with the named problem."""
    kwargs = {}
    if case == "x_dtype":
        x = x.to(torch.int32)
    elif case == "x_not_2d":
        x = x.view(T, 2, H // 2)
    elif case == "idx_dtype":
        idx = idx.to(torch.int32)
    elif case == "idx_shape":
        idx = idx[:-1]
    elif case == "weights_dtype":
        w = (w * 10).to(torch.int64)
    elif case == "weights_shape":
        w = w[:, :1]
    elif case == "topk_too_large":
        idx = torch.arange(33).repeat(T, 1) % E
        w = torch.rand(T, 33)
    elif case == "too_many_tokens":
        kwargs["num_max_tokens_per_rank"] = T - 1
    elif case == "expert_out_of_range":
        idx = idx.clone()
        idx[2, 1] = E
    elif case == "negative_expert":
        idx = idx.clone()
        idx[0, 0] = -2
    elif case == "duplicate_expert":
        idx = idx.clone()
        idx[3, 1] = idx[3, 0]
    elif case == "removed_zero_padding":
        kwargs["layout"], kwargs["expert_alignment"], kwargs["zero_padding"] = "expand", 4, False
    elif case == "bad_alignment":
        kwargs["layout"], kwargs["expert_alignment"] = "expand", 0
    elif case == "bad_layout":
        kwargs["layout"] = "sideways"
    return x, idx, w, kwargs


CASES = {
    # case: (exception type, phrase of the message on the rank with the bad input)
    "x_dtype": (TypeError, "x has dtype torch.int32"),
    "x_not_2d": (ValueError, "x must be 2-D"),
    "idx_dtype": (TypeError, "topk_idx has dtype torch.int32"),
    "idx_shape": (ValueError, "topk_idx must be [T=6, K]"),
    "weights_dtype": (TypeError, "topk_weights has dtype torch.int64"),
    "weights_shape": (ValueError, "topk_weights has shape (6, 1)"),
    "topk_too_large": (ValueError, "top-k=33"),
    "too_many_tokens": (ValueError, "dispatches 6 tokens but num_max_tokens_per_rank=5"),
    "expert_out_of_range": (ValueError, "outside [-1, 8): token 2"),
    "negative_expert": (ValueError, "outside [-1, 8): token 0"),
    "duplicate_expert": (ValueError, "same expert twice for token 3"),
    "removed_zero_padding": (TypeError, "zero_padding: the expand layout's padding rows are always zero"),
    "bad_alignment": (ValueError, "expert_alignment=0"),
}


def _every_rank_raises(rank: int, world: int, bad_rank: int) -> list[str]:
    # Good inputs of the same shapes first: what passed once must not let a bad input of the same shapes through.
    x, idx, w = _good(rank)
    warm = dv2.dispatch(x, idx, w, E)
    dv2.combine(warm.recv_x, warm.handle)
    outcomes = []
    for case, (error_type, phrase) in CASES.items():
        x, idx, w = _good(rank)
        if rank == bad_rank:
            x, idx, w, kwargs = _mutate(case, x, idx, w)
        else:
            kwargs = {"num_max_tokens_per_rank": T} if case == "too_many_tokens" else {}
            if case == "bad_alignment":
                kwargs = {"layout": "expand"}
        try:
            dv2.dispatch(x, idx, w, E, **kwargs)
        except (TypeError, ValueError) as error:
            if rank == bad_rank:
                assert isinstance(error, error_type), (case, error)
                assert phrase in str(error), (case, str(error))
            else:
                assert f"Rank(s) [{bad_rank}]" in str(error), (case, str(error))
            outcomes.append(case)
        else:
            raise AssertionError(f"{case}: no error on rank {rank}")
    # Nothing was lost: the group still works and gives right answers.
    x, idx, w = _good(rank)
    out = dv2.dispatch(x, idx, w, E)
    y = dv2.combine(out.recv_x, out.handle)
    ranks_per_token = torch.stack([(idx // (E // world) == r).any(1) for r in range(world)], 1).sum(1)
    torch.testing.assert_close(y, x * ranks_per_token.unsqueeze(1).to(x.dtype))
    return outcomes


def _uniform_error_without_validation(rank: int, world: int) -> None:
    assert not dv2.get_settings().validate
    x, idx, w = _good(rank)
    with pytest.raises(ValueError, match="num_experts=6 must be a positive multiple"):
        dv2.dispatch(x, idx % 6, w, 6)
    with pytest.raises(TypeError, match="topk_idx has dtype"):
        dv2.dispatch(x, idx.int(), w, E)
    with pytest.raises(ValueError, match="layout='sideways' is not a known expert layout"):
        dv2.dispatch(x, idx, w, E, layout="sideways")
    out = dv2.dispatch(x, idx, w, E, layout="expand")
    with pytest.raises(ValueError, match="combine input has 1 rows but the dispatch delivered"):
        dv2.combine(out.recv_x[:1], out.handle)
    with pytest.raises(TypeError, match="handle must be the DispatchHandle"):
        dv2.combine(out.recv_x, object())
    dv2.combine(out.recv_x, out.handle)


@pytest.mark.parametrize("world,bad_rank", [(2, 0), (2, 1), (4, 2)])
def test_bad_input_raises_on_every_rank(world: int, bad_rank: int) -> None:
    outcomes = run_distributed(_every_rank_raises, world, bad_rank)
    assert all(o == list(CASES) for o in outcomes)


def _combine_error_agreed(rank: int, world: int) -> str:
    x, idx, w = _good(rank)
    with dv2.settings_override(validate=True):
        out = dv2.dispatch(x, idx, w, E)
    # The settings change back; the combine still agrees as its dispatch's configuration did.
    rows = out.recv_x if rank == 0 else out.recv_x[:-1]
    try:
        dv2.combine(rows, out.handle)
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError(f"rank {rank}: combine did not raise")
    y = dv2.combine(out.recv_x, out.handle)  # nothing was lost: the group still combines
    ranks_per_token = torch.stack([(idx // (E // world) == r).any(1) for r in range(world)], 1).sum(1)
    torch.testing.assert_close(y, x * ranks_per_token.unsqueeze(1).to(x.dtype))
    return message


def test_a_bad_combine_input_under_validation_stops_every_rank() -> None:
    outcomes = run_distributed(_combine_error_agreed, 2, env={"MEGATRON_DEEPEPV2_VALIDATE": "0"}, timeout=60)
    assert "Rank(s) [1] of the expert-parallel group rejected their dispatch or combine inputs" in outcomes[0]
    # The peer's message carries the rank's own error (left in the store before the agreement), not a pointer to it.
    assert re.search(r"\(rank 1: ValueError: combine input has \d+ rows but the dispatch delivered", outcomes[0]), \
        outcomes[0]
    assert "combine input has" in outcomes[1] and "rows but the dispatch delivered" in outcomes[1]


def test_static_errors_raise_without_validation() -> None:
    # num_experts=6 is not a multiple of 4 ranks.
    run_distributed(_uniform_error_without_validation, 4, env={"MEGATRON_DEEPEPV2_VALIDATE": "0"})


def _check(limits, x, idx=None, w=None, **kwargs):
    idx = torch.zeros(x.shape[0] if not isinstance(x, tuple) else x[0].shape[0], 1, dtype=torch.long) if idx is None else idx
    defaults = dict(limits=limits)
    defaults.update(kwargs)
    return dispatch_inputs_problem(x, idx, w, **defaults)


def test_deepep_only_limits_are_checked_before_communication() -> None:
    limits = DeepEPBackend.limits
    error = _check(limits, torch.zeros(4, 256, dtype=torch.float32))
    assert isinstance(error, TypeError) and "bfloat16" in str(error)
    error = _check(limits, torch.zeros(4, 200, dtype=torch.bfloat16))
    assert isinstance(error, ValueError) and "hidden=200 is not a multiple of 256" in str(error)
    error = _check(limits, torch.zeros(4, 256, dtype=torch.bfloat16))
    assert isinstance(error, ValueError) and "needs CUDA tensors" in str(error)
    fp8 = (torch.zeros(4, 256, dtype=torch.float8_e4m3fn), torch.zeros(4, 2, dtype=torch.float16))
    error = _check(ReferenceBackend.limits, fp8)
    assert isinstance(error, ValueError) and "4-byte elements" in str(error)
    # The reference backend has none of DeepEP's hidden/dtype limits.
    assert _check(ReferenceBackend.limits, torch.zeros(4, 200, dtype=torch.float32)) is None


# ---------------------------------------------------------------- default settings (validate off)
# The growth timeout is long: a peer must learn of a failure from its announcement, not by waiting the timeout out.
DEFAULT_ENV = {"MEGATRON_DEEPEPV2_VALIDATE": "0", "MEGATRON_DEEPEPV2_GROWTH_TIMEOUT_S": "60"}
ONE_RANK_CASES = {
    # case: (layout, exception type, phrase on the bad rank)
    "expert_out_of_range": ("compact", ValueError, "outside [-1, 8): token 2"),
    "negative_expert": ("expand", ValueError, "outside [-1, 8): token 0"),
    "duplicate_expert": ("compact", ValueError, "same expert twice for token 3"),
    "too_many_tokens": ("expand", ValueError, "dispatches 6 tokens but num_max_tokens_per_rank=5"),
    "x_dtype": ("compact", TypeError, "x has dtype torch.int32"),
    "capacity_alone": ("compact", ValueError, "dispatches 20 tokens, more than the reference buffer's token limit 8"),
}


def _one_rank_bad_at_defaults(rank: int, world: int, case: str, bad_rank: int) -> tuple[str, str, float]:
    import time

    assert not dv2.get_settings().validate and dv2.get_settings().check_ids
    layout = ONE_RANK_CASES[case][0]
    x, idx, w = _good(rank)
    kwargs = {"layout": layout}
    if case == "capacity_alone":
        dv2.dispatch(x, idx, w, E, **kwargs)  # learns capacity 8 on both ranks
        if rank == bad_rank:
            gen = torch.Generator().manual_seed(5)
            idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(20)])
            x, w = torch.randn(20, H), torch.rand(20, K)
    elif rank == bad_rank:
        x, idx, w, extra = _mutate(case, x, idx, w)
        kwargs.update(extra)
    elif case == "too_many_tokens":
        kwargs["num_max_tokens_per_rank"] = T  # the others fit their (equal) setting
    started = time.monotonic()
    try:
        dv2.dispatch(x, idx, w, E, **kwargs)
    except Exception as error:  # noqa: BLE001 - returned to the test
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", time.monotonic() - started


@pytest.mark.parametrize("case", list(ONE_RANK_CASES))
def test_one_rank_with_bad_input_at_default_settings_stops_every_rank_naming_it(case: str) -> None:
    _layout, error_type, phrase = ONE_RANK_CASES[case]
    bad_rank = 1
    outcomes = run_distributed(_one_rank_bad_at_defaults, 2, case, bad_rank, env=DEFAULT_ENV, timeout=60)
    bad_type, bad_message, _ = outcomes[bad_rank]
    assert bad_type == error_type.__name__ and phrase in bad_message, outcomes[bad_rank]
    peer_type, peer_message, peer_seconds = outcomes[0]
    # The peer does not wait for a timeout: it reads the bad rank's announcement and raises naming it and its error.
    assert peer_type == "PeerFailure" and f"Rank(s) [{bad_rank}]" in peer_message and phrase in peer_message, \
        outcomes[0]
    assert peer_seconds < 10, outcomes[0]
    if case == "capacity_alone":  # the peer's batch fit: it went on to the exchange, where it saw the bad rank wait
        assert "wait for this rank at a communication buffer build that this rank did not need" in peer_message
        assert "did not come to grow it: their batches fit; they stopped waiting for this rank (rank(s) [0])" \
            in bad_message, bad_message
        assert outcomes[bad_rank][2] < 10, outcomes[bad_rank]
    else:  # the bad rank stopped before the first build, at whose rendezvous the peer waited
        assert "failed in this call" in peer_message and "rendezvous" in peer_message, peer_message


def test_bad_input_on_the_store_host_rank_still_stops_its_peer() -> None:
    # Rank 0 hosts the rendezvous store (kept up until every rank is done): the peer names it all the same.
    outcomes = run_distributed(_one_rank_bad_at_defaults, 2, "expert_out_of_range", 0, env=DEFAULT_ENV, timeout=60)
    assert outcomes[0][0] == "ValueError" and "outside [-1, 8)" in outcomes[0][1]
    assert outcomes[1][0] == "PeerFailure" and "Rank(s) [0]" in outcomes[1][1] and "outside [-1, 8)" in outcomes[1][1]
    assert outcomes[1][2] < 10, outcomes[1]


def _two_unrelated_failures(rank: int, world: int) -> dict:
    """Call 1: every rank dispatches (the buffer is built). Call 2: rank 3 rejects its ids, the others fail waiting for
    it to grow the buffer. Call 3: rank 1 rejects its dtype, ranks 0 and 2 fail waiting again; rank 3 makes no call."""
    x, idx, w = _good(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    big = (torch.randn(20, H, generator=gen), torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(20)]),
           torch.rand(20, K, generator=gen))
    dv2.dispatch(x, idx, w, E)
    outcome = {}
    for call, bad_rank, case in ((2, 3, "expert_out_of_range"), (3, 1, "x_dtype")):
        if rank == bad_rank:
            bad_x, bad_idx, bad_w, _ = _mutate(case, x, idx, w)
            with pytest.raises((TypeError, ValueError)):
                dv2.dispatch(bad_x, bad_idx, bad_w, E)
            continue
        if call == 3 and rank == 3:
            continue
        try:
            dv2.dispatch(*big, E)  # more tokens than the capacity: waits for the others to grow it
        except RuntimeError as error:
            outcome[call] = str(error)
    return outcome


def test_each_failure_is_reported_with_its_own_cause() -> None:
    """A peer's failure names the announcements of the call it failed in, not one left from an earlier failure."""
    outcomes = run_distributed(_two_unrelated_failures, 4, env=DEFAULT_ENV, timeout=90)
    # The ranks that stop waiting announce that too, as a consequence: the reports name only the cause.
    for rank in (0, 1, 2):
        assert "rank 3: ValueError" in outcomes[rank][2] and "outside [-1, 8)" in outcomes[rank][2], outcomes[rank]
        assert "Rank(s) [3] of the expert-parallel group failed in this call" in outcomes[rank][2], outcomes[rank]
    for rank in (0, 2):
        assert "rank 1: TypeError" in outcomes[rank][3] and "x has dtype torch.int32" in outcomes[rank][3]
        assert "rank 3:" not in outcomes[rank][3] and "outside [-1, 8)" not in outcomes[rank][3], outcomes[rank][3]


def _unlike_inputs(rank: int, world: int, field: str, validate: bool = True) -> tuple[str, str]:
    """Rank 1 dispatches inputs unlike the others' in ``field``."""
    dv2.configure(validate=validate)
    if field == "allow_hybrid_mode":  # a construction argument of the DeepEP backend, agreed on at its builds
        from tests.deepep_stand_in import use_stand_in_backend

        use_stand_in_backend()
        dv2.configure(backend="deepep")
    x, idx, w = _good(rank)
    if rank == 1:
        if field == "dtype":
            x = x.double()
        elif field == "hidden size":
            x = torch.randn(T, 2 * H)
        elif field == "top-k":
            idx = torch.cat([idx, (idx[:, :1] + 1) % E], dim=1)
            idx[:, 2] = torch.where(idx[:, 2] == idx[:, 1], -1, idx[:, 2])
            w = torch.rand(T, K + 1)
        elif field == "FP8":
            x = (x.to(torch.float8_e4m3fn), torch.ones(T, 1))
        elif field == "SM count":
            dv2.configure(num_sms=12)
        elif field == "allow_hybrid_mode":
            dv2.configure(allow_hybrid_mode=False)
    try:
        dv2.dispatch(x, idx, w, E)
    except ValueError as error:
        return type(error).__name__, str(error)
    return "no error", ""


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("field,rank1,others", [("dtype", "float64", "float32"), ("hidden size", "16", "8"),
                                                ("top-k", "3", "2"), ("FP8", "yes", "no"), ("SM count", "12", "64")])
def test_ranks_that_dispatch_unlike_inputs_all_raise_naming_them(world: int, field: str, rank1: str,
                                                                  others: str) -> None:
    """Under validation, inputs that differ across the ranks where the exchange needs them alike (which would crash
    gloo or receive garbage) make every rank raise a ValueError naming each rank's value."""
    outcomes = run_distributed(_unlike_inputs, world, field, env={"MEGATRON_DEEPEPV2_VALIDATE": "1"}, timeout=60)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "ValueError" and field in message.split(" differ (")[0].split("whose ")[-1], (rank, message)
        assert re.search(f"rank 1: [^;)]*{field} {rank1}", message), message
        assert re.search(f"rank 0: [^;)]*{field} {others}", message), message


@pytest.mark.parametrize("field,rank1,others", [("hidden size", "16", "8"), ("top-k", "3", "2"), ("FP8", "yes", "no"),
                                                ("allow_hybrid_mode", "no", "auto")])
def test_ranks_with_unlike_buffers_raise_naming_them_at_default_settings(field: str, rank1: str, others: str) -> None:
    """Without validation the buffer's build agrees on BUILD_AGREEMENT and the backend's own fields (once, not per
    call): a rank whose hidden size, top-k, FP8-ness or, on the DeepEP backend, hybrid mode differs makes every rank
    raise naming each rank's value, instead of corrupting the exchange; the message names every agreed field."""
    from megatron_deepepv2.backends.base import BUILD_AGREEMENT

    outcomes = run_distributed(_unlike_inputs, 2, field, False, env=DEFAULT_ENV, timeout=60)
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "ValueError" and field in message.split(" differ (")[0].split("whose ")[-1], (rank, message)
        assert re.search(f"rank 1: [^;)]*{field} {rank1}", message), message
        assert re.search(f"rank 0: [^;)]*{field} {others}", message), message
        assert "buffer builds" in message and all(each.name in message for each in BUILD_AGREEMENT), message


# ---------------------------------------------------------------- the device-side id check (CUDA)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device-side id check)")
_BAD_ID_SCRIPT = """
import sys, torch
from megatron_deepepv2.expert_ids import assert_expert_ids_on_device
idx = torch.tensor([[0, 1], [2, 3], [4, 5]], device="cuda")
case = sys.argv[1]
if case == "too_large":
    idx[1, 1] = 8
elif case == "below_minus_one":
    idx[0, 0] = -2
elif case == "duplicate":
    idx[2, 1] = 4
assert_expert_ids_on_device(idx, 8)
torch.cuda.synchronize()
print("PASSED")
"""


@needs_cuda
@pytest.mark.parametrize("case", ["too_large", "below_minus_one", "duplicate", "good"])
def test_device_side_id_check_stops_the_process_on_bad_ids(case: str) -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BAD_ID_SCRIPT, case], capture_output=True, text=True, timeout=300)
    if case == "good":
        assert done.returncode == 0 and "PASSED" in done.stdout, done.stderr[-2000:]
    else:
        assert done.returncode != 0 and "PASSED" not in done.stdout
        assert "device-side assert" in done.stderr or "Assertion" in done.stderr, done.stderr[-2000:]


@needs_cuda
def test_device_side_id_check_passes_every_valid_routing_without_a_host_sync() -> None:
    from megatron_deepepv2.expert_ids import assert_expert_ids_on_device

    gen = torch.Generator().manual_seed(0)
    for num_tokens, num_experts, top_k in [(1, 8, 1), (4096, 256, 8), (777, 64, 6), (3, 32, 32)]:
        idx = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
        idx[::3, -1] = -1  # -1 may repeat
        idx[::5, :] = -1
        idx = idx.cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert_expert_ids_on_device(idx, num_experts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    idx = torch.zeros(64, 8, dtype=torch.long, device="cuda") - 1
    with torch.cuda.graph(graph):
        assert_expert_ids_on_device(idx, 16)
    graph.replay()
    torch.cuda.synchronize()


@needs_cuda
@pytest.mark.parametrize("case", ["too_large", "duplicate"])
def test_host_sync_id_check_on_cuda_raises_a_value_error_and_the_process_goes_on(case: str) -> None:
    """With host sync the CUDA check reads its flag: a ValueError naming the token, no device assert, and the next
    check (of good ids) passes -- the flag was reset."""
    from megatron_deepepv2.expert_ids import expert_ids_flag_problem

    idx = torch.tensor([[0, 1], [2, 3], [4, 5]], device="cuda")
    bad = idx.clone()
    bad[1, 1] = 8 if case == "too_large" else 2
    problem = expert_ids_flag_problem(bad, 8)
    assert isinstance(problem, ValueError) and "token 1" in str(problem), problem
    assert expert_ids_flag_problem(idx, 8) is None
    torch.cuda.synchronize()  # no device-side assert is pending


def _bad_ids_without_host_sync(rank: int, world: int) -> str:
    x, idx, w = _good(rank)
    if rank == 1:
        idx = idx.clone()
        idx[4, 0] = E + 3
    try:
        dv2.dispatch(x, idx, w, E, layout="expand", host_sync=False, num_max_tokens_per_rank=T)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_bad_ids_without_host_sync_raise_the_assert_message_on_every_rank() -> None:
    outcomes = run_distributed(_bad_ids_without_host_sync, 2, env=DEFAULT_ENV, timeout=60)
    assert "topk_idx holds an expert id outside [-1, num_experts)" in outcomes[1], outcomes[1]
    assert "MEGATRON_DEEPEPV2_VALIDATE=1" in outcomes[1]
    assert "Rank(s) [1]" in outcomes[0] and "expert id outside" in outcomes[0], outcomes[0]


@pytest.mark.parametrize("change,tp,phrase", [
    ({}, 2, "expert tensor parallel size 1; set --expert-tensor-parallel-size 1"),
    ({"add_bias_linear": True}, 1, "without bias; pass --disable-bias-linear"),
    ({"fp8": "hybrid"}, 1, "drop --fp8-format / --fp4-format"),
    ({"fp4": "nvfp4"}, 1, "drop --fp8-format / --fp4-format"),
    ({"delay_wgrad_compute": True}, 1, "unset --delay-wgrad-compute"),
    ({"use_te_activation_func": True}, 1, "unset --use-te-activation-func"),
])
def test_sync_free_experts_refuse_what_they_cannot_run(change: dict, tp: int, phrase: str) -> None:
    from types import SimpleNamespace

    from megatron_deepepv2.mcore.megatron_config import check_sync_free_experts

    fields = dict(add_bias_linear=False, fp8=None, fp4=None, delay_wgrad_compute=False, use_te_activation_func=False)
    check_sync_free_experts(SimpleNamespace(**fields), 1)  # what they run: no error
    with pytest.raises(ValueError, match=re.escape(phrase)):
        check_sync_free_experts(SimpleNamespace(**{**fields, **change}), tp)


# ---------------------------------------------------------------- deterministic mode: what the installed DeepEP exposes
_HandleWithoutUnalignedCounts = handle_stand_in(
    "_HandleWithoutUnalignedCounts",
    parameters=[field for field in EP_HANDLE_ORDER_FIELDS if field != "num_unaligned_recv_tokens_per_expert"],
    doc="An ``EPHandle`` that keeps neither the expand layout's unaligned counts nor anything named for them.")
_HandleWithoutSort = handle_stand_in(
    "_HandleWithoutSort", attributes=EP_HANDLE_ORDER_FIELDS, sort=False,
    doc="An ``EPHandle`` with every metadata field (as class attributes: found through ``dir``) but no sort.")


def _deterministic_config(host_sync: bool, deterministic: bool = True):
    from megatron_deepepv2.backends.base import DispatchConfig
    from megatron_deepepv2.config import DeepepV2Settings

    return DispatchConfig(DeepEPBackend, DeepepV2Settings(deterministic=deterministic, host_sync=host_sync))


@pytest.mark.parametrize("handle, host_sync, missing", [
    (_HandleWithoutUnalignedCounts, False, "does not expose num_unaligned_recv_tokens_per_expert"),
    (_HandleWithoutUnalignedCounts, True, None),  # DeepEP's own sort needs none of them
    (_HandleWithoutSort, True, "does not expose deterministic_sort"),
    (_HandleWithoutSort, False, None),
    (None, True, "deep_ep has no EPHandle next to ElasticBuffer"),
    (None, False, "deep_ep has no EPHandle next to ElasticBuffer"),
])
def test_deterministic_mode_is_refused_where_the_installed_handle_lacks_what_the_order_reads(
        monkeypatch: pytest.MonkeyPatch, handle, host_sync: bool, missing) -> None:
    from tests.deepep_stand_in import install_deep_ep_with_handle

    install_deep_ep_with_handle(monkeypatch, handle)
    if missing is None:
        assert _deterministic_config(host_sync).settings.deterministic  # built, so checked
        assert dv2.resolve_config(backend=DeepEPBackend, deterministic=True, host_sync=host_sync).settings.deterministic
    else:
        mode = "Deterministic mode" + ("" if host_sync else " without host sync")
        for build in (lambda: _deterministic_config(host_sync),
                      lambda: dv2.resolve_config(backend=DeepEPBackend, deterministic=True, host_sync=host_sync)):
            with pytest.raises(ValueError, match=f"{mode} is not available on the deepep backend as installed: "
                                                 f".*{re.escape(missing)}"):
                build()
    _deterministic_config(host_sync, deterministic=False)  # nothing to order: builds


@pytest.mark.parametrize("host_sync", [True, False])
def test_a_refused_deterministic_mode_gives_the_backends_own_fix(monkeypatch: pytest.MonkeyPatch,
                                                                  host_sync: bool) -> None:
    """The contract's refusal names no backend's fix: it quotes the backend's reason, which says what to install
    (DeepEP's: DeepEP 2.1.0 or V2.5), and adds only what holds for every backend, turning deterministic mode off."""
    from megatron_deepepv2.backends.base import DispatchConfig
    from megatron_deepepv2.config import DeepepV2Settings
    from tests.deepep_stand_in import install_deep_ep_with_handle

    class Unordered(ReferenceBackend):  # not registered: a backend whose receive order cannot be fixed
        name = "unordered"

        @classmethod
        def deterministic_order_unavailable_reason(cls, host_sync: bool) -> str:
            return "its rows arrive in any order."

    settings = DeepepV2Settings(deterministic=True, host_sync=host_sync)
    with pytest.raises(ValueError) as refused:
        DispatchConfig(Unordered, settings)
    message = str(refused.value)
    assert "on the unordered backend as installed: its rows arrive in any order. Otherwise, turn off deterministic " \
           "mode (MEGATRON_DEEPEPV2_DETERMINISTIC / Megatron's --deterministic-mode)" in message, message
    assert "DeepEP" not in message, message
    install_deep_ep_with_handle(monkeypatch, _HandleWithoutSort if host_sync else _HandleWithoutUnalignedCounts)
    with pytest.raises(ValueError, match="DeepEP 2.1.0 and V2.5 do\\): install one of them. Otherwise, turn off"):
        DispatchConfig(DeepEPBackend, settings)
    install_deep_ep_with_handle(monkeypatch, None)
    with pytest.raises(ValueError, match="layout is unknown: install DeepEP 2.1.0 or V2.5. Otherwise, turn off"):
        DispatchConfig(DeepEPBackend, settings)


@pytest.mark.parametrize("line", ["2.1", "V2.5"])
@pytest.mark.parametrize("host_sync", [True, False])
def test_deterministic_mode_is_accepted_with_the_stand_ins_full_handle(monkeypatch: pytest.MonkeyPatch, line: str,
                                                                       host_sync: bool) -> None:
    """The stand-in's ``EPHandle`` (what the CPU ordering tests run against) exposes everything, on both lines."""
    from tests.deepep_stand_in import EPHandle, install_deep_ep_with_handle

    install_deep_ep_with_handle(monkeypatch, EPHandle, line)
    assert DeepEPBackend.deterministic_order_unavailable_reason(host_sync) is None
    assert _deterministic_config(host_sync).settings.deterministic
