"""The zoo: real models from transformers, timm, peft, torchvision and torch.nn at tiny sizes, random
weights, CPU, built by one set of helpers. Each builder returns (module, positional inputs): HF models
are called positionally with input_ids; graphmem.analyze takes a tuple.

- ``ZOO`` (name -> (the package it needs, builder)) and ``build(name)``: the checkpoint-plan zoo,
  tests/planning/test_zoo_plans.py;
- ``ACCURACY`` (name -> (builder, peak tolerance, the kernel that explains any gap)): the accuracy
  zoo, tests/capture/test_zoo_accuracy.py and tests/compiled/test_compiled_rules.py. Its builders skip the test when
  their library is missing (pytest.importorskip) and seed their own weights.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn

V, B, S = 128, 2, 32  # vocabulary, batch, sequence
Case = tuple[nn.Module, tuple]


def _ids(s: int = S, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (B, s), generator=torch.Generator().manual_seed(1))


def _images(size: int, batch: int = B) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _hf(classes: str, seq: int = S, lora: Optional[dict] = None, **config: Any) -> Callable[[], Case]:
    """transformers' ``Model(Config(**config))`` ("Config:Model"), optionally wrapped by peft's LoRA;
    token inputs (B, seq), or (B, 3, 32, 32) images for an image model."""
    def build() -> Case:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg_cls, model_cls = classes.split(":")
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config))
        if lora is not None:
            peft = pytest.importorskip("peft")
            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        if "Image" in model_cls:
            return model, (_images(32),)
        return model, (_ids(seq, int(config.get("vocab_size", V))),)
    return build


def _t5() -> Case:
    build = _hf("T5Config:T5ForConditionalGeneration", vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=4,
                num_heads=4, decoder_start_token_id=0)
    model, (ids,) = build()
    return model, (ids, None, _ids(16))  # input_ids, attention_mask, decoder_input_ids


def _timm(name: str, size: int = 32, batch: int = B, **kwargs: Any) -> Callable[[], Case]:
    def build() -> Case:
        timm = pytest.importorskip("timm")
        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, **kwargs), (_images(size, batch),)
    return build


def _torchvision(name: str) -> Callable[[], Case]:
    def build() -> Case:
        models = pytest.importorskip("torchvision.models")
        torch.manual_seed(0)
        return getattr(models, name)(num_classes=10), (_images(32),)
    return build


class _Output0(nn.Module):
    """nn.LSTM / nn.GRU return (output, state): train on the output."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _nn(make: Callable[[], nn.Module]) -> Callable[[], Case]:
    def build() -> Case:
        torch.manual_seed(0)
        return make(), (torch.randn(B, 16, 32, generator=torch.Generator().manual_seed(1)),)
    return build


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


# -- the checkpoint-plan zoo -------------------------------------------------------------------
_SMALL = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              max_position_embeddings=64)
_GPT2 = dict(vocab_size=V, n_positions=64, n_embd=64, n_layer=4, n_head=4, eos_token_id=0, bos_token_id=0)

# name -> (the package it needs, builder)
ZOO: dict[str, tuple[str, Callable[[], Any]]] = {
    "gpt2_eager": ("transformers", _hf("GPT2Config:GPT2LMHeadModel", attn_implementation="eager", **_GPT2)),
    "gpt2_sdpa": ("transformers", _hf("GPT2Config:GPT2LMHeadModel", **_GPT2)),
    "llama_gqa": ("transformers", _hf("LlamaConfig:LlamaForCausalLM", num_key_value_heads=2, **_SMALL)),
    "qwen2": ("transformers", _hf("Qwen2Config:Qwen2ForCausalLM", num_key_value_heads=2, **_SMALL)),
    "bert": ("transformers", _hf("BertConfig:BertForMaskedLM", vocab_size=V, hidden_size=64, num_hidden_layers=4,
                                 num_attention_heads=4, intermediate_size=128)),
    "t5": ("transformers", _t5),
    "vit": ("timm", _timm("vit_tiny_patch16_224", 64, 4, img_size=64, patch_size=8, depth=4, num_classes=10,
                          embed_dim=64, num_heads=4)),
    "convnext": ("timm", _timm("test_convnext", 64, 8, num_classes=10)),  # timm's tiny test ConvNeXt
    "lora_llama": ("peft", _hf("LlamaConfig:LlamaForCausalLM", num_key_value_heads=2,
                               lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
                               **_SMALL)),
}


def build(name: str) -> Any:
    """(model in train mode, inputs), the same weights on every call."""
    torch.manual_seed(0)
    m, inputs = ZOO[name][1]()
    return m.train(), inputs


# -- the accuracy zoo ----------------------------------------------------------------------------
_LM = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)
_TINY_GPT2 = dict(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4)

CONV = "oneDNN convolution scratch (weight/activation reorders; no rule outside channels-last depthwise: graphmem/oprules/conv.py)"

# name -> (build, peak tolerance (real - predicted) / real, the kernel whose scratch explains any gap).
# Measured on this machine (2 threads): every model without a convolution within 0.13 % (the LSTM's
# one fp32 (4H) bias buffer; GPT-2 48 B); with one, the gap is oneDNN's convolution scratch.
ACCURACY: dict[str, tuple[Callable[[], Case], float, str]] = {
    "hf_gpt2": (_hf("GPT2Config:GPT2LMHeadModel", 16, **_TINY_GPT2), 0.01, ""),
    "hf_llama": (_hf("LlamaConfig:LlamaForCausalLM", 16, **_LM), 0.01, ""),
    "hf_mistral": (_hf("MistralConfig:MistralForCausalLM", 16, **_LM), 0.01, ""),
    "hf_qwen2": (_hf("Qwen2Config:Qwen2ForCausalLM", 16, **_LM), 0.01, ""),
    "hf_mixtral_moe": (_hf("MixtralConfig:MixtralForCausalLM", 16, num_local_experts=4, num_experts_per_tok=2, **_LM),
                       0.01, ""),
    "hf_qwen2_moe": (_hf("Qwen2MoeConfig:Qwen2MoeForCausalLM", 16, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=16, shared_expert_intermediate_size=32, **_LM), 0.01, ""),
    "hf_bert": (_hf("BertConfig:BertForMaskedLM", 16, vocab_size=V, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64), 0.01, ""),
    "hf_vit": (_hf("ViTConfig:ViTForImageClassification", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, image_size=32, patch_size=8, num_labels=10), 0.01, ""),  # 0 B (0.20 % before
    # graphmem/oprules/conv_jit.py)
    "peft_lora_gpt2": (_hf("GPT2Config:GPT2LMHeadModel", 16, lora=dict(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                                      lora_dropout=0.1), **_TINY_GPT2), 0.01, ""),
    "nn_lstm": (_nn(lambda: _Output0(nn.LSTM(32, 48, num_layers=2, batch_first=True))), 0.01, ""),
    "nn_gru": (_nn(lambda: _Output0(nn.GRU(32, 48, num_layers=2, batch_first=True))), 0.01, ""),
    "nn_transformer_encoder": (_nn(_encoder), 0.01, ""),
    # the patch embedding's weight gradient: graphmem/oprules/conv_jit.py; 0 B (2.25 % before)
    "timm_vit_tiny": (_timm("vit_tiny_patch16_224", num_classes=10, img_size=32, patch_size=8, depth=2), 0.01, ""),
    "timm_resnet18": (_timm("resnet18", num_classes=10), 0.01, CONV),  # 0.09 %
    "torchvision_resnet18": (_torchvision("resnet18"), 0.01, CONV),  # 0.09 %
    # NCHW depthwise backward: graphmem/oprules/conv_dw.py; measured 0 B apart (1.20 % before)
    "torchvision_mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), 0.01, ""),
    # its peak is a depthwise 7x7 weight gradient (oneDNN's 16x16-blocked grouped kernel, 1,024x the
    # weight): graphmem/oprules/conv.py; measured 0 B apart (was 26.7 % before that rule)
    "timm_convnext_atto": (_timm("convnext_atto", num_classes=10), 0.01, ""),
}
