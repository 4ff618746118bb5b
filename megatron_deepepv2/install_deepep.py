"""Compatibility entry point: ``python -m megatron_deepepv2.install_deepep`` runs :mod:`megatron_deepepv2.cli.install_deepep`."""

import sys

from megatron_deepepv2.cli.install_deepep import main

if __name__ == "__main__":
    sys.exit(main())
