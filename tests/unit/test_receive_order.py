"""The sync-free deterministic receive order against a dense per-expert sort in plain Python, and the relinking of
hybrid mode's linked list against a boolean-mask selection (the way a host-sync implementation writes it)."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_deepepv2.backends.deepep.receive_order import compact_order, expand_order, relink


def _expand_receive(seed: int, num_tokens: int, topk: int, experts: int, alignment: int, empty: set[int],
                    tail: int, garbage: int):
    """A receive as DeepEP lays it out before sorting: each expert's block aligned, its selections at random rows of
    the block (arrival order), ``tail`` rows past the last block, and ``garbage`` tokens past the valid ones whose
    metadata holds anything."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randperm(10**6, generator=gen)[:num_tokens + garbage].long() * 2039 + 7  # unique, up to ~2e9
    chosen = torch.full((num_tokens, topk), -1, dtype=torch.long)
    for t in range(num_tokens):
        picks = [e for e in torch.randperm(experts, generator=gen).tolist() if e not in empty]
        count = int(torch.randint(0, topk + 1, (1,), generator=gen))
        chosen[t, :count] = torch.tensor(picks[:count], dtype=torch.long)
    counts = [int((chosen == e).sum()) for e in range(experts)]
    sizes = [(c + alignment - 1) // alignment * alignment for c in counts]
    starts = [sum(sizes[:e]) for e in range(experts)]
    num_rows = sum(sizes) + tail
    slots = torch.full((num_tokens + garbage, topk), -1, dtype=torch.int32)
    for e in range(experts):
        rows = (starts[e] + torch.randperm(sizes[e], generator=gen)[:counts[e]]).tolist()
        for (t, k), row in zip((chosen == e).nonzero().tolist(), rows):
            slots[t, k] = row
    slots[num_tokens:] = torch.randint(-5, 3 * num_rows + 5, (garbage, topk), generator=gen, dtype=torch.int32)
    return src, slots, torch.tensor(starts), num_rows


def _dense_expand_order(src, slots, starts, num_rows, num_tokens):
    """Per expert block (the last runs to the end): its selections' rows by source token, then its other rows."""
    owner = {int(slots[t, k]): int(src[t]) for t in range(num_tokens) for k in range(slots.shape[1])
             if slots[t, k] >= 0}
    bounds = starts.tolist() + [num_rows]
    order = []
    for e in range(len(starts)):
        block = range(bounds[e], max(bounds[e], bounds[e + 1]) if e < len(starts) - 1 else num_rows)
        order += sorted((r for r in block if r in owner), key=owner.get) + [r for r in block if r not in owner]
    return order


@pytest.mark.parametrize("alignment", [1, 16, 128])
@pytest.mark.parametrize("seed", range(4))
def test_expand_order_is_the_per_expert_sort_by_source_token(alignment: int, seed: int) -> None:
    num_tokens, topk, experts = 40 + 17 * seed, 4, 6
    empty = {seed % experts}  # an expert no token selects: an empty block
    tail, garbage = (0, 0) if seed == 0 else (3 * alignment + seed, 5)  # worst-case receives from seed 1 on
    src, slots, starts, num_rows = _expand_receive(seed, num_tokens, topk, experts, alignment, empty, tail, garbage)
    valid_tokens = None if garbage == 0 else torch.tensor(num_tokens)
    order, new_slots = expand_order(src, slots, starts, num_rows, valid_tokens)
    expected = _dense_expand_order(src, slots, starts, num_rows, num_tokens)
    assert order.tolist() == expected
    position = {row: i for i, row in enumerate(expected)}
    want = slots.clone()
    for t in range(num_tokens):
        for k in range(topk):
            if slots[t, k] >= 0:
                want[t, k] = position[int(slots[t, k])]
    assert torch.equal(new_slots, want) and new_slots.dtype == slots.dtype
    # Applied to rows that carry their source token, each block reads in source order, selections first.
    carried = torch.full((num_rows,), -1, dtype=torch.long)
    for t in range(num_tokens):
        for k in range(topk):
            if slots[t, k] >= 0:
                carried[slots[t, k]] = src[t]
    ordered = carried[order]
    for t in range(num_tokens):
        for k in range(topk):
            if new_slots[t, k] >= 0:
                assert ordered[new_slots[t, k]] == src[t]


def test_expand_order_of_no_rows_and_of_no_selections() -> None:
    order, slots = expand_order(torch.zeros(2, dtype=torch.long), torch.full((2, 3), -1, dtype=torch.int32),
                                torch.zeros(4, dtype=torch.long), 0)
    assert order.numel() == 0 and (slots == -1).all()
    order, slots = expand_order(torch.arange(2), torch.full((2, 3), -1, dtype=torch.int32),
                                torch.tensor([0, 16, 16, 32]), 48)
    assert order.tolist() == list(range(48)) and (slots == -1).all()


@pytest.mark.parametrize("valid", [None, 0, 7, 30])
def test_compact_order_sorts_by_source_token_with_the_tail_last(valid) -> None:
    gen = torch.Generator().manual_seed(3)
    src = torch.randperm(10**6, generator=gen)[:30] * 997 + 5  # unique, up to ~1e9
    count = 30 if valid is None else valid
    order = compact_order(src, None if valid is None else torch.tensor(valid))
    expected = sorted(range(count), key=lambda r: int(src[r])) + list(range(count, 30))
    assert order.tolist() == expected


def test_the_order_reads_nothing_on_the_host() -> None:
    """Every step is a tensor op: the order of a receive on the meta device (no data at all) has the right shapes."""
    src, slots, starts, num_rows = _expand_receive(1, 20, 3, 4, 16, set(), 9, 4)
    order, new_slots = expand_order(src.to("meta"), slots.to("meta"), starts.to("meta"), num_rows,
                                    torch.tensor(20, device="meta"))
    assert order.shape == (num_rows,) and new_slots.shape == slots.shape
    assert compact_order(src.to("meta"), torch.tensor(20, device="meta")).shape == src.shape


def _dense_relink(links: torch.Tensor, order: torch.Tensor, num_valid: int) -> torch.Tensor:
    """Boolean-mask selection, as with a host sync: the entries naming a valid row take that row's new position."""
    new_position = torch.argsort(order)  # the inverse of the gather permutation
    out = links.clone()
    points_to_a_row = (links >= 0) & (links < num_valid)
    out[points_to_a_row] = new_position[links[points_to_a_row].long()].to(links.dtype)
    return out


@pytest.mark.parametrize("valid", [None, 0, 9, 25])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("any_order", [False, True])
def test_relink_points_the_links_to_where_their_rows_went(valid, dtype: torch.dtype, any_order: bool) -> None:
    """``any_order``: a gather that also moves the rows past the valid ones (compact_order leaves them in place);
    links to those still stay."""
    num_rows = 25
    gen = torch.Generator().manual_seed(5 + (valid or 0))
    src = torch.randperm(10**6, generator=gen)[:num_rows] * 1009 + 3
    num_valid = num_rows if valid is None else valid
    order = torch.randperm(num_rows, generator=gen) if any_order else compact_order(
        src, None if valid is None else torch.tensor(valid))
    # Entries to rows (valid or not), negative ones, and ones past every row.
    links = torch.randint(-4, num_rows + 6, (3, 40), generator=gen, dtype=dtype)
    links[0, :4] = torch.tensor([-1, -7, num_rows, num_rows + 100], dtype=dtype)
    assert (links < 0).any() and (links >= num_valid).any() and ((links >= 0) & (links < num_valid)).any() == (
        num_valid > 0)
    got = relink(links, order, None if valid is None else torch.tensor(valid))
    assert got.dtype == dtype and got.shape == links.shape
    assert torch.equal(got, _dense_relink(links, order, num_valid))
    # What the links are for: each still reaches the same source token after the rows are gathered.
    moved = (links >= 0) & (links < num_valid)
    assert torch.equal(src[order][got[moved].long()], src[links[moved].long()])
    assert torch.equal(got[~moved], links[~moved])


def test_relink_of_no_rows_and_of_no_links() -> None:
    links = torch.tensor([[-1, 0, 3], [2, -2, 1]], dtype=torch.int32)
    empty_order = torch.zeros(0, dtype=torch.int64)
    assert torch.equal(relink(links, empty_order), links)
    assert torch.equal(relink(links, empty_order, torch.tensor(0)), links)
    order = compact_order(torch.tensor([30, 10, 20, 0]))
    none = torch.zeros((2, 0), dtype=torch.int32)
    assert relink(none, order).shape == (2, 0)
    # Every row valid, ordered [3, 1, 2, 0]: row 0 went to 3, row 1 stayed, row 2 stayed, row 3 went to 0.
    assert relink(links, order).tolist() == [[-1, 3, 0], [2, -2, 1]]
    # Two valid rows, ordered [1, 0, 2, 3]: rows 0 and 1 swapped; links past them stay.
    two = torch.tensor(2)
    assert relink(links, compact_order(torch.tensor([30, 10, 20, 0]), two), two).tolist() == [[-1, 1, 3], [2, -2, 0]]


def _handle(num_topk: int = 3, rows: int = 6, **changes):
    """A DeepEP handle as the ordering reads it, laid out as DeepEP 2.1.0 and V2.5 lay it out, with ``changes``."""
    from types import SimpleNamespace

    fields = dict(recv_src_metadata=torch.zeros(rows, num_topk + 2, dtype=torch.int32),
                  psum_num_recv_tokens_per_scaleup_rank=torch.tensor([rows], dtype=torch.int32),
                  psum_num_recv_tokens_per_expert=torch.tensor([2, 6], dtype=torch.int32),
                  num_unaligned_recv_tokens_per_expert=torch.tensor([2, 1], dtype=torch.int32),
                  channel_linked_list=None)
    fields.update(changes)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("layout", ["compact", "expand"])
def test_the_handle_layout_the_order_relies_on_is_accepted(layout: str) -> None:
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.deepep.receive_order import check_handle_layout

    check_handle_layout(_handle(), 3, ExpertLayout.parse(layout))
    check_handle_layout(_handle(channel_linked_list=torch.zeros(4, 2, dtype=torch.int64)), 3, ExpertLayout.COMPACT)


@pytest.mark.parametrize("layout,change,named", [
    ("compact", dict(recv_src_metadata=torch.zeros(6, 4, dtype=torch.int32)), "recv_src_metadata is (6, 4)"),
    ("expand", dict(recv_src_metadata=torch.zeros(6, 5)), "recv_src_metadata is (6, 5) torch.float32"),
    ("expand", dict(recv_src_metadata=torch.zeros(6, 6, dtype=torch.int64)), "recv_src_metadata is (6, 6)"),
    ("compact", dict(recv_src_metadata=torch.zeros(30, dtype=torch.int32)), "recv_src_metadata is (30,)"),
    ("expand", dict(psum_num_recv_tokens_per_scaleup_rank=None), "psum_num_recv_tokens_per_scaleup_rank is None"),
    ("expand", dict(num_unaligned_recv_tokens_per_expert=torch.zeros(2, 1, dtype=torch.int32)),
     "num_unaligned_recv_tokens_per_expert is (2, 1)"),
    ("compact", dict(channel_linked_list=torch.zeros(4)), "channel_linked_list is (4,) torch.float32"),
])
def test_a_handle_laid_out_otherwise_is_refused_before_it_is_rewritten(layout: str, change: dict, named: str) -> None:
    """A DeepEP whose handle is laid out otherwise would have its metadata silently corrupted by the rewrite: the
    ordering refuses it, naming the field, and leaves the handle as it was."""
    from megatron_deepepv2.layout import ExpertLayout
    from megatron_deepepv2.backends.deepep.receive_order import order_received

    handle = _handle(**change)
    before = {name: None if t is None else t.clone() for name, t in vars(handle).items()}
    rows = torch.randn(6, 4)
    recv_idx = torch.zeros(6, 3, dtype=torch.int64) if layout == "compact" else None
    weights = torch.rand(6, 3) if layout == "compact" else torch.rand(6)
    with pytest.raises(RuntimeError, match=re.escape(named) + ".*Deterministic mode supports DeepEP 2.1.0 and V2.5"):
        order_received(rows, recv_idx, weights, handle, 3, ExpertLayout.parse(layout), host_sync=False, cached=False,
                       receive_order=None)
    for name, tensor in vars(handle).items():
        assert (tensor is None) == (before[name] is None) and (tensor is None or torch.equal(tensor, before[name]))
