"""Per-op rules, in a registry that refuses duplicates (as torch.utils.flop_counter does).

A *note* rule flags an op whose fake (meta) kernel cannot know what the real kernel does with
memory; the report carries the note so nobody mistakes the number for the whole truth.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

NoteRule = Callable[[fx.Node], str]
NOTE_RULES: dict[Any, NoteRule] = {}


def register_note(*ops: Any) -> Callable[[NoteRule], NoteRule]:
    def wrap(fn: NoteRule) -> NoteRule:
        for op in ops:
            if op in NOTE_RULES:
                raise RuntimeError(f"a note rule for {op} is already registered")
            NOTE_RULES[op] = fn
        return fn
    return wrap


def _op(name: str) -> Any:
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, "default", None) if packet is not None else None


@register_note(*(op for op in (_op("mkldnn_rnn_layer"),) if op is not None))
def _onednn_rnn(node: fx.Node) -> str:
    return ("aten.mkldnn_rnn_layer (nn.LSTM/nn.GRU on the CPU): the real oneDNN kernel saves a uint8 "
            "workspace whose size oneDNN chooses and fake tensors report as empty; activation bytes "
            "undercount by that workspace (a few times the layer's gate activations)")
