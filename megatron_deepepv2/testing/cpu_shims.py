"""CPU shims that let Megatron-Core's MoELayer run on CPU processes over gloo (demo and tests only).

Megatron-Core calls a few CUDA-only APIs unconditionally on the MoE path (streams and events, tensors
created on ``torch.cuda.current_device()``, device-to-host split conversion). On a machine without CUDA,
:func:`install_cpu_shims` replaces exactly those with CPU equivalents:

* ``torch.cuda.current_device()`` returns ``"cpu"`` (tensors Megatron creates "on the GPU" land on the CPU);
* ``torch.cuda.Stream`` / ``Event`` / ``stream()`` / ``current_stream()`` become no-op stand-ins
  (everything on CPU is already ordered);
* ``moe_utils.maybe_move_tensor_to_cpu`` also converts CPU split tensors to numpy, as it does for CUDA
  tensors, because ``all_to_all_single`` takes split sizes as lists, not tensors;
* ``torch.compile`` of Megatron's ``@jit_fuser`` functions is disabled (no inductor C++ build per test);
* the model-parallel CUDA RNG tracker's ``fork()`` (attention, dropout) forks the CPU generator instead;
* Megatron's pipeline schedules create their token counter with ``device="cuda"``: it is created on the CPU;
* where Transformer Engine is installed, Megatron takes two of its CUDA kernels whatever the layer spec: the router's
  logits (TE's GEMM) and the final norm of a ``TransformerBlock`` (``TENorm``). On the CPU the router computes them
  with ``torch.mm`` and the block builds PyTorch's norm, as Megatron does without Transformer Engine.

With CUDA available it does nothing. It is never used on the library path.
"""

from __future__ import annotations

import contextlib
import os

import torch

_installed = False


class _NoopStream:
    """Stand-in for ``torch.cuda.Stream`` on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NoopEvent()

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, _NoopStream)

    def __hash__(self) -> int:
        return 0


class _NoopEvent:
    """Stand-in for ``torch.cuda.Event`` on CPU."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_CURRENT_STREAM = _NoopStream()


def install_cpu_shims() -> None:
    """Applies the shims when CUDA is not available (idempotent). Call before importing Megatron modules."""
    global _installed
    if _installed or torch.cuda.is_available():
        return
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    import torch._dynamo as dynamo  # noqa: PLC0415

    dynamo.config.disable = True
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.Stream = _NoopStream
    torch.cuda.Event = _NoopEvent
    torch.cuda.current_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.default_stream = lambda device=None: _CURRENT_STREAM
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    torch.cuda.synchronize = lambda device=None: None
    torch.Tensor.record_stream = lambda self, stream: None

    from megatron.core.transformer.moe import moe_utils, token_dispatcher  # noqa: PLC0415

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if hasattr(token_dispatcher, "maybe_move_tensor_to_cpu"):
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    from megatron.core.tensor_parallel import random as tp_random  # noqa: PLC0415

    @contextlib.contextmanager
    def fork_cpu_rng(self, name=None):
        with torch.random.fork_rng(devices=[]):
            yield

    tp_random.CudaRNGStatesTracker.fork = fork_cpu_rng

    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415

    schedules.torch = _TorchOnCpu()
    if getattr(moe_utils, "te_general_gemm", None) is not None:
        moe_utils.te_general_gemm = None
    from megatron.core.transformer import transformer_block  # noqa: PLC0415
    from megatron.core.transformer.torch_norm import WrappedTorchNorm  # noqa: PLC0415

    if getattr(transformer_block, "HAVE_TE", False) and hasattr(transformer_block, "LayerNormImpl"):
        transformer_block.LayerNormImpl = WrappedTorchNorm
    _installed = True


class _TorchOnCpu:
    """``torch`` as Megatron's pipeline schedules see it on CPU: ``torch.zeros(..., device="cuda")`` (their token
    counter) lands on the CPU; everything else is ``torch`` itself."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)
