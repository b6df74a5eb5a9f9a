"""Ground truth for the ZeRO-1 formula (passes/budget.py, ``zero=1``): a REAL multi-process CPU job
over gloo (torch.multiprocessing.spawn) running plain PyTorch's ZeRO-1, written as a user writes it::

    model = DistributedDataParallel(model, gradient_as_bucket_view=view)
    optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, foreach=False)
    for step in range(2):
        out = model(*batch); loss = loss_fn(out, batch); loss.backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

Nothing of graphmem's wrappers runs here (tests/layout/test_layout.py). Each rank measures, from the CPU
allocator's events under one torch.profiler window that spans the wrapping and both steps (as
tests/dist_truth.py measures, the garbage collector paused): the bytes held once DDP and the
optimizer are built (DDP's gradient buckets), the bytes held between the steps, each step's peak,
and the bytes of its local optimizer's states. Phases are told apart by marker allocations of
sizes nothing else allocates."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from tests.dist_truth import _grads, _held, _join, _keys, _profiled, _spawn, _user_loss, case
from tests.settle import addresses, events

# runs per case, each on a fresh model, every collective settled (tests/settle.py: ZeroRedundancyOptimizer's
# broadcasts, DDP's _broadcast_coalesced and parameter check: these had read +657,752 B and +24 B held in one
# run of two). A real reason for the least of the runs remains: DDP's Reducer runs small collectives of its
# own in C++ during the steps, out of Python's reach, and a 4 B block there was left unfreed (after the
# second step) in one run of two; the held and peak figures are the least of REPEAT runs (5 before the settle)
REPEAT = 3
MARK = 1_000_003  # marker allocation sizes: MARK + phase, in bytes (uint8)


def _mark(phase: int) -> None:
    torch.empty(MARK + phase, dtype=torch.uint8)  # allocated and freed at once: two events of that size


def _phases(prof: Any, marks: int, held: set[int]) -> tuple[list[int], list[int]]:
    """From the allocator's events in time order (tests/settle.py ``events``, ``held``: the storage
    addresses alive after the window): the running sum at each marker (the marker itself not
    counted) and the highest running sum between consecutive markers."""
    at: list[int] = []
    highs = [0]
    running = 0
    for _, size in events(prof, held):
        if size == MARK + len(at) and len(at) < marks:
            at.append(running)
            highs.append(running)
            continue
        if size == -(MARK + len(at) - 1) and at:
            continue
        running += size
        highs[-1] = max(highs[-1], running)
    assert len(at) == marks, at
    return at, highs[1:marks]


def _states(optimizer: ZeroRedundancyOptimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.optim.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def _run(name: str, view: bool, kept: list) -> dict[str, Any]:
    """One real ZeRO-1 job on this rank: the figures above, in bytes (the held ones include the
    parameters, buffers and batch, live before the window)."""
    model, batch = case(name)
    loss_fn = _user_loss(name)
    base = sum(_keys(_held(model) + list(batch)).values())
    with _profiled() as prof:
        ddp = DistributedDataParallel(model, gradient_as_bucket_view=view)
        optimizer = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3,
                                            foreach=False)
        _mark(0)
        for step in range(2):
            out = ddp(*batch)
            loss = loss_fn(out, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            del out, loss  # the step's outputs released before the next (graphmem's later steps)
            _mark(step + 1)
    held = addresses([*_held(model), *_grads(model), *batch, *_states(optimizer)])
    kept.append((ddp, optimizer, model, batch))  # freed after profiling would confuse the next window
    at, highs = _phases(prof, 3, held)
    mine = {id(p) for p in _owned(optimizer)}
    return {"built": base + at[0], "between": base + at[1], "after": base + at[2], "peak": base + highs[0],
            "later": base + highs[1], "states": sum(_keys(_states(optimizer)).values()),
            "owned": [i for i, p in enumerate(model.parameters()) if id(p) in mine]}


def _owned(optimizer: ZeroRedundancyOptimizer) -> list[nn.Parameter]:
    return [p for group in optimizer.optim.param_groups for p in group["params"]]


def _worker(rank: int, world_size: int, init: str, cases: list[tuple[str, bool]], out: str) -> None:
    unsettled = _join(rank, world_size, init)
    try:
        results, kept = [], []  # type: ignore[var-annotated]
        for name, view in cases:
            before = unsettled[0]
            runs = [_run(name, view, kept) for _ in range(REPEAT)]
            for key in ("states", "owned"):
                assert len({str(r[key]) for r in runs}) == 1, runs  # the same every time
            least = {k: min(r[k] for r in runs) for k in ("built", "between", "after", "peak", "later")}
            results.append({**runs[0], **least, "unsettled": unsettled[0] - before})
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_zero1(cases: list[tuple[str, bool]], world_size: int) -> list[list[dict[str, Any]]]:
    """For each case (a name for tests/dist_truth.py's ``case``, DDP's ``gradient_as_bucket_view``),
    each rank's {"built", "between", "after", "peak", "later", "states", "owned"} from one real
    gloo job of ``world_size`` processes: bytes held once DDP and ZeroRedundancyOptimizer are built,
    between the two steps and after the second, the first and second steps' peaks, the local
    optimizer's state bytes, and the indices (in ``model.parameters()``) of the parameters it steps."""
    return _spawn(_worker, cases, world_size)
