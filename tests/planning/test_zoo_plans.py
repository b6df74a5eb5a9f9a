"""Checkpoint plans on real models (tests/zoo.py: transformers, timm, peft; tiny configs,
random weights, CPU).

GIVEN a real model, WHEN graphmem plans at a budget halfway between the peak with every block
checkpointed and the peak without checkpoints, and the plan is applied to a fresh copy of the
model for one real CPU step, THEN the real saved bytes equal the plan's captured ones (0 B),
the real peak equals the plan's within the model's stated tolerance, and the plan fits.

Tolerances (real peak - predicted), each from a kernel whose scratch fake tensors cannot see:
see ``TOLERANCE``.
"""
from __future__ import annotations

import pytest
import torch
from paths import TESTS
from zoo import ZOO, build

import graphmem
from graphmem.passes.checkpoint import baselines
from graphmem.validation.measure import measure_peak

# real CPU peak minus predicted peak, in bytes, allowed per model (0 unless listed: Llama,
# Qwen2, T5, ViT, ConvNeXt measure 0 B; ConvNeXt's depthwise scratch is modelled by
# graphmem/oprules/conv.py). The gap is scratch a CPU kernel allocates inside the op at the
# peak, which fake tensors cannot see; it is there without checkpoints too (the report's own
# peak), so it belongs to the analysis, not to the plan:
TOLERANCE: dict[str, int] = {
    # the peak is in the MLP's backward (GPT-2's tanh GELU: aten.mul); TensorIterator's
    # scalar operands there: measured 32-128 B eager, 24-96 B SDPA
    "gpt2_eager": 128,
    "gpt2_sdpa": 96,
    # the same in the LoRA Llama's MLP backward: measured 64 B with every plan
    "lora_llama": 64,
    # BertForMaskedLM peaks in aten.native_layer_norm_backward of the MLM head's LayerNorm,
    # whose CPU kernel (ATen's layer_norm_kernel.cpp) allocates per-thread gamma/beta
    # partial sums: measured 31,744 B, the same without checkpoints
    "bert": 31744,
}

def _model(name: str) -> tuple:
    pytest.importorskip(ZOO[name][0])
    if name == "lora_llama":
        pytest.importorskip("transformers")
    return build(name)


def _budget(report: graphmem.Report) -> int:
    pl = report.planner
    every = baselines(pl.costs)["every block"]
    low = pl.verifier.measure(every)[0]
    assert low < report.peak_bytes, "checkpointing every block must lower this model's peak"
    return (low + report.peak_bytes) // 2


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ZOO))
def test_a_plan_holds_on_a_real_step(name: str) -> None:
    model, inputs = _model(name)
    report = graphmem.analyze(model, inputs)
    budget = _budget(report)
    plan = report.plan(budget=budget)
    v = plan.verification
    assert v is not None and plan.peak_bytes == v.captured_peak <= budget
    assert plan.segments  # the budget is below the peak without checkpoints
    fresh, fresh_inputs = build(name)
    keys = list(fresh.state_dict())
    with plan.apply(fresh):
        assert list(fresh.state_dict()) == keys
        real = measure_peak(fresh, fresh_inputs)
    assert list(fresh.state_dict()) == keys
    assert real.saved_bytes == v.captured_saved, (plan.segments, real.saved_bytes, v.captured_saved)
    assert 0 <= real.peak_bytes - plan.peak_bytes <= TOLERANCE.get(name, 0), (plan.segments, real.peak_bytes, plan.peak_bytes)
    if report.planner.exact:
        assert v.proven and v.captured_peak == v.predicted_peak
    else:
        assert not v.proven and 1 <= v.captures <= 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2_eager", "llama_gqa", "bert", "vit"])
def test_selective_plans_hold_on_a_real_step(name: str) -> None:
    model, inputs = _model(name)
    report = graphmem.analyze(model, inputs)
    budget = _budget(report)
    plan = report.plan(budget=budget, selective=2)
    v = plan.verification
    assert v is not None and plan.peak_bytes == v.captured_peak <= budget
    fresh, fresh_inputs = build(name)
    with plan.apply(fresh):
        real = measure_peak(fresh, fresh_inputs)
    assert real.saved_bytes == v.captured_saved
    assert 0 <= real.peak_bytes - plan.peak_bytes <= TOLERANCE.get(name, 0)


def test_a_checkpointed_hf_block_writes_no_kv_cache() -> None:
    """GIVEN GPT-2 with its default use_cache=True (a DynamicCache built per step and handed
    to every block), WHEN every block is checkpointed, THEN the real step runs (the recompute
    would otherwise append to the cache a second time: keys twice as long as the mask) and
    its loss and gradients equal an unchecked step's."""
    model, (ids,) = _model("gpt2_eager")
    torch.manual_seed(0)  # the same dropout masks in both steps
    ref = model(ids).logits.float().pow(2).mean()
    ref.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    from graphmem.planning.apply import apply_segments

    with apply_segments(model, "transformer.h", [(i, i) for i in range(4)]):
        torch.manual_seed(0)
        out = model(ids)
        loss = out.logits.float().pow(2).mean()
        loss.backward()
    assert torch.equal(loss, ref)
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n])
    # the cache holds the keys of no checkpointed block
    assert out.past_key_values.get_seq_length() == 0


def test_pieces_that_compose_without_the_kv_cache_give_a_proven_plan() -> None:
    """Llama with use_cache=False: no cache keeps the stored blocks' keys and values past
    their backward, the pieces compose, the plan is proven optimal."""
    model, inputs = _model("llama_gqa")
    model.config.use_cache = False
    report = graphmem.analyze(model, inputs)
    plan = report.plan(budget=_budget(report))
    assert report.planner.exact and plan.verification is not None and plan.verification.proven


@pytest.mark.slow
def test_cli_plans_a_transformers_model_file_and_says_how_it_verified(capsys: pytest.CaptureFixture) -> None:
    """GIVEN a model file that builds transformers' LlamaForCausalLM, WHEN `graphmem analyze
    ... --plan --budget` runs, THEN it prints the plan with its verification, and the JSON's
    chosen plan, applied to the real model for a real CPU step, has the printed peak and saved
    bytes. (In-process: the CLI's main, as `graphmem` calls it.)"""
    pytest.importorskip("transformers")
    import importlib.util
    import json

    import graphmem.planning as gc
    from graphmem.cli import main

    path = str(TESTS / "plan_models" / "hf_llama.py")
    args = ["analyze", path, "--input-shape", "2x64", "--plan", "--budget", "4MiB"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "Chosen plan (budget 4.00 MiB)" in text and "verified: captured peak" in text
    assert "best of" in text  # the KV cache keeps stored layers' keys: the pieces do not compose
    assert main([*args, "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["plan"]["chosen"]
    assert chosen["peak_bytes"] == chosen["verification"]["captured_peak_bytes"] <= 4 * 2**20
    spec = importlib.util.spec_from_file_location("hf_llama_file", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = mod.model()
    ids = torch.randint(0, 256, (2, 64))
    with gc.apply_segments(model, chosen["chain"], [tuple(s) for s in chosen["segments"]]):
        real = measure_peak(model, (ids,), mod.loss)
    assert real.saved_bytes == chosen["verification"]["captured_saved_bytes"]
    assert 0 <= real.peak_bytes - chosen["peak_bytes"] <= 64, (real.peak_bytes, chosen["peak_bytes"])


@pytest.mark.slow
def test_a_plan_replaces_transformers_own_checkpointing() -> None:
    """GIVEN Llama with model.gradient_checkpointing_enable() (every layer checkpointed by
    transformers, which turns its KV cache off), WHEN analyzed, THEN the report is that step
    (peak and saved bytes equal a real one), the plans show it as a baseline beside graphmem's
    plan at its peak, and that plan applied in its place (transformers' flag off while applied,
    back on after) has its captured peak and saved bytes in a real step."""
    model, inputs = _model("llama_gqa")
    model.gradient_checkpointing_enable()
    report = graphmem.analyze(model, inputs)
    real = measure_peak(model, inputs)
    assert (report.peak_bytes, report.activation_bytes) == (real.peak_bytes, real.saved_bytes)
    summary = report.plans()
    hf, mine = summary.baselines[0]
    assert hf.name.startswith("transformers") and hf.peak_bytes == report.peak_bytes
    assert mine.peak_bytes <= hf.peak_bytes and mine.recompute_flops < hf.recompute_flops
    assert summary.no_plan_peak > report.peak_bytes  # without any checkpoints
    fresh, fresh_inputs = build("llama_gqa")
    fresh.gradient_checkpointing_enable()
    keys = list(fresh.state_dict())
    with mine.apply(fresh):
        assert not any(layer.gradient_checkpointing for layer in fresh.model.layers)
        got = measure_peak(fresh, fresh_inputs)
    assert all(layer.gradient_checkpointing for layer in fresh.model.layers) and list(fresh.state_dict()) == keys
    assert mine.verification is not None
    assert (got.peak_bytes, got.saved_bytes) == (mine.peak_bytes, mine.verification.captured_saved)


def test_fake_tensors_take_transformers_real_mask_path() -> None:
    """Llama without a KV cache (use_cache=False): transformers checks on the real run that the
    position ids are one sequence per row and builds no mask; on fake tensors it would count
    the FakeTensor as tracing and materialize one per layer (graphmem/capture/hf_paths.py)."""
    model, inputs = _model("llama_gqa")
    model.config.use_cache = False
    report = graphmem.analyze(model, inputs)
    real = measure_peak(model, inputs)
    assert (report.peak_bytes, report.activation_bytes) == (real.peak_bytes, real.saved_bytes)
