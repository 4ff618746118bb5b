"""The "Verified" table: each capability of the package, and whether it ran on a GPU, on CPUs only, or never.

:data:`CAPABILITIES` is the one place that says so. Two renderings: the table with its evidence (``docs/verified.md``,
between the ``verified-table`` markers) and, for the README, the short names by status with a link to the table
(between the ``verified-summary`` markers). A capability that ran on a GPU names the JSON records of those runs in
``docs/``; the table's commit and date columns are read from what each JSON recorded when it was written
(``tools/_bench.provenance()``'s ``git_commit`` / ``git_dirty`` / ``date``, per run or for the whole document, or the
``commit`` / ``date`` of a record written by hand), never typed here: a JSON that recorded no commit shows "no
recorded commit". A capability tested on CPUs only names its tests; one never run names nothing. Adding a JSON to a
capability is one line: its path in ``jsons``.

::

    python tools/verified_table.py                          # the table, as markdown
    python tools/verified_table.py --write docs/verified.md  # replaces each marked block of the page
    python tools/verified_table.py --write README.md         # (the README has the summary's markers)
    python tools/verified_table.py --check README.md         # exit 1, with a diff, where the page's copy differs

A capability naming a JSON or a test file that does not exist is an error (exit 2), not a row without evidence.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- verified-table:start -->", "<!-- verified-table:end -->"
SUMMARY_START, SUMMARY_END = "<!-- verified-summary:start -->", "<!-- verified-summary:end -->"
#: The page with the whole table, which the summary links.
TABLE_PAGE = "docs/verified.md"

GPU, CPU, NEVER = "ran on a GPU", "CPU only", "never run"
STATUSES = (GPU, CPU, NEVER)

NO_COMMIT, NO_DATE = "no recorded commit", "no recorded date"
#: A commit as a record writes it: a short or full hash, alone or at the start of a sentence written by hand.
_HASH = re.compile(r"^([0-9a-f]{7,40})(?:-dirty)?\b")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}")


class VerifiedTableError(Exception):
    """A capability whose evidence is missing or does not fit its status."""


@dataclass(frozen=True)
class Capability:
    """One row of the table.

    Attributes:
        name: What the package does, as a user would ask for it (markdown).
        status: :data:`GPU`, :data:`CPU` or :data:`NEVER`.
        jsons: For :data:`GPU`: the records of the runs, paths from the repository root (at least one).
        tests: For :data:`CPU`: the test files or ``make`` targets that check it (at least one).
        note: What the status does not say (markdown), or "".
        short: The name in the README's summary (a few words), or "" for ``name``.
    """

    name: str
    status: str
    jsons: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    note: str = ""
    short: str = ""


#: Every capability, in the order the README lists them. GPU rows: the JSONs of their runs; CPU rows: their tests.
CAPABILITIES: tuple[Capability, ...] = (
    Capability("DeepEP 2.1.0 `ElasticBuffer` dispatch and combine in the expand layout at EP=1 (1x H200, a 1-rank NCCL "
               "group, megatron-core 0.19.2)", GPU,
               jsons=("docs/functional_h200_ep1.json", "docs/bench_hot_path_h200_ep1.json"),
               note="every functional case against the reference backend and alltoall; no NVLink traffic",
               short="DeepEP 2.1.0 `ElasticBuffer` at EP=1"),
    Capability("no host sync, and a MoE layer's forward + backward in a CUDA graph", GPU,
               jsons=("docs/functional_h200_ep1.json", "docs/training_rounds_gpt_moe_h200_ep1.json"),
               short="no host sync, CUDA graphs"),
    Capability("determinism with host sync (`--deterministic-mode`, bit-exact replays)", GPU,
               jsons=("docs/functional_h200_ep1.json",),
               short="determinism"),
    Capability("determinism without host sync, inside CUDA graphs", GPU,
               jsons=("docs/deterministic_order_h200_ep1.json", "docs/training_deterministic_graphs_h200_ep1.json"),
               short="determinism in CUDA graphs"),
    Capability("FP8 dispatch with BF16 gradients", GPU,
               jsons=("docs/functional_h200_ep1.json", "docs/fp8_sizing_h200_ep1.json",
                      "docs/bench_fp8_h200_ep1.json"),
               short="FP8 dispatch"),
    Capability("`SyncFreeSequentialMLP` experts; against `TEGroupedMLP` and TE's op fuser at the example models' "
               "shapes ([which experts](usage.md#which-experts))", GPU,
               jsons=("docs/bench_experts.json", "docs/training_rounds_gpt_moe_h200_ep1.json",
                      "docs/bench_experts_training_h100.json"),
               short="`SyncFreeSequentialMLP`"),
    Capability("Megatron-LM `pretrain_gpt.py` training at EP=1 against alltoall, and resumed from a checkpoint bit for "
               "bit", GPU,
               jsons=("docs/training_rounds_gpt_moe_h200_ep1.json",
                      "docs/training_rounds_qwen3_moe_router_h200_ep1.json", "docs/training_h200_ep1.json",
                      "docs/training_resume_h200_ep1.json"),
               short="`pretrain_gpt.py` training and resume"),
    Capability("Megatron-Core's own `TestFlexDispatcher` (core_v0.19.0) with `deepepv2` at EP=1", GPU,
               jsons=("docs/megatron_conformance_h200_ep1.json",),
               note="`make test-megatron`: DeepEP and the reference backend, with and without host sync; "
                    "[which cases run](conformance.md)",
               short="Megatron's own dispatcher tests"),
    Capability("the installer: DeepEP and NCCL built from source, and `--from-wheels`", GPU,
               jsons=("docs/install_deepep_h200.json",),
               short="the installer"),
    Capability("EP2 over NVLink (2x H200)", GPU, jsons=("docs/bench_T4096_H4096_E64_bf16.json",),
               note="once, on code older than the bound-dispatcher redesign",
               short="EP2 over NVLink (once, older code)"),
    Capability("Transformer Engine at EP=1 (1x H100): TE layers with `TEGroupedMLP` (host sync; also through TE's op "
               "fuser), fused permute, TE's FP8 recipes against BF16, deterministic mode, TE's partial CUDA graphs and "
               "whole TE layers in CUDA graphs; against alltoall, in functional cases and `pretrain_gpt.py` (rounds on "
               "three models, time to the first step); [what runs](usage.md#transformer-engine)", GPU,
               jsons=("docs/functional_te_h100_ep1.json", "docs/training_te_h100_ep1.json",
                      "docs/training_te_deterministic_h100_ep1.json", "docs/megatron_conformance_te_h100_ep1.json",
                      "docs/training_rounds_te_h100_ep1.json",
                      "docs/training_first_step_fresh_caches_gpt_moe_te_h100_ep1.json"),
               short="Transformer Engine (H100)"),
    Capability("the GPU suite, `make test` on 1x H100 with DeepEP: without Transformer Engine on a fresh machine, then "
               "with it", GPU, jsons=("docs/gpu_suite_h100_ep1.json", "docs/gpu_suite_te_rerun_h100_ep1.json"),
               short="the GPU suite with and without TE"),
    Capability("megatron-core 0.17.1 and 0.18.2", CPU,
               tests=("make test-compat", "tests/unit/test_megatron_integration.py", "tests/unit/test_no_host_sync.py",
                      "tests/unit/test_ep_overlap.py", "tests/cli/test_run_entry_point.py", "tests/cli/test_demo.py"),
               note="CI",
               short="megatron-core 0.17.1 and 0.18.2"),
    Capability("Megatron-LM `dev` with its own deepepv2 (`MEGATRON_DEEPEPV2_MANAGER`)", CPU,
               tests=("make test-native", "tests/unit/test_native_megatron.py"),
               short="Megatron-LM `dev`'s own deepepv2"),
    Capability("DeepEP V2.5 `EPBuffer`", CPU, tests=("tests/unit/test_deepep_adapter.py",),
               note="against a stand-in written from its sources",
               short="DeepEP V2.5 `EPBuffer`"),
    Capability("EP4, EP8 on one node", CPU, tests=("tests/unit/test_sizing.py", "tests/unit/test_topology.py"),
               note="buffer sizes for EP 1-64 against a model of DeepEP's arithmetic; the GPU case at node size "
                    "has never run",
               short="EP4 and EP8"),
    Capability("several nodes (DeepEP's hybrid mode)", CPU, tests=("tests/unit/test_topology.py",),
               note="the mode from each rank's node, over gloo ranks",
               short="several nodes"),
    Capability("Megatron's EP all-to-all overlap (combined 1F1B)", CPU, tests=("tests/unit/test_ep_overlap.py",),
               note="needs EP > 1",
               short="EP overlap (combined 1F1B)"),
    Capability("NCCL GIN over RDMA", NEVER,
               short="NCCL GIN over RDMA"),
    Capability("SM100 (Blackwell)", NEVER, note="built for",
               short="SM100 (Blackwell)"),
)


# ------------------------------------------------------------------------------------------ what a JSON records


@dataclass
class Recorded:
    """The commits and dates one JSON recorded.

    Attributes:
        commits: Short hashes in the order first recorded (``-dirty`` where the tree had uncommitted changes).
        dates: Days (``YYYY-MM-DD``) recorded.
        annotated: A record carries words written by hand beside its commit (a ``note``, or a sentence after the
            hash): the reader should read them in the JSON.
        missing: Some record says its commit is unknown.
    """

    commits: list[str] = field(default_factory=list)
    dates: list[str] = field(default_factory=list)
    annotated: bool = False
    missing: bool = False

    def add_commit(self, value: Any, dirty: Any = None) -> None:
        if not isinstance(value, str) or value in ("", "unknown"):
            self.missing = True
            return
        match = _HASH.match(value.strip())
        if not match:
            self.missing = self.annotated = True
            return
        if match.end() < len(value.strip()):
            self.annotated = True
        commit = match.group(1)[:7] + ("-dirty" if dirty is True or value.strip().startswith(f"{match.group(1)}-dirty")
                                       else "")
        if commit not in self.commits:
            self.commits.append(commit)

    def commit_cell(self) -> str:
        if not self.commits:
            return NO_COMMIT
        cell = ", ".join(self.commits) + ("\\*" if self.annotated else "")
        return cell + (f" (some records: {NO_COMMIT})" if self.missing else "")

    def date_cell(self) -> str:
        if not self.dates:
            return NO_DATE
        first, last = min(self.dates), max(self.dates)
        return first if first == last else f"{first} to {last}"


def _dicts(value: Any) -> Iterator[dict]:
    if isinstance(value, dict):
        yield value
        for item in value.values():
            yield from _dicts(item)
    elif isinstance(value, list):
        for item in value:
            yield from _dicts(item)


def recorded(document: Any) -> Recorded:
    """What a JSON document recorded of its commits and dates, wherever it keeps them: ``provenance`` dicts
    (``git_commit``, ``git_dirty``, ``date``; a report's ``git_commits`` and ``first_date``), per run or for the
    whole document, and records written by hand (``commit``, ``date``).

    Args:
        document: The parsed JSON.

    Returns:
        The commits and dates found; none found leaves both empty.
    """
    found = Recorded()
    for record in _dicts(document):
        if isinstance(record.get("git_commits"), list):
            for commit in record["git_commits"]:
                found.add_commit(commit)
        elif "git_commit" in record:
            found.add_commit(record["git_commit"], record.get("git_dirty"))
        if isinstance(record.get("commit"), str):
            found.add_commit(record["commit"])
        if "note" in record and any(key in record for key in ("git_commit", "git_commits", "commit")):
            found.annotated = True
        for key in ("date", "first_date"):
            value = record.get(key)
            if isinstance(value, str) and _DATE.match(value) and value[:10] not in found.dates:
                found.dates.append(value[:10])
    return found


def read_json(path: str, root: str = ROOT) -> Recorded:
    """:func:`recorded` of the JSON at ``path`` (from ``root``).

    Raises:
        VerifiedTableError: The file is missing or is not JSON.
    """
    full = os.path.join(root, path)
    try:
        with open(full) as f:
            return recorded(json.load(f))
    except FileNotFoundError:
        raise VerifiedTableError(f"{path} does not exist (from {root})") from None
    except json.JSONDecodeError as error:
        raise VerifiedTableError(f"{path} is not JSON: {error}") from None


# ------------------------------------------------------------------------------------------------- the table


def _check(capability: Capability, root: str) -> None:
    """Raises a :class:`VerifiedTableError` where ``capability``'s evidence does not fit its status or is missing."""
    where = f"capability {capability.name!r}"
    if capability.status not in STATUSES:
        raise VerifiedTableError(f"{where}: status {capability.status!r} is not one of {STATUSES}")
    if capability.status == GPU and (not capability.jsons or capability.tests):
        raise VerifiedTableError(f"{where}: a capability that ran on a GPU names the JSONs of its runs (and no tests)")
    if capability.status == CPU and (not capability.tests or capability.jsons):
        raise VerifiedTableError(f"{where}: a capability tested on CPU only names its tests (and no JSONs)")
    if capability.status == NEVER and (capability.jsons or capability.tests):
        raise VerifiedTableError(f"{where}: a capability never run names no JSONs and no tests")
    for path in capability.jsons + tuple(t for t in capability.tests if not t.startswith("make ")):
        if not os.path.exists(os.path.join(root, path)):
            raise VerifiedTableError(f"{where} names {path}, which does not exist (from {root})")


def _link(path: str, root: str, page_dir: str) -> str:
    return f"[{os.path.basename(path)}]({os.path.relpath(os.path.join(root, path), page_dir)})"


def table(capabilities: Sequence[Capability] = CAPABILITIES, root: str = ROOT,
          page_dir: Optional[str] = None) -> str:
    """The markdown table (and its legend) of ``capabilities``.

    Args:
        capabilities: The rows.
        root: The repository root the paths start from.
        page_dir: The folder of the page the table goes into, which its links are relative to (default: ``root``).

    Returns:
        The table, ending with a newline.

    Raises:
        VerifiedTableError: A capability's evidence is missing or does not fit its status.
    """
    page_dir = page_dir or root
    lines = ["| capability | status | evidence | commit | date |", "|---|---|---|---|---|"]
    for capability in capabilities:
        _check(capability, root)
        name = capability.name + (f": {capability.note}" if capability.note else "")
        if capability.status == GPU:
            records = [read_json(path, root) for path in capability.jsons]
            evidence = "<br>".join(_link(path, root, page_dir) for path in capability.jsons)
            commits = "<br>".join(r.commit_cell() for r in records)
            dates = "<br>".join(r.date_cell() for r in records)
            lines.append(f"| {name} | **{GPU}** | {evidence} | {commits} | {dates} |")
        elif capability.status == CPU:
            tests = ", ".join(f"`{test}`" for test in capability.tests)
            lines.append(f"| {name} | {CPU} | {tests} | - | - |")
        else:
            lines.append(f"| {name} | {NEVER} | - | - | - |")
    lines += ["", f"Commit and date as each JSON recorded them (\"{NO_COMMIT}\" where it recorded none; \\* marks "
              "words written by hand beside a commit: read them in the JSON). Written by `tools/verified_table.py "
              f"--write {TABLE_PAGE}` from its list of capabilities."]
    return "\n".join(lines) + "\n"


def summary(capabilities: Sequence[Capability] = CAPABILITIES, root: str = ROOT,
            page_dir: Optional[str] = None) -> str:
    """The README's summary: the short names of ``capabilities`` by status, and a link to the whole table.

    Raises:
        VerifiedTableError: A capability's evidence is missing or does not fit its status.
    """
    page_dir = page_dir or root
    for capability in capabilities:
        _check(capability, root)
    lines = []
    for status in STATUSES:
        names = [capability.short or capability.name for capability in capabilities if capability.status == status]
        if names:
            lines.append(f"- **{status}**: {'; '.join(names)}.")
    link = os.path.relpath(os.path.join(root, TABLE_PAGE), page_dir)
    lines += ["", f"Each with its evidence (the JSON of each GPU run, its commit and date; the tests of each CPU row): "
              f"[{os.path.basename(TABLE_PAGE)}]({link}). Written by `tools/verified_table.py --write README.md`."]
    return "\n".join(lines) + "\n"


#: Each kind of marked block: its markers and what fills it.
BLOCKS = ((START, END, table), (SUMMARY_START, SUMMARY_END, summary))


def _blocks(text: str, path: str) -> list[tuple[int, int, Any]]:
    """The marked blocks of ``text``: (where the content starts, where it ends, the function that fills it)."""
    found = []
    for start_marker, end_marker, render in BLOCKS:
        if start_marker not in text and end_marker not in text:
            continue
        start, end = text.find(start_marker), text.find(end_marker)
        if end < start or text.count(start_marker) != 1 or text.count(end_marker) != 1:
            raise VerifiedTableError(f"{path} needs exactly one {start_marker} followed by one {end_marker}")
        found.append((start + len(start_marker), end, render))
    if not found:
        raise VerifiedTableError(f"{path} has no {START} ... {END} or {SUMMARY_START} ... {SUMMARY_END} block")
    return sorted(found, key=lambda block: block[0])


def _regenerated(page: str, text: str, capabilities: Sequence[Capability], root: str) -> str:
    """``text`` with each of its marked blocks filled anew (links relative to ``page``'s folder)."""
    page_dir = os.path.dirname(os.path.abspath(page))
    pieces, done = [], 0
    for start, end, render in _blocks(text, page):
        pieces += [text[done:start], "\n" + render(capabilities, root, page_dir)]
        done = end
    return "".join(pieces) + text[done:]


def write(page: str, capabilities: Sequence[Capability] = CAPABILITIES, root: str = ROOT) -> bool:
    """Fills each marked block of ``page`` anew; True when the page changed."""
    with open(page) as f:
        text = f.read()
    new = _regenerated(page, text, capabilities, root)
    if new != text:
        with open(page, "w") as f:
            f.write(new)
    return new != text


def diff(page: str, capabilities: Sequence[Capability] = CAPABILITIES, root: str = ROOT) -> str:
    """The unified diff from ``page`` to the page with its marked blocks filled anew ("" when they agree)."""
    with open(page) as f:
        text = f.read()
    new = _regenerated(page, text, capabilities, root)
    return "".join(difflib.unified_diff(text.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"{page}", "tools/verified_table.py"))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="PAGE", help="replace the block between the markers of PAGE")
    action.add_argument("--check", metavar="PAGE", help="exit 1, printing a diff, where PAGE's block differs")
    args = parser.parse_args(argv)
    try:
        if args.write:
            print(f"{args.write}: {'updated' if write(args.write) else 'already up to date'}")
        elif args.check:
            difference = diff(args.check)
            if difference:
                print(difference, end="")
                print(f"{args.check} differs from the table: python tools/verified_table.py --write {args.check}",
                      file=sys.stderr)
                return 1
        else:
            print(table(), end="")
    except (VerifiedTableError, OSError) as error:
        print(f"verified_table: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
