"""``tools/bench_experts.py`` on the CPU: the example models' expert shapes, the profiled kernel summary, and the
refusals of Transformer Engine's variants (the timings themselves need a GPU)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tools import bench_experts

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt_moe_deepepv2.sh"


def _flags(text: str) -> dict[str, str]:
    return dict(re.findall(r"(--[a-z-]+) (\S+)", text))


def _example_model_args(model: str) -> dict[str, str]:
    """The example script's arguments for ``MODEL=model``: the shared shape, then the model's own (later wins)."""
    script = EXAMPLE.read_text()
    shape = re.search(r"SHAPE_ARGS=\((.*?)\)\n", script, re.S).group(1)
    own = re.search(rf"\n  {re.escape(model)}\) MODEL_ARGS=\((.*?)\) ;;", script, re.S).group(1)
    return {**_flags(shape), **_flags(own)}


@pytest.mark.parametrize("shape", bench_experts.TRAINING_SHAPES, ids=lambda shape: shape.label)
def test_training_shapes_are_the_example_models(shape) -> None:
    """Each training shape is its model's experts as the example script trains them at EP=1 with top-8."""
    args = _example_model_args(shape.model)
    tokens = int(args["--micro-batch-size"]) * int(args["--seq-length"])
    assert (shape.experts, shape.hidden, shape.ffn) == (int(args["--num-experts"]), int(args["--hidden-size"]),
                                                        int(args["--moe-ffn-hidden-size"])), args
    assert shape.selections == 8 * tokens and shape.worst_rows >= shape.selections + shape.experts * 127
    assert "--moe-router-topk 8" in EXAMPLE.read_text()


def test_kernel_summary_counts_per_call_and_ranks_the_kernels() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    averages = [
        SimpleNamespace(key="gemm_small", count=128, device_type=cuda, device_time_total=640.0),
        SimpleNamespace(key="gemm_big", count=4, device_type=cuda, device_time_total=2000.0),
        SimpleNamespace(key="silu", count=2, device_type=cuda, device_time_total=20.0),
        SimpleNamespace(key="cudaLaunchKernel", count=134, device_type=cpu, device_time_total=0.0),
        SimpleNamespace(key="cudaStreamSynchronize", count=6, device_type=cpu, device_time_total=0.0),
        SimpleNamespace(key="cudaMemcpyAsync", count=2, device_type=cpu, device_time_total=0.0),
        SimpleNamespace(key="Memcpy HtoD (Pageable -> Device)", count=2, device_type=cuda, device_time_total=5.0),
        SimpleNamespace(key="Memset (Device)", count=4, device_type=cuda, device_time_total=3.0),
        SimpleNamespace(key="aten::mm", count=8, device_type=cpu, device_time_total=2640.0),  # a host op's total
    ]
    summary = bench_experts.kernel_summary(averages, calls=2, host_s=0.01, top=2)
    assert summary["kernels"] == 67 and summary["gpu_ms"] == pytest.approx(1.33)
    assert summary["host_ms"] == pytest.approx(5.0)
    assert summary["synchronising_calls"] == 3 and summary["memcpy_calls"] == 1 and summary["gpu_copies"] == 3
    assert summary["top_kernels"] == [{"name": "gemm_big", "launches": 2, "ms": 1.0},
                                      {"name": "gemm_small", "launches": 64, "ms": 0.32}]
    older = [SimpleNamespace(key="k", count=2, device_type=cuda, cuda_time_total=300.0)]  # PyTorch before 2.4
    assert bench_experts.kernel_summary(older, calls=1, host_s=0.0)["gpu_ms"] == pytest.approx(0.3)


def test_transformer_engine_variants_are_refused_with_the_reason() -> None:
    """The op fuser with an activation it does not fuse is refused everywhere; without TE, both TE kinds are."""
    import importlib.util

    swiglu, squared_relu = bench_experts.TRAINING_SHAPES[0], bench_experts.TRAINING_SHAPES[-1]
    assert (swiglu.activation, squared_relu.activation) == ("swiglu", "squared_relu")
    with pytest.raises(ValueError, match="fuses squared ReLU only on Hopper, not swiglu"):
        bench_experts.build_experts("te_op_fuser", swiglu)
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed: its variants build (on the GPU, in tools/bench_experts.py)")
    for kind, shape in (("te_grouped_mlp", swiglu), ("te_op_fuser", squared_relu)):
        with pytest.raises(ValueError, match=f"{kind} needs Transformer Engine"):
            bench_experts.build_experts(kind, shape)
