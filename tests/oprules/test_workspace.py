"""Kernel rules (graphmem/oprules/registry.py) against real CPU kernels.

Each rule is checked where its kernel runs here: the sizes a real kernel returns (oneDNN's LSTM
workspace, aten._grouped_mm's output) and the scratch it allocates inside the op, read from the
CPU allocator's events (torch.profiler, as graphmem/validation/measure.py does) per top-level op.
"""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem
from graphmem.oprules import kernel_rule
from graphmem.oprules.registry import find, register_kernel, register_scratch
from graphmem.oprules.rnn import onednn_lstm_workspace
from graphmem.validation.measure import measure_peak

aten = torch.ops.aten
# bf16 kernels run oneDNN only where it has bf16 support (AVX-512 BF16 or AMX; not on an AVX2-only CPU): there
# the bf16 LSTM takes ATen's own path (no oneDNN workspace) and bf16 GEMMs no oneDNN scratch (measured on AVX2)
ONEDNN_BF16 = torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _op_scratch(fn: object, names: tuple[str, ...]) -> list[int]:
    """Per call of a top-level op named in ``names`` during ``fn()``: the bytes allocated inside
    it above what it still holds when it returns (its scratch)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()  # type: ignore[operator]
    found: list[int] = []

    def allocations(e: object) -> list[tuple[int, int]]:
        out, todo = [], [e]
        while todo:
            x = todo.pop()
            if x.tag == _EventType.Allocation:  # type: ignore[attr-defined]
                out.append((x.start_time_ns, x.extra_fields.alloc_size))  # type: ignore[attr-defined]
            todo.extend(x.children)  # type: ignore[attr-defined]
        return sorted(out)

    def walk(e: object) -> None:
        if e.tag == _EventType.TorchOp and e.name in names:  # type: ignore[attr-defined]
            run = high = 0
            for _, size in allocations(e):
                run += size
                high = max(high, run)
            found.append(high - run)
            return
        for c in e.children:  # type: ignore[attr-defined]
            walk(c)

    for e in prof.profiler.kineto_results.experimental_event_tree():
        walk(e)
    return found


def test_registries_refuse_duplicates() -> None:
    op = aten._grouped_mm.default
    assert kernel_rule(op, "cpu") is not None
    with pytest.raises(RuntimeError, match="already registered"):
        register_kernel(op, source="a second rule")(lambda run, a, k, mode: None)
    with pytest.raises(RuntimeError, match="already registered"):
        register_scratch(aten.native_layer_norm_backward.default, source="a second rule")(lambda a, k, out: [])
    assert find("scratch", aten.native_layer_norm_backward.default, "cuda") is None  # CPU kernels only


@pytest.mark.parametrize("seed", range(3))
def test_onednn_lstm_workspace_equals_real_kernel(seed: int) -> None:
    """The saved uint8 workspace of 20 random single-layer LSTMs (fp32 and bf16) has the size
    the rule computes from oneDNN's layout (a bf16 LSTM saves none where oneDNN lacks bf16)."""
    rng = random.Random(seed)
    sizes: list[int] = []

    def capture_ws(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.uint8:
            sizes.append(t.untyped_storage().nbytes())
        return t

    for _ in range(20):
        i, h = rng.choice([1, 3, 17, 32, 64, 256, 300]), rng.choice([1, 5, 16, 48, 100, 256, 257])
        b, s = rng.randint(1, 6), rng.randint(1, 24)
        dtype = rng.choice([torch.float32, torch.bfloat16])
        lstm = nn.LSTM(i, h, batch_first=True).to(dtype)
        sizes.clear()
        with torch.autograd.graph.saved_tensors_hooks(capture_ws, lambda t: t):
            lstm(torch.randn(b, s, i, dtype=dtype))
        onednn = dtype == torch.float32 or ONEDNN_BF16
        assert sizes == ([onednn_lstm_workspace(i, h, b, s, dtype)] if onednn else []), (i, h, b, s, dtype)


class _LSTM(nn.Module):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()
        self.rnn = nn.LSTM(*args, batch_first=True, **kwargs)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("shape", [(32, 48, 2, 16, 2, False), (17, 100, 2, 9, 2, False), (32, 48, 2, 16, 1, True),
                                   (5, 20, 4, 3, 3, False)])
def test_lstm_step_saved_exact_and_peak_within_one_bias(shape: tuple) -> None:
    """Saved bytes exact; the peak (at oneDNN's backward, whose reorders and scratchpad the rule
    adds) within one fp32 (4H) bias buffer below the real one: the kernel's first buffer and its
    late second bias gradient are not live together in every call."""
    i, h, b, s, layers, bi = shape
    torch.manual_seed(0)
    model, x = _LSTM(i, h, num_layers=layers, bidirectional=bi), torch.randn(b, s, i)
    report = graphmem.analyze(model, (x,))
    real = measure_peak(model, (x,))
    assert report.activation_bytes == real.saved_bytes
    assert 0 <= real.peak_bytes - report.peak_bytes <= 4 * h * 4
    assert report.by_category["workspace"] > 0 and not report.notes


@pytest.mark.parametrize("b,h,s,d,dtype", [(2, 4, 17, 8, torch.float32), (2, 3, 17, 64, torch.float32),
                                           (1, 2, 200, 16, torch.float32), (2, 2, 40, 32, torch.bfloat16)])
def test_flash_attention_cpu_scratch(b: int, h: int, s: int, d: int, dtype: torch.dtype) -> None:
    """CPU flash attention's per-thread buffers, forward and backward (FlashAttentionKernel.cpp):
    exact, except oneDNN's bf16 GEMM scratch inside the bf16 backward."""
    q, k, v = (torch.randn(b, h, s, d, dtype=dtype, requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v).square().sum().backward()

    fwd = _op_scratch(step, ("aten::_scaled_dot_product_flash_attention_for_cpu",))
    bwd = _op_scratch(step, ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",))
    report = graphmem.analyze(_Attention(), (q.detach().requires_grad_(),), dtype=None)
    scratch = {str(n.target): n.meta.get("scratch", 0) for n in report.step.ops}
    assert fwd == [scratch["aten._scaled_dot_product_flash_attention_for_cpu.default"]]
    predicted = scratch["aten._scaled_dot_product_flash_attention_for_cpu_backward.default"]
    if dtype == torch.float32 or not ONEDNN_BF16:
        assert bwd == [predicted]
    else:  # bf16: cpublas::gemm on reduced types runs oneDNN's bf16 GEMM, whose own scratch (measured
        # 22,144 B here) has no rule; graphmem counts everything else the kernel allocates
        assert 0 < bwd[0] - predicted <= 32 * 1024


class _Attention(nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, q * 1.0, q * 2.0).square()


@pytest.mark.parametrize("shape", [(2, 17, 32), (3, 5, 192)])
def test_layer_norm_backward_cpu_scratch(shape: tuple) -> None:
    ln = nn.LayerNorm(shape[-1])
    x = torch.randn(*shape, requires_grad=True)
    got = _op_scratch(lambda: ln(x).square().sum().backward(), ("aten::native_layer_norm_backward",))
    report = graphmem.analyze(nn.Sequential(ln), (x,), loss=lambda out, inputs: out.square().sum())
    scratch = [n.meta.get("scratch", 0) for n in report.step.ops if "native_layer_norm_backward" in str(n.target)]
    assert got == scratch == [2 * torch.get_num_threads() * shape[-1] * 4]
    # with sum()'s expanded gradient, the kernel first makes dY contiguous (one more input-sized buffer)
    got = _op_scratch(lambda: ln(x).sum().backward(), ("aten::native_layer_norm_backward",))
    report = graphmem.analyze(nn.Sequential(ln), (x,), loss=lambda out, inputs: out.sum())
    scratch = [n.meta.get("scratch", 0) for n in report.step.ops if "native_layer_norm_backward" in str(n.target)]
    assert got == scratch == [2 * torch.get_num_threads() * shape[-1] * 4 + x.numel() * 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_rule_matches_cpu_kernel(dtype: torch.dtype) -> None:
    """Output shape, strides and storage of the CPU kernel, where the meta kernel refuses fp32."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from graphmem.oprules.matmul import _grouped_mm

    a, w = torch.randn(10, 8, dtype=dtype), torch.randn(3, 8, 16, dtype=dtype)  # rows: multiples of 16 bytes
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    real = torch._grouped_mm(a, w, offs=offs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = _grouped_mm(None, (a, w, offs), {}, mode)  # type: ignore[arg-type]
    assert (fake.shape, fake.stride(), fake.dtype) == (real.shape, real.stride(), real.dtype)
    assert fake.untyped_storage().nbytes() == real.untyped_storage().nbytes()
    for bad, message in (((a.double(), w.double(), offs), "Float32, BFloat16 or Float16"),
                         ((torch.randn(10, 6, dtype=dtype), torch.randn(3, 6, 12, dtype=dtype), offs), "multiple of 16 bytes")):
        with pytest.raises(RuntimeError, match=message):  # what the CPU kernel refuses, the rule refuses
            torch._grouped_mm(*bad)
        with pytest.raises(RuntimeError, match=message):
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                _grouped_mm(None, bad, {}, mode)  # type: ignore[arg-type]


def _moe(name: str) -> tuple[nn.Module, tuple]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "mixtral":
        config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                             moe_intermediate_size=16, shared_expert_intermediate_size=32,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             num_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
        model = transformers.Qwen2MoeForCausalLM(config)
    return model, (torch.randint(0, 128, (2, 16)),)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_moe_exact_and_independent_of_routing(name: str) -> None:
    """transformers' grouped-mm experts: saved bytes and peak equal a real CPU step. Memory does
    not depend on the routing: the tokens are sorted by expert into one (tokens·top_k, d) buffer
    and aten._grouped_mm writes one output of that size whatever the offsets; two real steps with
    different tokens (so different routing) measure the same."""
    model, x = _moe(name)
    report = graphmem.analyze(model, x)
    real = measure_peak(model, x)
    other = measure_peak(model, (torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7)),))
    assert report.activation_bytes == real.saved_bytes == other.saved_bytes
    assert report.peak_bytes == real.peak_bytes == other.peak_bytes


def test_mm_copies_an_expanded_operand_for_blas() -> None:
    """LinearAlgebra.cpp addmm_impl_cpu_: the (32, 128) expanded gradient of ``sum()`` is cloned
    before BLAS reads it, once for each of the linear layer's two backward matmuls."""
    lin = nn.Linear(32, 128, bias=False)
    x = torch.randn(32, 32, requires_grad=True)
    got = [b for b in _op_scratch(lambda: lin(x).sum().backward(), ("aten::mm",)) if b]
    report = graphmem.analyze(nn.Sequential(lin), (x,), loss=lambda out, inputs: out.sum())
    scratch = [n.meta["scratch"] for n in report.step.ops if str(n.target) == "aten.mm.default" and "scratch" in n.meta]
    assert got == scratch == [32 * 128 * 4, 32 * 128 * 4]


def test_moe_with_a_per_expert_loop_is_refused_in_one_line() -> None:
    """Where memory does depend on the routing: transformers' "eager" experts loop over the
    experts hit, gathering each one's tokens (nonzero / where): data-dependent sizes that fake
    tensors cannot know. graphmem says so in one line; the grouped_mm path is routing-free."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, max_position_embeddings=64)
    config._experts_implementation = "eager"
    model = transformers.MixtralForCausalLM(config)
    with pytest.raises(graphmem.errors.DataDependentError, match="nonzero") as err:
        graphmem.analyze(model, (torch.randint(0, 128, (2, 16)),))
    assert "\n" not in str(err.value)


def test_text_report_names_the_workspace_at_the_peak() -> None:
    """The peak line says how much of it is kernel workspace inside the peak op (here the
    LayerNorm backward buffer and dY copy), which the per-op test above checks against the kernel."""
    from graphmem.render.text import render_text

    ln = nn.LayerNorm(64)
    x = torch.randn(2, 17, 64, requires_grad=True)
    report = graphmem.analyze(nn.Sequential(ln), (x,), loss=lambda out, inputs: out.sum())
    assert report.peak_op == "aten.native_layer_norm_backward.default"
    scratch = next(n.meta["scratch"] for n in report.step.ops if "native_layer_norm_backward" in str(n.target))
    real = measure_peak(nn.Sequential(ln), (x,), lambda out, inputs: out.sum())
    assert report.peak_bytes == real.peak_bytes
    from graphmem.units import fmt_bytes

    assert f"kernel workspace {fmt_bytes(scratch)} inside it" in render_text(report)
