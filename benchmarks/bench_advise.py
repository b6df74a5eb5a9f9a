#!/usr/bin/env python
"""How fast does ``graphmem advise`` answer? The CLI's work, end to end, in one process.

For a preset (default gpt2-xl at 32x1024 on the CUDA target with bf16 autocast, against 80 GiB):

  analyze   ``graphmem.analyze(preset, ...)``: the report's own capture (depth reuse: the chain's
            first blocks captured and the rest copied), the construction on the meta device included
  advise    ``report.advise(memory)``: every lever that applies captured (the levers that cannot
            apply are left out without a capture), the checkpoint planner's measurement and its
            verified plan, the combinations

Wall time (time.perf_counter) and CPU time of this process (time.process_time) are printed: on a
shared machine the CPU time is the steadier of the two. The goal is analyze + advise <= 30 s.

    python benchmarks/bench_advise.py
    python benchmarks/bench_advise.py --case gpt2:8x1024 --memory 8GiB
    python benchmarks/bench_advise.py --optimizer adamw     # the optimizer levers too (no depth reuse)

Nothing is asserted: it is a benchmark. The goal is printed next to the figure.
"""
from __future__ import annotations

import argparse
import gc
import time
from typing import Any, Callable

import graphmem
from graphmem.units import fmt_bytes

GOAL_S = 30.0


def _timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[1])
    p.add_argument("--case", default="gpt2-xl:32x1024", help="PRESET:SHAPE")
    p.add_argument("--memory", default="80GiB")
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="bf16")
    p.add_argument("--optimizer", default=None)
    a = p.parse_args()
    name, shape = a.case.split(":")
    report, w1, c1 = _timed(lambda: graphmem.analyze(name, input_shape=shape, device=a.device, amp=a.amp,
                                                     optimizer=a.optimizer))
    print(f"analyze  {name} {shape} ({report.target.describe()}): {w1:.2f} s wall, {c1:.2f} s CPU; "
          f"peak {fmt_bytes(report.peak_bytes)}")
    advice, w2, c2 = _timed(lambda: report.advise(a.memory))
    print(f"advise   {len(advice.levers)} levers, {len(advice.combinations)} combinations, {len(advice.left_out)} left out, "
          f"{advice.captures} captures of changed steps (+ the planner's): {w2:.2f} s wall, {c2:.2f} s CPU")
    print(f"answer   {advice.answer}")
    total_w, total_c = w1 + w2, c1 + c2
    print(f"total    {total_w:.2f} s wall, {total_c:.2f} s CPU; goal <= {GOAL_S:.0f} s: "
          f"{'met' if total_w <= GOAL_S else 'missed'} (wall), {'met' if total_c <= GOAL_S else 'missed'} (CPU)")


if __name__ == "__main__":
    main()
