"""Determinism manifest: every kernel- or communication-bearing module of megatron-deepepv2 and its tests.

Standard library only, so tools can load it by file path without torch
(``tools/check_kernel_determinism_coverage.py``). A module is *kernel-bearing* when it is registered here or
when its code (comments and strings blanked) matches one of :data:`KERNEL_CONTENT_PATTERNS`: DeepEP buffer
calls, our backends' dispatch/combine calls, ``torch.autograd.Function`` subclasses, collectives,
non-deterministic-prone reductions and compiled kernels.

Every entry either names determinism tests (bit-exact replay tests under ``tests/determinism``) or says why
it is exempt. Changing a registered source without touching one of its tests fails the gate's change rule unless
the change carries the ``determinism-exempt`` label (a commit trailer ``Determinism-exempt: <why>``); ``make test``
runs the rule against the base of the change (``--base-ref auto``: the merge base with the upstream main branch,
else ``HEAD~1``) and, where there is no such history (a copy without its own ``.git``, a depth-1 clone), says so and
judges registration only.
"""

from __future__ import annotations

import io
import re
import tokenize
from dataclasses import dataclass
from typing import Optional

EXEMPT_LABEL = "determinism-exempt"

#: Files under these roots are scanned for kernel-bearing code.
SCANNED_ROOTS = ("megatron_deepepv2/",)
CODE_SUFFIXES = (".py",)


@dataclass(frozen=True)
class KernelEntry:
    """One registered kernel- or communication-bearing module.

    Attributes:
        name: Unique entry name.
        sources: Repository-relative source paths.
        tests: Determinism test paths covering the sources.
        kind: ``dispatch`` (communication), ``autograd`` (autograd ops), ``external-lib`` (DeepEP),
            ``torch-op`` or ``demo``.
        notes: What is (or is not) replayed bit-exactly.
        exempt_reason: Why no determinism test applies (mutually exclusive with ``tests``).
    """

    name: str
    sources: tuple[str, ...]
    tests: tuple[str, ...] = ()
    kind: str = "dispatch"
    notes: str = ""
    exempt_reason: Optional[str] = None


_REPLAY_TESTS = ("tests/determinism/test_replay.py", "tests/functional/deepep_cases.py")

KERNELS: tuple[KernelEntry, ...] = (
    KernelEntry(
        name="reference_backend",
        sources=("megatron_deepepv2/backends/reference.py",),
        tests=_REPLAY_TESTS,
        kind="dispatch",
        notes="all_to_all_single dispatch/combine; fixed row order and slot-order FP32 reductions.",
    ),
    KernelEntry(
        name="deepep_backend",
        sources=("megatron_deepepv2/backends/deepep/adapter.py", "megatron_deepepv2/backends/deepep/backend.py"),
        tests=_REPLAY_TESTS,
        kind="external-lib",
        notes="ElasticBuffer dispatch/combine (adapter.py) over the buffer backend.py builds (deterministic=False: "
        "deterministic mode orders rows itself; one all-reduce of a zero first, which creates the NCCL communicator "
        "DeepEP reuses); bit-exact only in deterministic mode (GPU cases of the replay suite).",
    ),
    KernelEntry(
        name="autograd_ops",
        sources=("megatron_deepepv2/ops.py",),
        tests=_REPLAY_TESTS,
        kind="autograd",
        notes="dispatch/combine autograd functions; forward and backward replayed.",
    ),
    KernelEntry(
        name="megatron_manager",
        sources=("megatron_deepepv2/mcore/manager.py", "megatron_deepepv2/mcore/bounded_receive.py",
                 "megatron_deepepv2/mcore/integration.py"),
        tests=_REPLAY_TESTS,
        kind="dispatch",
        notes="MoELayer with deepepv2 (expand and compact) replayed bit-exactly.",
    ),
    KernelEntry(
        name="sync_free_experts",
        sources=("megatron_deepepv2/mcore/experts.py", "megatron_deepepv2/mcore/expert_kernels.py",
                 "megatron_deepepv2/kernels.py"),
        tests=_REPLAY_TESTS + ("tests/unit/test_experts.py",),
        kind="torch-op",
        notes="SyncFreeSequentialMLP: torch._grouped_mm over device-side counts and row-bounded Triton activation x "
        "probs / tail-zeroing kernels (no atomics; each row's probability gradient is summed by one program in a "
        "fixed order); MoELayer replays (CPU) and CUDA-graph replay vs eager (GPU) bitwise.",
    ),
    KernelEntry(
        name="fp8_dispatch_quantiser",
        sources=("megatron_deepepv2/fp8.py",),
        tests=("tests/unit/test_fp8_dispatch.py", "tests/functional/deepep_cases.py"),
        kind="compiled-kernel",
        notes="e4m3 1x128 quantise / dequantise: elementwise Triton kernels, each block's amax reduced by one program "
        "(no atomics), IEEE-rounded divisions; bitwise equal to the PyTorch formulation (GPU test) and the "
        "block-by-block oracle, and the FP8 dispatch replays bitwise in a CUDA graph (GPU case).",
    ),
    KernelEntry(
        name="sync_free_deterministic_order",
        sources=("megatron_deepepv2/backends/deepep/receive_order.py",),
        tests=("tests/unit/test_receive_order.py", "tests/unit/test_deepep_adapter.py",
               "tests/functional/deepep_cases.py"),
        kind="torch-op",
        notes="DeepEP's deterministic receive order without host reads: integer keys, a scatter-add with at most one "
        "contribution per row (zeros into one spare slot) and a stable sort, exact by construction; equal to a dense "
        "per-expert sort (CPU) and to DeepEP's own deterministic mode, CUDA-graph replays bitwise (GPU cases).",
    ),
    KernelEntry(
        name="buffer_lifecycle_and_agreement",
        sources=(
            "megatron_deepepv2/buffers.py",
            "megatron_deepepv2/groups.py",
            "megatron_deepepv2/failures.py",
            "megatron_deepepv2/agreement.py",
            "megatron_deepepv2/validation.py",
            "megatron_deepepv2/expert_ids.py",
        ),
        exempt_reason="Integer MAX all-reduces of sizes and error flags: exact by construction, no data path.",
        kind="torch-op",
    ),
    KernelEntry(
        name="node_topology",
        sources=("megatron_deepepv2/backends/deepep/topology.py",),
        exempt_reason="One all_gather_object of node identities per group at the first buffer build: decides DeepEP's "
        "mode, no data path.",
        kind="torch-op",
    ),
    KernelEntry(
        name="demo",
        sources=("megatron_deepepv2/cli/demo.py",),
        exempt_reason="Demo training loop (broadcast / gradient all-reduce); not library code.",
        kind="demo",
    ),
)

#: Regexes over code with comments and strings blanked; a match marks a file kernel-bearing.
KERNEL_CONTENT_PATTERNS: tuple[tuple[str, re.Pattern], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("deepep-buffer-call", r"\b\w*buffer\s*\.\s*(dispatch|combine)\s*[(,)]"),  # called, or passed to a caller
        ("backend-call", r"\b\w*backend\s*\.\s*(dispatch|cached_dispatch|combine)\s*\("),
        ("autograd-function", r"\btorch\s*\.\s*autograd\s*\.\s*Function\b|\bautograd\.Function\b"),
        ("grouped-gemm", r"\btorch\s*\.\s*_grouped_mm\s*\("),
        (
            "collective",
            r"\b(dist|torch\s*\.\s*distributed)\s*\.\s*(all_to_all_single|all_to_all|all_reduce|all_gather\w*|"
            r"reduce_scatter\w*|broadcast|reduce|scatter|gather)\s*[(,)]",  # called, or passed to a runner
        ),
        ("scatter-add", r"\.\s*scatter_add_?\s*\("),
        ("index-add", r"\.\s*index_add_?\s*\("),
        ("index-put-accumulate", r"index_put_?\s*\([^)]*accumulate\s*=\s*True"),
        ("compiled-kernel", r"\btorch\s*\.\s*compile\s*\(|@\s*triton\s*\.\s*jit|\bload_inline\s*\("),
    )
)


def strip_comments_and_strings(source: str) -> str:
    """Blanks comments and string literals (docstrings included) so patterns only see code.

    Args:
        source: Python source text.

    Returns:
        The text with every comment and string token replaced by spaces (line structure kept). Text that
        does not tokenize is returned unchanged.
    """
    lines = source.splitlines(keepends=True)
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return source
    blanked = [list(line) for line in lines]
    for tok in tokens:
        if tok.type not in (tokenize.COMMENT, tokenize.STRING) and tok.type != getattr(tokenize, "FSTRING_MIDDLE", -1):
            continue
        (start_row, start_col), (end_row, end_col) = tok.start, tok.end
        for row in range(start_row, end_row + 1):
            line = blanked[row - 1]
            first = start_col if row == start_row else 0
            last = end_col if row == end_row else len(line)
            for col in range(first, min(last, len(line))):
                if line[col] != "\n":
                    line[col] = " "
    return "".join("".join(line) for line in blanked)


def kernel_patterns_in(source: str) -> list[str]:
    """Names of the kernel patterns found in ``source`` (comments and strings ignored)."""
    code = strip_comments_and_strings(source)
    return [name for name, pattern in KERNEL_CONTENT_PATTERNS if pattern.search(code)]


def entries_for(path: str) -> list[KernelEntry]:
    """Entries that register ``path`` as a source."""
    return [entry for entry in KERNELS if path in entry.sources]


def is_scanned(path: str) -> bool:
    """Whether ``path`` is library code the gate scans."""
    return path.startswith(SCANNED_ROOTS) and path.endswith(CODE_SUFFIXES)
