"""Context parallel in torchtitan jobs (``parallelism.context_parallel_degree``), on the CUDA
target: graphmem runs torch's own context parallel, as torchtitan applies it, per rank on fake
tensors. No CPU can run it for real (torch's ring attention handles CUDA's SDPA kernels only,
torch/distributed/tensor/experimental/_context_parallel/_attention.py, and FlexAttention has no
CPU backward), so each rank is checked against the same job without context parallel at the
rank's share of the sequence, whose figures the gloo truths check (tests/titan/test_titan_truth.py):
what differs is what torch's context parallel code makes, named tensor by tensor."""
from __future__ import annotations

import collections

import pytest

pytest.importorskip("torchtitan")

import graphmem  # noqa: E402
from graphmem.errors import UsageError  # noqa: E402
from tests.titan_truth import small_llama3  # noqa: E402

LAYERS, BATCH, HEADS, KV_HEADS, HEAD_DIM = 4, 2, 4, 2, 16  # small_llama3's shapes
BF16 = 2


def _job(cp: int, seq: int, sdpa: bool = True, backend: str = "partial_dtensor"):
    """small_llama3 with bf16 parameters (the CUDA target's flash and cuDNN kernels need 16 bits),
    ``cp`` context-parallel ranks over a ``seq``-token sequence."""
    config = small_llama3(sdpa)
    config.parallelism.context_parallel_degree = cp
    config.parallelism.spmd_backend = backend
    config.training.mixed_precision_param = "bfloat16"
    config.training.seq_len = seq
    return config


def _report(cp: int, seq: int, rank: int, sdpa: bool = True):
    return graphmem.analyze(_job(cp, seq, sdpa), world_size=cp, rank=rank, device="cuda", gpu="h100")


def _saved(report) -> collections.Counter:
    return collections.Counter((s.op, s.shape, s.dtype, s.bytes) for s in report.saved)


@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_sdpa_ring_attention_saves_the_local_share(cp: int) -> None:
    """SDPA under context parallel (torchtitan's ``partial_dtensor`` backend, which applies it;
    ``spmd_types`` and ``full_dtensor`` refuse SDPA with CP themselves): torch's ring attention
    on the cuDNN kernel h100 picks (torchtitan asks cuDNN > flash > math). Every rank saves what
    the job without CP saves at a 1/cp share of the sequence, exactly, except that on ranks
    whose ring merges partial results (torch's ``_SDPAMerger``) the merged output comes out in
    another layout, so the ``.contiguous()`` before the output projection copies it: one
    (batch, seq/cp, heads, head_dim) bf16 tensor a layer more. The last rank's output needs no
    merge."""
    seq = 16 * cp
    alone = _report(1, 16, 0)
    ranks = [_report(cp, seq, r) for r in range(cp)]
    copy = LAYERS * BATCH * 16 * HEADS * HEAD_DIM * BF16
    assert ranks[-1].activation_bytes == alone.activation_bytes
    for r in ranks[:-1]:
        assert r.activation_bytes - alone.activation_bytes == copy
        extra = _saved(r) - _saved(alone)
        assert extra[("aten.clone.default", (BATCH, 16, HEADS, HEAD_DIM), "bfloat16", copy // LAYERS)] == LAYERS
    assert all(r.attention_backends == {"cudnn": LAYERS} for r in ranks)
    # the parameters are sharded over the CP ranks too (torchtitan's FSDP mesh is dp_shard x cp)
    assert ranks[0].parameter_bytes == alone.parameter_bytes // cp


@pytest.mark.slow
def test_flex_attention_gathers_keys_and_values() -> None:
    """FlexAttention under context parallel (torchtitan's default attention): each rank
    all-gathers the keys and values (torchtitan's ``flex_cp_allgather``) and FlexAttention saves
    the gathered ones, so a rank saves the job without CP's figure at its share of the sequence,
    plus the other ranks' keys and values, plus a BlockMask whose int32 index tensors span the
    whole sequence's key blocks (16 B each here instead of 8). The mask itself is built by torch's
    context parallel with a ``create_block_mask`` it compiles (``_create_cp_block_mask``); graphmem
    runs it eagerly, unrecorded, as it runs torchtitan's own (graphmem/titan/capture.py)."""
    cp, local = 2, 128  # FlexAttention's CP needs the sequence divisible by cp x 128 (its block size)
    alone = _report(1, local, 0, sdpa=False)
    ranks = [_report(cp, cp * local, r, sdpa=False) for r in range(cp)]
    kv = 2 * BATCH * local * KV_HEADS * HEAD_DIM * BF16  # one rank's keys and values, one layer
    mask = 48  # six 16-byte index tensors in place of six 8-byte ones
    for r in ranks:
        assert r.activation_bytes - alone.activation_bytes == LAYERS * (cp - 1) * kv + mask
        gathered = [s for s in r.saved if s.op == "cplib.flex_cp_allgather.default"]
        assert len(gathered) == 2 * LAYERS and all(s.shape == (BATCH, cp * local, KV_HEADS, HEAD_DIM) for s in gathered)


@pytest.mark.slow
def test_compiled_blocks_save_what_the_partition_keeps_of_the_ring() -> None:
    """``compile.enable`` with context parallel: dynamo traces each block with the ring attention
    inside (torch's CP dispatcher handles the DTensor SDPA as dynamo's fake run of the node picks
    the CUDA kernel, graphmem/capture/compiled_cuda.py ``example_values_ruled``), and AOTAutograd's
    partition of that graph decides what is saved: against the compiled job without CP at the last
    rank's share of the sequence, each layer keeps the all-gathered keys and values (one buffer of
    cp ranks' k and v) and a copy of its own k and v, where the eager ring kept neither."""
    def compiled(cp: int, seq: int):
        job = _job(cp, seq)
        job.compile.enable, job.compile.components, job.compile.backend = True, ["model"], "aot_eager"
        return graphmem.analyze(job, world_size=cp, rank=cp - 1, device="cuda", gpu="h100")

    cp = 2
    alone, last = compiled(1, 16), compiled(cp, 16 * cp)
    kv = 2 * BATCH * KV_HEADS * 16 * HEAD_DIM * BF16  # the rank's own keys and values, one layer
    assert last.activation_bytes - alone.activation_bytes == LAYERS * (cp + 1) * kv
    gathered = [s for s in last.saved if s.op.startswith("all_gather_into_tensor")]
    assert len(gathered) == LAYERS and all(s.bytes == cp * kv for s in gathered)


def test_context_parallel_is_refused_on_the_cpu() -> None:
    with pytest.raises(UsageError, match="CUDA target only"):
        graphmem.analyze(_job(2, 32), world_size=2, rank=0, device="cpu")


@pytest.mark.slow
def test_flex_attention_saves_what_its_compiled_function_saves() -> None:
    """torchtitan always compiles FlexAttention, and AOTAutograd's partition keeps only what the
    backward reads: out and the fp32 logsumexp, not the op's ``max_scores``, which its eager
    autograd saves too (graphmem/titan/capture.py ``_saved_as_compiled``). So the eager job and
    the job whose blocks are compiled (``compile.enable``; torchtitan's
    ``_maybe_regional_inductor_backend`` decides on the job's backend name, graphmem/titan/
    compiled.py ``flex_regions_decided``) save the same attention tensors: one (batch, heads, seq)
    fp32 tensor a layer."""
    def report(backend: str | None):
        job = _job(1, 128, sdpa=False)
        if backend:
            job.compile.enable, job.compile.components, job.compile.backend = True, ["model"], backend
        return graphmem.analyze(job, world_size=1, rank=0, device="cuda", gpu="h100")

    def attention_saves(r) -> collections.Counter:
        return collections.Counter((s.shape, s.dtype) for s in r.saved if s.shape in (
            (BATCH, HEADS, 128), (BATCH, HEADS, 128, HEAD_DIM)))

    eager = attention_saves(report(None))
    assert eager == {((BATCH, HEADS, 128), "float32"): LAYERS, ((BATCH, HEADS, 128, HEAD_DIM), "bfloat16"): LAYERS}
    for backend in ("aot_eager", "inductor"):
        assert attention_saves(report(backend)) == eager, backend
