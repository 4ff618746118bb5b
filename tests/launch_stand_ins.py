"""Stand-ins for checking a ``pretrain_gpt.py`` launch on CPU: ``torchrun`` for one rank in the calling process, and a
``pretrain_gpt.py`` that runs Megatron's argument handling up to the model's ``TransformerConfig`` and prints it (the
rest needs a GPU). Tests run a launch command as written with the stand-ins first on ``PATH`` / in the tree."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

from tests import preloaded_python

TORCHRUN = textwrap.dedent(
    """\
    #!/usr/bin/env bash
    # torchrun for one rank in this process: its options dropped, the rank's environment set
    while [ $# -gt 0 ]; do case "$1" in --nproc-per-node|--master-port|--master-addr) shift 2;; *) break;; esac; done
    export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1
    exec "$PYTHON" "$@"
    """
)
PRETRAIN_ARGUMENTS = textwrap.dedent(
    """
    import sys
    from megatron.core.transformer.moe import moe_layer
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args

    assert getattr(moe_layer.MoEFlexTokenDispatcher, "_deepepv2_plugin", False), "megatron_deepepv2.cli.run installs it"
    args = parse_args()
    validate_args(args)
    config = core_transformer_config_from_args(args)
    print("ARGV", sys.argv[1:3])
    print("CONFIG", config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend, config.num_moe_experts,
          config.gated_linear_unit, config.bias_activation_fusion, config.deterministic_mode, config.cuda_graph_impl)
    print("ROUTER", config.num_layers, config.moe_layer_freq, config.moe_router_score_function,
          config.moe_router_enable_expert_bias, config.moe_router_load_balancing_type, config.moe_router_num_groups,
          config.moe_router_group_topk, config.moe_router_topk_scaling_factor, config.moe_shared_expert_intermediate_size)
    # megatron-core 0.19 names the capture scope cuda_graph_modules; 0.17 and 0.18 cuda_graph_scope.
    scope = getattr(config, "cuda_graph_modules", None) or getattr(config, "cuda_graph_scope", None) or []
    scope = [scope] if isinstance(scope, str) else scope
    print("SHAPE", config.hidden_size, args.seq_length, args.micro_batch_size, config.num_moe_experts,
          config.moe_ffn_hidden_size, config.moe_aux_loss_coeff, [getattr(m, "name", m) for m in scope])
    """
)


def stand_in_launch(folder: Path, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """Writes the stand-ins into ``folder``.

    Args:
        folder: An empty folder.
        env: The environment to run the launch in.

    Returns:
        The Megatron-LM tree holding the stand-in ``pretrain_gpt.py``, and ``env`` with the stand-in ``torchrun``
        first on ``PATH`` and the interpreter it runs (:mod:`tests.preloaded_python`'s).
    """
    bin_dir, tree = folder / "bin", folder / "Megatron-LM"
    bin_dir.mkdir()
    tree.mkdir()
    (bin_dir / "torchrun").write_text(TORCHRUN)
    (bin_dir / "torchrun").chmod(0o755)
    (tree / "pretrain_gpt.py").write_text(PRETRAIN_ARGUMENTS)
    return tree, {**env, "PYTHON": preloaded_python.python(), "MASTER_PORT": "29999",
                  "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"}
