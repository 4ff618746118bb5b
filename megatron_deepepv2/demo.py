"""Compatibility entry point: ``python -m megatron_deepepv2.demo`` runs :mod:`megatron_deepepv2.cli.demo`."""

import gc

from megatron_deepepv2.cli.demo import main

if __name__ == "__main__":
    code = main()
    gc.freeze()  # exiting: skip the final garbage collection over torch's objects (as the tool's own entry does)
    raise SystemExit(code)
