"""A zoo of real models for the checkpoint-plan tests: tiny configs from transformers, timm
and peft, random weights, CPU. Each entry builds a fresh model (same seed, same weights) and
its positional inputs (HF models are called positionally with input_ids; graphmem.analyze
takes a tuple)."""
from __future__ import annotations

from typing import Any, Callable

import torch

V, B, S = 128, 2, 32  # vocabulary, batch, sequence


def _ids(s: int = S) -> torch.Tensor:
    return torch.randint(0, V, (B, s), generator=torch.Generator().manual_seed(1))


def _decoder(kind: str) -> Callable[[], Any]:
    def build() -> Any:
        import transformers as T

        small = dict(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, max_position_embeddings=64)
        if kind == "gpt2_eager":
            m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                               attn_implementation="eager", eos_token_id=0, bos_token_id=0))
        elif kind == "gpt2_sdpa":
            m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=4, n_head=4,
                                               eos_token_id=0, bos_token_id=0))
        elif kind == "llama":
            m = T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2))
        elif kind == "qwen2":
            m = T.Qwen2ForCausalLM(T.Qwen2Config(**small, num_key_value_heads=2))
        elif kind == "bert":
            m = T.BertForMaskedLM(T.BertConfig(vocab_size=V, hidden_size=64, num_hidden_layers=4,
                                               num_attention_heads=4, intermediate_size=128))
        elif kind == "lora_llama":
            import peft

            base = T.LlamaForCausalLM(T.LlamaConfig(**small, num_key_value_heads=2))
            m = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          lora_dropout=0.0))
        else:
            raise KeyError(kind)
        return m, (_ids(),)
    return build


def _t5() -> Any:
    import transformers as T

    m = T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=64, d_kv=16, d_ff=128, num_layers=4,
                                                num_heads=4, decoder_start_token_id=0))
    return m, (_ids(), None, _ids(16))  # input_ids, attention_mask, decoder_input_ids


def _timm(name: str, size: int, batch: int, **kw: Any) -> Callable[[], Any]:
    def build() -> Any:
        import timm

        m = timm.create_model(name, pretrained=False, **kw)
        return m, (torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1)),)
    return build


# name -> (the package it needs, builder)
ZOO: dict[str, tuple[str, Callable[[], Any]]] = {
    "gpt2_eager": ("transformers", _decoder("gpt2_eager")),
    "gpt2_sdpa": ("transformers", _decoder("gpt2_sdpa")),
    "llama_gqa": ("transformers", _decoder("llama")),
    "qwen2": ("transformers", _decoder("qwen2")),
    "bert": ("transformers", _decoder("bert")),
    "t5": ("transformers", _t5),
    "vit": ("timm", _timm("vit_tiny_patch16_224", 64, 4, img_size=64, patch_size=8, depth=4, num_classes=10,
                          embed_dim=64, num_heads=4)),
    "convnext": ("timm", _timm("test_convnext", 64, 8, num_classes=10)),  # timm's tiny test ConvNeXt
    "lora_llama": ("peft", _decoder("lora_llama")),
}


def build(name: str) -> Any:
    """(model in train mode, inputs), the same weights on every call."""
    torch.manual_seed(0)
    m, inputs = ZOO[name][1]()
    return m.train(), inputs
