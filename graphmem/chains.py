"""Chains of blocks: the ModuleList/Sequential of identical blocks a model repeats, and the
model cut to its first k blocks (depth reuse, formulas and plans all capture shallower copies)."""
from __future__ import annotations

import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterator, Optional

import torch.nn as nn


@dataclass(frozen=True)
class Chain:
    path: str  # the ModuleList / Sequential holding the repeated blocks
    length: int


def find_chain(model: nn.Module) -> Optional[Chain]:
    """The longest ModuleList/Sequential of >= 2 children of one class with equal parameter shapes."""
    best: Optional[Chain] = None
    for path, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.Sequential)) or len(m) < 2:
            continue
        sigs = {(type(c), tuple((n, tuple(p.shape)) for n, p in c.named_parameters())) for c in m}
        if len(sigs) == 1 and (best is None or len(m) > best.length):
            best = Chain(path, len(m))
    return best


@contextlib.contextmanager
def truncated(model: nn.Module, chain: Optional[Chain], k: Optional[int]) -> Iterator[None]:
    """Run the model with only the first k blocks of the chain (restored afterwards)."""
    if chain is None or k is None or k >= chain.length:
        yield
        return
    holder = model.get_submodule(chain.path)
    original = holder._modules
    holder._modules = OrderedDict(list(original.items())[:k])
    try:
        yield
    finally:
        holder._modules = original


@contextlib.contextmanager
def selected(model: nn.Module, chain: Chain, blocks: list[int]) -> Iterator[None]:
    """Run the model with only the chain's ``blocks`` (their indices, in order), renumbered from 0 as
    the chain's own: a chain cut in the middle as ``truncated`` cuts its end (restored afterwards)."""
    holder = model.get_submodule(chain.path)
    original = holder._modules
    items = list(original.values())
    holder._modules = OrderedDict((str(n), items[i]) for n, i in enumerate(blocks))
    try:
        yield
    finally:
        holder._modules = original
