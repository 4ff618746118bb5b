"""The command-line tools of megatron-deepepv2; a training step imports none of them.

* :mod:`.install_deepep` -- build and install DeepEP v2 (and NCCL), ending with the doctor:
  ``python -m megatron_deepepv2.cli.install_deepep --deepep-src PATH [--nccl-src PATH]``;
* :mod:`.doctor` -- environment checks, each with its fix: ``python -m megatron_deepepv2.cli.doctor [--json]``;
* :mod:`.demo` -- train a small MoE with alltoall and with deepepv2 and compare (``make demo``):
  ``python -m megatron_deepepv2.cli.demo``;
* :mod:`.run` -- the launch entry for unchanged training scripts (installs the backend, then runs the script):
  ``python -m megatron_deepepv2.cli.run SCRIPT [ARGS...]``.

These are the only commands: ``python -m megatron_deepepv2.cli.TOOL``, also installed as ``megatron-deepepv2-TOOL``
(``megatron-deepepv2-install-deepep``, ``-doctor``, ``-demo``, ``-run``). This file imports nothing: importing one
tool runs no other.
"""
