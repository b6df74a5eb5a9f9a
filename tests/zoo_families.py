"""The accuracy zoo: real models from transformers, timm, peft, torchvision and torch.nn at tiny sizes,
for tests/test_zoo_accuracy.py. Each entry builds (module, inputs) with random weights; a
missing library skips its entries (pytest.importorskip)."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn

Case = tuple[nn.Module, tuple]


def _hf(name: str, **config: object) -> Callable[[], Case]:
    def build() -> Case:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        cfg_cls, model_cls = name.split(":")
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config))
        if "Image" in model_cls:
            return model, (torch.randn(2, 3, 32, 32),)
        return model, (torch.randint(0, int(config.get("vocab_size", 128)), (2, 16)),)  # type: ignore[call-overload]
    return build


_LM = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def _timm(name: str, **kwargs: object) -> Callable[[], Case]:
    def build() -> Case:
        timm = pytest.importorskip("timm")
        torch.manual_seed(0)
        return timm.create_model(name, num_classes=10, **kwargs), (torch.randn(2, 3, 32, 32),)
    return build


def _torchvision(name: str) -> Callable[[], Case]:
    def build() -> Case:
        models = pytest.importorskip("torchvision.models")
        torch.manual_seed(0)
        return getattr(models, name)(num_classes=10), (torch.randn(2, 3, 32, 32),)
    return build


def _peft_gpt2() -> Case:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                                                                n_head=4))
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"],
                                                      lora_dropout=0.1))
    return model, (torch.randint(0, 128, (2, 16)),)


class _Output0(nn.Module):
    """nn.LSTM / nn.GRU return (output, state): train on the output."""

    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


def _lstm() -> Case:
    torch.manual_seed(0)
    return _Output0(nn.LSTM(32, 48, num_layers=2, batch_first=True)), (torch.randn(2, 16, 32),)


def _gru() -> Case:
    torch.manual_seed(0)
    return _Output0(nn.GRU(32, 48, num_layers=2, batch_first=True)), (torch.randn(2, 16, 32),)


def _encoder() -> Case:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), (torch.randn(2, 16, 32),)


CONV = "oneDNN convolution scratch (weight/activation reorders; no rule outside channels-last depthwise: passes/oprules.py)"

# name -> (build, peak tolerance (real - predicted) / real, the kernel whose scratch explains any gap).
# Measured on this machine (2 threads): every model without a convolution within 0.13 % (the LSTM's
# one fp32 (4H) bias buffer; GPT-2 48 B); with one, the gap is oneDNN's convolution scratch.
ZOO: dict[str, tuple[Callable[[], Case], float, str]] = {
    "hf_gpt2": (_hf("GPT2Config:GPT2LMHeadModel", vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4), 0.01, ""),
    "hf_llama": (_hf("LlamaConfig:LlamaForCausalLM", **_LM), 0.01, ""),
    "hf_mistral": (_hf("MistralConfig:MistralForCausalLM", **_LM), 0.01, ""),
    "hf_qwen2": (_hf("Qwen2Config:Qwen2ForCausalLM", **_LM), 0.01, ""),
    "hf_mixtral_moe": (_hf("MixtralConfig:MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **_LM), 0.01, ""),
    "hf_qwen2_moe": (_hf("Qwen2MoeConfig:Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                         shared_expert_intermediate_size=32, **_LM), 0.01, ""),
    "hf_bert": (_hf("BertConfig:BertForMaskedLM", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=64), 0.01, ""),
    "hf_vit": (_hf("ViTConfig:ViTForImageClassification", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                   intermediate_size=64, image_size=32, patch_size=8, num_labels=10), 0.01, CONV),  # measured 0.20 %
    "peft_lora_gpt2": (_peft_gpt2, 0.01, ""),
    "nn_lstm": (_lstm, 0.01, ""),
    "nn_gru": (_gru, 0.01, ""),
    "nn_transformer_encoder": (_encoder, 0.01, ""),
    "timm_vit_tiny": (_timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 0.05, CONV),  # 2.25 %
    "timm_resnet18": (_timm("resnet18"), 0.01, CONV),  # 0.09 %
    "torchvision_resnet18": (_torchvision("resnet18"), 0.01, CONV),  # 0.09 %
    "torchvision_mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), 0.05, CONV),  # 1.20 %
    # its peak is a depthwise 7x7 weight gradient (oneDNN's 16x16-blocked grouped kernel, 1,024x the
    # weight): graphmem/capture/workspace_conv.py; measured 0 B apart (was 26.7 % before that rule)
    "timm_convnext_atto": (_timm("convnext_atto"), 0.01, ""),
}
