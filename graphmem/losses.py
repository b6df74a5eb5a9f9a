"""A language model's head and cross-entropy in chunks of tokens, for the step whose peak is the loss.

A plain LM loss materializes the (tokens, vocab) logits, their fp32 copy and log-softmax, and
the same again in backward: on GPT-2 at 8x1024 each fp32 (tokens, vocab) tensor is 1.53 GiB.
``chunked_cross_entropy`` takes the hidden states and the head's weight instead and runs the
head + loss for ``chunk`` tokens at a time under ``torch.utils.checkpoint`` (non-reentrant), so
forward keeps only each chunk's hidden states and backward recomputes one chunk's logits at a
time. The loss and the gradients equal the plain ones (tests/trainers/test_losses.py).

    from graphmem.losses import chunked_cross_entropy
    head = model.lm_head
    model.lm_head = torch.nn.Identity()        # the model now returns hidden states
    hidden = model(ids)                         # (b, s, d)
    loss = chunked_cross_entropy(hidden[:, :-1], head.weight, ids[:, 1:])

The module wrappers do the swap and return the loss: ``ChunkedNextToken(model)`` for a model
whose ``lm_head`` makes the logits and whose loss is next-token prediction of its first input
(graphmem's bundled gpt2 and llama), ``ChunkedCausalLM(model)`` for a Hugging Face
``*ForCausalLM`` model called with ``labels`` (shifted as transformers' ForCausalLMLoss shifts
them). They hold the head themselves, so its weight still trains (tied weights stay tied).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from graphmem.capture.recompute import recompute_scope
from graphmem.training.lora import HeadOutside

CHUNK = 1024  # tokens per chunk: (1024, vocab) fp32 is 196 MiB at GPT-2's vocab


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                ignore_index: int) -> torch.Tensor:
    return _head_chunk_loss(hidden, lambda h: F.linear(h, weight, bias), targets, ignore_index)


def _head_chunk_loss(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], targets: torch.Tensor,
                     ignore_index: int) -> torch.Tensor:
    scope = recompute_scope()  # None in a real run; in graphmem's capture, the context a recompute gets
    with scope() if scope is not None else contextlib.nullcontext():
        logits = head(hidden)  # under autocast: the autocast dtype, as the plain head
        return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                          bias: Optional[torch.Tensor] = None, chunk: int = CHUNK,
                          ignore_index: int = -100) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` (mean over the targets
    that are not ``ignore_index``), ``chunk`` tokens at a time, each chunk checkpointed."""
    return _chunked(hidden, targets, chunk, ignore_index, _chunk_loss, weight, bias)


def chunked_head_loss(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunk: int = CHUNK,
                      ignore_index: int = -100) -> torch.Tensor:
    """``chunked_cross_entropy`` through the head module itself: a head with LoRA adapters
    (graphmem's ``LoRALinear``, peft's ``lora.Linear``) runs its base layer and its adapters."""
    return _chunked(hidden, targets, chunk, ignore_index, lambda h, t, i: _head_chunk_loss(h, head, t, i))


def _chunked(hidden: torch.Tensor, targets: torch.Tensor, chunk: int, ignore_index: int,
             fn: Callable[..., torch.Tensor], *head: Optional[torch.Tensor]) -> torch.Tensor:
    """``fn(hidden chunk, *head, target chunk, ignore_index)`` summed over the chunks (each checkpointed), over the
    number of targets."""
    if chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk):
        part = checkpoint(fn, h[start:start + chunk], *head, t[start:start + chunk], ignore_index, use_reentrant=False)
        total = total + part
    return total / (t != ignore_index).sum()


def _head(module: nn.Module, where: str) -> nn.Module:
    """The output head: an ``nn.Linear``, or one wrapped with LoRA adapters (its ``base_layer``)."""
    if isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear):
        return module
    raise ValueError(f"the model's {where} is {type(module).__name__}, not an nn.Linear")


def _head_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    if type(head) is nn.Linear:  # the weight itself: the function users call (tests/trainers/test_losses.py)
        return chunked_cross_entropy(hidden, head.weight, targets, head.bias, chunk)
    return chunked_head_loss(hidden, head, targets, chunk)


class ChunkedCausalLM(HeadOutside):
    """A Hugging Face causal LM whose head runs inside ``chunked_cross_entropy``: called like the
    model (``labels`` included), it returns the loss. The head is taken out of ``model``
    (``get_output_embeddings`` swapped for an identity), so the model returns hidden states.
    ``model`` may carry peft's adapters (``get_peft_model`` first, then this wrapper)."""

    def __init__(self, model: Any, chunk: int = CHUNK) -> None:  # a transformers PreTrainedModel (or a PeftModel)
        super().__init__()
        head = _head(model.get_output_embeddings(), "output head")
        self.head, self.chunk = head, chunk
        model.set_output_embeddings(nn.Identity())
        self.model = model

    def forward(self, labels: torch.Tensor, **batch: object) -> torch.Tensor:
        hidden = self.model(**batch).logits  # the identity head: (b, s, d) hidden states
        # transformers' ForCausalLMLoss (loss/loss_utils.py): pad the labels with ignore_index, shift by one
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        return _head_loss(self.head, hidden, shifted, self.chunk)

    def whole(self) -> nn.Module:
        model: Any = self.model
        model.set_output_embeddings(self.head)
        return model

    def around(self, model: nn.Module) -> "ChunkedCausalLM":
        return ChunkedCausalLM(model, self.chunk)


class ChunkedNextToken(HeadOutside):
    """``model(ids)`` returns logits from its ``head`` (the submodule's name: ``lm_head`` in
    models/gpt2.py, ``output`` in models/llama.py); this returns the next-token loss (position t
    predicts token t + 1, as their ``loss``) with the head in chunks. The head may carry LoRA
    adapters (graphmem's ``LoRALinear``)."""

    def __init__(self, model: nn.Module, head: str = "lm_head", chunk: int = CHUNK) -> None:
        super().__init__()
        self.head, self.chunk, self.head_name = _head(model.get_submodule(head), head), chunk, head
        model.set_submodule(head, nn.Identity())
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.model(ids)  # (b, s, d)
        return _head_loss(self.head, hidden[:, :-1], ids[:, 1:], self.chunk)

    def whole(self) -> nn.Module:
        self.model.set_submodule(self.head_name, self.head)
        return self.model

    def around(self, model: nn.Module) -> "ChunkedNextToken":
        return ChunkedNextToken(model, self.head_name, self.chunk)
