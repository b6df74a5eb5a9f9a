"""Per-rank captures through PyTorch's own wrappers (graphmem/distributed/) against real gloo runs.

GIVEN a model wrapped by fully_shard (FSDP2) over 2 ranks (and over 4), resharding after forward or not (or
with a bf16/fp32 MixedPrecisionPolicy), or
the bundled Llama split by parallelize_module (tensor parallel, with and without sequence parallel), the
bundled GPT-2 (fused c_attn) likewise, or a Hugging Face decoder split by transformers' own TP plan (Llama at
2 ranks, Qwen2 at 4, and Llama under FSDP2 x TP on a 2 x 2 mesh; the bundled Llama's TP + SP likewise)
WHEN graphmem captures rank r on fake tensors under the fake process group
THEN rank r's saved bytes equal a real 2-process (4-process) gloo step's (saved_tensors_hooks) to the byte,
and its peak equals the real step's CPU allocator peak (torch.profiler) up to the same gap the
single-device prediction has on that model (0 B for the torch.nn chain, Llama, Qwen2 and the bundled
GPT-2; HF GPT-2's 96 B are not from the distributed code), on every rank.
"""
from __future__ import annotations

import pytest
from conftest import torch_settings

import graphmem
from graphmem.distributed import Sharding, make_sharding
from graphmem.validation.measure import measure_peak
from tests.dist_truth import case, loss_of, measure_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # every rank is predicted with one thread, as each gloo rank runs
WORLD = 2
# torch.nn; transformers' Llama (GQA); GPT-2 (tied); models/llama.py; models/gpt2.py; transformers' Qwen2 (8 heads)
MODELS = ("chain", "llama_gqa", "gpt2_sdpa", "llama_bundled", "gpt2_bundled", "qwen2_gqa8", "llama_bundled+ce",
          "gpt2_bundled+ce")
CASES = [(name, make_sharding(WORLD, 0, fsdp=True, reshard_after_forward=raf)) for name in MODELS[:3] for raf in (True, False)] \
    + [("llama_gqa", make_sharding(WORLD, 0, fsdp=True, param_dtype="bf16", reduce_dtype="fp32"))] \
    + [("llama_bundled", make_sharding(WORLD, 0, tp=WORLD, sp=sp)) for sp in (False, True)] \
    + [("llama_gqa", make_sharding(WORLD, 0, tp=WORLD))] \
    + [("gpt2_bundled", make_sharding(WORLD, 0, tp=WORLD, sp=sp)) for sp in (False, True)] \
    + [("llama_bundled+ce", make_sharding(WORLD, 0, tp=WORLD, sp=sp, loss_parallel=lp)) for sp in (False, True)
       for lp in (False, True)] \
    + [("gpt2_bundled+ce", make_sharding(WORLD, 0, tp=WORLD, sp=True, loss_parallel=True))]
# (transformers' TP plan; fused c_attn; the bundled models' cross-entropy with the logits gathered or split: loss parallel)


def _id(name: str, s: Sharding) -> str:
    tp = f"tp{s.tp}-sp={s.sp}" + ("-loss-parallel" if s.loss_parallel else "") if s.tp > 1 else ""
    fsdp = f"fsdp-reshard={s.reshard_after_forward}-mp={s.param_dtype}" if s.fsdp else ""
    return "-".join(p for p in (name, fsdp, tp) if p)


@pytest.fixture(scope="module")
def real() -> list[list[dict[str, int]]]:
    return measure_ranks(CASES, WORLD)


@pytest.fixture(scope="module")
def single_gap() -> dict[str, int]:
    """Real minus predicted peak of each model's single-device step (the existing prediction)."""
    gaps = {}
    with torch_settings(num_threads=1):  # as each gloo rank runs
        for name in MODELS:
            model, batch = case(name)
            loss = loss_of(name)
            gaps[name] = measure_peak(model, batch, loss).peak_bytes - graphmem.analyze(model, batch, loss=loss).peak_bytes
    return gaps


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=[_id(n, s) for n, s in CASES])
def test_rank_matches_real_gloo(real: list[list[dict[str, int]]], single_gap: dict[str, int], index: int) -> None:
    name, sharding = CASES[index]
    _every_rank_is_real(name, sharding, real[index], single_gap[name])


# the same at 4 ranks: FSDP2 over 4 (padding: 4 does not divide every dimension the way 2 does); transformers'
# TP plan over 4 (Qwen2: biases, tied head); FSDP2 x TP on the 2 x 2 mesh, with transformers' plan and with the
# bundled Llama's TP + SP
CASES4 = [("chain", make_sharding(4, 0, fsdp=True)), ("llama_gqa", make_sharding(4, 0, fsdp=True, reshard_after_forward=False)),
          ("qwen2_gqa8", make_sharding(4, 0, tp=4)), ("llama_gqa", make_sharding(4, 0, fsdp=True, tp=2)),
          ("llama_bundled", make_sharding(4, 0, fsdp=True, tp=2, sp=True))]


@pytest.fixture(scope="module")
def real4() -> list[list[dict[str, int]]]:
    return measure_ranks(CASES4, 4)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES4)), ids=[_id(n, s) for n, s in CASES4])
def test_rank_matches_real_gloo_at_4_ranks(real4: list[list[dict[str, int]]], single_gap: dict[str, int],
                                           index: int) -> None:
    name, sharding = CASES4[index]
    _every_rank_is_real(name, sharding, real4[index], single_gap[name])


def _every_rank_is_real(name: str, sharding: Sharding, measured: list[dict[str, int]], gap: int) -> None:
    for rank in range(sharding.world_size):
        model, batch = case(name)
        report = graphmem.analyze(model, batch, loss=loss_of(name), world_size=sharding.world_size, rank=rank,
                                  fsdp="fully_shard" if sharding.fsdp else None,
                                  reshard_after_forward=sharding.reshard_after_forward, tp=sharding.tp, sp=sharding.sp,
                                  fsdp_param_dtype=sharding.param_dtype, fsdp_reduce_dtype=sharding.reduce_dtype,
                                  loss_parallel=sharding.loss_parallel)
        assert report.activation_bytes == measured[rank]["saved"], (name, rank)
        assert measured[rank]["peak"] - report.peak_bytes == gap, (name, rank)
