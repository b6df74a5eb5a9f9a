"""A 2-layer LLaMA (GQA, RoPE buffers computed at init, RMSNorm, SwiGLU) for a real step in a test."""
from graphmem.models import llama


def model():
    return llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                         ffn_hidden=64, max_seq_len=32))


def loss(output, inputs):
    return llama.loss(output, inputs)
