"""Depth reuse with the optimizer step (graphmem/capture/widen_optim.py, widen_spans.py): a step whose
optimizer runs after backward, captured with 5 blocks and widened to 8, is the 8-block capture op for
op, storage for storage (the optimizer states, the foreach step's temporaries), save for save; its
first and later steps' peaks, saved bytes, category timeline and budget rows are the full capture's;
and ``graphmem.analyze`` with reuse reports what it reports without, on real models."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import graphmem
import graphmem.step.measure as measure
from graphmem.capture.capture import capture
from graphmem.capture.reuse import capture_reusing, signature
from graphmem.capture.target import Target, make_target
from graphmem.capture.widen import widen
from graphmem.chains import find_chain, truncated
from graphmem.distributed import capture_rank, make_sharding
from graphmem.models import gpt2, llama
from graphmem.passes import liveness, saved
from graphmem.passes.later_steps import later_steps_peak
from graphmem.passes.timeline import category_timeline
from graphmem.training.spec import make_training, step_budget

N = 8  # blocks of the full capture; the widened one is captured with 5


def _llama(n: int = N) -> tuple[nn.Module, tuple, Any]:
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=n, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                          max_seq_len=32))
    return model, (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),), llama.loss


def _gpt2(n: int = N) -> tuple[nn.Module, tuple, Any]:
    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=n, n_head=2, n_embd=32))
    return model, (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),), gpt2.loss


def _hf(classes: str, n: int = N, lora: bool = False) -> tuple[nn.Module, tuple, Any]:
    from tests.zoo import _GPT2, _SMALL
    from tests.zoo import _hf as hf

    if classes.startswith("GPT2"):
        config = {**_GPT2, "n_layer": n}
    else:
        config = {**_SMALL, "num_hidden_layers": n, "num_key_value_heads": 2}
    lora_config = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0) if lora else None
    model, x = hf(classes, lora=lora_config, **config)()
    return model.train(), x, None


CUDA = ("cuda", "bf16")
# name -> (model builder, target, optimizer, implementation)
CASES: dict[str, tuple[Callable[..., tuple[nn.Module, tuple, Any]], Any, str, str]] = {
    "llama_cuda_adamw_foreach": (_llama, CUDA, "adamw", "auto"),
    "llama_cpu_adamw_forloop": (_llama, "cpu", "adamw", "auto"),
    "gpt2_cpu_momentum_foreach": (_gpt2, "cpu", "momentum", "foreach"),
    "gpt2_cpu_sgd": (_gpt2, "cpu", "sgd", "auto"),
    "llama_cuda_adamw_fused": (_llama, CUDA, "adamw", "fused"),
    "llama_cuda_adafactor": (_llama, CUDA, "adafactor", "auto"),
    "hf_llama_cpu_adamw": (lambda n=N: _hf("LlamaConfig:LlamaForCausalLM", n), "cpu", "adamw", "auto"),
    "hf_gpt2_cuda_momentum": (lambda n=N: _hf("GPT2Config:GPT2LMHeadModel", n), CUDA, "momentum", "auto"),
    "peft_lora_llama_cuda_adamw": (lambda n=N: _hf("LlamaConfig:LlamaForCausalLM", n, lora=True), CUDA, "adamw", "auto"),
    # advise's for-loop lever on a LoRA step: the last parameter stepped is the last block's, and zero_grad frees
    # every gradient after it (graphmem/capture/widen.py ``freed_at``)
    "peft_lora_llama_cuda_adamw_forloop": (lambda n=N: _hf("LlamaConfig:LlamaForCausalLM", n, lora=True), CUDA, "adamw",
                                           "forloop"),
}


def _target(t: Any) -> Target:
    return make_target(*t) if isinstance(t, tuple) else Target(t)


def _same_step(widened: Any, full: Any, training: Any, module: nn.Module) -> None:
    """Every figure the report reads from the step, widened and captured."""
    widened.check()
    assert signature(widened) == signature(full)
    assert widened.train == full.train and widened.micro_steps == full.micro_steps
    a, b = liveness(widened), liveness(full)
    assert a.timeline == b.timeline
    assert (a.peak_bytes, a.peak_index, a.peak_phase) == (b.peak_bytes, b.peak_index, b.peak_phase)  # first step
    assert later_steps_peak(widened, a) == later_steps_peak(full, b)  # later steps: the states from the start
    sa, sb = saved(widened), saved(full)
    assert sa.activation_bytes == sb.activation_bytes and sa.tensors == sb.tensors
    assert category_timeline(widened, a, sa.tensors).by_category == category_timeline(full, b, sb.tensors).by_category
    ra = step_budget(widened, a, sa, training, module, ())
    rb = step_budget(full, b, sb, training, module, ())
    assert ra == rb  # the budget's rows: parameters, gradients, optimizer states, activations, temporaries; peaks


# the transformers and peft cases are slow (CI runs them); the bundled models' stay in the quick command
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n.startswith(("hf_", "peft_")) else n
                                  for n in CASES])
def test_widened_step_with_the_optimizer_is_the_full_capture(name: str) -> None:
    # GIVEN a model of 8 identical blocks and an optimizer stepped after backward
    build, target, optimizer, impl = CASES[name]
    model, x, loss = build()
    t = _target(target)
    training = make_training(optimizer=optimizer, optimizer_impl=impl)
    chain = find_chain(model)
    assert chain is not None and chain.length == N
    # WHEN the step is captured with 5 blocks and widened to 8, and captured with 8
    with truncated(model, chain, 5):
        small = capture(model, x, loss, t, train=training.train)
    full = capture(model, x, loss, t, train=training.train)
    assert full.phase_start.get("optimizer") is not None
    widened = widen(small, chain, 5, N, [m for m, _ in model.named_modules()])
    # THEN they are the same step, and every figure read from it is the same
    _same_step(widened, full, training, model)


@pytest.mark.slow  # rank 1 of 4 through fully_shard, captured twice
def test_widened_fsdp2_rank_with_adamw_is_the_full_capture() -> None:
    # GIVEN rank 1 of 4 through fully_shard on the CUDA target, AdamW's foreach step over its DTensor shards
    model, x, loss = _llama()
    sharding = make_sharding(4, 1, fsdp=True)
    training = make_training(optimizer="adamw")
    target = _target(CUDA)
    chain = find_chain(model)
    with truncated(model, chain, 5):
        small = capture_rank(model, x, loss, target, sharding, training.train)
    full = capture_rank(model, x, loss, target, sharding, training.train)
    widened = widen(small, chain, 5, N, [m for m, _ in model.named_modules()])
    _same_step(widened, full, training, model)


def _used(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether analyze's capture took depth reuse, call by call."""
    used: list[bool] = []

    def spy(module: nn.Module, at: Any) -> Any:
        out = capture_reusing(module, at)
        used.append(out.used)
        return out

    monkeypatch.setattr(measure, "capture_reusing", spy)  # the one capture (graphmem/step/measure.py)
    return used


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama_cuda_adamw_foreach", "peft_lora_llama_cuda_adamw", "gpt2_cpu_sgd"])
def test_reports_with_the_optimizer_are_equal_with_and_without_reuse(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a 16-block model (deep enough for reuse) and an optimizer in the step (LoRA through peft for the
    # Hugging Face one: graphmem applies it)
    build, target, optimizer, _ = CASES[name]
    model, x, loss = build(16) if not name.startswith("peft") else _hf("LlamaConfig:LlamaForCausalLM", 16)
    options: dict[str, Any] = dict(optimizer=optimizer, device=target[0] if isinstance(target, tuple) else target)
    if isinstance(target, tuple):
        options["amp"] = target[1]
    if name.startswith("peft"):
        options.update(lora_rank=4, lora_targets="all-linear")
    used = _used(monkeypatch)
    # WHEN it is analyzed with depth reuse and without
    a = graphmem.analyze(model, x, loss=loss, **options).to_dict()
    b = graphmem.analyze(model, x, loss=loss, reuse=False, **options).to_dict()
    # THEN reuse was taken, and the reports are equal field by field (peaks first and later, budget rows,
    # the timeline's peak and its position, saved bytes)
    assert used == [True]
    assert a == b



@pytest.mark.slow
def test_a_chunked_loss_with_adamw_is_widened_exactly() -> None:
    # GIVEN a 16-block GPT-2 whose head and loss run checkpointed in chunks (advise's loss lever), with AdamW
    from graphmem import losses

    model, x, _ = _gpt2(16)
    wrapped = losses.ChunkedNextToken(model, "lm_head")
    train = make_training(optimizer="adamw").train
    at = lambda: capture(wrapped, x, None, _target(CUDA), train=train)  # noqa: E731
    # WHEN it is captured with depth reuse (the recompute is in the loss, outside the blocks) and without
    reused = capture_reusing(wrapped, at)
    full = at()
    # THEN reuse was taken and the step is the full capture's
    assert reused.used
    assert signature(reused.graph) == signature(full)
    a, b = liveness(reused.graph), liveness(full)
    assert a.timeline == b.timeline and later_steps_peak(reused.graph, a) == later_steps_peak(full, b)
