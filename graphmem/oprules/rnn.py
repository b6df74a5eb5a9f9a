"""oneDNN's LSTM on the CPU (``nn.LSTM``: ``aten.mkldnn_rnn_layer`` per layer and direction): the
workspace the kernel returns and autograd saves, where the meta kernel returns it empty (a
fake-kernel fix), and the weight reorders and scratchpad inside forward and backward; on the CUDA
target, a note for cuDNN's RNN memory, which has no rule.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from graphmem.oprules.registry import (
    RecordedOp,
    Run,
    Scratch,
    aten_op,
    register_kernel,
    register_note,
    register_scratch,
)

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode



def _good_ld(dim: int, itemsize: int) -> int:
    """oneDNN src/cpu/rnn/rnn_utils.cpp ``get_good_ld``: 64-byte aligned, not a multiple of 256."""
    ld = -(-dim // (64 // itemsize)) * (64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def _page(n: int) -> int:
    return -(-n // 4096) * 4096


def onednn_lstm_workspace(input_size: int, hidden: int, batch: int, steps: int, dtype: torch.dtype) -> int:
    """Bytes of the workspace oneDNN's LSTM forward-training primitive asks for (one layer, one
    direction: PyTorch calls ``mkldnn_rnn_layer`` per layer and direction).

    oneDNN src/cpu/rnn/rnn_utils.hpp ``init_conf`` (leading dimensions) and
    ``set_workspace_sizes``, src/cpu/rnn/rnn_utils.cpp ``set_offsets`` (each part starts on a
    4096-byte page): gates (T·N·ld(4H), gates type), h_t (T·N·ld(H)), the layer/iteration
    states ((L+1)·(T+1)·N·ld(max(I, H))), the c states ((L+1)·(T+1)·N·H, the c dtype PyTorch
    passes: the input's), and the diff states layer / iter / iter_c for backward in the fp32
    accumulation type. With L = 1 layer, states hold 2 rows. In the oneDNN v3.12 that
    torch 2.14 links, the iteration states share the layer states' part (checked against real
    runs of 80 random shapes, fp32 and bf16, tests/oprules/test_workspace.py)."""
    t, n, i, h = steps, batch, input_size, hidden
    e = dtype.itemsize  # gates, h_t, states and c in the data type; diff states in fp32
    parts = [t * n * _good_ld(4 * h, e) * e,                 # ws_gates
             t * n * _good_ld(h, e) * e,                     # ws_ht
             2 * (t + 1) * n * _good_ld(max(i, h), e) * e,   # ws_states_layer (= ws_states_iter)
             2 * (t + 1) * n * h * e,                        # ws_states_iter_c
             2 * (t + 1) * n * _good_ld(max(i, h), 4) * 4,  # ws_diff_states_layer
             2 * (t + 1) * n * _good_ld(max(i, h), 4) * 4,  # ws_diff_states_iter
             2 * (t + 1) * n * h * 4]                        # ws_diff_states_iter_c
    return sum(_page(p) for p in parts)


@register_kernel(aten_op("mkldnn_rnn_layer"), devices=("cpu",), workspace_outputs=(3,),
                 source="aten/src/ATen/native/mkldnn/RNN.cpp mkldnn_rnn_layer; oneDNN src/cpu/rnn/rnn_utils.hpp "
                        "set_workspace_sizes")
def _mkldnn_rnn_layer(run: Run, args: tuple, kwargs: dict, mode: FakeTensorMode) -> tuple[torch.Tensor, ...]:
    """aten/src/ATen/native/mkldnn/RNN.cpp ``mkldnn_rnn_layer``: in training it returns the
    primitive's workspace (uint8, ``workspace_desc().get_size()`` bytes), which autograd saves
    for ``mkldnn_rnn_layer_backward``; the meta kernel returns it empty."""
    out = run(*args, **kwargs)
    names = ("input", "w0", "w1", "w2", "w3", "hx", "cx", "reverse", "batch_sizes", "mode", "hidden_size",
             "num_layers", "has_biases", "bidirectional", "batch_first", "train")
    bound = dict(zip(names, args), **kwargs)
    x = bound["input"]  # (T, N, I): the caller passes time-major input
    if not bound["train"] or bound["mode"] != 2:  # 2: LSTM (GRU/RNN never take this path on the CPU)
        return out
    size = onednn_lstm_workspace(x.size(2), bound["hidden_size"], x.size(1), x.size(0), x.dtype)
    with mode:
        workspace = torch.empty((size,), dtype=torch.uint8, device=x.device)
    return (*out[:3], workspace)


# the scratchpad's fixed part beyond its page-rounded buffers: measured (the same 4,664 B for every
# shape tried, fp32); not found in oneDNN's source, where the registrar's bookkeeping lives
_ONEDNN_RNN_SCRATCHPAD_EXTRA = 4664


def _onednn_lstm_scratch(i: int, h: int, n: int, t: int, e: int) -> tuple[int, int, int]:
    """(weight reorders, bias, scratchpad) of one oneDNN LSTM call.

    aten/src/ATen/native/mkldnn/RNN.cpp ``mkldnn_rnn_layer``/``_backward``: the weights are
    reordered to oneDNN's ldigo layout (rows padded by ``get_good_ld``) and the two biases summed
    into one fp32 (4H) vector; oneDNN src/cpu/rnn/rnn_utils.hpp ``set_workspace_sizes`` sizes
    the scratchpad: scratch_gates (T·N·ld(4H), fp32: the layer GEMM is merged over time),
    scratch_ht (N·ld(H)) and scratch_diff_ht (N·ld(H), fp32), each on its own page."""
    reorders = i * _good_ld(4 * h, e) * e + h * _good_ld(4 * h, e) * e
    pad = _page(t * n * _good_ld(4 * h, 4) * 4) + _page(n * _good_ld(h, e) * e) + _page(n * _good_ld(h, 4) * 4)
    return reorders, 4 * h * 4, pad + _ONEDNN_RNN_SCRATCHPAD_EXTRA


@register_scratch(aten_op("mkldnn_rnn_layer"), source="aten/src/ATen/native/mkldnn/RNN.cpp mkldnn_rnn_layer; oneDNN "
                  "src/cpu/rnn/rnn_utils.hpp set_workspace_sizes")
def _mkldnn_rnn_layer_scratch(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    x, h = args[0], args[10]  # input (T, N, I), hidden_size
    if args[9] != 2:  # LSTM only
        return []
    reorders, bias, pad = _onednn_lstm_scratch(x.size(2), h, x.size(1), x.size(0), x.dtype.itemsize)
    return [Scratch(reorders + bias, "oneDNN LSTM weight reorders and summed bias (mkldnn/RNN.cpp)"),
            Scratch(pad, "oneDNN LSTM scratchpad (rnn_utils.hpp)")]


@register_scratch(aten_op("mkldnn_rnn_layer_backward"), source="aten/src/ATen/native/mkldnn/RNN.cpp "
                  "mkldnn_rnn_layer_backward; oneDNN src/cpu/rnn/rnn_utils.hpp set_workspace_sizes")
def _mkldnn_rnn_layer_backward_scratch(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    """Beside the forward's reorders and scratchpad: a dense copy of the output gradient
    (T·N·H) when it is not contiguous, grad_hy and grad_cy (N·H each) when autograd left
    either undefined (measured: both are made then), the summed bias, and, where oneDNN's ldgoi layout pads a weight gradient's rows
    (ld(I) ≠ I or ld(H) ≠ H), that gradient in oneDNN's layout before its copy into the output."""
    x, h = args[0], args[15]  # input (T, N, I), hidden_size
    if args[14] != 2:
        return []
    t, n, i, e = x.size(0), x.size(1), x.size(2), x.dtype.itemsize
    reorders, bias, pad = _onednn_lstm_scratch(i, h, n, t, e)
    grad_out, grad_hy, grad_cy = args[10], args[11], args[12]
    dense = not grad_out.is_contiguous()  # an expanded or strided gradient is made dense
    zeros = grad_hy is None or grad_cy is None  # both state gradients are then materialized
    # the op starts with an fp32 (4H) buffer and makes its second bias gradient output (4H,
    # fp32) only after the scratch is freed: at the kernel's high point the two cancel
    grads = dense * grad_out.numel() * e + zeros * 2 * n * h * e
    padded = sum(4 * h * _good_ld(k, 4) * 4 for k in (i, h) if _good_ld(k, 4) != k)
    return [Scratch(grads + reorders + bias + padded, "oneDNN LSTM backward copies and reorders (mkldnn/RNN.cpp)"),
            Scratch(pad, "oneDNN LSTM scratchpad (rnn_utils.hpp)")]



@register_note(aten_op("mkldnn_rnn_layer"), devices=("cuda",),
               source="aten/src/ATen/native/cudnn/RNN.cpp _cudnn_rnn (reserve space and workspace)")
def _cudnn_rnn(node: RecordedOp) -> str:
    return ("nn.LSTM/nn.GRU on the CUDA target: cuDNN's reserve space (saved for backward) and workspace are "
            "not modelled; the step ran oneDNN's CPU path, whose workspace is left out here")
