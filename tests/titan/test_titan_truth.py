"""torchtitan jobs, real against predicted: torchtitan's own Trainer and train_step on shrunk
llama3 debug models, one gloo process per rank (tests/titan_truth.py), beside graphmem's analysis
of the same prepared job on fake tensors (graphmem/titan/), rank by rank.

Tolerances, measured: saved bytes and the bytes before the step are exact. Peaks within 1 %, both
ways: with every collective settled and gloo's own clones freed where the collective was settled
(tests/titan_truth.py ``_events``), the first peaks agree to the byte on FSDP2, TP, FSDP x TP and
expert parallel (16 B on EP), and so do the later peaks (the least of three steps; 16 B on EP),
which read 1,536 B under graphmem's (0.05-0.09 %) until the truth counted the previous step's last
batch, live into the step (tests/titan_truth.py ``_unheld_before``). Pipelines' later peaks are
exact (1F1B, Interleaved1F1B, GPipe, FSDP x PP, TP x PP, every stage rank; ``_as_pipelined``). They
read up to 0.7 % over graphmem's (Interleaved1F1B's rank 0 +13,560 B) until graphmem's p2p works
held what they send to the step's end, as gloo's do (torch's PipelineScheduleMulti keeps every
send's works until its step returns: at that rank's peak, stage 2's backward of micro-batch 1, its
output and its input's gradient of micro-batch 0, 8,192 B each, are still held), and 520 B under on
every pipeline rank until the truth counted that batch (one micro-batch). Bounded below only: a
compiled job's first peak (Inductor and dynamo compile inside it) and a pipeline's first peak (see
test_pp)."""
from __future__ import annotations

import pytest

import graphmem
from tests.titan_truth import model_bytes, real_titan, small_llama3, small_qwen3_moe

pytestmark = pytest.mark.slow


def _predicted(config_fn, world: int, overrides: dict, rank: int):
    """graphmem's report of rank ``rank`` of the same job the real run ran (overrides set alike)."""
    config = config_fn()
    for path, value in overrides.items():
        *parents, name = path.split(".")
        target = config
        for p in parents:
            target = getattr(target, p)
        setattr(target, name, value)
    return graphmem.analyze(config, world_size=world, rank=rank, device="cpu")


def _as_predicted(config_fn, world: int, overrides: dict, ranks: list[dict[str, int]],
                  compiles: bool = False) -> None:
    """``compiles``: the real first step also compiles (Inductor's compilation runs inside it and
    allocates, more under load: +262 KB once on a loaded machine), so its peak is only bounded below."""
    for rank, real in enumerate(ranks):
        report = _predicted(config_fn, world, overrides, rank)
        assert report.activation_bytes == real["saved_bytes"], rank
        assert report.parameter_bytes + report.buffer_bytes == real["before_bytes"], rank
        for predicted, measured in ((report.budget.rank.later_peak_bytes, real["later_peak_bytes"]),
                                    (report.peak_bytes, real["peak_bytes"])):
            over = float("inf") if compiles and predicted == report.peak_bytes else 0.01 * predicted
            assert -0.01 * predicted <= measured - predicted <= over, (rank, predicted, real)


def _consistent(ranks: list[dict[str, int]]) -> None:
    for r in ranks:
        assert r["saved_bytes"] > 0
        assert r["peak_bytes"] > r["before_bytes"] > 0
        # after the first step the gradients and Adam's two states live between steps
        assert r["later_before_bytes"] > r["before_bytes"]
        assert r["later_peak_bytes"] > r["later_before_bytes"]
        assert r["unsettled"] == 0, r  # every collective's work was released on the rank's thread


@pytest.mark.parametrize("degree", [2, pytest.param(4, marks=pytest.mark.heavy)])  # heavy: 4 ranks, ~70 s
def test_fsdp(degree: int) -> None:
    overrides = {"parallelism.data_parallel_shard_degree": degree}
    ranks = real_titan(small_llama3, degree, overrides)
    _consistent(ranks)
    _as_predicted(small_llama3, degree, overrides, ranks)
    assert all(r["saved_bytes"] == r["later_saved_bytes"] for r in ranks)
    params, buffers, count = model_bytes()
    for r in ranks:  # rank r holds 1/degree of every parameter (all dims divide) and the whole buffers
        assert r["before_bytes"] == params // degree + buffers
        # later also the shards' gradients, Adam's exp_avg and exp_avg_sq, and a float32 step per parameter
        assert r["later_before_bytes"] == r["before_bytes"] + 3 * (params // degree) + 4 * count
    assert len({r["saved_bytes"] for r in ranks}) == 1  # data parallel ranks run the same shapes


def test_fsdp_selective_ac() -> None:
    """torchtitan's SelectiveAC (the debug and 8B configs' default): the outputs its policy keeps
    (every other ``aten.mm``, SDPA's outputs) live in checkpoint's own cache from forward to
    backward, counted as saved on both sides (graphmem/capture/sac.py; the truth's hooks see that
    cache through ``through_hooks``), exact; the peaks within 1 % as without checkpointing."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    plain = {"parallelism.data_parallel_shard_degree": 2}
    overrides = {**plain, "activation_checkpoint": SelectiveAC.Config()}
    ranks = real_titan(small_llama3, 2, overrides)
    _consistent(ranks)
    _as_predicted(small_llama3, 2, overrides, ranks)
    report = _predicted(small_llama3, 2, overrides, 0)
    kept = [t for t in report.saved if t.op == "aten.mm.default"]
    assert kept and all(t.category == "activation" for t in kept)  # SAC's mm outputs: activations, not temporaries


@pytest.mark.parametrize("backend", [pytest.param("aot_eager", marks=pytest.mark.heavy), "inductor"])  # heavy: ~1 min
def test_compiled_blocks(backend: str) -> None:
    """Each transformer block compiled by torchtitan (``compile.enable``, components ``model``)
    under FSDP2: graphmem compiles the blocks with its own backend (AOTAutograd's min-cut
    partition, graphmem/titan/compiled.py) whatever the job names; the real run compiles with
    the job's backend, Inductor's C++ code on this CPU included. Saved 1,203,496 B against
    eager's 1,531,176 on both, exact."""
    overrides = {"parallelism.data_parallel_shard_degree": 2, "compile.enable": True, "compile.components": ["model"],
                 "compile.backend": backend}
    ranks = real_titan(small_llama3, 2, overrides)
    _consistent(ranks)
    _as_predicted(small_llama3, 2, overrides, ranks, compiles=True)
    eager = _predicted(small_llama3, 2, {"parallelism.data_parallel_shard_degree": 2}, 0)
    assert ranks[0]["saved_bytes"] < eager.activation_bytes


@pytest.mark.heavy  # (CI time, ~50 s) tensor parallel runs in CI inside test_fsdp_tp and test_tp_pp
def test_tp() -> None:
    overrides = {"parallelism.tensor_parallel_degree": 2}
    ranks = real_titan(small_llama3, 2, overrides)
    _consistent(ranks)
    # torchtitan shards over a one-rank FSDP mesh here too: FSDP2 then copies each shard into
    # unsharded parameters it makes at full size (no all-gather), which are parameters, not saves
    _as_predicted(small_llama3, 2, overrides, ranks)
    params, buffers, _ = model_bytes()
    for r in ranks:  # the linear weights split in two, the norms' weights replicated
        assert params // 2 + buffers < r["before_bytes"] < params + buffers
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert len({r[key] for r in ranks}) == 1, key  # tensor parallel ranks hold the same shapes


def test_fsdp_tp() -> None:
    overrides = {"parallelism.data_parallel_shard_degree": 2, "parallelism.tensor_parallel_degree": 2}
    ranks = real_titan(small_llama3, 4, overrides)
    _consistent(ranks)
    _as_predicted(small_llama3, 4, overrides, ranks)
    params, buffers, _ = model_bytes()
    for r in ranks:  # FSDP halves what tensor parallel leaves on a rank
        assert params // 4 + buffers < r["before_bytes"] < params // 2 + buffers
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert len({r[key] for r in ranks}) == 1, key


# heavy (CI time, ~50 s): GPipe; CI runs 1F1B and the interleaved schedule (two stages per rank)
@pytest.mark.parametrize("schedule", ["1F1B", "Interleaved1F1B", pytest.param("GPipe", marks=pytest.mark.heavy)])
def test_pp(schedule: str) -> None:
    """Each stage rank's step with torch's pipeline schedules, as torchtitan builds them. A first
    step also runs torch's metadata inference, each stage's forward and backward once more
    (torch/distributed/pipelining/stage.py ``_forward_metadata_inference``); graphmem runs it too,
    as the first step's own ops (graphmem/titan/pipeline.py), whose saves are not activations, so
    its saved bytes are the later steps'. Stage 0 has no inputs that need grad, so its inference
    runs no backward and its graph dies at the cleanup; under the truth's saved-tensor hook, which
    returns each saved output itself, that graph holds itself through C++ and lives on, so the real
    first peak of a stage-0 rank can read higher than the run without hooks graphmem predicts."""
    overrides = {"parallelism.pipeline_parallel_degree": 2, "parallelism.pipeline_parallel_schedule": schedule}
    ranks = real_titan(small_llama3, 2, overrides)
    _consistent(ranks)
    params, buffers, _ = model_bytes()
    # the stages split the model: every parameter and buffer is on exactly one rank
    assert sum(r["before_bytes"] for r in ranks) == params + buffers
    _as_pipelined(overrides, ranks)


def test_fsdp_pp() -> None:
    """FSDP2 within each of two stages (4 ranks); stage ranks 0 and 2 (their FSDP peers hold the same shapes)."""
    overrides = {"parallelism.pipeline_parallel_degree": 2, "parallelism.data_parallel_shard_degree": 2}
    ranks = real_titan(small_llama3, 4, overrides)
    _consistent(ranks)
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert ranks[0][key] == ranks[1][key] and ranks[2][key] == ranks[3][key], key
    _as_pipelined(overrides, ranks, (0, 2))


@pytest.mark.parametrize("backend", [pytest.param("spmd_types", marks=pytest.mark.heavy), "full_dtensor"])  # heavy: ~2 min
def test_tp_pp(backend: str) -> None:
    """Tensor parallel inside each of two stages (4 ranks), under torchtitan's default SPMD backend
    (``spmd_types``, whose FSDP storage mesh is sliced while the job is built: graphmem/titan/
    capture.py ``_InitReads``) and under ``full_dtensor``. The real job holds the same bytes under
    both (saved 387,328 / 469,144 B on the two stages' ranks, and the same bytes before the step)."""
    overrides = {"parallelism.pipeline_parallel_degree": 2, "parallelism.tensor_parallel_degree": 2,
                 "parallelism.spmd_backend": backend}
    ranks = real_titan(small_llama3, 4, overrides)
    _consistent(ranks)
    for key in ("saved_bytes", "later_saved_bytes", "before_bytes", "later_before_bytes"):
        assert ranks[0][key] == ranks[1][key] and ranks[2][key] == ranks[3][key], key
    _as_pipelined(overrides, ranks, (0, 2))


def _as_pipelined(overrides: dict, ranks: list[dict[str, int]], which: tuple[int, ...] = (0, 1)) -> None:
    for rank in which:
        real = ranks[rank]
        report = _predicted(small_llama3, len(ranks), overrides, rank)
        assert report.activation_bytes == real["later_saved_bytes"] < real["saved_bytes"], rank
        assert report.parameter_bytes + report.buffer_bytes == real["before_bytes"], rank
        # exact: the send works hold what they sent to the step's end (graphmem/titan/capture.py)
        assert real["later_peak_bytes"] == report.budget.rank.later_peak_bytes, (rank, report.budget.rank, real)
        assert real["peak_bytes"] >= report.peak_bytes, (rank, report.peak_bytes, real)


def test_ep() -> None:
    """Expert parallel over the FSDP ranks (torchtitan's qwen3 MoE debug model, shrunk): the
    experts split by expert parallel, everything else by FSDP, so each rank holds half of it all.
    Routing is torchtitan's balanced round-robin on both sides (graphmem/titan/moe.py)."""
    overrides = {"parallelism.data_parallel_shard_degree": 2, "parallelism.expert_parallel_degree": 2}
    ranks = real_titan(small_qwen3_moe, 2, overrides)
    _consistent(ranks)
    _as_predicted(small_qwen3_moe, 2, overrides, ranks)
    params, buffers, count = model_bytes(small_qwen3_moe)
    for r in ranks:
        assert r["before_bytes"] == params // 2 + buffers
        assert r["later_before_bytes"] == r["before_bytes"] + 3 * (params // 2) + 4 * count
        assert r["saved_bytes"] == r["later_saved_bytes"]
