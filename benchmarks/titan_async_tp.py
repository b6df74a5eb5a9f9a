"""torchtitan's published 70B row (Table 4 of torchtitan/benchmarks/llama3_h100_202412_torchtitan.md:
FSDP32 x TP8, local batch 16, seq 8192, full AC, compile + Float8; 71.9 GiB max reserved, 67.6 GiB
with AsyncTP) as torchtitan 0.3.0 can express it: bf16 linears (tensorwise Float8 cannot be set in
0.3.0), each block compiled with Inductor's partition, with and without AsyncTP. Printed beside the
published figures, not held to them. The rest of the 2024 setting as benchmarks/titan_published.py
sets it: SDPA, the plain cross-entropy, AdamW ``foreach``, FSDP2 MixedPrecisionPolicy(bf16, fp32).

    python benchmarks/titan_async_tp.py
"""
from __future__ import annotations

import sys
from typing import Any

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from titan_published import COMPILE, predict, published_job  # noqa: E402

WORLD, FSDP, TP = 256, 32, 8
PUBLISHED = {False: 71.9, True: 67.6}  # with compile + Float8


def job(async_tp: bool) -> Any:
    from torchtitan.distributed.activation_checkpoint import FullAC

    overrides = ["--parallelism.data_parallel_shard_degree", str(FSDP), "--parallelism.tensor_parallel_degree", str(TP),
                 *COMPILE, *(["--compile.enable_async_tensor_parallel"] if async_tp else [])]
    config = published_job("llama3_70b", overrides)
    config.training.local_batch_size, config.training.seq_len = 16, 8192
    config.activation_checkpoint = FullAC.Config()
    return config


def main() -> int:
    print("| row | published (compile + Float8) | graphmem later-step max reserved (GiB) | max allocated (GiB) | "
          "first step reserved (GiB) | time (s) | peak RSS (GiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for async_tp in (False, True):
        got, seconds, rss = predict(WORLD, job(async_tp))
        print(f"| 70B FSDP{FSDP} x TP{TP}, local batch 16, full AC, compile, bf16 linears"
              f"{', AsyncTP' if async_tp else ''} | {PUBLISHED[async_tp]:.1f} | {got['later reserved']:.1f} | "
              f"{got['later allocated']:.1f} | {got['first reserved']:.1f} | {seconds:.0f} | {rss:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
