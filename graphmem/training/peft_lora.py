"""LoRA on Hugging Face models through peft itself (``peft.get_peft_model`` with a
``LoraConfig``): the adapters, the frozen base and the forward are peft's, so GPT-2's
``Conv1D``, fused projections and ``all-linear`` (every linear layer but the output head) work
as in a user's fine-tuning script. Applied to graphmem's meta copy of the model; peft puts the
adapters on the base layer's (meta) device. Where every parameter is on the meta device in fp32, fp16 or
bf16, peft makes the adapters there in the first place (``adapters_on_meta``): the same adapters,
without initializing a CPU copy of each first (an 8B model's 224 adapters: ~2.5 s of CPU).

A model that already is a peft model (``PeftModel``) is analyzed as it is, without options.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, ContextManager, Union

import torch
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
            with adapters_on_meta(model):
                wrapped = peft.get_peft_model(model, config)
    except ValueError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"})
        raise UsageError(f"peft found no layer to adapt for `lora_targets={','.join(lora.targets)}` ({first}); this "
                         f"model's projections are named {', '.join(linears) or 'none'}, or use all-linear") from e
    names = tuple(n for n, m in wrapped.named_modules() if isinstance(m, LoraLayer))
    return wrapped, names


def adapters_on_meta(model: nn.Module) -> ContextManager[object]:
    """Where ``model``'s parameters are all on the meta device in fp32, fp16 or bf16 (and torch's default
    dtype is fp32): a context in which peft makes each adapter's layers on the meta device. peft makes them
    on the default device in the default dtype, initializes them there (kaiming_uniform_ and zeros_ on
    real CPU memory), moves them to the base layer's device and dtype (peft/tuners/tuners_utils.py
    ``_move_adapter_to_device_of_base_layer``, which leaves an adapter already on the meta device as it is)
    and then upcasts fp16 and bf16 adapters to fp32 (``cast_adapter_dtype``, get_peft_model's
    ``autocast_adapter_dtype=True``, graphmem's call): on such a model both ways end with the same fp32 meta
    adapters. Elsewhere (another dtype, a quantized base, real weights) nothing changes."""
    params = list(model.parameters())
    if params and torch.get_default_dtype() == torch.float32 and all(
            p.device.type == "meta" and p.dtype in _ADAPTED_AS_FP32 for p in params):
        return torch.device("meta")
    return contextlib.nullcontext()


_ADAPTED_AS_FP32 = (torch.float32, torch.float16, torch.bfloat16)
