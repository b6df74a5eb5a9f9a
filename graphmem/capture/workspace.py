"""Kernel rules: where a real kernel's memory differs from what its fake (meta) kernel shows.

Two registries, each a decorator that refuses duplicates (as torch/utils/flop_counter.py's
``register_flop_formula``), keyed by aten overload and by the target device ("cpu", "cuda")
the rule holds for:

- **kernel rules** (``register_kernel``) replace the fake kernel of an op whose meta kernel
  refuses what the real kernel accepts or returns a tensor of the wrong size: ``aten._grouped_mm``
  on fp32 (transformers' MoE experts), the oneDNN RNN workspace (``aten.mkldnn_rnn_layer``, a
  saved tensor whose size oneDNN chooses; its storages are of kind "workspace");
- **scratch rules** (``register_scratch``) give the bytes a kernel allocates and frees inside one
  op (CPU flash attention's per-thread buffers, LayerNorm backward's reduction buffer); the
  recorder adds each as a storage of kind "workspace" live during that op only, so it counts
  in the peak (passes/timeline.py shows it as its own category); the CUDA target's
  memory-efficient attention backward is in graphmem/capture/workspace_efficient.py.

Every rule is derived from the kernel's source (file and function named) and tested against
real CPU runs (tests/test_workspace.py). Sizes that depend on the thread count use
``torch.get_num_threads()`` of the analyzing process: a CPU prediction is for a run with as
many threads.

Known limitations: oneDNN convolution's scratch (weight/gradient reorders whose layouts oneDNN
picks per shape and ISA) has rules only for depthwise convolutions (graphmem/capture/
workspace_conv.py channels-last, workspace_conv_dw.py NCHW), the gemm path of kernels wider than 14
(graphmem/capture/workspace_conv_gemm.py) and patch embeddings' weight gradients (workspace_conv_jit.py); oneDNN RNN backward's scratchpad, cuDNN's workspaces
and reserve space have no rule; passes/oprules.py names them in the report.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class Scratch:
    """Bytes one kernel allocates and frees inside an op."""

    nbytes: int
    what: str  # e.g. "flash attention buffers (FlashAttentionKernel.cpp)"


Run = Callable[..., Any]  # the fake kernel: run(*args, **kwargs)
KernelRule = Callable[[Run, tuple, dict, Any], Any]  # (run, args, kwargs, fake mode to make new tensors under)
ScratchRule = Callable[..., list[Scratch]]  # (args, kwargs, out), or (args, kwargs, out, gpu) when per_gpu

KERNEL_RULES: dict[tuple[Any, str], KernelRule] = {}
WORKSPACE_OUTPUTS: dict[Any, tuple[int, ...]] = {}  # op -> output positions that are kernel workspaces
SCRATCH_RULES: dict[tuple[Any, str], ScratchRule] = {}
PER_GPU: set[tuple[Any, str]] = set()  # rules told the target's GPU (register_scratch per_gpu)


def _op(name: str, overload: str = "default") -> Optional[Any]:
    packet = getattr(aten, name, None)
    return getattr(packet, overload, None) if packet is not None else None


def register_kernel(*ops: Any, devices: tuple[str, ...] = ("cpu", "cuda"),
                    workspace_outputs: tuple[int, ...] = ()) -> Callable[[KernelRule], KernelRule]:
    """Register ``fn(run, args, kwargs, mode) -> outputs`` in place of the fake kernel of ``ops``
    (``run`` is the fake kernel; new tensors are made under ``with mode:``)."""
    def wrap(fn: KernelRule) -> KernelRule:
        for op in ops:
            if op is None:
                continue
            for d in devices:
                if (op, d) in KERNEL_RULES:
                    raise RuntimeError(f"a kernel rule for {op} on {d} is already registered")
                KERNEL_RULES[(op, d)] = fn
            if workspace_outputs:
                WORKSPACE_OUTPUTS[op] = workspace_outputs
        return fn
    return wrap


def register_scratch(*ops: Any, devices: tuple[str, ...] = ("cpu",),
                     per_gpu: bool = False) -> Callable[[ScratchRule], ScratchRule]:
    """Register ``fn(args, kwargs, out) -> [Scratch]``: what ``ops`` allocate inside the kernel;
    ``per_gpu``: ``fn(args, kwargs, out, gpu)``, told the target's GPU (``Target.gpu``)."""
    def wrap(fn: ScratchRule) -> ScratchRule:
        for op in ops:
            if op is None:
                continue
            for d in devices:
                if (op, d) in SCRATCH_RULES:
                    raise RuntimeError(f"a scratch rule for {op} on {d} is already registered")
                SCRATCH_RULES[(op, d)] = fn
                if per_gpu:
                    PER_GPU.add((op, d))
        return fn
    return wrap


def kernel_rule(op: Any, device: str) -> Optional[KernelRule]:
    return KERNEL_RULES.get((op, device))


def scratch(op: Any, device: str, args: tuple, kwargs: dict, out: Any, gpu: str = "h100") -> list[Scratch]:
    rule = SCRATCH_RULES.get((op, device))
    if rule is None:
        return []
    found = rule(args, kwargs, out, gpu) if (op, device) in PER_GPU else rule(args, kwargs, out)
    return [s for s in found if s.nbytes > 0]


# -- aten._grouped_mm (MoE experts) ------------------------------------------------------------
@register_kernel(_op("_grouped_mm"))
def _grouped_mm(run: Run, args: tuple, kwargs: dict, mode: Any) -> torch.Tensor:
    """The CPU (and CUDA) kernel's own checks and output, where torch/_meta_registrations.py's
    ``meta_grouped_mm`` refuses fp32 (it copies the CUDA fast path's bf16 checks). After
    aten/src/ATen/native/GroupedMMUtils.h: ``_grouped_mm_validate_inputs`` (fp32, bf16 or fp16;
    2-d or 3-d; int32 offsets), ``_resolve_grouped_mm_out_dtype`` and
    ``create_grouped_gemm_output_tensor`` (the last dim's stride padded to 16 bytes, off ROCm);
    the CPU kernel then loops ``at::mm_out`` over the groups into that output (no other
    allocation: ``offs.cpu()`` of a CPU tensor is itself)."""
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args), **kwargs)
    a, b = bound["mat_a"], bound["mat_b"]
    offs, bias, out_dtype = bound.get("offs"), bound.get("bias"), bound.get("out_dtype")
    floats = (torch.float32, torch.bfloat16, torch.float16)

    def check(ok: bool, msg: str) -> None:
        if not ok:
            raise RuntimeError(msg)

    check(a.dtype in floats, f"Expected mat_a to be Float32, BFloat16 or Float16 matrix, got {a.dtype}")
    check(b.dtype in floats, f"Expected mat_b to be Float32, BFloat16 or Float16 matrix, got {b.dtype}")
    check(a.dim() in (2, 3) and b.dim() in (2, 3), "mat_a and mat_b have to be 2 or 3d")
    for m in (a, b):  # check_valid_strides_and_return_transposed: one unit stride, the other 16-byte aligned
        st, sz, align = m.stride(), m.shape, 16 // m.element_size()
        if st[-2] == 1 and st[-1] >= max(1, sz[-2]):
            check(st[-1] % align == 0, "strides should be multiple of 16 bytes")
        elif st[-1] == 1 and st[-2] >= max(1, sz[-1]):
            check(st[-2] % align == 0, "strides should be multiple of 16 bytes")
        else:
            check(False, f"Invalid strides/sizes, got {st} for strides and {tuple(sz)} for sizes")
    a2, b2 = a.dim() == 2, b.dim() == 2
    if not (a2 and b2):
        check(a.size(-1) == b.size(-2), "contraction dimension of mat_a and mat_b must match")
    check((offs is not None) == (a2 or b2), "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        check(offs.dim() == 1 and offs.dtype == torch.int32, "Offsets have to be a 1-d int32 tensor")
    check(bias is None, "Bias not supported yet")
    dtype = out_dtype or a.dtype
    check(dtype == a.dtype, "Grouped gemm output dtype must match `mat_a` dtype")
    if a2:
        assert offs is not None  # checked above: 2-d operands come with offsets
        size = [offs.size(0), a.size(0), b.size(1)] if b2 else [a.size(0), b.size(-1)]
        if not b2:
            check(offs.size(0) == b.size(0), "matrix batch sizes have to match")
    else:
        size = [a.size(1), b.size(1)] if b2 else [a.size(0), a.size(1), b.size(-1)]
    align = 16 // dtype.itemsize
    padded = size[:-1] + [-(-size[-1] // align) * align]
    stride = [math.prod(padded[i + 1:]) for i in range(len(padded))]
    with mode:
        return torch.empty_strided(size, stride, dtype=dtype, device=a.device)


# -- oneDNN RNN (nn.LSTM on the CPU) -----------------------------------------------------------
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
    runs of 80 random shapes, fp32 and bf16, tests/test_workspace.py)."""
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


@register_kernel(_op("mkldnn_rnn_layer"), devices=("cpu",), workspace_outputs=(3,))
def _mkldnn_rnn_layer(run: Run, args: tuple, kwargs: dict, mode: Any) -> Any:
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


# -- CPU flash attention -------------------------------------------------------------------
def _split(q_seq: int) -> int:
    """aten/src/ATen/native/cpu/FlashAttentionKernel.cpp ``flash_attention_kernel_impl`` and
    ``flash_attention_backward_kernel_impl``: the query block by sequence length (kv: 512)."""
    return 256 if q_seq >= 768 else 64 if q_seq >= 192 else 32


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_scratch(_op("_scaled_dot_product_flash_attention_for_cpu"))
def _flash_cpu(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """FlashAttentionKernel.cpp ``cpu_flash_attention``: per thread, an accumulation-type
    buffer qk (qS·kvS) + max (qS) + sum (qS) + dst (qS·D), and for bf16/fp16 a (qS, kvS)
    buffer in the input type. (fp16 with oneDNN packing, ``could_pack``, also pads K/V in
    ``std::make_unique`` buffers, outside PyTorch's allocator: not counted here either.)"""
    q, k = args[0], args[1]  # (b, h, s, d)
    qs, kvs, d = min(_split(q.size(2)), q.size(2)), min(512, k.size(2)), q.size(3)
    threads = torch.get_num_threads()
    acc = _opmath(q.dtype).itemsize
    reduced = q.dtype in (torch.float16, torch.bfloat16)
    return [Scratch(threads * (qs * kvs + 2 * qs + qs * d) * acc, "flash attention buffers (FlashAttentionKernel.cpp)"),
            Scratch(threads * qs * kvs * q.dtype.itemsize if reduced else 0, "flash attention reduced buffer")]


@register_scratch(_op("_scaled_dot_product_flash_attention_for_cpu_backward"))
def _flash_cpu_backward(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """FlashAttentionKernel.cpp ``cpu_flash_attention_backward``: per thread attn + grad_attn
    (2·qS·kvS, accumulation type; again in the input type for bf16/fp16), a ``dsum`` (qS) in
    each thread that runs a task (one counted, see below), and ``grad_out.contiguous()`` in (b, s, h, d) order when the
    gradient is not laid out so."""
    grad_out, q, k = args[0], args[1], args[2]  # (b, h, s, d)
    qs, kvs = min(_split(q.size(2)), q.size(2)), min(512, k.size(2))
    threads = torch.get_num_threads()
    acc = _opmath(q.dtype).itemsize
    reduced = q.dtype in (torch.float16, torch.bfloat16)
    # each worker thread makes its own dsum; the profiler's allocation events (the ground truth,
    # graphmem/validation/measure.py) record the calling thread's only: one
    tasks = 1
    found = [Scratch(threads * 2 * qs * kvs * acc, "flash attention backward buffers (FlashAttentionKernel.cpp)"),
             Scratch(threads * 2 * qs * kvs * q.dtype.itemsize if reduced else 0, "flash attention backward reduced buffer"),
             Scratch(tasks * qs * acc, "flash attention backward dsum")]
    if not grad_out.transpose(1, 2).is_contiguous():
        found.append(Scratch(grad_out.numel() * grad_out.dtype.itemsize, "grad_out.contiguous()"))
    return found


# -- LayerNorm backward on the CPU ---------------------------------------------------------------
@register_scratch(_op("native_layer_norm_backward"))
def _layer_norm_backward(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """aten/src/ATen/native/cpu/layer_norm_kernel.cpp ``LayerNormBackwardKernelImplInternal``:
    when dgamma or dbeta is wanted, a zeroed {2, num_threads, N} buffer for the two-pass
    reduction; ``LayerNormBackwardKernelImpl`` first makes ``dY.contiguous()``, and
    aten/src/ATen/native/layer_norm.cpp ``layer_norm_backward_cpu`` the input's."""
    names = ("grad_out", "input", "normalized_shape", "mean", "rstd", "weight", "bias", "output_mask")
    bound = dict(zip(names, args), **kwargs)
    dy, x, mask = bound["grad_out"], bound["input"], bound["output_mask"]
    n = math.prod(bound["normalized_shape"])
    found = []
    if mask[1] or mask[2]:
        found.append(Scratch(2 * torch.get_num_threads() * n * x.dtype.itemsize, "layer norm backward buffer (layer_norm_kernel.cpp)"))
    if not dy.is_contiguous():
        found.append(Scratch(dy.numel() * dy.dtype.itemsize, "dY.contiguous()"))
    if not x.is_contiguous():  # aten/src/ATen/native/layer_norm.cpp layer_norm_backward_cpu: expect_contiguous
        found.append(Scratch(x.numel() * x.dtype.itemsize, "input.expect_contiguous()"))
    return found


@register_scratch(_op("native_layer_norm"))
def _layer_norm(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """aten/src/ATen/native/layer_norm.cpp ``layer_norm_cpu``: ``input.expect_contiguous()``, a
    dense copy of a strided input for the kernel, gone when the op returns."""
    x = args[0]
    return [] if x.is_contiguous() else [Scratch(x.numel() * x.dtype.itemsize, "input.expect_contiguous()")]


# -- oneDNN LSTM scratch (forward and backward) --------------------------------------------------
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


@register_scratch(_op("mkldnn_rnn_layer"))
def _mkldnn_rnn_layer_scratch(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    x, h = args[0], args[10]  # input (T, N, I), hidden_size
    if args[9] != 2:  # LSTM only
        return []
    reorders, bias, pad = _onednn_lstm_scratch(x.size(2), h, x.size(1), x.size(0), x.dtype.itemsize)
    return [Scratch(reorders + bias, "oneDNN LSTM weight reorders and summed bias (mkldnn/RNN.cpp)"),
            Scratch(pad, "oneDNN LSTM scratchpad (rnn_utils.hpp)")]


@register_scratch(_op("mkldnn_rnn_layer_backward"))
def _mkldnn_rnn_layer_backward_scratch(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
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


# -- CUDA target: flash attention backward ---------------------------------------------------------
@register_scratch(_op("_scaled_dot_product_flash_attention_backward"), devices=("cuda",))
def _flash_cuda_backward(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp ``mha_bwd``: an fp32
    ``softmax_d`` (b, h, ⌈s_q/128⌉·128), the fp32 ``dq_accum`` (b, ⌈s_q/128⌉·128, h, ⌈d/32⌉·32)
    (non-deterministic mode: one split), and for MQA/GQA the expanded dK, dV (b, s_k, h, d)
    before their sum over the group. All die inside the op (softmax_d is dropped by ATen's
    wrapper)."""
    q, k = args[1], args[2]  # (b, h, s, d)
    b, h, s_q, d = q.shape
    h_k, s_k = k.size(1), k.size(2)
    s_r, d_r = -(-s_q // 128) * 128, -(-d // 32) * 32
    found = [Scratch(b * h * s_r * 4, "flash backward softmax_d (flash_api.cpp mha_bwd)"),
             Scratch(b * s_r * h * d_r * 4, "flash backward dq_accum (flash_api.cpp mha_bwd)")]
    if h_k != h:
        found.append(Scratch(2 * b * s_k * h * d * q.dtype.itemsize, "flash backward expanded dK, dV (GQA)"))
    return found


# -- CPU matrix multiply: operands BLAS cannot read in place -------------------------------------
def _blas_copies(m1: torch.Tensor, m2: torch.Tensor, result: torch.Tensor) -> int:
    """aten/src/ATen/native/LinearAlgebra.cpp ``addmm_impl_cpu_``: BLAS reads each operand as a
    column- or row-major matrix with a leading dimension at least its rows; an operand that is
    neither (an expanded gradient, stride 0, as ``sum()``'s) is first cloned contiguous. The
    result (made contiguous by the op) decides which operand plays BLAS's ``a``."""
    rs, rz = result.stride(), result.shape
    transpose_c = not (rs[0] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[0]))) and \
        rs[1] == 1 and (rz[0] == 1 or rs[0] >= max(1, rz[1]))
    if transpose_c:
        m1, m2 = m2, m1
    m, n = (rz[1], rz[0]) if transpose_c else (rz[0], rz[1])
    k = m1.shape[0 if transpose_c else 1]
    i, j = (1, 0) if transpose_c else (0, 1)
    copies = 0
    for t, lead, other in ((m1, m, k), (m2, k, n)):
        st = t.stride()
        if not ((st[i] == 1 and st[j] >= max(1, lead)) or (st[j] == 1 and st[i] >= max(1, other))):
            copies += t.numel() * t.element_size()
    return copies


@register_scratch(_op("mm"), _op("addmm"))
def _mm(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    m1, m2 = (args[0], args[1]) if len(args) < 3 or not isinstance(args[2], torch.Tensor) else (args[1], args[2])
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.numel() == 0 or m1.shape[1] == 0 \
            or out.dtype not in (torch.float32, torch.float64):  # bf16/fp16 may take oneDNN's matmul instead
        return []
    return [Scratch(_blas_copies(m1, m2, out), "operand copies for BLAS (LinearAlgebra.cpp addmm_impl_cpu_)")]


@register_scratch(_op("embedding_dense_backward"))
def _embedding_backward(args: tuple, kwargs: dict, out: Any) -> list[Scratch]:
    """aten/src/ATen/native/Embedding.cpp ``embedding_dense_backward_cpu``:
    ``grad_.contiguous().view({numel, d})``, a dense copy of a strided output gradient."""
    grad = args[0]
    return [] if grad.is_contiguous() else [Scratch(grad.numel() * grad.dtype.itemsize, "grad.contiguous()")]
