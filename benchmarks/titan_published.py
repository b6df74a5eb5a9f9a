"""torchtitan's published H100 memory (torchtitan/benchmarks/llama3_h100_202412_torchtitan.md in the
torchtitan repository, the figures of arXiv 2410.06511) beside graphmem's prediction, row by row,
with the time and memory each prediction took.

Each expressible row is the job torchtitan 0.3.0 builds from its own config registry
(``llama3_8b``) and overrides, set as the 2024 runs were (the file's "Versions and Dates":
torchtitan 9dec370): SDPA ``is_causal`` attention (graphmem/titan/job.py ``with_sdpa``),
the plain cross-entropy over the whole logits (0.3.0's default chunks it), AdamW ``foreach``
(0.3.0's default is fused), selective per-op activation checkpointing, FSDP2 with
MixedPrecisionPolicy(bf16, fp32). The published memory is ``max_reserved`` read at step 90 (stable,
the file says): a later step's, which graphmem's caching-allocator model gives over two steps in a row.

    python benchmarks/titan_published.py            # every expressible row
    python benchmarks/titan_published.py --rows 1   # the first only
    python benchmarks/titan_published.py --float8 1 # the first float8 row (rowwise; pip install torchao)
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

GIB = 2 ** 30

COMPILE = ["--compile.enable", "--compile.components", "model"]  # each transformer block, as the 2024 runs compiled
# (name, world size, config name, overrides, published max reserved GiB)
ROWS = [
    ("8B FSDP8, local batch 2, seq 8192, selective op AC (Table 1)", 8, "llama3_8b",
     ["--parallelism.data_parallel_shard_degree", "8"], 82.4),
    ("8B FSDP128, local batch 2, seq 8192, selective op AC (Table 3)", 128, "llama3_8b",
     ["--parallelism.data_parallel_shard_degree", "128"], 67.0),
    ("8B FSDP8 + torch.compile (Table 1)", 8, "llama3_8b",
     ["--parallelism.data_parallel_shard_degree", "8", *COMPILE], 77.0),
    ("8B FSDP128 + torch.compile (Table 3)", 128, "llama3_8b",
     ["--parallelism.data_parallel_shard_degree", "128", *COMPILE], 62.0),
]
COMMON = ["--training.local_batch_size", "2", "--training.seq_len", "8192", "--optimizer.implementation", "foreach"]

# Table 2 (8 GPUs, local batch 1, full AC; FSDP 8/cp x CP cp over cp x 32768 tokens), published with
# torch.compile and Float8. Float8 is not expressible (see below), so these rows run with bf16 linears,
# eager and with each block compiled, under torchtitan's ``partial_dtensor`` backend (the one that
# applies CP to SDPA). Not the published configuration: printed beside it, not held to it.
CP_ROWS = [(cp, 8 // cp, 32768 * cp, published) for cp, published in ((1, 83.9), (2, 84.2), (4, 84.0), (8, 84.5))]

# Tables 1 and 3's "+ Float8" rows, as torchtitan 0.3.0 can configure them (graphmem/titan/float8.py): its
# Float8LinearConverter with the rowwise recipe (torchao's Float8Linear, torch._scaled_mm on the CUDA target). The 2024
# runs scaled tensorwise and all-gathered float8 weights under FSDP2, which 0.3.0 cannot set: printed beside the
# published figure, not held to it. (name, world size, published max reserved GiB)
FLOAT8_ROWS = [("8B FSDP8 + compile + Float8 rowwise (Table 1: tensorwise, float8 all-gather)", 8, 76.8),
               ("8B FSDP128 + compile + Float8 rowwise (Table 3: tensorwise, float8 all-gather)", 128, 61.8)]

NOT_EXPRESSIBLE = [
    ("+ Float8 as published (Tables 1-6)", "the 2024 runs scaled tensorwise and all-gathered float8 weights under FSDP; "
     "torchtitan 0.3.0's Float8LinearConverter offers the rowwise recipes only (components/quantization/float8.py): "
     "Tables 1 and 3 run rowwise above, not held"),
    ("FSDP x CP (Tables 2, 6)", "those rows also use tensorwise Float8 (Table 2's rows above run without it)"),
    ("70B FSDP32 x TP8 (Table 4)", "compile + Float8 (+ AsyncTP's symmetric memory)"),
    ("405B FSDP8 x TP8 x PP8 (Table 5)", "compile + Float8 + AsyncTP"),
]


def published_job(config_name: str, overrides: list[str]) -> Any:
    """The job as the 2024 run was set: the registry's config, the overrides, the plain cross-entropy."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.common.config_utils import decoder_vocab_size

    from graphmem.titan import load_job

    job = load_job(config_name, COMMON + overrides)
    job.loss = CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(job.model_spec))
    return job


def cp_job(cp: int, fsdp: int, seq: int, compiled: bool) -> Any:
    """A Table 2 row's job as graphmem can run it (see ``CP_ROWS``): full activation checkpointing,
    RoPE's table as long as the sequence (0.3.0's llama3_8b stops at 131072 tokens)."""
    from torchtitan.distributed.activation_checkpoint import FullAC
    from torchtitan.models.common import ComplexRoPE

    job = published_job("llama3_8b", ["--parallelism.data_parallel_shard_degree", str(fsdp),
                                      "--parallelism.context_parallel_degree", str(cp),
                                      "--parallelism.spmd_backend", "partial_dtensor", *(COMPILE if compiled else [])])
    job.training.local_batch_size, job.training.seq_len = 1, seq
    job.activation_checkpoint = FullAC.Config()
    for _fqn, rope, _parent, _attr in job.model_spec.model.traverse(ComplexRoPE.Config):
        rope.max_seq_len = max(rope.max_seq_len, seq)
    return job


def float8_job(world: int) -> Any:
    """A ``FLOAT8_ROWS`` job: the compiled row's job through torchtitan's Float8LinearConverter, rowwise, the
    output projection left in bf16 as the 2024 runs left it (their converter's ``module_filter_fn=lambda mod, fqn:
    fqn != "output"``; 0.3.0 names it ``lm_head`` and filters it so in its own ``llama3_405b``)."""
    from graphmem.titan.float8 import with_float8

    return with_float8(published_job("llama3_8b", ["--parallelism.data_parallel_shard_degree", str(world), *COMPILE]),
                       recipe="rowwise", filter_fqns=["lm_head"], gpu="h100")


def predict(world: int, job: Any) -> tuple[dict[str, float], float, float]:
    import graphmem

    t0 = time.perf_counter()
    report = graphmem.analyze(job, world_size=world, rank=0, device="cuda", gpu="h100", attention="sdpa")
    m = report.memory  # the run's figures (passes/run_memory.py)
    seconds = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return ({"first allocated": m.first_allocated / GIB, "first reserved": m.first_reserved / GIB,
             "later allocated": m.later_allocated / GIB, "later reserved": m.later_reserved / GIB},
            seconds, rss)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", help="row numbers (1-based); default all")
    p.add_argument("--float8", type=int, nargs="*", help="the float8 rows only (1-based; default both; needs torchao)")
    args = p.parse_args(argv)
    print("| row | published max reserved (GiB) | graphmem later-step max reserved (GiB) | error | "
          "max allocated (GiB) | first step reserved (GiB) | time (s) | peak RSS (GiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, (name, world, cfg, overrides, published) in enumerate(ROWS, 1):
        if (args.rows and i not in args.rows) or (args.float8 is not None and not args.rows):
            continue
        got, seconds, rss = predict(world, published_job(cfg, overrides))
        err = (got["later reserved"] - published) / published * 100
        print(f"| {name} | {published:.1f} | {got['later reserved']:.1f} | {err:+.1f} % | {got['later allocated']:.1f} | "
              f"{got['first reserved']:.1f} | {seconds:.0f} | {rss:.2f} |", flush=True)
    if not args.rows or args.float8 is not None:
        for i, (name, world, published) in enumerate(FLOAT8_ROWS, 1):
            if args.float8 and i not in args.float8:
                continue
            got, seconds, rss = predict(world, float8_job(world))
            print(f"| {name} | {published:.1f} | {got['later reserved']:.1f} | not held (another recipe) | "
                  f"{got['later allocated']:.1f} | {got['first reserved']:.1f} | {seconds:.0f} | {rss:.2f} |", flush=True)
    if not args.rows and args.float8 is None:
        for (cp, fsdp, seq, published), compiled in ((row, c) for c in (False, True) for row in CP_ROWS):
            got, seconds, rss = predict(cp * fsdp, cp_job(cp, fsdp, seq, compiled))
            print(f"| 8B FSDP{fsdp} x CP{cp}, {seq} tokens, full AC, {'compile' if compiled else 'eager'}, bf16 "
                  f"linears (Table 2 published with compile + Float8: not comparable) | {published:.1f} | "
                  f"{got['later reserved']:.1f} | — | {got['later allocated']:.1f} | {got['first reserved']:.1f} | "
                  f"{seconds:.0f} | {rss:.2f} |", flush=True)
    for name, why in NOT_EXPRESSIBLE:
        print(f"| {name} | — | not expressible: {why} | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
