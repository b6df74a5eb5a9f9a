"""peft's adapters made on the meta device (graphmem/training/peft_lora.py ``adapters_on_meta``) are the
adapters peft makes on the CPU and moves to the meta base: the same modules, parameters (name, shape,
dtype, device, requires_grad) and buffers, on transformers' Llama and GPT-2 (Conv1D), in fp32 and in bf16
(peft upcasts a 16-bit base's adapters to fp32); a float64 or real base is left to peft's own path."""
from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn as nn

from graphmem.training import peft_lora
from graphmem.training.lora import LoRA

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def _model(kind: str) -> nn.Module:
    if kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
    else:
        config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _described(model: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type, p.requires_grad) for n, p in model.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype, b.device.type) for n, b in model.named_buffers())
    return params, buffers, tuple((n, type(m).__name__) for n, m in model.named_modules())


@pytest.mark.parametrize("kind,dtype", [("llama", torch.float32), ("gpt2", torch.float32), ("llama", torch.bfloat16),
                                        ("gpt2", torch.float16)])
def test_adapters_made_on_meta_are_peft_own(kind: str, dtype: torch.dtype) -> None:
    # GIVEN a meta model in fp32 or 16 bits and LoRA on every linear layer
    lora = LoRA(rank=4, targets=("all-linear",))
    assert not isinstance(peft_lora.adapters_on_meta(_model(kind).to(dtype)), contextlib.nullcontext)
    # WHEN peft adapts it made on the meta device, and the usual way (on the CPU, then moved)
    fast, names = peft_lora.apply_peft(_model(kind).to(dtype), lora)
    with mock.patch.object(peft_lora, "adapters_on_meta", lambda m: contextlib.nullcontext()):
        usual, usual_names = peft_lora.apply_peft(_model(kind).to(dtype), lora)
    # THEN the two are the same, every adapter on the meta device
    assert names == usual_names and names
    assert _described(fast) == _described(usual)
    assert all(p.device.type == "meta" for p in fast.parameters())
    assert all(p.dtype == torch.float32 for n, p in fast.named_parameters() if "lora_" in n)


def test_a_float64_or_real_base_takes_peft_own_path() -> None:
    assert isinstance(peft_lora.adapters_on_meta(_model("llama").to(torch.float64)), contextlib.nullcontext)
    assert isinstance(peft_lora.adapters_on_meta(nn.Linear(4, 4)), contextlib.nullcontext)
