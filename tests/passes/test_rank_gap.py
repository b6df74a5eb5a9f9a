"""The gap between rank r's real peak and the per-rank formula, by cause (passes/rank_gap.py): each
cause's bytes are computed here independently, from the model's parameter shapes and the batch."""
from __future__ import annotations

import math

import torch
import torch.nn as nn

import graphmem
from graphmem.models import llama

B, S, DIM, L = 2, 16, 32, 3


def _llama(vocab: int) -> tuple[nn.Module, tuple]:
    model = llama.build(llama.LlamaConfig(vocab_size=vocab, dim=DIM, n_layers=L, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                          max_seq_len=32))
    return model, (torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(1)),)


def _padded_shard(p: torch.Tensor, world: int) -> int:
    """FSDP2's shard of ``p`` on one rank: dim 0 padded to a multiple of the world (_fsdp_param.py)."""
    return math.ceil(p.shape[0] / world) * (p.numel() // p.shape[0]) * p.element_size()


def _unit_params(model: nn.Module, unit: str) -> list[torch.Tensor]:
    if unit == "the root":
        return [p for name, p in model.named_parameters() if not name.startswith("layers.")]
    return list(model.get_submodule(unit).parameters())


def test_fsdp2_gap_by_cause() -> None:
    # GIVEN FSDP2 over 4 ranks on a 3-block Llama, rank 1, peaking in the backward of the last block
    world = 4
    model, x = _llama(101)
    r = graphmem.analyze(model, x, loss=llama.loss, world_size=world, rank=1, fsdp="fully_shard")
    gap = r.sharding.breakdown
    causes = {c.key: c for c in gap.causes}
    # THEN the causes add up to the gap between the two peaks
    assert gap.real_peak == r.peak_bytes and gap.formula_peak == r.sharding.formula_peak
    assert sum(c.delta for c in gap.causes) == gap.gap == r.sharding.gap > 0
    assert gap.peak_unit == "layers.2"
    # the parameter shards: FSDP2's padded chunks against the formula's exact 1/world
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    params = list(model.parameters())
    assert causes["parameters"].real == sum(_padded_shard(p, world) for p in params) + buffers
    assert causes["parameters"].formula == math.ceil(sum(p.numel() * p.element_size() for p in params) / world) + buffers
    assert causes["parameters"].delta > 0 and "pads dim 0" in causes["parameters"].why
    # the next block's all-gather, prefetched while layers.2 runs backward: world x its padded shards
    assert causes["all-gather buffers"].units == (
        ("layers.1", "prefetched", world * sum(_padded_shard(p, world) for p in _unit_params(model, "layers.1"))),)
    assert causes["all-gather buffers"].formula == 0
    # the gathered (unsharded, padded) parameters of the running block and of the root
    gathered = {(u, role): b for u, role, b in causes["gathered"].units}
    assert gathered == {(u, role): world * sum(_padded_shard(p, world) for p in _unit_params(model, u))
                        for u, role in (("layers.2", "running"), ("the root", "root"))}
    # and the gradients FSDP2 holds whole until the unit's reduce-scatter: the root's output weight's
    output = model.output.weight
    assert ("mm.default", "output", output.numel() * output.element_size()) in \
        {(n.removeprefix("aten."), m, b) for n, m, b in causes["unsharded gradients"].largest}
    # rendered, largest difference first, in the report's notes and its JSON
    notes = r.notes[r.notes.index(next(n for n in r.notes if n.startswith("the gap by cause"))) + 1:]
    deltas = [c.delta for c in sorted((c for c in gap.causes if c.delta), key=lambda c: -abs(c.delta))]
    assert len(notes) == len(deltas) and notes[0].startswith(f"  {sorted(gap.causes, key=lambda c: -abs(c.delta))[0].key}:")
    assert any("layers.1 (prefetched)" in n for n in notes)
    assert r.to_dict()["sharding"]["gap_by_cause"]["gap_bytes"] == gap.gap


def test_sequence_parallel_gap_by_cause() -> None:
    # GIVEN TP 2 + sequence parallel on a 3-block Llama whose logits dominate: the peak is in the loss's
    # backward, where every block still holds what it saved
    model, x = _llama(1000)
    r = graphmem.analyze(model, x, loss=llama.loss, world_size=2, rank=0, tp=2, sp=True)
    gap = r.sharding.breakdown
    causes = {c.key: c for c in gap.causes}
    assert sum(c.delta for c in gap.causes) == gap.gap > 0 and gap.peak_unit == ""
    # THEN the saved all-gathered inputs are each block's attention and FFN input and the output
    # linear's, whole-sequence (b, s, dim) fp32: (2L + 1) of them
    assert gap.sp_gathered == (2 * L + 1) * B * S * DIM * 4
    assert "all-gathered block inputs" in next(n for n in r.notes if n.startswith("  activations"))
    # the logits, all-gathered over the vocabulary (no loss parallel): (b, s, vocab) fp32, not saved
    assert causes["redistribute outputs"].largest[0][2] == B * S * 1000 * 4
    # the embedding is vocabulary-parallel on the rank, whole in the formula: half of it less
    assert causes["parameters"].delta == -model.tok_embeddings.weight.numel() * 4 // 2


def test_later_steps_gap_by_cause() -> None:
    # GIVEN FSDP2 over 4 ranks with AdamW: a later step holds the optimizer states from its start
    world = 4
    model, x = _llama(101)
    r = graphmem.analyze(model, x, loss=llama.loss, world_size=world, rank=1, fsdp="fully_shard", optimizer="adamw")
    gap = r.sharding.later_breakdown
    causes = {c.key: c for c in gap.causes}
    # THEN the later steps' causes add up to the later steps' gap, each side at its own later peak
    assert gap.real_peak == r.sharding.later_peak == r.budget.rank.later_peak_bytes
    assert gap.formula_peak == r.sharding.formula_later
    assert sum(c.delta for c in gap.causes) == gap.gap == r.sharding.later_peak - r.sharding.formula_later > 0
    # the optimizer states: AdamW's two moments of FSDP2's padded shards and a 4-byte step per parameter, against
    # the formula's exact 1/world of the moments (computed here from the parameter shapes)
    params = list(model.parameters())
    assert causes["optimizer states"].real == 2 * sum(_padded_shard(p, world) for p in params) + 4 * len(params)
    assert causes["optimizer states"].formula == math.ceil(2 * sum(p.numel() * 4 for p in params) / world) + 4 * len(params)
    # rendered after the first step's, and in JSON
    assert any(n.startswith("the later steps' gap by cause") for n in r.notes)
    assert r.to_dict()["sharding"]["later_gap_by_cause"]["gap_bytes"] == gap.gap
