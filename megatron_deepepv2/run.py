"""Compatibility entry point: ``python -m megatron_deepepv2.run`` runs :mod:`megatron_deepepv2.cli.run`."""

import sys

from megatron_deepepv2.cli.run import main

if __name__ == "__main__":
    sys.exit(main())
