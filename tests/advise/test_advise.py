"""graphmem advise: every lever's peak is graphmem.analyze of the changed step (the same options
given by hand), the loss and optimizer levers' peaks are a real CPU step's, the chosen combination
fits, and the CLI answers bad input in one line."""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from cases import MODELS, build

import graphmem
from graphmem.advise import Lever
from graphmem.cli.main import main
from graphmem.losses import ChunkedCausalLM, ChunkedNextToken
from graphmem.training.loop import TrainStep
from graphmem.validation.measure import measure_peak

LM_TOLERANCE = 0.001  # as tests/trainers/test_training.py: the real CPU step's peak, allocator rounding included


def _close(predicted: int, real: int) -> None:
    gap = real - predicted
    assert 0 <= gap <= LM_TOLERANCE * real, (predicted, real)


def _options(row: Any, base: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The analyze options a lever's row names (parsed from its name, independently of graphmem/advise),
    and the module wrapper for the loss lever."""
    name, opts, wrap = row.name, dict(base), None
    if m := re.fullmatch(r"(\w+) (forloop|fused)", name):
        opts["optimizer_impl"] = m.group(2)
    elif m := re.fullmatch(r"(\w+) instead of \w+", name):
        opts.update(optimizer=m.group(1), optimizer_impl="auto")
    elif name == "bf16 autocast":
        opts["amp"] = "bf16"
    elif name == "bf16 params + fp32 masters":
        opts.update(dtype="bf16", master_weights=True)
    elif m := re.fullmatch(r"(\d+) micro-batches of (\d+)", name):
        opts.update(micro_batches=int(m.group(1)), batch=int(m.group(2)))
    elif m := re.fullmatch(r"ZeRO-(\d) over (\d+) ranks", name):
        opts.update(zero=int(m.group(1)), world_size=int(m.group(2)))
    elif m := re.fullmatch(r"FSDP2 over (\d+) ranks(, no reshard after forward)?", name):
        opts.update(fsdp="fully_shard", world_size=int(m.group(1)), rank=0, reshard_after_forward=not m.group(2))
    elif m := re.fullmatch(r"LoRA r=(\d+) all-linear \(fine-tuning\)", name):
        opts.update(lora_rank=int(m.group(1)), lora_targets="all-linear")
    elif name == "chunked LM head + cross-entropy":
        wrap = "loss"
    else:
        raise AssertionError(f"a lever the test does not know: {name}")
    return opts, wrap


def _analyze(module: Any, inputs: tuple, loss: Any, opts: dict[str, Any], wrap: Any, head: str) -> graphmem.Report:
    opts = dict(opts)
    batch = opts.pop("batch", None)
    if batch is not None:
        inputs = tuple(x[:batch] for x in inputs)
    if wrap == "loss":
        module, loss = ChunkedNextToken(copy.deepcopy(module), head), None
    return graphmem.analyze(module, inputs, loss=loss, **opts)


def _peak(r: graphmem.Report) -> int:
    """The highest peak of any step: the first's, or a later one's (the optimizer states made), per rank."""
    return max(r.budget.peak_bytes, r.budget.rank.later_peak_bytes) if r.budget is not None else r.peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("name,head,opts", [
    ("gpt2_sdpa", "lm_head", {"optimizer": "adamw"}),
    # heavy (CI time, ~70 s): the Llama twin; CI runs GPT-2's levers
    pytest.param("llama_sdpa", "output", {"optimizer": "adam", "optimizer_impl": "foreach"}, marks=pytest.mark.heavy),
])
def test_every_lever_is_analyze_with_the_change(name: str, head: str, opts: dict[str, Any]) -> None:
    module, inputs, loss = build(MODELS, name)
    inputs = (torch.cat([inputs[0], inputs[0]]),)  # batch 4: micro-batches of 2 and 1
    report = graphmem.analyze(module, inputs, loss=loss, **opts)
    advice = report.advise(memory=report.peak_bytes // 2, combine=True)
    kinds = {r.kind for r in advice.levers}
    # (checkpoint too: plans are for every step, Adam's states live from a later step's start)
    assert {"optimizer", "micro-batches", "sharding", "loss", "checkpoint"} <= kinds, kinds
    assert {"precision", "lora"} <= kinds | {x.kind for x in advice.left_out}  # here, maybe without a saving
    assert [r.peak_bytes for r in advice.levers] == sorted(r.peak_bytes for r in advice.levers)
    # FSDP2's rows are rank 0's step through fully_shard (checked below against analyze --rank 0 --fsdp)
    fsdp = [r.name for r in advice.levers if r.name.startswith("FSDP2")] + \
        [x.why for x in advice.left_out if x.why.startswith("FSDP2")]
    assert len(fsdp) == 2, fsdp
    for row in advice.levers:
        assert row.saving_bytes == _peak(report) - row.peak_bytes
        if row.kind == "checkpoint":
            continue  # the planner's verified plan: tested in tests/planning/test_checkpoint_plans.py
        expected = _analyze(module, inputs, loss, *_options(row, opts), head)
        assert row.peak_bytes == _peak(expected), row.name
    for combo in advice.combinations:  # each combination: analyze with all its levers' options
        merged: dict[str, Any] = dict(opts)
        wrap = None
        for part in combo.parts:
            row = next(r for r in advice.levers if r.name == part)
            changed, w = _options(row, opts)
            merged.update({k: v for k, v in changed.items() if opts.get(k) != v})
            wrap = wrap or w
        assert combo.peak_bytes == _peak(_analyze(module, inputs, loss, merged, wrap, head)), combo.name
    left = {x.kind for x in advice.left_out}
    assert "attention" in left  # the CPU target: SDPA's backend is a CUDA choice


def _real(model: Any, inputs: Any, loss: Any, train: TrainStep) -> int:
    """The real CPU peak of any step: the first, or the second (the optimizer states made before it)."""
    return max(measure_peak(copy.deepcopy(model), inputs, loss, train=train, warm_steps=w).peak_bytes for w in (0, 1))


def test_loss_and_optimizer_levers_match_a_real_cpu_step() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    report = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw", optimizer_impl="foreach")
    advice = report.advise(memory=report.peak_bytes - 1)
    rows = {r.name: r for r in advice.levers}
    chunked = rows["chunked LM head + cross-entropy"]
    _close(chunked.peak_bytes, _real(ChunkedNextToken(copy.deepcopy(module)), inputs, None, TrainStep("adamw", "foreach")))
    assert chunked.saving_bytes > 0
    loop = rows["adamw forloop"]
    _close(loop.peak_bytes, _real(module, inputs, loss, TrainStep("adamw", "forloop")))
    assert loop.saving_bytes > 0  # foreach's temporaries are gone
    other = rows["adafactor instead of adamw"]
    _close(other.peak_bytes, _real(module, inputs, loss, TrainStep("adafactor")))


def test_hf_causal_lm_loss_lever_is_analyze_and_a_real_step() -> None:
    pytest.importorskip("transformers")
    from zoo import build as zoo_build

    model, (ids,) = zoo_build("llama_gqa")
    batch = {"input_ids": ids, "labels": ids}
    report = graphmem.analyze(model, batch, optimizer="sgd")
    advice = report.advise(memory=report.peak_bytes - 1)
    row = next(r for r in advice.levers if r.kind == "loss")
    wrapped = ChunkedCausalLM(copy.deepcopy(model))
    assert row.peak_bytes == _peak(graphmem.analyze(wrapped, batch, optimizer="sgd"))
    _close(row.peak_bytes, _real(wrapped, batch, None, TrainStep("sgd")))
    assert row.saving_bytes > 0


def test_the_chosen_combination_fits_when_no_single_lever_does() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    inputs = (torch.cat([inputs[0], inputs[0]]),)
    report = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw")
    tried = report.advise(memory=1)  # nothing fits: every lever is captured, the combinations go as far as they can
    single = min(r.peak_bytes for r in tried.levers)
    assert not report.advise(memory=single).combinations  # a single lever fits: no combination captured
    combined = min(r.peak_bytes for r in tried.combinations)
    assert combined < single
    memory = (single + combined) // 2  # below every single lever, above the best combination
    advice = report.advise(memory=memory)
    assert not any(r.fits for r in advice.levers)
    choice = advice.choice
    assert choice is not None and len(choice.parts) >= 2, advice.answer
    assert choice.peak_bytes <= memory and choice.fits
    assert choice.name in advice.answer and "combination" in advice.answer


def test_a_step_that_fits_and_one_nothing_fits() -> None:
    module, inputs, loss = build(MODELS, "mlp")
    report = graphmem.analyze(module, inputs, loss=loss)
    assert report.advise(memory=report.peak_bytes).answer.startswith("the step already fits")
    advice = report.advise(memory=1024)
    assert advice.choice is None and "no lever or combination tried fits" in advice.answer
    left = {x.kind: x.why for x in advice.left_out}
    assert "no optimizer in the step" in left["optimizer"]
    assert "not a language model" in left["loss"]


def test_attention_lever_on_the_cuda_target() -> None:
    from graphmem.models import gpt2

    module = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=256, n_layer=2, n_head=2, n_embd=32, attention="sdpa"))
    inputs, loss = (torch.randint(0, 101, (2, 256)),), gpt2.loss  # long enough for math's (s, s) matrix to matter
    forced = graphmem.analyze(module, inputs, loss=loss, device="cuda", amp="bf16", attention="math")
    auto = graphmem.analyze(module, inputs, loss=loss, device="cuda", amp="bf16")
    assert auto.peak_bytes < forced.peak_bytes and "math" not in auto.attention_backends
    for figure, of in (("device", lambda r: r.memory.device_total), ("allocated", lambda r: r.memory.run_max_allocated)):
        advice = forced.advise(memory=of(forced) - 1, figure=figure)  # "device": the CUDA target's default
        row = next(r for r in advice.levers if r.kind == "attention")
        assert advice.figure == figure and row.peak_bytes == of(auto) < of(forced)
    left = {x.kind: x.why for x in auto.advise(memory=auto.memory.device_total - 1).left_out}
    assert "already runs" in left["attention"]


@pytest.mark.parametrize("argv,message", [
    (["advise", "gpt2", "--input-shape", "1x8", "--memory", "lots"], "invalid memory size"),
    (["advise", "gpt2", "--input-shape", "1x8", "--memory", "0GiB"], "invalid memory size"),
    (["advise", "gpt2", "--input-shape", "1x8", "--memory", "1GiB", "--ranks", "0"], "--ranks"),
    (["advise", "gpt2", "--input-shape", "1x8"], "--memory"),
])
def test_cli_bad_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


@pytest.mark.slow  # ~1 min: advise of a 3-block GPT with AdamW (13 captures)
def test_cli_json_is_the_api(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # a small GPT (the bundled gpt2 family at 3 layers, width 32): the CLI's JSON is the API's advice, lever by
    # lever: the CLI analyzes what graphmem.analyze does, asks Analysis.advise with the memory given, and writes
    # that Advice (the advice itself is computed once, by the CLI; a spy keeps it)
    from graphmem.report.live import Analysis
    asked: list[tuple[Analysis, object, Any]] = []
    advise = Analysis.advise

    def spy(self: Analysis, memory: Any, **kw: Any) -> Any:
        advice = advise(self, memory, **kw)
        asked.append((self, memory, advice))
        return advice

    monkeypatch.setattr(Analysis, "advise", spy)
    model = tmp_path / "tiny_gpt.py"
    model.write_text("from graphmem.models import gpt2\n"
                     "cfg = gpt2.GPTConfig(vocab_size=101, block_size=64, n_layer=3, n_head=2, n_embd=32)\n"
                     "model = lambda: gpt2.build(cfg)\nloss = gpt2.loss\n")
    argv = ["advise", str(model), "--input-shape", "2x64", "--memory", "600KiB", "--optimizer", "adamw", "--json"]
    status = main(argv)
    out = json.loads(capsys.readouterr().out)
    (cli_report, memory, advice), = asked
    report = graphmem.analyze(str(model), input_shape=(2, 64), optimizer="adamw")
    assert cli_report.to_dict() == report.to_dict() and memory == "600KiB"
    assert out["levers"] == [r.to_dict() for r in advice.levers] and len(out["levers"]) >= 3
    assert out["answer"] == advice.answer
    assert status == (0 if advice.choice is not None else 1)


@pytest.mark.parametrize("opts", [{}, {"optimizer": "adamw"}])
def test_the_batch_lever_is_the_largest_batch_whose_captured_step_fits(opts: dict[str, Any]) -> None:
    # GIVEN a step that does not fit (with Adam: its later steps hold the states from the start)
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    inputs = (torch.cat([inputs[0]] * 4),)  # batch 8
    report = graphmem.analyze(module, inputs, loss=loss, **opts)
    limit = _peak(report) * 3 // 4
    # WHEN advised
    row = next(r for r in report.advise(memory=limit).levers if r.kind == "batch")
    b = int(re.match(r"batch (\d+) instead of 8", row.name).group(1))  # type: ignore[union-attr]
    # THEN the row is the step at that batch, captured; it fits, and one more sample does not
    smaller = graphmem.analyze(module, (inputs[0][:b],), loss=loss, **opts)
    assert row.peak_bytes == _peak(smaller) <= limit and row.fits and 1 <= b < 8
    assert _peak(graphmem.analyze(module, (inputs[0][:b + 1],), loss=loss, **opts)) > limit


def test_lora_and_qlora_levers_are_analyze_with_those_options() -> None:
    # GIVEN a Hugging Face model trained in full with AdamW (bf16 weights, as a preset's config gives)
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    import transformers

    torch.manual_seed(0)  # wide enough that the frozen weights' gradients and Adam states outweigh the adapters
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    opts: dict[str, Any] = dict(optimizer="adamw", dtype="bf16")
    report = graphmem.analyze(model, batch, **opts)
    # WHEN advised
    rows = {r.name: r for r in report.advise(memory=_peak(report) // 2).levers if r.kind == "lora"}
    # THEN each adapter row is the step analyze captures with the same options
    lora = rows["LoRA r=16 all-linear (fine-tuning)"]
    qlora = rows["QLoRA r=16 all-linear (fine-tuning, 4-bit NF4 base)"]
    assert lora.peak_bytes == _peak(graphmem.analyze(model, batch, lora_rank=16, lora_targets="all-linear", **opts))
    assert qlora.peak_bytes == _peak(graphmem.analyze(model, batch, qlora=True, lora_rank=16, lora_targets="all-linear",
                                                      **opts))
    assert qlora.peak_bytes != lora.peak_bytes  # the 4-bit base is its own capture, not the LoRA row's


def test_the_loss_lever_knows_a_bundled_model_loaded_by_path() -> None:
    """`graphmem advise models/gpt2.py` loads the file as its own module: its loss is another
    function object with the same source, and the chunked-loss lever still applies."""
    from graphmem.advise.levers import _bundled_loss
    from graphmem.capture.load import load_file
    from graphmem.models import gpt2, llama

    for path, known in (("models/gpt2.py", gpt2.loss), ("models/llama.py", llama.loss)):
        loaded = load_file(path)
        assert loaded.loss is not known and _bundled_loss(loaded.loss) is known
    assert _bundled_loss(lambda out, inputs: out.sum()) is None


def test_the_pipeline_lever_is_every_ranks_stage_with_its_optimizer() -> None:
    """The pipeline row: 1F1B over --ranks stages, each rank's step with its stage's optimizer
    (analyze --pp P --rank r --micro-batches M, each captured); the row is the highest rank's peak."""
    module, inputs, loss = build(MODELS, "gpt2_sdpa")  # 2 blocks
    inputs = (torch.cat([inputs[0], inputs[0]]),)  # batch 4: 1F1B over 2 ranks takes 2 micro-batches
    report = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw")
    advice = report.advise(memory=report.peak_bytes // 2, ranks=2)
    rows = [r for r in advice.levers if r.kind == "pipeline"] + \
        [x for x in advice.left_out if x.kind == "pipeline"]
    assert len(rows) == 1 and isinstance(rows[0], Lever), rows
    row = rows[0]
    assert row.name == "pipeline over 2 ranks (1F1B, 2 micro-batches)"
    stages = [graphmem.analyze(module, inputs, loss=loss, optimizer="adamw", pp=2, rank=r, micro_batches=2)
              for r in range(2)]
    assert row.peak_bytes == max(_peak(s) for s in stages) < _peak(report)
    assert "1F1B's bubble idles 33% of the step" in row.cost
