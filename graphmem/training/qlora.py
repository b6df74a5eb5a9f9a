"""QLoRA (Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs"): the frozen base
weights in 4 bits through bitsandbytes, LoRA adapters through peft (graphmem/training/peft_lora.py).

The model is quantized as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
bnb_4bit_compute_dtype=torch.bfloat16))`` does, with the same code:

- transformers/integrations/bitsandbytes.py ``replace_with_bnb_linear`` swaps every ``nn.Linear``
  (and GPT-2's ``Conv1D``) but ``get_keys_to_not_convert`` (transformers/quantizers/base.py: the
  output embeddings, tied weights, the last module) for ``bnb.nn.Linear4bit``;
- each weight becomes ``bnb.nn.Params4bit(weight, requires_grad=False, **old.__dict__)`` and is
  quantized by bitsandbytes' ``quantize_4bit`` (bitsandbytes/functional.py), as transformers'
  ``Bnb4bitQuantize.convert`` does (Conv1D weights transposed first). On graphmem's meta copy the
  quantize op runs its registered fake (bitsandbytes/_ops.py ``quantize_4bit``): a packed uint8
  weight of ``(n + 1) // 2`` bytes, an fp32 absmax per 64-weight block, and with double
  quantization (``quantize_blockwise`` over the absmax, blocks of 256) a uint8 absmax, its fp32
  nested absmax, the 256-entry dynamic code and an fp32 offset.

The forward and backward are then bitsandbytes' own (``Linear4bit.forward`` -> ``matmul_4bit`` ->
``MatMul4Bit``, whose ``gemm_4bit`` op dequantizes the weight inside the kernel: its scratch is
graphmem/oprules/bnb.py) and peft's (peft/tuners/lora/bnb.py ``Linear4bit``).

Known limitations: QLoRA is for Hugging Face models (peft's adapters); ``prepare_model_for_kbit_training``
(fp32 casts of the non-quantized weights, gradient checkpointing) is not applied: plan checkpoints
with ``--plan``.
"""
from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn as nn

from graphmem.errors import UsageError

if TYPE_CHECKING:
    from types import ModuleType

    from bitsandbytes.functional import QuantState

    from graphmem.training.loop import TrainStep
    from graphmem.training.lora import LoRA

QUANT_TYPES = ("nf4", "fp4")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Quantization:
    """bitsandbytes' 4-bit recipe: ``quant_type`` (nf4 or fp4), double quantization of the block
    scales, the compute dtype the weight is dequantized to, the block size (bitsandbytes' 64)."""

    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: str = "bf16"
    blocksize: int = 64

    def describe(self) -> str:
        double = " + double quant" if self.double_quant else ""
        return f"4-bit {self.quant_type}{double} (bitsandbytes), {self.compute_dtype} compute"

    def to_dict(self) -> dict[str, object]:
        return {"quant_type": self.quant_type, "double_quant": self.double_quant,
                "compute_dtype": self.compute_dtype, "blocksize": self.blocksize}


def make_quantization(quantization: Optional[str]) -> Optional[Quantization]:
    """``"nf4"`` (``--qlora``: the QLoRA recipe), ``"fp4"``, or None."""
    if quantization is None:
        return None
    if quantization not in QUANT_TYPES:
        raise UsageError(f"quantization must be one of {', '.join(QUANT_TYPES)} (bitsandbytes' 4-bit types), "
                         f"got {quantization!r}")
    return Quantization(quantization)


def check_quantization(lora: Optional[LoRA], train: TrainStep) -> None:
    """What QLoRA trains and how: LoRA adapters on one device, the 4-bit base frozen."""
    if lora is None:
        raise UsageError("`qlora` trains LoRA adapters on the frozen 4-bit base: add `lora_rank` and `lora_targets` "
                         "(e.g. `lora_rank=16` `lora_targets='all-linear'`)")
    if train.master_weights:
        raise UsageError("`qlora` keeps the base in 4 bits and the adapters in fp32 (peft): drop `master_weights`")


def _bitsandbytes() -> ModuleType:
    quiet = logging.getLogger("bitsandbytes")  # its CPU backend logs, on import, a missing inference-only kernel
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        import bitsandbytes
        import transformers  # noqa: F401  (its bitsandbytes integration picks the layers)
    except ImportError:
        raise UsageError("`qlora` quantizes through bitsandbytes and transformers: pip install 'graphmem[qlora]'") from None
    finally:
        quiet.setLevel(level)
    return bitsandbytes


def quantize(model: nn.Module, q: Quantization, dtype: Optional[torch.dtype] = None) -> tuple[str, ...]:
    """Quantize ``model`` in place (meta or real) as transformers loads it in 4 bits: the other
    weights in ``dtype`` (the ``dtype=`` of ``from_pretrained``), the linear layers as
    ``bnb.nn.Linear4bit``. Returns the quantized layers' names."""
    bnb = _bitsandbytes()
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D
    from transformers.quantizers.base import get_keys_to_not_convert

    if dtype is not None:
        model.to(dtype)
    old = {name: m for name, m in model.named_modules() if type(m) is nn.Linear or isinstance(m, Conv1D)}
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=q.quant_type,
                                bnb_4bit_use_double_quant=q.double_quant,
                                bnb_4bit_compute_dtype=_DTYPES[q.compute_dtype])
    # double quantization's code (bitsandbytes/functional.py quantize_blockwise caches it on the
    # device of the first call): made on the CPU, so a meta quantization does not leave a meta one
    bnb.functional.name2qmap.setdefault("dynamic", bnb.functional.create_dynamic_map())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        replace_with_bnb_linear(model, get_keys_to_not_convert(model), config)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not layers:
        subclassed = sorted({type(m).__name__ for m in model.modules()
                             if isinstance(m, nn.Linear) and type(m) is not nn.Linear and not isinstance(m, Conv1D)})
        why = (f"; this model's linears are {', '.join(subclassed)}, subclasses of nn.Linear, which transformers' "
               "replace_with_bnb_linear leaves in full precision (it tests type(module) is nn.Linear, "
               "transformers/integrations/bitsandbytes.py)") if subclassed else ""
        raise UsageError("`qlora` found no linear layer to quantize in this model (transformers' bitsandbytes "
                         "integration replaces nn.Linear and Conv1D, never the output head)" + why)
    for name, m in layers:
        weight = old[name].weight.detach()
        value = weight.t() if isinstance(old[name], Conv1D) else weight  # as Bnb4bitQuantize.convert
        param = bnb.nn.Params4bit(value, requires_grad=False, **m.weight.__dict__)
        # Params4bit.to quantizes on a real device only; _quantize is the same call on meta
        m.weight = param._quantize(value.device)
        if old[name].bias is not None:
            m.bias = nn.Parameter(old[name].bias.detach(), requires_grad=False)
    return tuple(name for name, _ in layers)


def quant_state_of(p: torch.Tensor) -> Any:
    """The bitsandbytes QuantState of a 4-bit parameter (``Params4bit``), else None. Without
    bitsandbytes imported no parameter can be one."""
    bnb = sys.modules.get("bitsandbytes")
    return p.quant_state if bnb is not None and isinstance(p, bnb.nn.Params4bit) else None


def fake_quant_state(qs: QuantState, make: Callable[[torch.Tensor, str], torch.Tensor]) -> QuantState:
    """The same QuantState (bitsandbytes/functional.py) with each tensor replaced by
    ``make(tensor, field)``: the fake capture's copy of a 4-bit weight's state."""
    from bitsandbytes.functional import QuantState

    state2 = None
    if qs.state2 is not None:
        state2 = QuantState(absmax=make(qs.state2.absmax, "nested_absmax"), code=make(qs.state2.code, "nested_code"),
                            blocksize=qs.state2.blocksize, dtype=qs.state2.dtype)
    return QuantState(absmax=make(qs.absmax, "absmax"), shape=qs.shape, code=make(qs.code, "code"),
                      blocksize=qs.blocksize, quant_type=qs.quant_type, dtype=qs.dtype,
                      offset=None if qs.offset is None else make(qs.offset, "offset"), state2=state2)


def quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of every 4-bit weight's QuantState: memory the quantized model holds beside
    its parameters and buffers."""
    out: list[torch.Tensor] = []

    def keep(t: torch.Tensor, field: str) -> torch.Tensor:
        out.append(t)
        return t

    for p in model.parameters():
        qs = quant_state_of(p)
        if qs is not None:
            fake_quant_state(qs, keep)
    return out


@dataclass(frozen=True)
class Quantized:
    """What the quantized model holds: ``layers`` 4-bit linear layers with ``weights`` weights
    packed into ``packed_bytes`` (two per byte), and ``state_bytes`` of QuantStates (block
    scales, codes, offsets: the report's buffers hold them)."""

    layers: int
    weights: int
    packed_bytes: int
    state_bytes: int

    def to_dict(self) -> dict[str, int]:
        return {"layers": self.layers, "weights": self.weights, "packed_bytes": self.packed_bytes,
                "quant_state_bytes": self.state_bytes}


def packed_surplus(model: nn.Module) -> int:
    """How many more parameters the 4-bit weights of ``model`` stand for than their storage has
    elements: a ``Params4bit`` holds two 4-bit weights per uint8 element (or more per element of a
    wider ``quant_storage``), its QuantState keeps the weight's own shape (bitsandbytes/nn/modules.py
    ``Params4bit._quantize``, bitsandbytes/functional.py ``quantize_4bit``)."""
    return sum(prod(qs.shape) - p.numel() for p in model.parameters() if (qs := quant_state_of(p)) is not None)


def quantized_summary(model: nn.Module) -> Optional[Quantized]:
    """The 4-bit weights of ``model`` (None without any)."""
    packed = {id(p): p for p in model.parameters() if quant_state_of(p) is not None}
    if not packed:
        return None
    states = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in quant_state_tensors(model)}
    return Quantized(len(packed), sum(prod(quant_state_of(p).shape) for p in packed.values()),
                     sum(p.untyped_storage().nbytes() for p in packed.values()), sum(states.values()))
