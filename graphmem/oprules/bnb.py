"""Scratch of bitsandbytes' 4-bit matmul (``bitsandbytes::gemm_4bit``, graphmem/training/qlora.py):
the op's fake (bitsandbytes/_ops.py) makes only the output, while the kernels dequantize the whole
weight to the compute dtype inside the op and free it when it returns.

- CPU: bitsandbytes/backends/default/ops.py ``_gemm_4bit_default_impl`` (the CPU backend registers
  no gemm_4bit of its own): with double quantization the block scales are dequantized first
  (``dequantize_blockwise(...) + absmax_offset``: one fp32 value per block lives on, the first
  copy is freed by the addition), then ``dequantize_4bit`` makes the (N, K) weight in A's dtype
  and ``F.linear`` runs on it.
- CUDA: bitsandbytes/backends/cuda/ops.py ``gemm_4bit``: past M = 1536 rows (every training step
  of any size) or with K not a multiple of the block size, ``_dequant_linear_fallback``: the
  fp32 scales twice (``absmax_dq`` stays referenced until the function returns, beside
  ``absmax_dq + absmax_offset``) and the (N, K) weight in A's dtype. At M <= 4 the fused kernel
  allocates nothing more; between, ``_gemm_4bit_use_custom_cuda`` picks per GPU architecture
  from the live device, which a fake step has not: graphmem counts the fallback's scratch there
  (an upper bound) and names it.

Registered with the first bitsandbytes op the recorder sees (graphmem/oprules/__init__.py
``load_bitsandbytes``), so bitsandbytes is never imported for models without one.
"""
from __future__ import annotations

from math import prod

import bitsandbytes  # noqa: F401  (defines torch.ops.bitsandbytes)
import torch

from graphmem.oprules.registry import Scratch, register_scratch

_NAMES = ("A", "B", "shapeB", "absmax", "blocksize", "quant_type", "bias", "absmax_8bit", "absmax_code",
          "absmax_offset")
CUDA_FUSED_MAX_M = 1536  # backends/cuda/ops.py _gemm_4bit_custom_max_m (CUDA)
CUDA_ALWAYS_FUSED_M = 4  # backends/cuda/ops.py _GEMM_4BIT_CUSTOM_FLOOR_M


def _bound(args: tuple, kwargs: dict) -> dict:
    return dict(zip(_NAMES, args), **kwargs)


def _weight(a: dict) -> Scratch:
    a_t = a["A"]
    return Scratch(prod(a["shapeB"]) * a_t.element_size(), "the dequantized weight (dequantize_4bit)")


def _scales(a: dict, copies: int) -> list[Scratch]:
    q = a.get("absmax_8bit")
    return [] if q is None else [Scratch(copies * q.numel() * 4, "fp32 block scales (dequantize_blockwise)")]


@register_scratch(torch.ops.bitsandbytes.gemm_4bit.default, devices=("cpu",),
                  source="bitsandbytes/backends/default/ops.py _gemm_4bit_default_impl")
def _gemm_4bit_cpu(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    a = _bound(args, kwargs)
    return [*_scales(a, 1), _weight(a)]


@register_scratch(torch.ops.bitsandbytes.gemm_4bit.default, devices=("cuda",),
                  source="bitsandbytes/backends/cuda/ops.py gemm_4bit, _dequant_linear_fallback")
def _gemm_4bit_cuda(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    a = _bound(args, kwargs)
    k = a["A"].shape[-1]
    m = a["A"].numel() // k
    if m <= CUDA_ALWAYS_FUSED_M and k % a["blocksize"] == 0:
        return []
    found = [*_scales(a, 2), _weight(a)]
    if m <= CUDA_FUSED_MAX_M and k % a["blocksize"] == 0:
        return [Scratch(s.nbytes, s.what + ", if bitsandbytes picks dequantize + F.linear on this GPU (upper bound)")
                for s in found]
    return found


# -- bitsandbytes' optimizers on the CPU (bitsandbytes/backends/cpu/ops.py) --------------------
# The kernels are torch code: fp32 copies live inside the op and die when it returns. Adam (what
# Trainer's adamw_bnb_8bit / paged_adamw_8bit run), at its widest point, n elements of p:
# - ``_optimizer_update_8bit_blockwise_cpu``: both states dequantized to fp32, ``grad = g.float() *
#   gnorm_scale``, and ``(state2_fp32.sqrt() / correction2)``'s sqrt and quotient: 5 x 4n bytes,
#   one more 4n for ``p.data.float()`` when p is not fp32 (else it is p itself).
# - ``_optimizer_update_32bit_cpu`` (parameters under ``min_8bit_size``): ``g_float``, then
#   ``state1 / (state2.sqrt() + eps * correction2)``'s sum and quotient: 3 x 4n, plus ``p_float``.
# At that widest point a Python float meets a tensor (``/ correction2``; ``+ eps * correction2``):
# the argument parser wraps it into an 8 B double and TensorIterator casts that to float32 (4 B)
# for the op (graphmem/oprules/scalars.py): 12 B more, found at the 8-bit kernel's quotient from
# the profiler's allocation events (the Trainer's Llama with adamw_bnb_8bit: the first step's peak).
# Other optimizer names (momentum, lion, rmsprop, adagrad, ademamix, lamb's norms) are not modelled.
_NUMBER = 8 + 4  # the wrapped double and its float32 cast

def _adam_scratch(args: tuple, kwargs: dict, fp32_copies: int, what: str) -> list[Scratch]:
    a = dict(zip(("optimizer_name", "g", "p"), args), **kwargs)
    if a["optimizer_name"] != "adam":
        return []
    p = a["p"]
    copies = fp32_copies + (0 if p.dtype == torch.float32 else 1)
    return [Scratch(copies * p.numel() * 4 + _NUMBER, what + " and a Python float as a 0-d tensor")]


@register_scratch(getattr(torch.ops.bitsandbytes, "optimizer_update_8bit_blockwise", None) and
                  torch.ops.bitsandbytes.optimizer_update_8bit_blockwise.default, devices=("cpu",),
                  source="bitsandbytes/backends/cpu/ops.py _optimizer_update_8bit_blockwise_cpu")
def _adam_8bit_cpu(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    return _adam_scratch(args, kwargs, 5, "fp32 states, gradient and update (8-bit Adam on the CPU)")


@register_scratch(getattr(torch.ops.bitsandbytes, "optimizer_update_32bit", None) and
                  torch.ops.bitsandbytes.optimizer_update_32bit.default, devices=("cpu",),
                  source="bitsandbytes/backends/cpu/ops.py _optimizer_update_32bit_cpu")
def _adam_32bit_cpu(args: tuple, kwargs: dict, out: object) -> list[Scratch]:
    return _adam_scratch(args, kwargs, 3, "fp32 gradient and update (bitsandbytes' 32-bit Adam on the CPU)")
