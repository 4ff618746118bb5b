"""Shared machinery of the benchmarks in ``tools/``: timers, interleaving, process-group start-up, logging, outputs.

Every benchmark here times, starts and writes the same way, so that their numbers compare:

* timers, in microseconds per call: :func:`wall_us` (``N`` back-to-back calls and one synchronisation: what a
  training step waits for), :func:`host_us` (the clock stops before the synchronisation: the host's cost of
  issuing the calls), :func:`event_us` (CUDA events: the GPU's time) and :func:`median_us` (the median of single
  calls, the slowest rank's);
* :func:`interleave` and :func:`medians`: the variants of a comparison timed round by round, so that a machine whose
  speed drifts during the run (clocks, other work) slows them all alike, and the median per variant;
* :func:`routed_tokens`: a dispatch's inputs (BF16 rows, top-k expert ids and weights) on the GPU,
  :func:`megatron_manager_overrides`: the dispatch settings the Megatron manager turns off, and
  :func:`resolver_fields`: what a checkout's configuration resolver takes (the current one or an older one);
* :func:`launch_costs_us`: the host's cost of the GPU's elementary operations (an eager kernel launch, a Triton
  launch, an event record, a stream wait), which turns counts of launches into microseconds;
* :func:`require_cuda` (a tool's refusal without a GPU) and :func:`build_or_reason` (a row whose configuration the
  package or Megatron refuses is reported with the reason, and the run goes on);
* :func:`process_group`: torchrun's ranks, or a 1-rank group of this process, with the NCCL communicator created
  before anything reuses it and NVLink multicast left off;
* :func:`setup_logging`: progress lines on stderr;
* :func:`provenance`: the git commit the numbers come from (and whether the tree had uncommitted changes), where
  that commit was read (``BENCH_GIT_REVISION``, the package's own git checkout, or unknown) and the date, for the JSON
  document, and :func:`software_versions`: the versions of the packages the numbers ran with;
* :func:`write_outputs`, with :func:`new_figure` (or :func:`new_panels`), :func:`grouped_bars` and
  :func:`save_figure`: the JSON document and its PNG plot (matplotlib, Agg backend; without matplotlib the JSON is
  written and a warning says how to get the plot).

This module imports neither torch nor the package at import time: ``bench_host_overhead.py`` drives other
checkouts of the package from processes that import it only once their checkout is on the path, and its driver
process never needs torch.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import os
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

logger = logging.getLogger("_bench")

#: A timed call: the step of one variant.
Step = Callable[[], object]

#: NVLink multicast off in NCCL, PyTorch and NVSHMEM: a program that uses it can take a shared host's GPUs out of
#: service. Set where unset; a value already in the environment is kept.
MULTICAST_OFF: dict[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

PLOT_HINT = "pip install 'megatron-deepepv2[bench]' (matplotlib) for it"

#: The passes only direct callers need, which the Megatron manager turns off
#: (:func:`megatron_deepepv2.mcore.manager.dispatch_config_for`): its ids come from ``torch.topk``, and nothing reads
#: other ranks' weights or the rows past the valid ones.
MEGATRON_MANAGER_OVERRIDES: dict[str, Any] = {"check_ids": False, "mask_foreign_weights": False, "clear_tail": False}


# ---------------------------------------------------------------------------------------------------- timers


def cuda_synchronize() -> None:
    """Waits for all work on the current CUDA device (the ``synchronize`` of the timers on a GPU)."""
    import torch  # noqa: PLC0415

    torch.cuda.synchronize()


def _us_per_call(fn: Step, calls: int, synchronize: Optional[Callable[[], None]], wait_in_clock: bool) -> float:
    """:func:`wall_us` (``wait_in_clock``: the final synchronisation inside the clock) or :func:`host_us`."""
    if synchronize is not None:
        synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if synchronize is not None and wait_in_clock:
        synchronize()
    elapsed = time.perf_counter() - start
    if synchronize is not None and not wait_in_clock:
        synchronize()
    return elapsed / calls * 1e6


def wall_us(fn: Step, calls: int, synchronize: Optional[Callable[[], None]] = None) -> float:
    """Wall-clock microseconds per call of ``calls`` back-to-back calls and one synchronisation at the end.

    Args:
        fn: The call to time.
        calls: Calls timed together; the host runs ahead of the device between them, as in training.
        synchronize: Waits for the device (:func:`cuda_synchronize` on a GPU): once before the clock starts, once
            after the last call inside the clock. None times host work alone.

    Returns:
        Microseconds per call.
    """
    return _us_per_call(fn, calls, synchronize, wait_in_clock=True)


def host_us(fn: Step, calls: int, synchronize: Optional[Callable[[], None]] = None) -> float:
    """Host microseconds per call to issue ``calls`` back-to-back calls: the clock stops before the device is waited
    for, so that a call's cost on the host is told from the device work it queues.

    Args:
        fn: The call to time.
        calls: Calls timed together (few enough that the device's launch queue does not fill up and block them).
        synchronize: Waits for the device, before the clock starts and after it stops; None for host work alone.

    Returns:
        Microseconds per call.
    """
    return _us_per_call(fn, calls, synchronize, wait_in_clock=False)


def event_us(fn: Step, calls: int = 1) -> float:
    """GPU microseconds per call between two CUDA events recorded around ``calls`` back-to-back calls.

    Args:
        fn: The call to time (it queues work on the current stream).
        calls: Calls between the two events.

    Returns:
        Microseconds per call, from the first event to the second (the device's time, including any gaps in
        which it waited for the host).
    """
    import torch  # noqa: PLC0415

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / calls


def max_over_ranks(value: float, cuda: bool) -> float:
    """The largest ``value`` of the ranks of the default process group (``value`` itself without one).

    Args:
        value: This rank's value.
        cuda: Reduce on the current CUDA device (NCCL) rather than the CPU (gloo).

    Returns:
        The maximum over the ranks.
    """
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device="cuda" if cuda else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def median_us(fn: Step, iters: int, warmup: int, *, cuda: bool) -> float:
    """Median microseconds of single calls of ``fn``, the slowest rank's.

    Each timed call starts after a barrier of the default process group (when there is one), so that every rank
    times the same collective; the median of each rank is then reduced to the largest.

    Args:
        fn: The call to time.
        iters: Timed calls.
        warmup: Untimed calls first (JIT compilation, allocator growth, lazy initialisation).
        cuda: Time each call with CUDA events (:func:`event_us`); else with the wall clock.

    Returns:
        The median over the timed calls, maximised over the ranks.
    """
    import torch.distributed as dist  # noqa: PLC0415

    grouped = dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        fn()
    if cuda:
        cuda_synchronize()
    samples = []
    for _ in range(iters):
        if grouped:
            dist.barrier()
        samples.append(event_us(fn) if cuda else wall_us(fn, 1))
    return max_over_ranks(statistics.median(samples), cuda)


# ------------------------------------------------------------------------------------------------ interleaving


def interleave(variants: Mapping[str, Step], timer: Callable[[Step], float], *, rounds: int, warmup: int = 0,
               settle: int = 0) -> dict[str, list[float]]:
    """Times every variant once per round, the variants in turn, for ``rounds`` rounds.

    A machine that changes speed during the run (clock boost, thermal limits, other processes) then slows every
    variant alike instead of the ones that happened to run at the slow moment.

    Args:
        variants: The calls to compare, by name (timed in this order within a round).
        timer: Times one variant once: the microseconds of one sample (e.g. ``lambda fn: wall_us(fn, 20,
            cuda_synchronize)``).
        rounds: Samples per variant.
        warmup: Untimed calls of each variant before the first round.
        settle: Untimed calls of a variant right before each of its samples: the first calls after another
            variant's find their code and data out of the CPU's caches and would charge whichever variant differs
            most from the one before it.

    Returns:
        Per variant, its samples in round order.
    """
    for fn in variants.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            for _ in range(settle):
                fn()
            samples[name].append(timer(fn))
    return samples


def medians(samples: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The median of each variant's samples.

    Args:
        samples: Per variant, its samples (from :func:`interleave`).

    Returns:
        Per variant, the median, in the order of ``samples``.
    """
    return {name: statistics.median(values) for name, values in samples.items()}


# ------------------------------------------------------------------------------------------------ inputs


def resolver_fields(package: Any) -> frozenset[str]:
    """The names a checkout's configuration resolver takes as keyword arguments.

    Args:
        package: The checkout's ``megatron_deepepv2`` module.

    Returns:
        With ``package.resolve_config``: the fields of ``DispatchConfig`` but ``settings``, and those of
        ``DeepepV2Settings``. Older checkouts resolve with ``DispatchConfig.resolve``: its named parameters, or the
        fields of ``DispatchConfig`` where it takes ``**overrides``.
    """
    config_fields = set(getattr(package.DispatchConfig, "__dataclass_fields__", {}))
    if hasattr(package, "resolve_config"):
        return frozenset((config_fields - {"settings"}) | set(package.DeepepV2Settings.__dataclass_fields__))
    parameters = inspect.signature(package.DispatchConfig.resolve).parameters
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()):
        return frozenset(config_fields)
    return frozenset(parameters)


def megatron_manager_overrides(package: Any) -> dict[str, Any]:
    """Of :data:`MEGATRON_MANAGER_OVERRIDES`, those the checkout's resolver takes (:func:`resolver_fields`; an older
    checkout may predate some of the switches).

    Args:
        package: The checkout's ``megatron_deepepv2`` module.

    Returns:
        Keyword arguments for the checkout's resolver (all three switches on the current tree).
    """
    accepted = resolver_fields(package)
    return {name: value for name, value in MEGATRON_MANAGER_OVERRIDES.items() if name in accepted}


def routed_tokens(tokens: int, hidden: int, experts: int, topk: int, seed: int = 0) -> tuple[Any, Any, Any]:
    """A dispatch's inputs on the current CUDA device: BF16 hidden states, top-k expert ids (distinct per token, from
    uniform scores) and their fp32 weights.

    Args:
        tokens: Tokens (rows).
        hidden: Hidden size.
        experts: Global experts.
        topk: Experts per token.
        seed: Seed of the device generator that draws them.

    Returns:
        ``x`` ``[tokens, hidden]`` BF16, ``topk_idx`` ``[tokens, topk]`` int64 and ``topk_weights`` ``[tokens, topk]``
        fp32, all contiguous.
    """
    import torch  # noqa: PLC0415

    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weights, idx = torch.rand(tokens, experts, device="cuda", generator=gen).topk(topk, dim=1)
    return x, idx.contiguous(), weights.float().contiguous()


# ---------------------------------------------------------------------------------------- GPU launch costs


@functools.cache
def _triton_noop() -> Callable[[Any], None]:
    """A launcher of a Triton kernel that does nothing (compiled on first launch)."""
    import triton  # noqa: PLC0415

    @triton.jit
    def _noop(ptr):  # noqa: ARG001 - a kernel must take an argument to be launched with one
        pass

    def launch(tensor: Any) -> None:
        _noop[(1,)](tensor)

    return launch


def launch_costs_us(calls: int = 200, rounds: int = 15) -> dict[str, float]:
    """Host microseconds per call of the GPU's elementary operations, on the current device and stream.

    * ``eager_launch``: ``torch.add(a, b, out=c)`` of two small CUDA tensors: one kernel through PyTorch's
      dispatcher, the least an eager op costs;
    * ``triton_launch``: a Triton kernel that does nothing (the launch path of the package's own kernels);
    * ``event_record``: ``torch.cuda.Event.record()`` of an existing event;
    * ``event_create_record``: a new event recorded (what DeepEP's ``capture()`` does per call);
    * ``stream_wait_event``: ``torch.cuda.current_stream().wait_event(event)``.

    Each is the median over ``rounds`` interleaved rounds of ``calls`` back-to-back calls (:func:`host_us`).

    Args:
        calls: Calls per sample.
        rounds: Samples per operation.

    Returns:
        Microseconds per call, by operation.
    """
    import torch  # noqa: PLC0415

    a, b, out = (torch.ones(16, device="cuda") for _ in range(3))
    event = torch.cuda.Event()
    event.record()
    triton_noop = _triton_noop()

    def create_and_record() -> None:
        torch.cuda.Event().record()

    operations: dict[str, Step] = {
        "eager_launch": lambda: torch.add(a, b, out=out),
        "triton_launch": lambda: triton_noop(out),
        "event_record": event.record,
        "event_create_record": create_and_record,
        "stream_wait_event": lambda: torch.cuda.current_stream().wait_event(event),
    }
    timer = functools.partial(host_us, calls=calls, synchronize=cuda_synchronize)
    return medians(interleave(operations, timer, rounds=rounds, warmup=calls))


def build_or_reason(name: str, build: Callable[[], Any], not_run: dict[str, str]) -> Any:
    """Builds what a benchmark row times, or records why its configuration is refused.

    A ``ValueError`` or ``TypeError`` from the constructor is a configuration the package or Megatron refuses by
    design (and says why): the row is reported as not run and the run goes on. Anything else propagates.

    Args:
        name: The row.
        build: Builds it.
        not_run: Gets ``name`` -> the reason when the build is refused.

    Returns:
        What ``build`` returned, or None when it was refused.
    """
    try:
        return build()
    except (ValueError, TypeError) as error:
        not_run[name] = f"{type(error).__name__}: {error}"
        logger.info("   %-36s not run: %s", name, not_run[name].splitlines()[0])
        return None


def require_cuda(parser: argparse.ArgumentParser, what: str = "a CUDA GPU") -> None:
    """Exits through ``parser.error`` (status 2, the reason on stderr) where no CUDA device is visible.

    Args:
        parser: The tool's argument parser.
        what: What the tool needs, as the message names it (``needs <what>``).
    """
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        parser.error(f"needs {what}")


# --------------------------------------------------------------------------------------------- process group


def keep_multicast_off() -> None:
    """Sets :data:`MULTICAST_OFF` in this process's environment where unset (children inherit it)."""
    for name, value in MULTICAST_OFF.items():
        os.environ.setdefault(name, value)


@contextlib.contextmanager
def process_group(backend: str = "nccl", *, one_rank: bool = False) -> Iterator[int]:
    """The default process group for the benchmark's lifetime.

    Under torchrun (``RANK`` and ``WORLD_SIZE`` set) the launcher's ranks, one GPU each (``LOCAL_RANK``);
    otherwise a 1-rank group of this process on an in-process store (no port to pick). With NCCL the device is
    bound at start-up (``device_id``) and one all-reduce runs at once, so that the communicator exists before
    anything reuses it: DeepEP's ElasticBuffer builds on the group's NCCL communicator, and PyTorch otherwise creates
    it lazily, at the first collective. NVLink multicast stays off (:func:`keep_multicast_off`).

    Args:
        backend: ``"nccl"`` (one GPU per rank) or ``"gloo"`` (CPU).
        one_rank: A 1-rank group of this process even under torchrun.

    Yields:
        This process's rank.
    """
    keep_multicast_off()
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    kwargs: dict[str, Any] = {}
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    if one_rank or not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
    dist.init_process_group(backend, **kwargs)
    try:
        dist.all_reduce(torch.zeros(1, device=device))
        yield dist.get_rank()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------------- logging


def setup_logging(rank: int = 0, *, all_ranks: bool = False) -> None:
    """Progress lines on stderr, with the time of day: INFO on rank 0, WARNING on the others.

    Args:
        rank: This process's rank.
        all_ranks: INFO on every rank, each line naming its rank.
    """
    prefix = f"rank {rank} " if all_ranks else ""
    logging.basicConfig(level=logging.INFO if rank == 0 or all_ranks else logging.WARNING,
                        format=f"%(asctime)s {prefix}%(message)s", datefmt="%H:%M:%S")


# ------------------------------------------------------------------------------------------------ provenance


#: Where a benchmark runs on a copy of the tree without ``.git``: the commit it was copied from, as ``<hash>`` or
#: ``<hash>-dirty`` (uncommitted changes to tracked files), read by :func:`provenance`.
REVISION_ENV = "BENCH_GIT_REVISION"

#: What a checkout of this package holds at its root: :func:`provenance` trusts git only where git's top level is
#: such a folder, the one the described path lies in.
CHECKOUT_MARKERS = ("tools", "megatron_deepepv2")


def _git(root: str, *args: str) -> Optional[str]:
    """``git <args>``'s output in ``root``, or None where git or the checkout is missing or it fails."""
    try:
        # No optional locks: a benchmark must not hold the index lock of a tree others work in.
        done = subprocess.run(["git", "--no-optional-locks", "-C", root, *args], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def checkout_root(path: Optional[str] = None) -> Optional[str]:
    """The root of the copy of the package that holds ``path``: the nearest folder, ``path``'s own or above it, that
    holds ``tools/`` and ``megatron_deepepv2/`` (:data:`CHECKOUT_MARKERS`).

    Args:
        path: A file or folder (default: this file, whose root is the parent of ``tools/``).

    Returns:
        The folder's real path, or None when no folder above ``path`` looks like a copy of the package.
    """
    here = os.path.realpath(path or __file__)
    folder = here if os.path.isdir(here) else os.path.dirname(here)
    while True:
        if all(os.path.isdir(os.path.join(folder, name)) for name in CHECKOUT_MARKERS):
            return folder
        parent = os.path.dirname(folder)
        if parent == folder:
            return None
        folder = parent


def provenance(path: Optional[str] = None) -> dict[str, Any]:
    """What a benchmark's numbers come from: the git commit of the package's checkout, whether it had uncommitted
    changes, where the commit was read, and the date.

    The commit is never another repository's: a copy of the package without its own ``.git`` placed inside some
    other git repository would otherwise be stamped with that repository's commit. So git is asked only where its
    top level (``git rev-parse --show-toplevel``) is the package's own root (:func:`checkout_root`).

    Args:
        path: A file or folder in the checkout (default: this file's).

    Returns:
        ``git_commit`` (short hash, or None when unknown), ``git_dirty`` (uncommitted changes to tracked files;
        untracked files do not count; None when unknown), ``commit_source`` and ``date`` (UTC, ISO 8601).
        ``commit_source`` says where the commit came from: ``"BENCH_GIT_REVISION"`` (:data:`REVISION_ENV`, as
        ``<hash>`` or ``<hash>-dirty``, which wins when set: a remote machine's copy of the working tree may carry the
        ``.git`` of an earlier commit, or none), ``"git"`` (the package's own checkout) or ``"unknown"`` (no setting,
        and no git checkout whose top level is the package's root).
    """
    commit: Optional[str] = None
    dirty: Optional[bool] = None
    source = "unknown"
    value = os.environ.get(REVISION_ENV, "").strip()
    if value:
        commit, dirty, source = value.removesuffix("-dirty"), value.endswith("-dirty"), REVISION_ENV
    else:
        root = checkout_root(path)
        toplevel = _git(root, "rev-parse", "--show-toplevel") if root else None
        if root and toplevel and os.path.realpath(toplevel) == root:
            commit = _git(root, "rev-parse", "--short", "HEAD")
            if commit:
                source = "git"
                status = _git(root, "status", "--porcelain", "--untracked-files=no")
                dirty = None if status is None else bool(status)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"git_commit": commit, "git_dirty": dirty, "commit_source": source, "date": date}


#: The distributions whose versions a record names (:func:`software_versions`).
RECORDED_PACKAGES = ("torch", "megatron-core", "deep_ep", "transformer_engine", "megatron-deepepv2")


def software_versions(packages: Sequence[str] = RECORDED_PACKAGES) -> dict[str, Optional[str]]:
    """The installed versions of ``packages`` (None where one is not installed) and, with CUDA, the NCCL PyTorch
    loaded (``"nccl"``).

    Args:
        packages: Distribution names.

    Returns:
        ``{name: version or None}``.
    """
    versions: dict[str, Optional[str]] = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    import torch  # noqa: PLC0415  (not at import time: see the module docstring)

    if torch.cuda.is_available():
        from megatron_deepepv2.backends.deepep.probes import runtime_nccl_version  # noqa: PLC0415

        loaded = runtime_nccl_version()  # not torch.cuda.nccl.version(): the NCCL torch was built with
        versions["nccl"] = ".".join(map(str, loaded)) if loaded else None
    return versions


# --------------------------------------------------------------------------------------------------- outputs


def new_figure(width: float, height: float) -> tuple["Figure", "Axes"]:
    """A figure with one axes on matplotlib's Agg backend (no display needed).

    Args:
        width: Inches.
        height: Inches.

    Returns:
        The figure and its axes.

    Raises:
        ImportError: matplotlib is not installed.
    """
    return _pyplot().subplots(figsize=(width, height))


def new_panels(width: float, height: float, columns: int) -> tuple["Figure", list["Axes"]]:
    """A figure with ``columns`` axes side by side, as :func:`new_figure` makes one.

    Args:
        width: Inches.
        height: Inches.
        columns: Axes, left to right.

    Returns:
        The figure and its axes, in order.

    Raises:
        ImportError: matplotlib is not installed.
    """
    fig, axes = _pyplot().subplots(1, columns, squeeze=False, figsize=(width, height))
    return fig, list(axes[0])


def _pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def grouped_bars(ax: "Axes", groups: Sequence[str], series: Mapping[str, Sequence[float]], *,
                 value_format: Optional[str] = None, fontsize: float = 8, legend_columns: int = 1) -> None:
    """Bars of several series side by side in each group, the groups' labels centred under them, and a legend.

    Args:
        ax: Where to draw.
        groups: One label per group (the x axis).
        series: Per series (the legend), one value per group.
        value_format: Writes each bar's value above it in this %-format (e.g. ``"%.2f"``); None writes none.
        fontsize: Of the group labels and the legend.
        legend_columns: Columns of the legend.
    """
    width = 0.8 / max(len(series), 1)
    for k, (name, values) in enumerate(series.items()):
        bars = ax.bar([i + k * width for i in range(len(groups))], list(values), width, label=name)
        if value_format is not None:
            ax.bar_label(bars, fmt=value_format, fontsize=fontsize - 1)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], list(groups), fontsize=fontsize)
    ax.legend(fontsize=fontsize, ncol=legend_columns)


def save_figure(fig: "Figure", path: str) -> None:
    """Lays ``fig`` out tightly, writes it to ``path`` as a PNG (120 dpi) and closes it.

    Args:
        fig: The figure.
        path: The PNG file.
    """
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: str, name: str, document: Any, plot: Optional[Callable[[Any, str], None]] = None) -> None:
    """Writes ``<out>/<name>.json`` and, with ``plot``, ``<out>/<name>.png``.

    Benchmarks call this after each part of a run, so that a run cut short keeps what it measured. Without
    matplotlib the JSON is still written and a warning says how to get the plot.

    Args:
        out: Output folder (created if missing).
        name: File name without extension.
        document: What the JSON file holds (JSON-serialisable).
        plot: Draws ``document`` into the PNG file it is given (with :func:`new_figure` and :func:`save_figure`);
            None writes no plot.
    """
    os.makedirs(out, exist_ok=True)
    json_path = os.path.join(out, f"{name}.json")
    with open(json_path, "w") as f:
        json.dump(document, f, indent=1)
    logger.info("wrote %s", json_path)
    if plot is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("no plot: matplotlib is not installed; %s.", PLOT_HINT)
        return
    png_path = os.path.join(out, f"{name}.png")
    plot(document, png_path)
    logger.info("wrote %s", png_path)
