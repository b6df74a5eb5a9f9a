"""The step as one value: a StepSpec built once (graphmem/step/spec.py), measured by one function
(graphmem/step/measure.py), taken by ``graphmem.analyze`` directly, built by the CLI from its arguments,
and changed by ``dataclasses.replace``."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from cases import tiny_gpt, tokens

import graphmem
from graphmem.cli import options
from graphmem.cli.main import parser
from graphmem.errors import UsageError
from graphmem.passes.budget import Parallel
from graphmem.step.spec import Formula, Ranks, Single, Stages, StepSpec, make_parallelism, make_spec


def _gpt() -> tuple[torch.nn.Module, tuple]:
    torch.manual_seed(0)
    return tiny_gpt(), tokens()


def test_analyze_takes_a_spec_and_gives_the_keyword_forms_report() -> None:
    # GIVEN the same step as keyword options and as a spec
    model, x = _gpt()
    spec = make_spec(model, x, optimizer="adamw", micro_batches=2)
    # WHEN both are analyzed
    by_spec, by_options = graphmem.analyze(spec), graphmem.analyze(model, x, optimizer="adamw", micro_batches=2)
    # THEN the reports are equal, field by field
    assert by_spec.to_dict() == by_options.to_dict()
    assert by_spec.source is not None and by_spec.source.spec == spec


def test_a_spec_is_frozen_and_changed_by_replace() -> None:
    model, x = _gpt()
    spec = make_spec(model, x)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.reuse = False  # type: ignore[misc]
    adam = spec.with_train(optimizer="adam")
    assert adam.training.train.optimizer == "adam" and spec.training.train.optimizer is None
    smaller = spec.at((1, 16))
    assert smaller.shape == (1, 16) and smaller.inputs.given is None and spec.shape == (2, 16)
    # a lever's change is a new spec, measured as analyze measures it
    assert graphmem.analyze(adam).budget is not None
    # the spec is the whole input: no options beside it
    with pytest.raises(UsageError, match="StepSpec alone"):
        graphmem.analyze(spec, optimizer="adam")


@pytest.mark.parametrize("options, kind", [
    ({}, Single), ({"world_size": 4, "zero": 2}, Formula), ({"world_size": 2, "tp": 2}, Formula),
    ({"world_size": 4, "fsdp": "full"}, Formula), ({"world_size": 2, "rank": 1}, Ranks),
    ({"world_size": 2, "fsdp": "fully_shard"}, Ranks), ({"pp": 2, "rank": 1, "schedule": "gpipe"}, Stages),
])
def test_the_parallel_setting_is_decided_once_where_the_spec_is_built(options: dict, kind: type) -> None:
    assert isinstance(make_parallelism(**options), kind)


def test_the_two_fsdp_meanings_are_one_or_the_other() -> None:
    with pytest.raises(UsageError, match="one or the other"):
        make_parallelism(world_size=2, rank=0, fsdp="full")


def test_pipeline_with_qlora_is_refused_in_one_line() -> None:
    """The pipeline branch used to drop ``qlora`` silently (analyze at 165e7f6)."""
    model, x = _gpt()
    with pytest.raises(UsageError) as e:
        graphmem.analyze(model, x, pp=2, micro_batches=2, qlora=True, lora_rank=4, lora_targets="c_attn")
    assert "pipeline" in str(e.value) and "qlora" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UsageError, match="lora_rank"):
        graphmem.analyze(model, x, pp=2, micro_batches=2, lora_rank=4, lora_targets="c_attn")


def test_lora_alpha_is_an_analyze_keyword() -> None:
    model, x = _gpt()
    report = graphmem.analyze(model, x, lora_rank=4, lora_targets="c_attn", lora_alpha=32)
    assert report.source is not None and report.source.spec.training.lora.alpha == 32
    assert report.budget is not None and report.budget.to_dict()["lora"]["alpha"] == 32


def test_the_cli_builds_one_spec_from_its_arguments() -> None:
    args = parser().parse_args(["analyze", "models/llama.py", "--input-shape", "2x64", "--world-size", "4", "--rank", "1",
                                "--fsdp", "--optimizer", "adamw", "--micro-batches", "2"])
    spec = options.spec_of(args)
    assert isinstance(spec, StepSpec) and isinstance(spec.parallel, Ranks)
    assert (spec.parallel.sharding.rank, spec.parallel.sharding.world_size, spec.parallel.sharding.fsdp) == (1, 4, True)
    assert spec.training.train.micro_batches == 2 and spec.parallel.formula == Parallel()
    args = parser().parse_args(["analyze", "models/llama.py", "--input-shape", "2x64", "--world-size", "4", "--zero", "3"])
    assert options.spec_of(args).parallel == Formula(Parallel(4, 3))


def test_the_front_door_recognizes_each_kind_of_subject(tmp_path) -> None:
    """graphmem.spec_for (graphmem/frontends/door.py): a module, a StepSpec and a transformers Trainer each
    become the StepSpec that graphmem.analyze measures; what a kind of subject does not take is one line."""
    transformers = pytest.importorskip("transformers")
    model, x = _gpt()
    spec = graphmem.spec_for(model, x, optimizer="adamw")
    assert spec == make_spec(model, x, optimizer="adamw") and graphmem.spec_for(spec) is spec
    with pytest.raises(UsageError, match=r"spec_for\(spec\) takes the StepSpec alone"):
        graphmem.spec_for(spec, x, caller="graphmem.spec_for")
    with pytest.raises(UsageError, match="optimiser.*optimizer"):  # a misspelt keyword names the close match
        graphmem.spec_for(model, x, optimiser="adamw")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1,
                                                              n_head=2))
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, optim="sgd")
    trainer = transformers.Trainer(model=hf, args=args)
    batch = {"input_ids": torch.randint(0, 64, (2, 8)), "labels": torch.randint(0, 64, (2, 8))}
    by_trainer = graphmem.spec_for(trainer, batch)
    assert by_trainer.module is hf and by_trainer.training.train.trainer is not None and by_trainer.shape == (2, 8)
    assert graphmem.analyze(trainer, batch).activation_bytes == graphmem.analyze(by_trainer).activation_bytes
    with pytest.raises(UsageError, match="a Trainer's step comes from its TrainingArguments.*drop optimizer"):
        graphmem.spec_for(trainer, batch, optimizer="adamw")
    # validate takes the door's option sets for a Trainer (less its own parameters), refused before any real run
    with pytest.raises(UsageError, match="not `optimizer`: drop it"):
        graphmem.validate(trainer, batch, optimizer="adamw")
    with pytest.raises(UsageError, match="give `training_args`, `world_size`, `rank`"):
        graphmem.validate(hf, batch, training_args=args, optimizer="adamw")
