"""A transformers ``Trainer``'s own step (graphmem/training/hf_trainer.py) against the same step run
for real on the CPU (graphmem/validation/measure.py with the same runner): saved bytes, optimizer
states and the peaks of the first and later steps to the byte.

Tiny configs at 2x16: Llama, Llama with gradient checkpointing, a BERT classifier with
adamw_torch_fused, Llama + peft LoRA, GPT-2 under bf16 autocast, Llama with adafactor, with
adamw_bnb_8bit and paged_adamw_8bit. What closed the last bytes (found from the profiler's
allocation events by their parent ops): Python floats the argument parser wraps into 8 B doubles
(peft LoRA's ``* scaling``, GPT-2's NewGELUActivation constants, AdamW's ``/ bias_correction2_sqrt``
and its 4 B float32 cast; graphmem/capture/wrapped_numbers.py), the Scalar each tensor of
``torch._foreach_add_(state_steps, 1)`` becomes inside fused AdamW's CPU kernel
(graphmem/oprules/scalars.py), and the Python float in bitsandbytes' CPU Adam kernel
(graphmem/oprules/bnb.py).
"""
from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import GraphmemError
from graphmem.frontends.trainer import trainer_batch
from graphmem.render import render_json, render_text
from graphmem.validation.trainer import measure_trainer

transformers = pytest.importorskip("transformers")


def _llama() -> Any:
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                                                n_head=4))


def _bert() -> Any:
    cfg = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=64, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _lora_llama() -> Any:
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(_llama(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))


def _trainer(model: Any, out: str, **kwargs: Any) -> Any:
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0,
                                          gradient_accumulation_steps=2, **kwargs)
    return transformers.Trainer(model=model, args=args)


def _check(trainer: Any, shape: tuple[int, int] = (2, 16)) -> Any:
    torch.manual_seed(0)
    batch = trainer_batch(trainer, shape)
    r = graphmem.analyze(trainer, batch)
    assert r.step is not None
    r.step.check()
    first = measure_trainer(trainer, batch)
    later = measure_trainer(trainer, batch, warm_steps=1)
    b = r.budget.rank
    assert r.activation_bytes == first.saved_bytes
    assert b.row("optimizer states").size == first.state_bytes
    assert (b.peak_bytes, b.later_peak_bytes) == (first.peak_bytes, later.peak_bytes)
    return r


@pytest.mark.parametrize("make,kwargs", [
    (_llama, {"optim": "adamw_torch"}),
    (_llama, {"optim": "adamw_torch", "gradient_checkpointing": True}),
    (_bert, {"optim": "adamw_torch_fused"}),
    (_lora_llama, {"optim": "adamw_torch"}),
    (_llama, {"optim": "adafactor"}),
], ids=["llama", "llama-checkpointing", "bert-classifier", "llama-lora", "llama-adafactor"])
def test_trainer_step_matches_a_real_trainer_step(make: Any, kwargs: dict) -> None:
    with tempfile.TemporaryDirectory() as out:
        r = _check(_trainer(make(), out, **kwargs))
    assert "Training step · transformers Trainer's loop: optim " in render_text(r)
    d = json.loads(render_json(r))["budget"]
    assert d["loop"] == "transformers.Trainer" and d["max_grad_norm"] == 1.0 and d["micro_batches"] == 2
    json.dumps(d)


def test_bf16_autocast_through_accelerate_matches_a_real_step() -> None:
    """bf16=True: accelerate's prepare_model wraps forward in CPU autocast (and the outputs back to
    fp32); the runner installs it for the step and takes it off again."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(_gpt2(), out, optim="adamw_torch", bf16=True)
        forward = trainer.model.forward
        r = _check(trainer)
    assert r.to_dict()["budget"]["precision"] == "bf16 autocast"
    assert "_original_forward" not in trainer.model.__dict__ and trainer.model.forward == forward


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_adamw_8bit"])
def test_bitsandbytes_8bit_adamw_matches_a_real_step(optim: str) -> None:
    """adamw_bnb_8bit (bitsandbytes' CPU 8-bit optimizer) on fake tensors: its states to the byte; its
    CPU kernels' fp32 copies (graphmem/oprules/bnb.py) are the first step's peak, as in the real
    step (54,784 B under before they were counted)."""
    pytest.importorskip("bitsandbytes")
    with tempfile.TemporaryDirectory() as out:
        r = _check(_trainer(_llama(), out, optim=optim))
    assert r.budget.rank.peak_phase == "optimizer"


def test_training_args_file_from_the_cli(tmp_path: Any, capsys: Any) -> None:
    """graphmem analyze MODEL --training-args args.json|yaml builds a Trainer around the loaded model
    (on the meta device) with HfArgumentParser(TrainingArguments); a file it cannot read is one line."""
    from graphmem.cli.main import main

    args = tmp_path / "args.yaml"
    args.write_text(f"output_dir: {tmp_path}\nuse_cpu: true\nreport_to: []\noptim: adafactor\nmax_grad_norm: 0.5\n")
    assert main(["analyze", "hf-gpt2", "--input-shape", "2x32", "--training-args", str(args), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["budget"]
    assert (d["loop"], d["optimizer"], d["max_grad_norm"]) == ("transformers.Trainer", "adafactor", 0.5)
    bad = tmp_path / "bad.json"
    bad.write_text("{bad")
    for path in (bad, tmp_path / "missing.json"):
        assert main(["analyze", "hf-gpt2", "--input-shape", "2x32", "--training-args", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "training_args" in err[0]


def test_bad_trainers_are_one_line() -> None:
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(_llama(), out)
        trainer.model = None
        with pytest.raises(GraphmemError, match="has no model"):
            graphmem.analyze(trainer, input_shape=(2, 16))
        with pytest.raises(GraphmemError, match="no train_dataset"):
            graphmem.analyze(_trainer(_llama(), out))
        for option, value in (("torch_compile_backend", "eager"), ("torch_compile_mode", "max-autotune")):
            compiled = _trainer(_llama(), out, **{option: value})  # either one sets torch_compile=True
            with pytest.raises(GraphmemError, match=f"^{option}={value!r}: .*`{option}`"):
                graphmem.analyze(compiled, input_shape=(2, 16))


@pytest.mark.slow  # ~60 s: two models, each predicted and run for real three times
def test_validate_a_trainer_from_the_api_and_the_cli(tmp_path: Any, capsys: Any) -> None:
    """graphmem.validate(trainer) and graphmem validate CONFIG --training-args: the prediction beside the
    same runner's real CPU steps, every row within its rule."""
    from graphmem.cli.main import main

    with tempfile.TemporaryDirectory() as out:
        v = graphmem.validate(_trainer(_bert(), out, optim="adamw_torch"), input_shape=(2, 16))
    assert v.ok and v.row("saved for backward").difference == 0 and v.row("optimizer states").difference == 0
    assert v.row("peak (later steps)").difference == 0
    _gpt2().config.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [],
                                "gradient_accumulation_steps": 2, "max_grad_norm": 1.0}))
    assert main(["validate", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args", str(args),
                 "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["validation"]["rows"]}
    assert rows["saved for backward"]["difference"] == 0 and rows["optimizer states"]["difference"] == 0
    assert -48 <= rows["peak"]["difference"] <= 0  # the module docstring's GPT-2 gap


def test_an_optimizer_given_to_the_trainer_is_the_one_stepped() -> None:
    """Trainer(optimizers=(SGD with momentum, None)): rebuilt as its class, defaults and groups over the
    step's parameters; its momentum buffers are the states (the real run steps the same)."""
    model = _llama()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        trainer = transformers.Trainer(model=model, args=args, optimizers=(opt, None))
        r = _check(trainer)
        assert trainer.optimizer is opt and not opt.state  # the user's optimizer is left untouched
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert r.budget.row("optimizer states").size == params  # one momentum buffer per parameter
    assert r.to_dict()["budget"]["optimizer"] == "SGD (given)"


def test_the_batch_comes_from_the_train_dataset_through_the_collator() -> None:
    """The collator's padding decides the length of the Trainer's own batch (samples of 5 and 9 tokens
    padded to a multiple of 8, a plain list dataset); ``input_shape`` is honoured as given."""

    def collate(samples: list) -> dict:
        n = -(-max(len(s["input_ids"]) for s in samples) // 8) * 8
        ids = torch.tensor([s["input_ids"] + [0] * (n - len(s["input_ids"])) for s in samples])
        return {"input_ids": ids, "labels": ids.clone()}

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, remove_unused_columns=False,
                                              per_device_train_batch_size=2)
        data = [{"input_ids": list(range(5))}, {"input_ids": list(range(9))}]
        trainer = transformers.Trainer(model=_llama(), args=args, train_dataset=data, data_collator=collate)
        assert {k: tuple(v.shape) for k, v in trainer_batch(trainer, (2, 24)).items()} == {"input_ids": (2, 24),
                                                                                          "labels": (2, 24)}
        r = graphmem.analyze(trainer)
    assert set(r.input_shapes) == {(2, 16)} and r.batch["batch"] == "the first train() draws"


@pytest.mark.slow
@pytest.mark.xfail(torch.ops.mkldnn._is_mkldnn_bf16_supported(), strict=True,  # passes where bf16 GEMMs skip oneDNN (AVX2)
                   reason="GPT-2 with bf16 and gradient checkpointing: the later steps' real peak is "
                          "26,416 B (3.7 %) above the prediction; graphmem's own loop shows it too (20,120 B): the "
                          "capture of checkpointed GPT-2 blocks under CPU autocast (docs/trainer.md)")
def test_gpt2_bf16_with_gradient_checkpointing_later_steps() -> None:
    with tempfile.TemporaryDirectory() as out:
        _check(_trainer(_gpt2(), out, optim="adamw_torch", bf16=True, gradient_checkpointing=True))
