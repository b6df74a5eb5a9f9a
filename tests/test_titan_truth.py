"""The real side of the torchtitan check (tests/titan_truth.py): torchtitan's own Trainer and
train_step on shrunk llama3 debug models, one gloo process per rank, measured per rank. These
tests check that the measurements hold together; graphmem's prediction is compared elsewhere."""
from __future__ import annotations

import pytest

from tests.titan_truth import model_bytes, real_titan, small_llama3, small_qwen3_moe

pytestmark = pytest.mark.slow


def _consistent(ranks: list[dict[str, int]]) -> None:
    for r in ranks:
        assert r["saved_bytes"] > 0
        assert r["peak_bytes"] > r["before_bytes"] > 0
        # after the first step the gradients and Adam's two states live between steps
        assert r["later_before_bytes"] > r["before_bytes"]
        assert r["later_peak_bytes"] > r["later_before_bytes"]
        assert r["unsettled"] == 0, r  # every collective's work was released on the rank's thread


@pytest.mark.parametrize("degree", [2, 4])
def test_fsdp(degree: int) -> None:
    ranks = real_titan(small_llama3, degree, {"parallelism.data_parallel_shard_degree": degree})
    _consistent(ranks)
    assert all(r["saved_bytes"] == r["later_saved_bytes"] for r in ranks)
    params, buffers, count = model_bytes()
    for r in ranks:  # rank r holds 1/degree of every parameter (all dims divide) and the whole buffers
        assert r["before_bytes"] == params // degree + buffers
        # later also the shards' gradients, Adam's exp_avg and exp_avg_sq, and a float32 step per parameter
        assert r["later_before_bytes"] == r["before_bytes"] + 3 * (params // degree) + 4 * count
    assert len({r["saved_bytes"] for r in ranks}) == 1  # data parallel ranks run the same shapes


def test_tp() -> None:
    ranks = real_titan(small_llama3, 2, {"parallelism.tensor_parallel_degree": 2})
    _consistent(ranks)
    params, buffers, _ = model_bytes()
    for r in ranks:  # the linear weights split in two, the norms' weights replicated
        assert params // 2 + buffers < r["before_bytes"] < params + buffers
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert len({r[key] for r in ranks}) == 1, key  # tensor parallel ranks hold the same shapes


def test_fsdp_tp() -> None:
    ranks = real_titan(small_llama3, 4, {"parallelism.data_parallel_shard_degree": 2,
                                         "parallelism.tensor_parallel_degree": 2})
    _consistent(ranks)
    params, buffers, _ = model_bytes()
    for r in ranks:  # FSDP halves what tensor parallel leaves on a rank
        assert params // 4 + buffers < r["before_bytes"] < params // 2 + buffers
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert len({r[key] for r in ranks}) == 1, key


@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B"])
def test_pp(schedule: str) -> None:
    ranks = real_titan(small_llama3, 2, {"parallelism.pipeline_parallel_degree": 2,
                                         "parallelism.pipeline_parallel_schedule": schedule})
    _consistent(ranks)
    params, buffers, _ = model_bytes()
    # the stages split the model: every parameter and buffer is on exactly one rank
    assert sum(r["before_bytes"] for r in ranks) == params + buffers


def test_ep() -> None:
    """Expert parallel over the FSDP ranks (torchtitan's qwen3 MoE debug model, shrunk): the
    experts split by expert parallel, everything else by FSDP, so each rank holds half of it all."""
    ranks = real_titan(small_qwen3_moe, 2, {"parallelism.data_parallel_shard_degree": 2,
                                            "parallelism.expert_parallel_degree": 2})
    _consistent(ranks)
    params, buffers, count = model_bytes(small_qwen3_moe)
    for r in ranks:
        assert r["before_bytes"] == params // 2 + buffers
        assert r["later_before_bytes"] == r["before_bytes"] + 3 * (params // 2) + 4 * count
        assert r["saved_bytes"] == r["later_saved_bytes"]
