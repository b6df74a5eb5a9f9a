"""Per-rank captures on fake tensors (graphmem/distributed/): what each rank holds follows FSDP2's
own sharding rule, the collectives' buffers are their own category, and mistakes are one line.
(The real-run ground truth is tests/distributed/test_distributed.py.)"""
from __future__ import annotations

import math

import pytest
import torch

import graphmem
from graphmem.cli.main import main
from graphmem.passes.timeline import category_timeline
from tests.dist_truth import case


def _fsdp2_shard_bytes(model: torch.nn.Module, world: int) -> int:
    """FSDP2 keeps rank r's chunk of dim 0 of each parameter, padded to ceil(d0 / world) rows
    (torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _init_sharded_param)."""
    return sum(math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()
               for p in model.parameters())


@pytest.mark.parametrize("name", ["chain", "llama_gqa"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_each_rank_holds_its_padded_shards(name: str, world: int) -> None:
    model, batch = case(name)
    for rank in (0, world - 1):
        r = graphmem.analyze(model, batch, world_size=world, rank=rank, fsdp="fully_shard")
        assert r.parameter_bytes == _fsdp2_shard_bytes(model, world)
        assert r.gradient_bytes == r.parameter_bytes  # the reduce-scatter outputs, one per unit
        tl = category_timeline(r.step, r.liveness, r.saved)
        assert max(tl.by_category["communication"]) > 0
        assert r.sharding.communication_max == max(tl.by_category["communication"])


def test_reshard_after_forward_frees_gathered_blocks_and_the_formula_is_beside_it() -> None:
    model, batch = case("llama_gqa")
    kept = graphmem.analyze(model, batch, world_size=4, rank=0, fsdp="fully_shard", reshard_after_forward=False)
    freed = graphmem.analyze(model, batch, world_size=4, rank=0, fsdp="fully_shard")
    assert freed.activation_bytes == kept.activation_bytes  # the same saved activations
    gathered = lambda r: max(category_timeline(r.step, r.liveness, r.saved).by_category["communication"])  # noqa: E731
    assert gathered(kept) > gathered(freed)  # every block's gathered parameters held until backward
    assert kept.sharding.formula.fsdp == "grad-op" and freed.sharding.formula.fsdp == "full"
    assert freed.sharding.gap == freed.peak_bytes - freed.sharding.formula_peak
    assert any(n.startswith("formula cross-check") for n in freed.notes)


@pytest.mark.slow
def test_world_1024() -> None:
    model, batch = case("chain")  # FSDP2 pads each 64-row weight to 1024 rows: 960 empty chunks per parameter
    r = graphmem.analyze(model, batch, world_size=1024, rank=1023, fsdp="fully_shard")
    assert r.parameter_bytes == _fsdp2_shard_bytes(model, 1024)


def test_cli_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "models/mlp.py", "--input-shape", "4x784", "--world-size", "4", "--rank", "2",
                 "--fsdp", "--no-reshard-after-forward"]) == 0
    out = capsys.readouterr().out
    assert "rank 2 of 4 (fully_shard over 4, reshard_after_forward=False)" in out
    assert out.splitlines()[0].endswith("· rank 2 of 4 (fully_shard over 4, reshard_after_forward=False): one training step")


@pytest.mark.parametrize("args,phrase", [
    (["--world-size", "4", "--rank", "4", "--fsdp"], "use 0 to 3"),
    (["--world-size", "4", "--fsdp", "--zero", "3"], "give one or the other"),
    (["--world-size", "4", "--fsdp-param-dtype", "bf16"], "add --fsdp"),
    (["--world-size", "4", "--fsdp", "--optimizer", "momentum", "--optimizer-impl", "fused"], "use --optimizer-impl foreach"),
    (["--world-size", "4", "--fsdp", "--optimizer", "adafactor"], "use --optimizer adamw"),
    (["--world-size", "4", "--fsdp", "--optimizer", "adam", "--master-weights", "--dtype", "bf16"], "--fsdp-param-dtype bf16"),
    (["--world-size", "1", "--fsdp"], "raise --world-size"),
    (["--world-size", "4", "--tp", "2", "--rank", "1"], "add --fsdp to shard over them"),
    (["--world-size", "2", "--rank", "1", "--fsdp", "--plan", "--budget", "1GiB"], "analyze without --rank"),
    (["--world-size", "2", "--rank", "1", "--fsdp", "--formula"], "analyze without --rank"),
    (["--world-size", "4", "--fsdp", "--fsdp-no-sync"], "add --micro-batches 2"),
    (["--world-size", "4", "--micro-batches", "2", "--fsdp-no-sync"], "add --fsdp"),
    (["--world-size", "4", "--fsdp", "--qlora", "--lora-rank", "4", "--lora-targets", "all-linear"], "drop --qlora"),
    (["--world-size", "0", "--rank", "0", "--fsdp"], "--world-size must be a positive integer, got 0"),
])
def test_per_rank_mistakes_are_one_line(args: list[str], phrase: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "models/mlp.py", "--input-shape", "4x784", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err


def test_sharding_mistakes_name_the_api_options() -> None:
    """The library names its options (graphmem/cli/flags.py turns them into flags on the command line)."""
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(graphmem.UsageError, match="^`world_size` must be a positive integer, got 0$"):
        graphmem.analyze(mlp, (torch.randn(2, 8),), world_size=0, rank=0, fsdp="fully_shard")
    with pytest.raises(graphmem.UsageError, match="^unknown `fsdp_param_dtype` 'fp8': use one of"):
        graphmem.analyze(mlp, (torch.randn(2, 8),), world_size=2, rank=0, fsdp="fully_shard", fsdp_param_dtype="fp8")


@pytest.mark.parametrize("name", ["chain", "llama_gqa"])
def test_zero3_formula_rows_cross_check(name: str) -> None:
    """ZeRO-3 / FSDP full (passes/budget.py over the single-device step): parameters and gradients
    divided by N. Every first dimension of these models divides by 2, so FSDP2 pads nothing and the
    real wrappers' shards are the formula's rows to the byte; the peak differs by what the report says."""
    from graphmem.passes import liveness, saved
    from graphmem.passes.budget import Parallel, budget
    from graphmem.training.spec import units_of

    model, batch = case(name)
    r = graphmem.analyze(model, batch, world_size=2, rank=0, fsdp="fully_shard")
    single = graphmem.analyze(model, batch).step
    assert single is not None
    formula = budget(single, liveness(single), saved(single), Parallel(2, 0, "full"), units_of(model))
    assert r.parameter_bytes == formula.row("parameters").size
    assert r.gradient_bytes == formula.row("gradients").size
    assert r.sharding.formula_peak == formula.peak_bytes and r.sharding.gap == r.peak_bytes - formula.peak_bytes


@pytest.mark.parametrize("name", ["chain", "llama_gqa"])
def test_rank_optimizer_states_are_the_zero3_formulas_row(name: str) -> None:
    """torch.optim's AdamW over FSDP2's DTensor parameters: rank r's states are local shards. At 2
    ranks FSDP2 pads nothing on these models, so each rank's exp_avg + exp_avg_sq + step counters
    equal the ZeRO-3 formula's optimizer row (passes/budget.py: states / N, counters replicated) to
    the byte; the later steps' peak holds them from the start."""
    from graphmem.passes import liveness, saved
    from graphmem.passes.budget import Parallel, budget
    from graphmem.training.spec import units_of

    model, batch = case(name)
    single = graphmem.analyze(model, batch, optimizer="adamw").step
    assert single is not None
    formula = budget(single, liveness(single), saved(single), Parallel(2, 0, "full"), units_of(model))
    for rank in (0, 1):
        r = graphmem.analyze(model, batch, world_size=2, rank=rank, fsdp="fully_shard", optimizer="adamw")
        b = r.budget.rank
        assert b.row("optimizer states").size == formula.row("optimizer states").size > 0
        assert (r.sharding.later_peak, r.sharding.formula_later) == (b.later_peak_bytes, formula.later_peak_bytes)
        assert any("later steps (optimizer states from the start): formula" in n for n in r.notes)
        assert b.states_by_name == formula.states_by_name
        assert b.row("parameters").size * 2 + b.step_counter_bytes == b.row("optimizer states").size
        assert b.later_peak_bytes >= b.peak_bytes and b.trainable == b.parameters


def _chunk_rows(d0: int, world: int, rank: int) -> int:
    """Rows of rank's unpadded chunk: torch.chunk along dim 0, as FSDP2 splits (_fsdp_param.py)."""
    chunks = torch.chunk(torch.empty(d0), world)
    return chunks[rank].numel() if rank < len(chunks) else 0


def test_rank_optimizer_states_follow_fsdp2_chunks_at_3_ranks() -> None:
    """At 3 ranks FSDP2 pads dim 0 of each parameter to a multiple of 3 (the parameters' storage),
    but an optimizer state is ``zeros_like`` of the unpadded local chunk (torch.chunk's rows): the
    ranks' states add up to the single device's, the last rank holding less than the padded
    formula's ceil(states / 3)."""
    model, batch = case("chain")
    single = graphmem.analyze(model, batch, optimizer="adam").budget.rank
    counters = single.step_counter_bytes
    per_rank = []
    for rank in range(3):
        b = graphmem.analyze(model, batch, world_size=3, rank=rank, fsdp="fully_shard", optimizer="adam").budget.rank
        rows = sum(_chunk_rows(p.shape[0], 3, rank) * (p.numel() // p.shape[0]) for p in model.parameters())
        assert b.row("optimizer states").size - counters == 2 * 4 * rows  # exp_avg + exp_avg_sq, fp32
        per_rank.append(b.row("optimizer states").size - counters)
    assert sum(per_rank) == single.row("optimizer states").size - counters
    assert per_rank[-1] < per_rank[0]


@pytest.mark.parametrize("name,targets", [("llama_gqa", "q_proj,v_proj"), ("chain", "up")])
def test_rank_lora_holds_half_the_adapters_and_their_states(name: str, targets: str) -> None:
    """LoRA then fully_shard (peft's get_peft_model on an HF model, graphmem's adapters on a torch.nn
    one): only the adapters get gradients and AdamW states, rank r holding its half of each; the
    frozen base weights are sharded too, and no gradient is reduce-scattered for them."""
    from graphmem.passes import liveness, saved
    from graphmem.passes.budget import Parallel, budget
    from graphmem.training.spec import units_of

    model, batch = case(name)
    one = graphmem.analyze(model, batch, optimizer="adamw", lora_rank=4, lora_targets=targets)
    single = one.budget.rank
    assert one.step is not None and 0 < single.trainable < single.parameters
    formula = budget(one.step, liveness(one.step), saved(one.step), Parallel(2, 0, "full"), units_of(model))
    for rank in (0, 1):
        r = graphmem.analyze(model, batch, world_size=2, rank=rank, fsdp="fully_shard", optimizer="adamw",
                             lora_rank=4, lora_targets=targets)
        b = r.budget.rank
        assert b.trainable * 2 == single.trainable and b.parameters * 2 == single.parameters
        assert b.row("optimizer states").size == formula.row("optimizer states").size
        assert b.row("gradients").size == r.gradient_bytes == single.row("gradients").size // 2
        assert len(r.budget.lora_layers) == len(one.budget.lora_layers) > 0


def test_no_sync_holds_the_unsharded_gradients_between_micro_batches() -> None:
    """--fsdp-no-sync (set_requires_gradient_sync(False) before all micro-batches but the last): every
    rank keeps the whole fp32 gradient from the first micro-batch to the last one's reduce-scatter,
    named in the gradients row beside the sharded ones; three micro-steps are traced (the first makes
    them, a middle one adds, the last reduce-scatters)."""
    model, batch = case("chain")
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    each = graphmem.analyze(model, batch, world_size=2, rank=0, fsdp="fully_shard", optimizer="adamw", micro_batches=4)
    last = graphmem.analyze(model, batch, world_size=2, rank=0, fsdp="fully_shard", optimizer="adamw", micro_batches=4,
                            fsdp_no_sync=True)
    assert each.budget.rank.row("gradients").size == whole // 2  # the reduce-scattered shards
    assert last.budget.rank.row("gradients").size == whole // 2 + whole
    assert (len(each.step.micro_steps), len(last.step.micro_steps)) == (2, 3)
    assert last.peak_bytes > each.peak_bytes and last.budget.rank.later_peak_bytes > each.budget.rank.later_peak_bytes
    assert each.activation_bytes == last.activation_bytes
