"""The models and targets of benchmarks/gpu_truth.py: 18 real models (transformers, peft, timm,
torchvision, torch.nn) at tiny-but-not-trivial sizes (hidden 128, sequence 128, 64x64 images:
most tensors are well above the CUDA allocator's 512 B rounding), and the targets each runs on.

Each builder returns ``(module on the CPU in train mode, seeded weights; positional inputs)``; the
same call gives the same weights and inputs, so graphmem's side (fake tensors) and the real CUDA
side see one model.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

V, B, S, IMG = 512, 2, 128, 64  # vocabulary, batch, sequence, image side
Case = tuple[nn.Module, tuple]


@dataclass(frozen=True)
class Variant:
    """One target: graphmem.analyze's dtype / amp / attention / mode, and the same on the real side."""

    name: str
    dtype: Optional[str] = None  # parameter dtype (None: fp32 as built)
    amp: Optional[str] = None  # autocast dtype on the real side: torch.autocast("cuda", dtype)
    attention: str = "auto"  # SDPA backend: the real side runs under torch.nn.attention.sdpa_kernel
    mode: str = "eager"  # compiled: torch.compile(backend="aot_eager") on the real side

    def options(self) -> dict[str, Any]:
        return dict(dtype=self.dtype, amp=self.amp, attention=self.attention, mode=self.mode)


# Every model runs the first four; attention models (SDPA inside) also the last four. Listed in the
# order the time guard keeps them: the broadest coverage first.
BASE = (Variant("fp32"), Variant("amp-bf16", amp="bf16"), Variant("bf16", dtype="bf16"),
        Variant("compiled", mode="compiled"))
ATTENTION = (Variant("sdpa-flash", dtype="bf16", attention="flash"),  # flash has no fp32 kernel
             Variant("sdpa-efficient", attention="efficient"), Variant("sdpa-math", attention="math"),
             Variant("compiled-bf16", dtype="bf16", mode="compiled"))
VARIANTS = {v.name: v for v in BASE + ATTENTION}


def _ids(s: int = S, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (B, s), generator=torch.Generator().manual_seed(1))


def _images(size: int = IMG) -> torch.Tensor:
    return torch.randn(B, 3, size, size, generator=torch.Generator().manual_seed(1))


def _hf(classes: str, lora: Optional[dict] = None, **config: Any) -> Callable[[], Case]:
    """transformers' ``Model(Config(**config))`` ("Config:Model"), optionally with peft's LoRA."""
    def build() -> Case:
        import transformers

        torch.manual_seed(0)
        cfg_cls, model_cls = classes.split(":")
        model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**config))
        if lora is not None:
            import peft

            model = peft.get_peft_model(model, peft.LoraConfig(**lora))
        if "Image" in model_cls:
            return model, (_images(),)
        if "T5" in model_cls:
            return model, (_ids(), None, _ids(S // 2))  # input_ids, attention_mask, decoder_input_ids
        return model, (_ids(),)
    return build


def _timm(name: str, **kwargs: Any) -> Callable[[], Case]:
    def build() -> Case:
        import timm

        torch.manual_seed(0)
        return timm.create_model(name, pretrained=False, **kwargs), (_images(),)
    return build


def _torchvision(name: str, **kwargs: Any) -> Callable[[], Case]:
    def build() -> Case:
        from torchvision import models

        torch.manual_seed(0)
        return getattr(models, name)(num_classes=10, **kwargs), (_images(),)
    return build


def _tv_vit() -> Case:
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)  # nn.MultiheadAttention inside: SDPA with need_weights=False
    return VisionTransformer(IMG, 8, num_layers=2, num_heads=4, hidden_dim=128, mlp_dim=256, num_classes=10), \
        (_images(),)


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
        return make(), (torch.randn(B, S, 128, generator=torch.Generator().manual_seed(1)),)
    return build


def _encoder() -> nn.Module:
    layer = nn.TransformerEncoderLayer(128, 4, 256, dropout=0.1, batch_first=True, norm_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


_LM: dict[str, Any] = dict(vocab_size=V, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=S)
_GPT2: dict[str, Any] = dict(vocab_size=V, n_positions=S, n_embd=128, n_layer=2, n_head=4)

# name -> (builder, has SDPA attention: runs the ATTENTION variants too)
ZOO: dict[str, tuple[Callable[[], Case], bool]] = {
    "hf_gpt2": (_hf("GPT2Config:GPT2LMHeadModel", **_GPT2), True),
    "hf_llama": (_hf("LlamaConfig:LlamaForCausalLM", **_LM), True),
    "hf_mistral": (_hf("MistralConfig:MistralForCausalLM", **_LM), True),
    "hf_qwen2": (_hf("Qwen2Config:Qwen2ForCausalLM", **_LM), True),
    "hf_mixtral_moe": (_hf("MixtralConfig:MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2, **_LM),
                       False),
    "hf_bert": (_hf("BertConfig:BertForMaskedLM", vocab_size=V, hidden_size=128, num_hidden_layers=2,
                    num_attention_heads=4, intermediate_size=256, max_position_embeddings=S), True),
    "hf_t5": (_hf("T5Config:T5ForConditionalGeneration", vocab_size=V, d_model=128, d_kv=32, d_ff=256,
                  num_layers=2, num_heads=4, decoder_start_token_id=0), False),  # T5 adds a position bias: no SDPA
    "hf_vit": (_hf("ViTConfig:ViTForImageClassification", hidden_size=128, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=256, image_size=IMG, patch_size=8, num_labels=10), True),
    "peft_lora_llama": (_hf("LlamaConfig:LlamaForCausalLM", lora=dict(r=8, lora_alpha=16, lora_dropout=0.1,
                                                                      target_modules=["q_proj", "v_proj"]), **_LM),
                        True),
    "timm_vit_tiny": (_timm("vit_tiny_patch16_224", num_classes=10, img_size=IMG, patch_size=8, depth=2), True),
    "timm_resnet18": (_timm("resnet18", num_classes=10), False),
    "timm_convnext_atto": (_timm("convnext_atto", num_classes=10), False),
    "torchvision_resnet18": (_torchvision("resnet18"), False),
    "torchvision_mobilenet_v3_small": (_torchvision("mobilenet_v3_small"), False),
    "torchvision_vit": (_tv_vit, True),
    "nn_transformer_encoder": (_nn(_encoder), True),
    "nn_lstm": (_nn(lambda: _Output0(nn.LSTM(128, 128, num_layers=2, batch_first=True))), False),
    "nn_gru": (_nn(lambda: _Output0(nn.GRU(128, 128, num_layers=2, batch_first=True))), False),
}


# dynamo leaves nn.LSTM / nn.GRU to eager (torch._dynamo.config.allow_rnn is False): a compiled
# step has no graph, and graphmem refuses it in one line ("torch.compile made no graph of ...")
EAGER_ONLY = ("nn_lstm", "nn_gru")


def build(name: str) -> Case:
    """(model in train mode on the CPU, inputs): the same weights and inputs on every call."""
    model, inputs = ZOO[name][0]()
    return model.train(), inputs


def rows(models: Optional[list[str]] = None, variants: Optional[list[str]] = None) -> list[tuple[str, Variant]]:
    """(model, variant) pairs, variant-major in VARIANTS' order (the time guard drops the tail)."""
    names = list(ZOO) if not models else models
    unknown = [n for n in names if n not in ZOO] + [v for v in variants or () if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown model or variant {unknown}: models {', '.join(ZOO)}; variants {', '.join(VARIANTS)}")
    wanted = [VARIANTS[v] for v in variants] if variants else list(VARIANTS.values())
    return [(n, v) for v in wanted for n in names if (v in BASE or ZOO[n][1]) and not (v.mode == "compiled" and n in EAGER_ONLY)]
