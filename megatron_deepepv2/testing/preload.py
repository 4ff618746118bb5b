"""What a server imports up front for the processes it forks (the demo's CPU ranks, the tests' ranks, the tests'
preloaded ``python``): the one source of their lists, so that none drifts from the others.

Every server's list is :func:`server_preload`'s: torch first, the package, the shared Megatron modules
(:data:`MEGATRON_PRELOAD`), :mod:`megatron_deepepv2.testing.frozen_preload` last; a caller that needs more, or less,
says so in its call (its own modules before or after the Megatron ones; no package, no freeze). A missing module is
skipped by every server, so the lists hold for every megatron-core release the package supports.

This file imports nothing: the tests' preloaded ``python`` reads it without importing the package (``tests/
preloaded_python.py``), which importing ``megatron_deepepv2.testing.preload`` would.
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
#: Imported first by every server: what each of its processes imports before anything else.
TORCH_PRELOAD = ("torch", "torch.distributed")
#: The package itself, imported after torch by a server whose processes use it.
PACKAGE_PRELOAD = "megatron_deepepv2"
#: Imported last by a forkserver: freezes what the server imported (see there).
FREEZE_PRELOAD = "megatron_deepepv2.testing.frozen_preload"


def server_preload(*, package: bool = True, before_megatron: tuple[str, ...] = (),
                   after_megatron: tuple[str, ...] = (), freeze: bool = True) -> list[str]:
    """The modules a server imports before it forks processes, in import order.

    Args:
        package: Whether the server imports the package (:data:`PACKAGE_PRELOAD`) after torch; a server whose
            processes must import it themselves leaves it out.
        before_megatron: The caller's own modules, imported before :data:`MEGATRON_PRELOAD`.
        after_megatron: The caller's own modules, imported after :data:`MEGATRON_PRELOAD`.
        freeze: Whether :data:`FREEZE_PRELOAD` comes last (a forkserver; a server that freezes its imports itself,
            after its own set-up, leaves it out).

    Returns:
        A new list of module names (``multiprocessing``'s ``set_forkserver_preload`` takes it as it is).
    """
    return [*TORCH_PRELOAD, *((PACKAGE_PRELOAD,) if package else ()), *before_megatron, *MEGATRON_PRELOAD,
            *after_megatron, *((FREEZE_PRELOAD,) if freeze else ())]
