"""The DeepEP adapter's plumbing and its deterministic order, on CPU, against strict stand-ins for
``deep_ep.ElasticBuffer`` (2.1) and ``deep_ep.EPBuffer`` (V2.5, written from DeepEP's ``deep_ep/buffers/ep.py``: exact
signatures, ``do_handle_copy`` must be False, ``topk_idx`` version-checked by the handle, even SM counts,
``defer_epilogue`` only in async mode).

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
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Optional

import pytest
import torch

from tests.distributed import run_distributed
from tests.oracle import dense_step, experts_on_compact, experts_on_expand, make_problem
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


class _EventOverlap:
    #: Every event handed out, so that a test can check that each asynchronous one was waited on.
    created: list = []

    def __init__(self, is_async: bool, log: list) -> None:
        self.is_async, self.log = is_async, log
        self.waited = False
        _EventOverlap.created.append(self)

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
            return recv_x, recv_idx, recv_weights, handle, _EventOverlap(async_with_compute_stream, log)
        recv_x, recv_idx, recv_weights, ep_handle = self._receive(
            x, topk_idx, topk_weights, num_experts=num_experts, do_expand=do_expand, alignment=expert_alignment,
            do_cpu_sync=True if do_cpu_sync is None else do_cpu_sync,
            capacity=num_max_tokens_per_rank or self.num_max_tokens_per_rank, num_sms=num_sms or 20,
            handle_class=EPHandle)
        return recv_x, recv_idx, recv_weights, ep_handle, _EventOverlap(async_with_compute_stream, log)

    def combine(self, x, handle, topk_weights=None, num_sms=0, previous_event=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, **rest):
        assert not rest, rest
        self._check_common(previous_event, allocate_on_comm_stream,
                           dict(op="combine", num_sms=num_sms, prev=previous_event, alloc=allocate_on_comm_stream,
                                async_=async_with_compute_stream))
        combined, combined_weights = self._combine(x, handle, topk_weights)
        return combined, combined_weights, _EventOverlap(async_with_compute_stream, [])


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
            return recv_x, recv_idx, recv_weights, handle, _EventOverlap(async_with_compute_stream, [])
        num_sms = num_sms + num_sms % 2  # align(num_sms, 2)
        capacity = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        alignment = expert_alignment or 1
        recv_x, recv_idx, recv_weights, ep_handle = self._receive(
            x, topk_idx, topk_weights, num_experts=num_experts, do_expand=do_expand, alignment=alignment,
            do_cpu_sync=True if do_cpu_sync is None else do_cpu_sync, capacity=capacity, num_sms=num_sms or 20,
            handle_class=_EPHandleV25,
            handle_extra=dict(topk_idx=topk_idx, num_experts=num_experts, alignment=alignment, capacity=capacity))
        return recv_x, recv_idx, recv_weights, ep_handle, _EventOverlap(async_with_compute_stream, [])

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
        return combined, combined_weights, _EventOverlap(async_with_compute_stream, [])


#: The stand-in of each DeepEP line: the buffer class and the module attribute it is exported as.
STAND_INS = {"2.1": ("ElasticBuffer", FakeElasticBuffer), "V2.5": ("EPBuffer", FakeEPBuffer)}


def _install_fake(line: str = "2.1") -> None:
    name, cls = STAND_INS[line]
    module = types.ModuleType("deep_ep")
    setattr(module, name, cls)
    module.__version__ = "2.5.0-fake" if line == "V2.5" else "2.1.0-fake"
    sys.modules["deep_ep"] = module


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
    deep_ep = types.ModuleType("deep_ep")
    setattr(deep_ep, name, buffer_class)
    deep_ep.__version__ = "2.1.0-fake"
    monkeypatch.setitem(sys.modules, buffers.__name__, buffers)
    monkeypatch.setitem(sys.modules, "deep_ep", deep_ep)


def use_stand_in_backend(line: str = "2.1") -> None:
    """Makes ``backend="deepep"`` run the adapter over a line's stand-in, on CPU tensors of any dtype (in a rank)."""
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.backends.reference import ReferenceBackend

    _install_fake(line)
    DeepEPBackend.unavailable_reason = classmethod(lambda cls: None)
    DeepEPBackend.limits = ReferenceBackend.limits


def _adapter_worker(rank: int, world: int, line: str) -> None:
    # The stand-in, and the reference backend's limits, so that the autograd ops take CPU tensors of any dtype.
    use_stand_in_backend(line)
    stand_in = STAND_INS[line][1]
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig, Streams
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.config import DeepepV2Settings

    derived = []  # one entry per derivation of device counts from DeepEP's prefix sums
    count_from_psum = DeepEPBackend.device_counts
    DeepEPBackend.device_counts = lambda self, handle: derived.append(1) or count_from_psum(self, handle)
    spec = BufferSpec(hidden=8, num_topk=3, num_max_tokens_per_rank=32, settings=DeepepV2Settings(num_sms=23))
    sms = 24 if line == "V2.5" else 23  # V2.5 runs an even count; the backend rounds it itself
    backend, reference = DeepEPBackend(group_of(), spec), ReferenceBackend(group_of(), spec)
    assert isinstance(backend.ep_buffer, stand_in) and backend.line.num_sms(23) == sms
    assert backend.ep_buffer.ctor["allow_hybrid_mode"] is False  # single node -> direct mode
    problem = make_problem(41, [7, 0, 5, 9][:world], 8, 8, 3, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    for layout, host_sync in [(layout, sync) for layout in ExpertLayout for sync in (True, False)]:
        # The settings of the buffer above: the autograd ops below get theirs from the buffer registry.
        settings = DeepepV2Settings(host_sync=host_sync, num_sms=23, num_max_tokens_per_rank=32)
        config = DispatchConfig(DeepEPBackend, settings, layout, 4)
        derived.clear()
        got, want = backend.dispatch(x, idx, w, config, 8), reference.dispatch(x, idx, w, config, 8)
        valid = int(want.handle.num_valid_rows)
        # Without deterministic mode DeepEP's order is its own: compared in the oracle's order (the stand-in's record).
        assert torch.equal(in_dense_order(got.recv_x, got.handle.native)[:valid], want.recv_x[:valid])
        assert got.handle.tokens_per_expert_list == want.handle.tokens_per_expert_list
        # The device counts are derived only when asked for (host-sync callers use the host list), and once.
        assert not derived
        assert torch.equal(got.handle.tokens_per_expert, want.handle.tokens_per_expert)
        assert len(derived) == 1
        assert int(got.handle.num_valid_rows) == valid and len(derived) == 1
        assert got.handle.num_recv_rows == want.recv_x.shape[0]
        # The backend hands DeepEP's tensors back as they are: past the valid extent they are unspecified.
        assert torch.equal(in_dense_order(got.recv_topk_weights, got.handle.native)[:valid],
                           want.recv_topk_weights[:valid])
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(in_dense_order(got.recv_topk_idx, got.handle.native)[:valid], want.recv_topk_idx[:valid])
        assert (got.recv_topk_idx is None) == (layout is ExpertLayout.EXPAND)
        combined = backend.combine(got.recv_x, got.handle, got.recv_topk_weights)
        expected = reference.combine(want.recv_x, want.handle, want.recv_topk_weights)
        torch.testing.assert_close(combined.x, expected.x)
        torch.testing.assert_close(combined.topk_weights, expected.topk_weights)
        cached = backend.cached_dispatch(problem.grad_out[rows], got.handle)
        assert torch.equal(in_dense_order(cached.recv_x, got.handle.native)[:valid],
                           reference.cached_dispatch(problem.grad_out[rows], want.handle).recv_x[:valid])
        # The autograd ops with DeepEP's stream flags: previous event passed, async events waited; the direct-call
        # passes clear what DeepEP left past the valid extent (expert id -1, weight 0, zero gradient rows).
        stand_in.calls.clear()
        _EventOverlap.created.clear()
        xg = x.clone().requires_grad_()
        bound = ops.bind(config, group_of(), 8)
        recv_x, recv_w, _, recv_idx, handle = ops.DispatchFunction.apply(xg, w, bound, idx, None, Streams(True, True))
        assert isinstance(handle.buffer, DeepEPBackend) and handle.buffer is not backend  # the registry's buffer
        assert torch.equal(in_dense_order(recv_w, handle.native), want.recv_topk_weights.masked_fill(
            want.recv_topk_idx < 0, 0) if layout is ExpertLayout.COMPACT else want.recv_topk_weights)
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(in_dense_order(recv_idx, handle.native), want.recv_topk_idx)
        recv_x.retain_grad()
        y = ops.CombineFunction.apply(recv_x, handle, Streams(True, True))
        y.sum().backward()
        grad_rows = reference.cached_dispatch(torch.ones_like(y), want.handle).recv_x
        assert torch.equal(in_dense_order(recv_x.grad, handle.native)[:valid], grad_rows[:valid])
        assert not recv_x.grad[valid:].any()
        # Dispatch, combine, and in the backward the cached dispatch and the combine: every one asynchronous, and
        # every one waited on before its outputs were used.
        assert len(_EventOverlap.created) == 4 and all(e.is_async and e.waited for e in _EventOverlap.created)
        for call in stand_in.calls[:4]:
            assert call["prev"] == "event-handle" and call["alloc"]
            assert call["num_sms"] == sms, call
        cached_calls = [c for c in stand_in.calls if c.get("cached")]
        assert cached_calls and all(c["do_expand"] == (layout is ExpertLayout.EXPAND)
                                    and c["zero"] == (layout is ExpertLayout.EXPAND) for c in cached_calls)
        # Synchronous calls never allocate on the communication stream (nothing would protect those outputs from
        # reuse by that stream once freed), so they pass no previous event either.
        stand_in.calls.clear()
        recv_x, _, _, _, handle = ops.DispatchFunction.apply(x.clone().requires_grad_(), None, bound, idx, None,
                                                             Streams(False, True))
        ops.CombineFunction.apply(recv_x, handle, Streams(False, True)).sum().backward()
        assert len(stand_in.calls) == 4 and not any(c["alloc"] or c["prev"] or c["async_"] for c in stand_in.calls)
    DeepEPBackend.device_counts = count_from_psum
    # FP8 pairs pass through as pairs, bytes unchanged.
    fp8 = (x.to(torch.float8_e4m3fn), torch.rand(x.shape[0], 2, generator=torch.Generator().manual_seed(rank)))
    config = DispatchConfig(DeepEPBackend, layout=ExpertLayout.EXPAND, expert_alignment=4)
    got, want = backend.dispatch(fp8, idx, w, config, 8), reference.dispatch(fp8, idx, w, config, 8)
    assert isinstance(got.recv_x, tuple) and got.recv_x[0].dtype == torch.float8_e4m3fn
    assert torch.equal(in_dense_order(got.recv_x[0].view(torch.uint8), got.handle.native),
                       want.recv_x[0].view(torch.uint8))
    assert torch.equal(in_dense_order(got.recv_x[1], got.handle.native), want.recv_x[1])
    backend.destroy()
    assert backend.ep_buffer is None


def _deterministic_algorithms_worker(rank: int, world: int, line: str) -> None:
    """Megatron's --deterministic-mode turns on torch's deterministic algorithms with the fill left on (torch's
    default): every adapter call must still pass DeepEP's check, and the user's setting must come back."""
    use_stand_in_backend(line)
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig, Streams
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.reference import ReferenceBackend
    from megatron_deepepv2.config import DeepepV2Settings

    settings = DeepepV2Settings(num_sms=24, deterministic=True, host_sync=True, num_max_tokens_per_rank=16)
    spec = BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=16, settings=settings)
    config = DispatchConfig(DeepEPBackend, settings, ExpertLayout.EXPAND, expert_alignment=2)
    backend, reference = DeepEPBackend(group_of(), spec), ReferenceBackend(group_of(), spec)
    assert backend.ep_buffer.ctor["deterministic"] is False  # the backend orders the rows itself
    problem = make_problem(43, [5, 3], 8, 4, 2, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows].clone().requires_grad_(), problem.topk_idx[rows], problem.topk_weights[rows]
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        recv_x, _, _, _, handle = ops.DispatchFunction.apply(x, w, ops.bind(config, group_of(), 4), idx, None,
                                                             Streams(True, True))
        assert handle.buffer.ep_buffer.ctor["deterministic"] is False  # the registry's buffer: the backend sorts
        y = ops.CombineFunction.apply(recv_x * 2, handle, Streams(True, True))
        y.sum().backward()
        assert torch.utils.deterministic.fill_uninitialized_memory  # restored after every call
    finally:
        torch.use_deterministic_algorithms(False)
    want = reference.dispatch(x.detach(), idx, w, config, 4)
    torch.testing.assert_close(y, reference.combine(want.recv_x * 2, want.handle).x)
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0) * (idx >= 0).sum(1, keepdim=True))
    backend.destroy()


@pytest.mark.parametrize("line", list(STAND_INS))
def test_adapter_passes_deepeps_determinism_check_under_deterministic_algorithms(line: str) -> None:
    run_distributed(_deterministic_algorithms_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"})


def group_of():
    import torch.distributed as dist

    return dist.group.WORLD


@pytest.mark.parametrize("line", list(STAND_INS))
def test_adapter_plumbing_against_strict_stand_in(line: str) -> None:
    run_distributed(_adapter_worker, 4, line, env={"LOCAL_WORLD_SIZE": "4"})


def test_adapter_reports_deepep_v1_and_import_failures(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_deepepv2.backends.deepep.adapter import import_deep_ep

    v1 = types.ModuleType("deep_ep")
    v1.__version__ = "1.2.1"
    v1.Buffer = object
    monkeypatch.setitem(sys.modules, "deep_ep", v1)
    with pytest.raises(ImportError, match="deep_ep 1.2.1 .* has Buffer but neither ElasticBuffer .* it is DeepEP v1"):
        import_deep_ep()


def _caller_reuses_topk_idx(rank: int, world: int) -> str:
    """V2.5's handle keeps the ``topk_idx`` it is given: a caller that refills its tensor before the backward (as the
    next replay of a CUDA graph refills its static inputs) must not change the routing of a pending combine."""
    _install_fake("V2.5")
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.backends.reference import ReferenceBackend

    spec, config = BufferSpec(hidden=8, num_topk=3, num_max_tokens_per_rank=16), DispatchConfig(DeepEPBackend)
    backend, reference = DeepEPBackend(group_of(), spec), ReferenceBackend(group_of(), spec)
    problem = make_problem(44, [6, 5], 8, 8, 3, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows].clone(), problem.topk_weights[rows]
    got, want = backend.dispatch(x, idx, w, config, 8), reference.dispatch(x, idx, w, config, 8)
    idx.copy_(idx.roll(1, dims=0))  # the caller's static tensor, refilled for the next micro-batch
    torch.testing.assert_close(backend.combine(got.recv_x, got.handle).x, reference.combine(want.recv_x, want.handle).x)
    backend.destroy()
    return "ok"


def test_v25_handles_keep_a_copy_of_the_routing_not_the_callers_tensor() -> None:
    assert run_distributed(_caller_reuses_topk_idx, 2, env={"LOCAL_WORLD_SIZE": "2"}) == ["ok", "ok"]


# ------------------------------------------------------------------ deterministic mode: the order the backend makes
EXPERTS, HIDDEN, TOPK, CAPACITY = 8, 8, 3, 16
#: Tokens per rank: one rank sends none; then both send (several source groups to order).
ORDER_TOKENS = ([12, 0], [6, 9])


def _order_problem(seed: int, tokens: list[int]):
    """A problem whose routing leaves experts 2 and 5 empty (one on each rank) and drops further selections (-1)."""
    problem = make_problem(seed, tokens, HIDDEN, EXPERTS, TOPK)
    problem.topk_idx = problem.topk_idx.masked_fill((problem.topk_idx == 2) | (problem.topk_idx == 5), -1)
    return problem


def _backend_order_worker(rank: int, world: int, line: str) -> int:
    """The backend's calls in deterministic mode, with and without host sync and hybrid mode: the valid received rows,
    weights, compact ids, a cached dispatch, and a combine with weights of distinct rows, against the dense oracle."""
    use_stand_in_backend(line)
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.config import DeepepV2Settings

    oracle = DenseExchange(group_of(), CAPACITY)
    backends = {hybrid: DeepEPBackend(group_of(), BufferSpec(
        hidden=HIDDEN, num_topk=TOPK, num_max_tokens_per_rank=CAPACITY,
        settings=DeepepV2Settings(allow_hybrid_mode=hybrid))) for hybrid in (False, True)}
    assert not any(b.ep_buffer.ctor["deterministic"] for b in backends.values())
    cases = 0
    for seed, tokens in enumerate(ORDER_TOKENS):
        problem = _order_problem(seed, tokens)
        rows = problem.rows(rank)
        x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
        for layout in ExpertLayout:
            expand = layout is ExpertLayout.EXPAND
            for alignment in (1, 16, 128):
                for host_sync in (True, False):
                    for hybrid, backend in backends.items():
                        tag = f"{layout.value} alignment={alignment} host_sync={host_sync} hybrid={hybrid}"
                        settings = DeepepV2Settings(deterministic=True, host_sync=host_sync,
                                                    num_max_tokens_per_rank=CAPACITY, allow_hybrid_mode=hybrid)
                        config = DispatchConfig(DeepEPBackend, settings, layout, alignment)
                        got = backend.dispatch(x, idx, w, config, EXPERTS)
                        want_x, want_idx, want_w, plan = oracle.dispatch(
                            x, idx, w, num_experts=EXPERTS, expand=expand, alignment=alignment, cpu_sync=host_sync)
                        valid = sum(plan.aligned_counts) if expand else len(plan.rows)
                        assert got.recv_x.shape == want_x.shape, tag
                        assert torch.equal(got.recv_x[:valid], want_x[:valid]), tag
                        assert torch.equal(got.recv_topk_weights[:valid], want_w[:valid]), tag
                        if not expand:
                            assert torch.equal(got.recv_topk_idx[:valid], want_idx[:valid]), tag
                        # A combine of distinct rows (and weights): each row must reach its own token and slot.
                        gen = torch.Generator().manual_seed(1000 * cases + rank)
                        z = torch.randn(want_x.shape, generator=gen, dtype=want_x.dtype)
                        zw = torch.rand(want_w.shape, generator=gen)
                        combined = backend.combine(z, got.handle, zw)
                        expected = oracle.combine(z, plan, zw)
                        torch.testing.assert_close(combined.x, expected[0], rtol=1e-12, atol=1e-12, msg=tag)
                        assert torch.equal(combined.topk_weights, expected[1]), tag
                        for repeat in range(2):  # every cached dispatch of the handle, not just the first
                            g = torch.randn(x.shape, generator=gen, dtype=x.dtype)
                            gw = torch.rand(w.shape, generator=gen)
                            cached = backend.cached_dispatch(g, got.handle, gw)
                            want_gx, want_gw = oracle.cached_dispatch(g, plan, gw)
                            assert torch.equal(cached.recv_x[:valid], want_gx[:valid]), (tag, repeat)
                            assert torch.equal(cached.recv_topk_weights[:valid], want_gw[:valid]), (tag, repeat)
                        cases += 1
    for backend in backends.values():
        backend.destroy()
    return cases


@pytest.mark.parametrize("line", list(STAND_INS))
def test_deterministic_mode_receives_in_the_dense_order_with_and_without_host_sync(line: str) -> None:
    assert run_distributed(_backend_order_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"}) == [48, 48]


def _experts(result, local_weights: torch.Tensor, expand: bool) -> torch.Tensor:
    """The experts on the valid rows only (the same shapes with and without host sync), zero rows after them."""
    counts = result.handle.tokens_per_expert.tolist()
    valid = sum(counts) if expand else int(result.handle.num_valid_rows)
    recv_x, recv_w = result.recv_x[:valid], result.recv_topk_weights[:valid]
    if expand:
        out = experts_on_expand(recv_x, recv_w, counts, local_weights)
    else:
        out = experts_on_compact(recv_x, result.recv_topk_idx[:valid], recv_w, local_weights)
    return torch.nn.functional.pad(out, (0, 0, 0, result.recv_x.shape[0] - valid))


def _autograd_order_worker(rank: int, world: int, line: str) -> int:
    """``dispatch`` -> experts -> ``combine`` in deterministic mode: host sync or not, the same received rows (the
    oracle's), and bit-identical outputs and gradients (x, routing weights, expert weights), close to the dense step."""
    use_stand_in_backend(line)
    import megatron_deepepv2 as dv2

    local = EXPERTS // world
    mine = slice(rank * local, (rank + 1) * local)
    oracle = DenseExchange(group_of(), CAPACITY)
    runs = 0
    for seed, tokens in enumerate(ORDER_TOKENS):
        problem = _order_problem(10 + seed, tokens)
        rows = problem.rows(rank)
        dense = dense_step(problem)
        for layout in ("compact", "expand"):
            for alignment in (1, 16, 128):
                outcomes = []
                for host_sync in (True, False):
                    x = problem.x[rows].clone().requires_grad_()
                    w = problem.topk_weights[rows].clone().requires_grad_()
                    experts = problem.expert_weights[mine].clone().requires_grad_()
                    result = dv2.dispatch(x, problem.topk_idx[rows], w, EXPERTS, layout=layout,
                                          expert_alignment=alignment, backend="deepep", deterministic=True,
                                          host_sync=host_sync, num_max_tokens_per_rank=CAPACITY)
                    y = dv2.combine(_experts(result, experts, layout == "expand"), result.handle)
                    (y * problem.grad_out[rows]).sum().backward()
                    valid = int(result.handle.num_valid_rows)
                    outcomes.append((result.recv_x[:valid].detach(), result.recv_topk_weights[:valid].detach(),
                                     y.detach(), x.grad, w.grad, experts.grad))
                    runs += 1
                tag = f"{layout} alignment={alignment} tokens={tokens}"
                want_x, want_idx, want_w, _ = oracle.dispatch(problem.x[rows], problem.topk_idx[rows],
                                                       problem.topk_weights[rows], num_experts=EXPERTS,
                                                       expand=layout == "expand", alignment=alignment, cpu_sync=True)
                if layout == "compact":  # the op masks the weights of other ranks' experts
                    want_w = want_w.masked_fill(want_idx < 0, 0.0)
                synced, unsynced = outcomes
                assert torch.equal(synced[0], want_x) and torch.equal(synced[1], want_w), tag
                for name, a, b in zip(("rows", "weights", "y", "x grad", "weights grad", "experts grad"),
                                      synced, unsynced):
                    assert torch.equal(a, b), f"{tag}: {name} differs without host sync"
                for name, got, want in (("y", synced[2], dense.y[rows]), ("x grad", synced[3], dense.x_grad[rows]),
                                        ("weights grad", synced[4], dense.weights_grad[rows]),
                                        ("experts grad", synced[5], dense.experts_grad[mine])):
                    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-10, atol=1e-10, msg=f"{tag}: {name}")
    return runs


@pytest.mark.parametrize("line", list(STAND_INS))
def test_deterministic_mode_through_the_autograd_ops_is_the_same_with_and_without_host_sync(line: str) -> None:
    assert run_distributed(_autograd_order_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"}) == [24, 24]


def _scrambled_worker(rank: int, world: int, line: str) -> None:
    use_stand_in_backend(line)
    from megatron_deepepv2.backends.base import BufferSpec, DispatchConfig
    from megatron_deepepv2.backends.deepep.adapter import DeepEPBackend
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.config import DeepepV2Settings

    backend = DeepEPBackend(group_of(), BufferSpec(hidden=HIDDEN, num_topk=TOPK, num_max_tokens_per_rank=CAPACITY))
    oracle = DenseExchange(group_of(), CAPACITY)
    problem = _order_problem(3, [6, 9])
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    for layout in ExpertLayout:
        expand = layout is ExpertLayout.EXPAND
        config = DispatchConfig(DeepEPBackend, DeepepV2Settings(deterministic=False), layout, 16)
        first, second = backend.dispatch(x, idx, w, config, EXPERTS), backend.dispatch(x, idx, w, config, EXPERTS)
        want_x, _, _, plan = oracle.dispatch(x, idx, w, num_experts=EXPERTS, expand=expand, alignment=16,
                                             cpu_sync=True)
        valid = want_x.shape[0]
        assert valid > 4
        for got in (first, second):  # the same rows, in an order of DeepEP's own
            assert not torch.equal(got.recv_x, want_x), layout
            assert torch.equal(in_dense_order(got.recv_x, got.handle.native), want_x), layout
        assert not torch.equal(first.recv_x, second.recv_x), f"{layout}: one order for every dispatch"
    backend.destroy()


@pytest.mark.parametrize("line", list(STAND_INS))
def test_without_deterministic_mode_the_stand_in_receives_in_a_scrambled_order(line: str) -> None:
    """What makes the ordering tests able to fail: without deterministic mode the order is not the oracle's."""
    run_distributed(_scrambled_worker, 2, line, env={"LOCAL_WORLD_SIZE": "2"})
