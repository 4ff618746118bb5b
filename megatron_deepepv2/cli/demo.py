"""Demo (``make demo``): train a small MoE model with ``--moe-flex-dispatcher-backend deepepv2`` on 2 processes.

The model is embedding -> megatron-core ``MoELayer`` (residual) -> LayerNorm -> vocabulary head, trained
with Adam on a synthetic token-mapping task. It is trained twice from the same initial weights and data:
once with Megatron's alltoall dispatcher, once with the flex dispatcher on the deepepv2 backend. Each step
logs loss and tokens/s; the end says whether the two loss trajectories match.

* CPU (no CUDA, or ``--cpu``): 2 gloo processes, the reference backend, FP32 (through the CPU shims of
  :mod:`megatron_deepepv2.testing.cpu_shims`). The processes are forked from a server that imported Megatron once
  (a fresh interpreter per process would import it itself, seconds of CPU each).
* GPUs: one NCCL process per GPU (two by default; one on a 1-GPU machine, where the expert-parallel group has a
  single rank, EP=1), BF16, hidden 256, the ElasticBuffer backend when DeepEP v2 is usable, else the reference
  backend over NCCL (``--backend`` overrides). On a node without an RDMA NIC the GPU ranks get ``EP_DISABLE_GIN=1``
  unless it is set (:func:`megatron_deepepv2.cli.doctor.disable_gin_without_rdma`).

``--fp8-dispatch`` trains the deepepv2 layer twice instead, with BF16 and with FP8 dispatch (both in BF16; hidden 128
on CPU), and reports the largest loss gap and the quantisation error of the rows the experts receive.

Usage: ``python -m megatron_deepepv2.cli.demo [--steps 20] [--nproc N] [--backend ...]
[--fp8-dispatch]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import os
import time
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_deepepv2.testing.preload import server_preload
from megatron_deepepv2.testing.spawn import spawn_on_free_port

logger = logging.getLogger("megatron_deepepv2.cli.demo")

# What the CPU ranks import, imported once by the server they are forked from (a missing module is skipped): the
# shared list, with the demo's CPU helpers.
_CPU_PRELOAD = server_preload(before_megatron=("megatron_deepepv2.testing.cpu_shims",
                                               "megatron_deepepv2.testing.moe_model"))


@dataclass
class DemoConfig:
    """Demo knobs (see ``--help``)."""

    steps: int = 20
    nproc: int = 2
    tokens_per_rank: int = 256
    vocab: int = 64
    num_experts: int = 8
    topk: int = 2
    lr: float = 3e-3
    tolerance: float = 1e-4
    backend: str = "reference"
    fp8_dispatch: bool = False


class TinyMoEModel(torch.nn.Module):
    """Embedding -> MoELayer (residual) -> LayerNorm -> head."""

    def __init__(self, moe_layer: torch.nn.Module, vocab: int, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden, dtype=dtype)
        self.moe = moe_layer
        self.norm = torch.nn.LayerNorm(hidden, dtype=dtype)
        self.head = torch.nn.Linear(hidden, vocab, dtype=dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens).unsqueeze(1)  # [T, 1, H] = [seq, batch, hidden]
        moe_out, _ = self.moe(hidden)
        return self.head(self.norm(hidden + moe_out)).squeeze(1).float()


def _batch(step: int, rank: int, config: DemoConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, config.vocab, (config.tokens_per_rank,), generator=gen)
    targets = (tokens * 7 + 3) % config.vocab
    return tokens.to(device), targets.to(device)


def _train(dispatcher: str, rank: int, config: DemoConfig, device: torch.device, on_gpu: bool,
           fp8_dispatch: bool = False) -> list[float]:
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer  # noqa: PLC0415

    bf16 = on_gpu or config.fp8_dispatch  # FP8 dispatch quantises BF16 rows
    dtype = torch.bfloat16 if bf16 else torch.float32
    hidden = 256 if on_gpu else 128 if config.fp8_dispatch else 64  # FP8 scales blocks of 128 values
    shape = TinyMoEConfig(hidden=hidden, ffn=hidden, num_experts=config.num_experts, topk=config.topk,
                          params_dtype=dtype)
    torch.manual_seed(0)
    with dv2.settings_override(fp8_dispatch=fp8_dispatch):  # resolved when the layer is built
        moe_layer = build_moe_layer(shape, dispatcher, seed=0)
    model = TinyMoEModel(moe_layer, config.vocab, shape.hidden, dtype).to(device)
    # Replicated weights start equal on every rank; expert weights (allreduce=False) are each rank's own.
    for param in model.parameters():
        if getattr(param, "allreduce", True):
            dist.broadcast(param.data, src=0)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.lr)
    losses = []
    label = f"{dispatcher}{' fp8' if fp8_dispatch else ''}"
    for step in range(config.steps):
        tokens, targets = _batch(step, rank, config, device)
        if fp8_dispatch and step in (0, config.steps - 1) and rank == 0:
            _log_quantisation_error(model.embed(tokens).detach(), step)
        start = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(tokens), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # Data parallelism over the expert-parallel ranks: average the gradients of replicated weights.
        for param in model.parameters():
            if param.grad is not None and getattr(param, "allreduce", True):
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        optimizer.step()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss = float(global_loss) / dist.get_world_size()
        elapsed = time.perf_counter() - start
        losses.append(global_loss)
        if rank == 0:
            tokens_per_s = config.tokens_per_rank * dist.get_world_size() / elapsed
            logger.info("[%s] step %3d/%d  loss %.5f  %9.0f tokens/s", label, step + 1, config.steps,
                        global_loss, tokens_per_s)
    return losses


def _log_quantisation_error(rows: torch.Tensor, step: int) -> None:
    """Logs how far the rows the experts receive under FP8 dispatch are from the BF16 ones (the MoE layer's input)."""
    from megatron_deepepv2 import fp8  # noqa: PLC0415

    delivered = fp8.dequantize_e4m3_1x128(*fp8.quantize_e4m3_1x128(rows.contiguous()), dtype=rows.dtype).float()
    error = (delivered - rows.float()).abs().amax(dim=1) / rows.float().abs().amax(dim=1).clamp(min=1e-30)
    logger.info("FP8 dispatch, step %d: received rows' error relative to each row's largest value: max %.2e, "
                "mean %.2e", step + 1, float(error.max()), float(error.mean()))


def _worker(rank: int, world: int, port: int, config: DemoConfig, on_gpu: bool) -> None:
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if on_gpu:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        from megatron_deepepv2.testing.cpu_shims import install_cpu_shims  # noqa: PLC0415

        install_cpu_shims()
        torch.set_num_threads(1)
        device = torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    import megatron_deepepv2 as dv2  # noqa: PLC0415

    dv2.install()
    dv2.configure(backend=config.backend)
    # The baseline and the run compared with it: alltoall vs deepepv2, or deepepv2 BF16 vs FP8 dispatch.
    baseline_run, candidate_run = ((("deepepv2", False), ("deepepv2", True)) if config.fp8_dispatch else
                                   (("alltoall", False), ("deepepv2", False)))
    names = [f"{name}{' (FP8 dispatch)' if fp8_dispatch else ''}" for name, fp8_dispatch in (baseline_run,
                                                                                           candidate_run)]
    try:
        if rank == 0:
            logger.info("Training with %s (baseline) ...", names[0])
        baseline = _train(*baseline_run[:1], rank, config, device, on_gpu, fp8_dispatch=baseline_run[1])
        if rank == 0:
            logger.info("Training with %s (flex dispatcher, expand layout, %s backend) ...", names[1],
                        dv2.get_settings().backend)
        candidate = _train(*candidate_run[:1], rank, config, device, on_gpu, fp8_dispatch=candidate_run[1])
        worst = max(abs(a - b) for a, b in zip(baseline, candidate))
        if rank == 0:
            verdict = "MATCH" if worst <= config.tolerance else "MISMATCH"
            logger.info("loss %.5f -> %.5f (%s) vs %.5f -> %.5f (%s); largest difference %.2e: %s (tolerance %.0e)",
                        baseline[0], baseline[-1], names[0], candidate[0], candidate[-1], names[1], worst, verdict,
                        config.tolerance)
        if worst > config.tolerance:
            raise SystemExit(1)
    finally:
        dv2.destroy_buffers()
        dist.destroy_process_group()


def _fork_cpu_ranks(config: DemoConfig) -> None:
    """Starts the CPU ranks from a forkserver that preloads :data:`_CPU_PRELOAD` (the server starts with this process's
    environment: no GPU visible), on a free port (:func:`~megatron_deepepv2.testing.spawn.spawn_on_free_port`)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(_CPU_PRELOAD)
    spawn_on_free_port(_worker, (config, False), config.nproc, start_method="forkserver")


def main(argv=None) -> int:
    """Parses arguments and launches the ranks. Returns 0 when the loss trajectories match."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=DemoConfig.steps)
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes: GPUs on a GPU machine (default min(2, GPUs)), else CPU processes (default 2)")
    parser.add_argument("--backend", choices=["auto", "deepep", "reference"], default="auto",
                        help="deepepv2 backend (auto: DeepEP on GPUs when usable, else reference)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU processes even when GPUs are present")
    parser.add_argument("--fp8-dispatch", action="store_true",
                        help="compare deepepv2 with BF16 and with FP8 dispatch (instead of alltoall and deepepv2)")
    args = parser.parse_args(argv)
    gpus = 0 if args.cpu or not torch.cuda.is_available() else torch.cuda.device_count()
    nproc = args.nproc if args.nproc is not None else min(2, gpus) if gpus else DemoConfig.nproc
    config = DemoConfig(steps=args.steps, nproc=nproc, fp8_dispatch=args.fp8_dispatch)

    from megatron_deepepv2.backends.registry import resolve_backend  # noqa: PLC0415

    if not logging.getLogger().handlers:  # this process's lines: the backend choice, EP_DISABLE_GIN
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    on_gpu = 0 < config.nproc <= gpus
    if on_gpu:  # the GPU ranks (spawned below, they inherit it) build ElasticBuffers
        from megatron_deepepv2.cli.doctor import disable_gin_without_rdma  # noqa: PLC0415

        disable_gin_without_rdma()
    config.backend = resolve_backend(args.backend if on_gpu else "reference").name
    if on_gpu or config.fp8_dispatch:
        config.tolerance = 5e-2  # BF16 activations (dispatch orders differ between the two paths), or FP8 rows
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if not on_gpu:
        # The CPU ranks must not see a GPU (fewer GPUs than processes, or --cpu): Megatron would place parameters
        # on it, and the CPU shims step aside where CUDA is visible. The ranks (and their forkserver) inherit this.
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        if on_gpu:  # fresh interpreters: CUDA state must not be inherited through a fork
            spawn_on_free_port(_worker, (config, on_gpu), config.nproc)
        else:
            _fork_cpu_ranks(config)
    except mp.ProcessExitedException as error:
        print(f"demo failed: {error}")
        return 1
    return 0


if __name__ == "__main__":
    code = main()
    gc.freeze()  # exiting: skip the final garbage collection over torch's objects (most of a second)
    raise SystemExit(code)
