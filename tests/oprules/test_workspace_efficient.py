"""CUDA memory-efficient attention backward's scratch (graphmem/oprules/efficient_attention.py),
checked against sizes computed here by hand from PyTorch's source (attention_backward.cu
``_efficient_attention_backward``, kernel_backward.h ``Params::workspace_size``, cutlassB.h's sm80
kernel lists). No GPU was at hand: the formula is derived from source, unchecked on hardware.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem
from graphmem.oprules.efficient_attention import Kernel, select, workspace_size

BF16, F32 = torch.bfloat16, torch.float32
GQ_TILE_64 = 4 + 64 * 64  # GradQTempStorage: lock, counter, pad[2] + a 64x64 fp32 tile, in floats
GQ_TILE_128x64 = 4 + 128 * 64
GQ_TILE_128x128 = 4 + 128 * 128


@pytest.mark.parametrize("dtype,max_k,dropout,m,n,kernel", [
    (BF16, 64, False, 40, 40, Kernel(False, 64, 64, 64)),  # 40 is no multiple of 64: not the seq-aligned one
    (BF16, 64, False, 128, 128, Kernel(False, 64, 64, 64, True)),
    (torch.float16, 128, False, 100, 100, Kernel(False, 128, 128, 128)),
    (BF16, 128, True, 128, 128, Kernel(True, 128, 128, 128)),  # dropout: the kApplyDropout kernels
    (BF16, 192, False, 4096, 4096, Kernel(False, 128, 64, 65536)),  # DeepSeek-V3's MLA (192 / 128)
    (F32, 128, False, 100, 100, Kernel(False, 128, 64, 128)),
    (F32, 80, True, 100, 100, Kernel(True, 128, 64, 128)),
])
def test_the_first_kernel_of_the_sm80_list_that_fits(dtype: torch.dtype, max_k: int, dropout: bool, m: int, n: int,
                                                      kernel: Kernel) -> None:
    assert select(dtype, max_k, dropout, m, n) == kernel


def test_bf16_head_dim_64_keeps_dk_dv_in_registers_and_accumulates_dq_in_fp32() -> None:
    # 64x64_k64: kOutputInRF (64 <= 64), so only the dQ accumulator: ⌈40/64⌉·⌈64/64⌉ tiles per (b, h)
    assert workspace_size(BF16, 2, 4, 40, 40, 64, 64, False) == 2 * 4 * GQ_TILE_64 * 4 == 131200


def test_deepseek_v3_mla_head_dims_192_128() -> None:
    # 128x64_k65536: not kOutputInRF, so per split one key block's fp32 dK (64 x align(192, 128)) and
    # dV (64 x align(128, 128)) tiles; B·nH = 128 caps the splits at 200 // 128 = 1
    gk, gv, gq = 64 * 256, 64 * 128, (4096 // 128) * (192 // 64) * GQ_TILE_128x64
    assert workspace_size(BF16, 1, 128, 4096, 4096, 192, 128, False) == 128 * (gk + gv + gq) * 4 == 415432704
    # two heads: ⌈256/64⌉ = 4 splits (under 200 // 2), each with its own dK/dV tiles
    gk, gv, gq = 4 * 64 * 256, 4 * 64 * 128, 2 * 3 * GQ_TILE_128x64
    assert workspace_size(BF16, 1, 2, 256, 256, 192, 128, False) == 2 * (gk + gv + gq) * 4 == 1179840


def test_splits_fall_to_one_with_enough_blocks_or_in_deterministic_mode() -> None:
    # B·nH = 256 blocks and no more than 2 key blocks: one split
    one = 64 * 256 + 64 * 256 + 1 * 4 * GQ_TILE_128x64
    assert workspace_size(BF16, 16, 16, 128, 128, 256, 256, False) == 256 * one * 4
    many = 16 * 64 * 256 * 2 + 8 * 4 * GQ_TILE_128x64  # ⌈1024/64⌉ = 16 splits, under 200 // 4
    assert workspace_size(BF16, 1, 4, 1024, 1024, 256, 256, False) == 4 * many * 4
    assert workspace_size(BF16, 1, 4, 1024, 1024, 256, 256, False, deterministic=True) == \
        4 * (64 * 256 * 2 + 8 * 4 * GQ_TILE_128x64) * 4


def test_fp32_needs_no_dk_dv_accumulators() -> None:
    # fp32 writes dK/dV straight into the output (output_accum_t is the output type): dQ only
    assert workspace_size(F32, 2, 4, 100, 100, 128, 128, False) == 2 * 4 * (1 * 2 * GQ_TILE_128x64) * 4 == 524544
    # the workspace row is aligned to 4 floats: 2 tiles of 4 + 4096 floats are a multiple already
    assert workspace_size(F32, 1, 1, 65, 65, 32, 32, False) == 2 * GQ_TILE_64 * 4


class Attn(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _scratch(report: graphmem.Report) -> dict[str, int]:
    step = report.step
    assert step is not None
    return {s.name.split("scratch: ")[1]: s.nbytes for s in step.storages.values() if s.kind == "workspace"}


def _qkv(b: int, h: int, s: int, k: int, kv: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for d in (k, k, kv))


def test_the_cuda_target_counts_the_scratch_and_drops_the_note() -> None:
    # GIVEN MLA's head dims, which flash refuses (192 for q/k), on the H100
    b, h, s = 1, 2, 256
    r = graphmem.analyze(Attn(), _qkv(b, h, s, 192, 128, BF16), device="cuda", attention="efficient")
    found = _scratch(r)
    # THEN the backward's scratch: the sum's expanded gradient made contiguous, delta, the workspace;
    # and the forward's fp32 output accumulator (the 32x128 k65536 kernel: head dim above 128)
    assert found == {"grad_out.contiguous() (attention_backward.cu)": b * h * s * 128 * 2,
                     "memory-efficient backward delta (B, nH, M) fp32 (attention_backward.cu)": b * h * s * 4,
                     "memory-efficient backward fp32 accumulators (kernel_backward.h workspace_size)": 1179840,
                     "memory-efficient forward fp32 output accumulator (attention.cu)": b * s * h * 128 * 4}
    assert not [n for n in r.notes if "memory-efficient" in n]


@pytest.mark.parametrize("k,kv,dtype", [(128, 128, BF16), (64, 192, F32), (64, 64, torch.float16)])
def test_the_forward_keeps_its_output_in_registers_up_to_head_dim_128_or_in_fp32(k: int, kv: int,
                                                                                    dtype: torch.dtype) -> None:
    r = graphmem.analyze(Attn(), _qkv(1, 2, 64, k, kv, dtype), device="cuda", attention="efficient")
    assert not [name for name in _scratch(r) if "forward" in name]


def test_fp32_delta_temporaries_beyond_the_workspace() -> None:
    # fp32, K = 32 but Kv = 128: kernel 128x64_k128, one dQ tile per (b, h); delta comes from
    # (grad_out * out).sum(-1) (B, M, nH, Kv fp32), gone before the workspace is made
    b, h, s = 1, 2, 128
    r = graphmem.analyze(Attn(), _qkv(b, h, s, 32, 128, F32), device="cuda", attention="efficient")
    found = _scratch(r)
    ws = b * h * GQ_TILE_128x64 * 4
    product, delta = b * s * h * 128 * 4, b * h * s * 4
    assert found["memory-efficient backward fp32 accumulators (kernel_backward.h workspace_size)"] == ws == 65568
    assert found["memory-efficient backward delta's temporaries (grad_out * out).sum(-1), beyond the workspace "
                 "made after them"] == product + delta - ws


def test_gpus_whose_kernel_choice_is_not_derived_keep_the_note() -> None:
    r = graphmem.analyze(Attn(), _qkv(1, 2, 64, 64, 64, BF16), device="cuda", attention="efficient", gpu="a10")
    assert not _scratch(r)
    assert [n for n in r.notes if "memory-efficient attention (CUDA)" in n and "A100, H100" in n]


def test_auto_sends_unequal_head_dims_to_memory_efficient() -> None:
    # flash needs q, k and v of one head dim (sdp_utils.cpp check_head_dim_size_flash): MLA's
    # 192/128 runs memory-efficient attention, whose scratch the report then counts
    r = graphmem.analyze(Attn(), _qkv(1, 2, 64, 192, 128, BF16), device="cuda")
    assert r.attention_backends == {"efficient": 1}
    assert _scratch(r)
    r = graphmem.analyze(Attn(), _qkv(1, 2, 64, 128, 128, BF16), device="cuda")
    assert r.attention_backends == {"flash": 1}
