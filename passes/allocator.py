"""A model of PyTorch's CUDA caching allocator, replayed over one step's allocations and frees.

The liveness pass counts exact tensor bytes; a real GPU also pays for the caching allocator's
rounding, segment sizes and fragmentation. This pass replays the step's allocation sequence
through a model of ``DeviceCachingAllocator`` (pytorch/pytorch ``c10/cuda/CUDACachingAllocator.cpp``,
read at commit 001074d2; the constants are in ``c10/core/AllocatorConfig.h`` of torch 2.14.1;
the generic ``c10/core/CachingDeviceAllocator.h`` applies the same rules). What is modelled:

- ``round_size``: requests below ``kMinBlockSize`` (512 B) become 512 B, others round up to a
  multiple of 512 B (the optional ``roundup_power2_divisions`` setting is not modelled).
- ``get_pool``: rounded sizes up to ``kSmallSize`` (1 MiB) use the small pool, larger ones the
  large pool; blocks never move between pools.
- ``get_allocation_size``: a new small-pool segment is ``kSmallBuffer`` (2 MiB); a large request
  below ``kMinLargeAlloc`` (10 MiB) gets a ``kLargeBuffer`` (20 MiB) segment; a larger one is
  rounded up to a multiple of ``kRoundLarge`` (2 MiB).
- ``get_free_block``: best fit, the smallest free block of the pool that is large enough, ties
  by address (``BlockComparatorSize``); a new segment only when none fits.
- ``should_split``: the small pool splits when at least ``kMinBlockSize`` is left over, the large
  pool only when more than ``kSmallSize`` is left; an unsplit block counts whole in "allocated".
- ``free_block`` / ``try_merge_blocks``: a freed block merges with free neighbours of its segment.
- ``max_split_size`` (``max_split_size_mb``, default unlimited): blocks of at least that size are
  not split; a request below it never takes such a block, and a request at or above it only takes
  a cached block less than ``max_non_split_rounding`` (20 MiB) bigger than itself.
- ``expandable_segments:True``: one segment per pool whose physical memory grows in pages,
  ``kSmallBuffer`` (2 MiB) for the small pool and ``kLargeBuffer`` (20 MiB) for the large pool
  (``find_expandable_block``); a miss maps just enough pages after the free tail of the segment
  (``try_allocate_expandable_block`` / ``map_block``, using the rounded request, not
  ``get_allocation_size``); best fit skips the tail block when another block fits (its
  "expandable size" includes the unmapped space after it); every pool splits at 512 B.

- streams: a block belongs to the stream it was allocated on and only serves that stream's
  requests: ``BlockComparatorSize`` orders a pool's blocks by stream first, ``get_free_block``
  gives up when the best block found is another stream's (``(*it)->stream != p.stream()``), a new
  segment is made for the requesting stream (``alloc_block``: ``new Block(p.device(), p.stream(),
  ...)``) and an expandable segment serves one stream (``find_expandable_block`` matches
  ``segment->stream()``). So each stream has pools and segments of its own; a freed block goes back
  to its own stream's pool; allocated and reserved are the sums over the streams. Steps name the
  stream of each storage (``Storage.stream``: FSDP2's own streams, graphmem/distributed/fsdp.py).

Not modelled: ``recordStream`` (a block used on another stream is freed at once, not when that
stream's work is done), CUDA graph private pools, ``empty_cache``, OOM retries (``release_cached_blocks``), garbage
collection: nothing is returned to the driver, so reserved memory never shrinks. The allocator
starts empty (a real second step starts from the first step's cache), and new segments get
increasing addresses (real ``cudaMalloc`` addresses only decide ties between equal sizes).
"""
from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Optional, Sequence, Union

from graphmem.errors import PassError
from graphmem.stepgraph import StepGraph, Storage

MiB = 1 << 20
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 B
K_SMALL_SIZE = 1 * MiB  # kSmallSize: largest "small" request
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: small-pool segment (and expandable page)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: large requests below this share a kLargeBuffer
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer / large_segment_size(): large segment (and page)
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: bigger requests round up to this
MAX_NON_SPLIT_ROUNDING = 20 * MiB  # max_non_split_rounding_mb default (kLargeBuffer before)
_ADDRESS_SPACE = 1 << 50  # virtual size of an expandable segment: "bigger than any request"

# ("alloc", id, nbytes) | ("alloc", id, nbytes, stream) | ("free", id, 0); an id is any hashable, a
# stream any name ("default" when left out)
Event = Union[tuple[str, object, int], tuple[str, object, int, str]]  # (kind, id, nbytes[, stream])
DEFAULT_STREAM = "default"
_FREE, _USED, _UNMAPPED = 0, 1, 2


@dataclass(frozen=True)
class AllocatorResult:
    """What ``torch.cuda`` memory statistics would show after the replayed events.

    ``fragmentation`` is the reserved-but-unallocated memory at the moment ``max_allocated`` is
    first reached (``reserved_at_peak - allocated_at_peak``): cached free blocks and split-off
    remainders the program holds in segments but does not use. ``segments`` counts segments at
    the end (``cudaMalloc`` calls; with expandable segments, one per pool used).
    """

    max_allocated: int  # like torch.cuda.max_memory_allocated(): block sizes in use, max over time
    max_reserved: int  # like torch.cuda.max_memory_reserved(): segment (mapped) bytes, max
    allocated_at_peak: int  # allocated when max_allocated was first reached
    reserved_at_peak: int  # reserved at that moment
    fragmentation: int  # reserved_at_peak - allocated_at_peak
    segments: int
    timeline: tuple[tuple[int, int], ...]  # (allocated, reserved) after each event


def round_size(nbytes: int) -> int:
    """``round_size``: at least 512 B, else up to a multiple of 512 B."""
    if nbytes < K_MIN_BLOCK_SIZE:
        return K_MIN_BLOCK_SIZE
    return -(-nbytes // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a rounded request of ``size`` bytes gets."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


class _Block:
    """A run of bytes inside one segment; prev/next are the neighbours in that segment."""

    __slots__ = ("addr", "size", "state", "prev", "next")

    def __init__(self, addr: int, size: int, state: int, prev: Optional[_Block] = None,
                 next: Optional[_Block] = None) -> None:
        self.addr, self.size, self.state, self.prev, self.next = addr, size, state, prev, next


class _Pool:
    """Free mapped blocks of one pool, sorted by (size, address) like ``BlockPool.blocks``."""

    def __init__(self, small: bool) -> None:
        self.small = small
        self.keys: list[tuple[int, int]] = []
        self.free: dict[int, _Block] = {}
        self.tail: Optional[_Block] = None  # unmapped rest of this pool's expandable segment

    def add(self, b: _Block) -> None:
        b.state = _FREE
        insort(self.keys, (b.size, b.addr))
        self.free[b.addr] = b

    def remove(self, b: _Block) -> None:
        del self.keys[bisect_left(self.keys, (b.size, b.addr))]
        del self.free[b.addr]


def _expandable_size(b: _Block) -> int:
    return b.size + (b.next.size if b.next is not None and b.next.state == _UNMAPPED else 0)


class _Allocator:
    def __init__(self, expandable: bool, max_split_size: Optional[int]) -> None:
        self.expandable, self.max_split = expandable, max_split_size
        self.pools = (_Pool(small=True), _Pool(small=False))
        self.allocated = self.reserved = self.segments = self.next_addr = 0

    def _oversize(self, size: int) -> bool:
        return self.max_split is not None and size >= self.max_split

    def _get_free_block(self, pool: _Pool, size: int) -> Optional[_Block]:
        i = bisect_left(pool.keys, (size, -1))
        if i == len(pool.keys):
            return None
        if self.expandable:  # prefer a block that fits without counting unmapped space
            while (i + 1 < len(pool.keys) and _expandable_size(pool.free[pool.keys[i + 1][1]])
                   < _expandable_size(pool.free[pool.keys[i][1]])):
                i += 1
        b = pool.free[pool.keys[i][1]]
        if not self._oversize(size) and self._oversize(b.size):
            return None  # do not hand an oversize block to a smaller request
        if self._oversize(size) and b.size >= size + MAX_NON_SPLIT_ROUNDING:
            return None
        pool.remove(b)
        return b

    def _new_segment(self, pool: _Pool, size: int) -> _Block:
        seg = allocation_size(size)
        b = _Block(self.next_addr, seg, _USED)
        self.next_addr += seg
        self.reserved += seg
        self.segments += 1
        return b

    def _map_pages(self, pool: _Pool, size: int) -> _Block:
        """Grow the pool's expandable segment so that a block of ``size`` fits at its end."""
        if pool.tail is None:
            pool.tail = _Block(self.next_addr, _ADDRESS_SPACE, _UNMAPPED)
            self.next_addr += _ADDRESS_SPACE
            self.segments += 1
        tail = pool.tail
        start = tail.prev if tail.prev is not None and tail.prev.state == _FREE else None
        page = K_SMALL_BUFFER if pool.small else K_LARGE_BUFFER
        mapped = max(0, -(-(size - (start.size if start else 0)) // page) * page)
        if start is not None:  # the new pages merge with the free block before them
            pool.remove(start)
            start.size += mapped
            block = start
        else:
            block = _Block(tail.addr, mapped, _USED, tail.prev, tail)
            if tail.prev is not None:
                tail.prev.next = block
            tail.prev = block
        tail.addr += mapped
        tail.size -= mapped
        self.reserved += mapped
        return block

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        pool = self.pools[0] if size <= K_SMALL_SIZE else self.pools[1]
        b = self._get_free_block(pool, size)
        if b is None:
            b = self._map_pages(pool, size) if self.expandable else self._new_segment(pool, size)
        remaining = b.size - size
        if pool.small or self.expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = not self._oversize(size) and remaining > K_SMALL_SIZE
        if split:
            rest = _Block(b.addr + size, remaining, _FREE, b, b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            pool.add(rest)
        b.state = _USED
        self.allocated += b.size
        return b

    def free(self, b: _Block, small: bool) -> None:
        pool = self.pools[0] if small else self.pools[1]
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and other.state == _FREE:  # never merge with unmapped space
                pool.remove(other)
                if other is b.prev:
                    b.addr, b.prev = other.addr, other.prev
                    if b.prev is not None:
                        b.prev.next = b
                else:
                    b.next = other.next
                    if b.next is not None:
                        b.next.prev = b
                b.size += other.size
        pool.add(b)


def simulate(events: Sequence[Event], expandable_segments: bool = False, preexisting: Sequence[int] = (),
             *, max_split_size: Optional[int] = None) -> AllocatorResult:
    """Replay ``events`` through the caching-allocator model, starting from an empty cache.

    ``events``: ``("alloc", id, nbytes)`` / ``("free", id, 0)`` in program order; an allocation may
    name its stream, ``("alloc", id, nbytes, stream)`` (else "default"; a free goes back to the
    stream its block was allocated on); a zero-byte allocation gets no block. ``preexisting``:
    sizes allocated first on the default stream and never freed (e.g. the parameters, in order);
    they count in the peaks but not in ``timeline``, which has one entry per event.
    ``max_split_size``: bytes, like ``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb``.

    >>> r = simulate([("alloc", 0, 1), ("alloc", 1, 513), ("free", 0, 0)])
    >>> r.max_allocated, r.max_reserved, r.timeline[-1]
    (1536, 2097152, (1024, 2097152))
    """
    sims: dict[str, _Allocator] = {}  # by stream
    live: dict[object, tuple[Optional[_Block], bool, str]] = {}
    best = [0, 0, 0]  # max_allocated, reserved then, max_reserved
    total = [0, 0]  # allocated, reserved: summed over the streams

    def alloc(key: object, nbytes: int, stream: str) -> None:
        if key in live:
            raise PassError(f"allocator: id {key} allocated twice without a free in between")
        if nbytes < 0:
            raise PassError(f"allocator: id {key} asks for {nbytes} bytes")
        if not nbytes:
            live[key] = (None, True, stream)
            return
        sim = sims.get(stream) or sims.setdefault(stream, _Allocator(expandable_segments, max_split_size))
        was = (sim.allocated, sim.reserved)
        live[key] = (sim.malloc(nbytes), round_size(nbytes) <= K_SMALL_SIZE, stream)
        total[0] += sim.allocated - was[0]
        total[1] += sim.reserved - was[1]
        if total[0] > best[0]:
            best[0], best[1] = total[0], total[1]
        best[2] = max(best[2], total[1])

    for i, nbytes in enumerate(preexisting):
        alloc(("preexisting", i), nbytes, DEFAULT_STREAM)
    timeline = []
    for kind, key, nbytes, *stream in events:
        if kind == "alloc":
            alloc(key, nbytes, stream[0] if stream else DEFAULT_STREAM)
        elif kind == "free":
            if key not in live:
                raise PassError(f"allocator: free of id {key}, which is not allocated")
            block, small, on = live.pop(key)
            if block is not None:
                total[0] -= block.size
                sims[on].free(block, small)
        else:
            raise PassError(f"allocator: unknown event {kind!r} (expected 'alloc' or 'free')")
        timeline.append((total[0], total[1]))
    return AllocatorResult(best[0], best[2], best[0], best[1], best[1] - best[0],
                           sum(sim.segments for sim in sims.values()), tuple(timeline))


def events_from_step(g: StepGraph) -> list[Event]:
    """The step's allocation/free sequence: storages created at op i are allocated when op i runs
    (in sid order), storages freed after op i are freed before op i+1 allocates; pre-existing
    storages (created == -1) first; storages never freed stay allocated. Zero-byte storages are
    skipped (the CUDA allocator returns no block for size 0). An allocation on a stream other than
    the default one names it (``Storage.stream``)."""
    made: dict[int, list[int]] = {}
    dead: dict[int, list[int]] = {}
    for s in sorted(g.storages.values(), key=lambda s: s.sid):
        if s.nbytes == 0:
            continue
        made.setdefault(s.created, []).append(s.sid)
        if s.freed is not None:
            dead.setdefault(s.freed, []).append(s.sid)
    events: list[Event] = []
    for i in sorted(made.keys() | dead.keys()):  # -1 (before the step) first
        events += [_alloc(g.storages[sid]) for sid in made.get(i, ())]
        events += [("free", sid, 0) for sid in dead.get(i, ())]
    return events


def _alloc(s: Storage) -> Event:
    """A storage's allocation event, naming its stream unless it is the default one."""
    return ("alloc", s.sid, s.nbytes) if s.stream == DEFAULT_STREAM else ("alloc", s.sid, s.nbytes, s.stream)


def later_steps_events(g: StepGraph, steps: int = 2) -> list[Event]:
    """``steps`` steps in a row through one cache: the traced (first) step, then each later step
    as its ops run again without making the optimizer states (torch.optim's ``_init_group`` only
    adds them; they stay allocated), after the previous step's leftovers (its gradients and loss:
    ``zero_grad(set_to_none=True)`` at the step's start) are freed. What a training loop's
    ``torch.cuda.max_memory_reserved()`` reads after its first steps: the cache is kept from step
    to step, and the states live through every later forward and backward. The first step's own
    ops (``StepGraph.first_step_only``) are not run again; what they made and kept stays."""
    first = events_from_step(g)
    only = g.first_step_only or (0, 0)  # ops a later step does not run (a pipeline's metadata inference)
    setup = {s.sid for s in g.storages.values() if only[0] <= s.created < only[1]}
    kept = {s.sid for s in g.storages.values() if s.created < 0 or (s.kind == "optimizer state" and s.created >= 0)
            or (s.sid in setup and s.freed is None)}
    left = [s.sid for s in sorted(g.storages.values(), key=lambda s: s.sid)
            if s.freed is None and s.nbytes and s.sid not in kept]
    out = list(first)
    for k in range(1, steps):
        out += [("free", sid if k == 1 else (k - 1, sid), 0) for sid in left]
        out += [(kind, (k, key), *rest) for kind, key, *rest in first if key not in kept and key not in setup]
    return out


def allocator(g: StepGraph, expandable_segments: bool = False, *,
              max_split_size: Optional[int] = None) -> AllocatorResult:
    """The pass: the step replayed through the CUDA caching-allocator model (whatever device the
    step was captured on), parameters and other pre-existing storages allocated first.

    >>> import torch, graphmem
    >>> from graphmem.passes.allocator import allocator
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> r = allocator(graphmem.analyze(net, (torch.randn(8, 16),)).step)
    >>> r.max_reserved                   # everything fits in one 2 MiB small-pool segment
    2097152
    """
    return simulate(events_from_step(g), expandable_segments, max_split_size=max_split_size)
