"""Strict CPU stand-ins for DeepEP's buffers, and the switches that make ``backend="deepep"`` run over them.

The stand-ins are ``deep_ep.ElasticBuffer`` (2.1, :class:`FakeElasticBuffer`) and ``deep_ep.EPBuffer`` (V2.5,
:class:`FakeEPBuffer`, written from DeepEP's ``deep_ep/buffers/ep.py``: exact signatures, ``do_handle_copy`` must be
False, ``topk_idx`` version-checked by the handle, even SM counts, ``defer_epilogue`` only in async mode).
:data:`STAND_INS` names the buffer class of each DeepEP line.

The 2.1 stand-in enforces the host-side rules of DeepEP 2.1.0 that the adapter must respect (cached dispatch
needs ``num_sms`` and no ``topk_idx``; ``previous_event`` only with ``allocate_on_comm_stream``; zero padding
only with expand; events waited only in async mode; explicit destroy; torch's deterministic algorithms never
together with ``fill_uninitialized_memory``) and computes its results with a dense oracle of DeepEP's
exchange (:mod:`tests.stand_in`, which shares no code with the package's backends), so the adapter's results are
compared with an independent computation. Real ElasticBuffer runs are in ``tests/functional``.

Both stand-ins receive as DeepEP does without deterministic mode: the dense order scrambled (seeded, new per dispatch)
inside each source group (compact) or inside the valid rows of each expert block (expand, padding after them), with
garbage past the valid rows without CPU sync. Their :class:`EPHandle` (the class the backend inspects) carries
metadata consistent with the scramble, and combine and cached dispatch read that metadata as DeepEP does, so a wrong
update of it gives wrong results. ``EPHandle.deterministic_sort`` restores the dense order from the stand-in's own
record of the scramble; a buffer built ``deterministic=True`` runs it after every dispatch, as DeepEP does.

How tests use it: a rank worker calls :func:`use_stand_in_backend` (optionally with a line, ``"2.1"`` or ``"V2.5"``)
before building a ``DeepEPBackend`` on :func:`group_of`; :func:`install_deep_ep` only installs the ``deep_ep``
module; a test that needs the backend to see a given ``EPHandle`` class (or none) calls
:func:`install_deep_ep_with_handle` with pytest's ``monkeypatch``, the class being the full :class:`EPHandle` or one
that :func:`handle_stand_in` builds to lack what a check looks for. Each buffer class records its calls' arguments in
``calls``, and :attr:`EventOverlap.created` keeps every event handed out; :func:`in_dense_order` puts a receive output
back in the dense oracle's order.

The other ``deep_ep`` modules the tests install are built here too: :func:`fake_deep_ep` (a module of exactly the
attributes given, e.g. DeepEP v1's, :data:`DEEPEP_V1_EXPORTS`), :func:`install_fake_deep_ep` (one installed for a
test's duration) and :func:`install_recording_deep_ep` (a buffer class that only records how it is built).
"""

from __future__ import annotations

import inspect
import sys
import types
from dataclasses import dataclass
from typing import Optional, Sequence

import pytest
import torch

from tests.stand_in import DenseExchange, DensePlan


@dataclass
class _Receive:
    """The stand-in's record of one fresh dispatch's receive, in terms of the dense order.

    Attributes:
        plan: The dense oracle's plan.
        cpu_sync: The dispatch's ``do_cpu_sync``.
        capacity: ``num_max_tokens_per_rank`` (metadata column 0 is ``src_rank * capacity + token``).
        token_perm: Received token ``i`` (compact row, metadata row) holds dense token ``token_perm[i]``.
        slot_perm: Expand: row ``r`` holds dense expanded row ``slot_perm[r]`` (the identity on padding and past the
            blocks); empty for compact.
        links: Hybrid mode: for each entry of ``channel_linked_list`` (flattened), ``("row", global token id)`` when
            it points to a received token, else ``("other", its value)``; None in direct mode.
        local_slots: Compact: each received (source rank, token)'s slots with an expert on this rank.
    """

    plan: DensePlan
    cpu_sync: bool
    capacity: int
    token_perm: list[int]
    slot_perm: list[int]
    links: Optional[list[tuple[str, int]]]
    local_slots: dict[tuple[int, int], list[int]]

    @property
    def num_tokens(self) -> int:
        """Received tokens that hold data."""
        return len(self.plan.rows)


def _inverse(perm: list[int]) -> list[int]:
    out = [0] * len(perm)
    for position, value in enumerate(perm):
        out[value] = position
    return out


class EPHandle:
    """DeepEP's ``EPHandle`` as the backend reads it: the fields the deterministic order reads (constructor
    arguments, as DeepEP's), ``deterministic_sort`` with DeepEP's signature and semantics, and the stand-in's record.

    ``recv_src_metadata`` ``[N, K + 2]`` int32: row ``i`` is received token ``i`` (column 0 its global source index,
    column 1 its source rank, columns 2.. the expanded row of each selection in the expand layout, else -1), garbage
    past ``psum_num_recv_tokens_per_scaleup_rank[-1]``.
    """

    def __init__(self, do_expand: bool, num_sms: int, num_recv_tokens_per_expert_list: list[int],
                 psum_num_recv_tokens_per_scaleup_rank: torch.Tensor, psum_num_recv_tokens_per_expert: torch.Tensor,
                 num_unaligned_recv_tokens_per_expert: torch.Tensor, recv_src_metadata: torch.Tensor,
                 channel_linked_list: Optional[torch.Tensor], receive: _Receive) -> None:
        self.do_expand, self.num_sms = do_expand, num_sms
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list  # empty without CPU sync
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata, self.channel_linked_list = recv_src_metadata, channel_linked_list
        self.receive, self.plan, self.do_cpu_sync = receive, receive.plan, receive.cpu_sync
        self.num_valid_rows = sum(receive.plan.aligned_counts) if do_expand else receive.num_tokens
        # What the rows hold now, in dense terms (deterministic_sort updates it), and the sort's snapshot of it
        # (DeepEP's cached_recv_src_metadata_before_sort).
        self.token_now, self.slot_now = list(receive.token_perm), list(receive.slot_perm)
        self.before_sort: Optional[tuple[list[int], list[int]]] = None

    def deterministic_sort(self, do_cpu_sync: bool, is_cached_dispatch: bool, recv_x: torch.Tensor,
                           recv_sf: Optional[torch.Tensor], recv_topk_idx: Optional[torch.Tensor],
                           recv_topk_weights: Optional[torch.Tensor],
                           channel_linked_list: Optional[torch.Tensor]) -> None:
        """DeepEP's sort, from the record: in place; compact rows (and, fresh, the metadata rows and the links) to
        the dense order; expand (fresh only) each block's rows, and the metadata's slots rewritten to match."""
        assert do_cpu_sync == (self.do_cpu_sync and not is_cached_dispatch), \
            "DeepEP's sort gets the dispatch's own do_cpu_sync (False on a cached dispatch)"
        if not is_cached_dispatch:
            self.before_sort = (list(self.token_now), list(self.slot_now))
        assert self.before_sort is not None, "DeepEP asserts: a cached sort needs the fresh dispatch's sort first"
        token_before, slot_before = self.before_sort
        num_tokens = len(token_before)

        def permute(tensor: Optional[torch.Tensor], gather: list[int]) -> None:
            if tensor is not None:
                tensor.copy_(tensor[torch.tensor(gather, dtype=torch.long)])

        if not self.do_expand:
            gather = _inverse(token_before) + list(range(num_tokens, recv_x.shape[0]))
            for tensor in (recv_x, recv_sf, recv_topk_idx, recv_topk_weights):
                permute(tensor, gather)
            if not is_cached_dispatch:
                permute(self.recv_src_metadata, gather)
                self.token_now = list(range(num_tokens))
                if channel_linked_list is not None:  # row e went to row token_before[e]
                    flat = channel_linked_list.view(-1)
                    for p, entry in enumerate(flat.tolist()):
                        if 0 <= entry < num_tokens:
                            flat[p] = token_before[entry]
        elif not is_cached_dispatch:  # a cached expand receive is placed by the (already rewritten) slots
            for tensor in (recv_x, recv_sf, recv_topk_weights):
                permute(tensor, _inverse(slot_before))
            slots = self.recv_src_metadata[:num_tokens, 2:]
            for (j, k) in (slots >= 0).nonzero().tolist():
                slots[j, k] = slot_before[int(slots[j, k])]
            self.slot_now = list(range(len(slot_before)))

    def received(self) -> list[tuple[int, int]]:
        """``(metadata row, global source token)`` of every received token, read as DeepEP reads the handle: the
        first ``psum_num_recv_tokens_per_scaleup_rank[-1]`` metadata rows, or in hybrid mode the linked list's
        entries (each points to a received row; the other entries must be as the dispatch left them)."""
        num_tokens = int(self.psum_num_recv_tokens_per_scaleup_rank[-1])
        if self.channel_linked_list is None:
            return [(j, int(self.recv_src_metadata[j, 0])) for j in range(num_tokens)]
        out = []
        for (kind, value), entry in zip(self.receive.links, self.channel_linked_list.flatten().tolist()):
            if kind == "row":
                assert 0 <= entry < num_tokens, f"a link to a received row now points to {entry}"
                out.append((entry, value))
            else:
                assert entry == value, f"a link to no received row changed from {value} to {entry}"
        return out


def in_dense_order(tensor: Optional[torch.Tensor], native: EPHandle) -> Optional[torch.Tensor]:
    """A receive output of a stand-in (rows as they are now, per the stand-in's record) in the dense oracle's order;
    rows past the valid ones stay where they are."""
    if tensor is None:
        return None
    out = tensor.clone()
    if native.do_expand:
        out[torch.tensor(native.slot_now, dtype=torch.long)] = tensor[:len(native.slot_now)]
    else:
        out[torch.tensor(native.token_now, dtype=torch.long)] = tensor[:len(native.token_now)]
    return out


def _check_torch_deterministic() -> None:
    # deep_ep.utils.envs.check_torch_deterministic, called at every dispatch/combine (and sort).
    assert not (torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory)


class EventOverlap:
    #: Every event handed out, so that a test can check that each asynchronous one was waited on.
    created: list = []

    def __init__(self, is_async: bool, log: list) -> None:
        self.is_async, self.log = is_async, log
        self.waited = False
        EventOverlap.created.append(self)

    def current_stream_wait(self) -> None:
        _check_torch_deterministic()
        assert self.is_async, "DeepEP asserts: EventOverlap.event is None without async_with_compute_stream"
        self.log.append("wait")
        self.waited = True


def _fill_garbage(tensor: Optional[torch.Tensor], tail: torch.Tensor, value: float) -> None:
    """Rows ``tail`` of ``tensor`` set to a finite garbage value (FP8 through its bytes)."""
    if tensor is None:
        return
    if tensor.is_floating_point() and tensor.element_size() == 1:
        tensor.view(torch.uint8)[tail] = 0x42
    else:
        tensor[tail] = value


class _DenseStandIn:
    """What both stand-ins share: the dense exchange, the scrambled receive and its handle, the recorded constructor,
    events, destroy."""

    def _setup(self, group, num_max_tokens_per_rank, allow_hybrid_mode, deterministic, allow_multiple_reduction,
               explicitly_destroy) -> None:
        assert allow_multiple_reduction and explicitly_destroy
        self.num_bytes = 1 << 21
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.ctor = dict(allow_hybrid_mode=allow_hybrid_mode, deterministic=deterministic, T=num_max_tokens_per_rank)
        self.exchange = DenseExchange(group, num_max_tokens_per_rank)
        self.num_dispatches = 0  # seeds the scramble: new per dispatch
        self.destroyed = False

    @staticmethod
    def capture():
        return "event-handle"

    def _receive(self, x, topk_idx, topk_weights, *, num_experts, do_expand, alignment, do_cpu_sync, capacity,
                 num_sms, handle_class, handle_extra=None):
        """A fresh dispatch: the dense oracle's receive, scrambled, and a handle consistent with it."""
        recv_x, recv_idx, recv_weights, plan = self.exchange.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts, expand=do_expand, alignment=alignment,
            cpu_sync=do_cpu_sync)
        world, rank, topk = self.exchange.world, self.exchange.rank, plan.num_topk
        self.num_dispatches += 1
        gen = torch.Generator().manual_seed(7919 * self.num_dispatches + rank)
        num_tokens = len(plan.rows)
        token_perm: list[int] = []  # DeepEP receives each source rank's tokens together, in racing order
        for src in range(world):
            group = [d for d, (s, _) in enumerate(plan.rows) if s == src]
            token_perm += [group[i] for i in torch.randperm(len(group), generator=gen).tolist()]
        slot_perm: list[int] = []
        if do_expand:  # each block's valid rows in racing order, its padding after them
            slot_perm = list(range(plan.num_recv_rows))
            start = 0
            for real, aligned in zip(plan.real_counts, plan.aligned_counts):
                shuffled = (start + torch.randperm(real, generator=gen)).tolist()
                slot_perm[start:start + real] = shuffled
                start += aligned
        raw_of_dense = _inverse(slot_perm)
        dense_row_of = {source: d for d, source in enumerate(plan.expand_rows) if source is not None}
        num_meta_rows = num_tokens if do_cpu_sync else world * capacity
        metadata = torch.randint(-2, max(num_meta_rows, plan.num_recv_rows) + 3, (num_meta_rows, topk + 2),
                                 generator=gen, dtype=torch.int32)  # garbage past the received tokens
        local_slots = {}
        for i, d in enumerate(token_perm):
            src, t = plan.rows[d]
            metadata[i, :2] = torch.tensor([src * capacity + t, src])
            metadata[i, 2:] = -1
            local_slots[(src, t)] = [k for k in range(topk) if plan.local_idx[d, k] >= 0]
            if do_expand:
                for k in local_slots[(src, t)]:
                    metadata[i, 2 + k] = raw_of_dense[dense_row_of[(src, t, k)]]
        gather = torch.tensor(slot_perm if do_expand else token_perm + list(range(num_tokens, plan.num_recv_rows)),
                              dtype=torch.long)
        parts = [part[gather] for part in (recv_x if isinstance(recv_x, tuple) else (recv_x,))]
        recv_idx = None if recv_idx is None else recv_idx[gather]
        recv_weights = None if recv_weights is None else recv_weights[gather]
        links, linked_list = None, None
        if self.ctor["allow_hybrid_mode"]:  # entries to every received row, to none (-1), and past the received
            entries = list(range(num_tokens)) + [-1, -1, -1, num_tokens + 2, num_meta_rows + 5]
            entries = [entries[p] for p in torch.randperm(len(entries), generator=gen).tolist()]
            entries += [-1] * (len(entries) % 2)
            linked_list = torch.tensor(entries, dtype=torch.int32).view(2, -1)
            links = [("row", int(metadata[e, 0])) if 0 <= e < num_tokens else ("other", e) for e in entries]
        per_source = [sum(1 for s, _ in plan.rows if s == src) for src in range(world)]
        aligned = torch.tensor(plan.aligned_counts, dtype=torch.int32)
        if do_expand:  # DeepEP: aligned start of each block plus its real count
            unaligned = torch.tensor(plan.real_counts, dtype=torch.int32)
            psum_expert = torch.cumsum(aligned, 0).to(torch.int32) - aligned + unaligned
        else:  # inclusive prefix sum; the unaligned counts are only written in the expand layout
            unaligned = torch.full_like(aligned, -5)
            psum_expert = torch.cumsum(aligned, 0).to(torch.int32)
        receive = _Receive(plan, do_cpu_sync, capacity, token_perm, slot_perm, links, local_slots)
        handle = handle_class(do_expand, num_sms,
                              list(plan.aligned_counts) if do_cpu_sync else [],
                              torch.cumsum(torch.tensor(per_source), 0).to(torch.int32), psum_expert, unaligned,
                              metadata, linked_list, receive, **(handle_extra or {}))
        if not do_cpu_sync:  # DeepEP leaves rows past the valid extent uninitialised
            tail = torch.arange(plan.num_recv_rows) >= handle.num_valid_rows
            for part in parts:
                _fill_garbage(part, tail, 77.0)
            _fill_garbage(recv_idx, tail, 1)
            _fill_garbage(recv_weights, tail, 123.0)
        if self.ctor["deterministic"]:  # DeepEP's epilogue
            handle.deterministic_sort(do_cpu_sync, False, parts[0], parts[1] if len(parts) > 1 else None, recv_idx,
                                      recv_weights, linked_list)
        return (tuple(parts) if isinstance(recv_x, tuple) else parts[0]), recv_idx, recv_weights, handle

    def _cached(self, x, handle: EPHandle, topk_weights):
        """A cached dispatch as DeepEP places it: compact rows in the fresh dispatch's receive order, expand rows at
        the handle's metadata slots; garbage past the valid rows without CPU sync."""
        receive, plan = handle.receive, handle.plan
        if handle.do_expand:
            all_x, all_w = self.exchange.gather_inputs(x, topk_weights)
            rows = [torch.zeros((plan.num_recv_rows, *p.shape[1:]), dtype=p.dtype) for p in all_x[self.exchange.rank]]
            recv_weights = None if all_w is None else torch.zeros(plan.num_recv_rows, dtype=torch.float32)
            for j, token in handle.received():
                src, t = divmod(token, receive.capacity)
                for k, slot in enumerate(handle.recv_src_metadata[j, 2:].tolist()):
                    if slot >= 0:
                        for out, part in zip(rows, all_x[src]):
                            out.view(torch.uint8)[slot] = part[t].view(torch.uint8)
                        if recv_weights is not None:
                            recv_weights[slot] = all_w[src][t, k]
            recv_idx = None
        else:
            dense_x, dense_w = self.exchange.cached_dispatch(x, plan, topk_weights)
            gather = torch.tensor(receive.token_perm + list(range(receive.num_tokens, plan.num_recv_rows)),
                                  dtype=torch.long)
            rows = [part[gather] for part in (dense_x if isinstance(dense_x, tuple) else (dense_x,))]
            recv_weights = None if dense_w is None else dense_w[gather]
            recv_idx = torch.full((plan.num_recv_rows, plan.num_topk), -1, dtype=torch.int64)
            recv_idx[:receive.num_tokens] = plan.local_idx[gather[:receive.num_tokens]]
        if not handle.do_cpu_sync:
            tail = torch.arange(plan.num_recv_rows) >= handle.num_valid_rows
            for part in rows:
                _fill_garbage(part, tail, 99.0)
            _fill_garbage(recv_weights, tail, 123.0)
        if self.ctor["deterministic"]:
            handle.deterministic_sort(False, True, rows[0], rows[1] if len(rows) > 1 else None, recv_idx,
                                      recv_weights, handle.channel_linked_list)
        return (tuple(rows) if isinstance(x, tuple) else rows[0]), recv_idx, recv_weights

    def _combine(self, x, handle: EPHandle, topk_weights):
        """Combine as DeepEP reads the handle: compact row ``j`` is the token of metadata row ``j``; expand selection
        ``k`` of the token of metadata row ``j`` is row ``metadata[j, 2 + k]``."""
        acc = torch.promote_types(x.dtype, torch.float32)
        partial, slot_weight = {}, {} if topk_weights is not None else None
        for j, token in handle.received():
            src, t = divmod(token, handle.receive.capacity)
            if handle.do_expand:
                total = torch.zeros(x.shape[1], dtype=acc)
                for k, slot in enumerate(handle.recv_src_metadata[j, 2:].tolist()):
                    if slot >= 0:
                        total += x[slot].to(acc)
                        if slot_weight is not None:
                            slot_weight[(src, t, k)] = float(topk_weights[slot])
                partial[(src, t)] = total.to(x.dtype)
            else:
                partial[(src, t)] = x[j]
                if slot_weight is not None:
                    for k in handle.receive.local_slots[(src, t)]:
                        slot_weight[(src, t, k)] = float(topk_weights[j, k])
        return self.exchange.sum_at_sources(partial, slot_weight, handle.plan.num_tokens, handle.plan.num_topk, x)

    def destroy(self) -> None:
        self.destroyed = True
        self.exchange = None  # destroy() frees the buffer: any later use of it fails


class FakeElasticBuffer(_DenseStandIn):
    calls: list = []

    def __init__(self, group, num_max_tokens_per_rank=0, hidden=0, num_topk=0, use_fp8_dispatch=False,
                 deterministic=False, allow_hybrid_mode=True, allow_multiple_reduction=True, explicitly_destroy=False,
                 **unknown) -> None:
        assert not unknown, unknown
        self._setup(group, num_max_tokens_per_rank, allow_hybrid_mode, deterministic, allow_multiple_reduction,
                    explicitly_destroy)

    def _check_common(self, previous_event, allocate_on_comm_stream, kwargs):
        if previous_event is not None:
            assert allocate_on_comm_stream, "previous_event requires allocate_on_comm_stream (host assert)"
        _check_torch_deterministic()
        FakeElasticBuffer.calls.append(kwargs)

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, num_max_tokens_per_rank=None,
                 expert_alignment=None, num_sms=0, previous_event=None, async_with_compute_stream=False,
                 allocate_on_comm_stream=False, handle=None, do_expand=False, do_zero_padding=False,
                 do_cpu_sync=None, **rest):
        assert not rest, rest
        self._check_common(previous_event, allocate_on_comm_stream,
                           dict(op="dispatch", cached=handle is not None, num_sms=num_sms, do_expand=do_expand,
                                zero=do_zero_padding, prev=previous_event, alloc=allocate_on_comm_stream,
                                async_=async_with_compute_stream))
        assert not do_zero_padding or do_expand, "do_zero_padding needs do_expand"
        log: list = []
        if handle is not None:
            assert topk_idx is None, "cached dispatch takes topk_idx from the handle"
            assert num_sms != 0, "DeepEP #685: num_sms=0 with a handle raises TypeError"
            assert do_expand == handle.do_expand, "do_expand must be passed explicitly on cached dispatch"
            assert not do_cpu_sync, "Cannot do CPU sync with cached handle"
            recv_x, recv_idx, recv_weights = self._cached(x, handle, topk_weights)
            return recv_x, recv_idx, recv_weights, handle, EventOverlap(async_with_compute_stream, log)
        recv_x, recv_idx, recv_weights, ep_handle = self._receive(
            x, topk_idx, topk_weights, num_experts=num_experts, do_expand=do_expand, alignment=expert_alignment,
            do_cpu_sync=True if do_cpu_sync is None else do_cpu_sync,
            capacity=num_max_tokens_per_rank or self.num_max_tokens_per_rank, num_sms=num_sms or 20,
            handle_class=EPHandle)
        return recv_x, recv_idx, recv_weights, ep_handle, EventOverlap(async_with_compute_stream, log)

    def combine(self, x, handle, topk_weights=None, num_sms=0, previous_event=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, **rest):
        assert not rest, rest
        self._check_common(previous_event, allocate_on_comm_stream,
                           dict(op="combine", num_sms=num_sms, prev=previous_event, alloc=allocate_on_comm_stream,
                                async_=async_with_compute_stream))
        combined, combined_weights = self._combine(x, handle, topk_weights)
        return combined, combined_weights, EventOverlap(async_with_compute_stream, [])


class _EPHandleV25(EPHandle):
    """V2.5's EPHandle: keeps ``topk_idx`` by reference and asserts it was not modified while in use."""

    def __init__(self, *args, topk_idx, num_experts, alignment, capacity) -> None:
        super().__init__(*args)
        self.num_experts, self.expert_alignment, self.num_max_tokens_per_rank = num_experts, alignment, capacity
        self._topk_idx, self._topk_idx_version = topk_idx, topk_idx._version

    @property
    def topk_idx(self):
        assert self._topk_idx._version == self._topk_idx_version, \
            "`topk_idx` must not be modified while the EP handle is in use"
        return self._topk_idx


class FakeEPBuffer(_DenseStandIn):
    """DeepEP V2.5's ``EPBuffer``: its exact signatures (no ``**kwargs``) and host-side assertions."""

    calls: list = []

    def __init__(self, group, num_bytes=None, num_max_tokens_per_rank=0, hidden=0, num_topk=0,
                 use_fp8_dispatch=False, lb_allocation_plan_or_num_bytes=0, deterministic=False,
                 allow_hybrid_mode=True, allow_multiple_reduction=True, prefer_overlap_with_compute=True,
                 sl_idx=None, num_allocated_qps=0, num_cpu_timeout_secs=300, num_gpu_timeout_secs=100,
                 explicitly_destroy=False) -> None:
        self._setup(group, num_max_tokens_per_rank, allow_hybrid_mode, deterministic, allow_multiple_reduction,
                    explicitly_destroy)

    def dispatch(self, x, topk_idx=None, topk_weights=None, cumulative_local_expert_recv_stats=None,
                 num_experts=None, num_max_tokens_per_rank=None, expert_alignment=None, num_sms=0, num_qps=0,
                 previous_event=None, async_with_compute_stream=False, allocate_on_comm_stream=False, handle=None,
                 do_handle_copy=False, do_cpu_sync=None, do_expand=False, do_zero_padding=False,
                 use_tma_aligned_col_major_sf=False, defer_epilogue=False):
        assert not do_handle_copy, "`do_handle_copy` must be False; handle copying is no longer supported"
        _check_torch_deterministic()
        assert not defer_epilogue or async_with_compute_stream, "defer_epilogue requires async_with_compute_stream"
        if previous_event is not None:
            assert allocate_on_comm_stream, "previous_event requires allocate_on_comm_stream (host assert)"
        FakeEPBuffer.calls.append(dict(op="dispatch", cached=handle is not None, num_sms=num_sms, do_expand=do_expand,
                                       zero=do_zero_padding, prev=previous_event, alloc=allocate_on_comm_stream,
                                       async_=async_with_compute_stream))
        assert not do_zero_padding or do_expand, "do_zero_padding needs do_expand"
        if handle is not None:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            handle.topk_idx  # the version check of every cached dispatch
            given = (num_experts or handle.num_experts, expert_alignment or handle.expert_alignment,
                     num_max_tokens_per_rank or handle.num_max_tokens_per_rank)
            assert given == (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            recv_x, recv_idx, recv_weights = self._cached(x, handle, topk_weights)
            return recv_x, recv_idx, recv_weights, handle, EventOverlap(async_with_compute_stream, [])
        num_sms = num_sms + num_sms % 2  # align(num_sms, 2)
        capacity = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        alignment = expert_alignment or 1
        recv_x, recv_idx, recv_weights, ep_handle = self._receive(
            x, topk_idx, topk_weights, num_experts=num_experts, do_expand=do_expand, alignment=alignment,
            do_cpu_sync=True if do_cpu_sync is None else do_cpu_sync, capacity=capacity, num_sms=num_sms or 20,
            handle_class=_EPHandleV25,
            handle_extra=dict(topk_idx=topk_idx, num_experts=num_experts, alignment=alignment, capacity=capacity))
        return recv_x, recv_idx, recv_weights, ep_handle, EventOverlap(async_with_compute_stream, [])

    def combine(self, x, handle, topk_weights=None, bias=None, num_sms=0, num_qps=0, previous_event=None,
                async_with_compute_stream=False, allocate_on_comm_stream=False, defer_epilogue=False):
        _check_torch_deterministic()
        assert not defer_epilogue or async_with_compute_stream, "defer_epilogue requires async_with_compute_stream"
        if previous_event is not None:
            assert allocate_on_comm_stream, "previous_event requires allocate_on_comm_stream (host assert)"
        handle.topk_idx  # combine reads the handle's topk_idx
        FakeEPBuffer.calls.append(dict(op="combine", num_sms=num_sms, prev=previous_event,
                                       alloc=allocate_on_comm_stream, async_=async_with_compute_stream))
        combined, combined_weights = self._combine(x, handle, topk_weights)
        return combined, combined_weights, EventOverlap(async_with_compute_stream, [])


#: The stand-in of each DeepEP line: the buffer class and the module attribute it is exported as.
STAND_INS = {"2.1": ("ElasticBuffer", FakeElasticBuffer), "V2.5": ("EPBuffer", FakeEPBuffer)}
#: The ``__version__`` of each line's stand-in module.
FAKE_VERSIONS = {"2.1": "2.1.0-fake", "V2.5": "2.5.0-fake"}
#: What a DeepEP 1.x ``deep_ep`` exports that the backend looks at: v1's ``Buffer`` (no v2 buffer class) and a version.
DEEPEP_V1_EXPORTS = {"Buffer": object, "__version__": "1.2.1"}
#: The metadata of DeepEP's ``EPHandle`` (constructor arguments in 2.1.0 and V2.5) that the backend's own receive
#: order reads when deterministic mode runs without host sync.
EP_HANDLE_ORDER_FIELDS = ("recv_src_metadata", "psum_num_recv_tokens_per_scaleup_rank",
                          "psum_num_recv_tokens_per_expert", "num_unaligned_recv_tokens_per_expert",
                          "channel_linked_list")


def fake_deep_ep(**exports) -> types.ModuleType:
    """A ``deep_ep`` module holding exactly ``exports`` as its attributes.

    Args:
        **exports: The module's attributes, e.g. ``ElasticBuffer=FakeElasticBuffer, __version__="2.1.0-fake"``, or
            :data:`DEEPEP_V1_EXPORTS`; a module without ``ElasticBuffer`` / ``EPBuffer`` stands for a ``deep_ep``
            the backend must refuse.

    Returns:
        The module (installed nowhere).
    """
    module = types.ModuleType("deep_ep")
    for name, value in exports.items():
        setattr(module, name, value)
    return module


def install_fake_deep_ep(monkeypatch: pytest.MonkeyPatch, **exports) -> types.ModuleType:
    """Makes ``deep_ep``, for the test's duration, a :func:`fake_deep_ep` module of ``exports``.

    Args:
        monkeypatch: The test's ``monkeypatch``, which restores ``sys.modules`` after the test.
        **exports: The module's attributes, as for :func:`fake_deep_ep`.

    Returns:
        The module installed.
    """
    module = fake_deep_ep(**exports)
    monkeypatch.setitem(sys.modules, "deep_ep", module)
    return module


def install_recording_deep_ep(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Makes ``deep_ep``, for the test's duration, a 2.1 module whose ``ElasticBuffer`` only records how it is built.

    Args:
        monkeypatch: The test's ``monkeypatch``.

    Returns:
        The keyword arguments of each buffer construction, in order, filled as buffers are built (the group, passed
        positionally, is not kept).
    """
    built: list[dict] = []

    class RecordingBuffer:
        """A buffer class that records its constructor's keyword arguments and does nothing else."""

        def __init__(self, group, **kwargs) -> None:
            built.append(kwargs)

    install_fake_deep_ep(monkeypatch, ElasticBuffer=RecordingBuffer, __version__=FAKE_VERSIONS["2.1"])
    return built


def handle_stand_in(name: str, *, parameters: Sequence[str] = (), attributes: Sequence[str] = (), sort: bool = True,
                    doc: str = "") -> type:
    """An ``EPHandle`` class exposing only what it is given, for the checks of what deterministic mode needs of the
    installed DeepEP's handle (install it with :func:`install_deep_ep_with_handle`).

    The checks read what the class exposes: its constructor's parameters (as DeepEP's own handle takes its metadata,
    see :data:`EP_HANDLE_ORDER_FIELDS`) and its attributes (``dir``). They never build one or sort with it.

    Args:
        name: The class's name.
        parameters: The constructor's parameters after ``self``, as its signature shows them.
        attributes: Class attributes, each None (exposed through ``dir`` only).
        sort: Whether the class has ``deterministic_sort``, with DeepEP's signature (it raises if ever called).
        doc: The class's docstring: what the handle stands for.

    Returns:
        The class.
    """
    def __init__(self, *args, **kwargs) -> None:
        raise AssertionError("never built by a check")

    __init__.__signature__ = inspect.Signature([inspect.Parameter(field, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                                for field in ("self", *parameters)])
    namespace = {"__init__": __init__, "__doc__": doc, "__module__": __name__, **dict.fromkeys(attributes)}
    if sort:
        def deterministic_sort(self, do_cpu_sync, is_cached_dispatch, recv_x, recv_sf, recv_topk_idx,
                               recv_topk_weights, channel_linked_list) -> None:
            raise AssertionError("never called by a check")

        namespace["deterministic_sort"] = deterministic_sort
    return type(name, (), namespace)


def install_deep_ep(line: str = "2.1") -> None:
    """Installs (for the rest of the process: a rank's) a line's ``deep_ep`` module holding its stand-in buffer."""
    name, cls = STAND_INS[line]
    sys.modules["deep_ep"] = fake_deep_ep(**{name: cls, "__version__": FAKE_VERSIONS[line]})


def install_deep_ep_with_handle(monkeypatch: pytest.MonkeyPatch, handle_class: Optional[type],
                                line: str = "2.1") -> None:
    """Makes ``deep_ep`` (for the test's duration) a stand-in whose buffer class lives in a module holding
    ``handle_class`` as ``EPHandle``, or no ``EPHandle`` when None: what the backend inspects for deterministic mode."""
    name, stand_in = STAND_INS[line]
    buffers = types.ModuleType("deep_ep_stand_in_buffers")
    buffer_class = type(name, (stand_in,), {"__module__": buffers.__name__})
    setattr(buffers, name, buffer_class)
    if handle_class is not None:
        buffers.EPHandle = handle_class
    monkeypatch.setitem(sys.modules, buffers.__name__, buffers)
    install_fake_deep_ep(monkeypatch, **{name: buffer_class, "__version__": FAKE_VERSIONS[line]})


def use_stand_in_backend(line: str = "2.1") -> None:
    """Makes ``backend="deepep"`` run the adapter over a line's stand-in, on CPU tensors of any dtype (in a rank)."""
    from megatron_deepepv2.backends.deepep.backend import DeepEPBackend
    from megatron_deepepv2.backends.reference import ReferenceBackend

    install_deep_ep(line)
    DeepEPBackend.unavailable_reason = classmethod(lambda cls: None)
    DeepEPBackend.limits = ReferenceBackend.limits


def group_of():
    """The process group the stand-in tests build their buffers on: the world."""
    import torch.distributed as dist

    return dist.group.WORLD
