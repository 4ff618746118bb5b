"""Every figure the docs quote from a JSON of ``docs/`` is the JSON's value, rounded as the doc writes it.

``FIGURES`` lists the quoted figures: the doc, the text as the doc writes it with a format field (``{:.1f}``,
``{:,.0f}``, ...) where each figure stands, and for each field where its value comes from: a path into a JSON
(:func:`J`) or a figure computed from such values (a ratio of two medians, the median of runs, a range over rows).
The test computes each value from the JSON, formats it with the field's format spec (the rounding rule) and asserts
that the doc contains the text, whitespace and line breaks aside. Each figure's JSONs must be named by its doc, and
every ``docs/*.json`` that a doc names must exist.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Callable, Iterable

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

# JSON names in docs that are not files of docs/: what a command writes where it is run.
NOT_IN_DOCS = {
    "bench.json",  # tools/bench.py --out DIR (usage.md)
    "megatron-deepepv2-wheels.json",  # the installer's --wheel-dir (install-deepep.md)
}


# --- reading the docs and the JSONs ---------------------------------------------------------------------------------

def _normalised(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@cache
def doc_text(doc: str) -> str:
    """A doc's text (``README.md`` at the root, anything else under ``docs/``), whitespace runs as one space."""
    path = ROOT / doc if doc == "README.md" else DOCS / doc
    return _normalised(path.read_text())


@cache
def load(name: str) -> Any:
    """A JSON of ``docs/``, parsed."""
    return json.loads((DOCS / name).read_text())


def _expand_braces(name: str) -> list[str]:
    """``a{1,2}.json`` -> ``a1.json``, ``a2.json``; ``a{1..3}.json`` -> ``a1.json`` ... ``a3.json``."""
    match = re.search(r"\{([^{}]*)\}", name)
    if not match:
        return [name]
    body = match.group(1)
    if re.fullmatch(r"\d+\.\.\d+", body):
        first, last = (int(part) for part in body.split(".."))
        choices = [str(i) for i in range(first, last + 1)]
    else:
        choices = body.split(",")
    return [expanded for choice in choices
            for expanded in _expand_braces(name[:match.start()] + choice + name[match.end():])]


def named_jsons(text: str) -> set[str]:
    """The names of ``docs/`` JSONs a text names (``docs/x.json``, ``x.json``, ``x_run{1,2}.json``).

    Names under another folder (``runs/.../x.json``) and ``.jsonl`` / ``.json.gz`` files are not ``docs/`` JSONs.
    """
    names = set()
    for match in re.finditer(r"(?<![\w./{},-])((?:[\w./-]|\{[\w.,]+\})+\.json)(?![\w]|\.\w)", text):
        path = match.group(1)
        folder, _, name = path.rpartition("/")
        if folder not in ("", "docs"):
            continue
        names.update(_expand_braces(name))
    return names - NOT_IN_DOCS


# --- where a figure comes from --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """A figure's value: read from JSONs of ``docs/`` or computed from other sources.

    Attributes:
        files: The JSONs the value comes from.
        compute: Returns the value.
    """

    files: frozenset[str]
    compute: Callable[[], Any]

    def value(self) -> Any:
        """The value, read or computed now."""
        return self.compute()


def _files(sources: Iterable[Source]) -> frozenset[str]:
    return frozenset().union(*(source.files for source in sources))


def _step(node: Any, key: Any) -> Any:
    if isinstance(key, dict):
        matches = [item for item in node if all(item.get(k) == v for k, v in key.items())]
        assert len(matches) == 1, f"{key} selects {len(matches)} elements"
        return matches[0]
    return node[key]


def J(file: str, *path: Any) -> Source:
    """The value at ``path`` in ``docs/<file>``.

    Args:
        file: The JSON's name under ``docs/``.
        *path: Dict keys, list indices, or a dict that selects the one list element whose fields have its values.
    """
    def read() -> Any:
        node = load(file)
        for key in path:
            node = _step(node, key)
        return node
    return Source(frozenset({file}), read)


def calc(function: Callable[..., Any], *sources: Source) -> Source:
    """``function`` of the sources' values."""
    return Source(_files(sources), lambda: function(*(source.value() for source in sources)))


def ratio(a: Source, b: Source) -> Source:
    """a / b."""
    return calc(lambda x, y: x / y, a, b)


def difference(a: Source, b: Source) -> Source:
    """a - b."""
    return calc(lambda x, y: x - y, a, b)


def percent(a: Source, b: Source) -> Source:
    """a as a percentage of b."""
    return calc(lambda x, y: 100 * x / y, a, b)


def change(a: Source, b: Source) -> Source:
    """a against b as a signed percentage (+4.9 for 4.9% more)."""
    return calc(lambda x, y: 100 * (x / y - 1), a, b)


def scaled(a: Source, factor: float) -> Source:
    """a * factor (units: bytes to MiB, a fraction to a percentage)."""
    return calc(lambda x: x * factor, a)


def rounded(a: Source, digits: int) -> Source:
    """a rounded to ``digits`` (negative: to tens, hundreds, thousands)."""
    return calc(lambda x: round(x, digits), a)


def median(*sources: Source) -> Source:
    """The median of the values."""
    return calc(lambda *xs: statistics.median(xs), *sources)


def lowest(*sources: Source) -> Source:
    """The smallest value."""
    return calc(lambda *xs: min(xs), *sources)


def highest(*sources: Source) -> Source:
    """The largest value."""
    return calc(lambda *xs: max(xs), *sources)


def total(*sources: Source) -> Source:
    """The sum of the values."""
    return calc(lambda *xs: sum(xs), *sources)


def number_in(a: Source, pattern: str) -> Source:
    """The number that ``pattern``'s first group matches in the text value a."""
    def find(text: str) -> float:
        match = re.search(pattern, text)
        assert match, f"{pattern!r} not in {text!r}"
        return float(match.group(1))
    return calc(find, a)


def short_e(x: float) -> str:
    """x with two significant digits in the docs' scientific notation: ``1.3e-4``."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def spread(*sources: Source) -> Source:
    """(largest - smallest) / median, in percent: how far runs of one configuration lie apart."""
    return calc(lambda *xs: 100 * (max(xs) - min(xs)) / statistics.median(xs), *sources)


@dataclass(frozen=True)
class Figure:
    """Figures as one doc quotes them.

    Attributes:
        doc: The doc (under ``docs/``, or ``README.md``).
        text: The doc's text with a format field for each figure; the field's spec is its rounding rule.
        values: A source per field, in order.
        named_in: The doc that names the JSONs, where ``doc`` quotes them and links that doc instead.
    """

    doc: str
    text: str
    values: tuple[Source, ...]
    named_in: str | None = None

    def expected(self) -> str:
        """The text with the values computed from the JSONs."""
        return _normalised(self.text.format(*(source.value() for source in self.values)))


def fig(doc: str, text: str, *values: Source, named_in: str | None = None) -> Figure:
    """A :class:`Figure`."""
    return Figure(doc, text, values, named_in)


def row(*cells: str) -> str:
    """A markdown table row of the cells."""
    return "| " + " | ".join(cells) + " |"


# --- the JSONs ------------------------------------------------------------------------------------------------------

FP8 = "bench_fp8_h200_ep1.json"
EP2 = "bench_T4096_H4096_E64_bf16.json"
EP2_FP8 = "bench_T8192_H7168_E128_fp8.json"
SWEEP = "bench_sm_sweep_T4096_H4096_E64_bf16.json"
EXPERTS = "bench_experts.json"
ACTIVATIONS = "bench_experts_activations.json"
INSTRUCTIONS = "bench_host_instructions.json"
HOST_TIME = "bench_host_overhead.json"
SPLIT_INSTRUCTIONS = "bench_host_instructions_636a68a_bc20054.json"
#: The same measure before and after DeepEP's calls stood apart from its build, run twice.
ADAPTER_INSTRUCTIONS = ("bench_host_instructions_7ecbfeb_e8e0cfa.json",
                        "bench_host_instructions_7ecbfeb_e8e0cfa_second_run.json")
STATE_INSTRUCTIONS = ("bench_host_instructions_0513fe7_6d52e47.json",
                      "bench_host_instructions_0513fe7_6d52e47_second_run.json")
HOT = "bench_hot_path_h200_ep1.json"
HOT_SECOND = "bench_hot_path_h200_ep1_t4096_second_run.json"
CHECKS = "bench_checks.json"
SOAK = "soak_buffers.json"
INSTALL = "install_deepep_h200.json"
FUNCTIONAL = "functional_h200_ep1.json"
ROUNDS = "training_rounds_gpt_moe_h200_ep1.json"
FIRST_MACHINE = "training_rounds_gpt_moe_h200_ep1_first_machine.json"
QWEN3 = "training_rounds_qwen3_moe_router_h200_ep1.json"
TRACE_GPT = "training_trace_h200_ep1_gpt_moe.json"
TRACE_DSV3 = "training_trace_h200_ep1_deepseek_v3_router.json"
UNTRACED = "training_untraced_h200_ep1_gpt_moe.json"
TRAINING = "training_h200_ep1.json"
DET_GRAPHS = "training_deterministic_graphs_h200_ep1.json"
DET_ORDER = "deterministic_order_h200_ep1.json"
MEMORY = "memory_deepseek_v3.json"
FP8_SIZING = "fp8_sizing_h200_ep1.json"
CONFORMANCE = "megatron_conformance_h200_ep1.json"
COMPARE = "compare_dispatchers_h200_ep1.json"
COMPARE_GRAPHS = "compare_dispatchers_graphs_h200_ep1.json"

# Keys inside them.
NCCL_WHEEL = "megatron_deepepv2_nccl-2.30.7+sm90-py3-none-linux_x86_64.whl"
DEEP_EP_WHEEL = "deep_ep-2.1.0+local-cp312-cp312-linux_x86_64.whl"
EXPERT_SHAPES = ("E32 H4096 F1024", "E128 H7168 F2048")

# The hot path before and after the library/tools split, and before and after the one-declaration refactor: one
# JSON per run, the tree in the name.
SPLIT_BEFORE = [f"bench_hot_path_quick_636a68a_round{i}.json" for i in range(1, 9)]
SPLIT_AFTER = [f"bench_hot_path_quick_6f8e512_round{i}.json" for i in range(1, 7)]
SPLIT_FINAL = [f"bench_hot_path_quick_bc20054_round{i}.json" for i in (1, 2)]
REFACTOR_BEFORE = [f"bench_hot_path_quick_2212132_run{i}.json" for i in (1, 2)]
REFACTOR_AFTER = [f"bench_hot_path_quick_dcc627c_run{i}.json" for i in (1, 2)]
REFACTOR_SECOND = ["bench_hot_path_quick_7f8fcdd_run1.json", "bench_hot_path_quick_2212132_run3.json",
                   "bench_hot_path_quick_7f8fcdd_run2.json"]
OPS = ["ops_manager", "ops_manager_streams", "ops_defaults", "ops_no_host_sync"]


def hot(file: str, layout: str, variant: str, label: str | None = None) -> Source:
    """A time of ``tools/bench_hot_path.py``: a variant's row (``layer``: the dispatcher path), us per step."""
    if layout == "layer":
        return J(file, "dispatcher_paths", variant)
    select = {"layout": layout} if label is None else {"layout": layout, "label": label}
    return J(file, "rows", select, "times_us", variant)


def hot_ratio(file: str, layout: str, name: str, label: str | None = None) -> Source:
    """A ratio as ``tools/bench_hot_path.py`` names it (``a/b``), recomputed from the row's two times."""
    a, b = name.split("/")
    return ratio(hot(file, layout, a, label), hot(file, layout, b, label))


def over_runs(files: list[str], layout: str, variant: str) -> list[Source]:
    """A variant's time in each run."""
    return [hot(file, layout, variant) for file in files]


def median_min_max(sources: list[Source]) -> tuple[Source, Source, Source]:
    """Median, smallest and largest: the doc's ``median (min-max)``."""
    return median(*sources), lowest(*sources), highest(*sources)


def fp8_row(model: str, label: str, tokens: int, layout: str) -> Figure:
    """A row of the FP8 cost table, from ``bench_fp8_h200_ep1.json``."""
    def field(name: str) -> Source:
        return J(FP8, "rows", {"model": model, "tokens": tokens, "layout": layout}, name)
    return fig("benchmarks.md",
               row(label, str(tokens), layout, "{:,}", "{:.1f} ({:,.1f})", "{:.1f} ({:,.1f})", "{:.1f}", "{:.1f}%"),
               field("recv_rows"), field("quantize_us"), field("quantize_torch_us"), field("dequantize_us"),
               field("dequantize_torch_us"), field("dispatch_combine_us"),
               percent(total(field("quantize_us"), field("dequantize_us")), field("dispatch_combine_us")))


FP8_ROWS = [(model, label, tokens, layout)
            for model, label in [("deepseek-v3", "DeepSeek-V3 (7168)"), ("qwen3-30b-a3b", "Qwen3-30B-A3B (2048)"),
                                 ("mixtral-8x7b", "Mixtral-8x7B (4096)")]
            for tokens in (4096, 8192) for layout in ("compact", "expand")]


def fp8_all(name: str, hidden_at_least: int = 0) -> list[Source]:
    """A field of every row of the FP8 cost table (rows with at least the hidden size given)."""
    return [J(FP8, "rows", {"model": model, "tokens": tokens, "layout": layout}, name)
            for model, _, tokens, layout in FP8_ROWS
            if {"deepseek-v3": 7168, "qwen3-30b-a3b": 2048, "mixtral-8x7b": 4096}[model] >= hidden_at_least]


def fp8_overheads(hidden_at_least: int) -> list[Source]:
    """Quantise + dequantise against dispatch + combine, percent, per row."""
    return [percent(total(q, d), c) for q, d, c in zip(fp8_all("quantize_us", hidden_at_least),
                                                       fp8_all("dequantize_us", hidden_at_least),
                                                       fp8_all("dispatch_combine_us", hidden_at_least))]


def torch_over_fused() -> list[Source]:
    """PyTorch ops' time against the fused kernels', quantise and dequantise of every row."""
    return ([ratio(t, f) for t, f in zip(fp8_all("quantize_torch_us"), fp8_all("quantize_us"))]
            + [ratio(t, f) for t, f in zip(fp8_all("dequantize_torch_us"), fp8_all("dequantize_us"))])


def split_row(layout: str, variant: str) -> Figure:
    """A row of the library/tools split table: median (min-max) of each tree's runs, bc20054's runs beside 636a68a's
    last two."""
    return fig("benchmarks.md",
               row(layout, f"`{variant}`", "{:.0f} ({:.0f}-{:.0f})", "{:.0f} ({:.0f}-{:.0f})", "{:.0f}, {:.0f}",
                   "{:.0f}, {:.0f}"),
               *median_min_max(over_runs(SPLIT_BEFORE, layout, variant)),
               *median_min_max(over_runs(SPLIT_AFTER, layout, variant)),
               *over_runs(SPLIT_FINAL, layout, variant), *over_runs(SPLIT_BEFORE[6:], layout, variant))


def split_op_ratios() -> list[Source]:
    """6f8e512's median over 636a68a's median, for every ``ops_*`` row."""
    return [ratio(median(*over_runs(SPLIT_AFTER, layout, variant)), median(*over_runs(SPLIT_BEFORE, layout, variant)))
            for layout in ("compact", "expand") for variant in OPS]


def split_target(files: list[str], layout: str) -> tuple[Source, Source, Source]:
    """``ops_manager_streams/raw_autograd`` within each run: median (min-max) over the runs."""
    return median_min_max([hot_ratio(file, layout, "ops_manager_streams/raw_autograd") for file in files])


def final_faster_cells() -> Source:
    """How many ``ops_*`` cells the two bc20054 runs took less time in, summed, than the two 636a68a runs beside."""
    cells = [(total(*over_runs(SPLIT_FINAL, layout, variant)), total(*over_runs(SPLIT_BEFORE[6:], layout, variant)))
             for layout in ("compact", "expand") for variant in OPS]
    return calc(lambda *xs: sum(a < b for a, b in zip(xs[::2], xs[1::2])), *(s for cell in cells for s in cell))


def refactor_row(layout: str, variant: str) -> Figure:
    """A row of the one-declaration refactor table: both runs of each tree, and the mean of after / before of run 1
    and of run 2."""
    before, after = over_runs(REFACTOR_BEFORE, layout, variant), over_runs(REFACTOR_AFTER, layout, variant)
    return fig("benchmarks.md", row(layout, f"`{variant}`", "{:.0f}, {:.0f}", "{:.0f}, {:.0f}", "{:.2f}"),
               *before, *after, scaled(total(*[ratio(a, b) for a, b in zip(after, before)]), 1 / len(after)))


def run_ratios(files: list[str], name: str, layouts: Iterable[str] = ("compact", "expand")) -> list[Source]:
    """A ratio as ``tools/bench_hot_path.py`` names it, in each run and layout, in run order."""
    return [hot_ratio(file, layout, name) for file in files for layout in layouts]


def min_max(sources: list[Source]) -> tuple[Source, Source]:
    """The smallest and the largest: the doc's ``min-max``."""
    return lowest(*sources), highest(*sources)


def refactor_second_row(layout: str, variant: str) -> Figure:
    """A row of the refactor's second round: after, before, after."""
    return fig("benchmarks.md", row(layout, f"`{variant}`", "{:.0f}", "{:.0f}", "{:.0f}"),
               *over_runs(REFACTOR_SECOND, layout, variant))


HOT_LABELS = [("T4096 H4096", HOT, "T4096 H4096 E64 top8"), ("T1024 H4096", HOT, "T1024 H4096 E64 top8"),
              ("T16384 H4096", HOT, "T16384 H4096 E64 top8"), ("T4096 H7168", HOT, "T4096 H7168 E64 top8"),
              ("T4096 H4096, second run", HOT_SECOND, "T4096 H4096 E64 top8")]
HOT_VARIANTS = ["raw", "raw_autograd", "ops_manager", "ops_manager_streams", "ops_defaults", "ops_no_host_sync",
                "graph_replay", "kernel_time"]
HOT_TARGETS = ["ops_manager_streams/raw_autograd", "ops_defaults/raw_autograd", "ops_no_host_sync/ops_manager",
               "graph_replay/kernel_time"]
HOT_REPORTED = ["ops_manager/raw", "raw_autograd/raw", "ops_manager_streams/ops_manager"]


def hot_times_row(doc_label: str, file: str, label: str, layout: str) -> Figure:
    """A row of the hot path's times table."""
    return fig("benchmarks.md", row(doc_label, layout, *["{:.0f}"] * len(HOT_VARIANTS)),
               *[hot(file, layout, variant, label) for variant in HOT_VARIANTS])


def hot_ratios_row(doc_label: str, file: str, label: str, layout: str) -> Figure:
    """A row of the hot path's ratios table; a target ratio above its limit is written ``**x.xx missed**``."""
    def target(value: float, limit: float) -> str:
        return f"**{value:.2f} missed**" if round(value, 2) > limit else f"{value:.2f}"
    targets = [calc(target, hot_ratio(file, layout, name, label), J(file, "targets", name)) for name in HOT_TARGETS]
    reported = [hot_ratio(file, layout, name, label) for name in HOT_REPORTED]
    return fig("benchmarks.md", row(doc_label, layout, *["{}"] * len(targets), *["{:.2f}"] * len(reported)),
               *targets, *reported)


def hot_all(name: str, runs: list[tuple[str, str, str]] = HOT_LABELS) -> list[Source]:
    """A ratio of every row of the hot path tables."""
    return [hot_ratio(file, layout, name, label) for _, file, label in runs for layout in ("compact", "expand")]


def profile(layout: str, variant: str, name: str) -> Source:
    """A figure of the profiled T4096 H4096 step (``profiles`` in the first run's JSON)."""
    return J(HOT, "rows", {"label": "T4096 H4096 E64 top8", "layout": layout}, "profiles", variant, name)


PROFILED = ["raw", "raw_no_host_sync", "raw_autograd", "ops_manager", "ops_manager_streams", "ops_no_host_sync"]


CHECK_SHAPES = [(4096, 256, 8), (8192, 256, 8), (4096, 128, 8), (8192, 128, 8), (4096, 8, 2), (8192, 8, 2)]


def check_rows(name: str) -> list[Source]:
    """A field of every row of ``bench_checks.json`` (tokens, experts, top-k of each in ``CHECK_SHAPES``)."""
    return [J(CHECKS, "rows", {"tokens": tokens, "experts": experts, "top_k": top_k}, name)
            for tokens, experts, top_k in CHECK_SHAPES]


def check_row(tokens: int, experts: int, top_k: int) -> Figure:
    """A row of the default-checks table."""
    def field(name: str) -> Source:
        return J(CHECKS, "rows", {"tokens": tokens, "experts": experts, "top_k": top_k}, name)
    return fig("benchmarks.md",
               row(f"{tokens}, {experts}, {top_k}", "{:.1f} us", "{:.1f} us ({:.1f} + {:.1f})", "{:.1f} us",
                   "{:.0f} us"),
               field("device_check_device_us"), field("device_check_host_us"), field("kernel_launch_host_us"),
               field("assert_launch_host_us"), field("static_checks_host_us"), field("validate_check_wall_us"))


def layer_instructions(file: str, tree: str, variant: str, digits: int = 1) -> Source:
    """Instructions per step above bare tensor ops: thousands (``digits`` 1) or instructions (``digits`` 0)."""
    source = J(file, tree, variant, "layer_instructions")
    return scaled(source, 1e-3) if digits else source


def two_runs_before_and_after(files: tuple[str, str]) -> list[Source]:
    """The figures of a two-run instruction comparison, in the order its paragraph says them: per ops variant (the
    Megatron configuration, the direct-call defaults, settings resolved per call) and run, the layer instructions
    before, after and the change; then the change of ``autograd_floor`` in each run."""
    def layer(file: str, tree: str, variant: str) -> Source:
        return layer_instructions(file, tree, variant, 0)

    return [*[source for variant in ("ops_megatron_config", "ops_config", "ops_resolved_per_call") for file in files
              for source in (layer(file, "before", variant), layer(file, "now", variant),
                             change(layer(file, "now", variant), layer(file, "before", variant)))],
            *[change(layer(file, "now", "autograd_floor"), layer(file, "before", "autograd_floor")) for file in files]]


def round_time(file: str, run: str) -> Source:
    """A training run's step time, the median of its timed steps (ms)."""
    return J(file, "runs", {"run": run}, "median_step_ms")


def rounds_row(label: str, experts: str) -> Figure:
    """A row of the gpt-moe rounds table: each round, the median, the spread."""
    each = [round_time(ROUNDS, f"{label}#{i}") for i in (1, 2, 3)]
    return fig("training.md", row(f"`{label}`", f"`{experts}`", "{:.1f}, {:.1f}, {:.1f}", "{}", "{:.1f}%"),
               *each, calc(lambda x: f"**{x:.1f}**" if label == "deepepv2-nohostsync-graphs" else f"{x:.1f}",
                           median(*each)),
               spread(*each))


def rounds_ratios(file: str, run: str, baseline: str, rounds: Iterable[int] = (1, 2, 3)) -> list[Source]:
    """A run's step time over the baseline's, within each round."""
    return [ratio(round_time(file, f"{run}#{i}"), round_time(file, f"{baseline}#{i}")) for i in rounds]


def rounds_ratio_row(run: str, baseline: str, middle: str, bold: bool) -> Figure:
    """A row of the rounds' ratio table, up to its target column."""
    ratios = rounds_ratios(ROUNDS, run, baseline)
    central = "**{:.3f}** ({:.3f}-{:.3f})" if bold else "{:.3f} ({:.3f}-{:.3f})"
    return fig("training.md", f"| `{run}` / `{baseline}`{middle} | {{:.3f}}, {{:.3f}}, {{:.3f}} | {central} |",
               *ratios, *median_min_max(ratios))


def trace(file: str, dispatcher: str, *path: str) -> Source:
    """A figure of a traced step's summary."""
    return J(file, "summaries", dispatcher, *path)


def python_ms(file: str, dispatcher: str, frame: str) -> Source:
    """Host time of a Python frame per traced step (ms)."""
    return trace(file, dispatcher, "python", frame, "ms")


MOE_FORWARD = "moe/moe_layer.py(607): forward"
EXPERTS_FORWARD = "moe/experts.py(1318): forward"
OPTIMIZER_STEP = "optimizer/optimizer.py(1854): step"
TRACES = [(TRACE_GPT, "alltoall"), (TRACE_GPT, "deepepv2"), (TRACE_DSV3, "alltoall"), (TRACE_DSV3, "deepepv2")]


def trace_row(name: str, cell: str, value: Callable[[str, str], list[Source]]) -> Figure:
    """A row of the traces table: the same cell for each of the four traced steps."""
    return fig("training.md", row(name, *[cell] * len(TRACES)),
               *[source for file, dispatcher in TRACES for source in value(file, dispatcher)])


def losses(file: str, label: str) -> Source:
    """A run's losses per step, ``{step: loss}``."""
    return calc(lambda loss: {int(step): value for step, value in loss.items()},
                J(file, "runs", {"label": label}, "loss"))


def mean_loss(file: str, label: str, first: int, last: int) -> Source:
    """A run's mean loss over steps ``first``-``last``."""
    return calc(lambda loss: statistics.fmean(loss[i] for i in range(first, last + 1)), losses(file, label))


def largest_window_gap(a: Source, b: Source, window: int = 20) -> Source:
    """The largest difference of two runs' mean losses over any ``window`` consecutive steps both ran."""
    def gap(x: dict[int, float], y: dict[int, float]) -> float:
        steps = sorted(set(x) & set(y))
        return max(abs(statistics.fmean(x[i] for i in steps[s:s + window])
                       - statistics.fmean(y[i] for i in steps[s:s + window]))
                   for s in range(len(steps) - window + 1))
    return calc(gap, a, b)


def training_row(label: str, step: str, tokens: str, gap: bool = True) -> Figure:
    """A row of the 200-step table: steps, step time, tokens/s, losses, mean loss, gaps to alltoall."""
    def field(name: str) -> Source:
        return J(TRAINING, "runs", {"label": label}, name)
    cells = [f"`{label}`", "{}", step, tokens, "{:.5f} -> {:.3f}" + (" (192)" if label == "deepepv2" else ""),
             "{:.3f}", "{:.2f} / {:.3f} / {:.3f}" if gap else "-"]
    values = [field("steps"), field("median_step_ms"), field("tokens_per_s"), field("first_loss"),
              field("last_loss"), mean_loss(TRAINING, label, 151, 192)]
    if gap:
        values += [J(TRAINING, "loss_gap", label, "max_abs"), J(TRAINING, "loss_gap", label, "mean_abs"),
                   largest_window_gap(losses(TRAINING, label), losses(TRAINING, "alltoall"))]
    return fig("training.md", row(*cells), *values)


def det_graphs_row(label: str, what: str, runs: int, central: str) -> Figure:
    """A row of the deterministic-graphs table: step time of the configuration and of each run, tokens/s."""
    each = [J(DET_GRAPHS, "configurations", label, "median_step_ms_each", i) for i in range(runs)]
    every = " ({})".format(", ".join(["{:.1f}"] * runs)) if runs > 1 else ""
    return fig("training.md", row(f"`{label}`", what, str(runs), central + every, "{:,.0f}"),
               median(*each), *(each if runs > 1 else []), J(DET_GRAPHS, "configurations", label, "tokens_per_s"))


def det_order(run: int, line: int, pattern: str) -> Source:
    """A time in a line of ``deterministic_order_h200_ep1.json``'s output."""
    return number_in(J(DET_ORDER, "runs", run, "output", line), pattern)


def output_difference(x: float) -> str:
    """A row's output against alltoall's as comparison.md writes it: ``3.3e-03``, or ``0``."""
    return "0" if x == 0 else f"{x:.1e}"


def three_digits(x: float) -> str:
    """A layer time in ms as comparison.md's first table writes it: two decimals below 10, else one."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def compare_row(model: str, variant: str, cells: tuple[str, str, str], shortest_path: bool = False) -> Figure:
    """A row of comparison.md's first table (``model`` is the first cell, empty after a model's first row)."""
    def field(name: str) -> Source:
        return J(COMPARE, "rows", {"model": model, "variant": variant}, name)
    first, dispatcher, experts = cells
    path = ("**{:.2f}**" if shortest_path else "{:.2f}") if variant != "deepepv2-expand-graph" else "-"
    values = [scaled(field("path_us"), 1e-3)] if path != "-" else []
    values += [calc(three_digits, scaled(field("layer_us"), 1e-3)), field("peak_mib")]
    if variant != "alltoall":
        values.append(calc(output_difference, field("max_rel_diff")))
    return fig("comparison.md",
               row(first, dispatcher, f"`{experts}`", path, "{}", "{:.0f}", "{}" if variant != "alltoall" else ""),
               *values)


COMPARE_MODELS = [("qwen3-30b-a3b", "Qwen3-30B-A3B (2048, 128, 8, 768)", "allgather"),
                  ("mixtral-8x7b", "Mixtral-8x7B (4096, 8, 2, 14336)", "allgather"),
                  ("deepseek-v3", "DeepSeek-V3 (7168, 256, 8, 2048)", "deepepv2-expand")]
COMPARE_VARIANTS = [("alltoall", "alltoall", "SequentialMLP"), ("allgather", "allgather", "SequentialMLP"),
                    ("deepepv2-expand", "deepepv2 expand", "SequentialMLP"),
                    ("deepepv2-compact", "deepepv2 compact", "SequentialMLP"),
                    ("deepepv2-expand-no-host-sync", "deepepv2 expand, no host sync", "SyncFreeSequentialMLP"),
                    ("deepepv2-expand-graph", "deepepv2 expand, CUDA-graph replay", "SyncFreeSequentialMLP")]


def compare_graphs_row(model: str, label: str, variant: str) -> Figure:
    """A row of comparison.md's CUDA-graph table: ratios recomputed as baseline time / row time."""
    def field(name: str, of: str = variant) -> Source:
        return J(COMPARE_GRAPHS, "rows", {"model": model, "variant": of}, name)
    experts = "SequentialMLP" if variant == "alltoall" else "SyncFreeSequentialMLP"
    graph = variant == "deepepv2-no-host-sync-layer-graph"
    cells = [label, f"`{variant}`", f"`{experts}`", "-" if "graph" in variant else "{:.2f}",
             "**{:.2f}**" if graph else "{:.2f}", "{:.2f}" if "graph" in variant else "-",
             "**{:.2f}**" if graph else "-", "{:.0f}", "{:.1e}" if variant != "alltoall" else ""]
    values = [] if "graph" in variant else [scaled(field("path_us"), 1e-3)]
    values.append(scaled(field("layer_us"), 1e-3))
    if "graph" in variant:
        values.append(ratio(field("layer_us", "alltoall-syncfree"), field("layer_us")))
    if graph:
        values.append(ratio(field("layer_us", "alltoall-syncfree-graphs"), field("layer_us")))
    values.append(field("peak_mib"))
    if variant != "alltoall":
        values.append(field("max_rel_diff"))
    return fig("comparison.md", row(*cells), *values)


def conformance_row(configuration: str) -> Figure:
    """A row of conformance.md's results: outcomes counted over the configuration's cases, and its seconds."""
    cases = J(CONFORMANCE, "runs", configuration, "cases")
    counts = [calc(lambda c, o=outcome: sum(case["outcome"] == o for case in c.values()), cases)
              for outcome in ("passed", "failed", "skipped")]
    return fig("conformance.md", row(f"`{configuration}`", "{}", "{}", "{}", "{:.1f}"),
               *counts, J(CONFORMANCE, "runs", configuration, "seconds"))


def memory_row(ep: int, mode: str) -> Figure:
    """A row of the DeepSeek-V3 layer memory table."""
    def field(name: str) -> Source:
        return J(MEMORY, "rows", {"ep": ep, "mode": mode}, name)
    return fig("memory.md", row(str(ep), mode, *["{:,.0f} MiB"] * 4),
               field("buffer_mib"), field("received_mib"), field("kept_mib"), field("peak_mib"))


FIGURES: list[Figure] = [
    # ---- benchmarks.md: FP8 dispatch cost (bench_fp8_h200_ep1.json) ----
    *[fp8_row(*spec) for spec in FP8_ROWS],
    fig("benchmarks.md", "values and fp32 scales): {:.2f}x", ratio(J(FP8, "rows", 0, "fp8_bytes"),
                                                                  J(FP8, "rows", 0, "bf16_bytes"))),
    fig("benchmarks.md", "DeepSeek-V3 at T8192 {:.1f} MB -> {:.1f} MB per rank",
        scaled(J(FP8, "rows", {"model": "deepseek-v3", "tokens": 8192, "layout": "compact"}, "bf16_bytes"), 1e-6),
        scaled(J(FP8, "rows", {"model": "deepseek-v3", "tokens": 8192, "layout": "compact"}, "fp8_bytes"), 1e-6)),
    fig("benchmarks.md", "the PyTorch ops took {:.1f}-{:.1f}x the fused kernels' time",
        *min_max(torch_over_fused())),
    fig("benchmarks.md", "runs at {:.1f}-{:.1f} TB/s of memory traffic",
        scaled(J(FP8, "rows", {"model": "deepseek-v3", "tokens": 4096, "layout": "expand"}, "dequantize_GBs"), 1e-3),
        scaled(J(FP8, "rows", {"model": "deepseek-v3", "tokens": 8192, "layout": "expand"}, "dequantize_GBs"), 1e-3)),
    fig("benchmarks.md", "for hidden >= 4096, is **missed: {:.0f}-{:.0f}%**",
        *min_max(fp8_overheads(4096))),
    fig("benchmarks.md", "the quantiser's own speed ({:.1f}-{:.1f} TB/s",
        scaled(lowest(*fp8_all("quantize_GBs")), 1e-3), scaled(highest(*fp8_all("quantize_GBs")), 1e-3)),

    # ---- benchmarks.md: hot path before and after the library/tools split (one JSON per run) ----
    *[split_row(layout, variant)
      for layout, variants in [("compact", ["raw", "raw_autograd", *OPS, "graph_replay"]),
                               ("expand", ["raw", "raw_autograd", *OPS, "graph_replay"]),
                               ("layer", ["path_alltoall", "path_deepepv2_expand",
                                          "path_deepepv2_expand_no_host_sync"])]
      for variant in variants],
    fig("benchmarks.md", "The 6f8e512 medians of the `ops_*` rows are {:.2f}-{:.2f}x the before tree's",
        *min_max(split_op_ratios())),
    fig("benchmarks.md", "moved by up to {:.2f}x between the same runs",
        highest(*[ratio(median(*over_runs(SPLIT_AFTER, layout, "raw_autograd")),
                        median(*over_runs(SPLIT_BEFORE, layout, "raw_autograd")))
                  for layout in ("compact", "expand")])),
    fig("benchmarks.md", "`ops_manager_streams / raw_autograd` was {:.2f} ({:.2f}-{:.2f}) before and {:.2f} "
                         "({:.2f}-{:.2f}) at 6f8e512 in compact, {:.2f} and {:.2f} in expand",
        *split_target(SPLIT_BEFORE, "compact"), *split_target(SPLIT_AFTER, "compact"),
        split_target(SPLIT_BEFORE, "expand")[0], split_target(SPLIT_AFTER, "expand")[0]),
    fig("benchmarks.md", "faster, summed over the two, in {} of the 8 `ops_*` cells", final_faster_cells()),
    fig("benchmarks.md", "`docs/bench_host_instructions_636a68a_bc20054.json`): the layer's own instructions per "
                         "step (a variant minus `bare_tensor_ops`) are {:,.0f} before and {:,.0f} after for the "
                         "Megatron configuration ({:+.1f}%), {:,.0f} and {:,.0f} with the direct-call defaults "
                         "({:+.1f}%), {:,.0f} and {:,.0f} resolving settings per call ({:+.1f}%); `backend_floor` is "
                         "unchanged ({:,.0f} and {:,.0f})",
        *[source for variant in ("ops_megatron_config", "ops_config", "ops_resolved_per_call")
          for source in (layer_instructions(SPLIT_INSTRUCTIONS, "before", variant, 0),
                         layer_instructions(SPLIT_INSTRUCTIONS, "now", variant, 0),
                         change(layer_instructions(SPLIT_INSTRUCTIONS, "now", variant, 0),
                                layer_instructions(SPLIT_INSTRUCTIONS, "before", variant, 0)))],
        layer_instructions(SPLIT_INSTRUCTIONS, "before", "backend_floor", 0),
        layer_instructions(SPLIT_INSTRUCTIONS, "now", "backend_floor", 0)),
    fig("benchmarks.md", "first run then second: the Megatron configuration {:,.0f} before and {:,.0f} after "
                         "({:+.1f}%), then {:,.0f} and {:,.0f} ({:+.1f}%); the direct-call defaults {:,.0f} and "
                         "{:,.0f} ({:+.1f}%), then {:,.0f} and {:,.0f} ({:+.1f}%); settings resolved per call "
                         "{:,.0f} and {:,.0f} ({:+.1f}%), then {:,.0f} and {:,.0f} ({:+.1f}%). `autograd_floor`, "
                         "whose code is the same in both trees, moved by {:+.1f}% and {:+.1f}%",
        *two_runs_before_and_after(ADAPTER_INSTRUCTIONS)),
    fig("benchmarks.md", "second: the Megatron configuration {:,.0f} before and {:,.0f} after ({:+.1f}%), then "
                         "{:,.0f} and {:,.0f} ({:+.1f}%); the\ndirect-call defaults {:,.0f} and {:,.0f} ({:+.1f}%), "
                         "then {:,.0f} and {:,.0f} ({:+.1f}%); settings resolved per call {:,.0f}\nand {:,.0f} "
                         "({:+.1f}%), then {:,.0f} and {:,.0f} ({:+.1f}%). `autograd_floor`, whose code is the same "
                         "in both trees, moved\nby {:+.1f}% and {:+.1f}%",
        *two_runs_before_and_after(STATE_INSTRUCTIONS)),
    fig("benchmarks.md", "of the {:,.0f} added instructions",
        rounded(difference(layer_instructions(SPLIT_INSTRUCTIONS, "now", "ops_megatron_config", 0),
                           layer_instructions(SPLIT_INSTRUCTIONS, "before", "ops_megatron_config", 0)), -3)),

    # ---- benchmarks.md: hot path before and after the one-declaration refactor ----
    *[refactor_row(layout, variant)
      for layout, variants in [("compact", ["raw", "raw_autograd", *OPS, "graph_replay"]),
                               ("expand", ["raw", "raw_autograd", *OPS, "graph_replay"]),
                               ("layer", ["path_alltoall", "path_deepepv2_expand",
                                          "path_deepepv2_expand_no_host_sync"])]
      for variant in variants],
    *[refactor_second_row(layout, variant)
      for layout, variants in [("compact", ["raw_autograd", *OPS]), ("expand", ["raw_autograd", *OPS]),
                               ("layer", ["path_alltoall", "path_deepepv2_expand",
                                          "path_deepepv2_expand_no_host_sync"])]
      for variant in variants],
    fig("benchmarks.md", "`ops_manager_streams/raw_autograd` {:.2f}-{:.2f} (target <= 1.10; before {:.2f}-{:.2f}), "
                         "`ops_defaults/raw_autograd` {:.2f}-{:.2f} (<= 1.25; before {:.2f}-{:.2f}), "
                         "`graph_replay/kernel_time` {:.2f}-{:.2f} (<= 1.10)",
        *min_max(run_ratios(REFACTOR_AFTER, "ops_manager_streams/raw_autograd")),
        *min_max(run_ratios(REFACTOR_BEFORE, "ops_manager_streams/raw_autograd")),
        *min_max(run_ratios(REFACTOR_AFTER, "ops_defaults/raw_autograd")),
        *min_max(run_ratios(REFACTOR_BEFORE, "ops_defaults/raw_autograd")),
        *min_max(run_ratios(REFACTOR_AFTER, "graph_replay/kernel_time"))),
    fig("benchmarks.md", "`ops_no_host_sync/ops_manager` {:.2f}-{:.2f} in three rows and **{:.2f}, missed**, in run "
                         "2's expand row (<= 1.00; before {:.2f}-{:.2f})",
        *min_max(run_ratios(REFACTOR_AFTER, "ops_no_host_sync/ops_manager")[:3]),
        run_ratios(REFACTOR_AFTER, "ops_no_host_sync/ops_manager")[3],
        *min_max(run_ratios(REFACTOR_BEFORE, "ops_no_host_sync/ops_manager"))),
    fig("benchmarks.md", "took less time in both after runs than in the one before run (expand {:.2f}x, without host "
                         "sync {:.2f}-{:.2f}x)",
        *[ratio(hot(REFACTOR_SECOND[i], "layer", "path_deepepv2_expand"),
                hot(REFACTOR_SECOND[1], "layer", "path_deepepv2_expand")) for i in (0,)],
        *min_max([ratio(hot(REFACTOR_SECOND[i], "layer", "path_deepepv2_expand_no_host_sync"),
                        hot(REFACTOR_SECOND[1], "layer", "path_deepepv2_expand_no_host_sync")) for i in (0, 2)])),
    fig("benchmarks.md",
        "(`ops_defaults` {:.2f}-{:.2f}x, `ops_no_host_sync` {:.2f}-{:.2f}x, the others {:.2f}-{:.2f}x)",
        *[source for variants in (["ops_defaults"], ["ops_no_host_sync"],
                                  ["raw_autograd", "ops_manager", "ops_manager_streams"])
          for source in min_max([ratio(hot(REFACTOR_SECOND[i], "expand", variant),
                                       hot(REFACTOR_SECOND[1], "expand", variant))
                                 for variant in variants for i in (0, 2)])]),
    fig("benchmarks.md", "`ops_manager_streams/raw_autograd` {:.2f} and {:.2f} in one row each, **{:.2f} and {:.2f}, "
                         "missed** in the other two (before, this round: {:.2f} and {:.2f}); "
                         "`ops_defaults/raw_autograd` {:.2f}-{:.2f} (met); `ops_no_host_sync/ops_manager` "
                         "{:.2f}-{:.2f} and **{:.2f}, missed** once; `graph_replay/kernel_time` {:.2f}-{:.2f}",
        *[run_ratios([REFACTOR_SECOND[i]], "ops_manager_streams/raw_autograd", [layout])[0]
          for i, layout in ((0, "compact"), (2, "expand"), (0, "expand"), (2, "compact"))],
        *run_ratios(REFACTOR_SECOND[1:2], "ops_manager_streams/raw_autograd"),
        *min_max(run_ratios(REFACTOR_SECOND[0::2], "ops_defaults/raw_autograd")),
        *min_max(run_ratios(REFACTOR_SECOND[0::2], "ops_no_host_sync/ops_manager")[:3]),
        run_ratios(REFACTOR_SECOND[0::2], "ops_no_host_sync/ops_manager")[3],
        *min_max(run_ratios(REFACTOR_SECOND[0::2], "graph_replay/kernel_time"))),
    fig("benchmarks.md", "`raw_autograd`, which runs none of our code, spans {:.0f}-{:.0f} us in the expand rows",
        lowest(*over_runs(REFACTOR_SECOND, "expand", "raw_autograd")),
        highest(*over_runs(REFACTOR_SECOND, "expand", "raw_autograd"))),

    # ---- benchmarks.md: hot path on one H200 after the bound-dispatcher redesign ----
    *[hot_times_row(doc_label, file, label, layout)
      for doc_label, file, label in HOT_LABELS for layout in ("compact", "expand")],
    *[hot_ratios_row(doc_label, file, label, layout)
      for doc_label, file, label in HOT_LABELS for layout in ("compact", "expand")],
    fig("benchmarks.md", "`raw_autograd` costs {:.0f}-{:.0f} us more than `raw` at T4096 H4096 (both runs)",
        *min_max([difference(hot(f, layout, "raw_autograd", "T4096 H4096 E64 top8"),
                             hot(f, layout, "raw", "T4096 H4096 E64 top8"))
                  for f in (HOT, HOT_SECOND) for layout in ("compact", "expand")])),
    fig("benchmarks.md", "`record_stream` of every tensor cost {:.0f}-{:.0f} us per step there",
        *min_max([difference(hot(f, layout, "ops_manager_streams", "T4096 H4096 E64 top8"),
                             hot(f, layout, "ops_manager", "T4096 H4096 E64 top8"))
                  for f in (HOT, HOT_SECOND) for layout in ("compact", "expand")])),
    fig("benchmarks.md", "`ops_manager/raw` is {:.2f}-{:.2f} (no target)",
        *min_max(hot_all("ops_manager/raw"))),
    fig("benchmarks.md", "`ops_manager` is {:.2f}-{:.2f}x of `raw_autograd`",
        *min_max(hot_all("ops_manager/raw_autograd"))),
    fig("benchmarks.md", "`ops_manager_streams` is {:.2f}-{:.2f}x of `raw_autograd`",
        *min_max(hot_all("ops_manager_streams/raw_autograd"))),
    fig("benchmarks.md", "every variant but `ops_defaults` launches exactly the {:.0f} kernels of the raw calls, at "
                         "the raw calls' GPU time (compact {:.0f}-{:.0f} us, expand {:.0f}-{:.0f} us); `ops_defaults` "
                         "launches {:.0f} (compact) and {:.0f} (expand)",
        *[calc(lambda *xs: xs[0] if len(set(xs)) == 1 else f"unequal: {xs}",
               *[profile(layout, variant, "launches_per_step") for layout in ("compact", "expand")
                 for variant in PROFILED])],
        *[source for layout in ("compact", "expand")
          for source in min_max([profile(layout, variant, "gpu_us_per_step") for variant in PROFILED])],
        profile("compact", "ops_defaults", "launches_per_step"),
        profile("expand", "ops_defaults", "launches_per_step")),
    fig("benchmarks.md", "raw host-sync dispatch {:.0f}, through the adapter {:.0f}, through `ops.dispatch` {:.0f}; "
                         "cached dispatch raw {:.0f}, adapter {:.0f}; combine raw {:.0f}, adapter {:.0f}; an autograd "
                         "backward over a trivial Function {:.0f}",
        *[J(HOT, "isolated_calls_us", name)
          for name in ("raw_dispatch_host_sync", "adapter_dispatch_host_sync", "ops_dispatch_host_sync",
                       "raw_cached_dispatch", "adapter_cached_dispatch", "raw_combine", "adapter_combine",
                       "backward_nothing")]),
    fig("benchmarks.md", "`ops_no_host_sync/ops_manager`): {:.2f}-{:.2f}x in 6 of the 8 configurations and both runs "
                         "of T4096; {:.2f}x at T1024 expand and {:.2f}x at H7168 compact",
        *min_max([hot_ratio(file, layout, "ops_no_host_sync/ops_manager", label)
                  for _, file, label in HOT_LABELS for layout in ("compact", "expand")
                  if (label, layout) not in (("T1024 H4096 E64 top8", "expand"), ("T4096 H7168 E64 top8", "compact"))]),
        hot_ratio(HOT, "expand", "ops_no_host_sync/ops_manager", "T1024 H4096 E64 top8"),
        hot_ratio(HOT, "compact", "ops_no_host_sync/ops_manager", "T4096 H7168 E64 top8")),
    fig("benchmarks.md", "(GPU time {:.0f} and {:.0f} us against {:.0f}-{:.0f} us of wall clock)",
        hot(HOT, "expand", "kernel_time", "T1024 H4096 E64 top8"),
        hot(HOT, "compact", "kernel_time", "T4096 H7168 E64 top8"),
        *min_max([hot(HOT, layout, variant, label) for layout, label in (("expand", "T1024 H4096 E64 top8"),
                                                                         ("compact", "T4096 H7168 E64 top8"))
                  for variant in ("ops_manager", "ops_no_host_sync")])),
    fig("benchmarks.md", "the two runs of T4096 differ by up to {:.0f}% in a variant, `raw` compact {:.0f} against "
                         "{:.0f} us, and the alltoall path below by {:.0f}%",
        highest(*[calc(lambda a, b: 100 * (max(a, b) / min(a, b) - 1),
                       hot(HOT, layout, variant, "T4096 H4096 E64 top8"), hot(HOT_SECOND, layout, variant))
                  for layout in ("compact", "expand") for variant in HOT_VARIANTS]),
        hot(HOT, "compact", "raw", "T4096 H4096 E64 top8"), hot(HOT_SECOND, "compact", "raw"),
        change(hot(HOT, "layer", "path_alltoall"), hot(HOT_SECOND, "layer", "path_alltoall"))),
    fig("benchmarks.md", "an eager launch {:.1f} us, a Triton launch {:.1f} us, an event record {:.1f} us, a stream "
                         "wait {:.1f} us",
        *[J(HOT, "launch_costs_us", name) for name in ("eager_launch", "triton_launch", "event_record",
                                                       "stream_wait_event")]),
    fig("benchmarks.md", "ratio is of single measurements): alltoall {:,.0f} us; deepepv2 expand {:,.0f} us ({:.2f}x "
                         "alltoall's time); expand without host sync {:,.0f} us ({:.2f}x). Second run: alltoall "
                         "{:,.0f}, expand {:,.0f} ({:.2f}x), without host sync {:,.0f} ({:.2f}x;",
        *[source for file in (HOT, HOT_SECOND)
          for source in (hot(file, "layer", "path_alltoall"), hot(file, "layer", "path_deepepv2_expand"),
                         ratio(hot(file, "layer", "path_deepepv2_expand"), hot(file, "layer", "path_alltoall")),
                         hot(file, "layer", "path_deepepv2_expand_no_host_sync"),
                         ratio(hot(file, "layer", "path_deepepv2_expand_no_host_sync"),
                               hot(file, "layer", "path_alltoall")))]),

    # ---- benchmarks.md: EP2 benchmark (bench_T4096_H4096_E64_bf16.json, bench_T8192_H7168_E128_fp8.json) ----
    fig("benchmarks.md", "| raw ElasticBuffer dispatch (expand, align 128, CPU sync, epilogue) | {:.0f} us |",
        J(EP2, "rows", 0, "times_us", "raw_dispatch")),
    fig("benchmarks.md", "| raw ElasticBuffer combine (expand, with weights) | {:.0f} us |",
        J(EP2, "rows", 0, "times_us", "raw_combine")),
    fig("benchmarks.md", "| raw fwd+bwd (dispatch, combine, cached dispatch, weighted combine) | {:.0f} us |",
        J(EP2, "rows", 0, "times_us", "raw_fwd_bwd")),
    fig("benchmarks.md",
        "| our autograd ops fwd+bwd (same four calls) | {:.0f} us (`ops_vs_raw` **{:.2f}**; target 1.05) |",
        J(EP2, "rows", 0, "times_us", "ops_fwd_bwd"),
        ratio(J(EP2, "rows", 0, "times_us", "ops_fwd_bwd"), J(EP2, "rows", 0, "times_us", "raw_fwd_bwd"))),
    fig("benchmarks.md", "| dispatcher path fwd+bwd: alltoall / allgather | {:.0f} / {:.0f} us |",
        J(EP2, "rows", 0, "times_us", "path_alltoall"), J(EP2, "rows", 0, "times_us", "path_allgather")),
    fig("benchmarks.md", "| dispatcher path fwd+bwd: deepepv2 expand / compact | **{:.0f}** / {:.0f} us "
                         "(`path_speedup_expand_vs_best_stock` **{:.2f}**; target 5) |",
        J(EP2, "rows", 0, "times_us", "path_deepepv2_expand"), J(EP2, "rows", 0, "times_us", "path_deepepv2_compact"),
        ratio(J(EP2, "rows", 0, "times_us", "path_allgather"), J(EP2, "rows", 0, "times_us", "path_deepepv2_expand"))),
    fig("benchmarks.md",
        "| full MoELayer fwd+bwd (`SequentialMLP` experts): alltoall / allgather | {:.0f} / {:.0f} us |",
        J(EP2, "rows", 0, "times_us", "layer_alltoall"), J(EP2, "rows", 0, "times_us", "layer_allgather")),
    fig("benchmarks.md", "| full MoELayer fwd+bwd (`SequentialMLP` experts): deepepv2 expand / compact | {:.0f} / "
                         "{:.0f} us (`layer_speedup_expand_vs_best_stock` **{:.2f}**; target 1.3) |",
        J(EP2, "rows", 0, "times_us", "layer_deepepv2_expand"), J(EP2, "rows", 0, "times_us", "layer_deepepv2_compact"),
        ratio(J(EP2, "rows", 0, "times_us", "layer_allgather"),
              J(EP2, "rows", 0, "times_us", "layer_deepepv2_expand"))),
    fig("benchmarks.md", "| NVLink peer-to-peer peak (1 GiB send) | {:.1f} GB/s |", J(EP2, "nvlink_peak_GBs")),
    fig("benchmarks.md",
        "| dispatch: logical / remote GB/s, fraction of NVLink peak | {:.0f} / {:.0f} GB/s, **{:.0f}%** |",
        J(EP2, "rows", 0, "summary", "dispatch_logical_GBs"), J(EP2, "rows", 0, "summary", "dispatch_remote_GBs"),
        percent(J(EP2, "rows", 0, "summary", "dispatch_remote_GBs"), J(EP2, "nvlink_peak_GBs"))),
    fig("benchmarks.md", "| combine: remote GB/s, fraction of NVLink peak | {:.0f} GB/s, {:.0f}% |",
        J(EP2, "rows", 0, "summary", "combine_remote_GBs"),
        percent(J(EP2, "rows", 0, "summary", "combine_remote_GBs"), J(EP2, "nvlink_peak_GBs"))),
    fig("benchmarks.md", "raw dispatch {:.0f} us ({:.0f} GB/s logical, {:.0f} GB/s remote, {:.0f}% of peak), raw "
                         "combine {:.0f} us ({:.0f} GB/s remote, {:.0f}%), ops fwd+bwd {:.0f} us",
        J(EP2_FP8, "rows", 0, "times_us", "raw_dispatch"), J(EP2_FP8, "rows", 0, "summary", "dispatch_logical_GBs"),
        J(EP2_FP8, "rows", 0, "summary", "dispatch_remote_GBs"),
        percent(J(EP2_FP8, "rows", 0, "summary", "dispatch_remote_GBs"), J(EP2_FP8, "nvlink_peak_GBs")),
        J(EP2_FP8, "rows", 0, "times_us", "raw_combine"), J(EP2_FP8, "rows", 0, "summary", "combine_remote_GBs"),
        percent(J(EP2_FP8, "rows", 0, "summary", "combine_remote_GBs"), J(EP2_FP8, "nvlink_peak_GBs")),
        J(EP2_FP8, "rows", 0, "times_us", "ops_fwd_bwd")),

    # ---- benchmarks.md: EP2 performance features and SM sweep (bench_sm_sweep_T4096_H4096_E64_bf16.json) ----
    fig("benchmarks.md", "| raw dispatch / raw combine / raw fwd+bwd (16 SMs) | {:.0f} / {:.0f} / {:.0f} us |",
        J(SWEEP, "rows", 0, "times_us", "raw_dispatch"), J(SWEEP, "rows", 0, "times_us", "raw_combine"),
        J(SWEEP, "rows", 0, "times_us", "raw_fwd_bwd")),
    fig("benchmarks.md", "| our ops fwd+bwd (host sync) | {:.0f} us ({:.2f}x raw) |",
        J(SWEEP, "rows", 0, "times_us", "ops_fwd_bwd"),
        ratio(J(SWEEP, "rows", 0, "times_us", "ops_fwd_bwd"), J(SWEEP, "rows", 0, "times_us", "raw_fwd_bwd"))),
    fig("benchmarks.md", "| {:.0f} / {:.0f} / **{:.0f}** / {:.0f} us (expand's the shortest; the best stock, "
                         "allgather, took {:.2f}x its time) |",
        *[J(SWEEP, "rows", 0, "times_us", f"path_{name}")
          for name in ("alltoall", "allgather", "deepepv2_expand", "deepepv2_compact")],
        ratio(J(SWEEP, "rows", 0, "times_us", "path_allgather"),
              J(SWEEP, "rows", 0, "times_us", "path_deepepv2_expand"))),
    fig("benchmarks.md", "| {:.0f} / {:.0f} us (no host sync took **{:.2f}x** the time eager at this size",
        J(SWEEP, "rows", 0, "times_us", "layer_syncfree_host_sync"),
        J(SWEEP, "rows", 0, "times_us", "layer_syncfree_no_host_sync"),
        ratio(J(SWEEP, "rows", 0, "times_us", "layer_syncfree_no_host_sync"),
              J(SWEEP, "rows", 0, "times_us", "layer_syncfree_host_sync"))),
    fig("benchmarks.md", "| {:.0f} / {:.0f} us ({:.1f}% less time with it on); derived exposed communication = "
                         "(raw fwd+bwd - time saved) / raw fwd+bwd = **{:.0f}%** |",
        J(SWEEP, "rows", 0, "times_us", "layer_shared_serial"), J(SWEEP, "rows", 0, "times_us", "layer_shared_overlap"),
        scaled(change(J(SWEEP, "rows", 0, "times_us", "layer_shared_overlap"),
                      J(SWEEP, "rows", 0, "times_us", "layer_shared_serial")), -1),
        percent(difference(J(SWEEP, "rows", 0, "times_us", "raw_fwd_bwd"),
                           difference(J(SWEEP, "rows", 0, "times_us", "layer_shared_serial"),
                                      J(SWEEP, "rows", 0, "times_us", "layer_shared_overlap"))),
                J(SWEEP, "rows", 0, "times_us", "raw_fwd_bwd"))),
    *[fig("benchmarks.md", row(str(sms), "{:.0f} us, {:.0f} GB/s", "{:.0f} us, {:.0f} GB/s"),
          J(SWEEP, "sm_sweep", {"sms": sms}, "dispatch_us"), J(SWEEP, "sm_sweep", {"sms": sms}, "dispatch_remote_GBs"),
          J(SWEEP, "sm_sweep", {"sms": sms}, "combine_us"), J(SWEEP, "sm_sweep", {"sms": sms}, "combine_remote_GBs"))
      for sms in (4, 8, 16, 32, 64)],
    fig("benchmarks.md", "dispatch + combine takes {:.0f}% less time at 64 than at 16 SMs",
        scaled(change(total(J(SWEEP, "sm_sweep", {"sms": 64}, "dispatch_us"),
                            J(SWEEP, "sm_sweep", {"sms": 64}, "combine_us")),
                      total(J(SWEEP, "sm_sweep", {"sms": 16}, "dispatch_us"),
                            J(SWEEP, "sm_sweep", {"sms": 16}, "combine_us"))), -1)),
    fig("benchmarks.md", "`sm_knee` in the JSON) is {}", J(SWEEP, "sm_knee")),

    # ---- benchmarks.md: expert compute (bench_experts.json, bench_experts_activations.json) ----
    *[fig("benchmarks.md", row(name, "{:.2f} ms", "{:.2f} ms"),
          *[J(EXPERTS, "rows", {"config": config}, "times_ms", key) for config in EXPERT_SHAPES])
      for name, key in [("Megatron `SequentialMLP`", "sequential_mlp"),
                        ("`SyncFreeSequentialMLP`, exact rows (host counts)", "sync_free_exact"),
                        ("`SyncFreeSequentialMLP`, 65,536-row worst-case buffer (device counts)",
                         "sync_free_worst_case"),
                        ("bare `torch._grouped_mm` pair on stacked `[E, out, in]` weights, autograd",
                         "grouped_gemm_pair")]],
    *[fig("benchmarks.md", row(name, cell, cell),
          *[ratio(J(EXPERTS, "rows", {"config": config}, "times_ms", a),
                  J(EXPERTS, "rows", {"config": config}, "times_ms", b))
            for config in EXPERT_SHAPES])
      for name, cell, a, b in [("exact / bare GEMM pair (target <= 1.15)", "**{:.3f}**", "sync_free_exact",
                                "grouped_gemm_pair"),
                               ("worst case / exact (target <= 1.05)", "**{:.3f}**", "sync_free_worst_case",
                                "sync_free_exact"),
                               ("SequentialMLP / exact", "{:.2f}x", "sequential_mlp", "sync_free_exact")]],
    fig("benchmarks.md", "| experts | E32 H4096 F1024 ({:,} rows) | E128 H7168 F2048 ({:,} rows) |",
        *[J(EXPERTS, "rows", {"config": config}, "aligned_rows") for config in EXPERT_SHAPES]),
    fig("benchmarks.md", "({:,} tail rows x {} on the first shape",
        difference(J(EXPERTS, "rows", 0, "shape", "worst_rows"), J(EXPERTS, "rows", 0, "aligned_rows")),
        J(EXPERTS, "rows", 0, "shape", "hidden")),
    fig("benchmarks.md", "(max |diff| {:.3f} at outputs up to {:.2f}; {:.3f} at up to {:.1f})",
        J(EXPERTS, "rows", 0, "max_abs_diff_vs_sequential"), J(EXPERTS, "rows", 0, "max_abs_sequential_output"),
        J(EXPERTS, "rows", 1, "max_abs_diff_vs_sequential"), J(EXPERTS, "rows", 1, "max_abs_sequential_output")),
    *[fig("benchmarks.md", row(name, "{:.3f} ms", "{:.3f} ms", "{:.3f} ms", "{:.3f}", "{:.3f}" + suffix),
          *[J(ACTIVATIONS, "rows", {"config": config}, "times_ms", key)
            for key in ("sync_free_exact", "sync_free_worst_case", "grouped_gemm_pair")],
          ratio(J(ACTIVATIONS, "rows", {"config": config}, "times_ms", "sync_free_exact"),
                J(ACTIVATIONS, "rows", {"config": config}, "times_ms", "grouped_gemm_pair")),
          ratio(J(ACTIVATIONS, "rows", {"config": config}, "times_ms", "sync_free_worst_case"),
                J(ACTIVATIONS, "rows", {"config": config}, "times_ms", "sync_free_exact")))
      for name, config, suffix in [
          ("E32 H4096 F1024, SwiGLU", "E32 H4096 F1024 swiglu", ""),
          ("E32 H4096 F1024, GELU (Megatron's default, not gated)", "E32 H4096 F1024 gelu", ""),
          ("E32 H4096 F1024, clamped quick-GeGLU (GPT-OSS: clamp 7, linear offset 1)",
           "E32 H4096 F1024 clamped_quick_geglu", " (on the line)"),
          ("E128 H7168 F2048, SwiGLU", "E128 H7168 F2048 swiglu", "")]],

    # ---- benchmarks.md: host time of the layer (bench_host_instructions.json, bench_host_overhead.json) ----
    fig("benchmarks.md", "| **{:.1f}** | **{:.1f}** ({:+.0f}%) |",
        layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"),
        layer_instructions(INSTRUCTIONS, "now", "ops_megatron_config"),
        change(layer_instructions(INSTRUCTIONS, "now", "ops_megatron_config"),
               layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"))),
    fig("benchmarks.md", "| `dispatch(...)` with arguments, default settings (id check on) | {:.1f} | {:.1f} |",
        layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"),
        layer_instructions(INSTRUCTIONS, "now", "ops_resolved_per_call")),
    fig("benchmarks.md", "| `dispatch(..., config=resolve_config(...))`, default settings (id check on) | - | {:.1f} |",
        layer_instructions(INSTRUCTIONS, "now", "ops_config")),
    fig("benchmarks.md", "| the same, `check_ids=False` | - | {:.1f} |",
        layer_instructions(INSTRUCTIONS, "now", "ops_config_no_id_check")),
    fig("benchmarks.md", "| `backend_floor` (the backend contract called directly) | {:.1f} | {:.1f} |",
        layer_instructions(INSTRUCTIONS, "before", "backend_floor"),
        layer_instructions(INSTRUCTIONS, "now", "backend_floor")),
    fig("benchmarks.md", "| `autograd_floor` (two identity autograd functions) | {:.1f} | {:.1f} |",
        layer_instructions(INSTRUCTIONS, "before", "autograd_floor"),
        layer_instructions(INSTRUCTIONS, "now", "autograd_floor")),
    fig("benchmarks.md", "Halving means at most {:.1f} thousand instructions; the backend contract called with "
                         "nothing around it already takes {:.1f}. What is ours above that floor fell from {:.1f} to "
                         "{:.1f} thousand instructions ({:+.0f}%)",
        scaled(layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"), 0.5),
        layer_instructions(INSTRUCTIONS, "now", "backend_floor"),
        difference(layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"),
                   layer_instructions(INSTRUCTIONS, "before", "backend_floor")),
        difference(layer_instructions(INSTRUCTIONS, "now", "ops_megatron_config"),
                   layer_instructions(INSTRUCTIONS, "now", "backend_floor")),
        change(difference(layer_instructions(INSTRUCTIONS, "now", "ops_megatron_config"),
                          layer_instructions(INSTRUCTIONS, "now", "backend_floor")),
               difference(layer_instructions(INSTRUCTIONS, "before", "ops_resolved_per_call"),
                          layer_instructions(INSTRUCTIONS, "before", "backend_floor")))),
    fig("benchmarks.md", "pay the expert-id check the defaults ask for ({:.0f} thousand instructions",
        difference(layer_instructions(INSTRUCTIONS, "now", "ops_config"),
                   layer_instructions(INSTRUCTIONS, "now", "ops_config_no_id_check"))),
    fig("benchmarks.md", "| **the Megatron layer's dispatch** | **{:.1f} / {:.1f}** | **{:.1f} / {:.1f}** ({:+.0f}% / "
                         "{:+.0f}%) |",
        J(HOST_TIME, "before", "ops_resolved_per_call", "layer_min"),
        J(HOST_TIME, "before", "ops_resolved_per_call", "layer_median"),
        J(HOST_TIME, "now", "ops_megatron_config", "layer_min"),
        J(HOST_TIME, "now", "ops_megatron_config", "layer_median"),
        change(J(HOST_TIME, "now", "ops_megatron_config", "layer_min"),
               J(HOST_TIME, "before", "ops_resolved_per_call", "layer_min")),
        change(J(HOST_TIME, "now", "ops_megatron_config", "layer_median"),
               J(HOST_TIME, "before", "ops_resolved_per_call", "layer_median"))),
    *[fig("benchmarks.md", row(name, before, "{:.1f} / {:.1f}"),
          *([J(HOST_TIME, "before", before_key, "layer_min"), J(HOST_TIME, "before", before_key, "layer_median")]
            if before_key else []),
          J(HOST_TIME, "now", now_key, "layer_min"), J(HOST_TIME, "now", now_key, "layer_median"))
      for name, before, before_key, now_key in [
          ("`dispatch(...)` with arguments, default settings (id check on)", "{:.1f} / {:.1f}",
           "ops_resolved_per_call", "ops_resolved_per_call"),
          ("`dispatch(..., config=resolve_config(...))`, default settings", "-", None, "ops_config"),
          ("the same, `check_ids=False`", "-", None, "ops_config_no_id_check"),
          ("`backend_floor`", "{:.1f} / {:.1f}", "backend_floor", "backend_floor"),
          ("`autograd_floor`", "{:.1f} / {:.1f}", "autograd_floor", "autograd_floor")]],
    fig("benchmarks.md", "so their spread ({:.1f} against {:.1f}) is the timing's noise",
        J(HOST_TIME, "before", "autograd_floor", "layer_min"), J(HOST_TIME, "now", "autograd_floor", "layer_min")),

    # ---- benchmarks.md: soak, default checks, installer, functional record ----
    fig("benchmarks.md", "3 builds for {} changes (the two growths)", J(SOAK, "verdicts", 0, "changes")),
    fig("benchmarks.md", "flat within {:.1f} MiB (rank 0) and {:.1f} MiB (rank 1)",
        J(SOAK, "verdicts", 0, "memory_growth_mib"), J(SOAK, "verdicts", 1, "memory_growth_mib")),
    *[check_row(*shape) for shape in CHECK_SHAPES],
    fig("benchmarks.md", "`reference_us` = {:.0f} us is the raw DeepEP calls, forward dispatch + combine "
                         "(`raw_dispatch` + `raw_combine`, {:.0f} + {:.0f} us); `fwd_bwd_us` = {:.0f} us is our ops "
                         "forward + backward",
        J(CHECKS, "reference_us"), J(EP2, "rows", 0, "times_us", "raw_dispatch"),
        J(EP2, "rows", 0, "times_us", "raw_combine"), J(CHECKS, "fwd_bwd_us")),
    fig("benchmarks.md", "The checks cost **{:.1f}-{:.1f}% of `reference_us` in GPU time**; in host time, which "
                         "matters only where the host is the bottleneck, {:.1f}-{:.1f}% of `reference_us` and "
                         "{:.1f}-{:.1f}% of `fwd_bwd_us`",
        percent(lowest(*check_rows("device_check_device_us")), J(CHECKS, "reference_us")),
        percent(highest(*check_rows("device_check_device_us")), J(CHECKS, "reference_us")),
        *min_max(check_rows("default_checks_pct_of_reference")),
        *min_max(check_rows("default_checks_pct_of_fwd_bwd"))),
    fig("benchmarks.md", "a Triton launch from Python costs {:.1f}-{:.1f} us of host time (the kernel itself runs "
                         "{:.1f}-{:.1f} us)",
        *min_max(check_rows("kernel_launch_host_us")),
        *min_max(check_rows("device_check_device_us"))),
    fig("benchmarks.md", "the source build with `--wheel-dir` took {:.1f} s (NCCL {:.1f} s, DeepEP as a wheel {:.1f} "
                         "s), and on another bare machine `--from-wheels` installed its wheels ({:.1f} and {:.1f} "
                         "MiB) in {:.1f} s",
        J(INSTALL, "build_with_wheel_dir", "total_s"), J(INSTALL, "build_with_wheel_dir", "steps_s", "nccl"),
        J(INSTALL, "build_with_wheel_dir", "steps_s", "deep_ep"),
        J(INSTALL, "build_with_wheel_dir", "wheels_mib", NCCL_WHEEL),
        J(INSTALL, "build_with_wheel_dir", "wheels_mib", DEEP_EP_WHEEL),
        J(INSTALL, "from_wheels", "total_s")),
    fig("benchmarks.md", "That file now holds a later run: commit {}, {}, after the library/tools split (above), on a "
                         "fresh machine: {} functional cases passed, {} needs 2+ ranks (Megatron's EP overlap), and "
                         "{:.0f} unit and determinism tests with GPU cases passed.",
        J(FUNCTIONAL, "commit"), J(FUNCTIONAL, "date"),
        calc(lambda cases: sum(outcome.startswith("PASS") for outcome in cases.values()), J(FUNCTIONAL, "cases")),
        calc(lambda cases: sum(outcome.startswith("SKIP") for outcome in cases.values()), J(FUNCTIONAL, "cases")),
        number_in(J(FUNCTIONAL, "unit_and_determinism_tests"), r"^(\d+) passed")),

    # ---- internals.md ----
    fig("internals.md", "single runs: {:,.0f} us against expand's {:,.0f} us and alltoall's {:,.0f} us at T4096 H4096 "
                        "E64 top-8, 16 SMs",
        J(EP2, "rows", 0, "times_us", "path_deepepv2_compact"), J(EP2, "rows", 0, "times_us", "path_deepepv2_expand"),
        J(EP2, "rows", 0, "times_us", "path_alltoall")),
    fig("internals.md", "and {:.1f}-{:.1f}x alltoall's path time at EP=1 on one H200",
        *min_max([ratio(J(COMPARE, "rows", {"model": model, "variant": "deepepv2-compact"}, "path_us"),
                        J(COMPARE, "rows", {"model": model, "variant": "alltoall"}, "path_us"))
                  for model, _, _ in COMPARE_MODELS]),
        named_in="comparison.md"),
    fig("internals.md", "`record_stream` of every input and output ({:.0f}-{:.0f} us per forward + backward step at "
                        "T4096 H4096 on one H200: `ops_manager_streams` minus `ops_manager`",
        lowest(*[difference(hot(f, layout, "ops_manager_streams", "T4096 H4096 E64 top8"),
                            hot(f, layout, "ops_manager", "T4096 H4096 E64 top8"))
                 for f in (HOT, HOT_SECOND) for layout in ("compact", "expand")]),
        highest(*[difference(hot(f, layout, "ops_manager_streams", "T4096 H4096 E64 top8"),
                             hot(f, layout, "ops_manager", "T4096 H4096 E64 top8"))
                  for f in (HOT, HOT_SECOND) for layout in ("compact", "expand")])),
    fig("internals.md", "3 builds for {} changes, nothing left behind, resident memory flat within {:.1f} MiB",
        J(SOAK, "verdicts", 0, "changes"),
        highest(J(SOAK, "verdicts", 0, "memory_growth_mib"), J(SOAK, "verdicts", 1, "memory_growth_mib"))),
    fig("internals.md", "check runs **{:.1f}-{:.1f} us on the GPU** and takes **{:.1f}-{:.1f} us of host time** to "
                        "launch (a Triton launch and the assert), plus {:.1f}-{:.1f} us of static checks",
        *min_max(check_rows("device_check_device_us")),
        *min_max(check_rows("device_check_host_us")),
        *min_max(check_rows("static_checks_host_us"))),
    fig("internals.md", "`raw_dispatch` + `raw_combine` = {:.0f} us forward", J(CHECKS, "reference_us")),
    fig("internals.md", "that is {:.1f}-{:.1f}% in GPU time and {:.1f}-{:.1f}% in host time",
        percent(lowest(*check_rows("device_check_device_us")), J(CHECKS, "reference_us")),
        percent(highest(*check_rows("device_check_device_us")), J(CHECKS, "reference_us")),
        *min_max(check_rows("default_checks_pct_of_reference"))),
    fig("internals.md", "against our ops' forward + backward of that run ({:.0f} us, `fwd_bwd_us`), {:.1f}-{:.1f}% in "
                        "host time",
        J(CHECKS, "fwd_bwd_us"), lowest(*check_rows("default_checks_pct_of_fwd_bwd")),
        highest(*check_rows("default_checks_pct_of_fwd_bwd"))),

    # ---- memory.md ----
    fig("memory.md", "the model's FP8-sized buffer {:,} bytes, {:.0f} MiB, against {:,} bytes, {:.0f} MiB, that the "
                     "cached BF16 dispatch needs",
        J(FP8_SIZING, "before_fix", "model_bytes", "buffer"),
        scaled(J(FP8_SIZING, "before_fix", "model_bytes", "buffer"), 2 ** -20),
        J(FP8_SIZING, "before_fix", "model_bytes", "cached_dispatch_needs"),
        scaled(J(FP8_SIZING, "before_fix", "model_bytes", "cached_dispatch_needs"), 2 ** -20)),
    *[memory_row(ep, mode) for ep in (8, 64) for mode in ("host sync", "no host sync", "no host sync, bound 1.5")],

    # ---- comparison.md (compare_dispatchers_h200_ep1.json, compare_dispatchers_graphs_h200_ep1.json) ----
    *[compare_row(model, variant, (label if i == 0 else "", dispatcher, experts), shortest_path=variant == shortest)
      for model, label, shortest in COMPARE_MODELS
      for i, (variant, dispatcher, experts) in enumerate(COMPARE_VARIANTS)],
    *[compare_graphs_row(model, label if i == 0 else "", variant)
      for model, label in [("qwen3-30b-a3b", "Qwen3-30B-A3B (2048, 128, 8, 768)"),
                           ("mixtral-8x7b", "Mixtral-8x7B (4096, 8, 2, 14336)")]
      for i, variant in enumerate(["alltoall", "alltoall-syncfree", "alltoall-syncfree-graphs",
                                   "deepepv2-no-host-sync-layer-graph"])],
    fig("comparison.md", "alltoall's partial graphs raised its peak by {:.0f} MiB (Qwen3) and {:.0f} MiB (Mixtral) "
                         "over eager; the whole-layer deepepv2 graph's peak was {:.0f} and {:.0f} MiB below them",
        *[difference(J(COMPARE_GRAPHS, "rows", {"model": model, "variant": "alltoall-syncfree-graphs"}, "peak_mib"),
                     J(COMPARE_GRAPHS, "rows", {"model": model, "variant": "alltoall-syncfree"}, "peak_mib"))
          for model in ("qwen3-30b-a3b", "mixtral-8x7b")],
        *[difference(J(COMPARE_GRAPHS, "rows", {"model": model, "variant": "alltoall-syncfree-graphs"}, "peak_mib"),
                     J(COMPARE_GRAPHS, "rows", {"model": model, "variant": "deepepv2-no-host-sync-layer-graph"},
                       "peak_mib"))
          for model in ("qwen3-30b-a3b", "mixtral-8x7b")]),

    # ---- conformance.md (megatron_conformance_h200_ep1.json) ----
    fig("conformance.md", "{}, commit {} ([JSON](megatron_conformance_h200_ep1.json))",
        calc(lambda date: date[:10], J(CONFORMANCE, "date")), J(CONFORMANCE, "git_commit")),
    *[conformance_row(configuration) for configuration in ("deepep-hostsync", "deepep-nohostsync",
                                                           "reference-hostsync", "reference-nohostsync")],

    # ---- README.md's headline, usage.md and install-deepep.md ----
    fig("usage.md", "| Megatron `SequentialMLP` | {:.2f} ms | {:.2f} ms |",
        *[J(EXPERTS, "rows", i, "times_ms", "sequential_mlp") for i in (0, 1)]),
    fig("usage.md", "| `SyncFreeSequentialMLP`, exact rows (host sync) | {:.2f} ms (`SequentialMLP` {:.2f}x this) | "
                    "{:.2f} ms (`SequentialMLP` {:.2f}x this) |",
        *[source for i in (0, 1) for source in (J(EXPERTS, "rows", i, "times_ms", "sync_free_exact"),
                                                ratio(J(EXPERTS, "rows", i, "times_ms", "sequential_mlp"),
                                                      J(EXPERTS, "rows", i, "times_ms", "sync_free_exact")))]),
    fig("usage.md", "| `SyncFreeSequentialMLP`, 65,536-row worst-case buffer (no host sync) | {:.2f} ms ({:.3f}x "
                    "exact) | {:.2f} ms ({:.3f}x exact) |",
        *[source for i in (0, 1) for source in (J(EXPERTS, "rows", i, "times_ms", "sync_free_worst_case"),
                                                ratio(J(EXPERTS, "rows", i, "times_ms", "sync_free_worst_case"),
                                                      J(EXPERTS, "rows", i, "times_ms", "sync_free_exact")))]),
    fig("usage.md", "| two bare `torch._grouped_mm` (the GEMMs alone) | {:.2f} ms (exact = {:.2f}x) | {:.2f} ms "
                    "(exact = {:.2f}x) |",
        *[source for i in (0, 1) for source in (J(EXPERTS, "rows", i, "times_ms", "grouped_gemm_pair"),
                                                ratio(J(EXPERTS, "rows", i, "times_ms", "sync_free_exact"),
                                                      J(EXPERTS, "rows", i, "times_ms", "grouped_gemm_pair")))]),
    fig("usage.md", "stepped in **{:.3f}x** the time of `alltoall-syncfree-graphs` (median of the rounds' ratios, "
                    "{:.3f}-{:.3f}, faster in every round)",
        *median_min_max(rounds_ratios(ROUNDS, "deepepv2-nohostsync-graphs", "alltoall-syncfree-graphs"))),
    fig("install-deepep.md", "NCCL built for sm_90 only in {:.1f} s (libnccl 57 MiB), `.pth` check {:.1f} s, compiler "
                             "probe {:.1f} s (`/usr/bin/g++`), DeepEP build {:.1f} s (as a wheel, see below), import "
                             "check {:.1f} s, doctor {:.1f} s: **{:.1f} s in all**",
        *[J(INSTALL, "build_with_wheel_dir", "steps_s", step)
          for step in ("nccl", "torch-nccl", "compiler", "deep_ep", "verify", "doctor")],
        J(INSTALL, "build_with_wheel_dir", "total_s")),
    fig("install-deepep.md", "the wheels are {:.1f} MiB (NCCL for sm_90) and {:.1f} MiB (deep_ep); on another bare "
                             "machine `--from-wheels` took **{:.1f} s** (manifest check {:.1f} s, `pip install` "
                             "{:.1f} s, import check {:.1f} s, doctor {:.1f} s, no blocking problem)",
        J(INSTALL, "build_with_wheel_dir", "wheels_mib", NCCL_WHEEL),
        J(INSTALL, "build_with_wheel_dir", "wheels_mib", DEEP_EP_WHEEL),
        J(INSTALL, "from_wheels", "total_s"),
        *[J(INSTALL, "from_wheels", "steps_s", step) for step in ("wheels", "install", "verify", "doctor")]),

    # ---- training.md: rounds (training_rounds_*.json) ----
    rounds_row("alltoall-syncfree", "SyncFreeSequentialMLP"),
    rounds_row("alltoall-syncfree-graphs", "SyncFreeSequentialMLP"),
    rounds_row("deepepv2-syncfree", "SyncFreeSequentialMLP"),
    rounds_row("deepepv2-syncfree-compiled-preprocess", "SyncFreeSequentialMLP"),
    rounds_row("deepepv2-nohostsync-graphs", "SyncFreeSequentialMLP"),
    rounds_ratio_row("deepepv2-nohostsync-graphs", "alltoall-syncfree-graphs", "", bold=True),
    rounds_ratio_row("deepepv2-syncfree", "alltoall-syncfree", " (eager)", bold=True),
    rounds_ratio_row("deepepv2-syncfree", "alltoall-syncfree-graphs", " (eager against alltoall's best flags)",
                     bold=False),
    rounds_ratio_row("alltoall-syncfree-graphs", "alltoall-syncfree", "", bold=False),
    rounds_ratio_row("deepepv2-syncfree", "deepepv2-syncfree-compiled-preprocess", "", bold=False),
    fig("training.md", "whose host ran the eager steps faster (alltoall-syncfree {:.1f} and {:.1f} ms): "
                       "`deepepv2-syncfree` / `alltoall-syncfree` {:.3f} and {:.3f} (median {:.3f}:",
        round_time(FIRST_MACHINE, "alltoall-syncfree#1"), round_time(FIRST_MACHINE, "alltoall-syncfree#2"),
        *rounds_ratios(FIRST_MACHINE, "deepepv2-syncfree", "alltoall-syncfree", (1, 2)),
        median(*rounds_ratios(FIRST_MACHINE, "deepepv2-syncfree", "alltoall-syncfree", (1, 2)))),
    fig("training.md", "`deepepv2-nohostsync-graphs` / `alltoall-syncfree` {:.3f} and {:.3f}",
        *rounds_ratios(FIRST_MACHINE, "deepepv2-nohostsync-graphs", "alltoall-syncfree", (1, 2))),
    fig("training.md", "the graph runs stepped in {:.0f}-{:.0f} ms",
        lowest(*[round_time(file, f"deepepv2-nohostsync-graphs#{i}") for file in (ROUNDS, FIRST_MACHINE)
                 for i in (1, 2, 3)]),
        highest(*[round_time(file, f"deepepv2-nohostsync-graphs#{i}") for file in (ROUNDS, FIRST_MACHINE)
                  for i in (1, 2, 3)])),
    fig("training.md", "every eager run ends step 20 at {:.4f}-{:.4f}",
        lowest(*[J(ROUNDS, "runs", {"run": f"{label}#{i}"}, "last_loss") for i in (1, 2, 3)
                 for label in ("alltoall-syncfree", "alltoall-syncfree-graphs", "deepepv2-syncfree",
                               "deepepv2-syncfree-compiled-preprocess")]),
        highest(*[J(ROUNDS, "runs", {"run": f"{label}#{i}"}, "last_loss") for i in (1, 2, 3)
                  for label in ("alltoall-syncfree", "alltoall-syncfree-graphs", "deepepv2-syncfree",
                                "deepepv2-syncfree-compiled-preprocess")])),
    fig("training.md", "the graph runs at {:.4f}-{:.4f}",
        lowest(*[J(ROUNDS, "runs", {"run": f"deepepv2-nohostsync-graphs#{i}"}, "last_loss") for i in (1, 2, 3)]),
        highest(*[J(ROUNDS, "runs", {"run": f"deepepv2-nohostsync-graphs#{i}"}, "last_loss") for i in (1, 2, 3)])),
    fig("training.md", "alltoall {:.1f} and {:.1f} ms, deepepv2 {:.1f} and {:.1f} ms, ratios **{:.3f} and {:.3f}** "
                       "(median {:.3f};",
        round_time(QWEN3, "alltoall#1"), round_time(QWEN3, "alltoall#2"), round_time(QWEN3, "deepepv2#1"),
        round_time(QWEN3, "deepepv2#2"), *rounds_ratios(QWEN3, "deepepv2", "alltoall", (1, 2)),
        median(*rounds_ratios(QWEN3, "deepepv2", "alltoall", (1, 2)))),

    # ---- training.md: traces (training_trace_*.json, training_untraced_h200_ep1_gpt_moe.json) ----
    trace_row("step (wall, profiled)", "{:,.1f} ms", lambda f, d: [trace(f, d, "wall_ms")]),
    trace_row("GPU busy", "{:.1f} ms ({:.1f}%)",
              lambda f, d: [trace(f, d, "gpu_busy_ms"), percent(trace(f, d, "gpu_busy_ms"), trace(f, d, "wall_ms"))]),
    fig("training.md", "| host waits in synchronising calls | {:.1f} ms ({:,.0f} calls) | {:.1f} ms ({:,.0f}) | "
                       "{:.1f} ms ({:,.0f}) | {:.1f} ms ({:,.0f}) |",
        *[s for f, d in TRACES for s in (trace(f, d, "sync_wait_ms"), trace(f, d, "syncs"))]),
    trace_row("MoE layers' forward, all layers", "{:.1f} ms", lambda f, d: [python_ms(f, d, MOE_FORWARD)]),
    trace_row("of which the experts (`SequentialMLP.forward`)", "{:.1f} ms",
              lambda f, d: [python_ms(f, d, EXPERTS_FORWARD)]),
    trace_row("**MoE forward besides the experts** (router, dispatcher stages, shared expert)", "**{:.1f} ms**",
              lambda f, d: [difference(python_ms(f, d, MOE_FORWARD), python_ms(f, d, EXPERTS_FORWARD))]),
    trace_row("optimizer step (no dispatcher in it)", "{:.1f} ms", lambda f, d: [python_ms(f, d, OPTIMIZER_STEP)]),
    fig("training.md", "The GPU is busy {:.1f}-{:.1f}% of a step",
        lowest(*[percent(trace(f, d, "gpu_busy_ms"), trace(f, d, "wall_ms")) for f, d in TRACES]),
        highest(*[percent(trace(f, d, "gpu_busy_ms"), trace(f, d, "wall_ms")) for f, d in TRACES])),
    fig("training.md", "about {:,.0f}-{:,.0f} kernels a step",
        rounded(lowest(*[trace(f, d, "kernels") for f, d in TRACES]), -2),
        rounded(highest(*[trace(f, d, "kernels") for f, d in TRACES]), -2)),
    fig("training.md", "(its permute and the count copies: {:.1f} ms in gpt-moe) where deepepv2 spends {:.1f} ms "
                       "(`dispatch_preprocess`) + {:.1f} ms (`token_dispatch`) + {:.1f} ms (`token_combine`)",
        python_ms(TRACE_GPT, "alltoall", "moe/token_dispatcher.py(618): dispatch_preprocess"),
        python_ms(TRACE_GPT, "deepepv2", "moe/token_dispatcher.py(1855): dispatch_preprocess"),
        python_ms(TRACE_GPT, "deepepv2", "moe/token_dispatcher.py(1882): token_dispatch"),
        python_ms(TRACE_GPT, "deepepv2", "moe/token_dispatcher.py(1945): token_combine")),
    fig("training.md", "(`compile_wrapper` {:.0f} against {:.0f} calls, {:.1f} against {:.1f} ms per traced gpt-moe "
                       "step)",
        trace(TRACE_GPT, "deepepv2", "python", "_dynamo/eval_frame.py(956): compile_wrapper", "calls"),
        trace(TRACE_GPT, "alltoall", "python", "_dynamo/eval_frame.py(956): compile_wrapper", "calls"),
        python_ms(TRACE_GPT, "deepepv2", "_dynamo/eval_frame.py(956): compile_wrapper"),
        python_ms(TRACE_GPT, "alltoall", "_dynamo/eval_frame.py(956): compile_wrapper")),
    fig("training.md", "alltoall {:.1f} ms, deepepv2 {:.1f} ms ({:.2f}x), deepepv2 with `torch.compile` off everywhere "
                       "(`TORCHDYNAMO_DISABLE=1`) {:.1f} ms",
        J(UNTRACED, "runs", {"run": "alltoall"}, "median_step_ms"),
        J(UNTRACED, "runs", {"run": "deepepv2"}, "median_step_ms"),
        ratio(J(UNTRACED, "runs", {"run": "deepepv2"}, "median_step_ms"),
              J(UNTRACED, "runs", {"run": "alltoall"}, "median_step_ms")),
        J(UNTRACED, "runs", {"run": "deepepv2-nocompile"}, "median_step_ms")),

    # ---- training.md: 200 steps (training_h200_ep1.json) ----
    training_row("alltoall", "{:.0f} ms", "{:,.0f}", gap=False),
    training_row("deepepv2", "{:.0f} ms", "{:,.0f}"),
    training_row("deepepv2-syncfree", "{:.0f} ms", "{:,.0f}"),
    training_row("deepepv2-syncfree-fp8", "{:.0f} ms", "{:,.0f}"),
    training_row("deepepv2-nohostsync-eager", "{:.0f} ms", "{:,.0f}"),
    training_row("deepepv2-nohostsync-graphs", "**{:.1f} ms**", "**{:,.0f}**"),
    fig("training.md", "Step 1's loss differs from alltoall's by at most {}",
        calc(short_e, highest(*[calc(lambda a, b: abs(a - b), J(TRAINING, "runs", {"label": label}, "first_loss"),
                       J(TRAINING, "runs", {"label": "alltoall"}, "first_loss"))
                  for label in ("deepepv2", "deepepv2-syncfree", "deepepv2-syncfree-fp8", "deepepv2-nohostsync-eager",
                                "deepepv2-nohostsync-graphs")]))),
    fig("training.md", "the mean loss over steps 151-192 is within {:.2f}-{:.1f}% of alltoall's",
        *(lambda gaps: (lowest(*gaps), highest(*gaps)))(
            [calc(lambda a, b: 100 * abs(a - b) / b, mean_loss(TRAINING, label, 151, 192),
                  mean_loss(TRAINING, "alltoall", 151, 192))
             for label in ("deepepv2", "deepepv2-syncfree", "deepepv2-syncfree-fp8", "deepepv2-nohostsync-eager",
                           "deepepv2-nohostsync-graphs")])),
    fig("training.md", "the largest gap of 20-step means is {:.2f}-{:.2f}",
        *(lambda gaps: (lowest(*gaps), highest(*gaps)))(
            [largest_window_gap(losses(TRAINING, label), losses(TRAINING, "alltoall"))
             for label in ("deepepv2", "deepepv2-syncfree", "deepepv2-syncfree-fp8", "deepepv2-nohostsync-eager",
                           "deepepv2-nohostsync-graphs")])),
    fig("training.md",
        "follows alltoall's curve within {:.3f} (20-step means; {:.3f} against the BF16 sync-free run's)",
        largest_window_gap(losses(TRAINING, "deepepv2-syncfree-fp8"), losses(TRAINING, "alltoall")),
        largest_window_gap(losses(TRAINING, "deepepv2-syncfree-fp8"), losses(TRAINING, "deepepv2-syncfree"))),

    # ---- training.md: deterministic with CUDA graphs (training_deterministic_graphs_h200_ep1.json) ----
    det_graphs_row("det-graphs", "`--deterministic-mode`, no host sync, CUDA graphs", 3, "**{:.1f} ms**"),
    det_graphs_row("graphs", "no host sync, CUDA graphs (not deterministic)", 2, "{:.1f} ms"),
    det_graphs_row("order-graphs", "`MEGATRON_DEEPEPV2_DETERMINISTIC=1` alone (deepepv2 orders its rows; Megatron and "
                                   "torch not deterministic), CUDA graphs", 1, "{:.1f} ms"),
    det_graphs_row("det-hostsync", "`--deterministic-mode`, host sync, eager", 2, "{:.1f} ms"),
    det_graphs_row("hostsync", "host sync, eager (not deterministic)", 1, "{:.1f} ms"),
    fig("training.md", "{:.1f} ms per step against {:.1f} ms for deterministic training with host sync (the JSON's "
                       "`configurations`: `det-graphs` {:,.0f} tokens/s, `det-hostsync` {:,.0f}), **{:.2f}x its "
                       "throughput**",
        J(DET_GRAPHS, "configurations", "det-graphs", "median_step_ms"),
        J(DET_GRAPHS, "configurations", "det-hostsync", "median_step_ms"),
        J(DET_GRAPHS, "configurations", "det-graphs", "tokens_per_s"),
        J(DET_GRAPHS, "configurations", "det-hostsync", "tokens_per_s"),
        ratio(median(*[J(DET_GRAPHS, "configurations", "det-hostsync", "median_step_ms_each", i) for i in (0, 1)]),
              median(*[J(DET_GRAPHS, "configurations", "det-graphs", "median_step_ms_each", i) for i in (0, 1, 2)]))),
    fig("training.md", "**What determinism costs with graphs**: {:.1f} against {:.1f} ms ({:.2f}x)",
        J(DET_GRAPHS, "configurations", "det-graphs", "median_step_ms"),
        J(DET_GRAPHS, "configurations", "graphs", "median_step_ms"),
        ratio(J(DET_GRAPHS, "configurations", "det-graphs", "median_step_ms"),
              J(DET_GRAPHS, "configurations", "graphs", "median_step_ms"))),
    fig("training.md", "takes {:.1f} ms (+{:.1f} ms, {:.1f}%, within the {:.1f}% that separates the two `graphs` runs)",
        J(DET_GRAPHS, "configurations", "order-graphs", "median_step_ms"),
        difference(J(DET_GRAPHS, "configurations", "order-graphs", "median_step_ms"),
                   J(DET_GRAPHS, "configurations", "graphs", "median_step_ms")),
        change(J(DET_GRAPHS, "configurations", "order-graphs", "median_step_ms"),
               J(DET_GRAPHS, "configurations", "graphs", "median_step_ms")),
        spread(*[J(DET_GRAPHS, "configurations", "graphs", "median_step_ms_each", i) for i in (0, 1)])),
    fig("training.md", "the deterministic graph runs end at {:.4f} after 50 steps, the `graphs` runs at {:.4f} and "
                       "{:.4f}",
        J(DET_GRAPHS, "runs", {"run": "det-graphs#1"}, "last_loss"),
        J(DET_GRAPHS, "runs", {"run": "graphs#1"}, "last_loss"),
        J(DET_GRAPHS, "runs", {"run": "graphs#2"}, "last_loss")),
    fig("training.md", "differ from step 3 on (`lm loss` {:.6f} vs {:.6f})",
        J(DET_GRAPHS, "runs", {"run": "graphs#1"}, "loss", "3"),
        J(DET_GRAPHS, "runs", {"run": "graphs#2"}, "loss", "3")),
    fig("training.md", "compact {:.0f} -> {:.0f} us, expand {:.0f} -> {:.0f} us; called eagerly {:.0f} -> {:.0f} and "
                       "{:.0f} -> {:.0f} us",
        det_order(2, 0, r"eager / graph replay: \d+ / (\d+) us"), det_order(2, 0, r"deterministic \d+ / (\d+) us"),
        det_order(2, 1, r"eager / graph replay: \d+ / (\d+) us"), det_order(2, 1, r"deterministic \d+ / (\d+) us"),
        det_order(2, 0, r"eager / graph replay: (\d+) / \d+ us"), det_order(2, 0, r"deterministic (\d+) / \d+ us"),
        det_order(2, 1, r"eager / graph replay: (\d+) / \d+ us"), det_order(2, 1, r"deterministic (\d+) / \d+ us")),
]


# ---- Transformer Engine (functional_te_h100_ep1.json, training_te_*.json) ----
TE_CASES, TE_TRAIN, TE_DET = ("functional_te_h100_ep1.json", "training_te_h100_ep1.json",
                              "training_te_deterministic_h100_ep1.json")


def te_log(case: str, pattern: str, group: int = 1) -> Source:
    """A number in the first line of a TE case's log that ``pattern`` matches (its ``group``)."""
    def find(log: list[str]) -> float:
        return float(next(m for m in (re.search(pattern, entry) for entry in log) if m).group(group))
    return calc(find, J(TE_CASES, "cases", case, "log"))


def te_gap(run: str, baseline: str, file: str = TE_TRAIN) -> Source:
    """The largest absolute loss gap over the steps two runs share."""
    return calc(lambda a, b: max(abs(a[step] - b[step]) for step in a if step in b),
                J(file, "runs", {"run": run}, "loss"), J(file, "runs", {"run": baseline}, "loss"))


def te_fp8(recipe: str) -> tuple[Source, Source]:
    """deepepv2's and alltoall's largest relative error against BF16 under an FP8 recipe (``recipe`` a regex)."""
    pattern = rf"FP8 {recipe}: largest relative error against BF16 ([\d.e+-]+) \(\S+; alltoall ([\d.e+-]+)\)"
    case = "te_fp8_recipes_as_accurate_as_alltoall"
    return te_log(case, pattern, 1), te_log(case, pattern, 2)


def sci(x: float) -> str:
    """x as the TE section writes it: ``9.27e-2``."""
    mantissa, exponent = f"{x:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


TE_RECIPES = ("delayed", "tensorwise", "blockwise")
TE_FIGURES: list[Figure] = [
    fig("usage.md", "a whole TE `TransformerLayer` within {} of alltoall",
        calc(short_e, te_log("te_layer_with_grouped_mlp_matches_alltoall", r"largest relative error ([\d.e+-]+)"))),
    fig("usage.md", "runs: within {}.",
        calc(short_e, te_log("te_op_fuser_grouped_mlp_with_and_without_host_sync",
                             r"host sync: \d+ tensors, largest relative error ([\d.e+-]+)"))),
    fig("usage.md", "matches within {})",
        calc(short_e, te_log("permute_fusion_matches_alltoall", r"largest relative error ([\d.e+-]+)"))),
    fig("usage.md", "delayed {} (alltoall {}), tensorwise {} ({}), blockwise {} ({}); with FP8 dispatch as well, "
                    "{}, {} and {} (alltoall {}, {}, {})",
        *[calc(sci, source) for recipe in TE_RECIPES for source in te_fp8(recipe)],
        *[calc(sci, te_fp8(rf"{recipe} \+ FP8 dispatch")[side]) for side in (0, 1) for recipe in TE_RECIPES]),
    fig("usage.md", "`TEGroupedMLP` {}; `TEGroupedMLP` with TE's partial graphs (8 layers captured) {}; "
                    "`SyncFreeSequentialMLP` without host sync under TE's partial graphs against alltoall's with host "
                    "sync {};",
        calc(short_e, te_gap("deepepv2-te", "alltoall-te")),
        calc(short_e, te_gap("deepepv2-te-graphs", "alltoall-te-graphs")),
        calc(short_e, te_gap("deepepv2-nohostsync-te-graphs", "alltoall-syncfree-te-graphs"))),
    fig("usage.md", "(the two dispatchers {} apart)",
        calc(short_e, te_gap("deepepv2-te#1", "alltoall-te#1", TE_DET))),
    fig("usage.md", "part from the eager runs by {} at step 20",
        calc(short_e, te_gap("deepepv2-nohostsync-te-layer-graphs", "alltoall-syncfree-te-graphs"))),
    *[fig("training.md", row(f"`{run}`", f"`{baseline}`", "{}", "{:.4f} / {:.4f}"),
          calc(short_e, te_gap(run, baseline)), J(TE_TRAIN, "runs", {"run": run}, "last_loss"),
          J(TE_TRAIN, "runs", {"run": baseline}, "last_loss"))
      for run, baseline in (("deepepv2-te", "alltoall-te"), ("deepepv2-te-graphs", "alltoall-te-graphs"),
                            ("deepepv2-nohostsync-te-graphs", "alltoall-syncfree-te-graphs"))],
    fig("training.md", "| `deepepv2-nohostsync-te-layer-graphs` | `alltoall-syncfree-te-graphs` | {} (whole-layer "
                       "graphs: dropout from another stream) | {:.4f} / {:.4f} |",
        calc(short_e, te_gap("deepepv2-nohostsync-te-layer-graphs", "alltoall-syncfree-te-graphs")),
        J(TE_TRAIN, "runs", {"run": "deepepv2-nohostsync-te-layer-graphs"}, "last_loss"),
        J(TE_TRAIN, "runs", {"run": "alltoall-syncfree-te-graphs"}, "last_loss")),
    *[fig("training.md", f"| `{label}`, `--deterministic-mode`, run 2 | run 1 | 0 (bit for bit, 20 steps) | {{:.4f}} |",
          calc(lambda equal, loss: loss if equal else float("nan"),
               J(TE_DET, "bitwise", {"runs": [label, label]}, "equal"),
               J(TE_DET, "runs", {"run": f"{label}#2"}, "last_loss")))
      for label in ("deepepv2-te", "alltoall-te")],
]
FIGURES += TE_FIGURES

# ---- Transformer Engine rounds on three models, README's headline; the earlier machine's gpt-moe rounds; the GPU suite
TE_MODELS = {"gpt-moe": "training_rounds_gpt_moe_te_h100_ep1",
             "gpt-moe-large": "training_rounds_gpt_moe_large_te_h100_ep1",
             "qwen3-moe-router": "training_rounds_qwen3_moe_router_te_h100_ep1"}
TE_SUMMARY = "training_rounds_te_h100_ep1.json"
TE_FIRST_STEP = "training_first_step_fresh_caches_gpt_moe_te_h100_ep1.json"
TE_EARLIER, GPU_SUITE = "training_rounds_gpt_moe_te_h100_ep1_earlier_machine.json", "gpu_suite_h100_ep1.json"
GPU_SUITE_RERUN = "gpu_suite_te_rerun_h100_ep1.json"
DEEPEP_SHARD_3 = "tests/functional/test_deepep.py::test_deepep_cases_on_one_gpu[3]"
TE_CASES = "tests/functional/test_transformer_engine.py::test_te_cases_on_one_gpu"
TE_NO_DROPOUT = "training_gpt_moe_large_te_no_dropout_h100_ep1.json"
TE_BEST = ("deepepv2-nohostsync-te-layer-graphs", "alltoall-syncfree-te-graphs")
TE_SAME = ("deepepv2-te-graphs", "alltoall-te-graphs")
TE_ORDER = ("alltoall-te-graphs", "deepepv2-te-graphs", "alltoall-syncfree-te-graphs",
            "deepepv2-nohostsync-te-layer-graphs")


def te_report(model: str) -> str:
    return f"{TE_MODELS[model]}.json"


def te_step(model: str, label: str) -> Source:
    """A configuration's median step on a model: the median of its rounds' runs, from the model's report's runs."""
    return median(*[round_time(te_report(model), f"{label}#{i}") for i in (1, 2, 3)])


def te_trace(model: str, label: str, *path: str) -> Source:
    """A figure of a traced configuration's step, from the model's trace summary."""
    return trace(f"{TE_MODELS[model]}_trace.json", label, *path)


def te_busy(model: str, label: str) -> Source:
    """A traced configuration's GPU-busy time per step (ms)."""
    return te_trace(model, label, "gpu_busy_ms")


def te_first_steps(file: str, label: str, rounds: Iterable[int]) -> list[Source]:
    return [J(file, "runs", {"run": f"{label}#{i}"}, "first_step_s") for i in rounds]


def te_model_rows(model: str) -> list[Figure]:
    """The model's row of the median-step table and of the ratio table (targets judged here, not read)."""
    report = te_report(model)
    steps = fig("training.md", row(f"`{model}`", *["**{:.1f}** ({:.1f}, {:.1f}, {:.1f})"] * 4),
                *[source for label in TE_ORDER for source in
                  (te_step(model, label), *[round_time(report, f"{label}#{i}") for i in (1, 2, 3)])])
    best, same = rounds_ratios(report, *TE_BEST), rounds_ratios(report, *TE_SAME)
    met_best = calc(lambda m: "yes" if m <= 0.60 else "no", median(*best))
    met_same = calc(lambda m, top: "yes" if m <= 1.0 and top <= 1.05 else "no", median(*same), highest(*same))
    ratios = fig("training.md", row(f"`{model}`", "{:.3f}, {:.3f}, {:.3f}", "**{:.3f}** ({:.3f}-{:.3f})", "<= 0.60",
                                    "{}", "{:.3f}, {:.3f}, {:.3f}", "**{:.3f}** ({:.3f}-{:.3f})",
                                    "<= 1.00, no round above 1.05", "{}"),
                 *best, *median_min_max(best), met_best, *same, *median_min_max(same), met_same)
    return [steps, ratios]


#: The rounds whose launches found DeepEP's, Triton's and TorchInductor's caches warm (round 1 still compiled).
WARM_ROUNDS = (2, 3)


def first_step_cost(label: str) -> Source:
    """What empty caches add to a configuration's time to the first step: medians, empty against warm."""
    return difference(median(*te_first_steps(TE_FIRST_STEP, label, (1, 2))),
                      median(*te_first_steps(te_report("gpt-moe"), label, WARM_ROUNDS)))


def te_loss_spread(model: str, first: str, second: str, formatted: bool = True) -> Source:
    """The largest loss difference over steps 1-20 between any run of ``first`` and any other run of ``second``."""
    report = te_report(model)
    runs = [f"{label}#{i}" for label in (first, second) for i in (1, 2, 3)]

    def spread(*losses: dict) -> Any:
        ones, others = losses[:3], losses[3:]
        largest = max(abs(a[step] - b[step]) for x, a in enumerate(ones) for y, b in enumerate(others)
                      if first != second or x != y for step in a if int(step) <= 20)
        return short_e(largest) if formatted else largest
    return calc(spread, *[J(report, "runs", {"run": run}, "loss") for run in runs])


def te_loss_range(model: str, step: int, labels: list[str]) -> tuple[Source, Source]:
    """Lowest and highest loss at ``step`` over the three rounds' runs of ``labels``."""
    losses = [J(te_report(model), "runs", {"run": f"{label}#{i}"}, "loss", str(step)) for label in labels
              for i in (1, 2, 3)]
    return lowest(*losses), highest(*losses)


def te_earlier_row(label: str, experts: str, graphs: str) -> Figure:
    """A row of the earlier machine's table: each round's step and the median."""
    return fig("training.md", row(f"`{label}`", f"`{experts}`", graphs, "{:.1f}, {:.1f}, {:.1f}", "{:.1f}"),
               *[round_time(TE_EARLIER, f"{label}#{i}") for i in (1, 2, 3)],
               J(TE_EARLIER, "configurations", label, "median_step_ms"))


EXPERTS_TRAINING = "bench_experts_training_h100.json"
EXPERT_CONFIGS = {"gpt-moe": "E64 H1024 F256", "gpt-moe-large": "E64 H2048 F768", "qwen3-moe-router": "E128 H1024 F384"}


def experts_training(model: str, *path: str, activation: str = "swiglu") -> Source:
    """A figure of ``bench_experts --shapes training`` at a model's expert shape."""
    return J(EXPERTS_TRAINING, "rows", {"config": f"{model}: {EXPERT_CONFIGS[model]} {activation}"}, *path)


GPU_SUITE_FIGURES: list[Figure] = [
    *[figure for model in TE_MODELS for figure in te_model_rows(model)],
    fig("training.md", "its best keeps the GPU busy {:.1f}, {:.1f} and {:.1f} ms a step (`gpt-moe`, `gpt-moe-large`, "
                       "`qwen3-moe-router`), alltoall at its best {:.1f}, {:.1f} and {:.1f} ms",
        *[te_busy(model, TE_BEST[0]) for model in TE_MODELS], *[te_busy(model, TE_BEST[1]) for model in TE_MODELS]),
    fig("training.md", "its step would be {:.3f}, {:.3f} and {:.3f} of alltoall's",
        *[ratio(te_busy(model, TE_BEST[0]), te_step(model, TE_BEST[1])) for model in TE_MODELS]),
    fig("training.md", "already {:.0f}%, {:.0f}%\nand {:.0f}% GPU-busy ({:.1f} of {:.1f} ms, {:.1f} of {:.1f}, "
                       "{:.1f} of {:.1f})",
        *[percent(te_busy(model, TE_BEST[0]), te_step(model, TE_BEST[0])) for model in TE_MODELS],
        *[source for model in TE_MODELS for source in (te_busy(model, TE_BEST[0]), te_step(model, TE_BEST[0]))]),
    fig("training.md", "Of deepepv2's gain per step ({:.1f}, {:.1f} and {:.1f} ms),\nthe smaller GPU-busy time "
                       "accounts for {:.0f}%, {:.0f}% and {:.0f}%",
        *[difference(te_step(model, TE_BEST[1]), te_step(model, TE_BEST[0])) for model in TE_MODELS],
        *[percent(difference(te_busy(model, TE_BEST[1]), te_busy(model, TE_BEST[0])),
                  difference(te_step(model, TE_BEST[1]), te_step(model, TE_BEST[0]))) for model in TE_MODELS]),
    fig("training.md", "TE's multi-tensor Adam ({:.1f} ms a step on each) and the\nexperts' grouped GEMMs ({:.1f} ms)",
        *[calc(lambda *sides: sides[0] if round(sides[0], 1) == round(sides[1], 1) else float("nan"),
               *[calc(lambda kernels, prefix=prefix: next(ms for name, ms in kernels.items()
                                                          if name.startswith(prefix)),
                      te_trace("gpt-moe", label, "top_kernels_ms"))
                 for label in TE_BEST])
          for prefix in ("void multi_tensor_apply_kernel<TensorListMetadata<4", "_ZN7cutlass13device_kernel")]),
    fig("training.md", "{:.0f}% of alltoall's traced step is GPU-busy ({:.1f} of {:.1f} ms), {:.0f}% of deepepv2's",
        percent(te_busy("gpt-moe-large", TE_BEST[1]),
                te_trace("gpt-moe-large", TE_BEST[1], "wall_ms")),
        te_busy("gpt-moe-large", TE_BEST[1]),
        te_trace("gpt-moe-large", TE_BEST[1], "wall_ms"),
        percent(te_busy("gpt-moe-large", TE_BEST[0]),
                te_trace("gpt-moe-large", TE_BEST[0], "wall_ms"))),
    fig("training.md", "took {:.1f} ms a\nstep for `alltoall-syncfree-te-graphs` and {:.1f} ms for "
                       "`alltoall-te-graphs`, {:.1f}x and {:.1f}x this machine's, while\n"
                       "`deepepv2-nohostsync-te-layer-graphs` took {:.1f} ms, {:.1f}x: there the ratio was {:.3f}",
        J(TE_EARLIER, "configurations", TE_BEST[1], "median_step_ms"),
        J(TE_EARLIER, "configurations", TE_SAME[1], "median_step_ms"),
        ratio(J(TE_EARLIER, "configurations", TE_BEST[1], "median_step_ms"), te_step("gpt-moe", TE_BEST[1])),
        ratio(J(TE_EARLIER, "configurations", TE_SAME[1], "median_step_ms"), te_step("gpt-moe", TE_SAME[1])),
        J(TE_EARLIER, "configurations", TE_BEST[0], "median_step_ms"),
        ratio(J(TE_EARLIER, "configurations", TE_BEST[0], "median_step_ms"), te_step("gpt-moe", TE_BEST[0])),
        median(*rounds_ratios(TE_EARLIER, *TE_BEST))),
    fig("training.md", "any `deepepv2-te-graphs` run and any `alltoall-te-graphs` run\ndiffer by at most {}, {} and {} "
                       "over the 20 steps (`gpt-moe`, `gpt-moe-large`, `qwen3-moe-router`), and two\n"
                       "`alltoall-te-graphs` runs by up to {}, {} and {} themselves",
        *[te_loss_spread(model, TE_SAME[0], TE_SAME[1]) for model in TE_MODELS],
        *[te_loss_spread(model, TE_SAME[1], TE_SAME[1]) for model in TE_MODELS]),
    fig("training.md", "at step 16 their loss is {:.3f}-{:.3f} in all three rounds, against {:.3f}-{:.3f}\nfor every "
                       "other configuration",
        *te_loss_range("gpt-moe-large", 16, [TE_BEST[0]]),
        *te_loss_range("gpt-moe-large", 16, [TE_BEST[1], *TE_SAME])),
    fig("training.md", "`deepepv2-nohostsync-te-layer-graphs` and `alltoall-syncfree-te-graphs` differ by at most "
                       "{:.3f} (step {}) and end at\n{:.4f} against {:.4f}",
        J(TE_NO_DROPOUT, "loss_gap", TE_BEST[0], "max_abs"), J(TE_NO_DROPOUT, "loss_gap", TE_BEST[0], "at_iteration"),
        *[J(TE_NO_DROPOUT, "runs", {"label": label}, "last_loss") for label in TE_BEST]),
    fig("training.md", "one run of each at\n{},", J(TE_NO_DROPOUT, "provenance", "git_commit")),
    fig("training.md", "of one\nconfiguration with dropout on differ by up to {:.2f})",
        calc(max, *[te_loss_spread(model, TE_SAME[1], TE_SAME[1], formatted=False) for model in TE_MODELS])),
    fig("training.md", "round 1 ends at {:.4f} against {:.4f} for `alltoall-syncfree-te-graphs` (`gpt-moe`), {:.4f} "
                       "against {:.4f} (`gpt-moe-large`) and {:.4f} against {:.4f} (`qwen3-moe-router`)",
        *[J(te_report(model), "runs", {"run": f"{label}#1"}, "last_loss") for model in TE_MODELS for label in TE_BEST]),
    fig("training.md", "One H100, Transformer Engine 2.20.2, DeepEP 2.1.0, NCCL 2.30.7, torch 2.11.0+cu130, "
                       "megatron-core 0.19.2, commit {}, TE layers",
        calc(lambda *facts: facts[0] if len(set(facts[:3])) == 1 and set(facts[3:]) == {"NVIDIA H100 80GB HBM3"}
             else "not one commit on one H100",
             *[J(te_report(model), "provenance", "git_commit") for model in TE_MODELS],
             *[J(te_report(model), "machine", "devices", 0) for model in TE_MODELS])),
    *[fig("training.md", row(f"`{label}`", "{:.1f}, {:.1f} s", "{:.1f}, {:.1f} s"),
          *te_first_steps(TE_FIRST_STEP, label, (1, 2)), *te_first_steps(te_report("gpt-moe"), label, WARM_ROUNDS))
      for label in TE_BEST[::-1]],
    fig("training.md", "Emptying the caches costs alltoall {:.1f} s and\ndeepepv2 {:.1f} s (medians): {:.1f} s more "
                       "for deepepv2",
        *[first_step_cost(label) for label in TE_BEST[::-1]],
        difference(first_step_cost(TE_BEST[0]), first_step_cost(TE_BEST[1]))),
    fig("training.md", "and it starts {:.1f} s sooner warm",
        difference(median(*te_first_steps(te_report("gpt-moe"), TE_BEST[1], WARM_ROUNDS)),
                   median(*te_first_steps(te_report("gpt-moe"), TE_BEST[0], WARM_ROUNDS)))),
    fig("usage.md", "the alltoall step with `TEGroupedMLP` took {:.1f}x, {:.1f}x\nand {:.1f}x the step with "
                    "`SyncFreeSequentialMLP` on `gpt-moe`, `gpt-moe-large` and `qwen3-moe-router`",
        *[ratio(te_step(model, TE_SAME[1]), te_step(model, TE_BEST[1])) for model in TE_MODELS],
        named_in="training.md"),
    *[fig("usage.md", row(f"`{model}`: {shape}", "{:.2f} ms", "{:.2f} ms", "{:.0f} / {:.0f}", "{:.2f} ms, {:.2f} ms"),
          experts_training(model, "times_ms", "sync_free_exact"), experts_training(model, "times_ms", "te_grouped_mlp"),
          experts_training(model, "trace", "sync_free_exact", "kernels"),
          experts_training(model, "trace", "te_grouped_mlp", "kernels"),
          experts_training(model, "trace", "te_grouped_mlp", "host_ms"),
          experts_training(model, "trace", "te_grouped_mlp", "gpu_ms"))
      for model, shape in (("gpt-moe", "64 experts, H1024, F256"), ("gpt-moe-large", "64 experts, H2048, F768"),
                           ("qwen3-moe-router", "128 experts, H1024, F384"))],
    fig("usage.md", "its largest GEMM kernel launches once\nper expert: {:.0f} times a call for 64 experts, {:.0f} for "
                    "128",
        *[calc(lambda kernels: max(kernels, key=lambda k: k["ms"])["launches"],
               experts_training(model, "trace", "te_grouped_mlp", "top_kernels"))
          for model in ("gpt-moe", "qwen3-moe-router")]),
    fig("usage.md", "the call takes {:.2f} and {:.2f} ms for {:.2f} and {:.2f} ms of GPU work (traced, the host spent "
                    "{:.2f} and {:.2f}\nms a call",
        *[experts_training(model, *key)
          for key in (("times_ms", "te_grouped_mlp"), ("trace", "te_grouped_mlp", "gpu_ms"),
                      ("trace", "te_grouped_mlp", "host_ms"))
          for model in ("gpt-moe", "qwen3-moe-router")]),
    fig("usage.md", "{:.2f} ms\nof kernel time over its {:.0f} kernels, spread over several streams, against {:.2f} ms "
                    "over `SyncFreeSequentialMLP`'s\n{:.0f} (its two grouped GEMMs alone, bare: {:.2f} ms)",
        *[experts_training("gpt-moe-large", "trace", variant, key) for variant, key in
          (("te_grouped_mlp", "gpu_ms"), ("te_grouped_mlp", "kernels"), ("sync_free_exact", "gpu_ms"),
           ("sync_free_exact", "kernels"))],
        experts_training("gpt-moe-large", "times_ms", "grouped_gemm_pair")),
    fig("usage.md", "one H100, TE 2.20.2, commit {},\n{}):", J(EXPERTS_TRAINING, "provenance", "git_commit"),
        calc(lambda date: date[:10], J(EXPERTS_TRAINING, "provenance", "date"))),
    fig("usage.md", "squared ReLU it took {:.2f} ms against {:.2f} ms for `TEGroupedMLP` and {:.2f} ms for "
                    "`SyncFreeSequentialMLP`",
        *[experts_training("gpt-moe", "times_ms", variant, activation="squared_relu")
          for variant in ("te_op_fuser", "te_grouped_mlp", "sync_free_exact")]),
    fig("README.md", "3 interleaved rounds a model at {},\n{} ([JSON](docs/training_rounds_te_h100_ep1.json))",
        J(TE_SUMMARY, "provenance", "git_commit"), calc(lambda date: date[:10], J(TE_SUMMARY, "provenance", "date"))),
    *[fig("README.md", row(f"`{model}` ({what}" + "{:,} tokens)", "{:.1f} / {:.1f} ms, **{:.2f}x**",
                           "{:.1f} / {:.1f} ms, {:.2f}x"),
          J(te_report(model), "runs", {"run": f"{TE_BEST[0]}#1"}, "tokens_per_step"),
          te_step(model, TE_BEST[0]), te_step(model, TE_BEST[1]), median(*rounds_ratios(te_report(model), *TE_BEST)),
          te_step(model, TE_SAME[0]), te_step(model, TE_SAME[1]), median(*rounds_ratios(te_report(model), *TE_SAME)),
          named_in="training.md")
      for model, what in (("gpt-moe", "64 experts, top-8, "), ("gpt-moe-large", "GPU-bound, "),
                          ("qwen3-moe-router", "128 experts, top-8, "))],
    fig("README.md", "deepepv2's step is {:.0f}-{:.0f}% GPU-busy here; on an H100 where alltoall's step took {:.0f}x "
                     "as long, `gpt-moe` took {:.2f}x",
        lowest(*[percent(te_busy(model, TE_BEST[0]), te_step(model, TE_BEST[0])) for model in TE_MODELS]),
        highest(*[percent(te_busy(model, TE_BEST[0]), te_step(model, TE_BEST[0])) for model in TE_MODELS]),
        ratio(J(TE_EARLIER, "configurations", TE_BEST[1], "median_step_ms"), te_step("gpt-moe", TE_BEST[1])),
        median(*rounds_ratios(TE_EARLIER, *TE_BEST)), named_in="training.md"),
    te_earlier_row("alltoall-te-graphs", "TEGroupedMLP", "TE's partial"),
    te_earlier_row("deepepv2-te-graphs", "TEGroupedMLP", "TE's partial"),
    te_earlier_row("alltoall-syncfree-te-graphs", "SyncFreeSequentialMLP", "TE's partial"),
    te_earlier_row("deepepv2-nohostsync-te-layer-graphs", "SyncFreeSequentialMLP", "whole layers"),
    fig("training.md", "| deepepv2 at its best / alltoall at its best | {:.3f}, {:.3f}, {:.3f} | **{:.3f}** "
                       "({:.3f}-{:.3f}) | <= 0.60 | yes |",
        *rounds_ratios(TE_EARLIER, *TE_BEST), *median_min_max(rounds_ratios(TE_EARLIER, *TE_BEST))),
    fig("training.md", "| the same experts (`TEGroupedMLP`) and TE graph scope | {:.3f}, {:.3f}, {:.3f} | **{:.3f}** "
                       "({:.3f}-{:.3f}), no round above 1.05 | <= 1.00 | yes |",
        *rounds_ratios(TE_EARLIER, *TE_SAME), *median_min_max(rounds_ratios(TE_EARLIER, *TE_SAME))),
    fig("training.md", "the three `alltoall-te-graphs` runs lie {:.1f}%\napart ({:.1f} to {:.1f} ms), and the lowest "
                       "ratio, {:.3f}, pairs two runs 7 minutes apart (round 3)",
        J(TE_EARLIER, "configurations", "alltoall-te-graphs", "spread_pct"),
        lowest(*[round_time(TE_EARLIER, f"alltoall-te-graphs#{i}") for i in (1, 2, 3)]),
        highest(*[round_time(TE_EARLIER, f"alltoall-te-graphs#{i}") for i in (1, 2, 3)]),
        calc(lambda third, *every: third if third == min(every) else float("nan"),
             *rounds_ratios(TE_EARLIER, *TE_SAME, rounds=(3,)), *rounds_ratios(TE_EARLIER, *TE_SAME))),
    *[fig("benchmarks.md", row(name, "{}", "{}", "{}", "{:.0f} s", "{:.1f} s", "{:.1f} s"),
          *[J(GPU_SUITE, "runs", run, key) for key in ("passed", "failed", "skipped", "make_test_s", "pytest_s",
                                                          "longest_wait_s")])
      for run, name in (("plain", "without TE, cold DeepEP JIT cache"), ("te", "with TE (JIT cache warm)"))],
    fig("benchmarks.md", "a one-GPU functional shard compiling DeepEP's kernels on a cold JIT cache ({:.1f} s; "
                         "{:.1f} s "
                         "warm)",
        J(GPU_SUITE, "runs", "plain", "gpu_jobs", {"test": DEEPEP_SHARD_3},
          "held_s"),
        J(GPU_SUITE, "runs", "te", "gpu_jobs", {"test": DEEPEP_SHARD_3},
          "held_s")),
    fig("benchmarks.md", "The TE case file ran ({:.1f} s)",
        J(GPU_SUITE, "runs", "te", "gpu_jobs", {"test": TE_CASES},
          "held_s")),
    fig("benchmarks.md", "**With TE again, at {}** (another fresh H100, cold DeepEP JIT cache, TE installed before the "
                         "run;\n[gpu_suite_te_rerun_h100_ep1.json](gpu_suite_te_rerun_h100_ep1.json)): {} passed, {} "
                         "failed, {} skipped, `make test`\n{:.0f} s",
        J(GPU_SUITE_RERUN, "provenance", "git_commit"),
        *[J(GPU_SUITE_RERUN, "runs", "te", key) for key in ("passed", "failed", "skipped", "make_test_s")]),
    fig("benchmarks.md", "The one failure was again a test's assumption:\n`{}`",
        calc(lambda failed: "{0}.py::{1}".format(*failed[0].replace(".", "/").split("::")) if len(failed) == 1
             else failed,
             J(GPU_SUITE_RERUN, "runs", "te", "failed_tests"))),
]
FIGURES += GPU_SUITE_FIGURES


def mismatches(figure: Figure) -> list[str]:
    """What is wrong with one figure: the doc lacks its text with the JSONs' values, or does not name those JSONs."""
    expected = figure.expected()
    problems = []
    if expected not in doc_text(figure.doc):
        problems.append(f"{figure.doc} does not contain the figures of {sorted(_files(figure.values))}:\n"
                        f"  expected: {expected}")
    naming = figure.named_in or figure.doc
    if figure.named_in and f"]({'docs/' if figure.doc == 'README.md' else ''}{figure.named_in})" not in \
            doc_text(figure.doc):
        problems.append(f"{figure.doc} does not link {figure.named_in}, which names the JSONs of: {expected}")
    unnamed = _files(figure.values) - named_jsons(doc_text(naming))
    if unnamed:
        problems.append(f"{naming} quotes {sorted(unnamed)} without naming it")
    return problems


# One test per doc (each lists every figure of its doc that is wrong): a test per figure would spend more time in
# pytest's own bookkeeping than in the check.
@pytest.mark.parametrize("doc", sorted({figure.doc for figure in FIGURES}))
def test_the_doc_quotes_the_json(doc: str) -> None:
    """The doc contains each figure's text with the values the JSONs give, and names those JSONs."""
    problems = [problem for figure in FIGURES if figure.doc == doc for problem in mismatches(figure)]
    assert not problems, "\n".join(problems)


DOCS_THAT_NAME_JSONS = ["README.md", *sorted(p.name for p in DOCS.glob("*.md")),
                        *sorted(p.name for p in DOCS.glob("*.json"))]


@pytest.mark.parametrize("doc", DOCS_THAT_NAME_JSONS)
def test_every_json_a_doc_names_exists(doc: str) -> None:
    """A JSON of docs/ that a doc (or another JSON) names is there."""
    missing = sorted(name for name in named_jsons(doc_text(doc)) if not (DOCS / name).is_file())
    assert not missing, f"{doc} names {missing}, not in docs/"


def test_a_changed_figure_fails() -> None:
    """The check finds a figure whose doc text differs from the JSON, and a JSON name that is not in docs/."""
    figure = fig("benchmarks.md", "| NVLink peer-to-peer peak (1 GiB send) | {:.1f} GB/s |", J(EP2, "nvlink_peak_GBs"))
    assert figure.expected() in doc_text("benchmarks.md")
    changed = Figure(figure.doc, figure.text, (scaled(figure.values[0], 1.001),))
    assert changed.expected() not in doc_text("benchmarks.md") and mismatches(changed) and not mismatches(figure)
    assert named_jsons("see `docs/gone.json` and run{1,2}.json; runs/x/y.json, TRACE.json.gz, a.jsonl") == {
        "gone.json", "run1.json", "run2.json"}


def test_memory_md_quotes_the_sizing_model() -> None:
    """memory.md's computed figures (no JSON: Mixtral's FP8-sized buffer, the table of buffer sizes) are what
    ``megatron_deepepv2.backends.deepep.sizing`` computes."""
    from megatron_deepepv2.backends.deepep import sizing

    mib = 2 ** -20
    topology = sizing.Topology(num_scaleout_ranks=1, num_scaleup_ranks=4)
    fp8_buffer = sizing.calculated_buffer_bytes(4096, 4096, 2, use_fp8_dispatch=True, topology=topology)
    cached = sizing.call_bytes(4096, 4096, 2, use_fp8=True, topology=topology)["cached_dispatch"]
    expected = f"a {fp8_buffer * mib:g} MiB FP8-sized buffer against a cached BF16 dispatch of {cached * mib:g} MiB"
    assert expected in doc_text("memory.md")

    columns = [(1, 4096), (1, 8192), (2, 4096), (2, 8192), (8, 4096), (8, 8192), (64, 4096)]
    for model, hidden, top_k in [("DeepSeek-V3", 7168, 8), ("Qwen3-30B-A3B", 2048, 8), ("Mixtral-8x7B", 4096, 2),
                                 ("GPT-OSS-120B", 2880, 4)]:
        sizes = []
        for ranks, tokens in columns:  # direct mode up to 8 ranks, hybrid mode over nodes of 8 beyond
            hybrid = ranks > 8
            topology = sizing.Topology.for_group(ranks // 8 if hybrid else 1, 8 if hybrid else ranks, hybrid)
            sizes.append(sizing.calculated_buffer_bytes(tokens, hidden, top_k, False, topology) * mib)
        expected = row(f"{model} ({hidden}, {top_k})", *[f"{size:.0f}" for size in sizes])
        assert expected in doc_text("memory.md"), expected
