"""graphmem.losses: the chunked LM head + cross-entropy gives the plain loss's value and gradients,
on graphmem's bundled GPT-2 (tied head) and Llama, and on Hugging Face causal LMs (tests/zoo.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from cases import MODELS, build

from graphmem.losses import ChunkedCausalLM, ChunkedNextToken, chunked_cross_entropy


def _same_grads(plain: torch.nn.Module, wrapped: torch.nn.Module, head: str) -> None:
    """Every parameter's gradient, by name: the wrapper holds ``model.<name>`` and its head as ``head.*``."""
    theirs = dict(wrapped.named_parameters(remove_duplicate=False))
    names = [n for n, _ in plain.named_parameters(remove_duplicate=False)]
    assert names and len(theirs) == len(names)
    for name, p in plain.named_parameters(remove_duplicate=False):
        q = theirs["head." + name[len(head) + 1:] if name.startswith(head + ".") else "model." + name]
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,head", [("gpt2_sdpa", "lm_head"), ("llama_sdpa", "output")])
@pytest.mark.parametrize("chunk", [5, 1024])
def test_bundled_models_loss_and_gradients_equal_the_plain_loss(name: str, head: str, chunk: int) -> None:
    module, inputs, loss = build(MODELS, name)
    twin = copy.deepcopy(module)
    torch.manual_seed(1)  # the same dropout masks in both
    plain = loss(module(*inputs), inputs)
    plain.backward()
    wrapped = ChunkedNextToken(twin, head, chunk=chunk)
    torch.manual_seed(1)
    chunked = wrapped(*inputs)
    chunked.backward()
    torch.testing.assert_close(chunked, plain)
    _same_grads(module, wrapped, head)
    assert sum(1 for _ in wrapped.parameters()) == sum(1 for _ in module.parameters())  # a tied head stays tied


@pytest.mark.parametrize("name", ["llama_gqa", "gpt2_sdpa"])
def test_hf_causal_lm_loss_and_gradients_equal_transformers_loss(name: str) -> None:
    pytest.importorskip("transformers")
    from zoo import build as zoo_build

    model, (ids,) = zoo_build(name)
    twin = copy.deepcopy(model)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored positions, as a padded batch has
    torch.manual_seed(1)  # the same dropout masks in both
    plain = model(input_ids=ids, labels=labels).loss
    plain.backward()
    wrapped = ChunkedCausalLM(twin, chunk=7)
    torch.manual_seed(1)
    chunked = wrapped(input_ids=ids, labels=labels)
    chunked.backward()
    torch.testing.assert_close(chunked, plain)
    _same_grads(model, wrapped, "lm_head")


def test_chunked_cross_entropy_is_the_plain_one_under_bf16_autocast() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, requires_grad=True)
    targets = torch.randint(0, 50, (3, 11), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = torch.nn.functional.cross_entropy(
            torch.nn.functional.linear(hidden, weight).float().reshape(-1, 50), targets.reshape(-1))
        chunked = chunked_cross_entropy(hidden, weight, targets, chunk=4)
    torch.testing.assert_close(chunked, plain)
    ga = torch.autograd.grad(plain, (hidden, weight))
    gb = torch.autograd.grad(chunked, (hidden, weight))
    for a, b in zip(ga, gb):  # each chunk's bf16 matmul rounds on its own: bf16's tolerance
        torch.testing.assert_close(b, a, rtol=1.6e-2, atol=2e-3)


def test_bad_chunk_and_head() -> None:
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(torch.zeros(2, 4), torch.zeros(3, 4), torch.zeros(2, dtype=torch.long), chunk=0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.lm_head = torch.nn.Embedding(3, 4)
    with pytest.raises(ValueError, match="nn.Linear"):
        ChunkedNextToken(model)
