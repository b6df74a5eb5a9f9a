"""CUDA target: the scratch of memory-efficient attention (the CUTLASS kernels of xformers that
PyTorch ships), backward and forward, registered as scratch rules (graphmem/oprules/registry.py),
and the report's note where the target GPU is not modelled.

Derived from PyTorch 2.14's source, **unchecked on hardware** (graphmem was built without a GPU):

- aten/src/ATen/native/transformers/cuda/attention_backward.cu ``_efficient_attention_backward``
  (CUDA branch): ``grad_out_.contiguous()`` (a copy when the gradient is not laid out (B, M, H, K)),
  ``grad_q/k/v`` (the op's outputs, which the fake kernel makes too), ``delta`` (B, nH, M) fp32
  (``at::empty`` when the kernel computes it, else ``(grad_out.to(kFloat) * out.to(kFloat))
  .sum(-1).transpose(-2, -1).contiguous()``, whose temporaries die before the workspace is made),
  and a uint8 ``workspace`` of ``p.workspace_size()`` bytes; ``launchKernel`` takes the first kernel
  of ``dispatch_cutlassB`` whose ``kMaxK`` covers max(K, Kv), that applies dropout if needed and
  whose ``kKeysQueriesAlignedToBlockSize`` holds; the split-keys heuristic sets
  ``num_splits_key``. ``_scaled_dot_product_efficient_attention_backward_cuda`` calls it on
  (B, M, H, K) views.
- mem_eff_attention/kernel_backward.h ``AttentionBackwardKernel``: ``kOutputInRF = kIsHalf &&
  kMaxK <= kBlockSizeI``; ``kNeedsAccumGradQ`` (split keys are enabled from sm70) and, when the
  output is not kept in registers and is not fp32, ``kNeedsAccumGradK/V``; ``Params::workspace_size``
  = B·nH·align4(gk + gv + gq)·4 with gk = splits·kBlockSizeJ·align(K, kBlockSizeI) (per split, one
  key block's fp32 dK tile), gv likewise with Kv, gq = ⌈M/kBlockSizeI⌉·⌈K/kBlockSizeJ⌉ tiles of
  ``GradQTempStorage`` (4 int32 + kBlockSizeI·kBlockSizeJ fp32: ``GmemTile::kElementsStored``,
  the threads' accumulator fragments of a kBlockSizeI×kBlockSizeJ tile);
  ``kKernelComputesDelta = kIsHalf && (kOutputInRF || sm != 70)``.
- mem_eff_attention/kernels/cutlassB.h ``dispatch_cutlassB_{bf16,f16,f32}_sm80`` (every GPU from
  compute capability 8.0 to 12.1): the kernel lists below.
- forward: attention.cu ``_efficient_attention_forward`` takes the first kernel of cutlassF.h's
  sm80 list (64x64 k64, 64x128 k128, 32x128 k65536) whose ``kMaxK`` covers max(K, Kv); the last
  does not keep the output in registers (kernel_forward.h ``kSingleValueIteration = kMaxK <=
  kKeysPerBlock``), so for 16-bit inputs it makes an fp32 ``output_accum`` (B, M, nH, Kv)
  (``kNeedsOutputAccumulatorBuffer``), freed when the op returns.

Known limitations: modelled for the GPUs whose shared memory (opt-in, per block: A100 163 KB,
H100/H200/B200 227 KB) is taken to hold every kernel of the sm80 list, since those kernels were
generated for sm80 (the 64-wide ones are the fallbacks for smaller shared memory); on the A10 and
L4 (sm86/89: 99 KB and an extra k96 kernel), T4 and V100, which kernel fits is not derived and the
report says so (its note, below). Batches above 65,535 (run in chunks) are not modelled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from graphmem.oprules.registry import RecordedOp, Scratch, aten_op, register_note, register_scratch

HALF = (torch.float16, torch.bfloat16)
SOURCE = ("aten/src/ATen/native/transformers/cuda/attention_backward.cu _efficient_attention_backward, "
          "attention.cu _efficient_attention_forward; mem_eff_attention/kernel_backward.h workspace_size")


@dataclass(frozen=True)
class Kernel:
    """``AttentionBackwardKernel<Sm80, scalar_t, kIsAligned=true, kApplyDropout, kPreload,
    kBlockSizeI, kBlockSizeJ, kMaxK, kKeysQueriesAlignedToBlockSize>`` (kPreload plays no part)."""

    dropout: bool
    block_i: int
    block_j: int
    max_k: int
    seq_aligned: bool = False


_K = Kernel
# cutlassB.h dispatch_cutlassB_bf16_sm80 / _f16_sm80 (the same list), leaving out the
# k96 kernel it adds on sm86/89 only
SM80_HALF = (_K(False, 64, 64, 32, True), _K(False, 64, 64, 32), _K(False, 64, 64, 64, True), _K(False, 64, 64, 64),
             _K(False, 128, 128, 128, True), _K(False, 128, 128, 128), _K(False, 64, 64, 128, True),
             _K(False, 64, 64, 128), _K(False, 128, 64, 65536), _K(False, 64, 64, 65536),
             _K(True, 64, 64, 32), _K(True, 64, 64, 64), _K(True, 128, 128, 128), _K(True, 64, 64, 128),
             _K(True, 128, 64, 65536), _K(True, 64, 64, 65536))
# cutlassB.h dispatch_cutlassB_f32_sm80
SM80_F32 = (_K(False, 64, 64, 32), _K(False, 64, 64, 64), _K(False, 128, 64, 128), _K(False, 64, 64, 128),
            _K(False, 128, 64, 65536), _K(False, 64, 64, 65536), _K(True, 64, 64, 32), _K(True, 64, 64, 64),
            _K(True, 128, 64, 128), _K(True, 64, 64, 128), _K(True, 128, 64, 65536), _K(True, 64, 64, 65536))
# the compute capabilities modelled (module docstring): A100 (8.0), H100 and H200 (9.0), B200 (10.0)
MODELLED = ((8, 0), (9, 0), (10, 0))


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _align(a: int, b: int) -> int:
    return _ceil(a, b) * b


def select(dtype: torch.dtype, max_k: int, dropout: bool, m: int, n: int, varlen: bool = False) -> Kernel:
    """attention_backward.cu ``launchKernel``: the first kernel of the list that fits."""
    for k in SM80_HALF if dtype in HALF else SM80_F32:
        if k.max_k < max_k or (dropout and not k.dropout):
            continue
        if k.seq_aligned and (varlen or m % k.block_i or n % k.block_j):
            continue
        return k
    raise ValueError(f"no memory-efficient backward kernel for head dim {max_k}")  # cutlassB: no kernel found


def splits_key(k: Kernel, accum_kv: bool, batches: int, heads: int, n: int, given: Optional[int] = None,
               deterministic: bool = False) -> int:
    """attention_backward.cu: ``num_splits_key`` (the split-keys heuristic; grid (1, nH, B) before it)."""
    s = _ceil(n, k.block_j)
    if given is not None:
        s = min(s, given)
    else:
        if batches * heads >= 256 and n <= 2 * k.block_j:
            s = 1
        if accum_kv:
            s = min(s, 200 // (batches * heads))
    return 1 if s < 1 or deterministic else s


def workspace_size(dtype: torch.dtype, batches: int, heads: int, m: int, n: int, head_dim: int, head_dim_v: int,
                   dropout: bool, varlen: bool = False, given_splits: Optional[int] = None,
                   deterministic: bool = False) -> int:
    """Bytes of the kernel's fp32 workspace (kernel_backward.h ``Params::workspace_size``)."""
    k = select(dtype, max(head_dim, head_dim_v), dropout, m, n, varlen)
    half = dtype in HALF
    accum_kv = half and not k.max_k <= k.block_i  # kNeedsAccumGradK/V: not kOutputInRF, output not fp32
    s = splits_key(k, accum_kv, batches, heads, n, given_splits, deterministic)
    gk = s * k.block_j * _align(head_dim, k.block_i) if accum_kv else 0
    gv = s * k.block_j * _align(head_dim_v, k.block_i) if accum_kv else 0
    gq = _ceil(m, k.block_i) * _ceil(head_dim, k.block_j) * (4 + k.block_i * k.block_j)  # GradQTempStorage
    return batches * heads * _align(gk + gv + gq, 4) * 4


def backward_scratch(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     dropout_p: float, cu_seqlens: Optional[tuple[torch.Tensor, int, int]] = None,
                     given_splits: Optional[int] = None) -> list[Scratch]:
    """``_efficient_attention_backward``'s scratch; tensors in its (B, M, nH, K) layout.
    ``cu_seqlens``: (cu_seqlens_q, max_seqlen_q, max_seqlen_k) of a variable-length call."""
    b, m, h, kq = query.shape
    kv = value.size(3)
    batches, mq, nk = (b, m, key.size(1)) if cu_seqlens is None else \
        (cu_seqlens[0].size(0) - 1, cu_seqlens[1], cu_seqlens[2])
    deterministic = torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    ws = workspace_size(query.dtype, batches, h, mq, nk, kq, kv, dropout_p != 0.0, cu_seqlens is not None,
                        given_splits, deterministic)
    copy = 0 if grad_out.is_contiguous() else grad_out.numel() * grad_out.dtype.itemsize
    delta = b * h * m * 4
    found = [Scratch(copy, "grad_out.contiguous() (attention_backward.cu)"),
             Scratch(delta, "memory-efficient backward delta (B, nH, M) fp32 (attention_backward.cu)"),
             Scratch(ws, "memory-efficient backward fp32 accumulators (kernel_backward.h workspace_size)")]
    if query.dtype not in HALF:  # delta from (grad_out * out).sum(-1), made before the workspace
        product = grad_out.numel() * 4
        summed = 0 if h == 1 or m == 1 else delta  # the transposed sum is contiguous already
        found.append(Scratch(max(0, product + summed - ws), "memory-efficient backward delta's temporaries "
                             "(grad_out * out).sum(-1), beyond the workspace made after them"))
    return found


@register_scratch(aten_op("_scaled_dot_product_efficient_attention_backward"), devices=("cuda",), per_gpu=True,
                  source=SOURCE)
def _sdpa_efficient_backward(args: tuple, kwargs: dict, out: object, capability: tuple[int, int]) -> list[Scratch]:
    """``_scaled_dot_product_efficient_attention_backward_cuda``: (B, nH, M, K) in, transposed."""
    names = ("grad_out", "query", "key", "value", "attn_bias", "out", "logsumexp", "philox_seed", "philox_offset",
             "dropout_p")
    bound = dict(zip(names, args), **kwargs)
    if capability not in MODELLED or bound["grad_out"] is None:
        return []
    g, q, k, v = (bound[n].transpose(1, 2) for n in ("grad_out", "query", "key", "value"))
    return backward_scratch(g, q, k, v, float(bound["dropout_p"]))


@register_scratch(aten_op("_efficient_attention_backward"), devices=("cuda",), per_gpu=True,
                  source=SOURCE)
def _efficient_backward(args: tuple, kwargs: dict, out: object, capability: tuple[int, int]) -> list[Scratch]:
    names = ("grad_out", "query", "key", "value", "bias", "out", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
             "max_seqlen_k", "logsumexp", "dropout_p")
    bound = dict(zip(names, args), **kwargs)
    if capability not in MODELLED or bound["grad_out"] is None:
        return []
    cu = bound.get("cu_seqlens_q")
    varlen = (cu, int(bound["max_seqlen_q"]), int(bound["max_seqlen_k"])) if cu is not None else None
    return backward_scratch(bound["grad_out"], bound["query"], bound["key"], bound["value"], float(bound["dropout_p"]),
                            varlen, bound.get("num_splits_key"))


def forward_scratch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> list[Scratch]:
    """``_efficient_attention_forward``'s fp32 output accumulator; tensors in (B, M, nH, K)."""
    b, m, h, _ = query.shape
    kv = value.size(3)
    if query.dtype not in HALF or max(key.size(3), kv) <= 128:
        return []
    return [Scratch(b * m * h * kv * 4, "memory-efficient forward fp32 output accumulator (attention.cu)")]


@register_scratch(aten_op("_scaled_dot_product_efficient_attention"), devices=("cuda",), per_gpu=True,
                  source=SOURCE)
def _sdpa_efficient_forward(args: tuple, kwargs: dict, out: object, capability: tuple[int, int]) -> list[Scratch]:
    q, k, v = (args[i].transpose(1, 2) for i in range(3))  # (B, nH, M, K) in
    return forward_scratch(q, k, v) if capability in MODELLED else []


@register_scratch(aten_op("_efficient_attention_forward"), devices=("cuda",), per_gpu=True,
                  source=SOURCE)
def _efficient_forward(args: tuple, kwargs: dict, out: object, capability: tuple[int, int]) -> list[Scratch]:
    return forward_scratch(args[0], args[1], args[2]) if capability in MODELLED else []


@register_note(aten_op("_scaled_dot_product_efficient_attention_backward"), aten_op("_efficient_attention_backward"),
               devices=("cuda",), source=SOURCE)
def _efficient_backward_note(node: RecordedOp) -> str:
    if node.meta.get("scratch"):  # covered by the rules above
        return ""
    return ("memory-efficient attention (CUDA): the kernels' fp32 accumulators (attention_backward.cu workspace, "
            "the forward's output accumulator) are modelled for the A100, H100, H200 and B200 only: on this GPU, "
            "which kernel fits its shared memory is not derived (gpu='a100' or 'h100' gives the sm80 kernels' figure)")
