"""Megatron-LM training runs, step by step: record a ``pretrain_gpt.py`` launch, then compare runs.

Three subcommands:

* ``record``: the launch of ``python -m megatron_deepepv2.cli.run`` (installs the plugin, runs the script as
  ``__main__``), with every training step's exact losses, gradient norm and wall-clock time appended to a JSON-lines
  file by rank 0. Use it as the runner of ``examples/pretrain_gpt_moe_deepepv2.sh``::

      RUNNER="tools/train_gpt.py record --out runs/deepepv2.jsonl --" \\
          examples/pretrain_gpt_moe_deepepv2.sh /path/to/Megatron-LM 1 --train-iters 200 --log-interval 1

  Steps are taken from Megatron's ``training_log``, which runs once per iteration; values are kept both as numbers
  and as ``float.hex`` strings, so that two runs can be compared bit for bit.

* ``rounds``: the variants of :data:`VARIANTS` (a dispatcher, its experts, its CUDA graphs), each recorded as above
  from the same seed on one model of the example (``MODEL``), interleaved in rounds (A B C, then B C A, ...), so
  that a machine whose speed drifts between processes (20-30% on host-bound steps) slows every variant alike::

      python tools/train_gpt.py rounds --megatron-lm /path/to/Megatron-LM --model gpt-moe --rounds 3 --steps 20 \
          --out runs/gpt-moe alltoall-syncfree deepepv2-syncfree alltoall-syncfree-graphs deepepv2-nohostsync-graphs

* ``report``: runs against a baseline (loss gap per step, step time, tokens/s), runs that must be bitwise equal
  (two deterministic runs; a run resumed from a checkpoint against the uninterrupted one), written as
  ``<out>/<name>.json`` and a PNG (loss per step of every run; tokens/s per run)::

      python tools/train_gpt.py report --out docs --name training_h200_ep1 --baseline alltoall \\
          runs/alltoall.jsonl runs/deepepv2.jsonl --equal det_a.jsonl:det_b.jsonl --equal resumed.jsonl:det_a.jsonl

A step's time is the wall clock between two consecutive ``training_log`` calls (Megatron reads the loss on the host
every step, so each call follows the step's end); the report takes the median over the steps after ``--skip``
(warm-up: DeepEP's JIT, CUDA-graph capture). Runs that share a label (repeats of one configuration, e.g. interleaved
pairs) are reported one by one and together: the median of their medians and their spread. A target
``RUN:BASELINE:LIMIT[:ROUND_LIMIT]`` is judged on rounds: the step-time ratio of RUN to BASELINE within each round
(runs recorded by ``rounds`` carry their round; others pair by order), their median against LIMIT and, with
ROUND_LIMIT, every round against it; a row is *faster* only if every round says so.

``record --profile FIRST:LAST --profile-out TRACE.json.gz`` also traces steps FIRST to LAST with ``torch.profiler``
(host with Python stacks, and GPU), each step marked ``ProfilerStep#N`` from one ``training_log`` to the next, for
``tools/trace_summary.py``. Profiled steps run slower: the report leaves every step from FIRST on out of the step
time, so a run can be timed and then traced (``--train-iters 22 --profile 21:22`` times steps up to 20).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools._bench import (new_panels, provenance, save_figure, setup_logging, software_versions,  # noqa: E402
                          write_outputs)

logger = logging.getLogger("train_gpt")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt_moe_deepepv2.sh")
SEQUENTIAL, SYNC_FREE, TE_GROUPED = "SequentialMLP", "SyncFreeSequentialMLP", "TEGroupedMLP"
#: Megatron's alltoall dispatcher, selected over the example's flex + deepepv2.
ALLTOALL_ARGS = ("--moe-token-dispatcher-type", "alltoall", "--moe-flex-dispatcher-backend", "deepep")
#: The widest ``--cuda-graph-modules`` scope megatron-core 0.19 accepts for a dropless alltoall MoE layer of a GPT model
#: with ``--cuda-graph-impl local``. Refused: the whole layer (no scope), and ``attn``, with which a GPT layer
#: (``TransformerLayer``) is captured whole too: the dispatcher waits for its counts' device-to-host copy inside the
#: capture (``_maybe_dtoh_and_synchronize``: ``cudaErrorCapturedEvent``); ``moe`` (drop-and-pad layers only) and
#: ``mlp`` (dense layers only), by Megatron's config checks. ``moe_router`` (the local implementation adds
#: ``moe_preprocess``) passes, but only ``MoETransformerLayer`` (hybrid models) builds graphs for it: a GPT layer
#: builds none, so this variant runs eagerly, like ``alltoall-syncfree``. docs/training.md has the runs.
ALLTOALL_GRAPH_MODULES = ("moe_router", "moe_preprocess")
#: Transformer Engine layers (Megatron's default ``--transformer-impl``) with fused permute, over the example's local
#: spec; with ``--moe-grouped-gemm`` the experts are ``TEGroupedMLP``.
TE_LAYER_ARGS = ("--transformer-impl", "transformer_engine", "--moe-permute-fusion")
TE_GROUPED_ARGS = (*TE_LAYER_ARGS, "--moe-grouped-gemm")
#: Transformer Engine's partial CUDA graphs over the scope Megatron documents for a dropless MoE layer.
TE_GRAPH_ARGS = ("--cuda-graph-impl", "transformer_engine", "--cuda-graph-modules", "attn", "moe_router",
                 "moe_preprocess")


@dataclass(frozen=True)
class Variant:
    """One training configuration of the example, as ``rounds`` launches it.

    Attributes:
        name: The run's label.
        experts: The expert module every MoE layer gets (:data:`SEQUENTIAL` or :data:`SYNC_FREE`).
        description: What the variant is, in a line.
        env: Environment variables set for the launch.
        args: ``pretrain_gpt.py`` arguments added to the example's.
        record_args: ``record`` options (e.g. ``--megatron-dispatch-preprocess``).
    """

    name: str
    experts: str
    description: str
    env: Mapping[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()
    record_args: tuple[str, ...] = ()


_SYNC_FREE_ENV = {"MEGATRON_DEEPEPV2_EXPERTS": "sync_free"}
_NO_HOST_SYNC_ENV = {**_SYNC_FREE_ENV, "MEGATRON_DEEPEPV2_NO_HOST_SYNC": "1"}

def alltoall_graphs(modules: Sequence[str]) -> Variant:
    """``alltoall-syncfree-graphs``: alltoall with its experts and Megatron's per-layer CUDA graphs over ``modules``
    (:data:`ALLTOALL_GRAPH_MODULES` in :data:`VARIANTS`; another scope for a megatron-core whose widest differs)."""
    return Variant("alltoall-syncfree-graphs", SYNC_FREE,
                   f"alltoall-syncfree with Megatron's per-layer CUDA graphs over {' '.join(modules)}", _SYNC_FREE_ENV,
                   ALLTOALL_ARGS + ("--cuda-graph-impl", "local", "--cuda-graph-modules", *modules))


#: The variants by name. Each pair that a comparison needs holds the experts equal.
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("alltoall", SEQUENTIAL, "Megatron's alltoall dispatcher and its SequentialMLP experts", args=ALLTOALL_ARGS),
    Variant("deepepv2", SEQUENTIAL, "flex + deepepv2 with host sync, Megatron's SequentialMLP experts"),
    Variant("alltoall-syncfree", SYNC_FREE, "alltoall with SyncFreeSequentialMLP experts", _SYNC_FREE_ENV,
            ALLTOALL_ARGS),
    Variant("deepepv2-syncfree", SYNC_FREE, "flex + deepepv2 with host sync, SyncFreeSequentialMLP experts",
            _SYNC_FREE_ENV),
    Variant("deepepv2-syncfree-compiled-preprocess", SYNC_FREE,
            "deepepv2-syncfree with Megatron's torch.compile'd dispatch_preprocess instead of the package's eager one",
            _SYNC_FREE_ENV, record_args=("--megatron-dispatch-preprocess",)),
    alltoall_graphs(ALLTOALL_GRAPH_MODULES),
    Variant("deepepv2-nohostsync-eager", SYNC_FREE, "deepepv2 without host sync, SyncFreeSequentialMLP experts",
            _NO_HOST_SYNC_ENV),
    Variant("deepepv2-nohostsync-graphs", SYNC_FREE,
            "deepepv2 without host sync, each layer captured whole in Megatron's per-layer CUDA graphs",
            _NO_HOST_SYNC_ENV, ("--cuda-graph-impl", "local")),
    Variant("alltoall-te", TE_GROUPED, "alltoall with TE layers, TEGroupedMLP and fused permute",
            args=ALLTOALL_ARGS + TE_GROUPED_ARGS),
    Variant("alltoall-te-graphs", TE_GROUPED, "alltoall-te with TE's partial CUDA graphs (attn, router, preprocess)",
            args=ALLTOALL_ARGS + TE_GROUPED_ARGS + TE_GRAPH_ARGS),
    Variant("alltoall-syncfree-te-graphs", SYNC_FREE,
            "alltoall with TE layers, fused permute, SyncFreeSequentialMLP and TE's partial CUDA graphs",
            _SYNC_FREE_ENV, ALLTOALL_ARGS + TE_LAYER_ARGS + TE_GRAPH_ARGS),
    Variant("deepepv2-te", TE_GROUPED, "deepepv2 with host sync, TE layers, TEGroupedMLP and fused permute",
            args=TE_GROUPED_ARGS),
    Variant("deepepv2-te-graphs", TE_GROUPED, "deepepv2-te with TE's partial CUDA graphs (attn, router, preprocess)",
            args=TE_GROUPED_ARGS + TE_GRAPH_ARGS),
    Variant("deepepv2-nohostsync-te-graphs", SYNC_FREE,
            "deepepv2 without host sync, TE layers, SyncFreeSequentialMLP and TE's partial CUDA graphs",
            _NO_HOST_SYNC_ENV, TE_LAYER_ARGS + TE_GRAPH_ARGS),
    Variant("deepepv2-nohostsync-te-layer-graphs", SYNC_FREE,
            "deepepv2 without host sync, TE layers and SyncFreeSequentialMLP, each layer captured whole (local graphs)",
            _NO_HOST_SYNC_ENV, TE_LAYER_ARGS + ("--cuda-graph-impl", "local")),
)}


def built_expert_modules(model: Any) -> list[str]:
    """The class names of the expert modules of ``model``'s MoE layers (a module or a list of model chunks), sorted."""
    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: PLC0415

    chunks = model if isinstance(model, (list, tuple)) else [model]
    return sorted({type(module.experts).__name__ for chunk in chunks for module in chunk.modules()
                   if isinstance(module, MoELayer)})


def expert_module(environment: Mapping[str, str], arguments: Sequence[str] = ()) -> str:
    """The expert module of a run launched with ``environment`` and ``pretrain_gpt.py`` ``arguments`` (the example's
    MoE layers), as the launch asks for it; a run's record names what the built model has."""
    if environment.get("MEGATRON_DEEPEPV2_EXPERTS") == "sync_free":
        return SYNC_FREE
    return TE_GROUPED if "--moe-grouped-gemm" in arguments else SEQUENTIAL


# --------------------------------------------------------------------------------------------------- record


def _number(value: Any) -> Optional[float]:
    """A logged value as a Python float: a tensor (a ``[sum, count]`` pair is divided), a number, or None."""
    if value is None:
        return None
    if hasattr(value, "detach"):
        value = value.detach().float().cpu() if value.dtype.is_floating_point else value.detach().cpu()
        flat = value.flatten().tolist()
        if len(flat) == 2:  # megatron-core's (sum, count) loss pairs
            return flat[0] / flat[1] if flat[1] else None
        return float(flat[0]) if flat else None
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = (_number(v) for v in value)
        return total / count if count else None
    return float(value)


class CudaGraphCaptures:
    """Counts the CUDA graphs captured in this process: every capture, Megatron's local graphs and Transformer
    Engine's alike, ends in ``torch.cuda.CUDAGraph.capture_end``, which :meth:`install` wraps (once per process)."""

    count = 0

    @classmethod
    def install(cls) -> None:
        import torch  # noqa: PLC0415

        graph = torch.cuda.CUDAGraph
        if getattr(graph.capture_end, "_counted", False):
            return
        capture_end = graph.capture_end

        @functools.wraps(capture_end)
        def counted(self, *args, **kwargs):
            result = capture_end(self, *args, **kwargs)
            cls.count += 1
            return result

        counted._counted = True
        graph.capture_end = counted


def _device_name() -> str:
    import torch  # noqa: PLC0415

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


#: Set by ``rounds`` to the wall-clock time (``time.time()``) it launched the run at: the record's ``since_start`` then
#: counts from the launch (torchrun, interpreter start and imports included), else from the recorder's start.
LAUNCHED_AT_VARIABLE = "TRAIN_GPT_LAUNCHED_AT"
#: The compilation caches ``rounds --fresh-caches`` points at empty folders for each run: DeepEP's JIT, Triton's and
#: TorchInductor's (a fresh machine has none of them).
CACHE_VARIABLES = ("EP_JIT_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


class StepRecorder:
    """Wraps ``megatron.training.training.training_log``: each call appends one step to a JSON-lines file.

    The first line is the run's header: its label and round, batch, the expert modules of the built model, the device,
    the versions of torch, Transformer Engine, DeepEP, NCCL and megatron-core, the whole command line and the
    environment. Each step records its losses (exactly, as hex), the seconds since the previous step, the seconds
    since the run started (``since_start``: from its launch by ``rounds``, else from the recorder's start; the first
    step's is the time to the first step, imports, DeepEP's JIT compilation and graph captures included) and how
    many CUDA graphs the process has captured so far.

    Args:
        path: The JSON-lines file (rewritten at the start).
        label: The run's name, written in the first line.
        profile: ``(FIRST, LAST)`` iterations to trace with ``torch.profiler`` on rank 0, or None.
        profile_out: Where the trace goes (``.json`` or ``.json.gz``).
        round_number: The round of ``rounds`` the run belongs to, or None.
        exit_after_last_step: End the process (status 0) once the last iteration (``--train-iters``) is recorded,
            instead of waiting for Megatron's teardown (seconds per run that nothing measures).
    """

    def __init__(self, path: str, label: str, profile: Optional[tuple[int, int]] = None,
                 profile_out: Optional[str] = None, round_number: Optional[int] = None,
                 exit_after_last_step: bool = False) -> None:
        self.path, self.label, self.round_number = path, label, round_number
        self.exit_after_last_step = exit_after_last_step
        self._profile_window = list(profile) if profile else None
        self._last: Optional[float] = None
        launched_at = os.environ.get(LAUNCHED_AT_VARIABLE)
        #: Where ``since_start`` counts from: ``launch`` (``rounds`` launched the run) or ``recorder``.
        self.started_from = "launch" if launched_at else "recorder"
        self._started = time.perf_counter() - (time.time() - float(launched_at) if launched_at else 0.0)
        self._file = None
        self._profile, self._profile_out = profile, profile_out
        self._profiler: Any = None
        self._step_range: Any = None
        #: The expert modules of the built model's MoE layers, once :meth:`wrap_setup` saw it built.
        self.built_experts: Optional[list[str]] = None

    def wrap_setup(self, setup_model_and_optimizer: Any) -> Any:
        """Returns Megatron's ``setup_model_and_optimizer`` noting the built model's expert modules."""

        @functools.wraps(setup_model_and_optimizer)
        def noted(*args, **kwargs):
            result = setup_model_and_optimizer(*args, **kwargs)
            self.built_experts = built_expert_modules(result[0])
            return result

        return noted

    def _header(self) -> dict:
        from megatron.training import get_args  # noqa: PLC0415

        args = get_args()
        environment = {k: v for k, v in os.environ.items()
                       if k.startswith(("MEGATRON_DEEPEPV2_", "NCCL_ALGO")) or k in ("MODEL", *CACHE_VARIABLES)}
        return {"label": self.label, "round": self.round_number, "global_batch_size": args.global_batch_size,
                "seq_length": args.seq_length, "tokens_per_step": args.global_batch_size * args.seq_length,
                "world_size": args.world_size,
                "experts": ("+".join(self.built_experts) if self.built_experts
                            else expert_module(environment, sys.argv[1:])),
                "experts_from": "built model" if self.built_experts else "environment",
                "device": _device_name(), "versions": software_versions(), "started_from": self.started_from,
                "profile": self._profile_window,
                "argv": sys.argv[1:], "environment": environment, "provenance": provenance()}

    def wrap(self, training_log: Any) -> Any:
        """Returns ``training_log`` with the recording around it."""
        import torch.distributed as dist  # noqa: PLC0415

        @functools.wraps(training_log)
        def recorded(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
            now = time.perf_counter()
            if not dist.is_initialized() or dist.get_rank() == 0:
                self._write(iteration, loss_dict, grad_norm, learning_rate, skipped_iter, now)
                if self._profile is not None:
                    self._profile_step(int(iteration))
            result = training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                                  skipped_iter, grad_norm, *args, **kwargs)
            if self.exit_after_last_step and int(iteration) >= self._train_iters():
                self.close()
                if dist.is_initialized():
                    dist.barrier()
                os._exit(0)
            return result

        return recorded

    @staticmethod
    def _train_iters() -> int:
        from megatron.training import get_args  # noqa: PLC0415

        return int(get_args().train_iters)

    def close(self) -> None:
        """Flushes and closes the record."""
        if self._file is not None:
            self._file.close()
            self._file = None

    def _profile_step(self, iteration: int) -> None:
        """Called at the end of each iteration: starts, marks and stops the trace of iterations FIRST to LAST."""
        import torch  # noqa: PLC0415

        first, last = self._profile
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if iteration == first - 1:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
            self._profiler.__enter__()
        if self._profiler is None:
            return
        if first - 1 <= iteration < last:
            self._step_range = torch.profiler.record_function(f"ProfilerStep#{iteration + 1}")
            self._step_range.__enter__()
            return
        self._profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(self._profile_out)), exist_ok=True)
        self._profiler.export_chrome_trace(self._profile_out)
        logger.info("traced iterations %d-%d into %s", first, last, self._profile_out)
        self._profiler, self._profile = None, None

    def _write(self, iteration: int, loss_dict: dict, grad_norm: Any, learning_rate: Any, skipped: Any,
               now: float) -> None:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "w")
            self._file.write(json.dumps(self._header()) + "\n")
        losses = {key: _number(value) for key, value in loss_dict.items()}
        norm = _number(grad_norm)
        step = {"iteration": int(iteration), "losses": losses,
                "losses_hex": {k: (v.hex() if v is not None else None) for k, v in losses.items()},
                "grad_norm": norm, "grad_norm_hex": None if norm is None else norm.hex(),
                "learning_rate": _number(learning_rate), "skipped": int(_number(skipped) or 0),
                "seconds": None if self._last is None else now - self._last, "since_start": now - self._started,
                "cuda_graphs": CudaGraphCaptures.count}
        self._last = now
        self._file.write(json.dumps(step) + "\n")
        self._file.flush()


def use_megatrons_dispatch_preprocess() -> None:
    """Gives deepepv2 layers Megatron's own flex ``dispatch_preprocess`` (compiled with ``torch.compile``) instead of
    the package's eager one, to measure what running it eagerly changes. Call after ``megatron_deepepv2.install()``.

    Raises:
        RuntimeError: Where the installed dispatcher is not the package's.
    """
    from megatron.core.transformer.moe import moe_layer  # noqa: PLC0415

    dispatcher = moe_layer.MoEFlexTokenDispatcher
    if not getattr(dispatcher, "_deepepv2_plugin", False):
        raise RuntimeError("--megatron-dispatch-preprocess: the flex dispatcher is not megatron_deepepv2's "
                           "(MEGATRON_DEEPEPV2_MANAGER=native?); there is nothing to swap.")
    dispatcher.dispatch_preprocess = dispatcher.__mro__[1].dispatch_preprocess


def record(out: str, label: str, target: Sequence[str], profile: Optional[tuple[int, int]] = None,
           profile_out: Optional[str] = None, round_number: Optional[int] = None,
           megatron_dispatch_preprocess: bool = False, exit_after_last_step: bool = False) -> int:
    """Runs ``python -m megatron_deepepv2.cli.run TARGET...`` with a :class:`StepRecorder` on Megatron's training log.

    Args:
        out: The JSON-lines file.
        label: The run's name.
        target: ``[SCRIPT, ARGS...]`` as for ``megatron_deepepv2.cli.run``.
        profile: Iterations ``(FIRST, LAST)`` to trace, or None.
        profile_out: The trace file.
        round_number: The run's round (``rounds``), written in its header.
        megatron_dispatch_preprocess: See :func:`use_megatrons_dispatch_preprocess`.
        exit_after_last_step: See :class:`StepRecorder`.

    Returns:
        The runner's exit status.
    """
    import megatron_deepepv2  # noqa: PLC0415
    from megatron_deepepv2.cli import run  # noqa: PLC0415

    megatron_deepepv2.install()  # before Megatron's training modules are imported (run.main's install is then a no-op)
    if megatron_dispatch_preprocess:
        use_megatrons_dispatch_preprocess()
    import megatron.training.training as training  # noqa: PLC0415

    CudaGraphCaptures.install()
    recorder = StepRecorder(out, label, profile, profile_out, round_number, exit_after_last_step)
    training.training_log = recorder.wrap(training.training_log)
    training.setup_model_and_optimizer = recorder.wrap_setup(training.setup_model_and_optimizer)
    return run.main(list(target))


# --------------------------------------------------------------------------------------------------- report


def load(path: str) -> dict:
    """A recorded run: its header, and its steps by iteration (the last record of an iteration wins)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty: the run recorded no step (did it fail before training?).")
    header, steps = lines[0], {step["iteration"]: step for step in lines[1:]}
    return {"path": path, "label": header.get("label") or os.path.splitext(os.path.basename(path))[0],
            "header": header, "steps": steps}


def timed_steps(run: dict, skip: int) -> list[dict]:
    """The steps of ``run`` whose wall clock counts: after the first ``skip`` (warm-up), and before the first traced
    iteration, if the run was traced (the profiler slows every step from there on, and its trace is written during
    the last traced step's log)."""
    profile = run["header"].get("profile")
    steps = [run["steps"][i] for i in sorted(run["steps"]) if not profile or i < profile[0]]
    return [s for s in steps[skip:] if s["seconds"] is not None]


def summarise(run: dict, skip: int) -> dict:
    """Step time (median of :func:`timed_steps`), tokens/s and the loss curve of a run."""
    steps = [run["steps"][i] for i in sorted(run["steps"])]
    times = [s["seconds"] for s in timed_steps(run, skip)]
    step_s = statistics.median(times) if times else None
    tokens = run["header"].get("tokens_per_step")
    header = run["header"]
    return {"label": run["label"], "round": header.get("round"),
            "experts": header.get("experts") or expert_module(header.get("environment", {})),
            "timed_steps": len(times), "steps": len(steps),
            "first_iteration": steps[0]["iteration"] if steps else None,
            "last_iteration": steps[-1]["iteration"] if steps else None,
            "median_step_ms": None if step_s is None else step_s * 1e3, "tokens_per_step": tokens,
            "tokens_per_s": None if not step_s or not tokens else tokens / step_s,
            "first_loss": steps[0]["losses"].get("lm loss") if steps else None,
            "last_loss": steps[-1]["losses"].get("lm loss") if steps else None,
            "loss": {str(s["iteration"]): s["losses"].get("lm loss") for s in steps},
            "first_step_s": steps[0].get("since_start") if steps else None,
            "cuda_graphs": steps[-1].get("cuda_graphs") if steps else None,
            "device": header.get("device"), "versions": header.get("versions"), "argv": header.get("argv"),
            "environment": run["header"].get("environment", {}),
            "provenance": run["header"].get("provenance")}


def loss_gap(run: dict, baseline: dict) -> dict:
    """Largest and last absolute ``lm loss`` difference over the iterations both runs have."""
    common = sorted(set(run["steps"]) & set(baseline["steps"]))
    gaps = [abs(run["steps"][i]["losses"]["lm loss"] - baseline["steps"][i]["losses"]["lm loss"]) for i in common]
    if not gaps:
        return {"iterations": 0}
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    return {"iterations": len(common), "max_abs": gaps[worst], "at_iteration": common[worst], "last_abs": gaps[-1],
            "mean_abs": statistics.fmean(gaps)}


def bitwise_equal(run: dict, other: dict) -> dict:
    """Whether the iterations both runs have carry bit-identical losses and gradient norms; the first difference."""
    common = sorted(set(run["steps"]) & set(other["steps"]))
    for i in common:
        a, b = run["steps"][i], other["steps"][i]
        if a["losses_hex"] != b["losses_hex"] or a["grad_norm_hex"] != b["grad_norm_hex"]:
            return {"iterations": len(common), "equal": False, "first_difference": i,
                    "values": [[a["losses"], a["grad_norm"]], [b["losses"], b["grad_norm"]]]}
    return {"iterations": len(common), "equal": bool(common), "range": [common[0], common[-1]] if common else None}


def configurations(summaries: Sequence[dict]) -> dict:
    """Runs grouped by label: each configuration's runs, the median of their median step times, and their spread."""
    groups: dict[str, list[dict]] = {}
    for run in summaries:
        groups.setdefault(run["label"], []).append(run)
    out = {}
    for label, runs in groups.items():
        each = [r["median_step_ms"] for r in runs if r["median_step_ms"] is not None]
        if not each:
            continue
        median = statistics.median(each)
        tokens = runs[0]["tokens_per_step"]
        out[label] = {"runs": [r["run"] for r in runs], "experts": runs[0]["experts"],
                      "cuda_graphs": sorted({r["cuda_graphs"] for r in runs if r.get("cuda_graphs") is not None}),
                      "first_step_s_each": [r["first_step_s"] for r in runs if r.get("first_step_s") is not None],
                      "rounds": [r["round"] for r in runs if r["median_step_ms"] is not None],
                      "median_step_ms_each": each, "median_step_ms": median,
                      "spread_pct": (max(each) - min(each)) / median * 100,
                      "tokens_per_s": tokens / (median / 1e3) if tokens else None}
    return out


def round_ratios(groups: dict, run: str, baseline: str) -> dict[int, float]:
    """Step-time ratio ``run / baseline`` in each round both configurations completed: runs recorded by ``rounds``
    pair by their round, others by order (the k-th run of each)."""
    def by_round(group: dict) -> dict[int, float]:
        rounds = group["rounds"]
        recorded = rounds and all(r is not None for r in rounds)
        keys = rounds if recorded else range(1, len(group["median_step_ms_each"]) + 1)
        return dict(zip(keys, group["median_step_ms_each"]))

    ours, theirs = by_round(groups[run]), by_round(groups[baseline])
    return {k: ours[k] / theirs[k] for k in sorted(set(ours) & set(theirs))}


def target_ratios(groups: dict, targets: Sequence[str]) -> list[dict]:
    """``RUN:BASELINE:LIMIT[:ROUND_LIMIT]`` targets, judged on rounds.

    Each round's step-time ratio ``RUN / BASELINE`` (:func:`round_ratios`); ``ratio`` is their median, ``met`` says
    whether it is at most ``LIMIT`` and, with ``ROUND_LIMIT``, no round's ratio is above it; ``faster_in_every_round``
    whether every round's ratio is below 1 (the only case a row is called faster). ``pooled_ratio`` is the ratio of
    the two configurations' medians of run medians, for reference.

    Raises:
        ValueError: For a malformed target, or one naming a label no run has, or two configurations without a
            common round.
    """
    results = []
    for target in targets:
        parts = target.split(":")
        if len(parts) not in (3, 4):
            raise ValueError(f"target {target!r}: give RUN:BASELINE:LIMIT[:ROUND_LIMIT] (labels and ratios, e.g. "
                             "deepepv2-syncfree:alltoall-syncfree:1.0:1.05)")
        run, baseline = parts[0], parts[1]
        limit = float(parts[2])
        round_limit = float(parts[3]) if len(parts) == 4 else None
        missing = [label for label in (run, baseline) if label not in groups]
        if missing:
            raise ValueError(f"target {target!r}: no runs labelled {missing}; labels: {sorted(groups)}")
        per_round = round_ratios(groups, run, baseline)
        if not per_round:
            raise ValueError(f"target {target!r}: {run} and {baseline} share no round")
        values = list(per_round.values())
        ratio = statistics.median(values)
        results.append({"run": run, "baseline": baseline,
                        "experts": [groups[run]["experts"], groups[baseline]["experts"]],
                        "limit": limit, "round_limit": round_limit, "ratio": ratio,
                        "round_ratios": {str(k): v for k, v in per_round.items()},
                        "min_ratio": min(values), "max_ratio": max(values), "rounds": len(values),
                        "met": ratio <= limit and (round_limit is None or max(values) <= round_limit),
                        "faster_in_every_round": all(v < 1.0 for v in values),
                        "pooled_ratio": groups[run]["median_step_ms"] / groups[baseline]["median_step_ms"]})
    return results


def runs_provenance(summaries: Sequence[dict]) -> dict:
    """Where a report's numbers come from: the commits and dates its runs recorded (not the report's own checkout).
    A run's provenance may itself be a report's (``git_commits``, ``first_date``): its commits and dates count."""
    recorded = [r["provenance"] for r in summaries if r.get("provenance")]
    commits = sorted({commit for p in recorded
                      for commit in (p["git_commits"] if "git_commits" in p else [p.get("git_commit") or "unknown"])})
    dates = sorted(date for p in recorded for date in (p.get("first_date"), p.get("date")) if date)
    return {"git_commit": commits[0] if len(commits) == 1 else None, "git_commits": commits,
            "git_dirty": any(p.get("git_dirty") for p in recorded),
            "date": dates[-1] if dates else None, "first_date": dates[0] if dates else None}


def runs_machine(summaries: Sequence[dict]) -> dict:
    """The devices and software versions the runs recorded: ``versions`` where every run that recorded them agrees,
    else None (each run keeps its own)."""
    versions = [r["versions"] for r in summaries if r.get("versions")]
    return {"devices": sorted({r["device"] for r in summaries if r.get("device")}),
            "versions": versions[0] if versions and all(v == versions[0] for v in versions) else None}


def report(paths: Sequence[str], baseline: Optional[str], equal: Sequence[str], skip: int,
           targets: Sequence[str] = ()) -> dict:
    """The comparison document of recorded runs.

    Runs that share a label are repeats of one configuration: each is reported as ``LABEL#k`` (k from 1, in the order
    given), and ``configurations`` puts them together.

    Args:
        paths: Runs to summarise (JSON-lines files).
        baseline: Label of the configuration whose first run the others' loss gaps are taken against, or None.
        equal: ``A.jsonl:B.jsonl`` pairs that must be bitwise equal where their iterations overlap.
        skip: Warm-up steps left out of the step time.
        targets: ``RUN:BASELINE:LIMIT`` step-time ratios to check (see :func:`target_ratios`).

    Returns:
        ``{"runs": [...], "configurations": {...}, "targets": [...], "loss_gap": {run: ...}, "bitwise": [...]}``.

    Raises:
        ValueError: For a baseline or target naming no run.
    """
    runs = [load(p) for p in paths]
    counts: dict[str, int] = {}
    for run in runs:
        counts[run["label"]] = counts.get(run["label"], 0) + 1
    seen: dict[str, int] = {}
    for run in runs:
        seen[run["label"]] = seen.get(run["label"], 0) + 1
        run["run"] = run["label"] if counts[run["label"]] == 1 else f"{run['label']}#{seen[run['label']]}"
    summaries = [{"run": r["run"], **summarise(r, skip)} for r in runs]
    document: dict = {"provenance": runs_provenance(summaries), "machine": runs_machine(summaries), "runs": summaries,
                      "skip": skip, "configurations": configurations(summaries)}
    document["targets"] = target_ratios(document["configurations"], targets)
    if baseline is not None:
        reference = next((r for r in runs if r["label"] == baseline), None)
        if reference is None:
            raise ValueError(f"baseline {baseline!r} is not one of the runs' labels: {sorted(counts)}.")
        document["baseline"] = baseline
        document["loss_gap"] = {r["run"]: loss_gap(r, reference) for r in runs if r is not reference}
    document["bitwise"] = []
    for pair in equal:
        first, _, second = pair.partition(":")
        a, b = load(first), load(second)
        document["bitwise"].append({"runs": [a["label"], b["label"]], **bitwise_equal(a, b)})
    return document


def throughput_bars(configurations: list[dict]) -> tuple[list[float], list[float], list[float]]:
    """Thousand tokens/s of each configuration (its median step) and the error bars spanning its runs: how far the
    slowest run's tokens/s lies below and the fastest run's above, never below zero (with one run the two sides
    differ only by rounding)."""
    tokens = [g["tokens_per_s"] / 1e3 for g in configurations]
    pairs = list(zip(tokens, configurations))
    lows = [max(0.0, t - t * g["median_step_ms"] / max(g["median_step_ms_each"])) for t, g in pairs]
    highs = [max(0.0, t * g["median_step_ms"] / min(g["median_step_ms_each"]) - t) for t, g in pairs]
    return tokens, lows, highs


def bar_labels(groups: Sequence[tuple[str, dict]]) -> list[str]:
    """A throughput bar's label: the configuration, its expert module and its number of runs."""
    return [f"{label}\n{g.get('experts', '?')} (x{len(g['runs'])})" for label, g in groups]


def plotted_configurations(document: dict) -> dict:
    """The configurations a report's plot draws, each with its expert module. A document written by an older version
    of this tool (no ``configurations``, or none naming their experts) gets them from its runs: the expert module
    from each run's recorded environment, a configuration per label."""
    if not document.get("configurations"):
        summaries = []
        for run in document["runs"]:
            step_ms, tokens_per_s = run.get("median_step_ms"), run.get("tokens_per_s")
            tokens = run.get("tokens_per_step") or (tokens_per_s * step_ms / 1e3 if step_ms and tokens_per_s else None)
            summaries.append({**run, "run": run.get("run", run["label"]), "round": run.get("round"),
                              "experts": run.get("experts") or expert_module(run.get("environment", {})),
                              "tokens_per_step": tokens})
        return configurations(summaries)
    groups = {}
    for label, group in document["configurations"].items():
        if "experts" not in group:
            run = next((r for r in document["runs"] if r["label"] == label), {})
            group = {**group, "experts": run.get("experts") or expert_module(run.get("environment", {}))}
        groups[label] = group
    return groups


def plot(document: dict, path: str) -> None:
    """Loss per step of every run (left), tokens/s per configuration with its expert module (middle), and, with
    targets, each target's step-time ratio in every round beside its limit (right)."""
    targets = document.get("targets", [])
    fig, axes = new_panels(18 if targets else 12, 4.8, 3 if targets else 2)
    left, middle = axes[0], axes[1]
    for run in document["runs"]:
        steps = sorted(run["loss"], key=int)
        left.plot([int(s) for s in steps], [run["loss"][s] for s in steps], label=run.get("run", run["label"]),
                  linewidth=1)
    left.set_xlabel("iteration")
    left.set_ylabel("lm loss")
    left.set_yscale("log")
    left.legend(fontsize=6, ncol=2)
    left.set_title("loss per step")
    groups = [(label, g) for label, g in plotted_configurations(document).items() if g["tokens_per_s"]]
    tokens, lows, highs = throughput_bars([g for _, g in groups])
    bars = middle.bar(range(len(groups)), tokens, yerr=[lows, highs], capsize=3)
    middle.bar_label(bars, fmt="%.0f", fontsize=7)
    middle.set_xticks(range(len(groups)), bar_labels(groups), rotation=20, ha="right", fontsize=6)
    middle.set_ylabel("thousand tokens / s")
    middle.set_title("throughput (median step; bars: runs' range)")
    if targets:
        right = axes[2]
        for i, target in enumerate(targets):
            values = list(target["round_ratios"].values())
            right.scatter([i] * len(values), values, s=14, color="tab:blue", zorder=3)
            right.hlines(target["ratio"], i - 0.3, i + 0.3, color="tab:blue", linewidth=2)
            right.hlines(target["limit"], i - 0.35, i + 0.35, color="tab:red", linestyles="dashed", linewidth=1)
        right.axhline(1.0, color="grey", linewidth=0.8)
        right.set_xticks(range(len(targets)), [f"{t['run']}\n/ {t['baseline']}" for t in targets], rotation=20,
                         ha="right", fontsize=6)
        right.set_ylabel("step time ratio")
        right.set_title("each round's ratio (line: median; dashed: limit)")
    save_figure(fig, path)


# --------------------------------------------------------------------------------------------------- rounds


@dataclass(frozen=True)
class Launch:
    """One run of ``rounds``: a variant in a round, and where its record goes."""

    variant: Variant
    round_number: int
    out: str
    profile: Optional[tuple[int, int]] = None


def schedule(variants: Sequence[str], rounds: int, out: str, profile_last: Sequence[str] = (),
             profile_steps: int = 2, steps: int = 20) -> list[Launch]:
    """The runs of ``rounds`` in order: every variant once per round, the order rotated by one each round (A B C,
    B C A, C A B), so that no variant always runs first or after the same neighbour.

    Args:
        variants: Names in :data:`VARIANTS`.
        rounds: How many rounds.
        out: The folder of the records (``<variant>-r<round>.jsonl``).
        profile_last: Variants whose run in the last round is also traced, for ``profile_steps`` steps after the
            ``steps`` timed ones (the report leaves traced steps out of the step time).
        profile_steps: Steps traced.
        steps: Steps timed.

    Raises:
        ValueError: For an unknown variant, a traced one not run, or fewer than one round.
    """
    unknown = [v for v in (*variants, *profile_last) if v not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {sorted(VARIANTS)}")
    if not set(profile_last) <= set(variants):
        raise ValueError(f"traced variants {sorted(set(profile_last) - set(variants))} are not among those run")
    if rounds < 1 or not variants:
        raise ValueError("rounds needs at least one round and one variant")
    launches = []
    for r in range(1, rounds + 1):
        shift = (r - 1) % len(variants)
        for name in [*variants[shift:], *variants[:shift]]:
            traced = r == rounds and name in profile_last
            launches.append(Launch(VARIANTS[name], r, os.path.join(out, f"{name}-r{r}.jsonl"),
                                   (steps + 1, steps + profile_steps) if traced else None))
    return launches


def launch_command(launch: Launch, megatron_lm: str, steps: int, extra: Sequence[str]) -> tuple[list[str], str]:
    """The example's command line for ``launch`` and its ``RUNNER``: this tool's ``record``, which torchrun starts in
    place of ``-m megatron_deepepv2.cli.run`` (see the example)."""
    runner = [os.path.abspath(__file__), "record", "--out", os.path.abspath(launch.out), "--label",
              launch.variant.name, "--round", str(launch.round_number), "--exit-after-last-step",
              *launch.variant.record_args]
    iterations = steps
    if launch.profile:
        trace = os.path.abspath(launch.out.removesuffix(".jsonl") + ".trace.json.gz")
        runner += ["--profile", f"{launch.profile[0]}:{launch.profile[1]}", "--profile-out", trace]
        iterations = launch.profile[1]
    command = ["bash", EXAMPLE, megatron_lm, "1", "--train-iters", str(iterations), "--lr-decay-iters", "200",
               "--log-interval", "1", *launch.variant.args, *extra]
    return command, " ".join([*runner, "--"])


def launch_environment(launch: Launch, model: str, runner: str, out: str,
                       fresh_caches: bool = False) -> dict[str, str]:
    """The environment of ``launch``: this process's, the variant's settings, ``MODEL``, ``RUNNER`` and the launch
    time (:data:`LAUNCHED_AT_VARIABLE`); with ``fresh_caches``, each of :data:`CACHE_VARIABLES` names an empty folder
    under :func:`launch_caches` (emptied first: an earlier run into the same ``out`` left it filled). The CUDA
    driver's own compute cache is not among them."""
    env = {**os.environ, **launch.variant.env, "MODEL": model, "RUNNER": runner,
           LAUNCHED_AT_VARIABLE: repr(time.time())}
    if fresh_caches:
        folder = launch_caches(launch, out)
        shutil.rmtree(folder, ignore_errors=True)
        for variable in CACHE_VARIABLES:
            env[variable] = os.path.join(folder, variable.lower())
            os.makedirs(env[variable])
    return env


def launch_caches(launch: Launch, out: str) -> str:
    """The folder of ``launch``'s own compilation caches under ``rounds --fresh-caches`` (removed once it ran)."""
    return os.path.join(os.path.abspath(out), "caches", f"{launch.variant.name}-r{launch.round_number}")


def rounds_options(model: str, steps: int, extra: Sequence[str] = (), profile_last: Sequence[str] = (),
                   alltoall_graph_modules: Optional[Sequence[str]] = None, fresh_caches: bool = False) -> dict:
    """What the runs of one rounds folder share, so that a resumed call adds runs comparable with the kept ones: the
    model, steps, extra arguments, traced variants, alltoall's capture scope, fresh caches, and the machine (its host
    name: runs from two machines are not paired in a round).

    Args:
        model, steps, extra, profile_last, alltoall_graph_modules, fresh_caches: As :func:`run_rounds`.

    Returns:
        The options, JSON-serialisable.
    """
    return {"model": model, "steps": steps, "extra": list(extra), "profile_last": sorted(profile_last),
            "alltoall_graph_modules": list(alltoall_graph_modules or []), "fresh_caches": fresh_caches,
            "host": socket.gethostname()}


def completed_launches(out: str, options: dict, plan: Sequence[Launch]) -> list[dict]:
    """The launches of ``plan`` that ``out/rounds.json`` lists as completed: exit 0 and their record still there.

    Args:
        out: The rounds folder.
        options: :func:`rounds_options` of this call.
        plan: This call's launches (a kept launch must be one of them).

    Returns:
        The completed launches' entries, in the file's order; none when the file is missing.

    Raises:
        ValueError: When ``out/rounds.json`` is not a rounds file, or was written with other options (another model,
            step count, extra arguments, traced variants, capture scope, cache mode or machine): its records would be
            overwritten or paired with runs unlike them.
    """
    path = os.path.join(out, "rounds.json")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        try:
            earlier = json.load(f)
            launches, earlier_options = earlier["launches"], earlier["options"]
            completed = {(r["variant"], r["round"]): r for r in launches if r["exit"] == 0 and
                         os.path.exists(r["record"])}
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{path} is not a rounds file of this tool ({error!r}); give another --out or remove "
                             "it") from error
    differing = {key: (earlier_options.get(key), value) for key, value in options.items()
                 if earlier_options.get(key) != value}
    if differing:
        said = "; ".join(f"{key} was {old!r}, is {new!r}" for key, (old, new) in differing.items())
        raise ValueError(f"cannot resume the rounds in {out}: {said}. Resume with the same options, or give another "
                         "--out")
    return [completed[key] for key in ((launch.variant.name, launch.round_number) for launch in plan)
            if key in completed]


def _run_launch(launch: Launch, megatron_lm: str, model: str, steps: int, out: str, extra: Sequence[str],
                run_timeout_s: float, fresh_caches: bool) -> dict:
    """Runs one launch of :func:`run_rounds` (its output into its log; a failure logged with the log's end).

    Returns:
        Its entry: variant, round, record path, exit status (-9 when stopped at ``run_timeout_s``), seconds.
    """
    command, runner = launch_command(launch, megatron_lm, steps, extra)
    env = launch_environment(launch, model, runner, out, fresh_caches)
    log = launch.out.removesuffix(".jsonl") + ".log"
    began = time.monotonic()
    with open(log, "w") as f:
        try:
            status = subprocess.run(command, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    timeout=run_timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = -9
    seconds = time.monotonic() - began
    if status != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        logger.error("%s round %d failed (exit %d) after %.0f s:\n%s", launch.variant.name, launch.round_number,
                     status, seconds, tail)
    if fresh_caches:  # compiled for this launch alone: no later one may use them
        shutil.rmtree(launch_caches(launch, out), ignore_errors=True)
    return {"variant": launch.variant.name, "round": launch.round_number, "record": launch.out, "exit": status,
            "seconds": round(seconds, 1)}


def run_rounds(megatron_lm: str, model: str, variants: Sequence[str], rounds: int, steps: int, out: str,
               extra: Sequence[str] = (), profile_last: Sequence[str] = (), deadline_s: Optional[float] = None,
               run_timeout_s: float = 600.0, alltoall_graph_modules: Optional[Sequence[str]] = None,
               fresh_caches: bool = False, resume: bool = False) -> list[dict]:
    """Runs :func:`schedule`'s launches one after another (one GPU: the example at EP=1), each recorded by ``record``.

    A launch that fails is logged with the end of its output and the rounds go on; past ``deadline_s`` no launch
    starts (what ran is kept; the report pairs only rounds both sides completed). With ``resume``, a schedule cut
    off by its deadline goes on where it stopped: the launches of this schedule that ``out/rounds.json`` lists as
    completed are kept and not run again, the others run in the schedule's order (:func:`completed_launches`).

    Args:
        megatron_lm: The Megatron-LM tree (``pretrain_gpt.py``).
        model: The example's ``MODEL``.
        variants: Names in :data:`VARIANTS`.
        rounds: Rounds.
        steps: Steps per run (``--train-iters``; traced runs take more, see :func:`schedule`).
        out: Folder of the records and logs.
        extra: More ``pretrain_gpt.py`` arguments for every run.
        profile_last: See :func:`schedule`.
        deadline_s: Seconds from the start after which no launch starts, or None.
        run_timeout_s: A launch still running after this long is stopped and counts as failed.
        alltoall_graph_modules: The capture scope of ``alltoall-syncfree-graphs`` (:func:`alltoall_graphs`), or None
            for :data:`ALLTOALL_GRAPH_MODULES`.
        fresh_caches: Every launch compiles from empty caches (:func:`launch_environment`), as on a fresh machine.
        resume: Keep the completed launches of an earlier call into the same ``out`` with the same options.

    Returns:
        One entry per launch: variant, round, record path, exit status, seconds (kept ones included, first).

    Raises:
        ValueError: With ``resume``, as :func:`completed_launches`.
    """
    os.makedirs(out, exist_ok=True)
    plan = schedule(variants, rounds, out, profile_last, steps=steps)
    if alltoall_graph_modules:
        plan = [dataclasses.replace(launch, variant=alltoall_graphs(alltoall_graph_modules))
                if launch.variant.name == "alltoall-syncfree-graphs" else launch for launch in plan]
    options = rounds_options(model, steps, extra, profile_last, alltoall_graph_modules, fresh_caches)
    results = completed_launches(out, options, plan) if resume else []
    if results:
        logger.info("resuming: %d launches completed earlier are kept", len(results))
    done = {(r["variant"], r["round"]) for r in results}
    plan = [launch for launch in plan if (launch.variant.name, launch.round_number) not in done]
    start = time.monotonic()
    for i, launch in enumerate(plan, start=1):
        elapsed = time.monotonic() - start
        if deadline_s is not None and elapsed > deadline_s:
            logger.warning("deadline: %d of %d launches not started", len(plan) - i + 1, len(plan))
            break
        logger.info("[%d/%d] round %d %-40s (%.0f s so far)", i, len(plan), launch.round_number, launch.variant.name,
                    elapsed)
        results.append(_run_launch(launch, megatron_lm, model, steps, out, extra, run_timeout_s, fresh_caches))
        with open(os.path.join(out, "rounds.json"), "w") as f:
            json.dump({"options": options, "launches": results}, f, indent=1)
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    rec = commands.add_parser("record", help="run a training script, recording every step")
    rec.add_argument("--out", required=True, help="JSON-lines file")
    rec.add_argument("--label", default=None, help="the run's name (default: the file name)")
    rec.add_argument("--profile", default=None, metavar="FIRST:LAST", help="trace these iterations (torch.profiler)")
    rec.add_argument("--profile-out", default=None, help="the trace file (.json or .json.gz)")
    rec.add_argument("--round", type=int, default=None, help="the round the run belongs to (written in its header)")
    rec.add_argument("--exit-after-last-step", action="store_true",
                     help="end the process once the last iteration is recorded (skips Megatron's teardown)")
    rec.add_argument("--megatron-dispatch-preprocess", action="store_true",
                     help="deepepv2 layers run Megatron's compiled dispatch_preprocess instead of the package's")
    rec.add_argument("target", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    rnd = commands.add_parser("rounds", help="run variants of the example interleaved in rounds, each recorded")
    rnd.add_argument("variants", nargs="+", choices=sorted(VARIANTS), metavar="VARIANT",
                     help=f"variants to run: {', '.join(VARIANTS)}")
    rnd.add_argument("--megatron-lm", required=True, help="the Megatron-LM tree (pretrain_gpt.py)")
    rnd.add_argument("--model", default="gpt-moe", help="the example's MODEL")
    rnd.add_argument("--rounds", type=int, default=3, help="rounds (each runs every variant once)")
    rnd.add_argument("--steps", type=int, default=20, help="training steps per run")
    rnd.add_argument("--out", required=True, help="folder of the records")
    rnd.add_argument("--profile-last", nargs="*", default=[], metavar="VARIANT",
                     help="variants whose last-round run also traces 2 steps after the timed ones")
    rnd.add_argument("--deadline", type=float, default=None, help="seconds after which no run starts")
    rnd.add_argument("--run-timeout", type=float, default=600.0, help="seconds after which a run is stopped")
    rnd.add_argument("--alltoall-graph-modules", nargs="+", default=None, metavar="MODULE",
                     help=f"capture scope of alltoall-syncfree-graphs (default: {' '.join(ALLTOALL_GRAPH_MODULES)})")
    rnd.add_argument("--fresh-caches", action="store_true",
                     help="each run compiles from empty DeepEP JIT, Triton and TorchInductor caches (a fresh machine)")
    rnd.add_argument("--resume", action="store_true",
                     help="keep the runs an earlier call into the same --out completed (same options, same machine) "
                          "and run only the others")
    rnd.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more pretrain_gpt.py arguments")
    rep = commands.add_parser("report", help="compare recorded runs: JSON + PNG")
    rep.add_argument("runs", nargs="+", help="JSON-lines files")
    rep.add_argument("--out", required=True, help="output folder")
    rep.add_argument("--name", default="training", help="output file name without extension")
    rep.add_argument("--baseline", default=None, help="label of the run to take loss gaps against")
    rep.add_argument("--equal", action="append", default=[], help="A.jsonl:B.jsonl, bitwise equal where they overlap")
    rep.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the step time")
    rep.add_argument("--target", action="append", default=[], metavar="RUN:BASELINE:LIMIT[:ROUND_LIMIT]",
                     help="a step-time ratio to check on rounds, e.g. deepepv2-syncfree:alltoall-syncfree:1.0:1.05")
    args = parser.parse_args(argv)
    if args.command == "record":
        target = args.target[1:] if args.target[:1] == ["--"] else args.target
        if not target:
            parser.error("record needs the script to run: record --out FILE -- SCRIPT [ARGS...]")
        label = args.label or os.path.splitext(os.path.basename(args.out))[0]
        profile = None
        if args.profile:
            first, _, last = args.profile.partition(":")
            if not (first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
                parser.error(f"--profile {args.profile}: give FIRST:LAST iterations, 1 <= FIRST <= LAST")
            if not args.profile_out:
                parser.error("--profile needs --profile-out TRACE.json.gz")
            profile = (int(first), int(last))
        return record(args.out, label, target, profile, args.profile_out, args.round, args.megatron_dispatch_preprocess,
                      args.exit_after_last_step)
    setup_logging()
    if args.command == "rounds":
        if args.rounds < 1 or args.steps < 2:
            parser.error("rounds needs --rounds >= 1 and --steps >= 2")
        results = run_rounds(args.megatron_lm, args.model, args.variants, args.rounds, args.steps, args.out,
                             args.extra, args.profile_last, args.deadline, args.run_timeout,
                             args.alltoall_graph_modules, args.fresh_caches, args.resume)
        return 0 if results and all(r["exit"] == 0 for r in results) else 1
    document = report(args.runs, args.baseline, args.equal, args.skip, args.target)
    for run in document["runs"]:
        logger.info("%-30s %4d steps  loss %.4f -> %.4f  %8.1f ms/step  %9.0f tokens/s  first step at %s s, %s CUDA "
                    "graphs", run["run"], run["steps"], run["first_loss"] or float("nan"),
                    run["last_loss"] or float("nan"), run["median_step_ms"] or float("nan"),
                    run["tokens_per_s"] or float("nan"),
                    "?" if run["first_step_s"] is None else f"{run['first_step_s']:.1f}",
                    "?" if run["cuda_graphs"] is None else run["cuda_graphs"])
    for label, group in document["configurations"].items():
        logger.info("%-30s %d run(s): median %.1f ms/step (each %s, spread %.1f%%)", label, len(group["runs"]),
                    group["median_step_ms"], ", ".join(f"{v:.1f}" for v in group["median_step_ms_each"]),
                    group["spread_pct"])
    for target in document["targets"]:
        logger.info("target %s / %s: median of %d rounds %.3f (min %.3f, max %.3f; limit %.2f%s: %s)%s",
                    target["run"], target["baseline"], target["rounds"], target["ratio"], target["min_ratio"],
                    target["max_ratio"], target["limit"],
                    "" if target["round_limit"] is None else f", every round <= {target['round_limit']:.2f}",
                    "met" if target["met"] else "NOT met",
                    "; faster in every round" if target["faster_in_every_round"] else "")
    for label, gap in document.get("loss_gap", {}).items():
        logger.info("loss gap %s vs %s: %s", label, document["baseline"], gap)
    for check in document["bitwise"]:
        logger.info("bitwise %s: %s", " vs ".join(check["runs"]), check)
    write_outputs(args.out, args.name, document, plot)
    return 0 if all(check["equal"] for check in document["bitwise"]) else 1


if __name__ == "__main__":
    sys.exit(main())
