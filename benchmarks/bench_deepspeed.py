#!/usr/bin/env python
"""How long does a DeepSpeed rank's analysis take, and how much memory?

``graphmem.analyze(preset, input_shape=shape, deepspeed=config, world_size=N, rank=r, optimizer="adamw")``
end to end: the preset's construction on the meta device, ``deepspeed.initialize`` on a fake copy under the
fake process group (ZeRO partitions every parameter as on rank r of N), the first step recorded, then the
later steps' capture (a second engine, its first step run unrecorded: graphmem/deepspeed/capture.py), the
passes and the report. Timed once, after ``import deepspeed`` (15-35 s on this machine, once per process) and
a warm-up analysis of a 2-layer model with the same config (the first FakeTensorMode use and DeepSpeed's
first engine cost a few seconds once). The peak RSS of the process is read from ``/proc/self/status``, with the
process's own share (its peak less the shared libraries' file pages, which the kernel's page cache decides:
benchmarks/process_memory.py) beside it.

    python benchmarks/bench_deepspeed.py                                   # llama-2-70b 1x4096, ZeRO-3 bf16, 64 ranks
    python benchmarks/bench_deepspeed.py --case llama-2-7b:1x512 --world-size 8 --profile /tmp/ds.prof
    python benchmarks/bench_deepspeed.py --device cpu                      # the same on the CPU target

Nothing is asserted: it is a benchmark. The goals are printed next to the figures.
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import platform
import time
import warnings

import torch
from process_memory import PeakMemory

import graphmem
from graphmem.units import fmt_bytes

GOAL_SECONDS = 30.0
GOAL_RSS = 1.5e9


def config(stage: int, bf16: bool) -> dict:
    """The job's DeepSpeed config: DeepSpeed's defaults but the stage and the precision."""
    return {"train_micro_batch_size_per_gpu": "auto", "bf16": {"enabled": bf16}, "zero_optimization": {"stage": stage}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="llama-2-70b:1x4096", help="PRESET:SHAPE")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--fp32", dest="bf16", action="store_false")
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"),
                   help="the target (cuda, a DeepSpeed job's default: the GPU's figures, the device total; cpu: "
                        "DeepSpeed's CPU run)")
    p.add_argument("--profile", help="write cProfile's statistics of the timed analysis to this file")
    args = p.parse_args()
    preset, shape = args.case.split(":")
    warnings.filterwarnings("ignore")
    import deepspeed  # noqa: F401  (imported once per process, not timed)

    from graphmem.models.llama import LlamaConfig, Transformer  # the warm-up's 2-layer model

    options = dict(deepspeed=config(args.stage, args.bf16), world_size=args.world_size, rank=args.rank,
                   optimizer="adamw", device=args.device)
    with torch.device("meta"):
        small = Transformer(LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, ffn_hidden=128))
    graphmem.analyze(small, input_shape="1x16", **options)  # warm-up
    gc.collect()
    memory = PeakMemory()  # the libraries are mapped by now
    profile = cProfile.Profile() if args.profile else None
    start, cpu = time.perf_counter(), time.process_time()
    if profile is not None:
        profile.enable()
    report = graphmem.analyze(preset, input_shape=shape, **options)
    if profile is not None:
        profile.disable()
        profile.dump_stats(args.profile)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"deepspeed {deepspeed.__version__}")
    print(f"{preset} {shape}: {report.source.spec.parallel.describe()}, AdamW")
    print(f"  analyze: {seconds:.1f} s wall, {cpu:.1f} s CPU (goal <= {GOAL_SECONDS:.0f} s), peak RSS {fmt_bytes(memory.total())} "
          f"(goal <= {GOAL_RSS / 1e9:.1f} GB), of which the process's own {fmt_bytes(memory.own())} and the libraries' "
          f"file pages {fmt_bytes(memory.files())}; {report.num_ops} ops")
    later = report.budget.rank.later_peak_bytes if report.budget is not None else report.peak_bytes
    print(f"  rank's peak {fmt_bytes(report.peak_bytes)} (first step), {fmt_bytes(later)} "
          f"(later steps); activations {fmt_bytes(report.activation_bytes)}")
    if report.memory is not None and report.memory.rows:  # the CUDA target: what nvidia-smi would show
        print(f"  device total {fmt_bytes(report.memory.device_total)} (reserved {fmt_bytes(report.memory.run_max_reserved)}"
              f" + the rows outside the caching allocator) on {report.target.gpu if report.target else 'the card'}")


if __name__ == "__main__":
    main()
