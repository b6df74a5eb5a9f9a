"""Renderers: golden text output, JSON with exact integers, human units.

Golden files live in tests/golden/. After an intended change to the text layout, rewrite them
with ``GRAPHMEM_UPDATE_GOLDEN=1 pytest tests/render/test_render.py`` and check the diff by hand: every
number in them was derived by hand once (see the ``*_by_hand`` tests below).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from conftest import check_golden
from paths import ROOT, TESTS

import graphmem
import graphmem.render.text
from graphmem import cli
from graphmem.render import fmt_bytes, render_json, render_text
from graphmem.report import Report

GOLDEN = TESTS / "golden"
MLP_FILE = ROOT / "models" / "mlp.py"


# -- tiny deterministic models ----------------------------------------------------------------

def sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.act = nn.GELU()
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(self.ln(x))))  # (8, 16) -> (8, 32) -> (8, 16)


class Net(nn.Module):
    """Two levels of modules, so the module table has depth."""

    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))  # (8, 4)


def nested() -> nn.Module:
    torch.manual_seed(0)
    return Net()


MODELS: dict[str, Callable[[], nn.Module]] = {"sequential": sequential, "nested": nested}


def analyze(name: str) -> Report:
    torch.manual_seed(0)
    return graphmem.analyze(MODELS[name](), (torch.randn(8, 16),))


# -- golden text ------------------------------------------------------------------------------

def _check_golden(name: str, text: str) -> None:
    check_golden(text, GOLDEN / f"{name}.txt")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_render_text_matches_golden(name: str) -> None:
    # GIVEN a tiny deterministic model analyzed on an (8, 16) float32 batch
    report = analyze(name)
    # WHEN it is rendered as text THEN it matches the hand-checked golden file byte for byte
    _check_golden(name, render_text(report))


def test_render_text_sequential_numbers_by_hand() -> None:
    """The numbers in golden/sequential.txt, derived independently of graphmem."""
    r = analyze("sequential")
    f32 = 4
    params = (32 * 16 + 32 + 4 * 32 + 4) * f32  # 2048 + 128 + 512 + 16 = 2704 B = 2.64 KiB
    assert r.parameter_bytes == params == 2704
    assert r.gradient_bytes == params  # one grad per parameter after backward
    assert r.input_bytes == 8 * 16 * f32 == 512
    # Saved: the batch (Linear 0 needs it for its weight grad) and the ReLU output (ReLU's own
    # backward and Linear 2's weight grad both use it; one storage, counted once).
    assert r.by_category == {"activation": 8 * 32 * f32, "input": 8 * 16 * f32, "autocast copy": 0, "workspace": 0, "other": 0}
    assert r.activation_bytes == 512 + 1024 == 1536  # 1.50 KiB
    # Peak: during Linear 0's bias-grad sum in backward (op 25), live are the parameters (2704),
    # the batch (512), the output (8x4: 128), loss and its ones_like grad (4 + 4), the grads of
    # Linear 2 (512 + 16), ReLU's grad (threshold_backward 8x32: 1024), Linear 0's weight grad
    # (32x16: 2048) and the bias-grad sum being made (1x32: 128).
    assert r.peak_bytes == 2704 + 512 + 128 + 4 + 4 + 512 + 16 + 1024 + 2048 + 128 == 7080  # 6.91 KiB
    assert (r.peak_index, r.peak_phase, r.peak_op, r.peak_module) == (25, "backward", "aten.sum.dim_IntList", "0")
    assert len(r.live_at_peak) == 13 and sum(t.nbytes for t in r.live_at_peak) == r.peak_bytes
    # forward: t, addmm, relu, t, addmm; loss: sum; backward: the rest
    assert (r.phase_start["loss"], r.phase_start["backward"], r.num_ops) == (5, 6, 30)


def test_render_text_nested_numbers_by_hand() -> None:
    """The numbers in golden/nested.txt, derived independently of graphmem."""
    r = analyze("nested")
    f32 = 4
    params = (16 + 16 + 32 * 16 + 32 + 16 * 32 + 16 + 4 * 16 + 4) * f32  # 4688 B = 4.58 KiB
    assert r.parameter_bytes == r.gradient_bytes == params == 4688
    ln = 8 * 16 * f32 + 8 * 16 * f32 + 2 * 8 * 1 * f32  # batch + LN output + mean + rstd = 1088
    fc = 8 * 32 * f32  # fc output, saved by GELU = 1024
    act = 8 * 32 * f32  # GELU output, saved by proj = 1024
    proj = 8 * 16 * f32  # proj output, saved by head = 512
    assert r.activation_bytes == ln + fc + act + proj == 3648  # 3.56 KiB
    assert r.by_category["input"] == 512 and r.by_category["activation"] == 3136  # 3.06 KiB
    by_path = {m.path: (m.activation_bytes, m.self_bytes, m.count) for m in r.modules}
    assert by_path == {"": (3648, 0, 7), "block": (3648, 0, 7), "block.ln": (1088, 1088, 4),
                       "block.fc": (1024, 1024, 1), "block.act": (1024, 1024, 1),
                       "block.proj": (512, 512, 1), "head": (0, 0, 0)}
    # Peak during fc's bias-grad sum (op 44): parameters 4688 + batch 512 + output 128 + loss 4
    # + ones_like 4 + head grads (256 + 16) + proj grads (2048 + 64) + LN output still saved for
    # fc (512) + LN mean/rstd (64) + GELU grad (1024) + fc's input grad (8x16: 512) + fc's
    # weight grad (2048) + the bias-grad sum (128).
    assert r.peak_bytes == (4688 + 512 + 128 + 4 + 4 + 256 + 16 + 2048 + 64 + 512 + 64 + 1024 + 512
                            + 2048 + 128) == 12008  # 11.73 KiB
    assert (r.peak_index, r.peak_op, r.peak_module) == (44, "aten.sum.dim_IntList", "block.fc")
    assert len(r.live_at_peak) == 23 and sum(t.nbytes for t in r.live_at_peak) == r.peak_bytes


# -- JSON -------------------------------------------------------------------------------------

def _assert_int(value: Any) -> None:
    assert type(value) is int, f"{value!r} is a {type(value).__name__}, not an int"


@pytest.fixture
def mlp_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`graphmem analyze models/mlp.py --input-shape 4x784 --json`, parsed."""
    code = cli.main(["analyze", str(MLP_FILE), "--input-shape", "4x784", "--json"])
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    data: dict[str, Any] = json.loads(out)
    return data


def test_cli_json_has_exact_integer_totals(mlp_json: dict[str, Any]) -> None:
    for key in ("activation_bytes", "peak_bytes", "parameter_bytes", "gradient_bytes"):
        _assert_int(mlp_json[key])
    # mlp-mnist: 784 -> 1024 -> 1024 -> 10, float32
    params = (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) * 4
    assert mlp_json["parameter_bytes"] == params
    assert mlp_json["gradient_bytes"] == params
    assert mlp_json["input_shapes"] == [[4, 784]]
    assert mlp_json["peak_bytes"] >= mlp_json["parameter_bytes"] + mlp_json["activation_bytes"]


def test_cli_json_saved_items(mlp_json: dict[str, Any]) -> None:
    saved = mlp_json["saved"]
    assert saved
    for item in saved:
        assert {"op", "module", "shape", "dtype", "bytes", "category", "created", "released"} <= set(item)
        _assert_int(item["bytes"])
        _assert_int(item["created"])
        assert item["released"] is None or type(item["released"]) is int
        assert all(type(d) is int for d in item["shape"])
        assert isinstance(item["op"], str) and isinstance(item["module"], str)
    assert sum(item["bytes"] for item in saved) == mlp_json["activation_bytes"]


def test_cli_json_modules(mlp_json: dict[str, Any]) -> None:
    modules = mlp_json["modules"]
    for m in modules:
        assert {"path", "activation_bytes"} <= set(m)
        _assert_int(m["activation_bytes"])
    root = [m for m in modules if m["path"] == ""]
    assert len(root) == 1 and root[0]["activation_bytes"] == mlp_json["activation_bytes"]


def test_cli_json_is_the_report_dict(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # GIVEN a model file written for the test
    path = tmp_path / "tiny.py"
    path.write_text("import torch.nn as nn\nmodel = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))\n")
    # WHEN the CLI prints JSON
    assert cli.main(["analyze", str(path), "--input-shape", "8x16", "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    data = json.loads(out)
    # THEN it is the library's report, and the same numbers as the in-memory Sequential
    assert data == json.loads(render_json(graphmem.analyze(str(path), input_shape="8x16")))
    assert data["activation_bytes"] == 1536 and data["peak_bytes"] == 7080
    assert data["model"] == "tiny.py"


# -- units ------------------------------------------------------------------------------------

@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (1536, "1.50 KiB"),
    (2704, "2.64 KiB"), (1024 ** 2, "1.00 MiB"), (3 * 2 ** 30, "3.00 GiB"), (2 ** 40, "1.00 TiB"),
])
def test_fmt_bytes(n: int, text: str) -> None:
    assert fmt_bytes(n) == text


def test_ops_recorded_counts_the_optimizer_and_the_accumulating_micro_steps(capsys: pytest.CaptureFixture[str]) -> None:
    # GIVEN a step of 2 micro-batches and an SGD step (momentum: one state per parameter)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    report = graphmem.analyze(net, (torch.randn(4, 8),), optimizer="momentum", micro_batches=2)
    starts = report.phase_start
    # WHEN the text report is rendered
    line = next(x for x in render_text(report).splitlines() if x.startswith("ops recorded"))
    # THEN each phase's ops are counted from its start to the next one's, the optimizer's apart
    assert line == (f"ops recorded: {report.num_ops} (accumulate {starts['forward']}, "
                    f"forward {starts['loss'] - starts['forward']}, loss {starts['backward'] - starts['loss']}, "
                    f"backward {starts['optimizer'] - starts['backward']}, optimizer {report.num_ops - starts['optimizer']})")
    assert starts["optimizer"] < report.num_ops and starts["forward"] > 0
