"""Every advise lever that changes a single-device step, applied to a REAL CPU step.

GIVEN a step and ``report.advise(memory=...)``'s levers (graphmem/advise/levers.py)
WHEN the lever's change is made by hand and the changed step runs for real on the CPU
(``graphmem.validate`` with the options the row names, parsed from its name as tests/advise/test_advise.py
does: the real step is torch.optim's over the real model, measured by graphmem/validation/measure.py
from the allocator's events under torch.profiler; the inputs of a smaller batch are copied, not
sliced views, so they hold what the changed step's inputs hold)
THEN the row's predicted peak (the highest of the first and later steps) equals the real one, and
the changed step's saved bytes are 0 B off.

Measured (1 CPU thread): 0 B off on every lever here. bf16 parameters with fp32 master copies read
12 B real above at the first step's peak (AdamW's update over the fp32 masters) until the capture
counted the Python float AdamW divides by, wrapped into an 8 B double and cast to a 4 B float
(graphmem/capture/wrapped_numbers.py). LoRA through peft: see the test (peft's ``scaling`` floats).

The levers checked elsewhere against real runs, or not at all, are named in docs/validation.md
("Advise levers against real steps").
"""
from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
from cases import MODELS, build
from test_advise import _options, _peak

import graphmem
from graphmem.losses import ChunkedNextToken
from graphmem.units import fmt_bytes

pytestmark = pytest.mark.usefixtures("one_thread")


def _real(module: Any, inputs: tuple, loss: Any, opts: dict[str, Any], wrap: Any = None) -> tuple[int, int, int]:
    """(predicted, real) highest peak of the changed step, and its saved bytes' difference."""
    opts = dict(opts)
    batch = opts.pop("batch", None)
    if batch is not None:
        inputs = tuple(x[:batch].clone() for x in inputs)  # its own storage, as a batch of that size has
    if wrap == "loss":
        module, loss = ChunkedNextToken(copy.deepcopy(module), "lm_head"), None
    v = graphmem.validate(module, inputs, loss=loss, **opts)
    rows = {r.name: r for r in v.rows}
    peaks = [rows[k] for k in ("peak", "peak (later steps)") if k in rows]
    return max(r.predicted for r in peaks), max(r.measured for r in peaks), rows["saved for backward"].difference


@pytest.mark.slow  # every lever weighed, then 9 real steps: about a minute here
def test_optimizer_precision_micro_batch_and_loss_levers_are_real_steps() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    inputs = (torch.cat([inputs[0], inputs[0]]),)  # batch 4: micro-batches of 2 and 1
    opts = {"optimizer": "adamw", "optimizer_impl": "foreach"}
    report = graphmem.analyze(module, inputs, loss=loss, **opts)
    advice = report.advise(memory=1)  # every lever weighed
    checked = set()
    for row in advice.levers:
        if row.kind not in ("optimizer", "precision", "micro-batches", "loss"):
            continue
        predicted, real, saved = _real(module, inputs, loss, *_options(row, opts))
        print(f"{row.name}: row {row.peak_bytes:,} real {real:,}")
        assert predicted == row.peak_bytes, row.name  # the row is the changed step's prediction
        assert saved == 0 and real == row.peak_bytes, (row.name, real, row.peak_bytes)
        checked.add(row.name)
    # foreach -> forloop or fused AdamW: left out here (the peak does not drop), the line gives the changed
    # step's peak, which is the real step's
    for impl in ("forloop", "fused"):
        predicted, real, saved = _real(module, inputs, loss, {**opts, "optimizer_impl": impl})
        row = next((r for r in advice.levers if r.name == f"adamw {impl}"), None)
        if row is None:
            why = next(x.why for x in advice.left_out if x.why.startswith(f"adamw {impl}:"))
            assert f"({fmt_bytes(predicted)})" in why, why
        else:
            assert row.peak_bytes == predicted
        print(f"adamw {impl}: predicted {predicted:,} real {real:,}")
        assert saved == 0 and real == predicted
        checked.add(f"adamw {impl}")
    assert {"adafactor instead of adamw", "momentum instead of adamw", "adamw forloop", "adamw fused", "bf16 autocast",
            "bf16 params + fp32 masters", "2 micro-batches of 2", "4 micro-batches of 1",
            "chunked LM head + cross-entropy"} <= checked, checked


@pytest.mark.parametrize("opts", [{}, {"optimizer": "adamw"}])
def test_the_batch_lever_is_a_real_step(opts: dict[str, Any]) -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    inputs = (torch.cat([inputs[0]] * 4),)  # batch 8
    report = graphmem.analyze(module, inputs, loss=loss, **opts)
    row = next(r for r in report.advise(memory=_peak(report) * 3 // 4).levers if r.kind == "batch")
    b = int(re.match(r"batch (\d+) instead of 8", row.name).group(1))  # type: ignore[union-attr]
    predicted, real, saved = _real(module, inputs, loss, {**opts, "batch": b})
    print(f"{row.name}: row {row.peak_bytes:,} real {real:,}")
    assert saved == 0 and predicted == row.peak_bytes == real


@pytest.mark.slow  # every lever weighed on a wider Llama: about 40 s here
def test_the_lora_lever_is_a_real_step() -> None:
    """LoRA on a transformers Llama: peft's get_peft_model on the real model (graphmem.validate),
    wide enough that the frozen weights' gradients and AdamW states outweigh the adapters."""
    pytest.importorskip("peft")
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (2, 8))
    batch = {"input_ids": ids, "labels": ids}
    report = graphmem.analyze(model, batch, optimizer="adamw")
    row = next(r for r in report.advise(memory=_peak(report) // 2).levers if r.name.startswith("LoRA r=16"))
    predicted, real, saved = _real(model, batch, None,  # type: ignore[arg-type]
                                   {"optimizer": "adamw", "lora_rank": 16, "lora_targets": "all-linear"})
    print(f"{row.name}: row {row.peak_bytes:,} real {real:,}")
    assert saved == 0 and predicted == row.peak_bytes
    # peft's LoRA linears multiply by the Python float ``scaling`` (peft/tuners/lora/layer.py), which
    # eager wraps in a 0-dim float64 tensor (8 B) that MulBackward0 keeps until the backward, invisible
    # to fake tensors (as tests/distributed/test_distributed_step.py measures): at most 8 B per adapted linear.
    # Measured: 104 B = 13 of the 14 (q, k, v, o, gate, up, down of 2 layers) at the peak, in backward.
    adapted = 7 * model.config.num_hidden_layers
    assert 0 <= real - row.peak_bytes <= 8 * adapted, (real, row.peak_bytes)


@pytest.mark.slow  # every lever weighed on a 4-layer Llama, then 2 real steps: about 40 s here
def test_the_kv_cache_lever_and_the_plan_without_the_cache_are_real_steps() -> None:
    """GIVEN a transformers Llama whose config leaves ``use_cache`` on (as from_pretrained does), analyzed from
    ``input_shape`` with AdamW, and advised in too little memory
    WHEN the "KV cache off" row and the checkpoint plan's row (planned with the cache off, as transformers'
    gradient checkpointing runs it) are made by hand: the same batch with ``use_cache=False``, the plan applied
    THEN each row's peak is graphmem.validate's prediction and the real CPU step's peak, and saved bytes are 0 B
    off; the plan is the proven optimum (the blocks' memory adds up without the cache)."""
    import transformers

    from graphmem.capture.hf import HFOptions

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    assert model.config.use_cache
    opts = {"optimizer": "adamw"}
    report = graphmem.analyze(model, input_shape="2x32", **opts)
    assert report.batch["use_cache"].startswith("on")
    without = graphmem.analyze(model, input_shape="2x32", hf=HFOptions(use_cache=False), **opts)
    advice = report.advise(memory=(_peak(report) + without.plan(max_overhead=1.0).peak_bytes) // 2)  # a plan fits
    rows = {r.kind: r for r in advice.levers}
    batch = dict(report.source.spec.inputs.make((2, 32)).kwargs)  # the batch graphmem made (labels a copy of the ids)
    off = {**batch, "use_cache": False}
    # the lever: the same step with the cache off
    cache = rows.get("cache") or next(x for x in advice.left_out if x.kind == "cache")
    predicted, real, saved = _real(model, off, None, opts)  # type: ignore[arg-type]
    print(f"KV cache off: predicted {predicted:,} real {real:,}")
    assert saved == 0 and real == predicted
    if isinstance(cache, type(advice.levers[0])):
        assert cache.name == "KV cache off" and cache.peak_bytes == predicted
    else:
        assert f"({fmt_bytes(predicted)})" in cache.why, cache.why
    # the plan: planned on the step without the cache, proven optimal, its row the real step's
    plan_row = rows["checkpoint"]
    assert plan_row.name.endswith(", KV cache off") and "--use-cache off" in plan_row.how, plan_row
    plan = without.plan(budget=advice.memory)
    assert plan.verification is not None and plan.verification.proven
    with plan.apply(model):
        predicted, real, saved = _real(model, off, None, opts)  # type: ignore[arg-type]
    print(f"{plan_row.name}: row {plan_row.peak_bytes:,} predicted {predicted:,} real {real:,}")
    assert saved == 0 and predicted == plan_row.peak_bytes == real
