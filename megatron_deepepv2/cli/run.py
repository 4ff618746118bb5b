"""Entry point for unchanged training scripts: ``python -m megatron_deepepv2.cli.run SCRIPT [ARGS...]``.

Installs the deepepv2 backend into megatron-core (:func:`megatron_deepepv2.install`), then runs SCRIPT as
``__main__`` with ``ARGS`` as its command line, so ``--moe-flex-dispatcher-backend deepepv2`` parses.
Works under ``torchrun`` too::

    torchrun --nproc-per-node 8 -m megatron_deepepv2.cli.run pretrain_gpt.py ... \\
        --moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepepv2

``-m MODULE`` runs a module instead of a script.

On a node without an RDMA NIC it sets ``EP_DISABLE_GIN=1`` before the target runs, unless the variable is set
already (:func:`megatron_deepepv2.cli.doctor.disable_gin_without_rdma`, one INFO line): DeepEP's buffer otherwise
asserts "NCCL GIN is unavailable". Processes the target starts inherit it.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Optional, Sequence

USAGE = "usage: python -m megatron_deepepv2.cli.run (SCRIPT | -m MODULE) [ARGS...]"


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Installs the plugin and runs the target.

    Args:
        argv: ``[SCRIPT, ARGS...]`` or ``["-m", MODULE, ARGS...]`` (default: ``sys.argv[1:]``).

    Returns:
        0 after the target returns normally; 2 on a usage error. The target's ``SystemExit`` propagates.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\n" + (__doc__ or ""), file=sys.stderr)
        return 0 if argv else 2
    run_module = argv[0] == "-m"
    if run_module and len(argv) < 2:
        print(USAGE, file=sys.stderr)
        return 2
    target = argv[1] if run_module else argv[0]
    if not run_module and not os.path.isfile(target):
        print(f"megatron_deepepv2.cli.run: script {target!r} does not exist.\n{USAGE}", file=sys.stderr)
        return 2

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import megatron_deepepv2  # noqa: PLC0415
    from megatron_deepepv2.cli.doctor import disable_gin_without_rdma  # noqa: PLC0415

    # Before the target runs: DeepEP reads EP_DISABLE_GIN when the target builds a buffer.
    disable_gin_without_rdma()
    megatron_deepepv2.install()
    if run_module:
        sys.argv = [target, *argv[2:]]
        # As `python -m` finds modules in the current directory (an installed command's path starts at its bin/).
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *argv[1:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
        runpy.run_path(target, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
