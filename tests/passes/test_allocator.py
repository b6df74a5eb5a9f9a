"""The CUDA caching-allocator model, on hand-made event sequences with numbers derived by hand
from the rules in c10/cuda/CUDACachingAllocator.cpp (see passes/allocator.py), then on a
hand-built StepGraph and on one real capture."""
from __future__ import annotations

import doctest
import importlib

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.errors import PassError
from graphmem.passes import liveness
from graphmem.passes.allocator import allocator, events_from_step, later_steps_events, round_size, simulate
from graphmem.stepgraph import OpNode, StepGraph, Storage

allocator_module = importlib.import_module("graphmem.passes.allocator")  # the module, not the pass function

KiB, MiB = 1 << 10, 1 << 20


def _allocs(*sizes: int) -> list[tuple[str, int, int]]:
    return [("alloc", i, n) for i, n in enumerate(sizes)]


# --- rounding and pools -------------------------------------------------------------------

def test_round_size() -> None:
    assert [round_size(n) for n in (1, 511, 512, 513, 1024, 1025)] == [512, 512, 512, 1024, 1024, 1536]


def test_one_tiny_alloc_gets_512_bytes_in_a_2mib_small_segment() -> None:
    # GIVEN one 1-byte request  WHEN replayed  THEN a 512 B block in a fresh 2 MiB segment
    r = simulate(_allocs(1))
    assert (r.max_allocated, r.max_reserved, r.segments) == (512, 2 * MiB, 1)
    assert r.timeline == ((512, 2 * MiB),)
    assert r.fragmentation == 2 * MiB - 512


def test_small_allocs_share_one_segment() -> None:
    # 1000 B -> 1024; 600 KiB is already a multiple of 512. Both are split off the same 2 MiB.
    r = simulate(_allocs(1000, 600 * KiB))
    assert r.timeline == ((1024, 2 * MiB), (1024 + 600 * KiB, 2 * MiB))
    assert r.segments == 1


def test_one_mib_is_still_small_pool() -> None:
    # 1 MiB = kSmallSize goes to the small pool: A splits a 2 MiB segment (1 MiB left over),
    # B takes that 1 MiB exactly, C needs a second 2 MiB segment.
    r = simulate(_allocs(MiB, MiB, MiB))
    assert r.timeline == ((MiB, 2 * MiB), (2 * MiB, 2 * MiB), (3 * MiB, 4 * MiB))
    assert r.segments == 2


def test_just_over_one_mib_takes_a_20mib_large_segment() -> None:
    # 1 MiB + 1 rounds to 1 MiB + 512 > kSmallSize: large pool, < kMinLargeAlloc -> kLargeBuffer;
    # 20 MiB - (1 MiB + 512) left over is > 1 MiB, so it is split: allocated is the rounded size.
    r = simulate(_allocs(MiB + 1))
    assert (r.max_allocated, r.max_reserved) == (MiB + 512, 20 * MiB)


@pytest.mark.parametrize("request_bytes, segment, allocated", [
    (10 * MiB - 512, 20 * MiB, 10 * MiB - 512),  # below kMinLargeAlloc: kLargeBuffer, split
    (10 * MiB, 10 * MiB, 10 * MiB),  # at kMinLargeAlloc: own segment, a multiple of 2 MiB
    (30 * MiB, 30 * MiB, 30 * MiB),  # already a multiple of kRoundLarge
    (31 * MiB, 32 * MiB, 32 * MiB),  # 32 MiB segment; 1 MiB left over is not > kSmallSize: unsplit
    (19 * MiB, 20 * MiB, 20 * MiB),  # 1 MiB left over: not split, the block counts whole
    (19 * MiB - 512, 20 * MiB, 19 * MiB - 512),  # 1 MiB + 512 left over: split
])
def test_large_segment_sizes_and_the_large_split_threshold(request_bytes: int, segment: int, allocated: int) -> None:
    r = simulate(_allocs(request_bytes))
    assert (r.max_reserved, r.max_allocated, r.segments) == (segment, allocated, 1)


# --- best fit, splitting, coalescing --------------------------------------------------------

def test_best_fit_picks_the_smallest_free_block_that_fits() -> None:
    # GIVEN free large blocks of 12, 16 and 14 MiB (own segments, in that address order)
    events = _allocs(12 * MiB, 16 * MiB, 14 * MiB) + [("free", 0, 0), ("free", 1, 0), ("free", 2, 0)]
    # WHEN 13 MiB is requested: 12 is too small, best fit is 14 (first fit by address would be 16);
    # 1 MiB left over is not split, so allocated is 14 MiB. Then 15 MiB takes the 16 MiB block
    # (unsplit: +16 MiB), then 12 MiB takes the 12 MiB block (+12 MiB).
    events += [("alloc", 3, 13 * MiB), ("alloc", 4, 15 * MiB), ("alloc", 5, 12 * MiB)]
    r = simulate(events)
    # THEN no new segment: reserved stays 12 + 16 + 14 = 42 MiB
    assert [a for a, _ in r.timeline[-3:]] == [14 * MiB, 30 * MiB, 42 * MiB]
    assert r.max_reserved == 42 * MiB and r.segments == 3


def test_small_pool_splits_when_512_bytes_are_left() -> None:
    # A and B fill one 2 MiB segment (1 MiB each); freeing A leaves a 1 MiB hole next to B.
    # 1 MiB - 512 takes the hole and splits off 512 B (>= kMinBlockSize); a 512 B request then
    # takes that remainder, so no second segment: allocated reaches exactly 2 MiB.
    events = _allocs(MiB, MiB) + [("free", 0, 0), ("alloc", 2, MiB - 512), ("alloc", 3, 512)]
    r = simulate(events)
    assert r.timeline == ((MiB, 2 * MiB), (2 * MiB, 2 * MiB), (MiB, 2 * MiB),
                          (2 * MiB - 512, 2 * MiB), (2 * MiB, 2 * MiB))
    assert r.segments == 1


def test_large_pool_keeps_up_to_one_mib_inside_the_block() -> None:
    # A 19 MiB request in a free 20 MiB block leaves exactly 1 MiB: not split (needs > kSmallSize),
    # so the whole 20 MiB counts as allocated and a following 1 MiB + 512 needs a new segment.
    events = _allocs(20 * MiB) + [("free", 0, 0), ("alloc", 1, 19 * MiB), ("alloc", 2, MiB + 512)]
    r = simulate(events)
    assert r.timeline[-2:] == ((20 * MiB, 20 * MiB), (21 * MiB + 512, 40 * MiB))


@pytest.mark.parametrize("order", [(0, 1), (1, 0)])
def test_freed_neighbours_coalesce(order: tuple[int, int]) -> None:
    # A (512 KiB), B (512 KiB) and C (1 MiB, the exact rest) fill one 2 MiB small segment.
    # Freeing A and B (either order) merges them into one 1 MiB block, which a 1 MiB request
    # then reuses: still one segment, reserved 2 MiB, allocated back to 2 MiB.
    events = _allocs(512 * KiB, 512 * KiB, MiB) + [("free", i, 0) for i in order] + [("alloc", 3, MiB)]
    r = simulate(events)
    assert r.timeline[-1] == (2 * MiB, 2 * MiB)
    assert r.segments == 1


def test_max_allocated_is_the_max_of_summed_rounded_sizes() -> None:
    # 100 -> 512, 1000 -> 1024, 3000 -> 3072: sums 512, 1536, 1024 (first freed), 4096.
    r = simulate(_allocs(100, 1000) + [("free", 0, 0), ("alloc", 2, 3000)])
    assert [a for a, _ in r.timeline] == [512, 1536, 1024, 4096]
    assert r.max_allocated == r.allocated_at_peak == 4096


def test_preexisting_count_in_the_peak_but_not_the_timeline() -> None:
    # Parameters of 1 MiB + 512 (large pool: 20 MiB segment) and 100 B (small: 2 MiB segment).
    r = simulate([("alloc", 0, 1000)], preexisting=[MiB + 512, 100])
    assert r.timeline == ((MiB + 512 + 512 + 1024, 22 * MiB),)
    assert r.max_allocated == MiB + 2048 and r.segments == 2


# --- fragmentation and expandable segments -------------------------------------------------

# alloc A 8 MiB, B 8 MiB, free A, alloc C 12 MiB
EIGHT_EIGHT_TWELVE = _allocs(8 * MiB, 8 * MiB) + [("free", 0, 0), ("alloc", 2, 12 * MiB)]


def test_fragmentation_new_segment_although_enough_bytes_are_free() -> None:
    # A: 20 MiB segment, split [A 8 | free 12]. B fits the 12 MiB block: [A 8 | B 8 | free 4].
    # Free A: [free 8 | B 8 | free 4] (not adjacent to each other). C = 12 MiB >= kMinLargeAlloc:
    # no free block fits, new 12 MiB segment. At the peak: allocated 8 + 12, reserved 20 + 12.
    r = simulate(EIGHT_EIGHT_TWELVE)
    assert r.timeline == ((8 * MiB, 20 * MiB), (16 * MiB, 20 * MiB), (8 * MiB, 20 * MiB), (20 * MiB, 32 * MiB))
    assert (r.max_allocated, r.allocated_at_peak, r.reserved_at_peak) == (20 * MiB, 20 * MiB, 32 * MiB)
    assert r.fragmentation == 12 * MiB and r.segments == 2


def test_expandable_segments_map_20mib_pages_in_the_large_pool() -> None:
    # Same events, expandable: the large pool maps kLargeBuffer (20 MiB) pages. A maps one page:
    # [A 8 | free 12 | unmapped]; B: [A | B 8 | free 4 | unmapped]; free A: [free 8 | B | free 4 | ..].
    # C: nothing fits; the free 4 MiB before the unmapped tail grows by ceil(8/20) = 1 page:
    # [free 8 | B | C 12 | free 12 | unmapped]. Reserved 40 MiB, more than without (32 MiB):
    # expandable segments do not always reserve less.
    r = simulate(EIGHT_EIGHT_TWELVE, expandable_segments=True)
    assert r.timeline == ((8 * MiB, 20 * MiB), (16 * MiB, 20 * MiB), (8 * MiB, 20 * MiB), (20 * MiB, 40 * MiB))
    assert (r.max_allocated, r.reserved_at_peak, r.fragmentation, r.segments) == (20 * MiB, 40 * MiB, 20 * MiB, 1)


# a growing batch: 12 MiB, free, 14 MiB, free, 16 MiB (the case Note [Expandable Segments] names)
GROWING = [("alloc", 0, 12 * MiB), ("free", 0, 0), ("alloc", 1, 14 * MiB), ("free", 1, 0), ("alloc", 2, 16 * MiB)]


def test_growing_requests_fragment_fixed_segments() -> None:
    # Each request is >= 10 MiB and larger than every cached block: segments of 12, 14, 16 MiB.
    r = simulate(GROWING)
    assert r.timeline[-1] == (16 * MiB, 42 * MiB)
    assert (r.max_allocated, r.reserved_at_peak, r.fragmentation, r.segments) == (16 * MiB, 42 * MiB, 26 * MiB, 3)


def test_growing_requests_reuse_one_expandable_segment() -> None:
    # 12 MiB maps one 20 MiB page, split [12 | free 8]; each free merges back to one free 20 MiB
    # block, which 14 and 16 MiB reuse (split at 512 B). Reserved stays 20 MiB.
    r = simulate(GROWING, expandable_segments=True)
    assert r.timeline == ((12 * MiB, 20 * MiB), (0, 20 * MiB), (14 * MiB, 20 * MiB), (0, 20 * MiB), (16 * MiB, 20 * MiB))
    assert (r.reserved_at_peak, r.fragmentation, r.segments) == (20 * MiB, 4 * MiB, 1)


def test_expandable_small_pool_grows_by_2mib_pages() -> None:
    # Small pool pages are 2 MiB: A, B fill one page (1 MiB each, B exactly); C maps a second
    # page right after it. Same reserved as two 2 MiB segments, but one segment.
    r = simulate(_allocs(MiB, MiB, MiB), expandable_segments=True)
    assert r.timeline == ((MiB, 2 * MiB), (2 * MiB, 2 * MiB), (3 * MiB, 4 * MiB))
    assert r.segments == 1


def test_expandable_best_fit_prefers_a_block_that_is_not_the_growing_tail() -> None:
    # [A 4 | B 12 | C 2 | free 2 | unmapped] after A, B, C in one 20 MiB page. Free B: [A | free 12 |
    # C | free 2 (tail)]. A 2 MiB request: best fit by size is the 2 MiB tail block, but its
    # expandable size includes the unmapped space, so the 12 MiB hole is used (split) instead.
    # Then 11 MiB needs more than the 10 MiB left in the hole: the 2 MiB tail grows by one page.
    events = _allocs(4 * MiB, 12 * MiB, 2 * MiB) + [("free", 1, 0), ("alloc", 3, 2 * MiB), ("alloc", 4, 11 * MiB)]
    r = simulate(events, expandable_segments=True)
    assert r.timeline[-2:] == ((8 * MiB, 20 * MiB), (19 * MiB, 40 * MiB))
    # had the 2 MiB request taken the tail, the hole (12 MiB) would have fit 11 MiB: reserved 20 MiB


# --- max_split_size -------------------------------------------------------------------------

def test_oversize_blocks_are_not_split() -> None:
    # A 64 MiB block is freed, then 50 MiB and 12 MiB are requested.
    events = _allocs(64 * MiB) + [("free", 0, 0), ("alloc", 1, 50 * MiB), ("alloc", 2, 12 * MiB)]
    # default (unlimited): 50 splits the 64 MiB block (14 MiB left), 12 splits that (2 MiB > 1 MiB)
    assert simulate(events).timeline[-2:] == ((50 * MiB, 64 * MiB), (62 * MiB, 64 * MiB))
    # max_split_size 40 MiB: 50 >= 40 takes the 64 MiB block (< 50 + 20) unsplit; 12 < 40 may not
    # take an oversize block and there is no other: new 12 MiB segment.
    r = simulate(events, max_split_size=40 * MiB)
    assert r.timeline[-2:] == ((64 * MiB, 64 * MiB), (76 * MiB, 76 * MiB))


def test_oversize_block_too_much_bigger_is_not_reused() -> None:
    # 42 MiB >= max_split_size, but the cached 64 MiB block is >= 42 + 20 MiB: new 42 MiB segment
    events = _allocs(64 * MiB) + [("free", 0, 0), ("alloc", 1, 42 * MiB)]
    assert simulate(events, max_split_size=40 * MiB).timeline[-1] == (42 * MiB, 106 * MiB)


# --- streams (BlockComparatorSize / get_free_block match on the stream) ----------------------

def test_a_block_freed_on_one_stream_is_not_reused_by_another() -> None:
    # GIVEN 12 MiB allocated and freed on stream "rs"  WHEN 12 MiB is then asked for on the default
    # stream  THEN the cached block is rs's: a second 12 MiB segment, reserved 24 MiB
    events = [("alloc", 0, 12 * MiB, "rs"), ("free", 0, 0), ("alloc", 1, 12 * MiB)]
    r = simulate(events)
    assert r.timeline == ((12 * MiB, 12 * MiB), (0, 12 * MiB), (12 * MiB, 24 * MiB))
    assert (r.max_reserved, r.segments) == (24 * MiB, 2)
    # the same request on "rs" takes the cached block back: one segment
    same = simulate(events[:2] + [("alloc", 1, 12 * MiB, "rs")])
    assert (same.max_reserved, same.segments) == (12 * MiB, 1)
    # one stream throughout is the plain model: naming the default stream changes nothing
    assert simulate([("alloc", 0, 12 * MiB, "default"), ("free", 0, 0), ("alloc", 1, 12 * MiB)]) == \
        simulate([("alloc", 0, 12 * MiB), ("free", 0, 0), ("alloc", 1, 12 * MiB)])


def test_streams_sum_and_free_back_to_their_own_pool() -> None:
    # small requests: each stream cuts its own 2 MiB small segment; allocated and reserved sum
    r = simulate([("alloc", 0, 1000, "a"), ("alloc", 1, 1000, "b"), ("free", 0, 0), ("alloc", 2, 1000, "a")])
    assert r.timeline == ((1024, 2 * MiB), (2048, 4 * MiB), (1024, 4 * MiB), (2048, 4 * MiB))
    assert (r.max_allocated, r.max_reserved, r.segments) == (2048, 4 * MiB, 2)
    # expandable segments: one per pool and stream (find_expandable_block matches the stream)
    e = simulate([("alloc", 0, 3 * MiB, "a"), ("alloc", 1, 3 * MiB, "b")], expandable_segments=True)
    assert (e.max_reserved, e.segments) == (40 * MiB, 2)


def test_events_from_step_names_streams() -> None:
    on_rs = Storage(1, 12 * MiB, "gradient", 0, None, "m", "g", "float32", (3 * MiB,), stream="reduce_scatter")
    g = _graph([_s(0, 12 * MiB, 0, 0), on_rs, _s(2, 12 * MiB, 1, None)], 2)
    assert events_from_step(g) == [("alloc", 0, 12 * MiB), ("alloc", 1, 12 * MiB, "reduce_scatter"),
                                   ("free", 0, 0), ("alloc", 2, 12 * MiB)]
    # s2 reuses s0's default-stream block; the gradient keeps a segment of its own stream
    assert (allocator(g).max_reserved, allocator(g).segments) == (24 * MiB, 2)
    # a later step: the gradient is freed (zero_grad) and made again on its own stream
    later = later_steps_events(g)
    assert later[-2:] == [("free", (1, 0), 0), ("alloc", (1, 2), 12 * MiB)]
    assert ("alloc", (1, 1), 12 * MiB, "reduce_scatter") in later
    assert simulate(later).max_reserved == 24 * MiB  # each stream's freed block serves it again


# --- events -------------------------------------------------------------------------------

def test_zero_bytes_and_bad_events() -> None:
    assert simulate([("alloc", 0, 0), ("free", 0, 0)]).timeline == ((0, 0), (0, 0))
    with pytest.raises(PassError, match="allocator: free of id 7"):
        simulate([("free", 7, 0)])
    with pytest.raises(PassError, match="allocated twice"):
        simulate([("alloc", 1, 8), ("alloc", 1, 8)])


def _graph(storages: list[Storage], n_ops: int) -> StepGraph:
    ops = []
    for i in range(n_ops):
        node = OpNode("call_function", torch.ops.aten.relu.default, (), {}, f"relu_{i}")
        made = [s for s in storages if s.created == i]
        node.meta.update(index=i, phase="forward", module="m", bytes=sum(s.nbytes for s in made),
                         outputs=tuple((s.shape, torch.float32, s.sid) for s in made))
        ops.append(node)
    return StepGraph([], ops, {s.sid: s for s in storages}, [], {"forward": 0, "end": n_ops}, "cuda")


def _s(sid: int, nbytes: int, created: int, freed: int | None) -> Storage:
    kind = "parameter" if created < 0 else "activation"
    return Storage(sid, nbytes, kind, created, freed, "m", f"s{sid}", "float32", (nbytes // 4,))


# P (param, 1000 B), X (input, 40 B, freed after op 1) exist before; op 0 makes A (3000 B, freed
# after op 2) and B (0 B); op 1 makes C (500 B, freed after op 1); op 2 makes D (2 MiB, kept) and
# E (700 B, freed after op 2).
STORAGES = [_s(0, 1000, -1, None), _s(1, 40, -1, 1), _s(2, 3000, 0, 2), _s(3, 0, 0, 0), _s(4, 500, 1, 1),
            _s(5, 2 * MiB, 2, None), _s(6, 700, 2, 2)]


def test_events_from_step_by_hand() -> None:
    g = _graph(STORAGES, 3)
    g.check()
    assert events_from_step(g) == [
        ("alloc", 0, 1000), ("alloc", 1, 40),  # before the step, sid order
        ("alloc", 2, 3000),  # op 0 (B has no bytes: no event)
        ("alloc", 4, 500), ("free", 1, 0), ("free", 4, 0),  # op 1, then what dies after it
        ("alloc", 5, 2 * MiB), ("alloc", 6, 700), ("free", 2, 0), ("free", 6, 0)]  # op 2


def test_allocator_pass_by_hand() -> None:
    r = allocator(_graph(STORAGES, 3))
    # small segment: P 1024, X 512, A 3072, C 512 -> 5120; frees X, C -> 4096. D = 2 MiB is large:
    # 20 MiB segment, split. E (1024) skips the 512 B hole left by X, splits the rest.
    assert [a for a, _ in r.timeline] == [1024, 1536, 4608, 5120, 4608, 4096, 4096 + 2 * MiB,
                                          5120 + 2 * MiB, 2048 + 2 * MiB, 1024 + 2 * MiB]
    assert [res for _, res in r.timeline] == [2 * MiB] * 6 + [22 * MiB] * 4
    assert (r.max_allocated, r.reserved_at_peak) == (5120 + 2 * MiB, 22 * MiB)
    assert r.fragmentation == 20 * MiB - 5120 and r.segments == 2
    # liveness peak (op 2) is P + A + D + E = 1000 + 3000 + 2 MiB + 700; rounding adds 24 + 72 + 324
    assert r.max_allocated - liveness(_graph(STORAGES, 3)).peak_bytes == 420


def test_frees_after_an_op_come_before_the_next_ops_allocations() -> None:
    # A (12 MiB) lives only during op 0; B (12 MiB) is made at op 1 and reuses A's segment.
    r = allocator(_graph([_s(0, 12 * MiB, 0, 0), _s(1, 12 * MiB, 1, None)], 2))
    assert (r.max_reserved, r.segments) == (12 * MiB, 1)


# --- a real capture -------------------------------------------------------------------------

@pytest.mark.parametrize("expandable", [False, True])
def test_end_to_end_on_a_captured_step(expandable: bool) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    g = graphmem.analyze(net, (torch.randn(64, 512),)).step
    assert g is not None
    lv = liveness(g)
    r = allocator(g, expandable_segments=expandable)
    events = events_from_step(g)
    assert len(r.timeline) == len(events)
    # every storage here is at most 1 MiB (the 512x512 fp32 weight is exactly 1 MiB): small pool,
    # where blocks are split down to the rounded size, so rounding is the only overhead
    assert max(s.nbytes for s in g.storages.values()) <= MiB
    assert lv.peak_bytes <= r.max_allocated <= lv.peak_bytes + 512 * len(g.storages)
    assert r.max_reserved % (2 * MiB) == 0 and r.max_reserved >= r.max_allocated
    assert r.timeline[-1][0] == sum(round_size(s.nbytes) for s in g.storages.values()
                                    if s.freed is None and s.nbytes)


def test_docstring_examples() -> None:
    assert doctest.testmod(allocator_module).failed == 0
