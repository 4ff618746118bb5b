"""Bit-exact replay harness: run a computation several times from identical state and compare bytes.

``assert_replays_bit_exact(run, replays=3)`` calls ``run()`` ``replays`` times, restoring the CPU (and CUDA)
RNG state before each, and compares every returned tensor with the first run's byte for byte: same dtype,
same shape, same bit pattern (signed zeros and NaN payloads included). On GPU, replays after the first run
while a side stream keeps the device busy (contention changes kernel timing, not results, if deterministic).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch


class ReplayMismatch(AssertionError):
    """Replays of a computation differed; the message lists what and by how many elements."""


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().cpu(), b.detach().contiguous().cpu()
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    if a.dtype != b.dtype or a.shape != b.shape:
        return -1
    a, b = a.detach().contiguous().cpu().reshape(-1), b.detach().contiguous().cpu().reshape(-1)
    width = a.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    return int((a.view(as_int) != b.view(as_int)).sum())


@contextlib.contextmanager
def side_stream_contention() -> Iterator[None]:
    """Keeps a side CUDA stream busy with GEMMs during the block (no-op without CUDA)."""
    if not torch.cuda.is_available():
        yield
        return
    stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(stream):
        for _ in range(8):
            a = a @ a.T / 4096
    yield
    torch.cuda.synchronize()


def run_replays(run: Callable[[], dict[str, torch.Tensor]], replays: int = 3) -> list[dict[str, torch.Tensor]]:
    """Runs ``run`` ``replays`` times from the same RNG state; returns each run's tensors."""
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    results = []
    for index in range(replays):
        torch.set_rng_state(cpu_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state_all(cuda_state)
        with side_stream_contention() if index > 0 else contextlib.nullcontext():
            results.append({k: v.detach().clone() for k, v in run().items()})
    return results


def count_differing_replays(run: Callable[[], dict[str, torch.Tensor]], replays: int = 3) -> int:
    """Number of replays after the first that differ from it in any tensor (for negative controls)."""
    results = run_replays(run, replays)
    return sum(any(not bytes_equal(results[0][k], r[k]) for k in results[0]) or r.keys() != results[0].keys()
               for r in results[1:])


def assert_replays_bit_exact(run: Callable[[], dict[str, torch.Tensor]], replays: int = 3) -> dict[str, torch.Tensor]:
    """Asserts every replay equals the first bit for bit.

    Args:
        run: Returns named tensors (outputs, input/parameter/probs gradients).
        replays: Number of runs (>= 2).

    Returns:
        The first run's tensors.

    Raises:
        ReplayMismatch: Naming each tensor that differed and in how many elements.
    """
    results = run_replays(run, replays)
    problems = []
    for index, result in enumerate(results[1:], start=1):
        if result.keys() != results[0].keys():
            problems.append(f"replay {index} returned {sorted(result)} instead of {sorted(results[0])}")
            continue
        for name, tensor in result.items():
            if not bytes_equal(results[0][name], tensor):
                problems.append(f"replay {index}: {name} differs in {_differing_elements(results[0][name], tensor)} "
                                f"element(s) (dtype {tensor.dtype}, shape {tuple(tensor.shape)})")
    if problems:
        raise ReplayMismatch("; ".join(problems))
    return results[0]


def moe_layer_replay(layer: torch.nn.Module, x0: torch.Tensor, extra: Callable[[], dict] | None = None
                     ) -> Callable[[], dict[str, torch.Tensor]]:
    """A replayable forward + backward of a Megatron MoELayer from its current parameters.

    Each call restores the parameters, runs ``layer(x0)`` and backward of ``sum(y**2)``, and returns the
    output, the input gradient, every parameter gradient and whatever ``extra()`` returns (e.g. the probs
    gradient captured by a hook).
    """
    initial = [p.detach().clone() for p in layer.parameters()]

    def run() -> dict[str, torch.Tensor]:
        with torch.no_grad():
            for param, value in zip(layer.parameters(), initial):
                param.copy_(value)
        layer.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_()
        y, _ = layer(x)
        y.float().pow(2).sum().backward()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        grads = {f"grad_{n}": p.grad for n, p in layer.named_parameters() if p.grad is not None}
        return {"output": y, "grad_input": x.grad, **grads, **(extra() if extra else {})}

    return run
