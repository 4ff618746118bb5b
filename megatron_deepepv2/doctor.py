"""Compatibility entry point: ``python -m megatron_deepepv2.doctor`` runs :mod:`megatron_deepepv2.cli.doctor`."""

import sys

from megatron_deepepv2.cli.doctor import main

if __name__ == "__main__":
    sys.exit(main())
