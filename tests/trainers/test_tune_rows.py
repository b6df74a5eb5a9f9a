"""benchmarks/tune_rows.py's five rows (torchtune's optimization flags, each added to the one before) and its
chunked loss, on a tiny transformers Llama on the CPU target against the same steps run for real
(graphmem/validation/measure.py): the 3B rows themselves are predictions only (docs/loop.md), so the loop
they run is held here at a size a real CPU step can take. Saved bytes, host bytes and the peaks exact (the
12 B the first steps once read were the eager Adam step's and the bitsandbytes kernels' Python floats made
tensors: graphmem/capture/wrapped_numbers.py, graphmem/oprules/bnb.py).
"""
from __future__ import annotations

import sys
from typing import Any

import pytest
import torch
from paths import ROOT

import graphmem
from graphmem.training.loop import make_train_step
from graphmem.validation.measure import measure_peak

sys.path.insert(0, str(ROOT / "benchmarks"))
import tune_rows  # noqa: E402

transformers = pytest.importorskip("transformers")


def _model(checkpoint: bool, chunked: bool) -> tuple[torch.nn.Module, Any, Any]:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=True)
    lm = transformers.LlamaForCausalLM(cfg)
    if checkpoint:
        lm.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 4096, (2, 16))
    if chunked:
        return tune_rows.ChunkedOutput(lm), (ids,), tune_rows.chunked_loss
    return lm, {"input_ids": ids, "labels": ids}, None


@pytest.mark.slow
@pytest.mark.parametrize("chunked", [False, True], ids=["hf-loss", "chunked-loss"])
@pytest.mark.parametrize("row", range(len(tune_rows.ROWS)), ids=[r[0] for r in tune_rows.ROWS])
def test_each_row_matches_a_real_step(row: int, chunked: bool) -> None:
    # GIVEN the row's options (release_output as the recipe's `del logits`) on a tiny tied-embedding Llama
    if tune_rows.ROWS[row][1]["optimizer"] == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    _, options, checkpoint = tune_rows.ROWS[row]
    model, inputs, loss = _model(checkpoint, chunked)
    # WHEN analyzed and WHEN run for real, first step and a later one
    report = graphmem.analyze(model, inputs, loss=loss, release_output=True, **options)
    assert report.budget is not None
    b = report.budget.rank
    train = make_train_step(release_output=True, **options)
    first = measure_peak(model, inputs, loss, train=train)
    later = measure_peak(model, inputs, loss, train=train, warm_steps=1)
    # THEN the saved set, the host copies and the states are the real ones, and the peaks are within tolerance
    assert report.activation_bytes == first.saved_bytes
    assert report.budget.host_bytes == first.host_bytes
    assert b.row("optimizer states").size == first.state_bytes == later.state_bytes
    for predicted, real in ((b.peak_bytes, first.peak_bytes), (b.later_peak_bytes, later.peak_bytes)):
        assert predicted == real, (predicted, real)
