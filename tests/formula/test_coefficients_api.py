"""One coefficients API on every model: ``report.coefficients`` answers ``.activation``, ``.alpha``,
``.beta``, ``.gamma``, ``.peak``, ``.pieces`` and the evaluations whether the model's bytes are one
polynomial (Gemma 2, plain causal attention masked by the window) or one polynomial each side of a
sliding window (Gemma 3, graphmem/formula/piecewise.py). Every value is checked to the byte against
captures at shapes the fit never sampled.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest
import sympy
import torch

import graphmem
from graphmem.formula import Coefficients, PiecewiseCoefficients
from graphmem.render.formula import render_coefficients

W = 8  # sliding window, smaller than the report's sequence length (16)
HEADS, D = 4, 32


def _config(kind: str, layers: int = 2) -> Any:
    transformers = pytest.importorskip("transformers")
    cls = transformers.Gemma3TextConfig if kind == "gemma3" else transformers.Gemma2Config
    return cls(vocab_size=128, hidden_size=D, intermediate_size=64, num_hidden_layers=layers,
               num_attention_heads=HEADS, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
               sliding_window=W)


def _model(kind: str, layers: int = 2) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    cls = transformers.Gemma3ForCausalLM if kind == "gemma3" else transformers.Gemma2ForCausalLM
    torch.manual_seed(0)
    return cls(_config(kind, layers))


def _capture(kind: str, b: int, s: int, layers: int = 2) -> graphmem.Report:
    return graphmem.analyze(_model(kind, layers), (torch.randint(0, 128, (b, s)),))


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def case(request: pytest.FixtureRequest) -> tuple[str, Any]:
    kind = request.param
    return kind, _capture(kind, 2, 16).coefficients


def _block_at(c: Any, b: int, s: int) -> Fraction:
    """alpha·b·s·d_model + beta·b·n_heads·s² + gamma·b·s + the rest, from the public fields."""
    rest = sum((v * sympy.sympify(k).subs({"b": b, "s": s}) for k, v in c.split.rest.items()), Fraction(0))
    return c.alpha * b * s * c.d_model + c.beta * b * c.n_heads * s * s + c.gamma * b * s + Fraction(str(rest))


@pytest.mark.slow
def test_one_api_on_one_polynomial_and_on_pieces(case: tuple[str, Any]) -> None:
    kind, c = case
    if kind == "gemma3":  # Gemma 3 switches to the window's mask from s = W on: two pieces
        assert isinstance(c, PiecewiseCoefficients)
        assert [p.range for p in c.pieces] == [f"3 <= s < {W}", f"s >= {W}"]
        assert c.current is c.above and c.current_piece.range == f"s >= {W}"  # the input has s = 16
    else:  # Gemma 2: one polynomial, listed as its one piece
        assert isinstance(c, Coefficients)
        assert [p.range for p in c.pieces] == ["every size >= 3"] and c.current is c and c.current_piece.coefficients is c
    cur = c.current
    assert (c.activation, c.alpha, c.beta, c.gamma, c.peak, c.blocks) == (
        cur.activation, cur.alpha, cur.beta, cur.gamma, cur.peak, cur.blocks)
    assert c.alpha is not None and c.beta is not None and (c.d_model, c.n_heads) == (D, HEADS)
    for b, s in ((5, 11), (3, 21)):  # held out: in the input's piece, never sampled by the fit
        assert (b, s) not in {p for p, _, _ in c.held_out}
        r = _capture(kind, b, s)
        assert int(c.activation.subs({"b": b, "s": s})) == c.activation_at((b, s)) == r.activation_bytes, (b, s)
        assert c.peak.at((b, s))[0] == c.peak_at((b, s)) == r.peak_bytes, (b, s)
        one_block = r.activation_bytes - _capture(kind, b, s, layers=1).activation_bytes
        assert _block_at(c, b, s) == one_block, (b, s)  # alpha/beta/gamma: what one more block costs
    for piece in c.pieces:  # every piece answers at a held-out shape inside its own range
        b, s = 6, piece.low + 2
        r = _capture(kind, b, s)
        assert piece.coefficients.activation_at((b, s)) == c.activation_at((b, s)) == r.activation_bytes
        assert c.piece_at((b, s)) is piece.coefficients


@pytest.mark.slow
def test_renderers_read_either_kind(case: tuple[str, Any]) -> None:
    kind, c = case
    text = render_coefficients(c)
    data = c.to_dict()
    assert (Fraction(data["alpha"]), Fraction(data["beta"])) == (c.alpha, c.beta)  # JSON: the current piece's fields
    if kind == "gemma3":
        assert f"The input (s = 16) falls in [s >= {W}]" in text
        assert data["piece"] == f"s >= {W}" and len(data["piecewise"]["pieces"]) == 2
    else:
        assert "Piecewise" not in text and "piecewise" not in data
