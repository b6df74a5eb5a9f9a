"""Per-rank budgets (passes/budget.py) against the papers' formulas.

ZeRO (Rajbhandari et al. 2020, Figure 1, K = 12 for mixed-precision Adam): per rank,
baseline DP (2 + 2 + K)Psi, P_os (2 + 2 + K/N)Psi, P_os+g (2 + (2 + K)/N)Psi,
P_os+g+p (2 + 2 + K)Psi/N. Tensor/sequence parallelism (Korthikanti et al. 2022, Table 2):
activations per layer of a pre-LN GPT block in 16-bit with dropout and explicit softmax
attention: sbh(34 + 5as/h) without parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor
parallelism, sbh/t (34 + 5as/h) with tensor and sequence parallelism.
"""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.capture.capture import capture
from graphmem.capture.target import make_target
from graphmem.models import gpt2
from graphmem.passes import liveness, saved
from graphmem.passes.budget import budget, make_parallel
from graphmem.passes.tensor_parallel import tp_marks

N = 4
K = 12


TINY = "tests/formula_models/tiny_gpt.py"  # 4 blocks, explicit attention and dropout


def _recipe(**parallel: object) -> graphmem.Report:
    # 16-psi recipe: bf16 parameters and gradients, fp32 master, Adam's fp32 momentum and variance
    return graphmem.analyze(TINY, input_shape=(2, 8), optimizer="adam", dtype="bf16", master_weights=True, **parallel)


def _model_states(r: graphmem.Report) -> int:
    b = r.budget.rank
    return b.model_state_bytes - b.step_counter_bytes  # Adam's scalar step counters are replicated


@pytest.mark.parametrize("options,formula", [
    ({}, lambda psi: (2 + 2 + K) * psi),
    ({"zero": 1}, lambda psi: (2 + 2) * psi + Fraction(K, N) * psi),
    ({"zero": 2}, lambda psi: 2 * psi + Fraction(2 + K, N) * psi),
    ({"zero": 3}, lambda psi: Fraction(2 + 2 + K, N) * psi),
    ({"fsdp": "full"}, lambda psi: Fraction(2 + 2 + K, N) * psi),
    ({"fsdp": "grad-op"}, lambda psi: Fraction(2 + 2 + K, N) * psi),  # sharded between steps too (see below)
])
def test_zero_model_states_per_rank_follow_the_paper(options: dict, formula: object) -> None:
    r = _recipe(world_size=N, **options) if options else _recipe()
    psi = r.budget.rank.parameters
    assert psi % N == 0
    assert _model_states(r) == formula(psi)  # type: ignore[operator]
    assert r.budget.rank.step_counter_bytes == 4 * len(r.step.gradients)


def test_zero3_gathers_one_block_at_a_time() -> None:
    r = _recipe(world_size=N, zero=3)
    b = r.budget.rank
    blocks = r.budget.rank.largest_unit
    assert blocks.startswith("transformer.h.")
    params = {s.name: s.nbytes for s in r.step.storages.values() if s.kind == "parameter"}
    unit = sum(v for k, v in params.items() if k.startswith(blocks + "."))
    root = sum(v for k, v in params.items() if not k.startswith("transformer.h."))
    assert b.gather_bytes == (unit + root) * (N - 1) // N  # the rest of the unit's and the root's shards
    assert b.peak_bytes < r.budget.single.peak_bytes


def test_fsdp_grad_op_holds_every_gathered_unit_from_forward_to_backward() -> None:
    full, grad_op = _recipe(world_size=N, fsdp="full"), _recipe(world_size=N, fsdp="grad-op")
    g = grad_op.step
    blocks = sum(s.nbytes for s in g.storages.values() if s.kind == "parameter" and s.name.startswith("transformer.h."))
    turn = g.phase_start["backward"]  # the loss's backward (root unit): every block's forward done, no backward yet
    gathered = grad_op.budget.rank.timeline[turn] - full.budget.rank.timeline[turn]
    assert gathered == blocks * (N - 1) // N  # grad-op still holds every block gathered; full resharded them
    assert grad_op.budget.rank.later_peak_bytes > full.budget.rank.later_peak_bytes


def test_zero_peak_shrinks_with_the_stage() -> None:
    peaks = [_recipe(world_size=N, zero=z).budget.rank.later_peak_bytes for z in (1, 2, 3)]
    assert _recipe().budget.rank.later_peak_bytes > peaks[0] > peaks[1] > peaks[2]


B, S, H, A = 2, 16, 32, 4  # batch, sequence, hidden, heads


def _block() -> tuple:
    cfg = gpt2.GPTConfig(vocab_size=101, block_size=S, n_layer=1, n_head=A, n_embd=H, dropout=0.1, attention="explicit")
    with torch.device("meta"):
        blk = gpt2.Block(cfg)
    g = capture(blk, (torch.empty(B, S, H, device="meta", requires_grad=True),), None, make_target("cuda", dtype="fp16"))
    return g, liveness(g), saved(g)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (4, False), (2, True), (4, True)])
def test_tensor_and_sequence_parallel_activations_follow_korthikanti_table_2(t: int, sp: bool) -> None:
    g, lv, sv = _block()
    b = budget(g, lv, sv, make_parallel(t, tp=t, sp=sp))
    sbh, as2b = S * B * H, A * S * S * B
    if t == 1:
        table = Fraction(34 * sbh + 5 * as2b)
    elif not sp:
        table = sbh * (10 + Fraction(24, t) + Fraction(5 * A * S, H * t))
    else:
        table = Fraction(sbh, t) * (34 + Fraction(5 * A * S, H))
    # beyond the table, read off the graph: two LayerNorms' mean and rstd, (b, s, 1) each, in fp32
    # as CUDA's kernel keeps them (DESIGN.md: +16 B per token; sequence-split with sp), and the
    # causal mask (s, s) bool sliced from a buffer (no batch or sequence split: replicated)
    stats = sum(x.bytes for x in sv.tensors if x.op == "aten.native_layer_norm.default" and x.shape == (B, S, 1))
    assert stats == 2 * 2 * B * S * 4
    mask = S * S
    assert b.row("activations").size == table + (Fraction(stats, t) if sp else stats) + mask
    assert b.tp_split == ((2, 2) if t > 1 else (0, 0))  # c_attn, c_fc column-parallel; c_proj twice row-parallel


def test_tensor_parallel_splits_the_linear_weights_and_their_states() -> None:
    r = graphmem.analyze(TINY, input_shape=(2, 8), optimizer="adam", world_size=2, tp=2)
    g = r.step
    marks = tp_marks(g)
    split = {g.storages[w].name for w in marks.weights}
    assert "transformer.h.0.attn.c_attn.weight" in split and "transformer.h.0.attn.c_attn.bias" in split
    assert "transformer.h.0.attn.c_proj.weight" in split and "transformer.h.0.attn.c_proj.bias" not in split  # row bias whole
    assert "transformer.h.0.ln_1.weight" not in split
    assert "transformer.wte.weight" in split  # lm_head (tied with wte): a vocab-parallel output layer
    size = {s.sid: s.nbytes for s in g.storages.values() if s.kind == "parameter"}
    expected = sum(v // 2 if sid in marks.weights else v for sid, v in size.items())
    assert r.budget.row("parameters").size == expected
    assert r.budget.rank.states_by_name["exp_avg"] == expected  # fp32 states follow their weights
    assert r.budget.rank.states_by_name["step"] == 4 * len(g.gradients)  # scalar step counters stay whole


class Chainless(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_a_model_without_a_block_chain_is_one_unit() -> None:
    r = graphmem.analyze(Chainless(), (torch.randn(4, 8),), optimizer="sgd", world_size=2, zero=3)
    b = r.budget.rank
    assert b.largest_unit == "" and b.gather_bytes == r.parameter_bytes // 2
