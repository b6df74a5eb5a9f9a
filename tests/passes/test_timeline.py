"""The category timeline pass: on the hand-built step of test_passes.py (exact bytes), and its
invariants on real models."""
from __future__ import annotations

import pytest
import torch
from test_passes import SAVES, STORAGES, _graph

import graphmem
from graphmem.models.gpt2 import GPT, GPTConfig
from graphmem.passes import liveness, saved
from graphmem.passes.timeline import CATEGORIES, category_timeline


def test_category_timeline_by_hand() -> None:
    # GIVEN the 6-op step of test_passes.py: P param 100 B and X input 40 B before the step,
    # A 1000 B (ops 0-5, saved), B 500 B (op 1, temporary), C 300 B (ops 2-4, saved twice),
    # G 100 B (the gradient, ops 4-5), T 2000 B (op 5, temporary); X is saved too.
    g = _graph(STORAGES, SAVES, 6, {"forward": 0, "loss": 3, "backward": 4})
    lv = liveness(g)
    # WHEN the timeline is split by category
    tl = category_timeline(g, lv, saved(g).tensors)
    # THEN every op's bytes are where they belong
    assert tl.by_category == {
        "parameters": (100, 100, 100, 100, 100, 100),  # P
        "gradients": (0, 0, 0, 0, 100, 100),  # G from op 4
        "optimizer": (0, 0, 0, 0, 0, 0),  # no optimizer step traced
        "activations": (1040, 1040, 1340, 1340, 1340, 1040),  # A + X, and C during ops 2-4
        "communication": (0, 0, 0, 0, 0, 0),  # no collectives (graphmem/distributed/)
        "workspace": (0, 0, 0, 0, 0, 0),  # no kernel scratch
        "other": (0, 500, 0, 0, 0, 2000),  # B at op 1, T at op 5
    }
    assert tl.category_of == {0: "parameters", 1: "activations", 2: "activations", 3: "other", 4: "activations",
                              5: "gradients", 6: "other"}
    # AND the categories add up to the liveness timeline
    assert tuple(map(sum, zip(*tl.by_category.values()))) == lv.timeline == (1140, 1640, 1440, 1440, 1540, 3240)
    assert tl.at(5) == {"parameters": 100, "gradients": 100, "optimizer": 0, "activations": 1040, "communication": 0,
                        "workspace": 0, "other": 2000}


def test_unsaved_input_is_other() -> None:
    g = _graph(STORAGES, SAVES[:-1], 6, {"forward": 0, "loss": 3, "backward": 4})  # X no longer saved
    tl = category_timeline(g, liveness(g), saved(g).tensors)
    assert tl.by_category["activations"] == (1000, 1000, 1300, 1300, 1300, 1000)
    assert tl.by_category["other"] == (40, 540, 40, 40, 40, 2040)


@pytest.mark.parametrize("attention", ["explicit", "sdpa"])
def test_category_timeline_invariants_on_gpt(attention: str) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=101, block_size=32, n_layer=2, n_head=2, n_embd=32, attention=attention)
    r = graphmem.analyze(GPT(cfg), input_shape=(2, 16))
    assert r.step is not None and r.liveness is not None
    tl = category_timeline(r.step, r.liveness, r.saved)
    assert tuple(tl.by_category) == CATEGORIES
    assert tuple(map(sum, zip(*tl.by_category.values()))) == r.liveness.timeline
    # just before backward everything saved is still held: the band is exactly activation_bytes
    assert tl.by_category["activations"][r.phase_start["backward"] - 1] == r.activation_bytes
    # parameters and buffers never change; the gradients end as the parameters' .grad
    assert set(tl.by_category["parameters"]) == {r.parameter_bytes + r.buffer_bytes}
    assert tl.by_category["gradients"][-1] == r.gradient_bytes == r.parameter_bytes
    assert tl.by_category["gradients"][r.phase_start["backward"] - 1] == 0
