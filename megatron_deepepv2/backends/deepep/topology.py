"""Which nodes the ranks of an expert-parallel group run on, and the DeepEP mode that follows from it.

DeepEP 2.1 runs a group in one of two modes (``allow_hybrid_mode`` of its buffer): *hybrid*, NVLink domains joined by
RDMA, or *direct*, every rank in one flat scale-up domain (over NVLink only when the group is one NVLink domain).
DeepEP takes the NVLink domain from NCCL's LSA team (``get_physical_domain_size``), which NCCL builds from runs of
consecutive ranks on one node: its size is the greatest common divisor of the lengths of those runs, so that it is the
same on every rank and divides the group, as DeepEP asserts (``num_ranks % num_nvl_ranks == 0``). NCCL tells nodes
apart by a host hash: ``NCCL_HOSTID`` when set, else the hostname and the kernel's boot id.

So the mode is decided from where the ranks are, not from counts: hybrid when the group's ranks span more than one
node, direct within one node, whatever the group size, the local world size or the GPUs a process sees. A layout
whose NVLink domains NCCL would cut smaller than a node's share of the group (nodes holding unequal numbers of the
group's ranks, or a node's ranks not consecutive in the group) is refused rather than given a mode, since either mode
would send traffic between GPUs of one node over RDMA; an explicit ``allow_hybrid_mode`` still builds it.

DeepEP 2.1's buffer reaches ranks on other nodes through NCCL GIN, which needs an RDMA NIC; on a node without one its
constructor asserts "NCCL GIN is unavailable" unless ``EP_DISABLE_GIN=1``, which it reads when a buffer is built. So
that variable is decided from the hardware too (:func:`decide_gin`): a value the user set is kept; a node with an RDMA
NIC leaves it unset (GIN on); a node without one gets ``EP_DISABLE_GIN=1`` when its group stays on one node, and an
error naming the fix when the group spans nodes, which GIN off cannot serve.

This module owns: a process's node identity (:func:`local_node_id`), the one gather of a group's identities, cached per
group (:func:`group_node_ids`), the layout and decision as pure functions of the identities (:func:`node_layout`,
:class:`NodeLayout`), the choice a buffer build makes (:func:`choose_hybrid_mode`) and what the ranks agree on about it
(:data:`HYBRID_MODE_FIELD`), this node's RDMA devices (:func:`find_rdma_devices`), the nodes a launch spans
(:func:`launch_num_nodes`) and the GIN decision (:func:`decide_gin`; :func:`set_gin_variable` applies it,
:func:`set_gin_variable_for_group` for a buffer build).
"""

from __future__ import annotations

import glob
import logging
import math
import os
import socket
from dataclasses import dataclass
from functools import reduce
from typing import Callable, Mapping, MutableMapping, Optional, Sequence

import torch.distributed as dist

from megatron_deepepv2.agreement import AgreedField, yes_no
from megatron_deepepv2.groups import GroupState

#: Environment variable naming this process's NVLink domain, for clusters where hostnames do not (several hosts of one
#: multi-node NVLink domain, or one host seen under several names). Read directly, not as a setting of
#: :mod:`megatron_deepepv2.config`: it differs from node to node, while settings are the same on every rank.
NODE_ID_VARIABLE = "MEGATRON_DEEPEPV2_NODE_ID"
#: NCCL's own override of its host identity, which decides its LSA team (DeepEP's NVLink domain).
NCCL_HOST_ID_VARIABLE = "NCCL_HOSTID"
_BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
#: Group ranks shown in an error message's node map before it is cut short.
_MAX_RANKS_SHOWN = 32
#: The setting ``allow_hybrid_mode``, a construction argument of DeepEP's buffer: the ranks agree on it at a build, and
#: buffers of other values are kept apart (an entry of the DeepEP backend's ``extra_agreement``).
HYBRID_MODE_FIELD = AgreedField("allow_hybrid_mode", lambda spec: spec.settings.allow_hybrid_mode, yes_no)
#: DeepEP's switch: 1 builds its buffers without NCCL GIN (read when a buffer is built, by every rank).
GIN_VARIABLE = "EP_DISABLE_GIN"
#: Where Linux lists this node's RDMA devices (InfiniBand and RoCE NICs alike).
RDMA_DEVICE_DIR = "/sys/class/infiniband"

logger = logging.getLogger(__name__)
#: The environments in which :func:`set_gin_variable` set :data:`GIN_VARIABLE` itself (its value there is not the
#: user's, and is decided again for each group).
_gin_set_in: list[MutableMapping[str, str]] = []


def local_node_id(environ: Optional[Mapping[str, str]] = None) -> str:
    """This process's node identity: equal on two processes exactly when they share an NVLink domain.

    Args:
        environ: Mapping to read instead of ``os.environ``.

    Returns:
        :data:`NODE_ID_VARIABLE` when set (not empty); else the identity NCCL gives the host: ``NCCL_HOSTID`` when set,
        else the hostname followed by the first 8 characters of the kernel's boot id (so two machines with one
        hostname stay apart; the hostname alone where the boot id cannot be read).
    """
    environ = os.environ if environ is None else environ
    override = environ.get(NODE_ID_VARIABLE, "").strip()
    if override:
        return override
    nccl_host_id = environ.get(NCCL_HOST_ID_VARIABLE)
    if nccl_host_id is not None:
        return nccl_host_id
    hostname = socket.gethostname()
    try:
        with open(_BOOT_ID_FILE, encoding="ascii") as boot_id_file:
            boot_id = boot_id_file.read().strip()
    except OSError:
        boot_id = ""
    return f"{hostname}:{boot_id[:8]}" if boot_id else hostname


@dataclass(frozen=True)
class NodeLayout:
    """Where the ranks of a group are: one node identity per group rank, in group-rank order.

    Build it with :func:`node_layout`, which refuses layouts it cannot choose a DeepEP mode for; the properties hold
    for any layout.

    Attributes:
        node_ids: The node identity of each group rank (:func:`local_node_id` on that rank).
    """

    node_ids: tuple[str, ...]

    @property
    def num_ranks(self) -> int:
        """Ranks in the group."""
        return len(self.node_ids)

    @property
    def nodes(self) -> tuple[str, ...]:
        """The distinct nodes, in the order of their first group rank."""
        return tuple(dict.fromkeys(self.node_ids))

    @property
    def num_nodes(self) -> int:
        """Nodes the group spans."""
        return len(self.nodes)

    @property
    def ranks_per_node(self) -> tuple[int, ...]:
        """How many of the group's ranks each node of :attr:`nodes` holds."""
        return tuple(self.node_ids.count(node) for node in self.nodes)

    @property
    def runs(self) -> tuple[int, ...]:
        """Lengths of the runs of consecutive group ranks on one node, in group-rank order."""
        lengths: list[int] = []
        for rank, node in enumerate(self.node_ids):
            if rank and node == self.node_ids[rank - 1]:
                lengths[-1] += 1
            else:
                lengths.append(1)
        return tuple(lengths)

    @property
    def contiguous(self) -> bool:
        """Whether each node's ranks are consecutive in the group (one run per node)."""
        return len(self.runs) == self.num_nodes

    @property
    def nvlink_domain_size(self) -> int:
        """Ranks in the NVLink domain NCCL forms for the group (its LSA team: the gcd of :attr:`runs`).

        As NCCL computes it with ``NCCL_LSA_TEAM_SIZE`` unset and the group not one multi-node NVLink domain (there
        NCCL extends the team to the whole group: name the domain with :data:`NODE_ID_VARIABLE`).
        """
        return reduce(math.gcd, self.runs)

    @property
    def allow_hybrid_mode(self) -> bool:
        """Whether DeepEP should be allowed hybrid (RDMA x NVLink) mode: when the ranks span more than one node."""
        return self.num_nodes > 1

    def describe(self) -> str:
        """The layout in words, e.g. ``8 ranks on 8 nodes, 1 per node`` or ``8 ranks on 1 node``."""
        ranks = f"{self.num_ranks} rank{'s' if self.num_ranks != 1 else ''}"
        if self.num_nodes == 1:
            return f"{ranks} on 1 node"
        counts = sorted(set(self.ranks_per_node))
        per_node = str(counts[0]) if len(counts) == 1 else "/".join(map(str, self.ranks_per_node))
        interleaved = "" if self.contiguous else ", interleaved"
        return f"{ranks} on {self.num_nodes} nodes, {per_node} per node{interleaved}"

    def node_map(self) -> str:
        """Which node each group rank is on, as node indices into :attr:`nodes` (cut short for large groups)."""
        index = {node: i for i, node in enumerate(self.nodes)}
        shown = " ".join(str(index[node]) for node in self.node_ids[:_MAX_RANKS_SHOWN])
        return shown + (" ..." if self.num_ranks > _MAX_RANKS_SHOWN else "")


def node_layout(node_ids: Sequence[str]) -> NodeLayout:
    """The layout of a group from its ranks' node identities, checked for a mode DeepEP can be given.

    A pure function of ``node_ids``: every rank of a group passes the same gathered list and gets the same layout, or
    the same error.

    Args:
        node_ids: The node identity of each group rank, in group-rank order (:func:`group_node_ids`).

    Returns:
        The layout; its :attr:`NodeLayout.allow_hybrid_mode` is the decision (hybrid when the ranks span nodes).

    Raises:
        ValueError: If ``node_ids`` is empty, or the NVLink domains NCCL would form
            (:attr:`NodeLayout.nvlink_domain_size`) are smaller than the share of the group each node holds: nodes hold
            unequal numbers of the group's ranks, or a node's ranks are not consecutive in the group.
    """
    layout = NodeLayout(tuple(node_ids))
    if not layout.node_ids:
        raise ValueError("node_layout() needs the node identity of at least one rank; got an empty list.")
    counts = layout.ranks_per_node
    if len(set(counts)) == 1 and layout.contiguous:
        return layout
    domain = layout.nvlink_domain_size
    nodes = ", ".join(f"{node!r}: {count}" for node, count in zip(layout.nodes, counts))
    if len(set(counts)) > 1:
        problem = f"its nodes hold unequal numbers of its ranks ({nodes})"
        fix = ("place the same number of the group's ranks on every node (an expert-parallel size that divides, or is "
               "a multiple of, the GPUs per node)")
    else:
        problem = (f"each of its {layout.num_nodes} nodes holds {counts[0]} of its ranks, but not as consecutive group "
                   f"ranks (node of each group rank: {layout.node_map()})")
        fix = ("number the ranks node by node (torchrun does; under srun use --distribution=block), so that each "
               "node's ranks in the group are consecutive")
    raise ValueError(
        f"The expert-parallel group ({layout.describe()}) cannot be given a DeepEP mode automatically: {problem}. "
        "DeepEP takes its NVLink domain from NCCL's LSA team, which must be the same size on every rank and divide the "
        "group (DeepEP asserts num_ranks % num_nvl_ranks == 0); NCCL makes it so by cutting the runs of consecutive "
        f"ranks on one node into domains of their greatest common divisor, here {domain} rank"
        f"{'s' if domain != 1 else ''}, so GPUs of one node would exchange over RDMA instead of NVLink. To fix, {fix}; "
        "or choose DeepEP's mode yourself with allow_hybrid_mode (MEGATRON_DEEPEPV2_ALLOW_HYBRID_MODE=1 or 0) to "
        "build with this layout anyway. If hostnames do not name the NVLink domains, set "
        f"{NODE_ID_VARIABLE} on each rank to its domain's name."
    )


def group_node_ids(state: GroupState) -> tuple[str, ...]:
    """The node identity of every rank of the group of ``state``, in group-rank order; collective the first time per
    group.

    The first call on a group gathers :func:`local_node_id` from its ranks (one small ``all_gather_object``, a host
    sync: call it where the ranks are already in step, as a buffer build is); later calls return the cached result.

    Args:
        state: The group's state, which keeps the identities; every rank of the group must call this the first time.

    Returns:
        One identity per group rank.
    """
    if state.node_ids is None:
        gathered: list[Optional[str]] = [None] * state.size
        dist.all_gather_object(gathered, local_node_id(), group=state.group)
        state.node_ids = tuple(str(node) for node in gathered)
    return state.node_ids


def choose_hybrid_mode(state: GroupState, override: Optional[bool]) -> tuple[bool, str]:
    """DeepEP's ``allow_hybrid_mode`` for a buffer on the group of ``state``, and why.

    Args:
        state: The expert-parallel group's state. When ``override`` is None, every rank of the group must call this
            (the first call per group gathers the node identities, :func:`group_node_ids`).
        override: The configured ``allow_hybrid_mode``; None decides from the group's layout (:func:`node_layout`).

    Returns:
        ``(allow_hybrid_mode, reason)``, the reason in words for the build's log line, e.g.
        ``"8 ranks on 8 nodes, 1 per node"`` or ``"allow_hybrid_mode=False set"``. The same on every rank.

    Raises:
        ValueError: If ``override`` is None and the layout cannot be given a mode (see :func:`node_layout`); raised on
            every rank alike.
    """
    if override is not None:
        return bool(override), f"allow_hybrid_mode={bool(override)} set"
    layout = node_layout(group_node_ids(state))
    return layout.allow_hybrid_mode, layout.describe()


def find_rdma_devices() -> list[str]:
    """This node's RDMA devices (``/sys/class/infiniband/*``), which NCCL GIN needs; empty without an RDMA NIC.

    Returns:
        The devices' paths, sorted.
    """
    return sorted(glob.glob(os.path.join(RDMA_DEVICE_DIR, "*")))


def launch_num_nodes(environ: Optional[Mapping[str, str]] = None) -> int:
    """The nodes this launch spans, from the launcher's environment, without a collective.

    Args:
        environ: Mapping to read instead of ``os.environ``.

    Returns:
        torchrun's ``GROUP_WORLD_SIZE`` (its nodes) when set; else ``WORLD_SIZE`` over ``LOCAL_WORLD_SIZE``, rounded
        up, when both are set; else 1 (one process, or a launcher that says nothing about nodes).
    """
    environ = os.environ if environ is None else environ

    def positive(name: str) -> Optional[int]:
        value = environ.get(name, "").strip()
        return int(value) if value.isdigit() and int(value) > 0 else None

    nodes, world, local = positive("GROUP_WORLD_SIZE"), positive("WORLD_SIZE"), positive("LOCAL_WORLD_SIZE")
    if nodes is not None:
        return nodes
    return -(-world // local) if world is not None and local is not None else 1


@dataclass(frozen=True)
class GinDecision:
    """Whether DeepEP builds its buffers with NCCL GIN on this node, and why.

    Attributes:
        value: :data:`GIN_VARIABLE`'s value to build with: the user's, ``"1"`` when decided here, None for unset
            (GIN on).
        automatic: Whether the value was decided here (no RDMA NIC) rather than set by the user.
        reason: The decision in words, for a log line or the doctor's report.
    """

    value: Optional[str]
    automatic: bool
    reason: str

    @property
    def gin_on(self) -> bool:
        """Whether DeepEP will use GIN: the variable unset or not 1 (DeepEP reads it as an integer)."""
        return self.value is None or self.value.strip() in ("", "0")


def _user_value(environ: Mapping[str, str]) -> Optional[str]:
    """:data:`GIN_VARIABLE` as the user set it in ``environ``; None when unset or set by :func:`set_gin_variable`."""
    value = environ.get(GIN_VARIABLE)
    if value == "1" and any(environ is decided for decided in _gin_set_in):
        return None
    return value


def decide_gin(num_nodes: int, environ: Optional[Mapping[str, str]] = None,
               rdma_devices: Optional[Callable[[], Sequence[str]]] = None) -> GinDecision:
    """Decides DeepEP's :data:`GIN_VARIABLE` from the hardware: the one rule the library and the tools share.

    A value the user set (either one) is kept. Else a node with an RDMA NIC leaves it unset (GIN on); a node without
    one gets ``1`` (GIN off) when the ranks sharing a buffer are all on one node, and an error when they span nodes,
    which GIN off cannot serve. Changes nothing: :func:`set_gin_variable` applies the decision.

    Args:
        num_nodes: The nodes the ranks sharing DeepEP's buffer span (a group's :attr:`NodeLayout.num_nodes`, or
            :func:`launch_num_nodes` where no group is known).
        environ: Mapping to read instead of ``os.environ``.
        rdma_devices: The RDMA probe (default: :func:`find_rdma_devices`).

    Returns:
        The decision.

    Raises:
        RuntimeError: If this node has no RDMA NIC, the ranks span more than one node and the user did not set the
            variable.
    """
    environ = os.environ if environ is None else environ
    user_value = _user_value(environ)
    if user_value is not None:
        return GinDecision(value=user_value, automatic=False,
                           reason=f"{GIN_VARIABLE}={user_value} set in the environment, kept")
    devices = (rdma_devices or find_rdma_devices)()
    if devices:
        names = ", ".join(os.path.basename(device) for device in devices)
        return GinDecision(value=None, automatic=False,
                           reason=f"RDMA devices: {names}; GIN on ({GIN_VARIABLE} unset)")
    if num_nodes > 1:
        raise RuntimeError(
            f"DeepEP's ranks span {num_nodes} nodes, but this node has no RDMA NIC ({RDMA_DEVICE_DIR} is missing or "
            "empty): DeepEP 2.1 reaches ranks on other nodes through NCCL GIN, which needs RDMA, and "
            f"{GIN_VARIABLE}=1 (GIN off) would leave them unreachable. To fix, run on nodes with RDMA NICs "
            f"(InfiniBand or RoCE, listed under {RDMA_DEVICE_DIR}), or keep each expert-parallel group within one "
            f"node (an expert-parallel size of at most the GPUs of a node); set {GIN_VARIABLE} yourself to skip "
            "this check.")
    return GinDecision(value="1", automatic=True,
                       reason=f"no RDMA NIC ({RDMA_DEVICE_DIR} is missing or empty): GIN off, {GIN_VARIABLE}=1 "
                              f"set automatically before DeepEP builds a buffer (set {GIN_VARIABLE} to override)")


def set_gin_variable(num_nodes: int, environ: Optional[MutableMapping[str, str]] = None,
                     rdma_devices: Optional[Callable[[], Sequence[str]]] = None,
                     log: Optional[logging.Logger] = None) -> GinDecision:
    """Applies :func:`decide_gin`: sets ``EP_DISABLE_GIN=1`` where the decision says so, before DeepEP reads it.

    Logs one INFO line when it sets the variable (not when it finds it set already).

    Args:
        num_nodes: As for :func:`decide_gin`.
        environ: The environment to change (default: ``os.environ``, which DeepEP and child processes read).
        rdma_devices: As for :func:`decide_gin`.
        log: The logger of the INFO line (default: this module's).

    Returns:
        The decision.

    Raises:
        RuntimeError: As :func:`decide_gin`.
    """
    environ = os.environ if environ is None else environ
    decision = decide_gin(num_nodes, environ, rdma_devices)
    if decision.automatic and environ.get(GIN_VARIABLE) != decision.value:
        environ[GIN_VARIABLE] = decision.value
        if not any(environ is decided for decided in _gin_set_in):
            _gin_set_in.append(environ)
        (log or logger).info("No RDMA NIC on this node (%s is missing or empty): set %s=1, so DeepEP builds its "
                             "buffers without NCCL GIN (NVLink within one node). Set %s yourself to override.",
                             RDMA_DEVICE_DIR, GIN_VARIABLE, GIN_VARIABLE)
    return decision


def set_gin_variable_for_group(state: GroupState, environ: Optional[MutableMapping[str, str]] = None,
                               rdma_devices: Optional[Callable[[], Sequence[str]]] = None) -> GinDecision:
    """:func:`set_gin_variable` for a buffer on the group of ``state``, before DeepEP builds it; no collective.

    The nodes are the group's layout when its node identities were gathered already (:func:`choose_hybrid_mode`
    gathers them unless ``allow_hybrid_mode`` is set), else those of the launch (:func:`launch_num_nodes`).

    Args:
        state: The expert-parallel group's state.
        environ: As for :func:`set_gin_variable`.
        rdma_devices: As for :func:`decide_gin`.

    Returns:
        The decision.

    Raises:
        RuntimeError: As :func:`decide_gin`: no RDMA NIC here and the group (or the launch) spans nodes.
    """
    num_nodes = NodeLayout(state.node_ids).num_nodes if state.node_ids else launch_num_nodes(environ)
    return set_gin_variable(num_nodes, environ, rdma_devices)
