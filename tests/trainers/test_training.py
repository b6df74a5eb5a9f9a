"""The whole training step against real CPU runs: optimizer states to the byte, peaks within the
foundation's tolerance (tests/capture/test_ground_truth.py: LMs and MLP 0.1 %, the prediction never
above), micro-batches, master weights, LoRA and frozen parameters.

The real runs use graphmem/training/loop.py's loop itself (graphmem/validation/measure.py), so both sides run
the same step: micro-steps, ``optimizer.step()``, ``zero_grad(set_to_none=True)``.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from cases import MODELS, build

import graphmem
from graphmem.capture.capture import capture
from graphmem.cli.main import main
from graphmem.passes import liveness
from graphmem.training.loop import TrainStep
from graphmem.training.lora import LoRA, apply_lora
from graphmem.validation.measure import measure_peak

LM_TOLERANCE = 0.001
COMBOS = [(o, i) for o in ("sgd", "momentum", "adam", "adamw", "adafactor") for i in ("forloop", "foreach", "fused")
          if not (o == "adafactor" and i == "fused")]


def _close(predicted: int, real: int) -> None:
    gap = real - predicted
    assert 0 <= gap <= LM_TOLERANCE * real, (predicted, real)


@pytest.mark.parametrize("opt,impl", COMBOS)
def test_optimizer_state_and_step_peak_match_a_real_step(opt: str, impl: str) -> None:
    module, inputs, loss = build(MODELS, "gpt2_explicit")
    r = graphmem.analyze(module, inputs, loss=loss, optimizer=opt, optimizer_impl=impl)
    r.step.check()
    real = measure_peak(module, inputs, loss, train=TrainStep(opt, impl))
    assert r.budget.row("optimizer states").size == real.state_bytes  # sum of the state tensors' storages
    assert (real.state_bytes > 0) == (opt != "sgd")  # plain SGD keeps nothing
    assert r.baseline_bytes == real.baseline_bytes
    _close(r.peak_bytes, real.peak_bytes)
    assert r.budget.peak_bytes == r.peak_bytes  # one rank: the budget's peak is the traced one


@pytest.mark.parametrize("name,opt,impl", [("mlp", "adam", "foreach"), ("llama_sdpa", "adamw", "fused"),
                                           ("gpt2_explicit", "adafactor", "forloop")])
def test_later_steps_peak_matches_a_real_second_step(name: str, opt: str, impl: str) -> None:
    """From step 2 on the states exist before the step: derived from the first step's timeline,
    checked against a real run whose first step ran unmeasured."""
    module, inputs, loss = build(MODELS, name)
    b = graphmem.analyze(module, inputs, loss=loss, optimizer=opt, optimizer_impl=impl).budget.rank
    real = measure_peak(module, inputs, loss, train=TrainStep(opt, impl), warm_steps=1)
    assert real.baseline_bytes == b.row("parameters").size + b.row("buffers").size + b.row("optimizer states").size \
        + sum(x.nbytes for x in inputs)
    _close(b.later_peak_bytes, real.peak_bytes)
    assert b.later_peak_bytes >= b.peak_bytes


def test_the_step_peak_is_explained_by_what_is_live_there() -> None:
    """foreach Adam peaks in the optimizer step on its intermediates (torch.optim's docs: about one
    parameter-sized set more than the for-loop)."""
    module, inputs, loss = build(MODELS, "gpt2_explicit")
    loop = graphmem.analyze(module, inputs, loss=loss, optimizer="adam", optimizer_impl="forloop").budget.rank
    each = graphmem.analyze(module, inputs, loss=loss, optimizer="adam", optimizer_impl="foreach").budget.rank
    assert each.peak_phase == "optimizer" and each.peak_op.startswith("aten._foreach")
    assert sum(r.at_peak for r in each.rows) == each.peak_bytes
    params = each.row("parameters").size
    assert each.peak_bytes - loop.peak_bytes >= params // 2
    assert each.top_temporaries[0][0].startswith("aten._foreach")


def test_micro_batches_accumulate_gradients_and_match_a_real_run() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    one = graphmem.analyze(module, inputs, loss=loss, optimizer="adam")
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adam", micro_batches=3)
    real = measure_peak(module, inputs, loss, train=TrainStep("adam", micro_batches=3))
    _close(r.peak_bytes, real.peak_bytes)
    assert r.activation_bytes == one.activation_bytes  # each micro-step saves the same
    g = r.step
    grads = [g.storages[s] for s in g.gradients]
    assert grads and all(s.created < g.phase_start["forward"] for s in grads)  # made in micro-step 1 ...
    assert all(s.freed is not None and s.freed >= g.phase_start["optimizer"] for s in grads)  # ... held to zero_grad
    def forward_high(rep: graphmem.Report) -> int:  # the last micro-step's forward
        lo, hi = rep.phase_start["forward"], rep.phase_start["loss"]
        return max(rep.liveness.timeline[lo:hi])
    assert forward_high(r) >= forward_high(one) + r.gradient_bytes  # gradients held through later micro-steps


def test_tracing_two_micro_steps_is_exact_for_more() -> None:
    """Micro-steps 3..k hold what micro-step 2 holds; tracing all 4 gives the same peak and timeline shape."""
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    two = liveness(capture(module, inputs, loss, train=TrainStep("adam", micro_batches=4)))
    four = liveness(capture(module, inputs, loss, train=TrainStep("adam", micro_batches=4, trace_micro_steps=4)))
    assert two.peak_bytes == four.peak_bytes and two.end_bytes == four.end_bytes
    n = len(two.timeline)
    assert four.timeline[-n // 2:] == two.timeline[-n // 2:]


def test_master_weights_real_run() -> None:
    module, inputs, loss = build(MODELS, "gpt2_explicit")
    module = module.to(torch.bfloat16)
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adam", master_weights=True, dtype="bf16")
    real = measure_peak(module, inputs, loss, train=TrainStep("adam", master_weights=True))
    assert r.budget.row("optimizer states").size == real.state_bytes
    assert r.baseline_bytes == real.baseline_bytes  # the fp32 masters exist before the step
    _close(r.peak_bytes, real.peak_bytes)


@pytest.mark.parametrize("options", [{"dtype": "bf16", "master_weights": True}, {"amp": "bf16"}, {}])
def test_sixteen_bytes_per_parameter(options: dict) -> None:
    """ZeRO section 3: Adam with fp16/bf16 parameters and gradients, fp32 master, momentum and
    variance is 16 bytes per parameter (AMP's fp32 parameters and gradients: 4 + 4 + 8, fp32: same)."""
    r = graphmem.analyze("gpt2", input_shape=(1, 8), optimizer="adam", **options)
    b = r.budget.rank
    psi = b.parameters
    tensors = len(r.step.gradients)
    assert b.model_state_bytes - b.step_counter_bytes == 16 * psi
    assert b.step_counter_bytes == 4 * tensors  # Adam's step: one fp32 scalar per parameter tensor
    if options.get("master_weights"):
        assert (b.row("parameters").size, b.row("gradients").size, b.row("master copies").size) == (2 * psi, 2 * psi, 4 * psi)
    assert b.states_by_name["exp_avg"] == b.states_by_name["exp_avg_sq"] == 4 * psi


def test_lora_freezes_the_base_and_matches_a_real_run() -> None:
    module, inputs, loss = build(MODELS, "gpt2_explicit")
    before = [(n, p.requires_grad, p.device) for n, p in module.named_parameters()]
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw", lora_rank=4, lora_targets="c_attn,mlp.c_proj")
    assert [(n, p.requires_grad, p.device) for n, p in module.named_parameters()] == before  # untouched
    g, b = r.step, r.budget
    assert len(b.lora_layers) == 4  # 2 layers x (c_attn, mlp.c_proj)
    owners = {g.storages[s.owner].name for s in g.storages.values() if s.kind in ("gradient", "optimizer state")}
    assert owners and all(".lora_A." in n or ".lora_B." in n for n in owners)  # no grad/state for frozen weights
    adapters = sum(4 * (m.in_features + m.out_features) for m in _linears(module, ("c_attn", "mlp.c_proj")))
    assert b.rank.trainable == adapters
    assert b.row("gradients").size == 4 * adapters and b.rank.states_by_name["exp_avg"] == 4 * adapters
    real_module, _ = apply_lora(module, LoRA(4, ("c_attn", "mlp.c_proj")), inplace=True)
    torch.manual_seed(0)
    real = measure_peak(real_module, inputs, loss, train=TrainStep("adamw"))
    assert r.activation_bytes == real.saved_bytes
    assert b.row("optimizer states").size == real.state_bytes
    _close(r.peak_bytes, real.peak_bytes)


def _linears(module: nn.Module, targets: tuple[str, ...]) -> list[nn.Linear]:
    return [m for n, m in module.named_modules() if isinstance(m, nn.Linear) and any(t in n for t in targets)]


def test_frozen_parameters_get_no_gradient_and_no_state() -> None:
    module, inputs, loss = build(MODELS, "llama_sdpa")
    for name, p in module.named_parameters():
        if "layers.0" in name or "embed" in name:
            p.requires_grad_(False)
    frozen = sum(p.numel() for p in module.parameters() if not p.requires_grad)
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adam")
    b = r.budget.rank
    assert b.parameters - b.trainable == frozen
    assert b.row("gradients").size == 4 * b.trainable and b.states_by_name["exp_avg"] == 4 * b.trainable
    real = measure_peak(module, inputs, loss, train=TrainStep("adam"))
    assert b.row("optimizer states").size == real.state_bytes
    _close(r.peak_bytes, real.peak_bytes)


def test_cli_prints_the_budget_and_json_carries_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x16", "--optimizer", "adam", "--world-size", "4", "--zero", "2"]) == 0
    out = capsys.readouterr().out
    assert "Training step · adam (forloop) · 4 ranks, ZeRO-2 over 4" in out and "per rank" in out
    assert "why the peak" in out and "peak (later steps)" in out
    assert main(["analyze", "gpt2", "--input-shape", "1x16", "--optimizer", "sgd", "--json"]) == 0
    import json

    data = json.loads(capsys.readouterr().out)
    assert data["budget"]["optimizer"] == "sgd" and data["budget"]["per_rank"]["rows"]["optimizer states"]["bytes"] == 0


@pytest.mark.parametrize("args,phrase", [
    (["--master-weights", "--optimizer", "adam"], "--dtype bf16"),
    (["--master-weights"], "add --optimizer"),
    (["--optimizer", "adafactor", "--optimizer-impl", "fused"], "no fused adafactor"),
    (["--optimizer-impl", "foreach"], "needs an optimizer"),
    (["--lora-rank", "4", "--lora-targets", "qkv"], "named c_attn, c_proj"),
    (["--lora-rank", "4"], "needs --lora-targets"),
    (["--micro-batches", "0"], "positive integer"),
    (["--sp"], "add --tp"),
    (["--world-size", "6", "--tp", "4"], "not a multiple"),
    (["--world-size", "4", "--zero", "3", "--fsdp", "full"], "give one"),
])
def test_training_option_mistakes_are_one_line(args: list[str], phrase: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x8", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err
