"""The Megatron modules that a server preloads for the processes it forks (the demo's CPU ranks, the tests' ranks,
the tests' preloaded ``python``): the one list all three import up front, so that none drifts from the others.

Each server puts its own entries around it (torch first; the package and its harness modules; the Megatron
modules only it needs; :mod:`megatron_deepepv2.testing.frozen_preload` last). A missing module is skipped by every
server, so the list holds for every megatron-core release the package supports.
"""

#: What a Megatron MoE layer and the GPT layer specs import, in import order. Not ``megatron.training``: importing
#: it configures the root logger (to stdout), which a fresh interpreter only does when the run imports it.
MEGATRON_PRELOAD = (
    "megatron.core.parallel_state",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.models.gpt.gpt_layer_specs",
)
