"""The golden reports: every model of the real-model zoo (tests/zoo.py) and the bundled models
under each way a step is set up (one device, the per-rank formulas, rank r through fully_shard,
a pipeline stage, the CUDA target, compiled mode, LoRA, an optimizer with micro-batches),
analyzed and written as ``Report.to_dict()`` JSON to tests/golden/reports/. tests/render/test_report_golden.py
checks each report against its file field by field, so a change to how a step is described or
captured that moves any number is seen (``GRAPHMEM_UPDATE_GOLDEN=1`` rewrites them: check the diff).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import zoo
from cases import tiny_gpt, tokens

Case = Callable[[], Any]  # () -> Report


def _zoo(table: str, name: str, **options: Any) -> Case:
    def run() -> Any:
        import graphmem

        if table == "zoo":
            model, inputs = zoo.build(name)
        else:
            torch.manual_seed(0)
            model, inputs = zoo.ACCURACY[name][0]()
        return graphmem.analyze(model.train(), inputs, **options)
    return run


def _bundled(**options: Any) -> Case:
    def run() -> Any:
        import graphmem

        torch.manual_seed(0)
        return graphmem.analyze(tiny_gpt(), tokens(), **options)
    return run


def _preset(name: str, shape: str, **options: Any) -> Case:
    def run() -> Any:
        import graphmem

        return graphmem.analyze(name, input_shape=shape, **options)
    return run


CASES: dict[str, Case] = {
    **{f"zoo_{n}": _zoo("zoo", n) for n in zoo.ZOO},
    **{f"acc_{n}": _zoo("acc", n) for n in zoo.ACCURACY},
    "gpt_adamw_micro2": _bundled(optimizer="adamw", micro_batches=2),
    "gpt_zero2_world4": _bundled(optimizer="adam", world_size=4, zero=2),
    "gpt_tp2_formula": _bundled(world_size=2, tp=2, sp=True),
    "gpt_fsdp_rank1": _bundled(optimizer="adamw", world_size=2, rank=1, fsdp="fully_shard"),
    "gpt_pp2_rank1": _bundled(optimizer="adamw", pp=2, rank=1, micro_batches=2),
    "gpt_cuda_bf16": _bundled(device="cuda", amp="bf16"),
    "gpt_compiled": _bundled(mode="compiled"),
    "gpt_lora": _bundled(lora_rank=4, lora_targets="c_attn,c_proj", optimizer="adamw"),
    "llama_preset_fsdp_tp": _preset("models/llama.py", "2x16", world_size=4, rank=0, fsdp="fully_shard", tp=2, sp=True),
    "hf_llama_lora_adamw": _zoo("zoo", "llama_gqa", lora_rank=4, lora_targets="all-linear", optimizer="adamw"),
}
