"""FP8 dispatch (``fp8_dispatch``): BF16 hidden states travel as e4m3 with 1x128 scales; experts get BF16 rows.

The oracle is a dense single-process computation on the rows FP8 would deliver (:func:`tests.oracle.fp8_round_trip`,
written block by block, apart from the package's quantiser), with the quantisation as a straight-through estimator:
outputs, input, weight and expert gradients on 2 gloo ranks over the reference backend, both layouts, with and
without host sync. Bad input raises before any communication.
"""

from __future__ import annotations

import pytest
import torch

import megatron_deepepv2 as dv2
from megatron_deepepv2 import fp8
from tests.distributed import run_distributed
from tests.oracle import dense_moe, experts_on_compact, experts_on_expand, fp8_round_trip, make_problem

HIDDEN, EXPERTS, TOPK = 256, 8, 3
TOKENS = [7, 5]


def test_quantiser_matches_the_block_by_block_oracle() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 512, generator=gen) * torch.logspace(-3, 2, 33).unsqueeze(1)).to(torch.bfloat16)
    x[3] = 0  # an all-zero row: finite scales, zero values
    x_fp8, scales = fp8.quantize_e4m3_1x128(x)
    assert x_fp8.dtype == torch.float8_e4m3fn and scales.shape == (33, 4) and scales.dtype == torch.float32
    back = fp8.dequantize_e4m3_1x128(x_fp8, scales)
    assert torch.equal(back, fp8_round_trip(x)) and not back[3].any()
    error = (back.float() - x.float()).abs() / x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-30)
    assert float(error.max()) <= 2.0 ** -4  # e4m3: 3 mantissa bits, values scaled to the block's amax
    # A padding row (zero values) whose scale was never written comes back zero, not NaN.
    padding = fp8.dequantize_e4m3_1x128(torch.zeros(2, 256, dtype=torch.float8_e4m3fn),
                                        torch.tensor([[float("nan"), float("inf")], [1.0, -float("inf")]]))
    assert torch.equal(padding, torch.zeros(2, 256, dtype=torch.bfloat16))
    # Rows past the valid extent come back zero, whatever their bytes.
    scales[-2:] = float("nan")
    tail = fp8.dequantize_e4m3_1x128(x_fp8, scales, num_valid_rows=torch.tensor(31))
    assert torch.equal(tail[:31], back[:31]) and not tail[31:].any()


@pytest.mark.skipif(not torch.cuda.is_available() or not fp8.TRITON_AVAILABLE,
                    reason="the fused FP8 kernels run on CUDA with Triton; this machine has no CUDA GPU")
@pytest.mark.parametrize("rows,hidden", [(0, 256), (1, 128), (33, 2048), (1000, 7168)])
def test_fused_kernels_equal_the_pytorch_formulation_bitwise(rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen) * torch.logspace(-6, 4, max(rows, 1))[:rows].unsqueeze(1)
    x = x.to(torch.bfloat16).cuda()
    if rows > 3:
        x[3] = 0  # all-zero row: the amax floor
        x[2, :128] = 448.0  # a block whose amax is e4m3's largest value
    x_fp8, scales = fp8.quantize_e4m3_1x128(x)
    want_fp8, want_scales = fp8.quantize_e4m3_1x128_torch(x)
    assert x_fp8.shape == want_fp8.shape and scales.shape == want_scales.shape
    assert torch.equal(x_fp8.view(torch.uint8), want_fp8.view(torch.uint8)) and torch.equal(scales, want_scales)
    back = fp8.dequantize_e4m3_1x128(x_fp8, scales)
    assert torch.equal(back, fp8.dequantize_e4m3_1x128_torch(x_fp8, scales))
    assert torch.equal(back.cpu(), fp8_round_trip(x.cpu()))  # the block-by-block oracle
    if rows < 4:
        return
    # A received buffer: scales in a strided view, non-finite scales on padding rows, garbage past the valid rows.
    wide = torch.full((rows, 2 * (hidden // 128)), float("nan"), device="cuda")
    strided = wide[:, ::2]
    strided.copy_(scales)
    strided[1] = float("inf")
    garbage = x_fp8.clone()
    garbage[rows - 2:] = torch.randn(2, hidden, device="cuda").to(torch.float8_e4m3fn)
    strided[rows - 2:] = float("nan")
    valid = torch.tensor([rows - 2], device="cuda")
    got = fp8.dequantize_e4m3_1x128(garbage, strided, num_valid_rows=valid)
    assert torch.equal(got, fp8.dequantize_e4m3_1x128_torch(garbage, strided, num_valid_rows=valid))
    assert not got[1].any() and not got[rows - 2:].any() and torch.equal(got[2:rows - 2], back[2:rows - 2])


def _fp8_case(rank: int, world: int, layout: str, host_sync: bool) -> None:
    dv2.configure(validate=False, num_max_tokens_per_rank=8)
    problem = make_problem(5, TOKENS, HIDDEN, EXPERTS, TOPK, dtype=torch.float32)
    rows = problem.rows(rank)
    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    x = problem.x[rows].to(torch.bfloat16).requires_grad_()
    w = problem.topk_weights[rows].clone().requires_grad_()
    experts = problem.expert_weights[mine].clone().requires_grad_()
    kwargs = dict(layout=layout, expert_alignment=4 if layout == "expand" else 1)
    out = dv2.dispatch(x, problem.topk_idx[rows], w, EXPERTS, fp8_dispatch=True, host_sync=host_sync, **kwargs)
    assert out.recv_x.dtype == torch.bfloat16 and out.handle.buffer.spec.fp8
    recv = out.recv_x.float()
    if layout == "expand":
        counts = out.tokens_per_expert.tolist()
        valid = sum(counts)
        head = experts_on_expand(recv[:valid], out.recv_topk_weights[:valid], counts, experts)
        expert_out = torch.cat([head, recv[valid:] * 0])
    else:
        expert_out = experts_on_compact(recv, out.recv_topk_idx, out.recv_topk_weights, experts)
    y = dv2.combine(expert_out, out.handle)
    (y * problem.grad_out[rows]).sum().backward()

    # The dense oracle on the rows FP8 delivers, quantisation straight through for x.
    dx = problem.x.to(torch.bfloat16).requires_grad_()
    delivered = dx + (fp8_round_trip(dx.detach()) - dx).detach()
    dw = problem.topk_weights.clone().requires_grad_()
    dexp = problem.expert_weights.clone().requires_grad_()
    dense_y = dense_moe(delivered.float(), problem.topk_idx, dw, dexp)
    (dense_y * problem.grad_out).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y, dense_y[rows].detach(), **tol)
    torch.testing.assert_close(experts.grad, dexp.grad[mine], **tol)
    torch.testing.assert_close(w.grad, dw.grad[rows], **tol)
    # The received rows' gradient is BF16, so the input gradient is the dense one rounded through BF16.
    torch.testing.assert_close(x.grad.float(), dx.grad[rows].float(), rtol=2e-2, atol=2e-2)
    # FP8 really happened: the delivered rows are not the BF16 ones.
    assert not torch.equal(fp8_round_trip(x.detach()), x.detach())


@pytest.mark.parametrize("layout", ["compact", "expand"])
@pytest.mark.parametrize("host_sync", [True, False])
def test_fp8_dispatch_matches_the_dense_oracle(layout: str, host_sync: bool) -> None:
    run_distributed(_fp8_case, 2, layout, host_sync, timeout=120)


def _bad_fp8_inputs(rank: int, world: int) -> list[str]:
    dv2.configure(validate=False)
    idx = torch.tensor([[0, 1], [2, 3]])
    w = torch.rand(2, 2)
    messages = []
    for x, error in ((torch.randn(2, 256), TypeError), (torch.randn(2, 200).to(torch.bfloat16), ValueError),
                     ((torch.randn(2, 256).to(torch.float8_e4m3fn), torch.ones(2, 2)), TypeError)):
        with pytest.raises(error) as info:
            dv2.dispatch(x, idx, w, 8, fp8_dispatch=True)
        messages.append(str(info.value))
    return messages


def test_fp8_dispatch_rejects_what_it_cannot_quantise() -> None:
    messages = run_distributed(_bad_fp8_inputs, 2, env={"MEGATRON_DEEPEPV2_VALIDATE": "0"}, timeout=60)[0]
    assert "quantises BF16 hidden states; got torch.float32" in messages[0]
    assert "hidden size 200 is not a multiple of 128" in messages[1]
    assert "not an FP8 pair" in messages[2]


def _megatron_layer(rank: int, world: int) -> dict:
    from megatron_deepepv2.testing.cpu_shims import install_cpu_shims

    install_cpu_shims()
    dv2.install()
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer

    errors = {}
    for name, shape in (("hidden", TinyMoEConfig(hidden=192, num_experts=8, topk=2, params_dtype=torch.bfloat16)),
                        ("dtype", TinyMoEConfig(hidden=128, num_experts=8, topk=2))):
        with dv2.settings_override(fp8_dispatch=True, validate=False):
            try:
                build_moe_layer(shape, "deepepv2")
            except (TypeError, ValueError) as error:
                errors[name] = f"{type(error).__name__}: {error}"
    shape = TinyMoEConfig(hidden=128, ffn=64, num_experts=8, topk=2, params_dtype=torch.bfloat16)
    x = torch.randn(12, 1, 128, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    outputs = {}
    for name, dispatcher, fp8_dispatch in (("alltoall", "alltoall", False), ("bf16", "deepepv2", False),
                                           ("fp8", "deepepv2", True)):
        with dv2.settings_override(fp8_dispatch=fp8_dispatch, validate=False):
            layer = build_moe_layer(shape, dispatcher, seed=3)
            xin = x.clone().requires_grad_()
            y, _ = layer(xin)
            y.float().sum().backward()
            outputs[name] = (y.detach().float(), xin.grad.float())
    scale = float(outputs["alltoall"][0].abs().max())
    return {"errors": errors,
            "bf16_vs_alltoall": float((outputs["bf16"][0] - outputs["alltoall"][0]).abs().max()) / scale,
            "fp8_vs_alltoall": float((outputs["fp8"][0] - outputs["alltoall"][0]).abs().max()) / scale,
            "fp8_grad_finite": bool(outputs["fp8"][1].isfinite().all())}


def test_megatron_layer_with_fp8_dispatch() -> None:
    """One switch: a deepepv2 MoELayer dispatches FP8 (its output moves by the quantisation error only, the BF16 run
    equals alltoall's), and a layer that cannot (hidden not a multiple of 128, not BF16) fails when it is built."""
    for report in run_distributed(_megatron_layer, 2, timeout=180):
        assert "hidden size 192 is not a multiple of 128" in report["errors"]["hidden"], report
        assert report["errors"]["dtype"].startswith("TypeError: FP8 dispatch"), report
        assert report["bf16_vs_alltoall"] <= 1e-2, report
        assert 1e-3 < report["fp8_vs_alltoall"] <= 8e-2 and report["fp8_grad_finite"], report
