"""A 2-layer GPT-2 (SDPA attention, dropout) small enough for a real step in a test."""
from graphmem.models import gpt2


def model() -> gpt2.GPT:
    return gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=2, n_head=2, n_embd=32))


loss = gpt2.loss
