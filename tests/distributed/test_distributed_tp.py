"""Tensor parallel on fake tensors (graphmem/distributed/tensor_parallel.py, tensor_parallel_hf.py):
each rank holds Megatron's split of every weight, runs its own heads, and mistakes are one line.
(The real gloo ground truth is tests/distributed/test_distributed.py.)

GIVEN a Hugging Face decoder split by transformers' own TP plan (apply_tensor_parallelism), or the
bundled GPT-2 with its fused c_attn
WHEN graphmem captures rank r under the fake process group
THEN rank r's parameters have the shapes Megatron's split gives (written out here from the config),
the same as the real model's local shards after the plan written out as a user applies it
(tests/dist_plans.py), and its attention runs H/T heads.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import graphmem
from graphmem.cli.main import main
from graphmem.distributed.process_group import fake_process_group
from tests.dist_plans import tensor_parallel
from tests.dist_truth import case


def _rank_shapes(report: graphmem.Report) -> dict[str, tuple[int, ...]]:
    assert report.step is not None
    return {p.target: p.meta["shape"] for p in report.step.placeholders if p.meta["kind"] == "parameter"}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _real_local_shapes(model: nn.Module, name: str, world: int, rank: int, tp: int,
                       batch: tuple = ()) -> dict[str, tuple[int, ...]]:
    """The real model's local shards after the model's plan written out as a user applies it
    (tests/dist_plans.py: transformers' engine, not graphmem's code; real tensors, fake process group);
    with a batch, its gradients' local sizes after a real step ("grad " + name: (numel,))."""
    with fake_process_group(rank, world, tp, fsdp=False) as meshes:
        assert meshes.tp is not None
        tensor_parallel(model, name, meshes.tp, sp=False, loss_parallel=False)
        shapes = {n: tuple(_local(p).shape) for n, p in model.named_parameters()}
        if batch:
            model(*batch, labels=batch[0]).loss.backward()
            shapes.update({f"grad {n}": (_local(p.grad).numel(),) for n, p in model.named_parameters()})
        return shapes


def _gradient_shapes(report: graphmem.Report) -> dict[str, tuple[int, ...]]:
    g = report.step
    assert g is not None
    # a gradient's storage has the shape of the op that made it ((1, 1, d) for a norm's sum): compare sizes
    return {f"grad {g.storages[g.storages[sid].owner].name}": (math.prod(g.storages[sid].shape),)  # type: ignore[index]
            for sid in g.gradients}


def _megatron(name: str, config: object, tp: int) -> tuple[int, ...]:
    """Megatron-LM's split of a Llama-family decoder's weight ``name`` over ``tp`` ranks: q/k/v and
    gate/up by output rows, o/down by input columns, embedding and head by vocabulary rows."""
    d, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size  # type: ignore[attr-defined]
    hd = d // config.num_attention_heads  # type: ignore[attr-defined]
    q, kv = config.num_attention_heads * hd // tp, config.num_key_value_heads * hd // tp  # type: ignore[attr-defined]
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": ffn // tp, "up_proj": ffn // tp}
    module, kind = name.split(".")[-2:]
    if module in rows:
        return (rows[module], d) if kind == "weight" else (rows[module],)
    if module in ("o_proj", "down_proj"):
        return (d, q if module == "o_proj" else ffn // tp)
    if module in ("embed_tokens", "lm_head"):
        return (vocab // tp, d)
    return (d,)  # RMSNorm weights are replicated


@pytest.mark.parametrize("name,world,tp", [("llama_gqa", 2, 2), ("qwen2", 2, 2), ("qwen2_gqa8", 4, 4)])
def test_hf_rank_holds_megatron_shards(name: str, world: int, tp: int) -> None:
    for rank in (0, world - 1):
        model, batch = case(name)
        report = graphmem.analyze(model, batch, world_size=world, rank=rank, tp=tp)
        shapes = _rank_shapes(report)
        assert shapes == {n: _megatron(n, model.config, tp) for n, _ in model.named_parameters()}
        assert {**shapes, **_gradient_shapes(report)} == _real_local_shapes(model, name, world, rank, tp, batch)
        assert report.parameter_bytes == sum(4 * torch.Size(s).numel() for s in shapes.values())
        # DTensor's embedding backward hands the vocabulary-sharded embedding a Replicate gradient: the
        # full (vocab, d) on every rank (torch 2.14), as the real step above does; tied to the head, the
        # sum with the head's Shard(0) gradient is the shard
        vocab, d = model.config.vocab_size, model.config.hidden_size
        tied = model.lm_head.weight is model.model.embed_tokens.weight
        assert _gradient_shapes(report)["grad model.embed_tokens.weight"] == (vocab * d // (tp if tied else 1),)
        assert report.sharding.full_gradients == (() if tied else (("model.embed_tokens.weight", vocab * d * 4,
                                                                     vocab * d * 4 // tp),))  # a note says so


def test_gpt2_fused_c_attn_keeps_each_ranks_q_k_v_heads() -> None:
    from torch.distributed.tensor import distribute_tensor

    tp, d = 2, 64
    for rank in range(tp):
        model, batch = case("gpt2_bundled")
        full = model.transformer.h[0].attn.c_attn.weight.detach().clone()  # (3d, d): [q; k; v]
        report = graphmem.analyze(model, batch, world_size=tp, rank=rank, tp=tp)
        shapes = _rank_shapes(report)
        assert shapes["transformer.h.0.attn.c_attn.weight"] == (3 * d // tp, d)
        assert shapes["transformer.h.0.attn.c_proj.weight"] == (d, d // tp)
        assert shapes["transformer.wte.weight"] == (128 // tp, d) and "lm_head.weight" not in shapes  # still tied
        with fake_process_group(rank, tp, tp, fsdp=False) as meshes:
            assert meshes.tp is not None
            tensor_parallel(model, "gpt2_bundled", meshes.tp, sp=False, loss_parallel=False)  # written out by the test
            assert shapes == {n: tuple(_local(p).shape) for n, p in model.named_parameters()}
            assert model.transformer.wte.weight is model.lm_head.weight
            # the plan's placement gives rank r its chunk of q, of k and of v, in that order (Megatron's split;
            # the fake backend moves no data, so the chunk is taken locally as from a real scatter)
            placements = model.transformer.h[0].attn.c_attn.weight.placements
            shard = distribute_tensor(full, meshes.tp, placements, src_data_rank=None).to_local()
            assert torch.equal(shard, torch.cat([part.chunk(tp)[rank] for part in full.split(d)]))
        # the attention runs this rank's 4 / tp heads: q, k, v viewed as (b, s, heads, hd)
        assert report.step is not None
        views = {o.meta["shape"] for o in report.step.ops
                 if o.meta.get("module") == "transformer.h.0.attn" and str(o.target) == "aten.view.default"}
        assert (2, 32, 4 // tp, d // 4) in views and (2, 32, 4, d // 4) not in views


def test_gpt2_sequence_parallel_splits_the_residual_stream() -> None:
    """With --sp the blocks' norms and residual stream hold s/T positions; attention and MLP see all s."""
    tp = 2
    model, batch = case("gpt2_bundled")
    report = graphmem.analyze(model, batch, world_size=tp, rank=1, tp=tp, sp=True)
    assert report.step is not None
    inputs = report.step.module_inputs
    assert inputs["transformer.h.1.ln_1"] == inputs["transformer.ln_f"] == (2, 32 // tp, 64)
    assert inputs["transformer.h.1.attn.c_attn"] == (2, 32, 64)  # all-gathered before the column-parallel linear
    plain = graphmem.analyze(*case("gpt2_bundled"), world_size=tp, rank=1, tp=tp)
    assert plain.step is not None and plain.step.module_inputs["transformer.h.1.ln_1"] == (2, 32, 64)
    assert report.activation_bytes < plain.activation_bytes


def test_fsdp_x_tp_ranks_one_after_another() -> None:
    """Ranks of different tensor-parallel groups analyzed in one process: DTensor's sharding cache
    must not hand a later rank the sub-meshes of an earlier (destroyed) process group."""
    bytes_ = []
    for rank in (0, 2):
        model, batch = case("llama_gqa")
        report = graphmem.analyze(model, batch, world_size=4, rank=rank, tp=2, fsdp="fully_shard")
        bytes_.append(report.parameter_bytes)
        assert report.sharding.full_gradients == ()  # FSDP2's gradients are flat reduce-scatter outputs
    assert bytes_[0] == bytes_[1] > 0


def _llama_config(tmp_path: Path) -> str:
    case("llama_gqa")[0].config.save_pretrained(tmp_path)  # transformers' Llama: 4 heads, 2 key/value heads
    assert json.loads((tmp_path / "config.json").read_text())["num_key_value_heads"] == 2
    return str(tmp_path / "config.json")


@pytest.mark.parametrize("model,args,phrase", [
    ("hf", ["--world-size", "4", "--rank", "0", "--tp", "4"], "does not divide the 4 attention heads (2 key/value"),
    ("hf", ["--world-size", "2", "--rank", "1", "--tp", "2", "--sp"], "drop --sp"),
    ("models/gpt2.py", ["--world-size", "5", "--rank", "0", "--tp", "5"], "does not divide the 12 heads"),
    ("models/mlp.py", ["--world-size", "2", "--rank", "0", "--tp", "2"], "no tensor-parallel plan for"),
    ("hf", ["--world-size", "2", "--rank", "0", "--tp", "2", "--loss-parallel"], "drop --loss-parallel"),
    ("models/gpt2.py", ["--world-size", "2", "--loss-parallel"], "add --tp 2"),
])
def test_tp_mistakes_are_one_line(model: str, args: list[str], phrase: str, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = _llama_config(tmp_path) if model == "hf" else model
    shape = "4x784" if model == "models/mlp.py" else "2x16"
    assert main(["analyze", path, "--input-shape", shape, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0] and "Traceback" not in err[0], err


def test_peft_wrapped_model_is_one_error() -> None:
    from graphmem.errors import UsageError

    model, batch = case("lora_llama")
    with pytest.raises(UsageError, match="peft-wrapped"):
        graphmem.analyze(model, batch, world_size=2, rank=0, tp=2)


def test_cli_hf_rank_names_transformers_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", _llama_config(tmp_path), "--input-shape", "2x16", "--world-size", "2", "--rank", "1",
                 "--tp", "2"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("· rank 1 of 2 (transformers' apply_tensor_parallelism tp=2): one training step"), first


def test_cli_loss_parallel_keeps_the_logits_split(capsys: pytest.CaptureFixture[str]) -> None:
    """--loss-parallel: what the loss saves is the rank's vocabulary shard, (b(s-1), V/T), where
    without it the log-softmax runs over the logits gathered whole, (b(s-1), V)."""
    def loss_saved(extra: list[str]) -> set[tuple[int, ...]]:
        assert main(["analyze", "models/llama.py", "--input-shape", "2x16", "--world-size", "2", "--rank", "0",
                     "--tp", "2", "--json", *extra]) == 0
        saved = json.loads(capsys.readouterr().out)["saved"]
        return {tuple(t["shape"]) for t in saved if t["module"] == "" and len(t["shape"]) == 2 and t["shape"][0] == 30}
    assert loss_saved([]) == {(30, 32000)}
    assert loss_saved(["--loss-parallel"]) == {(30, 16000)}
