"""The training options beyond forward/backward (graphmem/training/loop.py: micro-batches, optimizer,
master weights; graphmem/training/lora.py; passes/budget.py: ZeRO/FSDP/tensor parallel) gathered
for ``graphmem.analyze``, and the budget it reports as ``report.budget``."""
from __future__ import annotations

import contextlib
import dataclasses
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union, cast

import torch
import torch.nn as nn

from graphmem.chains import find_chain
from graphmem.errors import UsageError
from graphmem.passes.budget import Budget, BudgetRow, Parallel, budget
from graphmem.passes.spike import Temporaries, temporaries_at
from graphmem.training.loop import TrainStep, make_train_step
from graphmem.training.loop_options import host_bytes_of
from graphmem.training.lora import HeadOutside, LoRA, adapted_model, apply_lora, make_lora, meta_copy
from graphmem.training.optim import resolved_impl
from graphmem.training.peft_lora import is_hf_model
from graphmem.training.qlora import (
    Quantization,
    Quantized,
    check_quantization,
    make_quantization,
    packed_surplus,
    quantize,
    quantized_summary,
)

if TYPE_CHECKING:
    from graphmem.passes.liveness import Liveness
    from graphmem.passes.saved import SavedSet
    from graphmem.stepgraph import StepGraph


@dataclass(frozen=True)
class Training:
    """The loop around forward and backward (how the step is split over ranks is the StepSpec's
    ``parallel``, graphmem/step/spec.py)."""

    train: TrainStep  # micro-batches, optimizer and its implementation, fp32 master weights
    lora: Optional[LoRA]  # adapters on the named linear layers, the rest frozen
    quantization: Optional[Quantization] = None  # 4-bit base weights through bitsandbytes (QLoRA)

    @property
    def requested(self) -> bool:
        """Any loop option given: the report then carries a budget."""
        return self.train.active or self.train.master_weights or self.lora is not None

    def keeps_dtypes(self, module: nn.Module) -> bool:
        """``prepare(module, self, ...)`` holds its final dtypes (4-bit weights, block scales, peft's
        fp32 adapters): the capture casts nothing."""
        return self.quantization is not None or (self.lora is not None and is_hf_model(adapted_model(module)))


def make_training(dtype: Optional[str] = None, optimizer: Optional[str] = None, optimizer_impl: str = "auto",
                  master_weights: bool = False, micro_batches: int = 1, lora_rank: Optional[int] = None,
                  lora_targets: Union[str, Sequence[str], None] = None, lora_alpha: Optional[float] = None,
                  quantization: Optional[str] = None, release_output: bool = False,
                  clip_grad_norm: Optional[float] = None, clip_foreach: bool = True, optimizer_in_backward: bool = False,
                  offload_activations: bool = False) -> Training:
    train = make_train_step(optimizer, optimizer_impl, master_weights, micro_batches, dtype, release_output,
                            clip_grad_norm, clip_foreach, optimizer_in_backward, offload_activations)
    lora = make_lora(lora_rank, lora_targets if lora_targets is None or isinstance(lora_targets, str) else tuple(lora_targets),
                     lora_alpha)
    quant = make_quantization(quantization)
    if quant is not None:
        check_quantization(lora, train)
    return Training(train, lora, quant)


_PREPARED: ContextVar[Optional[dict[tuple, tuple[nn.Module, tuple[nn.Module, tuple[str, ...]]]]]] = \
    ContextVar("graphmem_prepared", default=None)


@contextlib.contextmanager
def preparing_once() -> Iterator[None]:
    """Within it, ``prepare`` of the same module with the same LoRA (no quantization) and dtype returns
    the module it made the first time: advise captures one adapted model once per lever, and peft's
    ``get_peft_model`` on a 8B model's meta copy takes seconds. Captures do not change the module
    they capture (the fake parameters are swapped in and out; the sharded ones wrap a fake copy)."""
    token = _PREPARED.set({})
    try:
        yield
    finally:
        _PREPARED.reset(token)


def prepare(module: nn.Module, training: Training,
            dtype: Optional[torch.dtype] = None) -> tuple[nn.Module, tuple[str, ...]]:
    """The module to capture: with LoRA, a meta copy with adapters (the given one untouched);
    with quantization, that copy's linear layers in 4 bits first, the rest in ``dtype``."""
    if training.lora is None:
        return module, ()
    memo = _PREPARED.get() if training.quantization is None else None  # 4-bit weights: made afresh, as before
    key = (id(module), training.lora, dtype)
    if memo is not None and key in memo:  # the module is held in the memo: its id is not reused meanwhile
        return memo[key][1]
    made = _prepared(module, training, dtype)
    if memo is not None:
        memo[key] = (module, made)
    return made


def _prepared(module: nn.Module, training: Training, dtype: Optional[torch.dtype]) -> tuple[nn.Module, tuple[str, ...]]:
    lora = training.lora
    assert lora is not None  # prepare() returned the module as it is without LoRA
    if isinstance(module, HeadOutside):  # the whole model adapted (and quantized), its head taken out again
        model, names = prepare(cast(HeadOutside, meta_copy(module)).whole(), training, dtype)
        return module.around(model), names
    if training.quantization is None:
        if dtype is None or not is_hf_model(module):
            return apply_lora(module, lora)
        # peft's get_peft_model(autocast_adapter_dtype=True) makes the adapters of a 16-bit model
        # fp32 (peft/peft_model.py, PeftModel.__init__ -> _cast_adapter_dtype): cast first, as
        # from_pretrained(dtype=...) does, then adapt
        model = meta_copy(module).to(dtype)
        return apply_lora(model, lora, inplace=True)
    if not is_hf_model(module):
        raise UsageError(f"`qlora` runs the QLoRA recipe (transformers' bitsandbytes integration, peft's adapters) on a "
                         f"Hugging Face model; {type(module).__name__} is a plain nn.Module: drop `qlora`")
    model = meta_copy(module)
    quantize(model, training.quantization, dtype)
    return apply_lora(model, lora, inplace=True)


def units_of(module: nn.Module) -> tuple[str, ...]:
    """What ZeRO-3/FSDP gathers one at a time: the blocks of the repeated chain (a transformer's
    layers, as FSDP's transformer auto-wrap policy wraps them); the rest is the root unit."""

    chain = find_chain(module)
    if chain is None:
        return ()
    return tuple(f"{chain.path}.{i}" if chain.path else str(i) for i in range(chain.length))


@dataclass(frozen=True)
class StepBudget:
    """``report.budget``: what the whole step holds, per rank (``rank``) and, when the step is
    split over ranks, on one device without parallelism (``single``) for comparison."""

    training: Training
    device: str
    lora_layers: tuple[str, ...]
    layout: Parallel  # the per-rank formulas' layout (Parallel(): none; graphmem/step/spec.py Formula)
    rank: Budget
    single: Optional[Budget]
    spike: tuple[Temporaries, ...] = ()  # the temporaries live at rank's peak, made -> freed (passes/spike.py)
    quantized: Optional[Quantized] = None  # the 4-bit weights, if any (graphmem/training/qlora.py)
    whose: str = ""  # a per-rank capture's rank and wrappers (graphmem/distributed/view.py): the step is that rank's
    host_bytes: int = 0  # offload_activations: the saved tensors' copies in host memory (not in the device rows)

    @property
    def rows(self) -> tuple[BudgetRow, ...]:
        return self.rank.rows

    @property
    def peak_bytes(self) -> int:
        return self.rank.peak_bytes

    @property
    def model_state_bytes(self) -> int:
        return self.rank.model_state_bytes

    def row(self, name: str) -> BudgetRow:
        return self.rank.row(name)

    def to_dict(self) -> dict[str, object]:
        t = self.training
        out: dict[str, object] = {**t.train.to_dict(self.device),
                               "lora": {**t.lora.to_dict(), "layers": list(self.lora_layers)} if t.lora else None,
                               "quantization": {**(t.quantization.to_dict() if t.quantization else {}),
                                                **self.quantized.to_dict()} if self.quantized else None,
                               "parallel": self.layout.to_dict(), "per_rank": _budget_dict(self.rank),
                               **({"rank": self.whose} if self.whose else {}),
                               **({"host_bytes": self.host_bytes} if t.train.offload_activations else {})}
        if self.single is not None:
            out["single_device"] = _budget_dict(self.single)
        out["temporaries_at_peak"] = [{"made_by": t.made_by, "bytes": t.nbytes, "tensors": t.count,
                                       "first_made": t.first_made, "last_freed": t.last_freed,
                                       "freed_by": t.freed_by, "phase": t.phase} for t in self.spike]
        return out


def _budget_dict(b: Budget) -> dict[str, object]:
    return {
        "rows": {r.name: {"bytes": r.size, "at_peak": r.at_peak} for r in b.rows},
        "model_state_bytes": b.model_state_bytes, "step_counter_bytes": b.step_counter_bytes,
        "optimizer_states": dict(b.states_by_name), "parameters": b.parameters, "trainable_parameters": b.trainable,
        "peak": {"bytes": b.peak_bytes, "index": b.peak_index, "phase": b.peak_phase, "op": b.peak_op,
                 "module": b.peak_module, "top_temporaries": [{"made_by": n, "bytes": v} for n, v in b.top_temporaries]},
        "later_steps_peak": {"bytes": b.later_peak_bytes, "index": b.later_peak_index, "phase": b.later_peak_phase},
        **({"gathered_unit": b.largest_unit, "gather_bytes": b.gather_bytes} if b.gather_bytes else {}),
        **({"tp_linears": {"column": b.tp_split[0], "row": b.tp_split[1]}} if b.tp_split != (0, 0) else {}),
        **({"details": [{"name": d.name, "within": d.within, "bytes": d.size, "at_peak": d.at_peak, "note": d.note}
                        for d in b.details]} if b.details else {}),
    }


def step_budget(g: StepGraph, lv: Liveness, sv: SavedSet, training: Training, module: nn.Module, lora_layers: tuple[str, ...],
                whose: str = "", layout: Parallel = Parallel()) -> StepBudget:
    """The whole step's table over ``g``: per rank under the formulas' ``layout``, with the
    single-device table beside it when the layout splits the step."""
    units = units_of(module)
    rank = budget(g, lv, sv, layout, units)
    single = budget(g, lv, sv, Parallel(), units) if layout != Parallel() else None
    surplus = packed_surplus(module)  # the graph counts a 4-bit weight's packed elements; count its weights
    if surplus:
        rank = dataclasses.replace(rank, parameters=rank.parameters + surplus)
        single = dataclasses.replace(single, parameters=single.parameters + surplus) if single is not None else None
    device = g.target.device if g.target is not None else g.device
    spike = temporaries_at(g, lv, rank.peak_index, frozenset(t.sid for t in sv.tensors)) if rank.peak_index >= 0 else ()
    quantized = quantized_summary(module)  # --qlora's, or a model quantized by the user's own script
    host = host_bytes_of(g.storages.values())
    return StepBudget(training, device, lora_layers, layout, rank, single, spike, quantized, whose, host)


__all__ = ["Training", "make_training", "prepare", "StepBudget", "step_budget", "resolved_impl"]
