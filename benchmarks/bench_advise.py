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
    python benchmarks/bench_advise.py --optimizer adamw     # the optimizer levers too (depth reuse with the optimizer step)
    python benchmarks/bench_advise.py --l4-lora             # Llama-3.1-8B LoRA at 1x8192 on a 24 GB L4 (goal 60 s)

``--l4-lora`` is ``graphmem advise llama-3.1-8b --input-shape 1x8192 --device cuda --gpu l4 --lora-rank 16
--lora-targets all-linear --optimizer adamw --memory 24GB``: no single lever fits, so the
combinations are captured too. The peak RSS of the process (``ru_maxrss``, the advice's goal: 2 GB)
and the machine's load average (the machine may be shared) are printed beside the times.

Nothing is asserted: it is a benchmark. The goal is printed next to the figure.
"""
from __future__ import annotations

import argparse
import gc
import os
import resource
import time
from typing import Any, Callable

import graphmem
from graphmem.units import fmt_bytes

GOAL_S = 30.0
L4_LORA = {"case": "llama-3.1-8b:1x8192", "memory": "24GB", "device": "cuda", "gpu": "l4", "amp": None,
           "optimizer": "adamw", "lora_rank": 16, "lora_targets": "all-linear", "goal": 60.0}


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
    p.add_argument("--gpu", default=None)
    p.add_argument("--amp", default="bf16")
    p.add_argument("--optimizer", default=None)
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--lora-targets", default=None)
    p.add_argument("--goal", type=float, default=GOAL_S, help="seconds")
    p.add_argument("--l4-lora", action="store_true", help="the Llama-3.1-8B LoRA on an L4 case (" + ", ".join(
        f"{k}={v}" for k, v in L4_LORA.items()) + ")")
    a = p.parse_args()
    if a.l4_lora:
        vars(a).update(L4_LORA)
    name, shape = a.case.split(":")
    load = os.getloadavg()
    options = {k: v for k, v in (("gpu", a.gpu), ("lora_rank", a.lora_rank), ("lora_targets", a.lora_targets))
               if v is not None}
    report, w1, c1 = _timed(lambda: graphmem.analyze(name, input_shape=shape, device=a.device, amp=a.amp,
                                                     optimizer=a.optimizer, **options))
    print(f"analyze  {name} {shape} ({report.target.describe()}): {w1:.2f} s wall, {c1:.2f} s CPU; "
          f"peak {fmt_bytes(report.peak_bytes)}")
    advice, w2, c2 = _timed(lambda: report.advise(a.memory))
    print(f"advise   {len(advice.levers)} levers, {len(advice.combinations)} combinations, {len(advice.left_out)} left out, "
          f"{advice.captures} captures of changed steps (+ the planner's): {w2:.2f} s wall, {c2:.2f} s CPU")
    print(f"answer   {advice.answer}")
    total_w, total_c = w1 + w2, c1 + c2
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(f"total    {total_w:.2f} s wall, {total_c:.2f} s CPU; goal <= {a.goal:.0f} s: "
          f"{'met' if total_w <= a.goal else 'missed'} (wall), {'met' if total_c <= a.goal else 'missed'} (CPU)")
    print(f"memory   peak RSS {fmt_bytes(rss)} (goal <= 2 GB: {'met' if rss <= 2e9 else 'missed'})")
    print(f"machine  {os.cpu_count()} CPUs; load average {load[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
