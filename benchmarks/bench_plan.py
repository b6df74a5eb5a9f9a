#!/usr/bin/env python
"""How fast does graphmem plan checkpoints? The planner on a real 80-block chain, 50 budgets.

For a preset (default llama-2-70b at 8x4096 on the CUDA target in bf16: 80 identical decoder
blocks whose activations, 4x the parameters, are worth checkpointing), in one process:

  measure    ``report.planner``: the chain's pieces from captures at depth 4 (the report's own
             capture, ``graphmem.analyze``, is timed separately as ``analyze``)
  plan       the dynamic program for ``--budgets`` budgets evenly spread from the smallest
             reachable peak to the peak without checkpoints (``passes.checkpoint.optimal`` per
             budget, sharing the tables), best of ``--repeat`` runs; the goal is <= 0.5 s
  frontier   ``passes.checkpoint.frontier`` (the smallest reachable peak by bisection, then the
             program at 50 budgets)
  verify     ``report.plan(budget)`` at the middle budget: the program, then the step captured
             with the plan applied (graphmem/planning/verify.py); the goal for analyze + measure +
             this is <= 15 s

Wall time (time.perf_counter) and CPU time of this process (time.process_time) are both
printed: on a shared machine the CPU time is the steadier of the two.

    python benchmarks/bench_plan.py                         # llama-2-70b 8x4096, cuda bf16 (~1 min)
    python benchmarks/bench_plan.py --case gpt2-xl:32x1024 --device cpu --dtype fp32
    python benchmarks/bench_plan.py --amp bf16                # autocast: the cast cache's bytes in the states

Nothing is asserted: it is a benchmark. The goal is printed next to the figure.
"""
from __future__ import annotations

import argparse
import gc
import time

import graphmem
from graphmem.passes.checkpoint import evaluate, frontier, minimum_peak, optimal, segments_of, tables


def _timed(fn):  # type: ignore[no-untyped-def]
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--case", default="llama-2-70b:8x4096", help="PRESET:SHAPE")
    p.add_argument("--device", default="cuda", help="target device (default cuda)")
    p.add_argument("--dtype", default="bf16", help="parameter dtype (default bf16)")
    p.add_argument("--amp", default=None, help="autocast dtype (bf16/fp16; the parameters stay fp32)")
    p.add_argument("--budgets", type=int, default=50)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    name, shape = a.case.split(":")
    dtype = None if a.amp else a.dtype
    report, w, c = _timed(lambda: graphmem.analyze(name, input_shape=shape, device=a.device, dtype=dtype, amp=a.amp))
    total = [w]
    print(f"analyze   {name} {shape} ({report.target.describe() if hasattr(report.target, 'describe') else a.device}): {w:.2f} s wall, {c:.2f} s CPU; peak {report.peak_bytes / 2**30:.2f} GiB")
    planner, w, c = _timed(lambda: report.planner)
    total[0] += w
    costs = planner.costs
    print(f"measure   chain {costs.chain} of {costs.n} blocks (captured at depth {planner.depth}): {w:.2f} s wall, {c:.2f} s CPU")
    t, tw, tc = _timed(lambda: tables(costs))
    low = minimum_peak(costs, t)
    high = evaluate(costs, segments_of(costs.n, [])).peak_bytes
    budgets = [low + (high - low) * k // (a.budgets - 1) for k in range(a.budgets)]
    best = None
    for _ in range(a.repeat):
        plans, w, c = _timed(lambda: [optimal(costs, b, t) for b in budgets])
        best = (w, c) if best is None or w < best[0] else best
    assert best is not None
    distinct = len({p.segments for p in plans if p is not None})
    print(f"tables    {tw * 1000:.1f} ms wall")
    print(f"plan      {costs.n} blocks x {a.budgets} budgets: {best[0]:.3f} s wall, {best[1]:.3f} s CPU "
          f"(best of {a.repeat}; {distinct} distinct plans); goal <= 0.5 s: {'met' if best[0] <= 0.5 else 'missed'}")
    front, w, c = _timed(lambda: frontier(costs, a.budgets))
    print(f"frontier  {len(front)} Pareto plans, incl. the smallest-peak bisection: {w:.3f} s wall, {c:.3f} s CPU")
    mid = (low + high) // 2
    chosen, w, c = _timed(lambda: report.plan(budget=mid))
    v = chosen.verification
    print(f"verify    report.plan(budget) at the middle budget, its capture(s) with the plan applied: {w:.2f} s wall, "
          f"{c:.2f} s CPU; {v.line() if v is not None else 'not verified'}")
    print(f"total     analyze + measure + plan + verify: {total[0] + w:.2f} s wall; goal <= 15 s: "
          f"{'met' if total[0] + w <= 15 else 'missed'}")


if __name__ == "__main__":
    main()
