"""A 4-block GPT-2 with explicit attention and dropout, small enough for many captures."""
import torch
import torch.nn.functional as F

from graphmem.models import gpt2


def model() -> torch.nn.Module:
    return gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=64, n_layer=4, n_head=2, n_embd=32, attention="explicit"))


def loss(output: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]), inputs[0][:, 1:].reshape(-1))
