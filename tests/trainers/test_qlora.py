"""QLoRA (graphmem/training/qlora.py) against real CPU steps: bitsandbytes' CPU backend quantizes
the weights for real, peft adds the adapters, and the step is measured as every other ground
truth (graphmem/validation/measure.py): saved bytes to the byte, the quantized model's state
(packed weights, block scales, the rest) to the byte, the peak within the LMs' 0.1 % (the
prediction never above), and the gemm_4bit scratch rule against the kernel's own allocations."""
from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.training.loop import TrainStep
from graphmem.training.lora import LoRA
from graphmem.training.peft_lora import apply_peft
from graphmem.training.qlora import Quantization, quant_state_tensors, quantize
from graphmem.validation.measure import measure_peak

bnb = pytest.importorskip("bitsandbytes")
T = pytest.importorskip("transformers")
pytest.importorskip("peft")

LM_TOLERANCE = 0.001  # tests/capture/test_ground_truth.py: LMs, the prediction never above the real peak
V = 128


def _model(kind: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    torch.manual_seed(0)
    if kind == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    else:  # GPT-2: Conv1D projections, tied head
        m = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                           eos_token_id=0, bos_token_id=0))
    return m.to(dtype)


def _state_bytes(model: torch.nn.Module) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers(), *quant_state_tensors(model)]}
    return sum(storages.values())


@pytest.mark.slow
@pytest.mark.parametrize("kind,targets,amp,peak_in_linear", [("llama", ("all-linear",), False, False),
                                                              ("llama", ("all-linear",), True, False),
                                                              ("gpt2", ("all-linear",), False, False),
                                                              ("gpt2", ("c_attn", "c_fc"), False, True)])
def test_qlora_step_matches_a_real_quantized_step(kind: str, targets: tuple[str, ...], amp: bool,
                                                  peak_in_linear: bool) -> None:
    """``peak_in_linear``: GPT-2's un-adapted mlp.c_proj has no clone after it (peft's Linear4bit
    adds one), so the real peak is inside its forward gemm_4bit, where ``F.linear``'s bf16 oneDNN
    gemm allocates scratch graphmem does not model (for any bf16 CPU matmul): there the
    prediction stays below the real peak by at most that scratch. ``amp``: fp32 weights beside the
    4-bit ones under bf16 autocast (what Trainer(bf16=True) runs)."""
    model = _model(kind, torch.float32 if amp else torch.bfloat16)
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    r = graphmem.analyze(model, batch, qlora=True, lora_rank=4, lora_targets=",".join(targets), optimizer="adamw",
                         amp="bf16" if amp else None)
    assert all(p.dtype == (torch.float32 if amp else torch.bfloat16) for p in model.parameters())  # untouched
    g, b = r.step, r.budget
    assert g is not None and b is not None
    quantize(model, Quantization())  # the real model, quantized by bitsandbytes' CPU backend
    real_model, _ = apply_peft(model, LoRA(4, targets))
    packed = [p for p in real_model.parameters() if p.dtype == torch.uint8]
    assert packed and all(type(p).__name__ == "Params4bit" for p in packed)
    real = measure_peak(real_model, batch, None, train=TrainStep("adamw"), amp=torch.bfloat16 if amp else None)
    assert r.activation_bytes == real.saved_bytes
    assert b.row("parameters").size + b.row("buffers").size == _state_bytes(real_model)
    assert b.row("optimizer states").size == real.state_bytes
    gap = real.peak_bytes - r.peak_bytes
    onednn = 0
    if peak_in_linear:  # the bf16 gemm's own scratch in mlp.c_proj (b*s = 64 rows, 256 -> 64)
        x, w = torch.randn(64, 256, dtype=torch.bfloat16), torch.randn(64, 256, dtype=torch.bfloat16)
        onednn = _in_op_high(lambda: torch.nn.functional.linear(x, w))[0] - 64 * 64 * 2
    assert 0 <= gap <= LM_TOLERANCE * real.peak_bytes + onednn, (r.peak_bytes, real.peak_bytes)
    q = b.quantized  # the 4-bit line: the real model's packed weights and quant states
    assert q is not None and q.layers == len(packed) and q.weights == 2 * q.packed_bytes
    assert q.packed_bytes == sum(p.untyped_storage().nbytes() for p in packed)
    states = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in quant_state_tensors(real_model)}
    assert q.state_bytes == sum(states.values()) > 0
    gemms = [s for s in g.storages.values() if s.kind == "workspace" and "gemm_4bit" in s.name]
    assert len(gemms) >= len(packed)  # every 4-bit matmul's dequantized weight, counted in the peak


def _in_op_high(fn: Any) -> tuple[int, Any]:
    """The most bytes ``fn`` holds at once on the CPU allocator (its events under the profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from graphmem.validation.measure import _allocation_events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    running = high = 0
    for _, size in _allocation_events(prof):
        running += size
        high = max(high, running)
    return high, out


@pytest.mark.parametrize("m,k,n,double,bias", [(64, 64, 128, True, False), (7, 128, 96, False, True),
                                               (64, 256, 64, True, True)])
def test_gemm_4bit_scratch_is_the_kernels_own(m: int, k: int, n: int, double: bool, bias: bool) -> None:
    """The CPU kernel's allocations inside one gemm_4bit (the profiler's events): the scratch
    rule (block scales, dequantized weight) plus what ``F.linear`` on the dequantized weight
    allocates by itself (its output and oneDNN's own bf16 gemm scratch, which graphmem does not
    model for any bf16 CPU matmul)."""
    from graphmem.oprules import scratch

    w = torch.randn(n, k, dtype=torch.bfloat16)
    packed, qs = bnb.functional.quantize_4bit(w, compress_statistics=double, quant_type="nf4")
    a = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(n, dtype=torch.bfloat16) if bias else None
    op = torch.ops.bitsandbytes.gemm_4bit.default
    extra: dict = {"bias": b}
    if double:
        extra.update(absmax_8bit=qs.absmax, absmax_code=qs.state2.code, absmax_offset=qs.offset)
    args = (a, packed, list(qs.shape), qs.state2.absmax if double else qs.absmax, qs.blocksize, qs.quant_type)
    high, out = _in_op_high(lambda: op(*args, **extra))
    w_dq = bnb.functional.dequantize_4bit(packed, qs)
    linear, _ = _in_op_high(lambda: torch.nn.functional.linear(a, w_dq, b))
    rule = sum(s.nbytes for s in scratch(op, "cpu", args, extra, out))
    assert rule >= w_dq.untyped_storage().nbytes() and high == rule + linear


def test_qlora_mistakes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x8", "--qlora", "--lora-rank", "4",
                 "--lora-targets", "all-linear"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Hugging Face model" in err[0], err
    for options, phrase in [({}, "add `lora_rank`"), (dict(master_weights=True, optimizer="adam", dtype="bf16"),
                                                       "drop `master_weights`"),
                            (dict(mode="compiled"), "mode=.eager.")]:
        lora = {} if phrase == "add `lora_rank`" else dict(lora_rank=4, lora_targets="all-linear")
        with pytest.raises(UsageError, match=phrase):
            graphmem.analyze("hf-gpt2", input_shape=(1, 8), qlora=True, **lora, **options)


@pytest.mark.parametrize("tokens,bound", [(1600, False), (64, True)])
def test_cuda_target_counts_the_dequantize_fallback(tokens: int, bound: bool) -> None:
    """The CUDA target (graphmem/oprules/bnb.py, from backends/cuda/ops.py ``gemm_4bit``):
    past 1536 rows bitsandbytes always takes ``_dequant_linear_fallback``: per forward matmul
    the (N, K) weight in bf16 and the fp32 block scales twice; below, the fused kernel may run
    instead, and the scratch says it is an upper bound."""
    model = _model("llama")
    ids = torch.zeros(1, tokens, dtype=torch.long)
    r = graphmem.analyze(model, {"input_ids": ids, "labels": ids}, qlora=True, lora_rank=4, lora_targets="q_proj",
                         device="cuda")
    assert r.step is not None
    quantize(model, Quantization())
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    expected = sorted(m.out_features * m.in_features * 2 + 2 * 4 * m.weight.quant_state.absmax.numel() for m in layers)
    found: dict[int, int] = {}
    for s in r.step.storages.values():
        if s.kind == "workspace" and "gemm_4bit" in s.name:
            found[s.created] = found.get(s.created, 0) + s.nbytes
            assert ("upper bound" in s.name) == bound, s.name
    assert sorted(found.values()) == expected  # one per layer: forward only (backward dequantizes in visible ops)


def test_without_bitsandbytes_the_extra_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes then raises ImportError
    with pytest.raises(UsageError, match=r"graphmem\[qlora\]"):
        graphmem.analyze(_model("llama"), {"input_ids": torch.zeros(1, 8, dtype=torch.long)}, qlora=True,
                         lora_rank=4, lora_targets="q_proj")


@pytest.mark.slow
def test_a_quantized_peft_model_is_analyzed_as_it_is() -> None:
    """The model a QLoRA script holds (quantized by bitsandbytes, adapted by peft), handed to
    graphmem.analyze without --qlora: its 4-bit weights and QuantStates as they are."""
    model = _model("llama")
    quantize(model, Quantization())
    real_model, _ = apply_peft(model, LoRA(4, ("q_proj", "v_proj")))
    ids = torch.randint(0, V, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    r = graphmem.analyze(real_model, batch, optimizer="adamw")
    real = measure_peak(real_model, batch, None, train=TrainStep("adamw"))
    b = r.budget
    assert b is not None and b.quantized is not None and b.quantized.layers == 14  # 2 blocks x 7 linears
    assert r.activation_bytes == real.saved_bytes
    assert b.row("parameters").size + b.row("buffers").size == _state_bytes(real_model)
    assert 0 <= real.peak_bytes - r.peak_bytes <= LM_TOLERANCE * real.peak_bytes


def test_a_model_of_linear_subclasses_says_why_nothing_was_quantized() -> None:
    """transformers' Falcon builds its projections as FalconLinear(nn.Linear); replace_with_bnb_linear
    tests ``type(module) is nn.Linear`` and quantizes none of them (transformers warns "no linear
    modules were found"): the error names the subclass."""
    cfg = T.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    with pytest.raises(UsageError, match="FalconLinear, subclasses of nn.Linear"):
        graphmem.analyze(T.FalconForCausalLM(cfg), input_shape=(1, 8), qlora=True, lora_rank=4,
                         lora_targets="all-linear", optimizer="adamw")


def test_parameter_count_is_the_models_not_the_packed_bytes() -> None:
    """A Params4bit holds two 4-bit weights per uint8 element; the report counts the weights, as
    peft's own count does on the same model with the same adapters unquantized
    (``get_nb_trainable_parameters``, which also doubles a Params4bit's elements)."""
    import copy

    model = _model("llama")
    r = graphmem.analyze(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)}, qlora=True, lora_rank=4,
                         lora_targets="all-linear", optimizer="adamw")
    assert r.budget is not None and r.budget.quantized is not None
    peft_model, _ = apply_peft(copy.deepcopy(model), LoRA(4, ("all-linear",)))
    trainable, total = peft_model.get_nb_trainable_parameters()
    assert (r.budget.rank.trainable, r.budget.rank.parameters) == (trainable, total)
    assert total == sum(p.numel() for p in model.parameters()) + trainable
