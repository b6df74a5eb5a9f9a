"""Targets: the CUDA rules on this CPU-only machine, dtypes, autocast, SDPA backends.

Byte counts are derived by hand in comments from what each kernel keeps for backward.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem
from graphmem.capture.cuda_rules import select_backend
from graphmem.capture.target import make_target
from graphmem.cli.main import main

B, H, S, HD = 2, 4, 40, 64
BF16 = 2  # bytes


class Attn(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _qkv(dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(B, H, S, HD, dtype=dtype, requires_grad=True) for _ in range(3))


def test_cuda_dropout_keeps_a_one_byte_mask_cpu_a_float_noise() -> None:
    x = (torch.randn(4, 10, 32, requires_grad=True),)
    cuda = graphmem.analyze(nn.Dropout(0.1), x, device="cuda")
    cpu = graphmem.analyze(nn.Dropout(0.1), x)
    assert cuda.activation_bytes == 4 * 10 * 32 * 1  # native_dropout's bool mask, 1 B an element
    assert cpu.activation_bytes == 4 * 10 * 32 * 4  # the CPU's float noise tensor


def test_flash_saves_inputs_output_fp32_logsumexp_and_rng_state() -> None:
    r = graphmem.analyze(Attn(), _qkv(), device="cuda", attention="flash")
    qkv_out = 4 * B * H * S * HD * BF16  # q, k, v (the step's inputs) and the output
    logsumexp = B * H * S * 4  # fp32 (b, h, s)
    rng = 2 * 8 + 8  # philox seed (2,) and offset (), uint64
    assert r.activation_bytes == qkv_out + logsumexp + rng == 165144
    assert r.attention_backends == {"flash": 1}


def test_efficient_pads_logsumexp_to_a_multiple_of_32() -> None:
    r = graphmem.analyze(Attn(), _qkv(), device="cuda", attention="efficient")
    padded = 64  # s = 40 rounded up to a multiple of 32
    assert r.activation_bytes == 4 * B * H * S * HD * BF16 + B * H * padded * 4 + 8 + 8 == 165904


def test_math_saves_the_b_h_s_s_probabilities_in_fp32() -> None:
    r = graphmem.analyze(Attn(), _qkv(), device="cuda", attention="math")
    fp32 = 4
    upcast_scaled = 3 * B * H * S * HD * fp32  # q*f, k^T*f (matmul operands) and v, upcast to fp32
    probs = B * H * S * S * fp32  # _safe_softmax output, saved by the second matmul
    assert r.activation_bytes == upcast_scaled + probs == 296960


def test_auto_backend_follows_pytorch_rules() -> None:
    t = make_target("cuda")
    q16 = torch.empty(B, H, S, HD, dtype=torch.bfloat16, device="meta")
    q32 = torch.empty(B, H, S, HD, device="meta")
    mask = torch.empty(S, S, dtype=torch.bool, device="meta")
    assert select_backend(t, q16, q16, None, False) == "flash"  # half, no mask, sm90, hd 64
    assert select_backend(t, q32, q32, None, False) == "efficient"  # flash needs fp16/bf16
    assert select_backend(t, q16, q16, mask, False) == "efficient"  # flash takes no mask
    assert select_backend(make_target("cuda", gpu="v100"), q16, q16, None, False) == "math"  # bf16 needs sm80
    odd = torch.empty(B, H, S, 60, dtype=torch.bfloat16, device="meta")
    assert select_backend(t, odd, odd, None, False) == "math"  # head dim not a multiple of 8
    assert select_backend(make_target("cuda", attention="cudnn"), q16, q16, None, False) == "cudnn"


class TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_autocast_weight_copies_are_categorized(device: str) -> None:
    r = graphmem.analyze(TwoLinear(), (torch.randn(16, 32),), device=device, amp="bf16")
    # b's input needs a gradient, so b's backward keeps its bf16 weight copy (8x64); a's input
    # (the batch) needs none, so a's weight copy is not saved
    assert r.by_category["autocast copy"] == 8 * 64 * BF16
    # activations: the bf16 copy of the batch (a needs it for its weight grad) and relu's output
    assert r.by_category["activation"] == 16 * 32 * BF16 + 16 * 64 * BF16


def test_dtype_builds_parameters_and_float_inputs_in_that_dtype() -> None:
    r = graphmem.analyze(TwoLinear(), (torch.randn(16, 32),), dtype="bf16")
    assert r.parameter_bytes == (32 * 64 + 64 + 64 * 8 + 8) * BF16
    assert r.input_bytes == 16 * 32 * BF16


def test_cuda_target_on_a_cpu_build_says_how_to_fix(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["analyze", "mlp-mnist", "--input-shape", "4x784", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA build" in err[0] and "pip install torch==2.14.1" in err[0]


@pytest.mark.parametrize("args,phrase", [
    (["--amp", "bf16", "--dtype", "bf16"], "nothing to cast"),
    (["--attention", "efficient"], "CUDA kernel"),
    (["--device", "cuda", "--gpu", "k80"], "unknown gpu"),
])
def test_target_option_mistakes_are_one_line(args: list[str], phrase: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "mlp-mnist", "--input-shape", "4x784", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0]


def test_cuda_bf16_gpt2_uses_flash_and_reports_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "tests/formula_models/tiny_gpt.py", "--input-shape", "2x16", "--device", "cuda",
                 "--dtype", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "target cuda (CUDA rules on fake CPU tensors), params bf16, attention auto on h100" in out


@pytest.mark.parametrize("amp,dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_cpu_amp_matches_a_real_cpu_autocast_run(amp: str, dtype: torch.dtype) -> None:
    """The CPU target runs PyTorch's own CPU autocast (bf16, and fp16 since torch 2.x): saved bytes equal a real run's."""
    from graphmem.validation.measure import measure_saved

    torch.manual_seed(0)
    net, x = TwoLinear(), (torch.randn(16, 32),)
    r = graphmem.analyze(net, x, amp=amp)
    saved: dict[int, int] = {}
    params = {p.untyped_storage()._cdata for p in net.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=dtype):
        net(*x).sum()
    assert r.activation_bytes == sum(saved.values())
    assert measure_saved(net, x) != r.activation_bytes  # fp32 without autocast differs


def test_cuda_report_carries_the_caching_allocator_prediction() -> None:
    from graphmem.passes.allocator import allocator

    r = graphmem.analyze(TwoLinear(), (torch.randn(16, 32),), device="cuda")
    a = r.cuda_allocator
    assert a == allocator(r.step)
    # rounding to 512 B blocks only adds; everything here fits one 2 MiB small-pool segment
    assert r.peak_bytes <= a.max_allocated <= r.peak_bytes + 512 * len(r.step.storages)
    assert a.max_reserved == 2 * 2**20
    d = r.to_dict()["cuda_allocator"]
    assert (d["max_allocated"], d["max_reserved"]) == (a.max_allocated, a.max_reserved)
    assert graphmem.analyze(TwoLinear(), (torch.randn(16, 32),)).cuda_allocator is None  # CPU target


def test_sdpa_kernel_priority_is_torch_own() -> None:
    """A model's ``sdpa_kernel(backends, set_priority=True)`` (torchtitan's SDPA asks cuDNN > flash >
    math) picks cuDNN on the CUDA target as on a GPU; the default order (flash first, cuDNN after
    math) never does (sdp_utils.cpp ``select_sdp_backend``)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    class Attn(torch.nn.Module):
        def __init__(self, order: list) -> None:
            super().__init__()
            self.proj, self.order = torch.nn.Linear(64, 192), order

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            q, k, v = self.proj(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4)
            with sdpa_kernel(self.order, set_priority=True) if self.order else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    x = torch.randn(2, 32, 64)
    titan = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    assert graphmem.analyze(Attn(titan), (x,), device="cuda", dtype="bf16").attention_backends == {"cudnn": 1}
    assert graphmem.analyze(Attn([]), (x,), device="cuda", dtype="bf16").attention_backends == {"flash": 1}
    assert torch._C._get_sdp_priority_order()[0] == int(SDPBackend.FLASH_ATTENTION)  # restored after the context


def _saved(report: graphmem.Report) -> Counter:
    return Counter((t.op, t.shape, t.dtype, t.bytes) for t in report.saved)


E, FF, SEQ = 64, 128, 16  # model width, feed-forward width, sequence (B = 2 sequences, H = 4 heads of HD_ = 16)
HD_ = E // H


def encoder(dropout: float) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, FF, dropout=dropout, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=False), (torch.randn(B, SEQ, E),)


def encoder_expected(dropout: float) -> Counter:
    """What a CUDA run of ``encoder`` under ``torch.autocast("cuda", torch.bfloat16)`` saves, by
    autocast's cast lists (aten/src/ATen/autocast_mode.h: linear, mm, bmm and SDPA are
    lower_precision_fp; layer_norm fp32) and the kernels CUDA picks. nn.TransformerEncoderLayer
    calls its attention with ``need_weights=False``, so multi_head_attention_forward calls SDPA:
    bf16 q, k, v, no mask, head dim 16 on sm90 is flash (sdp_utils.cpp)."""
    n, bf16, f32 = B * SEQ, "bfloat16", "float32"
    saved = Counter({
        # in_proj: the batch (seq-first, a non-contiguous view) cast to bf16, folded to 2-D by matmul
        # (a copy); its weight copy is not saved (the batch needs no gradient)
        ("aten.clone.default", (SEQ, B, E), bf16, n * E * 2): 1,
        # q, k, v: views of the packed projection made contiguous, saved by flash
        ("aten.clone.default", (3, SEQ, B, E), bf16, 3 * n * E * 2): 1,
        # flash: its output (also out_proj's input), fp32 logsumexp (b, h, s), philox seed and offset
        ("aten._scaled_dot_product_flash_attention.default", (B, H, SEQ, HD_), bf16, n * E * 2): 1,
        ("aten._scaled_dot_product_flash_attention.default", (B, H, SEQ), f32, B * H * SEQ * 4): 1,
        ("aten._scaled_dot_product_flash_attention.default", (2,), "uint64", 16): 1,
        ("aten._scaled_dot_product_flash_attention.default", (), "uint64", 8): 1,
        ("aten._to_copy.default", (E, E), bf16, E * E * 2): 1,  # out_proj's weight copy
        ("aten.add.Tensor", (B, SEQ, E), f32, n * E * 4): 2,  # the residual sums LayerNorm saves
        ("aten.native_layer_norm.default", (B, SEQ, 1), f32, n * 4): 4,  # mean and rstd of norm1, norm2
        ("aten._to_copy.default", (B, SEQ, E), bf16, n * E * 2): 1,  # linear1's input copy
        ("aten._to_copy.default", (FF, E), bf16, FF * E * 2): 1,  # linear1's weight copy
        ("aten._to_copy.default", (E, FF), bf16, E * FF * 2): 1,  # linear2's weight copy
        ("aten.relu.default", (B, SEQ, FF), bf16, n * FF * 2): 1,  # relu's output (linear2's input at p = 0)
    })
    if dropout > 0:  # CUDA's fused dropout: a bool mask each; linear2 saves the dropped bf16 activation
        saved += Counter({("aten.native_dropout.default", (B, SEQ, E), "bool", n * E): 2,
                          ("aten.native_dropout.default", (B, SEQ, FF), "bool", n * FF): 1,
                          ("aten.native_dropout.default", (B, SEQ, FF), bf16, n * FF * 2): 1})
    return saved


@pytest.mark.parametrize("dropout", [0.1, 0.0])
def test_cuda_amp_transformer_encoder_runs_its_attention_under_the_cuda_rules(dropout: float) -> None:
    """nn.MultiheadAttention's ``F.multi_head_attention_forward`` is one call to a
    TorchFunctionMode; its linears, SDPA and dropout meet the CUDA rules one by one (as CUDA's
    autocast meets the aten ops inside it). Before: fp32 linears, the CPU's math SDPA with float
    dropout noise: 160256 B at dropout 0.1."""
    module, inputs = encoder(dropout)
    r = graphmem.analyze(module, inputs, device="cuda", amp="bf16")
    assert _saved(r) == encoder_expected(dropout)
    assert r.activation_bytes == {0.1: 107544, 0.0: 91160}[dropout]
    assert r.attention_backends == {"flash": 1}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(E, H, dropout=0.1, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(x, x, x)[0]  # need_weights=True (the default): bmm, softmax, dropout, bmm; no SDPA


def test_cuda_amp_multihead_attention_with_weights_keeps_fp32_probabilities() -> None:
    torch.manual_seed(0)
    r = graphmem.analyze(Attention(), (torch.randn(B, SEQ, E),), device="cuda", amp="bf16")
    bh, n, bf16 = B * H, B * SEQ, "bfloat16"
    assert _saved(r) == Counter({
        ("aten.clone.default", (SEQ, B, E), bf16, n * E * 2): 1,  # in_proj's folded bf16 input
        ("aten.clone.default", (3, SEQ, B, E), bf16, 3 * n * E * 2): 1,  # k and v (bmm's operands): bf16
        ("aten.mul.Tensor", (bh, SEQ, HD_), bf16, n * E * 2): 1,  # the scaled q, bmm's other operand
        ("aten._softmax.default", (bh, SEQ, SEQ), "float32", bh * SEQ * SEQ * 4): 1,  # softmax: fp32 list
        ("aten.native_dropout.default", (bh, SEQ, SEQ), "bool", bh * SEQ * SEQ): 1,  # fused dropout's mask
        ("aten._to_copy.default", (bh, SEQ, SEQ), bf16, bh * SEQ * SEQ * 2): 1,  # the probabilities cast for bmm
        ("aten.clone.default", (SEQ, bh, HD_), bf16, n * E * 2): 1,  # out_proj's input, made contiguous
        ("aten._to_copy.default", (E, E), bf16, E * E * 2): 1,  # out_proj's weight copy
    })
    assert r.attention_backends == {}


class AutocastOff(nn.Module):
    """A region with autocast off for the tensors' device type, as transformers writes it
    (``torch.autocast(device_type=x.device.type, enabled=False)``: 4.x's LlamaRotaryEmbedding,
    GPT-2's ``_upcast_and_reordered_attn``), and a bf16 region inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)  # bf16 under the target's amp
        with torch.autocast(device_type=x.device.type, enabled=False):
            h = self.b(h.float())  # fp32, as on a GPU: "cuda" there, "cpu" on graphmem's fake tensors
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
                h = self.c(h)  # bf16 again
        return h


def autocast_off_expected() -> Counter:
    n = 16 * 32
    return Counter({
        ("aten._to_copy.default", (16, 32), "bfloat16", n * 2): 2,  # a's input copy; c's input copy
        ("aten._to_copy.default", (16, 32), "float32", n * 4): 1,  # b's input: h.float(), not cast back
        ("aten._to_copy.default", (32, 32), "bfloat16", 32 * 32 * 2): 1,  # c's weight copy (b keeps its fp32 weight)
    })


def test_cuda_rules_honour_the_models_autocast_regions() -> None:
    """Before, the region was ignored: 7168 B, not 6144, as b ran in bf16 (its fp32 input cast back
    to bf16, its weight copied) and c saved b's bf16 output."""
    r = graphmem.analyze(AutocastOff(), (torch.randn(16, 32),), device="cuda", amp="bf16")
    assert _saved(r) == autocast_off_expected()
    assert not torch.is_autocast_enabled("cuda")  # the state and torch.autocast are as they were
    assert torch.autocast.__init__.__module__ == "torch.amp.autocast_mode"


def upcast_gpt2() -> tuple[nn.Module, tuple, Counter]:
    """transformers' GPT-2 with ``reorder_and_upcast_attn`` and the fp32 q and k its
    ``_upcast_and_reordered_attn`` saves under CUDA autocast, by (shape, dtype): count."""
    from zoo import _TINY_GPT2, _hf

    module, inputs = _hf("GPT2Config:GPT2LMHeadModel", 16, None, reorder_and_upcast_attn=True, attn_implementation="eager",
                         **_TINY_GPT2)()
    cfg: Any = module.config
    bh, s, hd = inputs[0].shape[0] * cfg.n_head, inputs[0].shape[1], cfg.n_embd // cfg.n_head
    return module, inputs, Counter({((bh, s, hd), "float32"): cfg.n_layer, ((bh, hd, s), "float32"): cfg.n_layer})


def test_cuda_rules_open_transformers_maybe_autocast_regions() -> None:
    """GPT-2's ``_upcast_and_reordered_attn`` runs baddbmm in ``maybe_autocast(query.device.type,
    enabled=False)``, which transformers opens only where ``torch.is_autocast_enabled(device_type)``
    (transformers/utils/generic.py): on a GPU under amp it is, so baddbmm takes ``q.float()`` and
    ``k.float()`` as they are and saves them in fp32. Before, asked about "cpu" (the fake tensors'
    device type), torch said no, and baddbmm's operands were cast back to bf16: 8192 B less here."""
    module, inputs, upcast = upcast_gpt2()
    r = graphmem.analyze(module, inputs, device="cuda", amp="bf16")
    copies = Counter((t.shape, t.dtype) for t in r.saved if t.op == "aten._to_copy.default")
    assert {k: copies[k] for k in upcast} == upcast
    assert not any(t.dtype == "bfloat16" and (t.shape, "float32") in upcast for t in r.saved)


def test_cuda_amp_llama_rotary_cos_sin_stay_fp32() -> None:
    """transformers' LlamaRotaryEmbedding (5.x) computes cos and sin from fp32 ``position_ids *
    inv_freq`` with no autocast region (mul and cos are on none of CUDA autocast's lists), so they
    are fp32 under amp as on a GPU; q * cos and k * sin save them (per position, for all heads)."""
    from zoo import _LM, _hf

    module, inputs = _hf("LlamaConfig:LlamaForCausalLM", 16, None, **_LM)()
    r = graphmem.analyze(module, inputs, device="cuda", amp="bf16")
    cfg: Any = module.config
    rotary = [(t.shape, t.dtype) for t in r.saved if t.module == "model.rotary_emb"]
    assert rotary == [((1, inputs[0].shape[1], cfg.hidden_size // cfg.num_attention_heads), "float32")] * 2
