"""LoRA (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") as PEFT builds
it: each targeted ``nn.Linear`` becomes ``base(x) + lora_B(lora_A(dropout(x))) * alpha / r``
with a trainable ``lora_A`` (r x in) and ``lora_B`` (out x r); every other parameter, the base
weights included, is frozen (requires_grad=False: no gradient, no optimizer state).

graphmem wraps a structural copy whose parameters are meta tensors (no real memory, the
user's module untouched); ``inplace=True`` wraps a real module (the ground-truth tests).
This hand-written wrapper is for plain modules; Hugging Face models get peft's own layers
(graphmem/training/peft_lora.py), so Conv1D and other projections work as peft adapts them.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, cast

import torch
import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.training.peft_lora import apply_peft, is_hf_model


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        self.base_layer = base
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, **kw)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling


class HeadOutside(nn.Module):
    """A wrapper that holds its model's output head outside the model (graphmem/losses.py's
    chunked heads). LoRA adapts the whole model, as a user adapts it before wrapping it: the head
    is put back (``whole``), the model adapted (peft for a Hugging Face model), and wrapped again
    (``around``), its head taken out where this wrapper's was (an adapted head stays adapted)."""

    model: nn.Module

    def whole(self) -> nn.Module:
        """``model`` with its head back in place; this wrapper is spent (call it on a copy)."""
        raise NotImplementedError

    def around(self, model: nn.Module) -> "HeadOutside":
        """A wrapper of this kind around ``model`` (its head taken out as this one's was)."""
        raise NotImplementedError


def adapted_model(module: nn.Module) -> nn.Module:
    """The model LoRA adapts: a ``HeadOutside`` wrapper's model, else ``module`` itself."""
    return module.model if isinstance(module, HeadOutside) else module


@dataclass(frozen=True)
class LoRA:
    rank: int
    targets: tuple[str, ...]  # substrings of module names
    alpha: float = 8.0  # PEFT's default lora_alpha
    dropout: float = 0.0  # PEFT's default lora_dropout

    def describe(self) -> str:
        return f"LoRA r={self.rank} on {','.join(self.targets)}"

    def to_dict(self) -> dict[str, object]:
        return {"rank": self.rank, "targets": list(self.targets), "alpha": self.alpha, "dropout": self.dropout}


def make_lora(rank: Optional[int], targets: Optional[str | tuple[str, ...] | list[str]],
              alpha: Optional[float] = None) -> Optional[LoRA]:
    if rank is None and not targets and alpha is None:
        return None
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise UsageError(f"`lora_rank` must be a positive integer, got {rank!r}")
    names = tuple(t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets or ()) if t.strip())
    if not names:
        raise UsageError("`lora_rank` needs `lora_targets`: module-name substrings of the linear layers to adapt, "
                         "e.g. qkv,proj, or all-linear")
    if alpha is not None and (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0):
        raise UsageError(f"`lora_alpha` must be a positive number, got {alpha!r}")
    return LoRA(rank, names, 8.0 if alpha is None else float(alpha))


def meta_copy(module: nn.Module) -> nn.Module:
    """A structural copy whose parameters and buffers are meta tensors of the same shape,
    dtype and requires_grad (ties kept): modules can be swapped in it freely."""
    memo: dict[int, object] = {}
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in memo:
            meta = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device="meta")
            memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(module, memo)
    except Exception as e:
        raise UsageError(f"cannot copy {type(module).__name__} to add LoRA adapters ({type(e).__name__}: "
                         f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}); wrap the linear layers yourself "
                         "and pass the module without `lora_rank`") from e


def apply_lora(module: nn.Module, lora: LoRA, inplace: bool = False) -> tuple[nn.Module, tuple[str, ...]]:
    """The module with LoRA on every nn.Linear whose name contains a target (``all-linear``:
    every one), and the wrapped names. Everything but the adapters is frozen. A Hugging Face
    model gets peft's own adapters instead (graphmem/training/peft_lora.py); a ``HeadOutside``
    wrapper's model is adapted whole, its head included, and wrapped again."""
    if isinstance(module, HeadOutside):
        wrapper = module if inplace else cast(HeadOutside, meta_copy(module))
        model, names = apply_lora(wrapper.whole(), lora, inplace=True)
        return module.around(model), names
    if is_hf_model(module):
        return apply_peft(module if inplace else meta_copy(module), lora)
    model = module if inplace else meta_copy(module)
    every = lora.targets == ("all-linear",)
    found = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.Linear) and (every or any(t in name for t in lora.targets))]
    if not found:
        linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        shown = ", ".join(dict.fromkeys(n.rsplit(".", 1)[-1] for n in linears)) or "none"
        raise UsageError(f"no nn.Linear name contains {', '.join(lora.targets)}; this model's linear layers "
                         f"are named {shown}: pick `lora_targets` from those")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, lin in found:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, LoRALinear(lin, lora.rank, lora.alpha, lora.dropout))
    return model, tuple(name for name, _ in found)
