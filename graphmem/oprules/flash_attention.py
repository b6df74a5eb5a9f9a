"""Flash attention's scratch: the CPU kernel (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)
forward and backward, per-thread buffers; the CUDA target's backward (flash_api.cpp ``mha_bwd``).
"""
from __future__ import annotations

import torch

from graphmem.oprules.registry import Scratch, aten_op, register_scratch


def _split(q_seq: int) -> int:
    """aten/src/ATen/native/cpu/FlashAttentionKernel.cpp ``flash_attention_kernel_impl`` and
    ``flash_attention_backward_kernel_impl``: the query block by sequence length (kv: 512)."""
    return 256 if q_seq >= 768 else 64 if q_seq >= 192 else 32


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_scratch(aten_op("_scaled_dot_product_flash_attention_for_cpu"),
                  source="aten/src/ATen/native/cpu/FlashAttentionKernel.cpp cpu_flash_attention")
def _flash_cpu(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
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


@register_scratch(aten_op("_scaled_dot_product_flash_attention_for_cpu_backward"),
                  source="aten/src/ATen/native/cpu/FlashAttentionKernel.cpp cpu_flash_attention_backward")
def _flash_cpu_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
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


# -- CUDA target: flash attention backward ---------------------------------------------------------
@register_scratch(aten_op("_scaled_dot_product_flash_attention_backward"), devices=("cuda",),
                  source="aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp mha_bwd")
def _flash_cuda_backward(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
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

