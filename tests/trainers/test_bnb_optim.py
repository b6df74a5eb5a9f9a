"""bitsandbytes' 8-bit Adam in graphmem's own loop (``optimizer='adamw8bit'``, ``paged_adamw8bit``,
``adam8bit``: graphmem/training/optim.py) against the same loop run for real on the CPU with the real
bitsandbytes optimizer (graphmem/validation/measure.py): the optimizer states and the first and later
steps' peaks to the byte.

The last bytes were Python floats bitsandbytes' CPU kernels (bitsandbytes/backends/cpu/ops.py
``_optimizer_update_8bit_blockwise_cpu``, ``_optimizer_update_32bit_cpu``) divide or multiply by at
their widest point: the Python argument parser wraps each into an 8 B double tensor and the op casts it
to a 4 B float one, inside the bitsandbytes op, never a fake tensor (the profiler's allocation events
put them under ``bitsandbytes::optimizer_update_*``): 12 B in the kernels' rule (graphmem/oprules/bnb.py).
"""
from __future__ import annotations

import json
from math import ceil
from typing import Any

import pytest
import torch
from cases import MODELS, build, tiny_gpt, tokens

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.training.loop import TrainStep, make_train_step
from graphmem.validation.measure import measure_peak

bnb = pytest.importorskip("bitsandbytes")
MIN_8BIT_SIZE, BLOCK, QMAP = 4096, 256, 256  # bitsandbytes/optim/optimizer.py Optimizer2State (0.50)


@pytest.fixture(autouse=True)
def _fresh_overrides() -> None:
    """bitsandbytes' GlobalOptimManager is one per process: a transformers Trainer with adamw_bnb_8bit
    registers 32-bit states for each Embedding's weight there (Trainer.create_optimizer), and an
    earlier test's entries, matched by ``id`` of a parameter, reach a later model's parameters when
    ids are reused. Each test starts with none, as a fresh process does."""
    bnb.optim.GlobalOptimManager.get_instance().initialize()


def _close(predicted: int, real: int) -> None:
    assert predicted == real, (predicted, real)


def _state_bytes(params: list[torch.Tensor]) -> int:
    """bitsandbytes' init_state: >= min_8bit_size elements: two uint8 states and two fp32 absmax of one
    value per 256-block; smaller: two fp32 states; one pair of 256-entry fp32 maps for the optimizer."""
    total = 0
    for p in params:
        n = p.numel()
        total += 2 * n + 2 * 4 * ceil(n / BLOCK) if n >= MIN_8BIT_SIZE else 2 * 4 * n
    return total + 2 * 4 * QMAP


def _check(module: torch.nn.Module, inputs: Any, loss: Any, opt: str) -> Any:
    r = graphmem.analyze(module, inputs, loss=loss, optimizer=opt)
    assert r.step is not None and r.budget is not None
    r.step.check()
    b = r.budget.rank
    first = measure_peak(module, inputs, loss, train=TrainStep(opt))
    later = measure_peak(module, inputs, loss, train=TrainStep(opt), warm_steps=1)
    assert b.row("optimizer states").size == first.state_bytes == later.state_bytes
    assert first.state_bytes == _state_bytes([p for p in module.parameters() if p.requires_grad])
    assert r.activation_bytes == first.saved_bytes and r.baseline_bytes == first.baseline_bytes
    _close(b.peak_bytes, first.peak_bytes)
    _close(b.later_peak_bytes, later.peak_bytes)
    return r


@pytest.mark.parametrize("opt", ["adamw8bit", "paged_adamw8bit", "adam8bit"])
def test_8bit_adam_matches_a_real_step(opt: str) -> None:
    """States to the byte (and to bitsandbytes' own layout); the first step peaks in its CPU kernel."""
    torch.manual_seed(0)
    module, inputs, loss = build(MODELS, "gpt2_explicit")
    r = _check(module, inputs, loss, opt)
    b = r.budget.rank
    assert b.peak_phase == "optimizer" and b.peak_op.startswith("bitsandbytes.optimizer_update")
    assert set(b.states_by_name) == {"state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2"}
    assert b.states_by_name["qmap1"] == b.states_by_name["qmap2"] == 4 * QMAP  # one pair, shared
    d = r.to_dict()["budget"]
    assert (d["optimizer"], d["impl"]) == (opt, "bitsandbytes")


@pytest.mark.parametrize("case", ["gpt2_explicit", "llama"])
def test_8bit_adamw_stepped_in_backward(case: str) -> None:
    """GIVEN optimizer_in_backward with bitsandbytes' AdamW8bit: one optimizer per parameter, each with its own
    pair of quantization maps from its construction on, used only by a parameter of >= 4096 elements (smaller ones
    keep 32-bit states); WHEN analyzed on the CPU target THEN every pair is held before the step as in the real
    one (the baseline to the byte), the states to the byte, the peaks in backward to the byte (28 B under on the
    GPT and 12 B on the Llama before the kernels' Python-float tensors were counted, module docstring)."""
    torch.manual_seed(0)
    module, inputs, loss = (build(MODELS, case) if case != "llama" else _tiny_llama())
    kw: dict[str, Any] = {"optimizer": "adamw8bit", "optimizer_in_backward": True}
    r = graphmem.analyze(module, inputs, loss=loss, **kw)
    assert r.budget is not None
    b = r.budget.rank
    first = measure_peak(module, inputs, loss, train=make_train_step(**kw))
    later = measure_peak(module, inputs, loss, train=make_train_step(**kw), warm_steps=1)
    maps = 2 * 4 * QMAP * sum(1 for p in module.parameters() if p.requires_grad)  # every optimizer's pair
    assert r.baseline_bytes == first.baseline_bytes >= maps
    assert b.row("optimizer states").size == first.state_bytes == later.state_bytes
    assert b.peak_phase == "backward"
    _close(b.peak_bytes, first.peak_bytes)
    _close(b.later_peak_bytes, later.peak_bytes)


def _tiny_llama() -> tuple[torch.nn.Module, Any, None]:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 16))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, None


def test_8bit_adamw_on_a_transformers_llama() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 128, (2, 16))
    _check(model, {"input_ids": ids, "labels": ids}, None, "adamw8bit")


def test_validate_with_8bit_adamw() -> None:
    torch.manual_seed(0)
    v = graphmem.validate(tiny_gpt(), tokens(), optimizer="adamw8bit")
    assert v.ok, v.reason
    assert v.row("optimizer states").difference == 0 and v.row("before the step").difference == 0


def test_cli_analyze_prints_the_8bit_states(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x8", "--optimizer", "adamw8bit"]) == 0
    out = capsys.readouterr().out
    assert "adamw8bit (bitsandbytes)" in out and "state1" in out and "qmap1" in out
    assert main(["analyze", "gpt2", "--input-shape", "1x8", "--optimizer", "adamw8bit", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)["budget"]
    assert d["optimizer"] == "adamw8bit"


@pytest.mark.parametrize("kwargs,phrase", [
    ({"optimizer": "adamw8bit", "optimizer_impl": "foreach"}, "drop `optimizer_impl`"),
    ({"optimizer": "paged_adamw8bit", "device": "cuda"}, "cudaMallocManaged"),
    ({"optimizer": "adamw8bit", "fsdp": "fully_shard", "world_size": 2}, "one device"),
])
def test_what_is_not_run_is_one_line(kwargs: dict, phrase: str) -> None:
    module, inputs, loss = build(MODELS, "mlp")
    with pytest.raises(UsageError, match=phrase):
        graphmem.analyze(module, inputs, loss=loss, **kwargs)
