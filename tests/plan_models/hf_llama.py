"""A tiny Hugging Face Llama (transformers' own LlamaForCausalLM from a LlamaConfig: grouped-
query attention, rotary tables made once per step and passed to every decoder layer, a KV
cache built per step since use_cache defaults to True) for ``graphmem analyze ... --plan``.

    graphmem analyze tests/plan_models/hf_llama.py --input-shape 4x512 --plan --budget 60MiB
"""
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=6,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def model() -> torch.nn.Module:
    return LlamaForCausalLM(CONFIG)


def loss(output, inputs):  # next-token cross-entropy, as a causal LM trains
    logits, ids = output.logits, inputs[0]
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
