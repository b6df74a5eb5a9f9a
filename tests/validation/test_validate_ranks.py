"""`graphmem validate` / `graphmem.validate` per rank: the step graphmem's per-rank analysis records through
fully_shard (FSDP2) or parallelize_module (tensor + sequence parallel), run for real in 2 gloo CPU processes
(graphmem/validation/ranks.py), each rank wrapped by the same call as the analysis
(graphmem/distributed/wrappers.py apply_wrappers).

GIVEN graphmem's bundled GPT-2 as a model file (FSDP2 with 3 micro-batches synced on the last, foreach AdamW: a
first and a later step), transformers' Llama (tests/zoo.py, FSDP2, rank 1 alone) and GPT-2 (FSDP2 without
resharding after forward), or the bundled Llama as a model file (TP 2 + SP)
WHEN validate runs the ranks for real
THEN every rank's saved-for-backward, before-step and optimizer-state bytes equal graphmem.analyze(...,
rank=r)'s to the byte, and each peak is within validate's tolerance (1 % of the measured peak, never
below it: the per-rank gaps the gloo truth tests bound, tests/distributed/test_distributed.py SINGLE_GAP and
tests/distributed/test_distributed_step.py OPTIMIZER_GAP, are 0 to 96 B on these models, far inside it);
and a per-rank setting validate does not run for real is refused in one line that names it.
Every rank runs with one thread (the one_thread fixture: the prediction's thread count is passed on).
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch import nn

from graphmem import cli
from graphmem.errors import UsageError
from graphmem.validation.result import DEFAULT_TOLERANCE, Validation
from graphmem.validation.validate import validate
from tests.validation.test_validate import model_file, run_cli
from tests.zoo import build

pytestmark = pytest.mark.usefixtures("one_thread")
EXACT = ("saved for backward", "before the step", "optimizer states")


def _each_rank_is_real(rows: list[dict[str, Any]], ranks: list[int], tolerance: float = DEFAULT_TOLERANCE) -> None:
    assert sorted({r["rank"] for r in rows}) == ranks
    for r in rows:
        gap = r["measured"] - r["predicted"]
        if r["name"] in EXACT:
            assert gap == 0, r
        else:  # a peak: never above the real one, below it by at most the tolerance
            assert 0 <= gap <= tolerance / 100 * r["measured"], r
        assert r["ok"] is True, r
    assert {r["name"] for r in rows if r["rank"] == ranks[0]} >= {"saved for backward", "before the step", "peak"}


def _rows(v: Validation) -> list[dict[str, Any]]:
    return v.to_dict()["rows"]  # type: ignore[no-any-return]


@pytest.mark.slow
def test_cli_validates_the_bundled_gpt2_per_rank_with_fsdp2_and_no_sync(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--fsdp",
                                     "--world-size", "2", "--optimizer", "adamw", "--optimizer-impl", "foreach",
                                     "--micro-batches", "3", "--fsdp-no-sync", "--json"])
    assert code == 0, err
    doc = json.loads(out)["validation"]
    assert doc["ok"] and doc["device"] == "cpu"
    _each_rank_is_real(doc["rows"], [0, 1])
    rows = {(r["rank"], r["name"]): r for r in doc["rows"]}
    # 3 micro-batches, reduce-scattered after the last only (set_requires_gradient_sync); the later step (AdamW's
    # states from its start) is measured on every rank, and each holds its own shards' states
    assert rows[(0, "optimizer states")]["measured"] > 0 and (1, "peak (later steps)") in rows


@pytest.mark.slow
def test_cli_table_names_each_rank(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--fsdp",
                                   "--world-size", "2", "--rank", "1"])
    assert code == 0
    assert "2 gloo processes: fully_shard over 2" in out.splitlines()[0]
    ranked = [line.split()[0] for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert ranked == ["1", "1", "1"]  # rank 1's saved, before-step and peak rows alone


@pytest.mark.slow
def test_transformers_llama_rank_1_under_fsdp2() -> None:
    model, batch = build("llama_gqa")  # transformers' LlamaForCausalLM, grouped-query attention, 4 layers
    v = validate(model, batch, world_size=2, fsdp="fully_shard", rank=1)
    assert v.ok, v.reason
    _each_rank_is_real(_rows(v), [1])
    assert v.row("saved for backward", rank=1).difference == 0 and v.row("saved for backward").measured > 0


@pytest.mark.slow
def test_transformers_gpt2_ranks_count_their_gelu_scalars() -> None:
    model, batch = build("gpt2_sdpa")  # transformers' GPT2LMHeadModel, tied embeddings
    v = validate(model, batch, world_size=2, fsdp="fully_shard", reshard_after_forward=False)
    assert v.ok, v.reason
    _each_rank_is_real(_rows(v), [0, 1])
    # exact on every rank: the 96 B it kept before were NewGELUActivation's Python-float scalars (4 blocks x 3 x
    # 8 B), which the capture counts now (graphmem/capture/wrapped_numbers.py)
    assert all(v.row("peak", rank=r).difference == 0 for r in (0, 1))


@pytest.mark.slow
def test_bundled_llama_tensor_and_sequence_parallel() -> None:
    v = validate(model_file("tiny_llama"), input_shape=(2, 16), world_size=2, tp=2, sp=True)
    assert v.ok, v.reason
    _each_rank_is_real(_rows(v), [0, 1])


@pytest.mark.parametrize("options, named", [
    ({"world_size": 2, "zero": 3}, "`zero`"),
    ({"world_size": 2, "fsdp": "full"}, "`fsdp='full'`"),
    ({"world_size": 2, "fsdp": "fully_shard", "fsdp_offload": True}, "`fsdp_offload`"),
    ({"pp": 2}, "`pp`"),
    ({"world_size": 2}, "nothing splits the step"),
])
def test_unsupported_per_rank_settings_are_one_line(options: dict[str, Any], named: str) -> None:
    with pytest.raises(UsageError) as e:
        validate(nn.Linear(4, 4), (torch.randn(2, 4),), **options)
    assert named in str(e.value) and "\n" not in str(e.value)


def test_per_rank_runs_on_the_cpu_only() -> None:
    from graphmem.validation.validate import _ranks  # (validate itself refuses cuda first on a machine without one)

    with pytest.raises(UsageError, match="CPU processes over gloo"):
        _ranks(nn.Linear(4, 4), None, (2, 4), None, torch.device("cuda"), 1.0, None,
               {"world_size": 2, "fsdp": "fully_shard"})


def test_cli_refuses_the_zero_formula_in_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    code = cli.main(["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--world-size", "2", "--zero", "3"])
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and out == "" and len(lines) == 1 and "not --zero" in lines[0]  # (the CLI names its flags)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])


def test_a_job_over_the_memory_budget_is_refused_before_any_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    import graphmem.validation.ranks as ranks

    monkeypatch.setattr(ranks, "available_memory", lambda: 1000)
    monkeypatch.setattr(ranks, "run_ranks", lambda job, world: pytest.fail("a rank started"))
    with pytest.raises(UsageError, match="a real step on 2 ranks needs about .* over the safety budget"):
        validate(_net(), (torch.randn(4, 16),), world_size=2, fsdp="fully_shard")


def test_a_loss_the_ranks_cannot_unpickle_is_refused_in_one_line() -> None:
    with pytest.raises(UsageError, match="`loss` pickled, and it is not picklable") as e:
        validate(_net(), (torch.randn(4, 16),), loss=lambda out, batch: out.sum(), world_size=2, fsdp="fully_shard")
    assert "\n" not in str(e.value)
