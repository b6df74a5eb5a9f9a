"""Per-rank memory budget of the traced step: parameters, gradients, optimizer states, master
copies, activations, temporaries and the peak, for data parallelism with ZeRO (Rajbhandari
et al. 2020) or FSDP and tensor/sequence parallelism (Korthikanti et al. 2022).

Every storage of the step keeps its traced size and lifetime; a rank holds a fraction of it:
- ZeRO-1 (P_os): optimizer states, fp32 masters, and everything the optimizer step makes (it
  updates only this rank's partition) are divided by the data-parallel size d;
- ZeRO-2 (P_os+g) also the gradients, each whole during the op that produces it (before its
  reduce-scatter); FSDP ``grad-op`` (SHARD_GRAD_OP) likewise, and its parameters are sharded
  between steps but gathered from a unit's forward to the end of its backward;
- ZeRO-3 (P_os+g+p) and FSDP ``full`` also the parameters, each unit's gathered while its ops
  run (the root unit, not in a block, for all of forward and backward; in backward the next
  unit is prefetched, FSDP's default BACKWARD_PRE);
- tensor parallelism t: the tensors passes/tensor_parallel.py marks as split (and with ``sp``
  the sequence-split ones) are divided by t, so are the split weights' gradients and states.
Partitions are padded to equal sizes (as DeepSpeed and FSDP do), so every rank holds the same:
one table describes each rank. Buffers, scalar step counters and integer inputs are replicated.

The first step creates the optimizer states lazily, in the optimizer phase; from the second step on they exist from the
start (the previous step's outputs released), so the pass also gives the later steps' peak: each op's live bytes plus the
states not yet created at that op (a later step's ops are the first's minus the state creation: torch.optim's
``_init_group`` only adds states). The one-device later-steps peak is passes/later_steps.py."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Optional

from graphmem.errors import UsageError
from graphmem.passes.later_steps import later_steps_peak, later_steps_peak_at, made_states
from graphmem.passes.liveness import Liveness
from graphmem.passes.saved import SavedSet
from graphmem.passes.tensor_parallel import TPMarks, tp_marks
from graphmem.stepgraph import StepGraph, Storage

__all__ = ["COMMUNICATION", "HOST", "KIND_ROW", "ROWS", "Budget", "BudgetRow", "Parallel", "budget", "later_steps_peak",
           "later_steps_peak_at", "made_states", "make_parallel", "rank_share"]

ROWS = ("parameters", "buffers", "gradients", "optimizer states", "master copies", "activations", "temporaries")
COMMUNICATION = "communication buffers"  # a row of its own where the step has any (at the peak, as temporaries)
COMM_NOTE = "the wrappers' collective buffers live at the peak (DDP's gradient buckets, held for the job; FSDP2's all-gather and reduce-scatter buffers)"
KIND_ROW = {"parameter": "parameters", "buffer": "buffers", "gradient": "gradients", "optimizer state": "optimizer states",
            "master": "master copies", "communication": COMMUNICATION}


@dataclass(frozen=True)
class Parallel:
    world_size: int = 1
    zero: int = 0  # DeepSpeed ZeRO stage 0-3
    fsdp: Optional[str] = None  # "full" | "grad-op"
    tp: int = 1
    sp: bool = False

    @property
    def dp(self) -> int:
        """Data-parallel size: the ranks that hold the same model shard (world / tp)."""
        return self.world_size // self.tp

    def describe(self) -> str:
        parts = [f"{self.world_size} rank{'s' if self.world_size > 1 else ''}"]
        if self.zero:
            parts.append(f"ZeRO-{self.zero} over {self.dp}")
        if self.fsdp:
            parts.append(f"FSDP {self.fsdp} over {self.dp}")
        if self.tp > 1:
            parts.append(f"tensor parallel {self.tp}" + (" + sequence parallel" if self.sp else ""))
        return ", ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {"world_size": self.world_size, "zero": self.zero, "fsdp": self.fsdp, "tp": self.tp, "sp": self.sp,
                "dp": self.dp}


def make_parallel(world_size: int = 1, zero: int = 0, fsdp: Optional[str] = None, tp: int = 1, sp: bool = False) -> Parallel:
    """Check the options and name the fix when they do not fit together."""
    for name, v in (("world size", world_size), ("tensor-parallel size", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{name} must be a positive integer, got {v!r}")
    if zero not in (0, 1, 2, 3):
        raise UsageError(f"unknown ZeRO stage {zero!r}: use 1, 2 or 3")
    if fsdp not in (None, "full", "grad-op"):
        raise UsageError(f"unknown FSDP strategy {fsdp!r}: use full or grad-op")
    if zero and fsdp:
        raise UsageError("`zero` and `fsdp` are two ways to shard the same states: give one")
    if world_size % tp:
        raise UsageError(f"`world_size={world_size}` is not a multiple of `tp={tp}`: world = data parallel x tensor parallel")
    if sp and tp == 1:
        raise UsageError("`sp` splits the sequence over the tensor-parallel ranks: add `tp=2` (or more)")
    return Parallel(world_size, zero, fsdp, tp, sp)


@dataclass(frozen=True)
class BudgetRow:
    name: str
    size: int  # bytes one rank holds of this kind (temporaries: at the peak)
    at_peak: int  # bytes of this kind live at the rank's peak
    note: str = ""
    within: str = ""  # a row of ``Budget.details``: the row it details, or HOST; "" in ``Budget.rows`` (which partition the peak)


HOST = "host memory"  # the ``within`` of a detail row in host memory (DeepSpeed's CPU offload: graphmem/deepspeed/report.py)


@dataclass(frozen=True)
class Budget:
    parallel: Parallel
    rows: tuple[BudgetRow, ...]  # ROWS order, then "gathered parameters" when parameters are sharded
    peak_bytes: int  # the traced (first) step's peak on one rank
    peak_index: int
    peak_phase: str
    later_peak_bytes: int  # steps after the first: optimizer states live from the start
    later_peak_index: int
    later_peak_phase: str
    model_state_bytes: int  # parameters + gradients + optimizer states + master copies, per rank (no buffers)
    step_counter_bytes: int  # scalar optimizer states (Adam's step), replicated; inside the states row
    states_by_name: dict[str, int]  # optimizer state name (exp_avg, ...) -> bytes per rank
    parameters: int  # parameter elements (the whole model)
    trainable: int  # elements of parameters that get a gradient
    peak_op: str  # the op during which the peak happens ("" before the step)
    peak_module: str
    top_temporaries: tuple[tuple[str, int], ...]  # largest temporaries at the peak, by the op (or kind) that made them
    largest_unit: str = ""  # ZeRO-3/FSDP: the unit with the most parameters
    gather_bytes: int = 0  # its gathered parameters on one rank
    tp_split: tuple[int, int] = (0, 0)  # (column-parallel, row-parallel) linear ops in the (last micro-step's) forward
    timeline: tuple[int, ...] = field(default=(), repr=False)  # one rank's live bytes per op
    later_at_peak: tuple[tuple[str, int], ...] = ()  # bytes per row live at the later steps' peak (states made later too)
    details: tuple[BudgetRow, ...] = ()  # rows detailing those above, not adding to them (deepspeed/report.py residual_rows)

    def row(self, name: str) -> BudgetRow:
        return next(r for r in self.rows if r.name == name)


def _numel(s: Storage) -> int:
    return math.prod(s.shape)


def _ceil(num: int, den: int) -> int:
    return -(-num // den)


def _unit_of(path: str, units: tuple[str, ...]) -> int:
    """Index of the unit (a block) holding module/parameter ``path``; -1: the root unit."""
    for i, u in enumerate(units):
        if path == u or path.startswith(u + "."):
            return i
    return -1


@dataclass(frozen=True)
class _Shares:
    """How one rank holds each storage: numerators over ``den`` = tp * dp, before and after
    data-parallel sharding, and the budget row it belongs to."""

    g: StepGraph
    parallel: Parallel
    marks: Optional[TPMarks]
    saved_sids: frozenset[int]
    opt_start: int

    @property
    def den(self) -> int:  # every rank's byte count is an integer over den, rounded up at the end
        return self.parallel.tp * self.parallel.dp

    @property
    def shard_states(self) -> bool:
        return self.parallel.zero >= 1 or self.parallel.fsdp is not None

    @property
    def shard_grads(self) -> bool:
        return self.parallel.zero >= 2 or self.parallel.fsdp is not None

    @property
    def shard_params(self) -> bool:
        return self.parallel.zero == 3 or self.parallel.fsdp is not None

    def row_of(self, s: Storage) -> str:
        if s.kind in KIND_ROW:
            return KIND_ROW[s.kind]
        return "activations" if s.sid in self.saved_sids else "temporaries"

    def tp_part(self, s: Storage) -> int:  # numerator after tensor parallelism (over den)
        den, marks = self.den, self.marks
        if marks is None or (s.kind == "optimizer state" and _numel(s) <= 1):  # step counters: whole
            return den
        param = s.sid if s.kind == "parameter" else s.owner
        if param is not None:
            split = param in marks.weights
        else:
            split = s.sid in marks.sharded or (self.parallel.sp and s.sid in marks.stream and s.created < self.opt_start
                                               and not (s.kind == "input" and not _floating(s.dtype)))
        return den // self.parallel.tp if split else den

    def part(self, s: Storage) -> tuple[int, int]:  # (numerator before and after data-parallel sharding)
        before = self.tp_part(s)
        scalar = s.kind == "optimizer state" and _numel(s) <= 1
        sharded = (not scalar and (
            (self.shard_states and (s.kind in ("optimizer state", "master", "gradient copy")
                                    or (s.created >= self.opt_start and s.kind not in ("gradient", "parameter", "buffer"))))
            or (self.shard_grads and s.kind == "gradient") or (self.shard_params and s.kind == "parameter")))
        return before, before // self.parallel.dp if sharded else before


def rank_share(g: StepGraph, parallel: Parallel) -> Callable[[int], Fraction]:
    """The part of storage ``sid`` one rank holds under tensor (and sequence) parallelism."""
    sh = _Shares(g, parallel, tp_marks(g) if parallel.tp > 1 else None, frozenset(),
                 g.phase_start.get("optimizer", g.num_ops))
    return lambda sid: Fraction(sh.tp_part(g.storages[sid]), sh.den)


def budget(g: StepGraph, lv: Liveness, sv: SavedSet, parallel: Parallel = Parallel(),
           units: tuple[str, ...] = ()) -> Budget:
    """One rank's budget. ``units`` are the module paths ZeRO-3/FSDP gathers one at a time
    (api.py passes the blocks of the model's repeated chain); the rest is the root unit."""
    opt_start = g.phase_start.get("optimizer", g.num_ops)
    marks = tp_marks(g) if parallel.tp > 1 else None
    sh = _Shares(g, parallel, marks, frozenset(x.sid for x in sv.tensors), opt_start)
    den = sh.den
    parts = {sid: sh.part(g.storages[sid]) for sid in lv.intervals}
    gather, largest, gather_max = _gathered(g, units, parts, sh.shard_params, parallel.fsdp == "grad-op", opt_start)
    timeline, later_line = _timelines(g, lv, parts, gather)
    n = g.num_ops
    peak_index = max(range(n), key=timeline.__getitem__, default=-1)
    later_index = max(range(n), key=later_line.__getitem__, default=-1)
    base = sum(g.storages[sid].nbytes * parts[sid][1] for sid in lv.intervals if g.storages[sid].created < 0)
    peak = timeline[peak_index] if n else base
    held, at_peak, contributors = _rows(g, lv, sh, parts, peak_index)
    later_at = _later_rows(g, lv, sh, parts, later_index, gather) if n else {}
    states = [s for s in g.storages.values() if s.kind == "optimizer state"]
    by_name: dict[str, int] = {}
    for s in states:
        key = s.name.split(" (")[0].rsplit(":", 1)[-1]
        by_name[key] = by_name.get(key, 0) + _ceil(s.nbytes * parts.get(s.sid, sh.part(s))[1], den)
    params = [s for s in g.storages.values() if s.kind == "parameter"]
    with_grad = {o for s in g.storages.values() if s.kind == "gradient" for o in (s.owners or (s.owner,))}
    notes = _row_notes(parallel, sh.shard_states, sh.shard_grads, sh.shard_params, parallel.tp)
    out_rows = [BudgetRow(r, held[r], _ceil(at_peak[r], den), notes.get(r, "")) for r in ROWS]
    if comm := any(s.kind == "communication" for s in g.storages.values()):
        out_rows.append(BudgetRow(COMMUNICATION, held[COMMUNICATION], _ceil(at_peak[COMMUNICATION], den), COMM_NOTE))
    if sh.shard_params:
        out_rows.append(BudgetRow("gathered parameters", _ceil(gather_max, den), _ceil(gather[peak_index] if n else 0, den),
                                  f"all-gather buffers; largest unit {largest or '(root)'}"))
    top = tuple((name, _ceil(v, den)) for name, v in sorted(contributors.items(), key=lambda kv: -kv[1])[:5])
    node = g.ops[peak_index] if peak_index >= 0 else None
    return Budget(
        parallel=parallel, rows=tuple(out_rows), peak_bytes=_ceil(peak, den), peak_index=peak_index,
        peak_phase=g.phase_of(peak_index),
        later_peak_bytes=_ceil(later_line[later_index], den) if n else _ceil(peak, den),
        later_peak_index=later_index, later_peak_phase=g.phase_of(later_index),
        model_state_bytes=sum(held[r] for r in ("parameters", "gradients", "optimizer states", "master copies")),
        step_counter_bytes=sum(_ceil(s.nbytes * den, den) for s in states if _numel(s) <= 1), states_by_name=by_name,
        parameters=sum(_numel(s) for s in params), trainable=sum(_numel(s) for s in params if s.sid in with_grad),
        peak_op=str(node.target) if node is not None else "",
        peak_module=node.meta.get("module", "") if node is not None else "", top_temporaries=top,
        largest_unit=largest, gather_bytes=_ceil(gather_max, den), tp_split=_forward_linears(g, marks),
        timeline=tuple(_ceil(v, den) for v in timeline),
        later_at_peak=tuple((r, _ceil(v, den)) for r, v in later_at.items() if comm or r != COMMUNICATION))


def _later_rows(g: StepGraph, lv: Liveness, sh: _Shares, parts: dict[int, tuple[int, int]], index: int,
                gather: list[int]) -> dict[str, int]:
    """Per row, what one rank holds at op ``index`` of a later step (numerators over den): the
    traced step's live tensors there, the optimizer states the traced step makes after it (a later
    step holds them from its start), and the gathered parameters."""
    _, at, _ = _rows(g, lv, sh, parts, index)
    for s in g.storages.values():
        if s.kind == "optimizer state" and index < s.created:
            at[sh.row_of(s)] += s.nbytes * parts.get(s.sid, sh.part(s))[1]
    if sh.shard_params:
        at["gathered parameters"] = gather[index]
    return at


def _timelines(g: StepGraph, lv: Liveness, parts: dict[int, tuple[int, int]],
               gather: list[int]) -> tuple[list[int], list[int]]:
    """One rank's live bytes per op (numerators over den) in the traced step and in later steps,
    where the optimizer states live from the start and the first step's own ops
    (``StepGraph.first_step_only``) do not run, what they made to keep living from the start."""
    n = g.num_ops
    diff = [0] * (n + 1)
    later = [0] * (n + 1)
    first_only = g.first_step_only
    for sid, (start, stop) in lv.intervals.items():
        s = g.storages[sid]
        before, after = parts[sid]
        diff[start] += s.nbytes * after
        diff[stop + 1] -= s.nbytes * after
        if s.kind == "gradient" and after < before:  # whole until its reduce-scatter
            diff[start] += s.nbytes * (before - after)
            diff[start + 1] -= s.nbytes * (before - after)
        if s.kind == "optimizer state" and s.created >= 0:  # later steps: live from the start
            later[0] += s.nbytes * after
            later[s.created] -= s.nbytes * after
        elif first_only is not None and first_only[0] <= s.created < first_only[1]:
            if s.freed is None:  # made once and kept (a pipeline stage's receive buffers): live from the start
                later[0] += s.nbytes * after
                later[start] -= s.nbytes * after
            else:  # a later step does not run the ops that made it
                later[start] -= s.nbytes * after
                later[stop + 1] += s.nbytes * after
    timeline: list[int] = []
    later_line: list[int] = []
    live = extra = 0
    for i in range(n):
        live += diff[i]
        extra += later[i]
        timeline.append(live + gather[i])
        later_line.append(live + gather[i] + extra)
    return timeline, later_line


def _rows(g: StepGraph, lv: Liveness, sh: _Shares, parts: dict[int, tuple[int, int]],
          peak_index: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Bytes one rank holds per row, bytes per row live at the peak (over den), and the
    temporaries live at the peak by the op (or kind) that made them."""
    rows, at_peak = ({r: 0 for r in (*ROWS, COMMUNICATION)} for _ in range(2))
    for s in g.storages.values():
        after = (parts.get(s.sid) or sh.part(s))[1]
        r = sh.row_of(s)
        if r not in ("temporaries", COMMUNICATION) and (s.sid in lv.intervals or s.created < 0):
            rows[r] += s.nbytes * after
    contributors: dict[str, int] = {}
    for sid, (a, b) in lv.intervals.items():
        if a <= peak_index <= b:
            s = g.storages[sid]
            before, after = parts[sid]
            nb = s.nbytes * (before if s.kind == "gradient" and s.created == peak_index else after)
            at_peak[sh.row_of(s)] += nb
            if sh.row_of(s) == "temporaries":
                label = s.kind if s.kind == "gradient copy" else s.name
                contributors[label] = contributors.get(label, 0) + nb
    held = {r: _ceil(v, sh.den) for r, v in rows.items()}
    held.update({r: _ceil(at_peak[r], sh.den) for r in ("temporaries", COMMUNICATION)})  # rows at the peak
    return held, at_peak, contributors


def _forward_linears(g: StepGraph, marks: Optional[TPMarks]) -> tuple[int, int]:
    if marks is None:
        return (0, 0)
    start, end = g.phase_start.get("forward", 0), g.phase_start.get("loss", g.num_ops)
    return (sum(start <= i < end for i in marks.column), sum(start <= i < end for i in marks.row))


def _floating(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat", "complex"))


def _gathered(g: StepGraph, units: tuple[str, ...], parts: dict[int, tuple[int, int]], shard_params: bool,
              grad_op: bool, opt_start: int) -> tuple[list[int], str, int]:
    """Per op, the gathered parameters beyond this rank's shard (numerators over den); the
    largest unit and its gathered bytes."""
    n = g.num_ops
    if not shard_params:
        return [0] * n, "", 0
    extra: dict[int, int] = {}
    for s in g.storages.values():
        if s.kind == "parameter" and s.sid in parts:
            u = _unit_of(s.name, units)
            extra[u] = extra.get(u, 0) + s.nbytes * (parts[s.sid][0] - parts[s.sid][1])
    unit_of_op = [_unit_of(op.meta.get("module", ""), units) for op in g.ops]
    phase = [g.phase_of(i) for i in range(n)]
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for i in range(opt_start if opt_start < n else n):
        u = unit_of_op[i]
        first.setdefault(u, i)
        last[u] = i
    out = [0] * n
    root = extra.get(-1, 0)  # the root unit stays gathered through forward and backward
    for i in range(min(opt_start, n)):
        held = {-1}
        u = unit_of_op[i]
        if grad_op:
            held |= {k for k in first if first[k] <= i <= last[k]}
        else:
            held.add(u)
            if phase[i] == "backward" and u > 0:
                held.add(u - 1)  # prefetched: the next unit to run backward
        out[i] = sum(extra.get(k, 0) for k in held)
    largest = max((k for k in extra if k >= 0), key=lambda k: extra[k], default=-1)
    if largest < 0:
        return out, "", root
    return out, units[largest], extra[largest] + root


def _row_notes(p: Parallel, states: bool, grads: bool, params: bool, t: int) -> dict[str, str]:
    d = p.dp
    notes = {"activations": "saved for backward" + (f"; split tensors / {t}" if t > 1 else "")
             + (" (sequence parallel: all but the token ids)" if p.sp else "")}
    if params:
        notes["parameters"] = f"/ {d} (sharded; gathered per unit)"
    if grads:
        notes["gradients"] = f"/ {d} (reduce-scattered)"
    if states:
        notes["optimizer states"] = f"/ {d} (partitioned)"
        notes["master copies"] = f"/ {d} (partitioned)"
    if t > 1:
        for r in ("parameters", "gradients", "optimizer states", "master copies"):
            notes[r] = (notes.get(r, "") + f"; tensor-parallel weights / {t}").lstrip("; ")
    return notes
