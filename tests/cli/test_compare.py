"""``graphmem compare``: real model changes with their deltas derived by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cases import tiny_gpt
from conftest import check_golden
from paths import TESTS

import graphmem
from graphmem import cli
from graphmem.render import fmt_bytes, render_json
from graphmem.render.compare import render_comparison
from graphmem.report.compare import SavedGroup, compare

GOLDEN = TESTS / "golden"
MLP_MODEL = """\
from graphmem.models.mlp import MLP, MLPConfig, example_inputs, loss
model = lambda: MLP(MLPConfig(in_features=16, hidden=(32,), out_features=4, activation={act!r}))
"""


def _analyze_json(capsys: pytest.CaptureFixture[str], tmp_path: Path, act: str) -> Path:
    model = tmp_path / f"{act}.py"
    model.write_text(MLP_MODEL.format(act=act))
    assert cli.main(["analyze", str(model), "--input-shape", "8x16", "--json"]) == 0
    out = tmp_path / f"{act}.json"
    out.write_text(capsys.readouterr().out)
    return out


def test_gelu_to_relu_mlp_from_the_command_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # GIVEN the JSON reports of an MLP 16 -> 32 -> 4 (b = 8, float32) with GELU, then with ReLU
    a, b = _analyze_json(capsys, tmp_path, "gelu"), _analyze_json(capsys, tmp_path, "relu")
    # WHEN they are compared
    assert cli.main(["compare", str(a), str(b)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    c = compare(json.loads(a.read_text()), json.loads(b.read_text()), (str(a), str(b)))
    # THEN: GELU's backward needs its input (net.0's 8x32 output, 1024 B) and net.2 needs GELU's
    # output (1024 B); ReLU's backward and net.2 share ReLU's output. One 8x32 tensor less.
    f32, act = 4, 8 * 32 * 4
    params = (16 * 32 + 32 + 32 * 4 + 4) * f32
    totals = {t.name: t for t in c.totals}
    assert totals["activations"].delta == -act == -1024
    assert [(t.before, t.after) for t in (totals["parameters"], totals["gradients"])] == [(params, params)] * 2
    # the peak moves but, by coincidence of sizes, stays 7080 B. GELU: at net.2's bias-grad sum
    # (op 20): parameters 2704, batch 512, net.0's output and GELU's output (both still saved,
    # 1024 each), net.2's input grad 1024 and weight grad 512, the logits 128 and their grad 128,
    # the bias grad 16, loss 4 and its grad 4. ReLU: at net.0's bias-grad sum (op 30): parameters
    # 2704, net.0's weight grad 2048, ReLU's grad 1024, batch 512, net.2's weight grad 512, the
    # logits 128, net.0's bias grad 128, net.2's 16, loss 4 and its grad 4.
    gelu_peak = params + 512 + 1024 + 1024 + 1024 + 512 + 128 + 128 + 16 + 4 + 4
    relu_peak = params + 2048 + 1024 + 512 + 512 + 128 + 128 + 16 + 4 + 4
    assert (totals["peak (run)"].before, totals["peak (run)"].after) == (gelu_peak, relu_peak) == (7080, 7080)
    assert c.peak_at == ("op 20 (backward, aten.sum.dim_IntList, net.2)", "op 30 (backward, aten.sum.dim_IntList, net.0)")
    assert [(m.name, m.delta) for m in c.modules] == [("", -act), ("net", -act), ("net.0", -act)]
    assert c.removed == (SavedGroup("aten.addmm.default", "net.0", (8, 32), "float32", "activation", act, 1),
                         SavedGroup("aten.gelu.default", "net.1", (8, 32), "float32", "activation", act, 1))
    assert c.added == (SavedGroup("aten.relu.default", "net.1", (8, 32), "float32", "activation", act, 1),)
    # AND the text says so
    assert out.startswith(f"graphmem compare · {a} → {b}\ninput 8x16 · target cpu · precision fp32 parameters · "
                          "optimizer none · loop forward and backward, no optimizer step · parallel 1 rank\n")
    assert [" ".join(line.split()) for line in out.splitlines() if line.startswith("model")] == [
        f"model {a.stem}.py {b.stem}.py"]  # in the table of what differs
    before = totals["activations"].before
    assert [" ".join(line.split()) for line in out.splitlines() if line.startswith("activations")] == [
        f"activations {fmt_bytes(before)} {fmt_bytes(before - act)} -1.00 KiB -1,024 B {-100 * act / before:.1f}%"]
    assert f"Saved only in {b}: 1 tensor, 1.00 KiB" in out and f"Saved only in {a}: 2 tensors, 2.00 KiB" in out
    assert out == render_comparison(c)


def test_amp_and_optimizer_differ(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """golden/compare_amp_adamw.txt: the same MLP as plain fp32 and as bf16 autocast + AdamW; the
    comparison names the precision, the optimizer and the loop that differ (``--depth 1``)."""
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "mlp.py"
    model.write_text(MLP_MODEL.format(act="gelu"))
    for name, extra in (("fp32.json", []), ("bf16_adamw.json", ["--amp", "bf16", "--optimizer", "adamw"])):
        assert cli.main(["analyze", "mlp.py", "--input-shape", "8x16", "--json", *extra]) == 0
        Path(name).write_text(capsys.readouterr().out)
    assert cli.main(["compare", "fp32.json", "bf16_adamw.json", "--depth", "1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    check_golden(out, GOLDEN / "compare_amp_adamw.txt")
    c = compare(json.loads(Path("fp32.json").read_text()), json.loads(Path("bf16_adamw.json").read_text()))
    assert [row for row in c.context if row[1] != row[2]] == [
        ("precision", "fp32 parameters", "fp32 parameters, bf16 autocast"), ("optimizer", "none", "adamw"),
        ("loop", "forward and backward, no optimizer step", "adamw (forloop)")]
    # autocast saves bf16 copies: the two 8x32 activations (1 KiB each) at half size, the batch's
    # bf16 copy (8x16, 256 B) instead of the fp32 batch (512 B), and net.2's bf16 weight (4x32, 256 B)
    totals = {t.name: t for t in c.totals}
    assert totals["activations"].delta == -2 * 512 - 512 + 256 + 256 == -1024
    later = totals["peak (later steps)"]
    assert later.shown == (False, True) and "peak (later steps)            -" in out
    # the module table stops at depth 1: (model) and net, not net.0 / net.1 / net.2
    assert "  net  " in out and "net.0" not in out.split("Saved only in")[0]


def _gpt(attention: str) -> dict:
    return json.loads(render_json(graphmem.analyze(tiny_gpt(2, attention, dropout=0.1), input_shape=(2, 16))))  # as read from a file


def test_explicit_attention_to_sdpa_on_tiny_gpt2() -> None:
    c = compare(_gpt("explicit"), _gpt("sdpa"), ("explicit", "sdpa"))
    layers, b, h, s, block = 2, 2, 2, 16, 32
    scores = b * h * s * s * 4  # (b, h, s, s) float32: 4096 B
    totals = {t.name: t.delta for t in c.totals}
    # explicit attention also saves ~mask[:, :, :s, :s] for masked_fill's backward (bool, s*s),
    # and keeps the (1, 1, block, block) bool mask as a buffer; SDPA (is_causal) needs neither
    assert totals["activations"] == -layers * s * s == -512
    assert totals["buffers"] == -layers * block * block == -2048
    # the peak is in layer 1's MLP backward, while both layers' masks are still saved, and so is
    # the 8 B double each layer's `* (1.0 / math.sqrt(hd))` wraps its Python float into
    # (MulBackward0 keeps it: graphmem/capture/wrapped_numbers.py); SDPA takes its scale as a float
    assert totals["peak (run)"] == -(layers * block * block + layers * s * s + layers * 8) == -2576
    assert totals["parameters"] == totals["gradients"] == 0
    # the same dropout tensors (noise and output, (b, h, s, s) each) move from the attn_dropout
    # module into SDPA's decomposition inside attn; attn's subtree loses only the mask
    changed = {m.name: m.delta for m in c.modules}
    for i in range(layers):
        assert changed[f"transformer.h.{i}.attn.attn_dropout"] == -2 * scores
        assert changed[f"transformer.h.{i}.attn"] == changed[f"transformer.h.{i}"] == -s * s
    assert changed[""] == changed["transformer"] == changed["transformer.h"] == -layers * s * s
    assert len(changed) == 3 + 3 * layers

    def kinds(groups: tuple[SavedGroup, ...]) -> set[tuple[str, str, int]]:
        return {(g.op, g.module, g.total) for g in groups}

    attn = [f"transformer.h.{i}.attn" for i in range(layers)]
    assert kinds(c.removed) == {k for a in attn for k in [
        ("aten._softmax.default", a, scores), ("aten.empty_like.default", f"{a}.attn_dropout", scores),
        ("aten.mul.Tensor", f"{a}.attn_dropout", scores), ("aten.bitwise_not.default", a, s * s)]}
    assert kinds(c.added) == {k for a in attn for k in [
        ("aten._safe_softmax.default", a, scores), ("aten.empty_like.default", a, scores),
        ("aten.mul.Tensor", a, scores)]}
    text = render_comparison(c, top=3)
    assert "Saved only in explicit: 8 tensors, 24.50 KiB (top 3 rows of 8)" in text
    assert "buffers" in text and "-2,048 B  -100.0%" in text


def test_identical_reports() -> None:
    r = _gpt("sdpa")
    c = compare(r, r)
    assert all(t.delta == 0 for t in c.totals) and not c.modules and not c.added and not c.removed
    assert "Saved tensors: the same in both" in render_comparison(c)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("not json", "is not a JSON report (JSONDecodeError"),
    ('{"model": "x"}', "is not a graphmem JSON report (no activation_bytes, peak_bytes"),
    ("[1, 2]", "is not a graphmem JSON report"),
])
def test_bad_report_files(capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str | None,
                          message: str) -> None:
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    good = tmp_path / "good.json"
    good.write_text(render_json(graphmem.analyze(torch.nn.Linear(4, 2), (torch.randn(3, 4),))))
    assert cli.main(["compare", str(good), str(bad)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("graphmem: error: ") and message in err and err.count("\n") == 1


def test_compare_reads_saved_reports_through_from_dict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """``graphmem compare a.json b.json`` reads each file back as the Report it was
    (``Report.from_dict``): the same comparison and text as the two live reports give."""
    from graphmem.report import Report
    from graphmem.report.compare import load_json_report

    torch.manual_seed(0)
    live = [graphmem.analyze(tiny_gpt(2, attention), input_shape=(2, 16)) for attention in ("explicit", "sdpa")]
    paths = [tmp_path / "explicit.json", tmp_path / "sdpa.json"]
    for report, path in zip(live, paths):
        path.write_text(render_json(report))
    loaded = [load_json_report(p) for p in paths]
    assert all(type(r) is Report and r == l and not hasattr(r, "step") for r, l in zip(loaded, live))
    assert cli.main(["compare", str(paths[0]), str(paths[1])]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out == render_comparison(compare(live[0], live[1], (str(paths[0]), str(paths[1]))))


def test_compare_refuses_a_report_without_its_exact_fields(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    old = json.loads(render_json(graphmem.analyze(torch.nn.Linear(4, 2), (torch.randn(3, 4),))))
    del old["exact"]  # as an older graphmem wrote it
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    assert cli.main(["compare", str(path), str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "old.json is not a JSON report written by this graphmem" in err and err.count("\n") == 1
