"""`graphmem validate` / `graphmem.validate`: the prediction beside one REAL training step.

Real runs allocate, so every model here is tiny (tests/validate_models/: 2-layer GPT-2 and
LLaMA, a small MLP and a width-8 ResNet-18; the mlp-mnist preset is 7.5 MB of weights). The
CUDA path is covered by tests that skip without a GPU.
"""
from __future__ import annotations

import importlib
import json
from typing import Any

import pytest
import torch
from paths import TESTS
from torch import nn

import graphmem
from graphmem import cli
from graphmem.errors import GraphmemError, UsageError
from graphmem.models import llama
from graphmem.validation import measure
from graphmem.validation.result import judge
from graphmem.validation.validate import NO_GPU, Validation, ValidationError, validate

validate_module = importlib.import_module("graphmem.validation.validate")
MODELS = TESTS / "validate_models"
TINY = {"tiny_gpt2": (2, 16), "tiny_llama": (2, 16), "tiny_mlp": (4, 64)}
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def model_file(name: str) -> str:
    return str(MODELS / f"{name}.py")


def run_cli(capfd: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    """capfd, not capsys: the profiler's C++ side writes to file descriptor 2 directly."""
    code = cli.main(argv)
    out, err = capfd.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("graphmem: error: ") and "Traceback" not in err, err
    return lines[0]


def assert_exact_and_within(v: Validation, tolerance: float = 1.0) -> None:
    assert v.row("saved for backward").difference == 0
    assert v.row("before the step").difference == 0
    peak = v.row("peak")
    assert 0 <= -peak.difference <= tolerance / 100 * peak.measured
    assert v.ok and v.reason == "" and all(r.ok for r in v.rows)


# -- passing runs -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TINY))
def test_model_files_match_a_real_cpu_step(name: str) -> None:
    v = validate(model_file(name), input_shape=TINY[name])
    assert v.device == "cpu" and v.input_shapes == (TINY[name],)
    assert_exact_and_within(v)
    assert v.report is not None and v.row("peak").predicted == v.report.peak_bytes  # the prediction is graphmem.analyze's


def test_preset_is_built_for_real() -> None:
    v = graphmem.validate("mlp-mnist", input_shape="4x784")
    assert v.model == "mlp-mnist"
    assert_exact_and_within(v)


def test_rebuilt_model_has_the_buffers_its_init_computes() -> None:
    """Why validate rebuilds instead of to_empty(): non-persistent buffers computed in __init__
    (LLaMA's RoPE tables) must hold their real values, not uninitialized memory."""
    loaded = validate_module._build(model_file("tiny_llama"), torch.device("cpu"))
    cos, sin = llama.rope_tables(32 // 4, 32, 10000.0)
    assert torch.equal(loaded.module.rope_cos, cos) and torch.equal(loaded.module.rope_sin, sin)
    assert loaded.loss is not None and not any(p.is_meta for p in loaded.module.parameters())


def test_real_module_is_used_as_is_and_restored() -> None:
    torch.manual_seed(1)
    net = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4)).eval()
    grad = torch.ones(32, 16)
    net[0].weight.grad = grad
    weights = [p.detach().clone() for p in net.parameters()]
    x = torch.randn(8, 16)
    state = torch.random.get_rng_state()
    v = validate(net, (x,), tolerance=0)
    assert_exact_and_within(v, 0)
    assert not net.training and not net[1].training  # eval flags back
    assert net[0].weight.grad is grad and net[3].weight.grad is None
    assert all(torch.equal(a, b) for a, b in zip(weights, net.parameters()))
    assert torch.equal(torch.random.get_rng_state(), state)  # validate seeds in a forked RNG


def test_real_module_with_input_shape_uses_the_default_input_rule() -> None:
    net = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 8))
    v = validate(net, input_shape=(2, 5))
    assert_exact_and_within(v)


def test_cli_prints_the_table_and_exits_0(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16"])
    assert code == 0, err
    assert err == ""  # the profiler's own log lines are filtered out
    for text in ("saved for backward", "before the step", "peak", "predicted", "measured", "difference",
                 "ok (exact)", "within tolerance"):
        assert text in out


def test_cli_json_has_exact_integers(capfd: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_mlp"), "--input-shape", "4x64", "--json"])
    assert code == 0 and err == ""
    doc = json.loads(out)["validation"]
    assert doc["ok"] is True and doc["reason"] == "" and doc["device"] == "cpu" and doc["tolerance_percent"] == 1.0
    rows = {r["name"]: r for r in doc["rows"]}
    assert set(rows) == {"saved for backward", "before the step", "peak"}
    for r in rows.values():
        assert all(isinstance(r[k], int) and not isinstance(r[k], bool) for k in ("predicted", "measured", "difference"))
        assert r["difference"] == r["predicted"] - r["measured"] and r["ok"] is True
    assert rows["saved for backward"]["difference"] == 0 and rows["saved for backward"]["predicted"] > 0


# -- failures: exit 1, the table on stdout, one line on stderr ----------------------------------

def _patched_measure(monkeypatch: pytest.MonkeyPatch, saved: int = 0, peak: int = 0) -> None:
    real = measure.measure_peak

    def fake(*args: Any, **kwargs: Any) -> measure.RealStep:
        m = real(*args, **kwargs)
        return measure.RealStep(m.saved_bytes + saved, m.peak_bytes + peak, m.baseline_bytes, m.allocations)

    monkeypatch.setattr(measure, "measure_peak", fake)


def test_peak_far_above_the_prediction_fails(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    _patched_measure(monkeypatch, peak=100_000)  # ~28 % of the tiny GPT-2's peak
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16"])
    assert code == 1
    assert "FAIL" in out and "OUTSIDE tolerance" in out and "ok (exact)" in out
    line = one_line(err)
    assert "peak: predicted" in line and "below the measured" in line and line.endswith("outside the 1 % tolerance")
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--tolerance", "50"])
    assert code == 0 and err == ""


def test_prediction_above_the_measurement_fails(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    _patched_measure(monkeypatch, peak=-8)
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_mlp"), "--input-shape", "4x64", "--tolerance", "100"])
    assert code == 1 and "+8" in out
    assert "above the measured" in one_line(err)


def test_saved_bytes_must_match_exactly(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    _patched_measure(monkeypatch, saved=4)
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_mlp"), "--input-shape", "4x64", "--json"])
    assert code == 1
    doc = json.loads(out)["validation"]
    assert doc["ok"] is False and doc["rows"][0]["difference"] == -4 and doc["rows"][0]["ok"] is False
    assert "saved for backward" in one_line(err) and "exactly" in err


def test_conv_gap_is_kernel_scratch_never_an_overestimate() -> None:
    """A tiny convnet: oneDNN's convolution scratch makes the real CPU peak larger than any
    aten-level prediction (at 32x32 the scratch is a large share of a tiny step); saved bytes
    are still exact and the prediction is never above."""
    v = validate(model_file("tiny_conv"), input_shape=(2, 3, 32, 32), tolerance=100)
    assert v.ok and v.row("saved for backward").difference == 0 and v.row("peak").difference <= 0
    strict = validate(model_file("tiny_conv"), input_shape=(2, 3, 32, 32), tolerance=0)
    assert strict.ok == (strict.row("peak").difference == 0)
    if not strict.ok:
        assert "--tolerance 2.5" in strict.reason
        with pytest.raises(ValidationError) as e:
            strict.check()
        assert isinstance(e.value, GraphmemError) and e.value.exit_code == 1


# -- refusals: exit 2, one line, nothing real built ---------------------------------------------

def _no_build(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("the real model must not be built over the budget")

    monkeypatch.setattr(validate_module, "_build", refuse)


def test_over_the_ram_budget_is_refused(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    _no_build(monkeypatch)
    report = graphmem.analyze(model_file("tiny_gpt2"), input_shape=(2, 16))
    fixed = report.baseline_bytes - report.input_bytes + report.gradient_bytes
    assert fixed < report.peak_bytes
    # budget = half of it: above the weights and gradients, below the step's peak
    monkeypatch.setattr(validate_module, "available_memory", lambda: fixed + report.peak_bytes)
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16"])
    line = one_line(err)
    assert code == 2 and out == ""
    assert f"({report.peak_bytes:,} B)" in line and "safety budget" in line and "--input-shape" in line and "e.g. 1x16" in line

    monkeypatch.setattr(validate_module, "available_memory", lambda: 1000)
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16"])
    assert code == 2 and "smaller configuration" in one_line(err)


def test_available_memory_reads_meminfo() -> None:
    assert validate_module.available_memory() > 0


def test_cuda_without_a_gpu_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _no_build(monkeypatch)
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--device", "cuda"])
    assert code == 2 and out == ""
    assert one_line(err) == f"graphmem: error: {NO_GPU}"


@pytest.mark.parametrize("argv,fragment", [
    (["--tolerance", "-1"], "invalid tolerance"),
    (["--tolerance", "abc"], "--tolerance"),
    (["--device", "tpu"], "--device"),
])
def test_bad_arguments(capfd: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_mlp"), "--input-shape", "4x64", *argv])
    assert code == 2 and out == "" and fragment in one_line(err)


def test_meta_module_and_missing_inputs_are_usage_errors() -> None:
    with torch.device("meta"):
        net = nn.Linear(4, 4)
    with pytest.raises(UsageError, match="meta device"):
        validate(net, input_shape=(2, 4))
    with pytest.raises(UsageError, match="no inputs"):
        validate(nn.Linear(4, 4))


# -- CUDA (runs on a GPU host) ------------------------------------------------------------------

@needs_gpu
@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_llama"])
def test_cuda_step_matches_the_allocator_model(name: str) -> None:
    v = validate(model_file(name), input_shape=TINY[name], device="cuda")
    assert v.device.startswith("cuda")
    assert [r.name for r in v.rows] == ["saved for backward", "allocated before the step", "peak allocated",
                                        "peak reserved"]
    assert v.row("saved for backward").difference == 0
    assert v.row("allocated before the step").ok is None and v.row("peak reserved").ok is None
    assert v.ok, v.reason


@needs_gpu
def test_cuda_real_module_on_the_gpu(capfd: pytest.CaptureFixture[str]) -> None:
    net = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).cuda()
    v = validate(net, (torch.randn(32, 64, device="cuda"),), device="cuda")
    assert v.row("saved for backward").difference == 0 and v.ok, v.reason
    with pytest.raises(UsageError, match="move the module"):
        validate(nn.Linear(4, 4), input_shape=(2, 4), device="cuda")
    code, out, err = run_cli(capfd, ["validate", model_file("tiny_gpt2"), "--input-shape", "2x16", "--device", "cuda"])
    assert code == 0 and "peak allocated" in out, err


def test_cuda_path_arithmetic_with_stand_in_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA measurement code, run here on CPU tensors with torch.cuda's counters replaced:
    the step's predicted rise (caching-allocator model) lands on the measured before-step bytes."""
    report = graphmem.analyze(model_file("tiny_llama"), input_shape=(2, 16), device="cuda")
    model = validate_module._cuda_model(report)
    assert report.step is not None
    # parameters, buffers and inputs, each in its own 512 B-rounded block of a fresh cache
    before = sum(-(-s.nbytes // 512) * 512 for s in report.step.storages.values() if s.created == -1 and s.nbytes)
    counters = {"allocated": 7_000_000, "max_allocated": 7_000_000 + model.max_allocated - before,
                "max_reserved": 12_582_912}
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev=None: counters["allocated"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev=None: counters["max_allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda dev=None: counters["max_reserved"])
    loaded = validate_module._build(model_file("tiny_llama"), torch.device("cpu"))
    inputs = validate_module._inputs(loaded, (2, 16), torch.device("cpu"))
    spec = report.source.spec
    rows = validate_module._cuda(report, loaded.module, inputs, loaded.loss, torch.device("cpu"), spec.training,
                                 spec.target)
    by = {r.name: r for r in rows}
    assert calls == ["reset"]
    assert by["allocated before the step"].predicted == before
    assert by["allocated before the step"].measured == counters["allocated"]
    assert by["peak allocated"].predicted == by["peak allocated"].measured == counters["max_allocated"]
    assert by["peak reserved"].predicted == model.max_reserved and by["peak reserved"].measured == counters["max_reserved"]
    assert by["saved for backward"].predicted == report.activation_bytes
    assert by["saved for backward"].measured == measure.measure_saved(loaded.module, inputs, loaded.loss)  # CPU here
    judged, _ = judge(rows, 1.0)
    assert [r.ok for r in judged][1:] == [None, True, None]



def test_garbage_profiled_earlier_is_not_freed_inside_the_measured_step() -> None:
    """GIVEN a 4 MiB block allocated under an earlier profile and left in a reference cycle (as
    a Hugging Face model's garbage is), and a collection during the next step (here forced by a
    forward hook; in the suite, the collector's own schedule), WHEN the step is measured, THEN
    its peak is the one measured without that garbage: the CPU allocator's profiler reporter
    reports the block's free as a negative event, which inside the window lowered the peak
    (graphmem/capture/collector.py quiet_gc collects before the window)."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    from graphmem.validation.measure import measure_peak

    model, x = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64)), torch.randn(32, 64)
    clean = measure_peak(model, (x,)).peak_bytes
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True):
        junk: list = [torch.empty(1 << 20)]
        junk.append(junk)  # only the collector frees it
    gc.collect()  # junk survives (still referenced) into the oldest generation
    del junk
    def collect(*args: object) -> None:
        gc.collect()

    handle = model[1].register_forward_hook(collect)
    try:
        assert measure_peak(model, (x,)).peak_bytes == clean
    finally:
        handle.remove()


# -- validate runs the step the spec names: its loop ---------------------------------------------

@pytest.mark.parametrize("options", [
    dict(optimizer="adamw", micro_batches=2),  # the optimizer, its states, a second step's peak
    dict(optimizer="sgd", lora_rank=4, lora_targets="c_attn,c_proj"),  # adapters on a copy, the rest frozen
    dict(optimizer="adam", dtype="bf16", master_weights=True),  # 16-bit parameters, fp32 masters
])  # (amp="bf16" on the CPU: oneDNN's bf16 GEMM scratch is not modelled, tests/planning/test_checkpoint_plans.py measures it)
def test_validate_runs_the_loop_the_spec_names(options: dict) -> None:
    # GIVEN a real module and the loop as analyze takes it
    from cases import tiny_gpt, tokens

    torch.manual_seed(0)
    module, inputs = tiny_gpt(), tokens()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    # WHEN validated
    v = validate(module, inputs, **options)
    # THEN the real step is that loop: saved bytes and states exact, peaks within 1 %, never above
    names = {r.name for r in v.rows}
    assert v.ok, v.reason
    assert v.row("saved for backward").difference == 0 and v.row("before the step").difference == 0
    if options.get("optimizer") not in (None, "sgd"):
        assert {"optimizer states", "peak (later steps)"} <= names and v.row("optimizer states").difference == 0
    # and the user's module is untouched (LoRA and the dtype went on a copy)
    assert all(torch.equal(weights[k], t) for k, t in module.state_dict().items())
    assert all(p.dtype == torch.float32 for p in module.parameters())


def test_validate_names_what_it_does_not_run_for_real() -> None:
    module = nn.Linear(4, 4)
    with pytest.raises(UsageError, match="not `zero`"):  # a formula: no wrapper to run per rank (tests/validation/test_validate_ranks.py)
        validate(module, (torch.randn(2, 4),), world_size=2, zero=1)


def test_cli_validate_takes_the_loop_options(capfd: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", "gpt2", "--input-shape", "1x16", "--optimizer", "adamw", "--micro-batches", "2"]) == 0
    out = capfd.readouterr().out
    assert "adamw" in out.splitlines()[0] and "2 micro-batches" in out.splitlines()[0]
    assert "peak (later steps)" in out and "optimizer states" in out
