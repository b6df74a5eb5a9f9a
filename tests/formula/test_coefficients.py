"""Exact formulas: polynomials in the input sizes, per-block alpha/beta/gamma, fit and sweep.

Expected alpha/beta/gamma are derived by hand below from the tensors each block saves
(fp32 on the CPU target: 4 B an element), written out, not computed by graphmem.
"""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
import sympy
import torch
from cases import tiny_gpt
from paths import TESTS

import graphmem
from graphmem.cli.main import main
from graphmem.formula.fit import MIN_SIZE, NotPolynomialError
from graphmem.models import gpt2, llama, mlp, resnet
from graphmem.passes.coefficients import PeakModel, degree_of, interpolate, split_block, terms

HERE = TESTS
B, S = sympy.symbols("b s")


# -- pure parts -------------------------------------------------------------------------------

def test_degree_of_finite_differences() -> None:
    assert degree_of([5, 5, 5]) == 0
    assert degree_of([1, 3, 5, 7]) == 1
    assert degree_of([n * n + 1 for n in range(5)]) == 2
    assert degree_of([n ** 3 for n in range(5)]) == 3
    assert degree_of([1, 2, 4, 8, 16]) is None  # not a polynomial of degree <= 3


def test_interpolate_is_exact_with_rational_coefficients() -> None:
    f = lambda b, s: Fraction(3, 2) * b * s * s + 7 * b * s + 5 * s + 11  # noqa: E731
    grids = [[2, 3], [4, 5, 6]]
    poly = interpolate({(b, s): int(f(b, s) * 2) for b in grids[0] for s in grids[1]}, grids, [B, S])
    assert terms(poly, [B, S]) == {"b*s**2": 3, "b*s": 14, "s": 10, "1": 22}


def test_peak_model_is_the_largest_per_op_polynomial() -> None:
    # op 0 holds 100*b bytes, op 1 holds 1000 + 10*b: op 1 peaks for b < 10, op 0 for b > 10
    grid = [[3, 4]]
    model = PeakModel({(3,): (300, 1030), (4,): (400, 1040)}, grid, [B])
    assert model.at((5,)) == (1050, 1)
    assert model.at((20,)) == (2000, 0)
    assert model.polynomial(0) == 100 * B


def test_split_block() -> None:
    sp = split_block({"b*s": Fraction(72 * 32 + 16), "b*s**2": Fraction(24), "s**2": Fraction(1)}, 32, 2, Fraction(16))
    assert (sp.alpha, sp.beta, sp.gamma, sp.rest) == (72, 12, 16, {"s**2": 1})


# -- per-block coefficients, derived by hand ------------------------------------------------------

def _gpt(attention: str, dropout: float) -> torch.nn.Module:
    return tiny_gpt(4, attention, dropout, block_size=64)


def test_gpt2_explicit_attention_with_dropout_alpha_beta_by_hand() -> None:
    c = graphmem.analyze(_gpt("explicit", 0.1), input_shape=(4, 16), loss=gpt2.loss).coefficients
    d = 32
    # Saved per token by one block (bytes), each tensor attributed to the block that made it:
    per_token = {
        "ln_1 output (b,s,d)": 4 * d, "ln_2 output (b,s,d)": 4 * d,
        "q, k^T, v contiguous copies for the matmuls, 3 x (b,h,s,hd)": 3 * 4 * d,
        "attention output transposed copy (b,s,h,hd), c_proj's input": 4 * d,
        "resid_dropout noise (CPU dropout saves a float mask)": 4 * d,
        "mlp dropout noise": 4 * d,
        "two residual sums (b,s,d), saved by ln_2 and the next ln_1": 2 * 4 * d,
        "c_fc output (b*s,4d), saved by GELU": 4 * 4 * d,
        "GELU output (b,s,4d), saved by c_proj": 4 * 4 * d,
    }
    assert c.d_model == d and c.n_heads == 2 and c.blocks == 4
    assert c.alpha == Fraction(sum(per_token.values()), d) == 72
    # (b,h,s,s) per element: softmax output 4 B + dropout noise 4 B + dropped probabilities 4 B
    assert c.beta == 4 + 4 + 4 == 12
    # per token, not a multiple of d: LayerNorm mean and rstd, fp32, for ln_1 and ln_2
    assert c.gamma == 2 * (4 + 4) == 16
    # the causal mask ~mask[:s, :s] saved by masked_fill: 1 B per s**2, independent of b
    assert c.split.rest == {"s**2": 1}


def test_gpt2_sdpa_without_attention_dropout_has_beta_zero_on_cpu() -> None:
    c = graphmem.analyze(_gpt("sdpa", 0.0), input_shape=(4, 16), loss=gpt2.loss).coefficients
    d, h = 32, 2
    per_token = 4 * d + 4 * d  # ln_1 and ln_2 outputs
    per_token += 4 * 3 * d  # c_attn output (b*s,3d): q, k, v are views of it, saved by SDPA's flash kernel
    per_token += 4 * d  # SDPA output (b,h,s,hd)
    per_token += 2 * 4 * d  # the two residual sums
    per_token += 4 * 4 * d + 4 * 4 * d  # c_fc output and GELU output
    assert c.alpha == Fraction(per_token, d) == 64
    assert c.beta == 0  # the CPU flash kernel keeps no (b,h,s,s) tensor
    assert c.gamma == 2 * (4 + 4) + 4 * h  # LayerNorm mean/rstd, and the fp32 logsumexp (b,h,s)


def test_llama_grouped_query_attention_alpha_by_hand() -> None:
    torch.manual_seed(0)
    d, h, kv, ffn = 32, 4, 2, 96
    net = llama.build(llama.LlamaConfig(vocab_size=101, dim=d, n_layers=4, n_heads=h, n_kv_heads=kv,
                                        ffn_hidden=ffn, max_seq_len=64))
    c = graphmem.analyze(net, input_shape=(4, 16), loss=llama.loss).coefficients
    per_token = 2 * (4 * d + 4 * d)  # each RMSNorm saves x*rsqrt and its output (two (b,s,d) products)
    per_token += 4 * d  # q after RoPE (b,h,s,hd)
    per_token += 2 * 4 * d  # k and v repeated from kv=2 to h=4 heads: copies of h heads, not kv
    per_token += 4 * d  # SDPA output
    per_token += 2 * 4 * d  # the two residual sums
    per_token += 4 * 4 * ffn  # w1 output, SiLU output, w3 output, their product (b,s,ffn)
    assert c.alpha == Fraction(per_token, d) == 40 + Fraction(16 * ffn, d) == 88
    assert c.beta == 0
    assert c.gamma == 2 * 4 + 4 * h  # the two rsqrt (b,s,1), the logsumexp (b,h,s)
    assert c.n_heads == h


# -- the whole-model polynomial reproduces captures ------------------------------------------------

def _case(name: str) -> tuple[torch.nn.Module, tuple[int, ...], object, list[tuple[int, ...]]]:
    torch.manual_seed(0)
    if name == "gpt2":
        return _gpt("explicit", 0.1), (4, 16), gpt2.loss, [(3, 5), (7, 12), (5, 31), (9, 3), (6, 20)]
    if name == "llama":
        net = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=4, n_heads=4, n_kv_heads=2,
                                            ffn_hidden=64, max_seq_len=64, attention="explicit"))
        return net, (4, 16), llama.loss, [(3, 4), (8, 9), (5, 30), (11, 7), (4, 25)]
    if name == "mlp":
        net = mlp.build(mlp.MLPConfig(in_features=64, hidden=(128, 128), out_features=10, dropout=0.1))
        return net, (4, 64), mlp.loss, [(3, 64), (17, 64), (40, 64), (9, 64), (100, 64)]
    net = resnet.build(resnet.ResNetConfig(width=8))
    return net, (2, 3, 64, 64), resnet.loss, [(3, 3, 32, 96), (4, 3, 96, 64), (5, 3, 128, 32), (3, 3, 160, 160), (6, 3, 64, 32)]


# heavy (CI time, ~40 s): GPT-2, whose block the Llama case's polynomial form covers in CI
@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.heavy), "llama", "mlp", "resnet"])
def test_polynomial_reproduces_captured_bytes_at_five_held_out_points(name: str) -> None:
    net, shape, loss, points = _case(name)
    if name == "resnet" and torch.backends.cpu.get_cpu_capability() == "AVX2":
        # oneDNN's AVX2 kernels change with the feature map's size (a 3x3 kernel taller than the map,
        # 1x1 or 2x2 at 32 or 64 px, runs the gemm convolution and its per-thread weight reduction:
        # graphmem/oprules/conv_gemm.py avx2_gemm_weights; conv_jit.py avx2_jit_applies above): the
        # step's peak is no one polynomial in h and w there, and graphmem says so; saved bytes still are
        c = graphmem.analyze(net, input_shape=shape, loss=loss).coefficients
        for point in points:
            assert c.activation_at(point) == graphmem.analyze(net, input_shape=point, loss=loss).activation_bytes
            with pytest.raises(NotPolynomialError, match="not a polynomial"):
                c.peak_at(point)
        return
    c = graphmem.analyze(net, input_shape=shape, loss=loss).coefficients
    for point in points:
        captured = graphmem.analyze(net, input_shape=point, loss=loss)
        assert c.activation_at(point) == captured.activation_bytes, point
        assert c.peak_at(point) == captured.peak_bytes, point
    if name == "resnet":  # strided convs and pooling round: exact on multiples of 32 only
        assert c.variables == ("b", "h", "w") and c.steps == (1, 32, 32)


def test_not_polynomial_is_said_not_printed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(NotPolynomialError, match="not a polynomial in s"):
        _ = graphmem.analyze(str(HERE / "formula_models" / "pad_to_3.py"), input_shape=(2, 12)).coefficients
    code = main(["formula", str(HERE / "formula_models" / "pad_to_3.py"), "--input-shape", "2x12"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "not a polynomial in s" in err[0] and "no formula" in err[0]


# -- questions: will it fit, sweeps ---------------------------------------------------------------

def test_fit_gpt2_xl_80gib_seq_1024_answer_fits_and_next_does_not() -> None:
    report = graphmem.analyze("gpt2-xl", input_shape=(1, 1024))
    answer = report.fit("80GiB", seq=1024)
    memory = 80 * 2**30
    assert answer.variable == "b" and answer.value >= 1
    # proof by independent captures at the answer and one above
    at = graphmem.analyze("gpt2-xl", input_shape=(answer.value, 1024)).peak_bytes
    above = graphmem.analyze("gpt2-xl", input_shape=(answer.value + 1, 1024)).peak_bytes
    assert at <= memory < above
    assert (answer.peak_at_value, answer.peak_above) == (at, above)


def test_fit_sequence_length_for_a_fixed_batch() -> None:
    net = _gpt("explicit", 0.1)
    report = graphmem.analyze(net, input_shape=(2, 16), loss=gpt2.loss)
    memory = 2_000_000
    answer = report.fit(memory, batch=2)
    assert answer.variable == "s"
    at = graphmem.analyze(net, input_shape=(2, answer.value), loss=gpt2.loss).peak_bytes
    above = graphmem.analyze(net, input_shape=(2, answer.value + 1), loss=gpt2.loss).peak_bytes
    assert at <= memory < above
    # with memory to spare, the model's own limit (block_size 64) bounds the answer, and says so
    limited = report.fit(10**12, batch=2)
    assert (limited.value, limited.captured_above) == (64, None) and "accepts s <= 64" in limited.limit


def test_sweep_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sweep", "models/mlp.py", "--batch", "4,16", "--seq", "784", "--json"]) == 2  # mlp has no seq
    capsys.readouterr()
    model = str(HERE / "formula_models" / "tiny_gpt.py")
    assert main(["sweep", model, "--batch", "1,4,8", "--seq", "8,16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["sweep"]
    assert [(r["batch"], r["seq"]) for r in rows] == [(b, s) for b in (1, 4, 8) for s in (8, 16)]
    for r in rows:  # every row checked here against an independent capture
        cap = graphmem.analyze(model, input_shape=(r["batch"], r["seq"]))
        assert (r["activation_bytes"], r["peak_bytes"]) == (cap.activation_bytes, cap.peak_bytes)
    assert rows[0]["captured_peak_bytes"] == rows[0]["peak_bytes"]  # batch 1 < MIN_SIZE: captured
    assert MIN_SIZE == 3


@pytest.mark.slow
def test_the_sweep_example_of_docs_formulas_md_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/formulas.md's ``graphmem sweep`` line, as written there (it once asked GPT-2 for s = 2048,
    past its block_size), with a grid point beside an independent capture."""
    line = next(ln for ln in (HERE.parent / "docs" / "formulas.md").read_text().splitlines()
                if ln.startswith("graphmem sweep "))
    argv = line.split("#")[0].split()[1:]
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    rows = json.loads(capsys.readouterr().out)["sweep"]
    grid = dict(zip(argv[::2], argv[1::2]))
    assert [(r["batch"], r["seq"]) for r in rows] == [(int(b), int(s)) for b in grid["--batch"].split(",")
                                                      for s in grid["--seq"].split(",")]
    r = rows[-2]  # (32, 512): from the formulas, not captured by the sweep
    cap = graphmem.analyze(argv[1], input_shape=(r["batch"], r["seq"]))
    assert (r["activation_bytes"], r["peak_bytes"]) == (cap.activation_bytes, cap.peak_bytes)


def test_formula_cli_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(HERE / "formula_models" / "tiny_gpt.py")
    assert main(["formula", model, "--input-shape", "4x16"]) == 0
    text = capsys.readouterr().out
    assert "α = 72, β = 12, γ = 16, d_model = 32, n_heads = 2" in text
    assert "per block (transformer.h, 4 blocks)" in text
    assert main(["formula", model, "--input-shape", "4x16", "--json", "--heads", "1"]) == 0
    c = json.loads(capsys.readouterr().out)["coefficients"]
    assert (c["alpha"], c["beta"], c["gamma"], c["d_model"], c["n_heads"], c["blocks"]) == (72, 24, 16, 32, 1, 4)
    assert isinstance(c["activation"], str) and c["activation_terms"]["b*s**2"] == 4 * 24


def test_analyze_formula_flag_adds_the_formula_to_text_json_and_markdown(capsys: pytest.CaptureFixture[str]) -> None:
    model = str(HERE / "formula_models" / "tiny_gpt.py")
    assert main(["analyze", model, "--input-shape", "4x16"]) == 0
    assert "α =" not in capsys.readouterr().out  # only when asked for: it costs captures
    assert main(["analyze", model, "--input-shape", "4x16", "--formula"]) == 0
    assert "α = 72, β = 12, γ = 16" in capsys.readouterr().out
    assert main(["analyze", model, "--input-shape", "4x16", "--formula", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["coefficients"]["alpha"], data["coefficients"]["beta"], data["coefficients"]["blocks"]) == (72, 12, 4)
    assert main(["analyze", model, "--input-shape", "4x16", "--formula", "--format", "markdown"]) == 0
    assert "### Formula" in capsys.readouterr().out


@pytest.mark.slow
def test_formula_cli_per_rank_with_tp(capsys: pytest.CaptureFixture[str]) -> None:
    """--tp/--sp make every number of `graphmem formula` one rank's, as analyze(tp=, sp=) does; --sp alone is a
    one-line usage error."""
    model = str(HERE / "formula_models" / "tiny_gpt.py")
    assert main(["formula", model, "--input-shape", "4x16", "--sp"]) == 2
    assert "add --tp" in capsys.readouterr().err
    assert main(["formula", model, "--input-shape", "4x16", "--tp", "2", "--sp", "--json"]) == 0
    c = json.loads(capsys.readouterr().out)["coefficients"]
    assert c["per_rank"] == "2 ranks, tensor parallel 2 + sequence parallel"
    whole = graphmem.analyze(model, input_shape=(4, 16)).coefficients
    assert Fraction(c["alpha"]) == whole.alpha / 2 and Fraction(c["beta"]) == whole.beta / 2  # every tensor of the block split
