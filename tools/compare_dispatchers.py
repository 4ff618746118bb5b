#!/usr/bin/env python3
"""Every MoE dispatcher side by side, on Megatron MoE layers shaped like popular models' (one run, one machine).

Per model shape and tokens per rank, each variant builds the same megatron-core ``MoELayer`` (same weights and
routing: the first layer of a model is initialised, the others load its weights) and reports:

* ``path_us``: the dispatcher path alone (router, dispatch stages, identity experts, combine stages), forward +
  backward, median, slowest rank: the dispatchers compared without experts;
* ``layer_us``: the whole layer forward + backward, with the experts the row names (``expert_module``): Megatron's
  ``SequentialMLP`` (the local spec's) or ``SyncFreeSequentialMLP`` (``megatron_deepepv2.mcore.experts``: two grouped
  GEMMs; what deepepv2 without host sync needs);
* ``peak_mib``: peak GPU memory of the layer steps above the layer's weights and buffers (CUDA only);
* ``max_rel_diff``: the layer output against Megatron's ``alltoall`` (``SequentialMLP``) on the same input, relative
  to its largest magnitude (``matches`` when within the tolerance of the dtype), so that a fast row is also a right
  one;
* ratios, baseline time / row time (> 1: faster than the baseline): ``layer_speedup`` against ``layer_baseline``,
  the Megatron ``alltoall`` row with the SAME experts, eager (``alltoall`` for ``SequentialMLP`` rows,
  ``alltoall-syncfree`` for ``SyncFreeSequentialMLP`` rows), so that a layer ratio measures the dispatcher and not
  the experts; ``path_speedup`` against ``path_baseline``, ``alltoall``'s path; ``graph_speedup``, of a row replayed
  from CUDA graphs, against ``graph_baseline``, ``alltoall-syncfree-graphs`` (below) when that row ran, so that
  graphs are also compared with graphs.

Variants (:data:`VARIANTS`): Megatron's ``alltoall`` with either experts and ``allgather``; ``flex`` with ``deepep``
(DeepEP's v1 ``Buffer``) and ``hybridep`` where megatron-core finds them (otherwise the row says why not); ``flex`` +
``deepepv2`` (the expand layout, the one Megatron layers take) with host sync and either experts, without host sync,
and without host sync with the whole layer (dispatcher + ``SyncFreeSequentialMLP``) captured in one CUDA graph and
replayed, which only a dispatcher that never waits for the host allows (its comparisons: ``alltoall-syncfree``,
eager, and ``alltoall-syncfree-graphs``).

``alltoall-syncfree-graphs`` is Megatron's ``alltoall`` with ``SyncFreeSequentialMLP`` under the widest CUDA-graph
capture megatron-core (0.17 to 0.19) accepts for a dropless alltoall MoE layer with ``--cuda-graph-impl local``.
Capturing the whole layer (an empty ``cuda_graph_modules``) or ``moe`` fails for it: ``moe`` needs drop-and-pad
(``moe_pad_expert_input_to_capacity``, refused by ``TransformerConfig`` otherwise), and the alltoall dispatcher of a
dropless layer copies its token counts to the host and synchronises before its all-to-all and its expert split. The
widest partial scope is ``moe_router`` + ``moe_preprocess`` (the local implementation sets both when either is named):
``MoETransformerLayer`` (the MoE layer of Megatron's hybrid model specs; the ``TransformerLayer`` of its GPT specs
captures none of a MoE layer under the local implementation) then captures, forward and backward, its router stage
(pre-MLP layernorm, router, the dispatcher's ``dispatch_preprocess``; the dispatcher's tensors named in
``token_dispatcher.cudagraph_attrs`` leave the graph as outputs and are put back on it) and its postprocess stage
(``combine_postprocess``, bias-dropout-add), and runs ``token_dispatch``, the experts and the combine eagerly in
between, after recording an event behind the router graph and synchronising it (the dispatcher's host copies move to
``token_dispatch`` under that configuration). Here the layer is a bare ``MoELayer``, built with that configuration
(Megatron's own checks run on it), and its forward is cut where Megatron cuts it (:class:`MoEStages`, calling the
layer's ``route``, ``preprocess``, ``dispatch``, ``routed_experts_compute``, ``combine`` and ``postprocess``):
``torch.cuda.make_graphed_callables`` captures the route + preprocess stage (with the router's parameters) and the
postprocess stage, forward and backward (:class:`PartialGraphs`); what lies outside a bare ``MoELayer`` (layernorm,
bias-dropout-add) is not in them. Its layer baseline is ``alltoall-syncfree`` (same experts, eager).

On GPUs deepepv2 runs on ElasticBuffer (DeepEP v2) with ``--sms`` SMs (default: the package's default, the
``num_sms`` of ``megatron_deepepv2.DeepepV2Settings``, what a user gets); with ``--cpu`` (2 gloo processes, a smoke run of the
tool itself) on the reference backend, in FP32, without the rows replayed from CUDA graphs (they say why).

Prints progress, writes ``compare_dispatchers.json`` (the rows, with the run's SMs, git commit and date),
``compare_dispatchers.md`` (the tables, each ratio with its baseline) and ``compare_dispatchers.png`` to ``--out``,
after every variant (the plot after every model), so that a run cut short keeps what it measured::

    EP_DISABLE_GIN=1 torchrun --nproc-per-node 1 tools/compare_dispatchers.py --models qwen3-30b-a3b deepseek-v3 \\
        --tokens 4096 --out bench_out    # one GPU, EP=1; 2 or 8 GPUs: --nproc-per-node
    EP_DISABLE_GIN=1 torchrun --nproc-per-node 1 tools/compare_dispatchers.py --models qwen3-30b-a3b \\
        --variants alltoall-syncfree-graphs deepepv2-no-host-sync-layer-graph --out bench_out   # graphs vs graphs
    python tools/compare_dispatchers.py --cpu --models tiny --tokens 64 --out bench_out

On a GPU the layers are initialised there (Megatron's RNG tracker), once per model: a DeepSeek-V3 layer (256 experts,
7.5e9 parameters on one rank) initialised on the CPU took about 40 s per variant.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import _bench  # noqa: E402

logger = logging.getLogger("compare_dispatchers")

#: Seed of the first layer of each model (the others load its weights).
SEED = 11
SEQUENTIAL = "SequentialMLP"
SYNC_FREE = "SyncFreeSequentialMLP"
#: The graph scopes of the rows (``cuda_graph_scope`` in the JSON).
WHOLE_LAYER = "whole layer"
MEGATRON_PARTIAL = "moe_router+moe_preprocess"
GRAPH_SCOPES: dict[str, str] = {
    WHOLE_LAYER: "the whole layer forward + backward in one CUDA graph",
    MEGATRON_PARTIAL: "route + preprocess and postprocess in CUDA graphs, dispatch, experts and combine eager "
                      "(Megatron's widest capture of a dropless alltoall layer)",
}


@dataclass(frozen=True)
class ModelShape:
    """A model's MoE layer: hidden size, routed experts, top-k, expert FFN size."""

    hidden: int
    experts: int
    topk: int
    ffn: int


MODELS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(hidden=7168, experts=256, topk=8, ffn=2048),
    "qwen3-30b-a3b": ModelShape(hidden=2048, experts=128, topk=8, ffn=768),
    "mixtral-8x7b": ModelShape(hidden=4096, experts=8, topk=2, ffn=14336),
    "tiny": ModelShape(hidden=64, experts=8, topk=2, ffn=64),  # the CPU smoke shape
}


@dataclass(frozen=True)
class Variant:
    """One dispatcher configuration.

    Attributes:
        name: Row name.
        dispatcher: What :func:`~megatron_deepepv2.testing.moe_model.build_moe_layer` takes (``alltoall``,
            ``allgather`` or a flex backend name).
        description: What the row is, for the markdown and the JSON.
        no_host_sync: deepepv2 without host sync (needs ``sync_free_experts``).
        sync_free_experts: ``SyncFreeSequentialMLP`` experts instead of Megatron's ``SequentialMLP``.
        graph: Time a CUDA-graph replay of the whole layer step (needs ``no_host_sync``).
        partial_graphs: Megatron's widest CUDA-graph capture of a dropless ``alltoall`` layer (``--cuda-graph-impl
            local``, ``cuda_graph_modules`` ``moe_router`` + ``moe_preprocess``): the route + preprocess and the
            postprocess stages replayed from CUDA graphs, forward and backward, the rest eager
            (:class:`PartialGraphs`; needs the ``alltoall`` dispatcher).
        needs: The ``megatron.core.transformer.moe.fused_a2a`` flag the dispatcher needs, if any.
    """

    name: str
    dispatcher: str
    description: str
    no_host_sync: bool = False
    sync_free_experts: bool = False
    graph: bool = False
    partial_graphs: bool = False
    needs: Optional[str] = None

    def __post_init__(self) -> None:
        if self.no_host_sync and not self.sync_free_experts:
            raise ValueError(f"{self.name}: no host sync needs experts that take device-side counts")
        if self.graph and not self.no_host_sync:
            raise ValueError(f"{self.name}: a CUDA graph of the layer needs a dispatcher without host sync")
        if self.partial_graphs and (self.dispatcher != "alltoall" or self.graph):
            raise ValueError(f"{self.name}: the partial graphs are those of Megatron's alltoall layer, not of a "
                             "whole-layer graph")

    @property
    def expert_module(self) -> str:
        """The experts' class name."""
        return SYNC_FREE if self.sync_free_experts else SEQUENTIAL

    @property
    def graph_scope(self) -> Optional[str]:
        """What the row replays from CUDA graphs (:data:`GRAPH_SCOPES`), None for an eager row."""
        if self.graph:
            return WHOLE_LAYER
        return MEGATRON_PARTIAL if self.partial_graphs else None


VARIANTS = [
    Variant("alltoall", "alltoall", "Megatron's alltoall dispatcher, SequentialMLP experts: the reference of every "
            "row's output and the layer baseline of the SequentialMLP rows"),
    Variant("alltoall-syncfree", "alltoall", "Megatron's alltoall dispatcher with SyncFreeSequentialMLP experts: the "
            "layer baseline of the SyncFreeSequentialMLP rows", sync_free_experts=True),
    Variant("alltoall-syncfree-graphs", "alltoall", "Megatron's alltoall dispatcher with SyncFreeSequentialMLP "
            "experts under the widest CUDA-graph capture megatron-core accepts for a dropless alltoall MoE layer "
            "(--cuda-graph-impl local, cuda_graph_modules moe_router + moe_preprocess): the route + preprocess stage "
            "(router, dispatch_preprocess) and the postprocess stage (combine_postprocess) replayed from CUDA graphs, "
            "forward and backward; dispatch, experts and combine eager after one host synchronisation; the graph "
            "baseline of the rows replayed from CUDA graphs", sync_free_experts=True, partial_graphs=True),
    Variant("allgather", "allgather", "Megatron's allgather dispatcher, SequentialMLP experts"),
    Variant("flex-deepep-v1", "deepep", "Megatron's flex dispatcher on DeepEP v1 (Buffer), SequentialMLP experts",
            needs="HAVE_DEEP_EP"),
    Variant("flex-hybridep", "hybridep", "Megatron's flex dispatcher on HybridEP, SequentialMLP experts",
            needs="HAVE_HYBRIDEP"),
    Variant("deepepv2-expand", "deepepv2", "flex + deepepv2, expand layout, with host sync, SequentialMLP experts"),
    Variant("deepepv2-expand-syncfree", "deepepv2", "flex + deepepv2, expand layout, with host sync, "
            "SyncFreeSequentialMLP experts", sync_free_experts=True),
    Variant("deepepv2-expand-no-host-sync", "deepepv2", "flex + deepepv2, expand layout, without host sync, "
            "SyncFreeSequentialMLP experts", no_host_sync=True, sync_free_experts=True),
    Variant("deepepv2-no-host-sync-layer-graph", "deepepv2", "flex + deepepv2 without host sync, the whole layer "
            "(dispatcher + SyncFreeSequentialMLP experts) forward + backward captured in one CUDA graph and replayed, "
            "which only a dispatcher that never waits for the host allows; its comparisons are alltoall-syncfree, "
            "eager (layer ratio), and alltoall-syncfree-graphs, Megatron's widest capture of its alltoall layer, when "
            "that row ran (graph ratio)", no_host_sync=True, sync_free_experts=True, graph=True),
]

#: The layer baseline of each kind of experts: Megatron's alltoall with the same experts, eager.
LAYER_BASELINES: dict[str, str] = {v.expert_module: v.name for v in VARIANTS
                                   if v.dispatcher == "alltoall" and v.graph_scope is None}
#: The path baseline (identity experts: the dispatchers alone).
PATH_BASELINE = "alltoall"
#: The baseline of the rows replayed from CUDA graphs: Megatron's alltoall layer under its widest capture.
GRAPH_BASELINE = "alltoall-syncfree-graphs"


def unavailable_reason(variant: Variant, cuda: bool) -> Optional[str]:
    """Why ``variant`` cannot run in this process, or None."""
    if variant.needs is not None:
        from megatron.core.transformer.moe import fused_a2a  # noqa: PLC0415

        if not getattr(fused_a2a, variant.needs, False):
            return f"megatron-core's fused_a2a.{variant.needs} is False here (the backend's package is not installed)"
        if not cuda:
            return "needs CUDA GPUs"
    if variant.partial_graphs:
        reason = partial_graphs_unsupported()
        if reason is not None:
            return reason
    if variant.graph_scope is not None and not cuda:
        return "CUDA-graph replay needs CUDA GPUs"
    return None


# ------------------------------------------------------------------ Megatron's partial CUDA graphs, at the layer level

#: ``MoELayer.forward``'s stages, in its order (megatron-core 0.17 to 0.19 have them all): the partial graphs cut the
#: layer between them.
MOE_LAYER_STAGES = ("shared_experts_compute", "route", "preprocess", "dispatch", "routed_experts_compute", "combine",
                    "postprocess")


def partial_graphs_unsupported() -> Optional[str]:
    """Why the megatron-core in use cannot give the ``partial_graphs`` row, or None: its ``MoELayer`` must have the
    stages of its forward (:data:`MOE_LAYER_STAGES`) and its ``TransformerConfig`` the local CUDA-graph
    implementation with a module list (``cuda_graph_modules``, ``cuda_graph_scope`` before 0.18). The dispatcher's
    side (``cudagraph_attrs``, the device-to-host copies moved out of ``dispatch_preprocess``) is checked on the
    built layer (:func:`check_partial_graph_layer`)."""
    import dataclasses  # noqa: PLC0415

    from megatron.core.transformer.moe.moe_layer import MoELayer  # noqa: PLC0415
    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    version = _megatron_version()
    missing = [name for name in MOE_LAYER_STAGES if not callable(getattr(MoELayer, name, None))]
    if missing:
        return f"megatron-core {version}'s MoELayer has no {', '.join(missing)} (the stages the graphs cut it into)"
    fields = {field.name for field in dataclasses.fields(TransformerConfig)}
    if "cuda_graph_impl" not in fields or _graph_modules_field(fields) is None:
        return (f"megatron-core {version}'s TransformerConfig has no cuda_graph_impl with cuda_graph_modules (or "
                "cuda_graph_scope): no local partial CUDA graphs")
    return None


def _megatron_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown version)"


def _graph_modules_field(fields: set[str]) -> Optional[str]:
    """The ``TransformerConfig`` field of the graphed modules: ``cuda_graph_modules`` (0.18+), ``cuda_graph_scope``
    (0.17)."""
    return next((name for name in ("cuda_graph_modules", "cuda_graph_scope") if name in fields), None)


def partial_graph_config() -> dict:
    """The ``TransformerConfig`` fields of Megatron's widest partial capture of a MoE layer: the local implementation,
    ``moe_router`` + ``moe_preprocess`` (the local implementation sets both when either is named). Megatron's own
    checks refuse it where the preprocess copies counts to the host (token drop, router padding for FP8), and
    refuse ``moe`` (the whole MoE layer) and an empty list (the whole layer) for a dropless layer."""
    import dataclasses  # noqa: PLC0415

    from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: PLC0415

    field = _graph_modules_field({field.name for field in dataclasses.fields(TransformerConfig)})
    return {"cuda_graph_impl": "local", field: ["moe_router", "moe_preprocess"]}


def check_partial_graph_layer(layer) -> None:
    """Raises where the built layer cannot run its route + preprocess stage in a CUDA graph: its dispatcher must
    name the attributes the graph's outputs carry (``cudagraph_attrs``) and copy its counts to the host after that
    stage (``cuda_dtoh_point`` ``before_ep_alltoall``, which Megatron's alltoall dispatcher sets under this config);
    shared experts (an output of the graph in Megatron) and a latent projection are not staged here."""
    dispatcher = layer.token_dispatcher
    if not isinstance(getattr(dispatcher, "cudagraph_attrs", None), list):
        raise RuntimeError(f"{type(dispatcher).__name__} has no cudagraph_attrs (what a graph's outputs carry)")
    point = getattr(dispatcher, "cuda_dtoh_point", None)
    if point != "before_ep_alltoall":
        raise RuntimeError(f"{type(dispatcher).__name__} copies its counts to the host at {point!r}, inside the "
                           "graphed preprocess")
    if getattr(layer, "use_shared_expert", False) or getattr(layer.config, "moe_latent_size", None):
        raise RuntimeError("shared experts and latent projections are not staged by this tool")


def _attr_owner(dispatcher, name: str) -> tuple[object, str]:
    """The object that holds the dispatcher attribute ``name`` (dotted: ``shared_experts.gate_score``) and its leaf
    name, as Megatron's ``MoETransformerLayer`` resolves them."""
    parents, _, leaf = name.rpartition(".")
    owner = dispatcher
    for parent in parents.split(".") if parents else ():
        owner = getattr(owner, parent)
    return owner, leaf


def dispatcher_graph_attrs(dispatcher) -> tuple[tuple[str, ...], list[torch.Tensor]]:
    """The dispatcher's ``cudagraph_attrs`` that hold tensors now, and those tensors: what the route + preprocess
    graph's outputs carry (megatron-core 0.19's ``MoETransformerLayer._get_token_dispatcher_attrs``), since a replay
    runs no Python and sets none of them."""
    names, tensors = [], []
    for name in dispatcher.cudagraph_attrs:
        owner, leaf = _attr_owner(dispatcher, name)
        value = getattr(owner, leaf, None)
        if torch.is_tensor(value):
            names.append(name)
            tensors.append(value)
    return tuple(names), tensors


def restore_dispatcher_attrs(dispatcher, names: tuple[str, ...], tensors: list[torch.Tensor]) -> None:
    """Sets the dispatcher's attributes ``names`` to ``tensors`` (a graph's outputs), as Megatron does before the
    eager stage (``MoETransformerLayer._restore_token_dispatcher_attrs``)."""
    if len(names) != len(tensors):
        raise ValueError(f"{len(tensors)} dispatcher tensors for {len(names)} attributes {names}")
    for name, tensor in zip(names, tensors):
        owner, leaf = _attr_owner(dispatcher, name)
        setattr(owner, leaf, tensor)


class MoEStages:
    """A megatron-core ``MoELayer``'s forward cut where Megatron's partial CUDA graphs cut it, each stage calling the
    layer's own methods in the order of its ``forward`` (``custom_forward``):

    * :meth:`route_and_preprocess` (``fwd_execution_map`` ``"route"``, graphed): ``shared_experts_compute`` (nothing
      here), ``route`` (the router), ``preprocess`` (``token_dispatcher.dispatch_preprocess``); returns the permuted
      tokens and probabilities, then the dispatcher's tensors named in ``cudagraph_attrs``;
    * :meth:`expert_compute` (``"expert_compute"``, eager): puts those tensors back on the dispatcher, then
      ``dispatch``, ``routed_experts_compute`` (``dispatch_postprocess``, experts, ``combine_preprocess``),
      ``combine`` (``token_combine``);
    * :meth:`postprocess` (``"postprocess"``, graphed): ``postprocess`` (``combine_postprocess``).

    Run eagerly one after the other (:func:`staged_step`) they compute what the layer's forward computes, bit for
    bit.
    """

    def __init__(self, layer) -> None:
        self.layer = layer
        #: The dispatcher attributes the first :meth:`route_and_preprocess` returned (every later call returns the
        #: same: a graph's outputs are fixed at its capture).
        self.attr_names: Optional[tuple[str, ...]] = None

    def route_and_preprocess(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The route + preprocess stage: ``(tokens, probs, *dispatcher tensors)``."""
        layer = self.layer
        shared_expert_output = layer.shared_experts_compute(hidden_states)
        if shared_expert_output is not None:
            raise RuntimeError("shared experts are not staged by this tool")
        probs, routing_map = layer.route(hidden_states)
        hidden, probs = layer.preprocess(hidden_states, probs, routing_map)
        names, tensors = dispatcher_graph_attrs(layer.token_dispatcher)
        if self.attr_names is None:
            self.attr_names = names
        elif names != self.attr_names:
            raise RuntimeError(f"the dispatcher's tensors changed from {self.attr_names} to {names}")
        return (hidden, probs, *tensors)

    def expert_compute(self, hidden: torch.Tensor, probs: torch.Tensor,
                       dispatcher_tensors: list[torch.Tensor]) -> torch.Tensor:
        """The eager stage: the dispatcher's tensors restored, then dispatch, experts, combine."""
        layer = self.layer
        restore_dispatcher_attrs(layer.token_dispatcher, self.attr_names, dispatcher_tensors)
        dispatched, probs = layer.dispatch(hidden, probs)
        output, mlp_bias = layer.routed_experts_compute(dispatched, probs)
        if mlp_bias is not None:
            raise RuntimeError("an expert bias is not staged by this tool")
        return layer.combine(output)

    def postprocess(self, output: torch.Tensor) -> torch.Tensor:
        """The postprocess stage: the layer's output."""
        return self.layer.postprocess(output, None)


def staged_forward(stages: MoEStages, x: torch.Tensor, route_stage: Optional[Callable] = None,
                   postprocess_stage: Optional[Callable] = None,
                   host_wait: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """The layer's forward in Megatron's partial-graph order (``MoETransformerLayer._forward_mlp``): the route +
    preprocess stage, the host's wait, the eager stage, the postprocess stage.

    Args:
        stages: The layer's stages.
        x: The layer's input.
        route_stage: Runs the route + preprocess stage (a graph's replay); ``stages.route_and_preprocess`` for None.
        postprocess_stage: Runs the postprocess stage; ``stages.postprocess`` for None.
        host_wait: Called between the first stage and the eager one (Megatron records an event after the router
            graph and synchronises it); nothing for None.

    Returns:
        The layer's output.
    """
    hidden, probs, *dispatcher_tensors = (route_stage or stages.route_and_preprocess)(x)
    if host_wait is not None:
        host_wait()
    output = stages.expert_compute(hidden, probs, dispatcher_tensors)
    return (postprocess_stage or stages.postprocess)(output)


def staged_step(stages: MoEStages, x: torch.Tensor, grad: torch.Tensor, route_stage: Optional[Callable] = None,
                postprocess_stage: Optional[Callable] = None,
                host_wait: Optional[Callable[[], None]] = None) -> torch.Tensor:
    """One forward + backward of the layer from cleared gradients, staged (:func:`staged_forward`): what
    :func:`~megatron_deepepv2.testing.moe_model.layer_step` does with ``layer(x)``.

    Returns:
        The output.
    """
    for param in stages.layer.parameters():
        param.grad = None
    x.grad = None
    output = staged_forward(stages, x, route_stage, postprocess_stage, host_wait)
    output.backward(grad)
    return output


class _StageModule(torch.nn.Module):
    """A stage as the module ``torch.cuda.make_graphed_callables`` takes: ``params`` (the router) registered, so
    that the graphed backward computes their gradients too."""

    def __init__(self, fn: Callable, params: torch.nn.Module) -> None:
        super().__init__()
        self.params = params
        object.__setattr__(self, "_fn", fn)  # not a submodule

    def forward(self, *args: torch.Tensor):
        return self._fn(*args)


class PartialGraphs:
    """Megatron's partial CUDA graphs of a dropless ``alltoall`` MoE layer, at the layer level (CUDA only).

    ``torch.cuda.make_graphed_callables`` captures the forward and the backward of the route + preprocess stage (the
    router's parameters in it) and of the postprocess stage (:class:`MoEStages`); a step (:meth:`step`) replays the
    first, records an event and synchronises it (as ``MoETransformerLayer`` does after its router graph), runs
    dispatch, experts and combine eagerly with the dispatcher's tensors taken from the graph's outputs, replays the
    second; the backward replays their backward graphs around the eager stage's.

    The layer must be built with :func:`partial_graph_config` (the dispatcher then copies its counts to the host in
    ``token_dispatch``, outside the graph). Every replay writes the same memory: the input of the postprocess graph
    is copied in, and the dispatcher's tensors it reads are the first graph's outputs. The gradient accumulators of
    the input and the router's weight date from the capture, on its stream: PyTorch warns once that they differ from
    the replay's stream, and orders the two streams (the backward ends synchronised with the current stream).
    """

    def __init__(self, layer, x: torch.Tensor, warmup_iters: int = 3) -> None:
        check_partial_graph_layer(layer)
        self.stages = MoEStages(layer)
        self._event = torch.cuda.Event()
        self.route = torch.cuda.make_graphed_callables(
            _StageModule(self.stages.route_and_preprocess, layer.router), (x,), num_warmup_iters=warmup_iters)
        # One replay puts the dispatcher's tensors at the first graph's outputs, where the postprocess graph's
        # capture reads them; its eager stage gives the postprocess graph's sample input.
        with torch.no_grad():
            hidden, probs, *dispatcher_tensors = self.route(x)
            self.host_wait()
            combined = self.stages.expert_compute(hidden, probs, dispatcher_tensors)
        self.postprocess = torch.cuda.make_graphed_callables(
            self.stages.postprocess, (combined.detach().requires_grad_(),), num_warmup_iters=warmup_iters)

    def host_wait(self) -> None:
        """The host waits for the first graph (Megatron's ``_router_dtoh_event``)."""
        self._event.record()
        self._event.synchronize()

    def step(self, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """One forward + backward from cleared gradients; returns the output (the postprocess graph's memory)."""
        return staged_step(self.stages, x, grad, self.route, self.postprocess, self.host_wait)


def selected_variants(names: Optional[list[str]]) -> list[Variant]:
    """The variants ``--variants`` names (all for None), with the baselines their rows need: ``alltoall`` always
    (the output reference), ``alltoall-syncfree`` when a selected row has sync-free experts."""
    if names is None:
        return list(VARIANTS)
    chosen = set(names) | {PATH_BASELINE}
    chosen |= {LAYER_BASELINES[v.expert_module] for v in VARIANTS if v.name in chosen}
    return [v for v in VARIANTS if v.name in chosen]


def _build_layer(variant: Variant, model: ModelShape, max_tokens: int, args: argparse.Namespace, cuda: bool,
                 weights: dict):
    """The layer of ``variant``: the first of a model (``weights`` empty) initialised, its weights then kept in
    ``weights``; the others allocated without initialisation and loaded from ``weights`` (same parameters)."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import TinyMoEConfig, build_moe_layer  # noqa: PLC0415

    if variant.dispatcher == "deepepv2":
        dv2.configure(backend="deepep" if cuda else "reference", host_sync=not variant.no_host_sync,
                      num_max_tokens_per_rank=max_tokens, num_sms=args.sms)
    extra: dict = {"perform_initialization": not weights}
    if variant.partial_graphs:
        extra.update(partial_graph_config())  # Megatron's own checks of the capture run on it
    if cuda:
        # Parameters allocated (and the first layer initialised) on the GPU: a DeepSeek-V3 layer on one rank
        # holds 7.5e9 parameters, which the CPU initialises in about 40 s.
        extra["use_cpu_initialization"] = False
        if not weights:
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: PLC0415

            model_parallel_cuda_manual_seed(SEED)  # the expert weights come from Megatron's RNG tracker
    shape = TinyMoEConfig(hidden=model.hidden, ffn=model.ffn, num_experts=model.experts, topk=model.topk,
                          params_dtype=torch.bfloat16 if cuda else torch.float32, extra=extra)
    layer = build_moe_layer(shape, variant.dispatcher, seed=SEED, sync_free_experts=variant.sync_free_experts)
    if variant.partial_graphs:
        check_partial_graph_layer(layer)
    if weights:
        layer.load_state_dict(weights, strict=True)
    else:
        # SequentialMLP's keys either way (SyncFreeSequentialMLP loads and saves them too).
        weights.update({key: value.detach().clone() if isinstance(value, torch.Tensor) else value
                        for key, value in layer.state_dict().items()})
    return layer


def measure_variant(variant: Variant, model: ModelShape, tokens_list: list[int], references: dict[int, torch.Tensor],
                    weights: dict, args: argparse.Namespace, cuda: bool) -> list[dict]:
    """Builds the layer of ``variant`` once and times it at every token count.

    Args:
        variant: The dispatcher configuration.
        model: Layer shape.
        tokens_list: Tokens per rank to measure.
        references: Per token count, the ``alltoall`` layer output on this rank's input (filled in by the
            ``alltoall`` variant, which runs first).
        weights: The model's layer weights (filled in by the first variant, which runs first: ``alltoall``).
        args: ``--iters``, ``--warmup``, ``--sms``.
        cuda: GPUs (BF16; ElasticBuffer for deepepv2) or CPU (FP32; reference backend).

    Returns:
        One row per token count. A layer Megatron refuses to build (the same on every rank) gives rows that say why.
    """
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.mcore.manager import dispatch_config_for  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import capture_layer_step, dispatcher_path_step, layer_step  # noqa: PLC0415

    start = time.perf_counter()
    try:
        layer = _build_layer(variant, model, max(tokens_list), args, cuda, weights)
    except Exception as error:  # noqa: BLE001 - a configuration Megatron rejects: recorded, the run goes on
        dv2.configure(host_sync=True)
        reason = f"build failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        logger.info("   %-34s not run: %s", variant.name, reason)
        return [{"variant": variant.name, "tokens": tokens, "unavailable": reason} for tokens in tokens_list]
    logger.info("   %-34s built in %.1f s", variant.name, time.perf_counter() - start)
    dtype = next(layer.parameters()).dtype
    device = next(layer.parameters()).device
    # What the layer really holds (the baselines are paired on it).
    expert_module = type(layer.experts).__name__
    num_sms = dispatch_config_for(layer.config).settings.num_sms if variant.dispatcher == "deepepv2" else None

    def time_call(fn: _bench.Step) -> float:
        return _bench.median_us(fn, args.iters, args.warmup, cuda=cuda)

    rows = []
    for tokens in tokens_list:
        gen = torch.Generator().manual_seed(1000 * tokens + dist.get_rank())
        x = torch.randn(tokens, 1, model.hidden, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        grad = torch.ones_like(x)
        row: dict = {"variant": variant.name, "tokens": tokens, "expert_module": expert_module,
                     "cuda_graph": variant.graph_scope is not None}
        if variant.graph_scope is not None:
            row["cuda_graph_scope"] = variant.graph_scope
        if num_sms is not None:
            row["num_sms"] = num_sms
        layer.zero_grad(set_to_none=True)  # the peak is measured above the weights alone, at every token count
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        if variant.graph:
            graph, static_output = capture_layer_step(layer, x, grad)
            row["layer_us"] = time_call(graph.replay)
            graph.replay()
            output = static_output.detach().clone()
            del graph
        elif variant.partial_graphs:
            graphs = PartialGraphs(layer, x)
            row["layer_us"] = time_call(lambda: graphs.step(x, grad))
            output = graphs.step(x, grad).detach().clone()
            del graphs
        else:
            row["path_us"] = time_call(lambda: dispatcher_path_step(layer, x))
            row["layer_us"] = time_call(lambda: layer_step(layer, x, grad))
            output = layer_step(layer, x, grad).detach()
        if cuda:
            torch.cuda.synchronize()
            row["peak_mib"] = _bench.max_over_ranks((torch.cuda.max_memory_allocated() - before) / 2**20, cuda)
        if variant.name == "alltoall":
            references[tokens] = output
        elif tokens in references:
            reference = references[tokens]
            scale = float(reference.float().abs().max()) or 1.0
            row["max_rel_diff"] = _bench.max_over_ranks(
                float((output.float() - reference.float()).abs().max()) / scale, cuda)
            row["matches"] = row["max_rel_diff"] <= (5e-2 if dtype == torch.bfloat16 else 1e-4)
        rows.append(row)
        logger.info("   %-34s T%-6d %s", variant.name, tokens, ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()
            if k not in ("variant", "tokens", "cuda_graph", "cuda_graph_scope")))
    del layer
    dv2.destroy_buffers()
    dv2.configure(host_sync=True)
    return rows


def add_ratios(rows: list[dict]) -> list[dict]:
    """Sets each measured row's ratios (baseline time / row time; > 1: faster than the baseline), in place.

    ``layer_speedup`` is against ``layer_baseline``: of the same model and tokens, the Megatron ``alltoall`` row whose
    layer holds the same experts (:data:`LAYER_BASELINES`, paired on the row's ``expert_module``, the class the layer
    really held). ``path_speedup`` is against ``path_baseline``: ``alltoall``'s dispatcher path (identity experts).
    ``graph_speedup``, of a row replayed from CUDA graphs (``cuda_graph``), is against ``graph_baseline``:
    :data:`GRAPH_BASELINE` (Megatron's alltoall layer under its widest capture) with the same experts, when that row
    ran, so that graphs are also compared with graphs. A baseline row gets no ratio against itself.

    Returns:
        ``rows``.
    """
    measured = {(r["model"], r["tokens"], r["variant"]): r for r in rows if "layer_us" in r}
    for row in measured.values():
        key = (row["model"], row["tokens"])
        layer_baseline = LAYER_BASELINES.get(row["expert_module"])
        base = measured.get((*key, layer_baseline))
        if base is not None and base is not row and base["expert_module"] == row["expert_module"]:
            row["layer_baseline"] = layer_baseline
            row["layer_speedup"] = base["layer_us"] / row["layer_us"]
        base = measured.get((*key, PATH_BASELINE))
        if "path_us" in row and base is not None and base is not row and "path_us" in base:
            row["path_baseline"] = PATH_BASELINE
            row["path_speedup"] = base["path_us"] / row["path_us"]
        base = measured.get((*key, GRAPH_BASELINE))
        if (row.get("cuda_graph") and base is not None and base is not row
                and base["expert_module"] == row["expert_module"]):
            row["graph_baseline"] = GRAPH_BASELINE
            row["graph_speedup"] = base["layer_us"] / row["layer_us"]
    return rows


def compare(args: argparse.Namespace, cuda: bool,
            after_variant: Optional[Callable[[list[dict], bool], None]] = None) -> list[dict]:
    """All rows, models x variants x tokens (in an initialised process group with Megatron's EP state).

    ``after_variant`` gets the rows so far after each variant, and whether that variant ended a model (the outputs
    are rewritten then, so that a run cut short keeps what it measured).
    """
    rows: list[dict] = []
    variants = selected_variants(args.variants)
    start = time.perf_counter()
    for model_name in args.models:
        model = MODELS[model_name]
        logger.info("== %s (hidden %d, %d experts, top-%d, FFN %d), tokens per rank %s (%.0f s so far)", model_name,
                    model.hidden, model.experts, model.topk, model.ffn, args.tokens, time.perf_counter() - start)
        base = {"model": model_name, **asdict(model)}
        references: dict[int, torch.Tensor] = {}
        weights: dict = {}
        for index, variant in enumerate(variants):
            reason = unavailable_reason(variant, cuda)
            if reason is not None:
                logger.info("   %-34s not run: %s", variant.name, reason)
                measured = [{"variant": variant.name, "tokens": t, "unavailable": reason} for t in args.tokens]
            else:
                measured = measure_variant(variant, model, args.tokens, references, weights, args, cuda)
            rows += [{**base, **row} for row in measured]
            add_ratios(rows)
            if after_variant is not None:
                after_variant(rows, index == len(variants) - 1)
        del weights, references
        if cuda:
            torch.cuda.empty_cache()
    logger.info("== done in %.0f s", time.perf_counter() - start)
    return rows


#: What the table and the plot add to the time of a row replayed from CUDA graphs.
_GRAPH_NOTES = {WHOLE_LAYER: " (CUDA graph)", MEGATRON_PARTIAL: " (partial CUDA graphs)"}
_GRAPH_LABELS = {WHOLE_LAYER: "whole layer in a CUDA graph", MEGATRON_PARTIAL: "route+preprocess, postprocess graphed"}


def _ratio(row: dict, kind: str) -> str:
    if f"{kind}_speedup" not in row:
        return "-"
    return f"{row[f'{kind}_speedup']:.2f}x vs {row[f'{kind}_baseline']}"


def markdown(rows: list[dict], meta: Optional[dict] = None) -> str:
    """The tables: one per (model, tokens), each ratio with the baseline it was taken against."""
    meta = meta or {}
    commit = meta.get("git_commit") or "unknown commit"
    if meta.get("git_dirty"):
        commit += " (uncommitted changes)"
    lines = [f"{meta.get('date', '')}, {meta.get('device', '?')}, EP={meta.get('world_size', '?')}, deepepv2 on "
             f"{meta.get('deepepv2_num_sms', '?')} SMs, {commit}; median of {meta.get('iters', '?')} after "
             f"{meta.get('warmup', '?')} warm-ups, slowest rank.", "",
             "Ratios are baseline time / row time (> 1: faster than the baseline). **layer**: against Megatron's "
             "alltoall with the same experts (`alltoall` for SequentialMLP rows, `alltoall-syncfree` for "
             "SyncFreeSequentialMLP rows), so that it measures the dispatcher, not the experts. **path** (router, "
             "dispatch, identity experts, combine: the dispatchers alone): against `alltoall`'s path. **graph**, of "
             f"a row replayed from CUDA graphs: against `{GRAPH_BASELINE}` (Megatron's alltoall layer under its "
             "widest CUDA-graph capture, same experts) when that row ran, so that graphs are compared with graphs.",
             "", "Variants:"]
    present = {r["variant"] for r in rows}
    lines += [f"- `{v.name}`: {v.description}." for v in VARIANTS if v.name in present]
    lines.append("")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["model"], row["tokens"]), []).append(row)
    for (model, tokens), group in groups.items():
        lines += [f"### {model}, {tokens} tokens per rank", "",
                  "| variant | expert module | path fwd+bwd (us) | path ratio | layer fwd+bwd (us) | layer ratio | "
                  "graph ratio | peak (MiB) | output vs alltoall |", "|---|---|---|---|---|---|---|---|---|"]
        for r in group:
            if "unavailable" in r:
                lines.append(f"| {r['variant']} | | not run: {r['unavailable']} | | | | | | |")
                continue
            match = ("" if "max_rel_diff" not in r
                     else f"{r['max_rel_diff']:.1e} ({'ok' if r['matches'] else 'DIFFERS'})")
            path_us = f"{r['path_us']:.0f}" if "path_us" in r else "-"
            layer_us = f"{r['layer_us']:.0f}" + _GRAPH_NOTES.get(r.get("cuda_graph_scope"), "")
            peak = f"{r['peak_mib']:.0f}" if "peak_mib" in r else "-"
            lines.append(f"| {r['variant']} | {r['expert_module']} | {path_us} | {_ratio(r, 'path')} | {layer_us} | "
                         f"{_ratio(r, 'layer')} | {_ratio(r, 'graph')} | {peak} | {match} |")
        lines.append("")
    return "\n".join(lines)


def bar_label(variant: str, expert_module: str, graph_scope: Optional[str] = None) -> str:
    """The plot's label of a variant's bars: its name, the expert module its layer held, and what it replays from
    CUDA graphs, e.g. ``alltoall-syncfree (SyncFreeSequentialMLP)``."""
    return f"{variant} ({expert_module}" + (f"; {_GRAPH_LABELS[graph_scope]}" if graph_scope else "") + ")"


def bar_series(rows: list[dict], groups: list[tuple]) -> tuple[dict[str, list[float]], list[bool]]:
    """The plot's bars: per measured variant (in :data:`VARIANTS` order), its label (:func:`bar_label`, with the
    expert module the rows' layer really held) and its layer time in ms per ``(model, tokens)`` group (0 where it
    did not run there); and per series whether its experts are ``SyncFreeSequentialMLP`` (hatched)."""
    series: dict[str, list[float]] = {}
    hatched: list[bool] = []
    for v in VARIANTS:
        measured = [r for r in rows if r["variant"] == v.name and "layer_us" in r]
        if not measured:
            continue
        values = [next((r["layer_us"] / 1000 for r in measured if (r["model"], r["tokens"]) == group), 0.0)
                  for group in groups]
        expert_module = measured[0].get("expert_module", v.expert_module)
        series[bar_label(v.name, expert_module, measured[0].get("cuda_graph_scope"))] = values
        hatched.append(expert_module == SYNC_FREE)
    if not series:
        return {"nothing measured": [0.0] * len(groups)}, [False]
    return series, hatched


def plot(document: dict, path: str) -> None:
    """Bars of each variant's layer time per (model, tokens), in ms, log scale; SyncFreeSequentialMLP rows hatched
    (variants not run anywhere left out)."""
    rows = document["rows"]
    where = (f"{document.get('device', '')}, EP={document.get('world_size', '?')}, deepepv2 on "
             f"{document.get('deepepv2_num_sms', '?')} SMs")
    groups = sorted({(r["model"], r["tokens"]) for r in rows}, key=str)
    fig, ax = _bench.new_figure(max(9, 3 * len(groups)), 6)
    series, hatched = bar_series(rows, groups)
    _bench.grouped_bars(ax, [f"{m}\nT{t}" for m, t in groups], series, fontsize=7)
    for container, hatch in zip(ax.containers, hatched):
        for bar in container:
            bar.set_hatch("//" if hatch else "")
    ax.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    if any(any(values) for values in series.values()):
        ax.set_yscale("log")
    ax.set_ylabel("MoE layer forward + backward, ms (median, log scale)")
    ax.set_title(f"Dispatchers side by side ({where}), lower is better\n"
                 "compare bars with the same experts (hatched: SyncFreeSequentialMLP)", fontsize=9)
    _bench.save_figure(fig, path)


def write_outputs(rows: list[dict], out: str, meta: dict, with_plot: bool = True) -> None:
    """Writes the markdown tables, the JSON (``meta`` and the rows) and, ``with_plot``, the PNG to ``out``."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "compare_dispatchers.md"), "w") as f:
        f.write(markdown(rows, meta))
    _bench.write_outputs(out, "compare_dispatchers", {**meta, "rows": rows}, plot if with_plot else None)


def run_metadata(args: argparse.Namespace, cuda: bool) -> dict:
    """What the JSON says about the run: settings, SMs, commit, date, versions, variants and their baselines."""
    versions = _bench.software_versions()
    return {
        **_bench.provenance(__file__),
        "deepepv2_backend": "deepep (ElasticBuffer)" if cuda else "reference",
        "deepepv2_num_sms": args.sms,
        "dtype": "bf16" if cuda else "fp32",
        "models": args.models,
        "tokens": args.tokens,
        "iters": args.iters,
        "warmup": args.warmup,
        "versions": versions,
        "ratios": "baseline time / row time (> 1: faster than the baseline); layer_speedup against layer_baseline "
                  "(Megatron's alltoall with the same experts, eager), path_speedup against path_baseline (alltoall's "
                  "dispatcher path, identity experts), graph_speedup of a row replayed from CUDA graphs against "
                  "graph_baseline (Megatron's alltoall layer under its widest CUDA-graph capture, same experts) when "
                  "that row ran",
        "layer_baselines": LAYER_BASELINES,
        "path_baseline": PATH_BASELINE,
        "graph_baseline": GRAPH_BASELINE,
        "cuda_graph_scopes": GRAPH_SCOPES,
        "variants": {v.name: {"dispatcher": v.dispatcher, "expert_module": v.expert_module,
                              "host_sync": not v.no_host_sync, "cuda_graph": v.graph_scope is not None,
                              "cuda_graph_scope": v.graph_scope,
                              "layer_baseline": LAYER_BASELINES[v.expert_module],
                              "description": v.description} for v in VARIANTS},
    }


def _parse(argv: Optional[list[str]]) -> argparse.Namespace:
    from megatron_deepepv2.config import DeepepV2Settings  # noqa: PLC0415

    default_sms = DeepepV2Settings().num_sms
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["deepseek-v3", "qwen3-30b-a3b",
                                                                                 "mixtral-8x7b"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096], help="tokens per rank (default: 4096)")
    parser.add_argument("--variants", nargs="+", choices=[v.name for v in VARIANTS], default=None,
                        help="a subset (the eager alltoall rows their ratios need always run; name "
                             f"{GRAPH_BASELINE} for the graph ratio)")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per measurement (the median is kept)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls before them")
    parser.add_argument("--sms", type=int, default=default_sms,
                        help=f"SMs for DeepEP v2's kernels (default: the package's default, {default_sms}; "
                             "0 = DeepEP's analytic model)")
    parser.add_argument("--cpu", action="store_true", help="2 gloo CPU processes, reference backend (smoke run)")
    parser.add_argument("--out", default="bench_out")
    return parser.parse_args(argv)


def run_rank(rank: int, args: argparse.Namespace, cuda: bool, meta: dict) -> list[dict]:
    """One rank's part, in an initialised process group: installs the plugin, sets up EP, compares; rank 0 writes
    the outputs (:func:`run_metadata` with ``meta`` over it, and the rows) after each variant."""
    import megatron_deepepv2 as dv2  # noqa: PLC0415
    from megatron_deepepv2.testing.moe_model import init_expert_parallel  # noqa: PLC0415

    if not cuda:
        from megatron_deepepv2.testing.cpu_shims import install_cpu_shims  # noqa: PLC0415

        install_cpu_shims()
    dv2.install()
    init_expert_parallel()
    _bench.setup_logging(rank)
    if rank == 0:
        meta = {**run_metadata(args, cuda), **meta}
        logger.info("%s, EP=%s, deepepv2 on %s SMs, commit %s%s", meta.get("device"), meta.get("world_size"),
                    args.sms, meta["git_commit"], " (uncommitted changes)" if meta["git_dirty"] else "")

    def after_variant(rows: list[dict], model_done: bool) -> None:
        write_outputs(rows, args.out, meta, with_plot=model_done)

    return compare(args, cuda, after_variant if rank == 0 else None)


def _cpu_worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        run_rank(rank, args, False, {"world_size": world, "device": "cpu (gloo, reference backend)"})
    finally:
        dist.destroy_process_group()


def main(argv: Optional[list[str]] = None) -> int:
    args = _parse(argv)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU ranks (spawned, they inherit it) must not see a GPU
        from megatron_deepepv2.testing.spawn import spawn_on_free_port  # noqa: PLC0415

        spawn_on_free_port(_cpu_worker, (args,), 2)
        return 0
    with _bench.process_group("nccl") as rank:
        run_rank(rank, args, True, {"world_size": dist.get_world_size(), "device": torch.cuda.get_device_name()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
