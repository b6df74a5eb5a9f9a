"""AsyncTP (``compile.enable_async_tensor_parallel``) on the CUDA target: Inductor's
micro-pipeline pass on each compiled block's split graphs (graphmem/titan/async_tp.py) and the
fused ops' CUDA allocations (graphmem/oprules/symm_mem.py). No CPU runs symmetric memory, so
the async job is checked against the same job without AsyncTP, whose figures are checked against
real gloo runs (tests/titan/test_titan_truth.py): every difference is computed here from shapes."""
from __future__ import annotations

import collections

import pytest

pytest.importorskip("torchtitan")

import torch  # noqa: E402

from graphmem.capture.target import make_target  # noqa: E402
from graphmem.errors import UsageError  # noqa: E402
from graphmem.oprules import scratch  # noqa: E402
from graphmem.oprules.symm_mem import AG_MM, MM_RS, workspace_bytes  # noqa: E402
from tests.titan_truth import small_llama3  # noqa: E402

LAYERS, DIM, HIDDEN, TP, BF16 = 4, 64, 192, 2, 2  # small_llama3's shapes, two TP ranks, bf16 parameters


def _job(async_tp: bool, batch: int = 1, seq: int = 64, backend: str = "inductor"):
    config = small_llama3(True)
    config.parallelism.tensor_parallel_degree = TP
    config.compile.enable, config.compile.components, config.compile.backend = True, ["model"], backend
    config.compile.enable_async_tensor_parallel = async_tp
    config.training.mixed_precision_param = "bfloat16"
    config.training.local_batch_size, config.training.seq_len = batch, seq
    return config


def _capture(config, device: str = "cuda"):
    from graphmem.titan.capture import capture_job

    return capture_job(config, TP, 0, make_target(device=device, gpu="h100"))


@pytest.fixture(scope="module")
def jobs():
    """Rank 0 of the job with and without AsyncTP: one sequence of 64 tokens (batch 1: the fused
    ops' (sequence, batch)-ordered outputs are then contiguous, see test_batch_over_one)."""
    return _capture(_job(False)), _capture(_job(True))


def _fused(g, op):
    return [o for o in g.ops if o.target is op]


def _bytes_by_kind(g) -> collections.Counter:
    made: collections.Counter = collections.Counter()
    for s in g.storages.values():
        if s.created >= 0:
            made[s.kind] += s.nbytes
    return made


def _phase_peak(g, phase: str, end: str) -> int:
    from passes import liveness

    timeline = liveness(g).timeline
    return max(timeline[g.phase_start[phase]:g.phase_start[end]])


@pytest.mark.slow
def test_fused_ops_replace_the_tp_matmuls(jobs) -> None:
    """torchtitan's TP plan for a llama3 block (torchtitan/models/common/decoder_sharding.py): ``wqkv`` and
    ``w1``/``w3`` column-wise after an all-gather of the sequence-parallel input (one fused op
    each, its matmuls sharing the gathered input: 1 and 2 weights), ``wo`` and ``w2`` row-wise,
    whose input gradients all-gather the output gradient before their matmul (one fused op each
    in backward). No reduce-scatter fuses: DTensor reduce-scatters the sequence dimension as
    permute, clone, ``reduce_scatter_tensor`` (the graphs' own ops), and the pass fuses a
    reduce-scatter only when its input is the matmul (micro_pipeline_tp.py
    ``_find_producer_matmul``)."""
    plain, fused = jobs
    assert not _fused(plain, AG_MM) and not _fused(plain, MM_RS)
    weights = collections.Counter((o.meta["phase"], len(o.args[1])) for o in _fused(fused, AG_MM))
    assert weights == {("forward", 1): LAYERS, ("forward", 2): LAYERS, ("backward", 1): 2 * LAYERS}
    assert not _fused(fused, MM_RS)
    assert all(o.kwargs.get("return_A", True) for o in _fused(fused, AG_MM))  # the gathered input is used again


@pytest.mark.slow
def test_saved_set_is_the_partitions(jobs) -> None:
    """The pass runs after AOTAutograd's partition: the same tensors are saved, byte for byte
    (a matmul's 2-D output in the plain job is the fused op's 3-D output: counted by elements)."""
    from passes import saved

    def kept(g):
        return collections.Counter((torch.Size(s.shape).numel(), s.dtype, s.bytes) for s in saved(g).tensors)

    plain, fused = jobs
    assert kept(plain) == kept(fused)


@pytest.mark.slow
def test_allocations_differ_by_the_gathered_inputs(jobs) -> None:
    """Each fused op makes the gathered input in its own buffer (``A_flat``, returned as A) where
    the plain job's all-gather makes a communication buffer and then its ``cat`` the gathered
    input: the activations are the same bytes, the fused ops make no scratch (A returned, the
    shard viewable), and the plain job's all-gather outputs are what it makes in addition."""
    plain, fused = jobs
    gathered = 1 * 64 * DIM * BF16  # batch x sequence x dim, bf16: the input of every fused op
    a, b = _bytes_by_kind(plain), _bytes_by_kind(fused)
    assert a["activation"] == b["activation"]
    assert a["communication"] - b["communication"] == gathered * len(_fused(fused, AG_MM))
    assert "workspace" not in b
    for o in _fused(fused, AG_MM):
        shapes = [shape for shape, _, _ in o.meta["outputs"]]
        assert o.meta["bytes"] == sum(torch.Size(s).numel() for s in shapes) * BF16


@pytest.mark.slow
def test_fused_op_makes_all_its_outputs_at_once(jobs) -> None:
    """The forward peak (in the last block's SwiGLU) holds ``w3``'s output in the async job: the
    fused op allocates every matmul's output before it runs (``outputs = [A_flat.new_empty(...)
    for B in Bs]``), where the plain job runs ``w3``'s matmul after the SiLU. Backward and the
    step's peak (the optimizer's) are the same."""
    plain, fused = jobs
    w3_out = 1 * 64 * (HIDDEN // TP) * BF16
    assert _phase_peak(fused, "forward", "loss") - _phase_peak(plain, "forward", "loss") == w3_out
    assert _phase_peak(fused, "backward", "optimizer") == _phase_peak(plain, "backward", "optimizer")
    from passes import liveness

    assert liveness(fused).peak_bytes == liveness(plain).peak_bytes


@pytest.mark.slow
def test_workspace_is_reported_apart(jobs) -> None:
    """One symmetric workspace for the TP group, grown to the largest shard an all-gather matmul
    copies in (``get_symm_mem_workspace``), plus its signal pad; not a storage of the step."""
    from torch._C._distributed_c10d import _SymmetricMemory

    plain, fused = jobs
    shard = 1 * (64 // TP) * DIM * BF16
    assert workspace_bytes(fused.ops) == shard + _SymmetricMemory.signal_pad_size
    assert workspace_bytes(plain.ops) == 0
    from passes import notes

    assert [n for n in notes(fused) if n.startswith("symmetric memory workspace: 13.00 KiB")]  # 4,096 + 9,216 B
    assert not [n for n in notes(plain) if "symmetric" in n]


@pytest.mark.slow
def test_batch_over_one() -> None:
    """With two sequences the fused op's A is (sequence, batch)-ordered on the GPU
    (``unflatten``): reshaped to 2-D for the saved input and the weight gradient's matmul, it is
    copied, as Inductor copies a view it cannot express by strides; one copy per fused op."""
    plain, fused = _capture(_job(False, 2, 32)), _capture(_job(True, 2, 32))
    a, b = _bytes_by_kind(plain), _bytes_by_kind(fused)
    gathered = 2 * 32 * DIM * BF16
    n = len(_fused(fused, AG_MM))
    assert b["activation"] - a["activation"] == gathered * n
    assert a["communication"] - b["communication"] == gathered * n


@pytest.mark.slow
def test_aot_eager_runs_plain_tp() -> None:
    """torchtitan sets Inductor's flag with any backend; ``aot_eager`` runs no post-grad pass."""
    g = _capture(_job(True, backend="aot_eager"))
    assert not _fused(g, AG_MM) and not _fused(g, MM_RS)


def test_cpu_target_is_refused() -> None:
    with pytest.raises(UsageError, match="device='cuda'"):
        _capture(_job(True), device="cpu")


@pytest.fixture
def group():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield dist.group.WORLD.group_name
    finally:
        dist.destroy_process_group()


def _scratch(op, args, kwargs=None):
    return sum(s.nbytes for s in scratch(op, "cuda", args, kwargs or {}, None))


def test_matmul_reduce_scatter_stacks_partials(group) -> None:
    """``_fused_matmul_reduce_scatter_impl``: the stacked partials, every rank's chunk of A @ B,
    and a copy of A where ``movedim(scatter_dim, 0).flatten(0, -2)`` cannot view it."""
    a, b = torch.empty(2, 64, 32, dtype=torch.bfloat16), torch.empty(32, 48, dtype=torch.bfloat16)
    partials, copy = 2 * 64 * 48 * BF16, a.numel() * BF16
    restrided = a.transpose(0, 1).contiguous().transpose(0, 1)  # the pass's restride for scatter dim 1
    assert _scratch(MM_RS, (restrided, b, "sum", 1, group)) == partials
    assert _scratch(MM_RS, (a, b, "sum", 1, group)) == partials + copy
    assert _scratch(MM_RS, (a, b, "sum", 2, group)) == partials  # the last dim: A.flatten(0, -2), a view


def test_all_gather_matmul_paths(group) -> None:
    """``_fused_all_gather_matmul``: the gathered A is scratch without ``return_A``; the shard is
    copied when it cannot be flattened; the last-dim path gathers into scratch always; the
    multimem path (gather dim 0, at most 2048 gathered rows) gathers into the workspace."""
    w = [torch.empty(32, 16, dtype=torch.bfloat16)]
    shard = torch.empty(2, 256, 32, dtype=torch.bfloat16)  # batch 2, 256 of 1024 tokens a rank
    restrided = shard.transpose(0, 1).contiguous().transpose(0, 1)  # the pass's restride
    gathered = 4 * shard.numel() * BF16
    assert _scratch(AG_MM, (restrided, w, 1, group)) == 0
    assert _scratch(AG_MM, (restrided, w, 1, group), {"return_A": False}) == gathered
    assert _scratch(AG_MM, (shard, w, 1, group)) == shard.numel() * BF16  # movedim(1, 0) of (2, 256, 32)
    assert _scratch(AG_MM, (torch.empty(64, 32, dtype=torch.bfloat16), [torch.empty(128, 16)], 1, group)) == \
        4 * 64 * 32 * BF16  # last dim
    assert _scratch(AG_MM, (torch.empty(512, 32), w, 0, group), {"return_A": False}) == 0  # multimem
    assert _scratch(AG_MM, (torch.empty(513, 32), w, 0, group), {"return_A": False}) == 4 * 513 * 32 * 4
