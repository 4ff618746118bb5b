"""Bad input raises a clear error before any communication, on every rank, and loses nothing."""

from __future__ import annotations

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2.backends import DeepEPBackend, ExpertLayout, ReferenceBackend
from megatron_deepepv2.validation import check_dispatch_inputs
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
    elif case == "zero_padding_compact":
        kwargs["zero_padding"] = True
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
    "zero_padding_compact": (ValueError, "zero_padding=True only applies"),
    "bad_alignment": (ValueError, "expert_alignment=0"),
}


def _every_rank_raises(rank: int, world: int, bad_rank: int) -> list[str]:
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


def test_static_errors_raise_without_validation() -> None:
    # num_experts=6 is not a multiple of 4 ranks.
    run_distributed(_uniform_error_without_validation, 4, env={"MEGATRON_DEEPEPV2_VALIDATE": "0"})


def _check(limits, x, idx=None, w=None, **kwargs):
    idx = torch.zeros(x.shape[0] if not isinstance(x, tuple) else x[0].shape[0], 1, dtype=torch.long) if idx is None else idx
    defaults = dict(num_experts=8, group_size=2, limits=limits, layout=ExpertLayout.COMPACT, expert_alignment=1, zero_padding=False)
    defaults.update(kwargs)
    return check_dispatch_inputs(x, idx, w, **defaults)


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
