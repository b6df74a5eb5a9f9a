"""Per-op rules, in a registry that refuses duplicates (as torch.utils.flop_counter does).

A *note* rule flags an op whose fake (meta) kernel cannot know what the real kernel does with
memory and for which graphmem has no rule (graphmem/capture/workspace.py holds the rules); the report
carries the note so nobody mistakes the number for the whole truth.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

NoteRule = Callable[[fx.Node], str]
NOTE_RULES: dict[tuple[Any, str], NoteRule] = {}  # (op, target device) -> rule


def register_note(*ops: Any, devices: tuple[str, ...] = ("cpu", "cuda")) -> Callable[[NoteRule], NoteRule]:
    def wrap(fn: NoteRule) -> NoteRule:
        for op in ops:
            if op is None:
                continue
            for d in devices:
                if (op, d) in NOTE_RULES:
                    raise RuntimeError(f"a note rule for {op} on {d} is already registered")
                NOTE_RULES[(op, d)] = fn
        return fn
    return wrap


def _op(name: str) -> Any:
    packet = getattr(torch.ops.aten, name, None)
    return getattr(packet, "default", None) if packet is not None else None


@register_note(_op("convolution"), _op("convolution_backward"), devices=("cpu",))
def _onednn_conv(node: fx.Node) -> str:
    if node.meta.get("scratch"):  # covered by a rule (graphmem/capture/workspace_conv.py: depthwise channels-last;
        return ""                 # workspace_conv_dw.py: depthwise NCHW; _gemm.py: kernels > 14; _jit.py: patch embeddings)
    return ("aten.convolution (CPU): oneDNN's scratch inside the op (weight and activation reorders to its "
            "blocked layouts, its scratchpad; chosen per shape, ISA and thread count) is not modelled except for "
            "fp32 depthwise convolutions, kernels wider than 14 (oneDNN's gemm path) and patch embeddings: the "
            "real peak can be higher by up to a few weight- or activation-sized buffers per convolution "
            "(measured: ResNet-18 +0.09 %, Whisper's Conv1d up to +10 % at toy sizes)")


@register_note(_op("convolution"), _op("convolution_backward"), devices=("cuda",))
def _cudnn_conv(node: fx.Node) -> str:
    # cuDNN documents no size or bound for it: only a per-algorithm runtime query (cudnnGetConvolution*WorkspaceSize)
    return "aten.convolution (CUDA): cuDNN's workspace (chosen by its algorithm search) is not modelled"


@register_note(_op("mkldnn_rnn_layer"), devices=("cuda",))
def _cudnn_rnn(node: fx.Node) -> str:
    return ("nn.LSTM/nn.GRU on the CUDA target: cuDNN's reserve space (saved for backward) and workspace are "
            "not modelled; the step ran oneDNN's CPU path, whose workspace is left out here")


@register_note(_op("_scaled_dot_product_efficient_attention_backward"), _op("_efficient_attention_backward"),
               devices=("cuda",))
def _efficient_backward(node: fx.Node) -> str:
    if node.meta.get("scratch"):  # covered by a rule (graphmem/capture/workspace_efficient.py)
        return ""
    return ("memory-efficient attention (CUDA): the kernels' fp32 accumulators (attention_backward.cu workspace, "
            "the forward's output accumulator) are modelled for the A100, H100, H200 and B200 only: on this GPU, "
            "which kernel fits its shared memory is not derived (gpu='a100' or 'h100' gives the sm80 kernels' figure)")
