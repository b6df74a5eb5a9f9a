#!/usr/bin/env python
"""How long does a per-rank capture through PyTorch's own wrappers take, and how much memory?

``graphmem.analyze(preset, input_shape=shape, device=..., world_size=N, rank=r, fsdp="fully_shard",
tp=T, sp=...)`` end to end (the preset's meta construction, the fake process group, fully_shard
and parallelize_module on the fake copy, the capture of rank r's step (a deep chain: at depth 5,
checked at 6, widened: graphmem/capture/reuse.py), the single-device capture for the formula
beside it, the passes and the gap by cause), timed once per case after a warm-up run of the same
case on one block (the first FakeTensorMode use in a process costs ~1-2 s). The peak RSS of the
process is read from ``resource.getrusage`` after the run.

    python benchmarks/bench_distributed.py                                  # llama-2-70b 1x4096, FSDP 64 x TP 8 + SP, cuda, rank 0
    python benchmarks/bench_distributed.py --case llama-2-7b:1x512 --world-size 16 --tp 2 --device cpu

Nothing is asserted: it is a benchmark. The goals are printed next to the figures.
"""
from __future__ import annotations

import argparse
import gc
import platform
import resource
import time
import warnings

import torch

import graphmem
from graphmem.units import fmt_bytes

GOAL_SECONDS = 20.0
GOAL_RSS = 2 * 1024**3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="llama-2-70b:1x4096", help="PRESET:SHAPE")
    p.add_argument("--world-size", type=int, default=512)
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--no-sp", dest="sp", action="store_false")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    preset, shape = args.case.split(":")
    warnings.filterwarnings("ignore")
    options = dict(device=args.device, world_size=args.world_size, rank=args.rank, fsdp="fully_shard", tp=args.tp,
                   sp=args.sp and args.tp > 1)
    graphmem.analyze("llama-2-7b", input_shape="1x16", **{**options, "world_size": 2 * args.tp})  # warm-up
    gc.collect()
    start = time.perf_counter()
    report = graphmem.analyze(preset, input_shape=shape, **options)
    seconds = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{preset} {shape} on {args.device}: rank {args.rank} of {args.world_size} "
          f"(FSDP {args.world_size // args.tp} x TP {args.tp}{' + SP' if options['sp'] else ''})")
    print(f"  analyze: {seconds:.1f} s (goal <= {GOAL_SECONDS:.0f} s), peak RSS {fmt_bytes(rss)} "
          f"(goal <= {fmt_bytes(GOAL_RSS)}), {report.num_ops} ops")
    print(f"  rank's peak {fmt_bytes(report.peak_bytes)}, parameters {fmt_bytes(report.parameter_bytes)}, "
          f"activations {fmt_bytes(report.activation_bytes)}")
    for line in report.notes:
        print(f"  {line}")


if __name__ == "__main__":
    main()
