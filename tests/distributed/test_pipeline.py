"""Pipeline stages (graphmem/distributed/pipeline.py): rank r's step under torch.distributed.
pipelining's real schedules, checked against the same pipeline run for real (two and four
processes, gloo: tests/pipeline_real.py) and against the schedules' textbook in-flight counts."""
from __future__ import annotations

import pytest
import torch
from pipeline_real import measure_pipeline

import graphmem
from graphmem.capture.target import make_target
from graphmem.cli.main import main
from graphmem.distributed.pipeline import analyze_stage, make_pipeline
from graphmem.errors import UsageError
from graphmem.models import gpt2, llama

HEAVY = pytest.mark.heavy  # pyproject.toml: the larger twins of cases CI runs

GPT = gpt2.GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1)
GPT8 = gpt2.GPTConfig(n_layer=8, n_head=2, n_embd=32, vocab_size=64, block_size=16, dropout=0.1)  # 8 stages interleaved on 4
LLAMA = llama.LlamaConfig(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, ffn_hidden=64, max_seq_len=16)


def bundled_gpt2() -> tuple:
    return gpt2.build(GPT), torch.randint(0, GPT.vocab_size, (4, 16)), gpt2.loss


def bundled_gpt2_8() -> tuple:
    return gpt2.build(GPT8), torch.randint(0, GPT8.vocab_size, (8, 16)), gpt2.loss


def _zoo_llama(copies: int) -> tuple:
    pytest.importorskip("transformers")
    from zoo import build as zoo_build

    model, (ids,) = zoo_build("llama_gqa")  # 4 decoder layers, batch 2
    return model, torch.cat([ids] * copies), None  # micro-batches of one sequence


def hf_llama() -> tuple:
    return _zoo_llama(2)  # batch 4


def hf_llama_8() -> tuple:
    return _zoo_llama(4)  # batch 8


# the blocks [a, b) each stage holds, in stage order (stage s on rank s % pp): 4 blocks over 2 and over
# 4 stages, 8 blocks over 4 and over 8 (interleaved: two stages per rank)
HALVES, QUARTERS = [(0, 2), (2, 4)], [(0, 1), (1, 2), (2, 3), (3, 4)]
EIGHTHS = [(i, i + 1) for i in range(8)]


def _named(model: torch.nn.Module, split: list[tuple[int, int]], pp: int, rank: int) -> str:
    """How the report names rank's stages: "stage s (chain.a..b-1)", joined."""
    chain = "model.layers" if hasattr(model, "model") else "transformer.h"
    return ", ".join(f"stage {s} ({chain}.{a}..{b - 1})" for s, (a, b) in enumerate(split) if s % pp == rank)


@pytest.mark.slow
@pytest.mark.parametrize("build,pp,m,splits", [
    (bundled_gpt2, 2, 4, {"1f1b": HALVES, "gpipe": HALVES, "interleaved": QUARTERS}),
    (hf_llama, 2, 4, {"1f1b": HALVES}),
    # M > P: ranks hold 4, 3, 2, 1 micro-batches
    # heavy (pyproject.toml): 4 gloo ranks, 2.5 to 4 minutes each; CI runs the 2-rank cases
    pytest.param(bundled_gpt2_8, 4, 8, {"1f1b": [(0, 2), (2, 4), (4, 6), (6, 8)], "interleaved": EIGHTHS}, marks=HEAVY),
    pytest.param(hf_llama_8, 4, 8, {"1f1b": QUARTERS}, marks=HEAVY),
], ids=["gpt2-2", "hf-llama-2", "gpt2-4", "hf-llama-4"])
def test_each_rank_is_a_real_gloo_pipeline_rank(build, pp: int, m: int, splits: dict, tmp_path) -> None:
    """No tolerance: saved bytes, the bytes live before the step and the profiled peak are
    compared to the byte on every rank (these models' kernels keep no scratch the capture misses)."""
    # GIVEN the same pipeline written out and run for real (tests/pipeline_real.py), one process per rank on gloo
    real = measure_pipeline(build, pp, splits, m, str(tmp_path))
    model, batch, loss = build()
    for schedule, split in splits.items():
        for rank in range(pp):
            # WHEN graphmem runs that rank's schedule on the fake process group
            report = graphmem.analyze(model, (batch,), loss=loss, pp=pp, rank=rank, schedule=schedule, micro_batches=m)
            assert f"micro-batches, {_named(model, split, pp, rank)}:" in report.notes[0], (report.notes[0], split)
            # THEN saved bytes and the peak are the real rank's, to the byte
            got = {"saved": report.activation_bytes, "baseline": report.baseline_bytes, "peak": report.peak_bytes}
            assert got == real[schedule][rank], (schedule, rank)
            if schedule == "1f1b":  # ... while holding the textbook's micro-batches (Narayanan et al. 2021, 2.2)
                assert f"at most {min(m, pp - rank)};" in report.notes[0], (rank, report.notes[0])


# the for-loop AdamW (the CPU's default) divides by ``bias_correction2_sqrt``, a Python float that
# aten.div wraps in an 8-byte double tensor and copies to a 4-byte float32 one, both live during the
# div (torch/optim/adam.py ``_single_tensor_adam``): 12 B the real step held above graphmem's at a
# peak inside that step until the capture counted them (graphmem/capture/wrapped_numbers.py)
SCALAR_GAP = {"adamw": 0, "momentum": 0}


@pytest.mark.slow
@pytest.mark.parametrize("build,optimizer", [(bundled_gpt2, "adamw"), pytest.param(bundled_gpt2, "momentum", marks=HEAVY),
                                               pytest.param(hf_llama, "adamw", marks=HEAVY)],
                         ids=["gpt2-adamw", "gpt2-momentum", "hf-llama-adamw"])
def test_each_rank_steps_its_own_stage_optimizer_as_a_real_gloo_rank(build, optimizer: str, tmp_path) -> None:
    """The stage's optimizer after the schedule (torch.optim over the stage's own parameters,
    then zero_grad): saved bytes, the first step's peak, and a later step's with the states made
    before it starts (the budget table's "peak (later steps)"), on every rank, to the byte but
    for SCALAR_GAP where the peak is in the optimizer step."""
    # GIVEN the same pipeline run for real, each rank stepping its stage's optimizer, two steps
    real = measure_pipeline(build, 2, {"1f1b": HALVES}, 4, str(tmp_path), optimizer=optimizer)
    model, batch, loss = build()
    for rank in range(2):
        # WHEN graphmem runs that rank's schedule and optimizer on the fake process group
        report = graphmem.analyze(model, (batch,), loss=loss, pp=2, rank=rank, micro_batches=4, optimizer=optimizer)
        r, b = real["1f1b"][rank], report.budget.rank if report.budget is not None else None
        assert b is not None
        # THEN saved bytes, the bytes before the step and the optimizer states are the real rank's
        assert (report.activation_bytes, report.baseline_bytes) == (r["saved"], r["baseline"])
        states = sum(s.nbytes for s in report.step.storages.values() if s.kind == "optimizer state")
        assert states == r["states"] > 0, (states, r)
        # ... and the first and the later steps' peaks too
        assert r["peak"] - b.peak_bytes == (SCALAR_GAP[optimizer] if b.peak_phase == "optimizer" else 0), (rank, r)
        assert r["later"] - b.later_peak_bytes == (SCALAR_GAP[optimizer] if b.later_peak_phase == "optimizer" else 0), \
            (rank, b.later_peak_bytes, r)


def hf_gpt2() -> tuple:
    pytest.importorskip("transformers")
    from zoo import build as zoo_build

    model, (ids,) = zoo_build("gpt2_sdpa")
    return model, torch.cat([ids, ids]), None


@pytest.mark.slow
def test_hf_gpt2_ranks_are_real_with_its_gelu_scalars(tmp_path) -> None:
    """transformers' GPT-2 GELU (NewGELUActivation, activations.py) multiplies by three Python
    floats; eager wraps each in a 0-dim float64 tensor (8 B) that its MulBackward0 keeps until
    the block's backward. Fake tensors never see those wrapped numbers; the capture counts them
    (graphmem/capture/wrapped_numbers.py), each micro-batch's held until its block's backward, so
    the peak is exact on every rank (it read 24 B a block a micro-batch in flight under the real
    one before); saved bytes are exact (saved-tensor hooks never see a wrapped number)."""
    real = measure_pipeline(hf_gpt2, 2, {"1f1b": HALVES, "gpipe": HALVES}, 4, str(tmp_path))
    model, batch, _ = hf_gpt2()
    for schedule in ("1f1b", "gpipe"):
        for rank in range(2):
            st = _stage(model, batch, None, 2, rank, schedule, 4)
            (a, b), = st.blocks
            assert st.saved.activation_bytes == real[schedule][rank]["saved"]
            assert real[schedule][rank]["peak"] == st.liveness.peak_bytes, (schedule, rank, st.in_flight.at_peak * (b - a) * 3 * 8)


def _stage(model: torch.nn.Module, batch: torch.Tensor, loss, pp: int, rank: int, schedule: str, m: int):
    return analyze_stage(model, (batch,), loss, make_target("cpu"), make_pipeline(pp, rank, schedule, m))


@pytest.mark.parametrize("pp,m,family", [(2, 4, "gpt2"), (2, 4, "llama"), (4, 8, "gpt2"),
                                         pytest.param(4, 8, "llama", marks=pytest.mark.slow)])
def test_1f1b_holds_min_m_p_minus_r_micro_batches_gpipe_all(pp: int, m: int, family: str) -> None:
    """Narayanan et al. 2021 (Megatron-LM at scale), section 2.2: under 1F1B stage r of P keeps at
    most min(M, P - r) micro-batches' activations (its warm-up forwards), under GPipe all M; the
    report's note prints that count."""
    module = gpt2.build(GPT) if family == "gpt2" else llama.build(LLAMA)
    loss = gpt2.loss if family == "gpt2" else llama.loss
    batch = torch.randint(0, 64, (m, 16))
    for rank in range(pp):
        one = _stage(module, batch, loss, pp, rank, "1f1b", m)
        assert one.in_flight.most == min(m, pp - rank), rank
        assert f"at most {min(m, pp - rank)};" in one.notes[0], one.notes[0]
        assert len(one.in_flight.per_micro_batch) == m
        if rank in (0, pp - 1):
            all_m = _stage(module, batch, loss, pp, rank, "gpipe", m)
            assert all_m.in_flight.most == m
            assert f"at most {m};" in all_m.notes[0]
            # holding every micro-batch costs: GPipe's peak is above 1F1B's on the same stage
            assert all_m.liveness.peak_bytes > one.liveness.peak_bytes
            assert all_m.saved.activation_bytes == one.saved.activation_bytes  # the same saves, held longer


def test_interleaved_runs_two_virtual_stages_per_rank() -> None:
    model, batch, loss = gpt2.build(GPT), torch.randint(0, 64, (4, 16)), gpt2.loss
    st = _stage(model, batch, loss, 2, 0, "interleaved", 4)
    assert st.blocks == ((0, 1), (2, 3))  # stages 0 and 2 of 4: one block each
    assert len(st.in_flight.per_micro_batch) == 2 * 4  # each stage runs every micro-batch
    # interleaving holds more micro-batches than 1F1B's P - r: its warm-up forwards, (v - 1) P + 2 (P - 1 - r)
    # (Megatron-LM's interleaved schedule, Narayanan et al. 2021 section 2.2.2; torch's _get_warmup_ops),
    # and the first steady-state forward before the first backward; measured real at P = 4 (docs/pipeline.md)
    assert st.in_flight.most == (2 - 1) * 2 + 2 * (2 - 1 - 0) + 1 == 5
    # every micro-batch's embedding saves a view of the one batch: its storage counts once in the step
    assert st.saved.activation_bytes == sum(st.in_flight.per_micro_batch) - 3 * batch.untyped_storage().nbytes()


def test_a_stage_holds_only_its_own_blocks() -> None:
    model, batch = gpt2.build(GPT), torch.randint(0, 64, (4, 16))
    whole = graphmem.analyze(model, (batch,), loss=gpt2.loss)
    ranks = [graphmem.analyze(model, (batch,), loss=gpt2.loss, pp=2, rank=r, micro_batches=4) for r in range(2)]
    # the tied embedding/head weight is on both ends, as each stage holds its own copy
    assert ranks[0].parameter_bytes + ranks[1].parameter_bytes == whole.parameter_bytes + \
        model.lm_head.weight.numel() * 4
    assert all(r.peak_bytes < whole.peak_bytes for r in ranks)


def test_received_activations_take_the_target_dtype() -> None:
    # stage 1's first LayerNorm saves its input: the activation received from stage 0
    model, batch = gpt2.build(GPT), torch.randint(0, 64, (4, 16))
    report = graphmem.analyze(model, (batch,), loss=gpt2.loss, pp=2, rank=1, micro_batches=4, dtype="bf16")
    received = [t for t in report.saved if t.module == "transformer.h.2.ln_1"]
    assert len(received) == 4 * 3 and {t.dtype for t in received} == {"bfloat16"}  # input, mean, rstd per micro-batch


@pytest.mark.parametrize("kwargs,message", [
    (dict(pp=2, rank=2), "`rank` must be in 0..1"),
    (dict(schedule="gpipe"), "`rank` and `schedule` need it"),
    (dict(rank=1), "is not one of the 1 ranks"),  # without --pp, --rank is FSDP/TP's (graphmem/distributed/)
    (dict(pp=2, schedule="zb"), "unknown `schedule="),
    (dict(pp=2, micro_batches=3), "split evenly into `micro_batches=3`"),
    (dict(pp=8, micro_batches=4, schedule="gpipe"), "fewer than the 8 pipeline stages"),
    (dict(pp=4, micro_batches=2), "needs at least as many micro-batches as stages"),  # torch's Schedule1F1B refuses
    (dict(pp=2, micro_batches=2, optimizer="adam", master_weights=True, dtype="bf16"), "does not combine"),
])
def test_bad_pipeline_options_name_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        graphmem.analyze(gpt2.build(GPT), (torch.randint(0, 64, (4, 16)),), loss=gpt2.loss, **kwargs)


def test_cli_reports_rank_r(capsys: pytest.CaptureFixture[str]) -> None:
    model = "tests/formula_models/tiny_gpt.py"
    assert main(["analyze", model, "--input-shape", "4x16", "--pp", "2", "--rank", "1", "--micro-batches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline rank 1 of 2, 1f1b schedule, 4 micro-batches, stage 1 (transformer.h.2..3)" in out
    assert out.splitlines()[0].endswith("· pipeline rank 1 of 2, 1f1b schedule, 4 micro-batches: one training step")
    assert main(["analyze", model, "--input-shape", "4x16", "--pp", "2", "--rank", "5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--rank must be in 0..1" in err
    assert main(["analyze", model, "--input-shape", "4x16", "--pp", "2", "--plan"]) == 2
    assert "do not combine with it yet" in capsys.readouterr().err
