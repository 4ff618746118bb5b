"""The DeepEP adapter's plumbing, on CPU, against strict stand-ins for ``deep_ep.ElasticBuffer`` (2.1) and
``deep_ep.EPBuffer`` (V2.5, written from DeepEP's ``deep_ep/buffers/ep.py``: exact signatures, ``do_handle_copy``
must be False, ``topk_idx`` version-checked by the handle, even SM counts, ``defer_epilogue`` only in async mode).

The 2.1 stand-in enforces the host-side rules of DeepEP 2.1.0 that the adapter must respect (cached dispatch
needs ``num_sms`` and no ``topk_idx``; ``previous_event`` only with ``allocate_on_comm_stream``; zero padding
only with expand; events waited only in async mode; explicit destroy; torch's deterministic algorithms never
together with ``fill_uninitialized_memory``) and computes its results with a dense oracle of DeepEP's
exchange (:mod:`tests.stand_in`, which shares no code with the package's backends), so the adapter's results are
compared with an independent computation. Real ElasticBuffer runs are in ``tests/functional``.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from tests.distributed import run_distributed
from tests.oracle import make_problem
from tests.stand_in import DenseExchange


class _Handle:
    def __init__(self, plan, do_expand: bool, num_sms: int, do_cpu_sync: bool) -> None:
        self.plan, self.do_expand, self.num_sms = plan, do_expand, num_sms
        # Without CPU sync DeepEP leaves the host list empty.
        self.num_recv_tokens_per_expert_list = list(plan.aligned_counts) if do_cpu_sync else []
        # DeepEP's device-side prefix sums, as documented: compact = inclusive psum of aligned counts;
        # expand = aligned start of expert i + its real count.
        aligned = torch.tensor(plan.aligned_counts, dtype=torch.int32)
        self.psum_num_recv_tokens_per_scaleup_rank = torch.tensor([0, len(plan.rows)], dtype=torch.int32)
        if do_expand:
            starts = torch.cumsum(aligned, 0) - aligned
            self.psum_num_recv_tokens_per_expert = (starts + torch.tensor(plan.real_counts)).to(torch.int32)
        else:
            self.psum_num_recv_tokens_per_expert = torch.cumsum(aligned, 0).to(torch.int32)
        self.num_valid_rows = sum(plan.aligned_counts) if do_expand else len(plan.rows)
        self.do_cpu_sync = do_cpu_sync


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


class _DenseStandIn:
    """What both stand-ins share: the dense exchange, the recorded constructor, events, destroy."""

    def _setup(self, group, num_max_tokens_per_rank, allow_hybrid_mode, deterministic, allow_multiple_reduction,
               explicitly_destroy) -> None:
        assert allow_multiple_reduction and explicitly_destroy
        self.num_bytes = 1 << 21
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.ctor = dict(allow_hybrid_mode=allow_hybrid_mode, deterministic=deterministic, T=num_max_tokens_per_rank)
        self.exchange = DenseExchange(group, num_max_tokens_per_rank)
        self.destroyed = False

    @staticmethod
    def capture():
        return "event-handle"

    @staticmethod
    def _garbage_past_valid_rows(recv_idx, recv_weights, plan, handle) -> None:
        """DeepEP leaves rows past the valid extent uninitialised without CPU sync: make them garbage."""
        tail = torch.arange(plan.num_recv_rows) >= handle.num_valid_rows
        if recv_idx is not None:
            recv_idx[tail] = 1
        if recv_weights is not None:
            recv_weights[tail] = 123.0

    def _cached_rows(self, x, handle, topk_weights):
        """A cached dispatch's rows; without CPU sync DeepEP leaves those past the valid extent uninitialised."""
        recv_x, recv_weights = self.exchange.cached_dispatch(x, handle.plan, topk_weights)
        if not handle.do_cpu_sync:
            recv_x[torch.arange(recv_x.shape[0]) >= handle.num_valid_rows] = 99.0
        return recv_x, recv_weights

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
        from megatron_deepepv2.backends import ExpertLayout

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
            recv_x, recv_weights = self._cached_rows(x, handle, topk_weights)
            recv_idx = None if do_expand else self._local_idx(handle.plan)
            return recv_x, recv_idx, recv_weights, handle, _EventOverlap(async_with_compute_stream, log)
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        recv_x, recv_idx, recv_weights, plan = self.exchange.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts, expand=do_expand, alignment=expert_alignment,
            cpu_sync=do_cpu_sync)
        ep_handle = _Handle(plan, do_expand, num_sms or 20, do_cpu_sync)
        if not do_cpu_sync:
            self._garbage_past_valid_rows(recv_idx, recv_weights, plan, ep_handle)
        return recv_x, recv_idx, recv_weights, ep_handle, _EventOverlap(async_with_compute_stream, log)

    @staticmethod
    def _local_idx(plan):
        recv_idx = torch.full((plan.num_recv_rows, plan.num_topk), -1, dtype=torch.int64)
        recv_idx[:len(plan.rows)] = plan.local_idx
        return recv_idx

    def combine(self, x, handle, topk_weights=None, num_sms=0, previous_event=None, async_with_compute_stream=False,
                allocate_on_comm_stream=False, **rest):
        assert not rest, rest
        self._check_common(previous_event, allocate_on_comm_stream,
                           dict(op="combine", num_sms=num_sms, prev=previous_event, alloc=allocate_on_comm_stream,
                                async_=async_with_compute_stream))
        combined, combined_weights = self.exchange.combine(x, handle.plan, topk_weights)
        return combined, combined_weights, _EventOverlap(async_with_compute_stream, [])


class _EPHandleV25(_Handle):
    """V2.5's EPHandle: keeps ``topk_idx`` by reference and asserts it was not modified while in use."""

    def __init__(self, plan, do_expand, num_sms, do_cpu_sync, topk_idx, num_experts, alignment, capacity) -> None:
        super().__init__(plan, do_expand, num_sms, do_cpu_sync)
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
            recv_x, recv_weights = self._cached_rows(x, handle, topk_weights)
            recv_idx = None if do_expand else FakeElasticBuffer._local_idx(handle.plan)
            return recv_x, recv_idx, recv_weights, handle, _EventOverlap(async_with_compute_stream, [])
        num_sms = num_sms + num_sms % 2  # align(num_sms, 2)
        capacity = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync
        alignment = expert_alignment or 1
        recv_x, recv_idx, recv_weights, plan = self.exchange.dispatch(
            x, topk_idx, topk_weights, num_experts=num_experts, expand=do_expand, alignment=alignment,
            cpu_sync=do_cpu_sync)
        ep_handle = _EPHandleV25(plan, do_expand, num_sms or 20, do_cpu_sync, topk_idx, num_experts, alignment,
                                 capacity)
        if not do_cpu_sync:
            self._garbage_past_valid_rows(recv_idx, recv_weights, plan, ep_handle)
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
        combined, combined_weights = self.exchange.combine(x, handle.plan, topk_weights)
        return combined, combined_weights, _EventOverlap(async_with_compute_stream, [])


#: The stand-in of each DeepEP line: the buffer class and the module attribute it is exported as.
STAND_INS = {"2.1": ("ElasticBuffer", FakeElasticBuffer), "V2.5": ("EPBuffer", FakeEPBuffer)}


def _install_fake(line: str = "2.1") -> None:
    name, cls = STAND_INS[line]
    module = types.ModuleType("deep_ep")
    setattr(module, name, cls)
    module.__version__ = "2.5.0-fake" if line == "V2.5" else "2.1.0-fake"
    sys.modules["deep_ep"] = module


def use_stand_in_backend(line: str = "2.1") -> None:
    """Makes ``backend="deepep"`` run the adapter over a line's stand-in, on CPU tensors of any dtype (in a rank)."""
    from megatron_deepepv2.backends import DeepEPBackend, ReferenceBackend

    _install_fake(line)
    DeepEPBackend.unavailable_reason = classmethod(lambda cls: None)
    DeepEPBackend.limits = ReferenceBackend.limits


def _adapter_worker(rank: int, world: int, line: str) -> None:
    # The stand-in, and the reference backend's limits, so that the autograd ops take CPU tensors of any dtype.
    use_stand_in_backend(line)
    stand_in = STAND_INS[line][1]
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends import BufferSpec, DeepEPBackend, DispatchConfig, ExpertLayout, ReferenceBackend, Streams
    from megatron_deepepv2.config import DeepepV2Settings

    derived = []  # one entry per derivation of device counts from DeepEP's prefix sums
    count_from_psum = DeepEPBackend.device_counts
    DeepEPBackend.device_counts = lambda self, handle: derived.append(1) or count_from_psum(self, handle)
    spec = BufferSpec(hidden=8, num_topk=3, num_max_tokens_per_rank=32, settings=DeepepV2Settings(num_sms=23))
    sms = 24 if line == "V2.5" else 23  # V2.5 runs an even count; the backend rounds it itself
    backend, reference = DeepEPBackend(group_of(), spec), ReferenceBackend(group_of(), spec)
    assert isinstance(backend.buffer, stand_in) and backend.num_sms == sms
    assert backend.buffer.ctor["allow_hybrid_mode"] is False  # single node -> direct mode
    problem = make_problem(41, [7, 0, 5, 9][:world], 8, 8, 3, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows], problem.topk_idx[rows], problem.topk_weights[rows]
    for layout, host_sync in [(layout, sync) for layout in ExpertLayout for sync in (True, False)]:
        # The settings of the buffer above: the autograd ops below get theirs from the buffer registry.
        settings = DeepepV2Settings(host_sync=host_sync, num_sms=23, num_max_tokens_per_rank=32)
        config = DispatchConfig(DeepEPBackend, settings, layout, 4, layout is ExpertLayout.EXPAND)
        derived.clear()
        got, want = backend.dispatch(x, idx, w, config, 8), reference.dispatch(x, idx, w, config, 8)
        assert torch.equal(got.recv_x, want.recv_x)
        assert got.handle.tokens_per_expert_list == want.handle.tokens_per_expert_list
        # The device counts are derived only when asked for (host-sync callers use the host list), and once.
        assert not derived
        assert torch.equal(got.handle.tokens_per_expert, want.handle.tokens_per_expert)
        assert len(derived) == 1
        valid = int(want.handle.num_valid_rows)
        assert int(got.handle.num_valid_rows) == valid and len(derived) == 1
        assert got.handle.num_recv_rows == want.recv_x.shape[0]
        # The backend hands DeepEP's tensors back as they are: past the valid extent they are unspecified.
        assert torch.equal(got.recv_topk_weights[:valid], want.recv_topk_weights[:valid])
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(got.recv_topk_idx[:valid], want.recv_topk_idx[:valid])
        assert (got.recv_topk_idx is None) == (layout is ExpertLayout.EXPAND)
        combined = backend.combine(got.recv_x, got.handle, got.recv_topk_weights)
        expected = reference.combine(want.recv_x, want.handle, want.recv_topk_weights)
        torch.testing.assert_close(combined.x, expected.x)
        torch.testing.assert_close(combined.topk_weights, expected.topk_weights)
        cached = backend.cached_dispatch(problem.grad_out[rows], got.handle)
        assert torch.equal(cached.recv_x[:valid], reference.cached_dispatch(problem.grad_out[rows], want.handle).recv_x[:valid])
        # The autograd ops with DeepEP's stream flags: previous event passed, async events waited; the direct-call
        # passes clear what DeepEP left past the valid extent (expert id -1, weight 0, zero gradient rows).
        stand_in.calls.clear()
        _EventOverlap.created.clear()
        xg = x.clone().requires_grad_()
        bound = ops.bind(config, group_of(), 8)
        recv_x, recv_w, _, recv_idx, handle = ops.DispatchFunction.apply(xg, w, bound, idx, None, Streams(True, True))
        assert isinstance(handle.buffer, DeepEPBackend) and handle.buffer is not backend  # the registry's buffer
        assert torch.equal(recv_w, want.recv_topk_weights.masked_fill(
            want.recv_topk_idx < 0, 0) if layout is ExpertLayout.COMPACT else want.recv_topk_weights)
        if layout is ExpertLayout.COMPACT:
            assert torch.equal(recv_idx, want.recv_topk_idx)
        recv_x.retain_grad()
        y = ops.CombineFunction.apply(recv_x, handle, Streams(True, True))
        y.sum().backward()
        grad_rows = reference.cached_dispatch(torch.ones_like(y), want.handle).recv_x
        assert torch.equal(recv_x.grad[:valid], grad_rows[:valid]) and not recv_x.grad[valid:].any()
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
    config = DispatchConfig(DeepEPBackend, layout=ExpertLayout.EXPAND, expert_alignment=4, zero_padding=True)
    got, want = backend.dispatch(fp8, idx, w, config, 8), reference.dispatch(fp8, idx, w, config, 8)
    assert isinstance(got.recv_x, tuple) and got.recv_x[0].dtype == torch.float8_e4m3fn
    assert torch.equal(got.recv_x[0].view(torch.uint8), want.recv_x[0].view(torch.uint8))
    assert torch.equal(got.recv_x[1], want.recv_x[1])
    backend.destroy()
    assert backend.buffer is None


def _deterministic_algorithms_worker(rank: int, world: int, line: str) -> None:
    """Megatron's --deterministic-mode turns on torch's deterministic algorithms with the fill left on (torch's
    default): every adapter call must still pass DeepEP's check, and the user's setting must come back."""
    use_stand_in_backend(line)
    from megatron_deepepv2 import ops
    from megatron_deepepv2.backends import BufferSpec, DeepEPBackend, DispatchConfig, ExpertLayout, ReferenceBackend, Streams
    from megatron_deepepv2.config import DeepepV2Settings

    settings = DeepepV2Settings(num_sms=24, deterministic=True, host_sync=True, num_max_tokens_per_rank=16)
    spec = BufferSpec(hidden=8, num_topk=2, num_max_tokens_per_rank=16, settings=settings)
    config = DispatchConfig(DeepEPBackend, settings, ExpertLayout.EXPAND, expert_alignment=2, zero_padding=True)
    backend, reference = DeepEPBackend(group_of(), spec), ReferenceBackend(group_of(), spec)
    assert backend.buffer.ctor["deterministic"] is True
    problem = make_problem(43, [5, 3], 8, 4, 2, dtype=torch.float32)
    rows = problem.rows(rank)
    x, idx, w = problem.x[rows].clone().requires_grad_(), problem.topk_idx[rows], problem.topk_weights[rows]
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory
        recv_x, _, _, _, handle = ops.DispatchFunction.apply(x, w, ops.bind(config, group_of(), 4), idx, None,
                                                             Streams(True, True))
        assert handle.buffer.buffer.ctor["deterministic"] is True  # the registry's buffer, built from the settings
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
    from megatron_deepepv2.backends.deepep import import_deep_ep

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
    from megatron_deepepv2.backends import BufferSpec, DeepEPBackend, DispatchConfig, ReferenceBackend

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
