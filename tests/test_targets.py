"""Targets: the CUDA rules on this CPU-only machine, dtypes, autocast, SDPA backends.

Byte counts are derived by hand in comments from what each kernel keeps for backward.
"""
from __future__ import annotations

import contextlib

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
