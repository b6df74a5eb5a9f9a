"""``graphmem.analyze(trainer)`` on the batch the Trainer's own dataloader yields
(graphmem/training/hf_trainer_batch.py), against a REAL ``trainer.train()`` on the CPU
(tests/trainer_run_truth.py: its own dataloader, sampler, collator and loop).

A tiny Llama, token samples of unequal lengths padded by ``DataCollatorForLanguageModeling(mlm=False)``
(a tokenizer built here, no download), 2 samples a batch, ``max_steps=2``, ``max_grad_norm=1.0``.
What the real run holds that the prediction does not, named and counted to the byte:

- accelerate's ``DataLoaderShard`` collates one batch ahead (``__iter__``'s ``next_batch``): the next
  batch is alive through each step (none at an epoch's last batch);
- within an epoch, ``_run_epoch``'s locals ``grad_norm`` and ``tr_loss_step`` keep the previous step's
  gradient norm and last loss (4 B each) until the next step's are made (a step that begins an epoch has
  neither, as the prediction's later steps).
"""
from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import GraphmemError
from graphmem.frontends.trainer import trainer_inputs

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.trainer_run_truth import measure_train  # noqa: E402

SHORT, LONG = [7, 12], [7, 12, 5, 9, 16, 3]  # samples' lengths: one batch an epoch; three batches of unequal lengths


def _tokenizer() -> Any:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i + 2 for i in range(126)}}
    model = tokenizers.models.WordLevel(vocab, unk_token="[UNK]")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer(model), pad_token="[PAD]",
                                                unk_token="[UNK]")


def _trainer(out: str, lengths: list[int], dataset: bool = True, **kwargs: Any) -> Any:
    torch.manual_seed(0)  # the same weights for the prediction and the real run
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    data = [{"input_ids": [2 + (i * 7 + j) % 120 for j in range(n)]} for i, n in enumerate(lengths)]
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, per_device_train_batch_size=2,
                                          max_steps=2, save_strategy="no", disable_tqdm=True, max_grad_norm=1.0,
                                          **kwargs)
    collator = transformers.DataCollatorForLanguageModeling(_tokenizer(), mlm=False)
    return transformers.Trainer(model=transformers.LlamaForCausalLM(cfg), args=args, data_collator=collator,
                                train_dataset=data if dataset else None)


def _batches(trainer: Any) -> list[int]:
    """Bytes of each batch of the first epoch, as the Trainer's dataloader yields them (same seed as train())."""
    return [sum(v.untyped_storage().nbytes() for v in b.values()) for b in trainer.get_train_dataloader()]


@pytest.mark.slow  # ~15 s: a real train() and the analysis
def test_a_trainer_alone_equals_a_real_train() -> None:
    """Every step of the run starts an epoch (2 samples, 1 batch), so nothing is held across steps: saved
    bytes and both steps' peaks to the byte; the batch is the one train() ran (padded to the longer sample)."""
    with tempfile.TemporaryDirectory() as out:
        r = graphmem.analyze(_trainer(out, SHORT))
        real = measure_train(_trainer(out, SHORT))
    assert real.shapes == ((2, 12), (2, 12)) and set(r.input_shapes) == {(2, 12)}
    assert r.batch["batch"] == "the first train() draws"
    assert "DataCollatorForLanguageModeling" in r.batch["dataset"]
    b = r.budget.rank
    assert r.activation_bytes == real.saved_bytes
    assert (b.peak_bytes, b.later_peak_bytes) == real.peaks


@pytest.mark.slow  # ~20 s: two real train() runs and two analyses
def test_first_and_longest_batch_against_a_real_run_of_unequal_batches() -> None:
    """Six samples: the run's two steps train on batches of 9 and 16 tokens (the third, 12, collated ahead).
    ``first`` predicts step 1 (the one-ahead batch 2 apart); ``longest`` picks batch 2, whose later-step
    peak is the run's maximum: the one-ahead batch 3 and the 8 B of step 1's norm and loss apart (module
    docstring), within 1 %."""
    with tempfile.TemporaryDirectory() as out:
        first = graphmem.analyze(_trainer(out, LONG))
        longest = graphmem.analyze(_trainer(out, LONG), trainer_batch="longest")
        sizes = _batches(_trainer(out, LONG))
        real = measure_train(_trainer(out, LONG))
    assert real.shapes == ((2, 9), (2, 16)) and len(sizes) == 3
    assert set(first.input_shapes) == {(2, 9)} and set(longest.input_shapes) == {(2, 16)}
    assert longest.batch["batch"] == "the longest of the 2 the run draws (no. 2)"
    assert first.activation_bytes == real.saved_bytes
    assert real.peaks[0] - first.budget.rank.peak_bytes == sizes[1]  # batch 2, collated ahead
    gap = real.peaks[1] - longest.budget.rank.later_peak_bytes
    assert gap == sizes[2] + 4 + 4  # batch 3 ahead, step 1's grad_norm and tr_loss_step
    assert 0 < gap < 0.01 * real.peaks[1]
    run = max(longest.budget.rank.peak_bytes, longest.budget.rank.later_peak_bytes)
    assert abs(max(real.peaks) - run) < 0.01 * max(real.peaks)


@pytest.mark.parametrize("seeds", [{}, {"seed": 7}, {"data_seed": 3}])
def test_the_first_batch_is_the_one_train_runs(seeds: dict) -> None:
    """The sampler seeded as train() seeds it (``data_seed``, else torch's initial seed, ``args.seed``):
    the same samples as the first batch train() hands ``training_step``."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, LONG, **seeds)
        state = torch.random.get_rng_state()
        drawn, settings = trainer_inputs(trainer, None, None)
        assert torch.equal(torch.random.get_rng_state(), state)  # the user's RNG left as it was
        seen: list = []
        step = trainer.training_step
        trainer.training_step = lambda model, inputs, *a: seen.append(inputs) or step(model, inputs, *a)
        trainer.args.max_steps = 1
        trainer.train()
    assert set(drawn) == set(seen[0]) and all(torch.equal(drawn[k], seen[0][k]) for k in drawn)


def test_a_ddp_rank_draws_its_shard_of_the_batches() -> None:
    """Rank r of N trains on the r-th, (r+N)-th, ... batch of the one-process order: accelerate's
    BatchSamplerShard (split_batches=False) over the same seeded sampler on every rank."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    order = BatchSampler(SequentialSampler(range(12)), 2, False)
    assert [list(BatchSamplerShard(order, num_processes=3, process_index=r))[0] for r in range(3)] == \
        [list(order)[r] for r in range(3)]
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, LONG)
        batches = list(trainer.get_train_dataloader())
        for rank in range(3):
            drawn, settings = trainer_inputs(trainer, None, None, "first", world_size=3, rank=rank)
            assert all(torch.equal(drawn[k], batches[rank][k]) for k in batches[rank])
            assert settings["batch"] == f"the first train() draws for rank {rank} of 3"


def test_input_shape_is_never_changed() -> None:
    """A Trainer with a dataset of 9- and 16-token batches: ``input_shape`` is the shape analyzed (the
    dataset's first batch resized, its keys and dtypes kept); a shape no tensor of the batch has is one line."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(out, LONG)
        for shape in ((2, 16), (3, 20), (1, 4)):
            batch, settings = trainer_inputs(trainer, None, shape)
            assert {k: tuple(v.shape) for k, v in batch.items()} == dict.fromkeys(("input_ids", "attention_mask", "labels"), shape)
            assert settings["batch"] == "input_shape as given (train()'s first, 2x9, resized)"
        r = graphmem.analyze(trainer, input_shape=(3, 20))
        assert set(r.input_shapes) == {(3, 20)}
        with pytest.raises(GraphmemError, match=r"^`input_shape=\(2, 3, 4\)` fits no tensor of the Trainer's batch") as e:
            graphmem.analyze(trainer, input_shape=(2, 3, 4))
        assert "\n" not in str(e.value)


def test_without_a_dataset_or_a_batch_is_one_line() -> None:
    with tempfile.TemporaryDirectory() as out:
        bare = _trainer(out, LONG, dataset=False)
        for call in (lambda: graphmem.analyze(bare), lambda: graphmem.validate(bare)):
            with pytest.raises(GraphmemError, match="^the Trainer has no train_dataset to draw its batch from: give "
                                                    "it one .*`input_shape`") as e:
                call()
            assert "\n" not in str(e.value)
        with pytest.raises(GraphmemError, match="^`trainer_batch='last'`: use 'first'"):
            graphmem.analyze(_trainer(out, LONG), trainer_batch="last")
        ragged = _trainer(out, LONG)
        ragged.data_collator = transformers.default_data_collator  # stacks lists: unequal lengths fail
        with pytest.raises(GraphmemError, match="^the Trainer's dataloader could not draw a batch .*pads") as e:
            graphmem.analyze(ragged)
        assert "\n" not in str(e.value)


def _cli_files(tmp_path: Any) -> tuple[Any, Any]:
    """A tiny Llama's config.json and a TrainingArguments file (2 samples a batch, clipping) in ``tmp_path``."""
    import json

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [],
                                "per_device_train_batch_size": 2, "max_grad_norm": 1.0}))
    return cfg, args


@pytest.mark.slow  # ~20 s: the CLI's analysis and the library's
def test_the_cli_draws_the_batch_from_its_train_dataset(tmp_path: Any, capsys: Any) -> None:
    """graphmem analyze CONFIG --training-args args.json --train-dataset data.jsonl (no --input-shape): the
    first batch train() draws, the same report as graphmem.analyze(trainer) on that Trainer; without a
    dataset or a shape, one line naming both flags."""
    import json

    from graphmem.cli.main import main
    from graphmem.frontends.trainer import trainer_from_file

    cfg, args = _cli_files(tmp_path)
    data = tmp_path / "data.jsonl"  # the CLI's Trainer collates with default_data_collator: samples of one length
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 12)), "labels": list(range(i, i + 12))}) + "\n"
                            for i in range(5)))
    assert main(["analyze", str(tmp_path / "config.json"), "--training-args", str(args), "--train-dataset", str(data),
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["input_shapes"] == [[2, 12], [2, 12]] and d["batch"]["batch"] == "the first train() draws"
    r = graphmem.analyze(trainer_from_file(transformers.LlamaForCausalLM(cfg), str(args), train_dataset=str(data)))
    assert (d["activation_bytes"], d["peak_bytes"]) == (r.activation_bytes, r.peak_bytes)
    assert main(["analyze", str(tmp_path / "config.json"), "--training-args", str(args)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--train-dataset" in err[0] and "--input-shape" in err[0]
    assert main(["analyze", str(tmp_path / "config.json"), "--input-shape", "2x8", "--train-dataset", str(data)]) == 2
    assert "give --training-args too" in capsys.readouterr().err


def test_cli_validate_runs_the_batch_of_its_train_dataset(tmp_path: Any, capsys: Any) -> None:
    """graphmem validate CONFIG --training-args args.json --train-dataset data.jsonl (no --input-shape): the
    prediction for the first batch train() draws beside the Trainer's real steps on it, within tolerance;
    the batch is the dataset's (its samples' length), and the flags' mistakes are one line each."""
    import json

    from graphmem.cli.main import main

    cfg, args = _cli_files(tmp_path)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"input_ids": list(range(i, i + 11)), "labels": list(range(i, i + 11))}) + "\n"
                            for i in range(4)))
    assert main(["validate", str(tmp_path / "config.json"), "--training-args", str(args), "--train-dataset", str(data),
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["validation"]
    rows = {r["name"]: r for r in d["rows"]}
    assert rows["saved for backward"]["predicted"] == rows["saved for backward"]["measured"] > 0
    assert "2x11" in json.dumps(d) or [2, 11] in d.get("input_shapes", [[2, 11]])
    assert main(["validate", str(tmp_path / "config.json"), "--train-dataset", str(data)]) == 2
    assert "give --training-args too" in capsys.readouterr().err
    assert main(["validate", str(tmp_path / "config.json")]) == 2
    assert "--input-shape" in capsys.readouterr().err
