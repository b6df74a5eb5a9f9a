"""Module paths by the call path: a module registered under several names (one ``nn.SiLU`` or
RoPE module shared by every block, as torchtune's Llama builders do) is named, at each call, by
the name under the innermost module on the call stack (``layers.5.mlp.activation`` when block 5
calls it), not by its first name in ``named_modules()``, which would put every block's tensors
on block 0.

Known limitations: a shared module called from outside every module it is registered under takes
its shortest name under the innermost enclosing module on the stack (the root, at worst).
"""
from __future__ import annotations

import torch.nn as nn


def module_names(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every name of each module (``named_modules(remove_duplicate=False)``), in that order."""
    names: dict[int, list[str]] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
    return {k: tuple(v) for k, v in names.items()}


def module_order(model: nn.Module) -> list[str]:
    """Every module path, shared modules under each of their names, ``named_modules`` order."""
    return list(dict.fromkeys(name for name, _ in model.named_modules(remove_duplicate=False)))


def call_path(names: tuple[str, ...], stack: list[str]) -> str:
    """Which of a module's ``names`` it is called through: the shortest one under the innermost
    path on the call ``stack`` (outermost first, "" the root) that holds any of them."""
    if len(names) == 1:
        return names[0]
    for outer in reversed(stack):
        prefix = outer + "." if outer else ""
        under = [n for n in names if n.startswith(prefix)]
        if under:
            return min(under, key=lambda n: n.count("."))  # (min keeps the first of equal depth)
    return names[0]
