"""LoRA on Hugging Face models through peft itself (``peft.get_peft_model`` with a
``LoraConfig``): the adapters, the frozen base and the forward are peft's, so GPT-2's
``Conv1D``, fused projections and ``all-linear`` (every linear layer but the output head) work
as in a user's fine-tuning script. Applied to graphmem's meta copy of the model; peft puts the
adapters on the base layer's (meta) device.

A model that already is a peft model (``PeftModel``) is analyzed as it is, without options.
"""
from __future__ import annotations

import warnings
from typing import Any, Union

import torch.nn as nn

from graphmem.errors import UsageError


def is_hf_model(module: nn.Module) -> bool:
    """A transformers PreTrainedModel, or a peft model around one."""
    return any(c.__module__.startswith(("transformers.", "peft.")) and c.__name__ in ("PreTrainedModel", "PeftModel")
               for c in type(module).__mro__)


def apply_peft(model: nn.Module, lora: Any) -> tuple[nn.Module, tuple[str, ...]]:
    """``peft.get_peft_model(model, LoraConfig(r, lora_alpha, target_modules, lora_dropout))``
    and the names of the adapted layers."""
    try:
        import peft
        from peft.tuners.lora import LoraLayer
    except ImportError:
        raise UsageError("LoRA on a Hugging Face model runs through peft: pip install 'graphmem[hf]'") from None
    if any(c.__name__ == "PeftModel" for c in type(model).__mro__):
        raise UsageError("this model already has peft adapters; analyze it as it is, without `lora_rank`")
    targets: Union[str, list[str]] = "all-linear" if lora.targets == ("all-linear",) else list(lora.targets)
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    try:
        with warnings.catch_warnings():  # peft's notes for Conv1D (fan_in_fan_out) and deprecations
            warnings.simplefilter("ignore")
            wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise UsageError(f"peft found no layer to adapt for `lora_targets={','.join(lora.targets)}` ({first}); this "
                         f"model's projections are named {', '.join(linears) or 'none'}, or use all-linear") from e
    names = tuple(n for n, m in wrapped.named_modules() if isinstance(m, LoraLayer))
    return wrapped, names
