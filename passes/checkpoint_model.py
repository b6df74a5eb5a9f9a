"""The checkpoint model of a chain of blocks: what each block's ops do to live memory in each
role a plan gives it (``Piece``, ``Stage``, ``ChainCosts``), and the exact peak of a plan
(``evaluate``). The program that finds the cheapest plan under a budget is
passes/checkpoint_program.py; baselines, the frontier and the brute-force check are
passes/checkpoint.py (which re-exports this module's names).

The model. A step over a chain of n blocks is a sequence of *pieces*, each a run of ops whose
effect on live memory is two numbers: ``high`` (the most bytes live above the level at its
start) and ``net`` (the level change across it). Which pieces occur depends only on how each
block is run (measured by graphmem/planning/costs.py from captures of the real step):

  forward     a stored block, the first block of a checkpointed segment, a later one
  backward    segments from the last to the first: a stored block's backward; a segment's
              backward ops up to the first saved tensor it needs, the segment's forward run
              again (keeping what backward needs; the last block's recompute stops early),
              then the blocks' backward (see ``Stage`` for every role)

plus fixed pieces before the chain (``before``), between its forward and its backward (the
head, loss and the head's backward: ``head`` up to the end of the forward context, then
``head_post``) and after (``after``). Stitching the pieces of a plan in order gives its peak
exactly (``evaluate``). This is Chen et al. 2016's segment view ("Training Deep Nets with
Sublinear Memory Cost") with the costs measured per piece instead of assumed, and a
stored/checkpointed choice per segment as in Rotor (Beaumont et al. 2019, "Optimal
checkpointing for heterogeneous chains").

Frees that land elsewhere than the piece that made them are the plan's own ``Piece(0, -bytes)``
(the pieces keep those bytes live):
- autocast's cast cache holds parameters' low-precision copies until its context exits: a
  checkpointed block's copies (nothing saves them) and a stored block's unsaved ones (biases)
  die at the forward's exit, in the head (``Stage.c_fwd``, ``c_first``, ``c_member``); in a
  segment's recompute, which torch.utils.checkpoint runs in one autocast context, the earlier
  blocks' unsaved copies die at the end of the last block's recompute (``c_re_*``);
- tensors made before the chain that only checkpointed segments keep (``ChainCosts.shared``)
  die after the lowest checkpointed segment's backward, or in the head without checkpoints;
- with gradient accumulation, later micro-steps (``ChainCosts.later``) run the same forward
  from a higher level, and the plan's peak is the larger of the two.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from graphmem.errors import PassError

Segment = tuple[int, int, bool]  # (first block, last block, checkpointed); stored => a == b


@dataclass(frozen=True)
class Piece:
    high: int  # most live bytes above the level at its start (>= 0)
    net: int  # level change across it

    def then(self, other: "Piece") -> "Piece":
        return Piece(max(self.high, self.net + other.high), self.net + other.net)


NOTHING = Piece(0, 0)
# a role no capture could show (its plan failed to run): the program never chooses it
UNMEASURED = Piece(1 << 60, 0)


@dataclass(frozen=True)
class Stage:
    """How one block's ops move memory in each role it can play, and its FLOPs.

    Stored: ``fwd``, ``bwd``. Checkpointed forward: ``fwd_first`` (the segment's first block:
    its input and, on the CPU, the stashed RNG state stay), ``fwd_member`` (later blocks).
    A segment of this block alone, in backward: ``one_pre`` (backward ops before the first
    saved tensor is needed), ``one_re`` (the recompute), ``one_post``. A longer segment a..b:
    ``pre`` (b), ``re_first`` (a), ``re_member`` (a+1..b-1), ``re_last`` (b; stops early once
    everything needed is back), ``post`` (b), ``bwd_member`` (b-1..a+1), ``bwd_first`` (a).
    """

    name: str
    fwd: Piece
    bwd: Piece
    fwd_first: Piece
    fwd_member: Piece
    one_pre: Piece
    one_re: Piece
    one_post: Piece
    pre: Piece
    re_first: Piece
    re_member: Piece
    re_last: Piece
    post: Piece
    bwd_member: Piece
    bwd_first: Piece
    flops: int  # forward FLOPs of the block
    one_re_flops: int  # FLOPs each recompute role runs (early stop may skip a last block's tail)
    re_first_flops: int
    re_member_flops: int
    re_last_flops: int
    # bytes of autocast cast-cache copies a role leaves to be freed later (0 without autocast):
    # forward roles at the forward context's exit, recompute roles at the end of the recompute
    c_fwd: int = 0
    c_first: int = 0
    c_member: int = 0
    c_re_first: int = 0
    c_re_member: int = 0

    @property
    def net(self) -> int:
        """The block's forward+backward net effect, stored (its cache copies freed at the
        forward's exit): ``h_i``, the same however the block runs (``ChainCosts.check``)."""
        return self.fwd.net - self.c_fwd + self.bwd.net


@dataclass(frozen=True)
class ChainCosts:
    stages: tuple[Stage, ...]
    base: int  # live bytes before the step (parameters, buffers, batch)
    before: Piece  # ops before the chain's forward
    head: Piece  # after the chain's forward, until the forward context exits (all of it without autocast)
    after: Piece  # after the chain's backward
    chain: str = ""  # module path of the chain
    head_post: Piece = NOTHING  # from the forward context's exit until the chain's backward starts
    # gradient accumulation: the pieces of micro-steps 2..k (their forward is this one's; their
    # backward adds into gradients that exist; ``later.base`` is the level they start at) and k
    later: Optional["ChainCosts"] = None
    micro_steps: int = 1
    # tensors made before the chain and passed to its blocks that no stored block saves (an
    # attention mask, rotary tables): without checkpoints they die in the head (``head_free``,
    # ``head_post_free``); a checkpointed segment keeps them as its inputs, so they die after
    # the lowest checkpointed segment's backward. The other pieces leave them live.
    shared: int = 0
    head_free: Piece = NOTHING
    head_post_free: Piece = NOTHING
    # tensors made before the chain that only its first block is given and does not save (the
    # chain's input, when block 0 casts it first): alive until the first segment's backward if
    # it is checkpointed, else dead in the head (``head_entry_free``, ``head_post_entry_free``:
    # the head when it is stored but another segment is checkpointed)
    entry: int = 0
    head_entry_free: Piece = NOTHING
    head_post_entry_free: Piece = NOTHING
    # whether the pieces compose: every role measured alike in every capture, ``check`` holds
    # and stitching gives each captured plan's peak. Without it the program is an estimate
    # (graphmem/planning/verify.py checks its plans by captures); ``problem`` says what disagreed.
    exact: bool = True
    problem: str = ""

    @property
    def n(self) -> int:
        return len(self.stages)

    def check(self) -> None:
        """The program's premise: a segment's forward+backward net effect is the same however
        it runs (the sum of its blocks' stored-mode effects); later micro-steps run the same
        forward."""
        if self.later is not None:
            self.later.check()
            for i, (s, s2) in enumerate(zip(self.stages, self.later.stages)):
                for role in ("fwd", "fwd_first", "fwd_member", "c_fwd", "c_first", "c_member"):
                    if getattr(s, role) != getattr(s2, role):
                        raise PassError(f"checkpoint: block {i}'s forward ({role}) differs between micro-steps; "
                                        "the chain's pieces do not compose")
        h = [s.net for s in self.stages]
        for a in range(self.n):
            for b in range(a, self.n):
                seg = (_forward((a, b, True), self.stages).net - _cached((a, b, True), self.stages)
                       + backward_piece((a, b, True), self.stages).net)
                if seg != sum(h[a:b + 1]):
                    raise PassError(
                        f"checkpoint: blocks {a}..{b} checkpointed change memory by {seg} B over the "
                        f"step but {sum(h[a:b + 1])} B stored; the chain's pieces do not compose")


def level_after(costs: ChainCosts) -> int:
    """Live bytes when the step (one micro-step) has run, whatever the plan: where the next
    micro-step starts."""
    h = sum(s.net for s in costs.stages)
    return (costs.base + costs.before.net + costs.head.net + costs.head_post.net - costs.shared - costs.entry + h
            + costs.after.net)


# -- plans ---------------------------------------------------------------------------------
def segments_of(n: int, checkpointed: Sequence[tuple[int, int]]) -> tuple[Segment, ...]:
    """The full segmentation: the checkpointed segments plus every other block stored."""
    out: list[Segment] = []
    i = 0
    for a, b in sorted(checkpointed):
        out.extend((j, j, False) for j in range(i, a))
        out.append((a, b, True))
        i = b + 1
    out.extend((j, j, False) for j in range(i, n))
    return tuple(out)


def _forward(seg: Segment, st: Sequence[Stage]) -> Piece:
    a, b, ck = seg
    if not ck:
        return st[a].fwd
    p = st[a].fwd_first
    for i in range(a + 1, b + 1):
        p = p.then(st[i].fwd_member)
    return p


def _cached(seg: Segment, st: Sequence[Stage]) -> int:
    """Bytes a segment's forward leaves in autocast's cache (freed at the forward's exit)."""
    a, b, ck = seg
    if not ck:
        return st[a].c_fwd
    return st[a].c_first + sum(st[i].c_member for i in range(a + 1, b + 1))


def backward_piece(seg: Segment, st: Sequence[Stage]) -> Piece:
    a, b, ck = seg
    if not ck:
        return st[a].bwd
    if a == b:
        return st[a].one_pre.then(st[a].one_re).then(st[a].one_post)
    p = st[b].pre.then(st[a].re_first)
    for i in range(a + 1, b):
        p = p.then(st[i].re_member)
    cleared = st[a].c_re_first + sum(st[i].c_re_member for i in range(a + 1, b))
    p = p.then(st[b].re_last).then(Piece(0, -cleared)).then(st[b].post)
    for i in range(b - 1, a, -1):
        p = p.then(st[i].bwd_member)
    return p.then(st[a].bwd_first)


def _recompute_flops(seg: Segment, st: Sequence[Stage]) -> int:
    a, b, ck = seg
    if not ck:
        return 0
    if a == b:
        return st[a].one_re_flops
    return st[a].re_first_flops + sum(st[i].re_member_flops for i in range(a + 1, b)) + st[b].re_last_flops


@dataclass(frozen=True)
class Evaluated:
    segments: tuple[Segment, ...]
    peak_bytes: int
    kept_bytes: int  # what the chain's forward leaves allocated for its backward
    recompute_flops: int

    @property
    def checkpointed(self) -> tuple[tuple[int, int], ...]:
        return tuple((a, b) for a, b, ck in self.segments if ck)


def evaluate(costs: ChainCosts, segments: Sequence[Segment]) -> Evaluated:
    """The exact peak of a plan: its pieces stitched in the order the step runs them (with
    micro-steps, the larger of the first's and the later ones' peaks; recompute in each)."""
    e = _evaluate(costs, segments)
    if costs.later is None:
        return e
    peak = max(e.peak_bytes, _evaluate(costs.later, segments).peak_bytes)
    return Evaluated(e.segments, peak, e.kept_bytes, e.recompute_flops * costs.micro_steps)


def head_pieces(costs: ChainCosts, any_checkpointed: bool, first_checkpointed: bool) -> tuple[Piece, Piece]:
    """The head's two pieces for a plan: which tensors made before the chain die in it."""
    if not any_checkpointed and (costs.shared or costs.entry):
        return costs.head_free, costs.head_post_free
    if not first_checkpointed and costs.entry:
        return costs.head_entry_free, costs.head_post_entry_free
    return costs.head, costs.head_post


def _evaluate(costs: ChainCosts, segments: Sequence[Segment]) -> Evaluated:
    st = costs.stages
    if [i for a, b, _ in segments for i in range(a, b + 1)] != list(range(costs.n)):
        raise PassError(f"checkpoint: segments {list(segments)} do not cover blocks 0..{costs.n - 1} in order")
    level = peak = costs.base
    cached = sum(_cached(s, st) for s in segments)
    lowest = next((k for k, (_, _, ck) in enumerate(segments) if ck), None)  # the shared tensors' last holder
    first = bool(segments) and segments[0][2]  # the entry tensors' holder
    head, head_post = head_pieces(costs, lowest is not None, first)
    back: list[Piece] = []
    for k in range(len(segments) - 1, -1, -1):
        back.append(backward_piece(segments[k], st))
        if k == lowest and costs.shared:
            back.append(Piece(0, -costs.shared))
        if k == 0 and first and costs.entry:
            back.append(Piece(0, -costs.entry))
    order = [costs.before, *(_forward(s, st) for s in segments), head, Piece(0, -cached), head_post, *back,
             costs.after]
    kept = -cached  # what survives the forward's exit
    for k, p in enumerate(order):
        peak = max(peak, level + p.high)
        level += p.net
        if 1 <= k <= len(segments):
            kept += p.net
    flops = sum(_recompute_flops(s, st) for s in segments)
    return Evaluated(tuple(segments), peak, kept, flops)
