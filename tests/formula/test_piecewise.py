"""Piecewise formulas around a sliding window (graphmem/formula/piecewise.py): Mistral with window 8 is
not one polynomial in s (plain causal attention below the window, the window's mask from it on),
but one on each side; formula, sweep and fit hold on both sides, checked by captures."""
from __future__ import annotations

import pytest
import torch

import graphmem
from graphmem.render.formula import render_coefficients

W = 8


@pytest.fixture(scope="module")
def report() -> graphmem.Report:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        sliding_window=W)
    return graphmem.analyze(transformers.MistralForCausalLM(config), (torch.randint(0, 128, (2, 16)),))


def _captured(report: graphmem.Report, b: int, s: int) -> graphmem.Report:
    return graphmem.analyze(report.source.module, (torch.randint(0, 128, (b, s)),))


@pytest.mark.slow
def test_sliding_window_formula_is_two_exact_pieces(report: graphmem.Report) -> None:
    c = report.coefficients
    assert c.breakpoint == W and c.variables[c.index] == "s"
    assert "s**2" not in c.below.activation_terms and "b*s**2" in c.above.activation_terms  # the window's mask
    for b in (1, 3):
        for s in (3, 5, W - 1, W, W + 1, 13, 24):  # both sides, the breakpoint and beyond the fitted range
            r = _captured(report, b, s)
            assert (c.activation_at((b, s)), c.peak_at((b, s))) == (r.activation_bytes, r.peak_bytes), (b, s)
    text = render_coefficients(c)
    assert f"breakpoint s = {W}" in text and f"[s < {W}]" in text and f"[s >= {W}]" in text
    assert c.to_dict()["piecewise"]["breakpoint"] == W


@pytest.mark.heavy  # ~2.5 min; CI runs the formula's two exact pieces on the same report
def test_sliding_window_sweep_and_fit_across_the_window(report: graphmem.Report) -> None:
    sw = report.sweep([1, 2], [4, W, 16])
    for b, s, act, peak, _, _ in sw.rows:
        r = _captured(report, b, s)
        assert (act, peak) == (r.activation_bytes, r.peak_bytes), (b, s)
    for memory in (228_000, 400_000):  # answers below (s = 7) and above the window
        a = report.fit(memory, batch=2)
        assert a.peak_at_value == a.captured_at_value <= memory < a.peak_above == a.captured_above
