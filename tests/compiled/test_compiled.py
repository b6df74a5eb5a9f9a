"""Compiled mode (``mode="compiled"``, ``--mode compiled``) against reality.

Ground truth: a REAL ``torch.compile(model, backend="aot_eager")`` training step on the CPU,
its saved bytes counted by ``saved_tensors_hooks`` around the compiled step (AOTAutograd's
runtime saves what the compiled forward returns for backward with ``ctx.save_for_backward``),
deduplicated by storage, parameters excluded: graphmem.validation.measure.measure_saved. 0 B difference.
"""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch
import torch.nn as nn
from cases import MODELS, build
from paths import TESTS

import graphmem
from graphmem import cli
from graphmem.capture.compiled import CompiledGraphs, _Backend, module_path
from graphmem.errors import DataDependentError
from graphmem.models import mlp
from graphmem.passes import recomputed
from graphmem.render import render_text
from graphmem.training.step import run_step
from graphmem.validation.measure import measure_peak, measure_saved


def real_compiled_saved(module: nn.Module, inputs: tuple, loss: Any, backend: Any = "aot_eager") -> int:
    """Saved bytes of a real compiled step (after a fresh dynamo state, as in a new process)."""
    torch._dynamo.reset()
    try:
        return measure_saved(torch.compile(module, backend=backend), inputs, loss)
    finally:
        torch._dynamo.reset()


# every bundled family; resnet_bottleneck and llama_explicit were checked too (0 B) but cost ~20 s more
@pytest.mark.parametrize("name", ["gpt2_explicit", "gpt2_sdpa", "llama_sdpa", "mlp", "resnet_small"])
def test_compiled_saved_bytes_exact(name: str) -> None:
    module, inputs, loss = build(MODELS, name)
    report = graphmem.analyze(module, inputs, loss=loss, mode="compiled")
    report.step.check()
    assert report.activation_bytes == real_compiled_saved(module, inputs, loss)
    # eager beside it is the eager analysis of the same step
    assert report.compiled.eager_bytes == graphmem.analyze(module, inputs, loss=loss).activation_bytes
    assert report.compiled.compiled_bytes == report.activation_bytes
    root = next(m for m in report.compiled.modules if m.path == "")
    assert (root.eager_bytes, root.compiled_bytes) == (report.compiled.eager_bytes, report.activation_bytes)


@pytest.mark.parametrize("name", ["gpt2_explicit", "llama_sdpa", "mlp"])
def test_compiled_peak_matches_a_real_compiled_step(name: str) -> None:
    # GIVEN a real torch.compile(backend="aot_eager") step, compiled before the measured one
    module, inputs, loss = build(MODELS, name)
    report = graphmem.analyze(module, inputs, loss=loss, mode="compiled")
    torch._dynamo.reset()
    try:
        compiled = torch.compile(module, backend="aot_eager")
        run_step(compiled, inputs, loss)  # compile outside the measured step
        real = measure_peak(compiled, inputs, loss)
    finally:
        torch._dynamo.reset()
    # THEN the predicted peak is the real one, within the ground-truth tolerance (measured: 0 B; the
    # compiled backward frees its gradient inputs as it goes, which graphmem keeps by not hooking it)
    assert report.peak_bytes <= real.peak_bytes
    assert real.peak_bytes - report.peak_bytes <= 0.001 * real.peak_bytes


class GraphBreak(nn.Module):
    """A print splits the forward: two compiled graphs, and the eager glue between them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Dropout(0.1))
        self.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.a(x)
        torch._dynamo.graph_break()
        return self.b(y * y.sigmoid())


def test_graph_breaks_exact() -> None:
    torch.manual_seed(0)
    module, inputs = GraphBreak(), (torch.randn(4, 16),)
    report = graphmem.analyze(module, inputs, mode="compiled")
    assert report.activation_bytes == real_compiled_saved(module, inputs, None)
    assert report.compiled.forward_graphs == 2 and report.compiled.graph_breaks
    text = render_text(report)
    assert "Graph breaks" in text and "2 forward graphs" in text


def test_recomputed_ops_are_the_real_partitioners() -> None:
    """The ops graphmem lists as recomputed in backward are those of a real compiled step's
    backward graphs (same op, module, shape, dtype, bytes), and the list is not empty here."""
    module, inputs, loss = build(MODELS, "llama_sdpa")
    report = graphmem.analyze(module, inputs, loss=loss, mode="compiled")
    backend = _Backend(frozenset(n for n, _ in module.named_modules()))
    assert real_compiled_saved(module, inputs, loss, backend) == report.activation_bytes
    real = recomputed(CompiledGraphs(tuple(backend.graphs)))
    assert report.compiled.recomputed == real and real
    assert report.compiled.recomputed_bytes == sum(r.bytes for r in real)
    names = {n for n, _ in module.named_modules()}
    assert all(r.module in names and r.module for r in real)  # attributed to the modules that made them
    assert "aten.silu.default" in {r.op for r in real}  # SwiGLU's silu: recomputed, not saved


def test_formula_in_compiled_mode_matches_a_real_run() -> None:
    module, inputs, loss = build(MODELS, "mlp")
    report = graphmem.analyze(module, inputs, loss=loss, mode="compiled")
    c = report.coefficients
    assert c.activation.subs("b", 4) == report.activation_bytes
    bigger = (torch.randn(7, 64),)
    assert int(c.activation.subs("b", 7)) == real_compiled_saved(module, bigger, loss)


def test_cli_json_and_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", mlp.__file__, "--input-shape", "4x784", "--mode", "compiled", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["target"]["mode"] == "compiled"
    assert data["compiled"]["compiled_activation_bytes"] == data["activation_bytes"]
    assert data["compiled"]["forward_graphs"] == 1
    assert cli.main(["analyze", mlp.__file__, "--input-shape", "4x784", "--mode", "compiled"]) == 0
    out = capsys.readouterr().out
    assert "Eager vs compiled" in out and "torch.compile" in out


def test_unknown_mode_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["analyze", mlp.__file__, "--input-shape", "4x784", "--mode", "fast"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--mode" in err


def test_data_dependent_model_names_the_fix() -> None:
    """`.item()` in forward: dynamo breaks the graph there, and the eager `.item()` needs values."""
    item = TESTS / "badmodels" / "item.py"
    with pytest.raises(DataDependentError, match="item"):
        graphmem.analyze(str(item), input_shape=(2, 4), mode="compiled")


def test_module_path_from_dynamo_sources() -> None:
    names = frozenset({"", "transformer", "transformer.h", "transformer.h.0", "transformer.h.0.attn"})
    stack = {"1": ("L['self'].transformer.h.0", object), "2": ("L['self'].transformer.h[0].attn", object)}
    assert module_path(stack, names) == "transformer.h.0.attn"
    assert module_path({"1": ("L['self']._modules['transformer']", object)}, names) == "transformer"
    assert module_path({"1": ("L['self'].elsewhere", object)}, names) == ""
    assert module_path(None, names) == ""


def test_analyses_leave_no_cache_entries() -> None:
    """Each analysis removes what it added to dynamo's cache, so repeated analyses (formula
    fits, sweeps) never reach the recompile limit."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    torch._dynamo.reset()
    module = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    for b in range(1, 10):  # more than dynamo's recompile limit (8)
        report = graphmem.analyze(module, (torch.randn(b, 8),), mode="compiled")
        assert report.compiled.forward_graphs == 1 and report.activation_bytes == 2 * b * 8 * 4  # input, relu output
    assert _debug_get_cache_entry_list(type(module).forward.__code__) == []
