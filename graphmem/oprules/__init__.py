"""Per-op rules: kernel workspaces, fake-kernel fixes, collectives, bitsandbytes, and the report's
notes for what has no rule, in one registry (graphmem/oprules/registry.py), one module per kernel
family, each rule naming its source. The recorder (graphmem/capture/recorder.py) and the notes
pass (passes/notes.py) look rules up here.

Families: matmul.py (``_grouped_mm``'s fake kernel, BLAS operand copies) · rnn.py (oneDNN's LSTM
workspace and scratch; cuDNN's note) · flash_attention.py (CPU flash attention, the CUDA target's
flash backward) · efficient_attention.py (the CUDA target's memory-efficient attention) ·
layer_norm.py · embedding.py · scalars.py (a Scalar made a tensor inside
add/sub/mul/div and their foreach forms) · dropout.py (the fused CPU dropout compiled mode calls) · conv.py
with conv_gemm.py, conv_dw.py, conv_jit.py, conv_brgemm.py (oneDNN's convolution; cuDNN's note; which
oneDNN kernels run, AVX-512 or AVX2: isa.py) · collectives.py
(gloo's scratch, ``wait_tensor``) · optim.py (torch.optim's fused SGD, which has no fake kernel) · symm_mem.py (AsyncTP's fused all-gather/reduce-scatter matmuls on
CUDA, the symmetric-memory workspace) · bnb.py (bitsandbytes' 4-bit matmul and optimizers: loaded
with the first bitsandbytes op, so bitsandbytes is never imported for models without one).
"""
from __future__ import annotations

from collections.abc import Hashable
from typing import Optional

from graphmem.oprules import (  # noqa: F401  (each registers its family's rules)
    collectives,
    conv,
    dropout,
    efficient_attention,
    embedding,
    flash_attention,
    layer_norm,
    matmul,
    optim,
    rnn,
    scalars,
    symm_mem,
)
from graphmem.oprules.registry import RULES, WORKSPACE_OUTPUTS, KernelRule, NoteRule, Rule, Scratch, find

__all__ = ["RULES", "Rule", "Scratch", "kernel_rule", "load_bitsandbytes", "note_rule", "scratch",
           "workspace_outputs"]


def load_bitsandbytes() -> None:
    """Register bitsandbytes' rules (imports bitsandbytes: call it once a bitsandbytes op or weight is seen)."""
    import graphmem.oprules.bnb  # noqa: F401


def kernel_rule(op: Hashable, device: str) -> Optional[KernelRule]:
    """The fake-kernel fix for ``op`` on the target ``device``, if there is one."""
    rule = find("kernel", op, device)
    return rule.fn if rule is not None else None


def workspace_outputs(op: Hashable) -> tuple[int, ...]:
    """The output positions of ``op`` that are kernel workspaces (a kernel rule's ``workspace_outputs``)."""
    return WORKSPACE_OUTPUTS.get(op, ())


def scratch(op: Hashable, device: str, args: tuple, kwargs: dict, out: object,
            capability: tuple[int, int] = (9, 0)) -> list[Scratch]:
    """What ``op`` allocates and frees inside its kernel on the target ``device`` (empty where no
    rule holds); ``capability``: the target GPU's (Target.capability; the H100's by default)."""
    if getattr(op, "namespace", "") == "bitsandbytes":  # a QLoRA weight, an 8-bit optimizer a trainer makes mid-step
        load_bitsandbytes()
    rule = find("scratch", op, device)
    if rule is None:
        return []
    found = rule.fn(args, kwargs, out, capability) if rule.per_gpu else rule.fn(args, kwargs, out)
    return [s for s in found if s.nbytes > 0]


def note_rule(op: Hashable, device: str) -> Optional[NoteRule]:
    """The report's note rule for ``op`` on the target ``device``, if there is one."""
    rule = find("note", op, device)
    return rule.fn if rule is not None else None
