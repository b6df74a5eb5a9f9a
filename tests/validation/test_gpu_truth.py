"""benchmarks/gpu_truth.py's plumbing without a GPU (``--dry``): graphmem's CUDA target on every
row, the table's shape, the docs section, and PyTorch's published GPU figures reproduced by
graphmem (test/functorch/test_ac.py's activation memory budgets and test_fsdp_memory.py's
MiB after forward, graphmem side on fake tensors; benchmarks/gpu_truth_anchors.py says which)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_truth  # noqa: E402
import gpu_truth_anchors as anchors  # noqa: E402
import gpu_truth_zoo as zoo  # noqa: E402
from gpu_truth_report import ANCHOR_HEAD, ZOO_HEAD, markdown  # noqa: E402
from gpu_truth_steps import Side  # noqa: E402


def _table_rows(text: str, head: list[str]) -> list[list[str]]:
    """The body rows of the Markdown table whose header is ``head``."""
    lines = text.splitlines()
    start = lines.index("| " + " | ".join(head) + " |")
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split(" | ")])
    return rows


def test_dry_subset(tmp_path: Path) -> None:
    """GIVEN two models (one with SDPA attention) on four targets and the quick anchors
    WHEN the script runs --dry THEN every row has graphmem's figures, no real ones, the table has
    one line a row and 15 columns, every anchor figure is PyTorch's, and the docs section is
    written once (a rerun replaces it)."""
    docs = tmp_path / "validation.md"
    docs.write_text("# Validation\n\nkept text\n")
    argv = ["--dry", "--models", "nn_transformer_encoder,nn_gru", "--variants", "fp32,amp-bf16,sdpa-efficient,compiled",
            "--anchors", "quick", "--docs", str(docs), "--jobs", "1"]
    run = gpu_truth.main(argv)

    assert [(r.model, r.variant) for r in run.zoo] == [
        ("nn_transformer_encoder", "fp32"), ("nn_gru", "fp32"), ("nn_transformer_encoder", "amp-bf16"),
        ("nn_gru", "amp-bf16"), ("nn_transformer_encoder", "sdpa-efficient"),
        ("nn_transformer_encoder", "compiled")]  # variant-major; SDPA backends where attention runs; no compiled RNN
    assert all(isinstance(r.predicted, Side) and r.real is None for r in run.zoo), [r.predicted for r in run.zoo]
    by = {(r.model, r.variant): r.predicted for r in run.zoo}
    # nn.TransformerEncoder's SDPA runs inside F.multi_head_attention_forward, under graphmem's CUDA rules
    # since they run Python torch functions with the rules on the stack (graphmem/capture/cuda_rules.py): its
    # row names the backend its 2 layers ran
    assert by["nn_transformer_encoder", "sdpa-efficient"].note == "efficient x2"  # type: ignore[union-attr]  (2 layers)
    assert by["nn_transformer_encoder", "amp-bf16"].saved < by["nn_transformer_encoder", "fp32"].saved  # type: ignore[union-attr]

    text = docs.read_text()
    assert text.startswith("# Validation\n\nkept text\n") and text.count("<!-- gpu_truth:dry:begin -->") == 1
    zoo_rows = _table_rows(text, ZOO_HEAD)
    assert len(zoo_rows) == 6 and all(len(r) == len(ZOO_HEAD) == 15 for r in zoo_rows)
    anchor_rows = _table_rows(text, ANCHOR_HEAD)
    assert len(anchor_rows) == len(run.anchors) == 4 + 3 + 2 + 2 + 2
    assert {r.verdict() for r in run.anchors} <= {"ok", "(no figure)"}, markdown(run)
    fsdp = {r.setting: r.graphmem for r in run.anchors if r.source == anchors.TEST_FSDP}
    # sharded parameters 1.96 MiB + the batch 1.15 MiB; + 338.05 MiB of activations; + sharded gradients
    assert fsdp == {"no_ckpt: start": 3.11, "no_ckpt: after fwd": 340.02, "no_ckpt: after loss": 340.02,
                    "no_ckpt: after bwd": 5.07}

    gpu_truth.main(argv[:1] + ["--models", "nn_gru", "--variants", "fp32", "--anchors", "none", "--docs", str(docs)])
    again = docs.read_text()
    assert again.count("<!-- gpu_truth:dry:begin -->") == 1 and len(_table_rows(again, ZOO_HEAD)) == 1


def test_rows_and_mistakes() -> None:
    assert len(zoo.ZOO) >= 15
    pairs = zoo.rows()
    attention = sum(has for _, has in zoo.ZOO.values())
    assert len(pairs) == len(zoo.ZOO) * len(zoo.BASE) + attention * len(zoo.ATTENTION) - len(zoo.EAGER_ONLY)
    with pytest.raises(SystemExit, match="unknown model or variant"):
        zoo.rows(["gpt5"])
    with pytest.raises(SystemExit, match="no GPU here"):
        gpu_truth.main(["--models", "nn_gru", "--no-docs"])  # a real run on a machine without a GPU


def test_time_guard() -> None:
    """A guard already spent: nothing runs, every row says skipped, the table is still printed."""
    run = gpu_truth.main(["--dry", "--models", "nn_gru", "--anchors", "none", "--timeout", "0", "--no-docs"])
    assert [str(r.predicted).split(" ")[0] for r in run.zoo] == ["skipped"] * 3


@pytest.mark.slow  # two spawned processes import torch (~70 s on a loaded 2-core machine)
@pytest.mark.heavy  # (CI time) the benchmark's pool plumbing; the dry rows and anchors run in CI
def test_process_pool() -> None:
    """--jobs 2: graphmem's side in spawned processes (as on the GPU host), the same figures as in-process."""
    argv = ["--dry", "--models", "nn_gru", "--variants", "fp32,bf16", "--anchors", "none", "--no-docs"]
    pooled, alone = gpu_truth.main(argv + ["--jobs", "2"]), gpu_truth.main(argv + ["--jobs", "1"])
    assert [r.predicted.saved for r in pooled.zoo] == [r.predicted.saved for r in alone.zoo]  # type: ignore[union-attr]
    assert all(isinstance(r.predicted, Side) for r in pooled.zoo)


@pytest.mark.slow
def test_dry_all_anchors_reproduce() -> None:
    """Every figure PyTorch's tests assert (test_ac.py's budgets, test_fsdp_memory.py with and without
    checkpoint) is graphmem's on the CUDA target."""
    run = gpu_truth.main(["--dry", "--variants", "fp32", "--models", "nn_gru", "--no-docs", "--timeout", "3000"])
    checked = [r for r in run.anchors if r.expected is not None]
    assert len(checked) == 70 and all(r.verdict() == "ok" for r in checked), markdown(run)


@pytest.mark.parametrize("variant", ["sdpa-math", pytest.param("compiled", marks=pytest.mark.slow)])
def test_real_side_plumbing_on_cpu(monkeypatch: pytest.MonkeyPatch, variant: str) -> None:
    """The real side's code path (warm-up, the measured step, saved_tensors_hooks, torch.compile with
    aot_eager) with the model left on the CPU and torch.cuda's counters stubbed: its saved bytes are
    the CPU truth, which graphmem's CPU target predicts exactly, eager and compiled."""
    import gpu_truth_steps as steps
    import torch

    import graphmem

    monkeypatch.setattr(steps, "_to_cuda", lambda model, inputs, dtype: (model, inputs))
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: 0)
    target = zoo.VARIANTS[variant]
    real = steps.measure_cuda(*zoo.build("hf_bert"), target)
    predicted = graphmem.analyze(*zoo.build("hf_bert"), mode=target.mode,
                                 attention="math" if target.attention == "math" else "auto")
    assert real.saved == predicted.activation_bytes > 0


def test_gpu_run_plumbing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The GPU run's path through main (no --dry) with the real measurements stubbed: real columns
    filled, the saved-bytes verdict counted, the real anchors filled in, the gpu section written."""
    import importlib

    import torch

    validate = importlib.import_module("graphmem.validation.validate")  # the package exports the function
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3 (stub)")
    monkeypatch.setattr(validate, "_target", lambda dev: {"device": "cuda", "gpu": "h100"})
    monkeypatch.setattr(gpu_truth, "measure_cuda", lambda model, inputs, variant: Side(1_000, 2_048, 2_048, 2 << 20, 0.5))
    monkeypatch.setattr(anchors, "real_act_mib", lambda case, budget: 1.0)
    docs = tmp_path / "validation.md"
    run = gpu_truth.main(["--models", "nn_gru", "--variants", "fp32", "--anchors", "quick", "--docs", str(docs),
                          "--jobs", "1"])
    row = _table_rows(docs.read_text(), ZOO_HEAD)[0]
    assert row[4] == "1,000" and row[8] == "2,048" and row[11] == "2,097,152" and row[13] == "0.50"
    assert "<!-- gpu_truth:gpu:begin -->" in docs.read_text() and "GPU: NVIDIA H100 80GB HBM3 (stub)" in run.title
    assert "real side 1 ran, saved bytes exact on 0 of 1" in docs.read_text()
    assert {r.real for r in run.anchors if r.source == anchors.TEST_AC} == {1.0}
