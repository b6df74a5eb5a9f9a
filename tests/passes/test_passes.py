"""The passes on hand-built StepGraphs with exact byte counts (no torch run involved)."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from graphmem.errors import PassError
from graphmem.passes import liveness, saved
from graphmem.stepgraph import SaveEvent, StepGraph, Storage


def _graph(storages: list[Storage], saves: list[SaveEvent], n_ops: int, phases: dict[str, int]) -> StepGraph:
    g = fx.Graph()
    ops = []
    for i in range(n_ops):
        node = g.create_node("call_function", torch.ops.aten.relu.default, (), {})
        made = [s for s in storages if s.created == i]
        phase = max(((start, p) for p, start in phases.items() if start <= i), default=(0, "forward"))[1]
        node.meta.update(index=i, phase=phase, module="m", bytes=sum(s.nbytes for s in made),
                         outputs=tuple((s.shape, torch.float32, s.sid) for s in made))
        ops.append(node)
    return StepGraph(g, ops, {s.sid: s for s in storages}, saves, {**phases, "end": n_ops}, "cpu",
                     modules=["", "m", "m.a"])


def _s(sid: int, nbytes: int, kind: str, created: int, freed: int | None, module: str = "m") -> Storage:
    return Storage(sid, nbytes, kind, created, freed, module, f"s{sid}", "float32", (nbytes // 4,))


# A 6-op step: forward 0-2, loss 3, backward 4-5.
#   param P (100 B) and input X (40 B) exist before; A (1000 B, op 0, saved, freed after op 5);
#   B (500 B, op 1, temporary, freed after op 1); C (300 B, op 2, saved twice, freed after 4);
#   G (100 B, op 4, the gradient, alive at the end); T (2000 B, op 5, freed after op 5).
STORAGES = [_s(0, 100, "parameter", -1, None, ""), _s(1, 40, "input", -1, None, ""),
            _s(2, 1000, "activation", 0, 5, "m.a"), _s(3, 500, "activation", 1, 1),
            _s(4, 300, "activation", 2, 4), _s(5, 100, "gradient", 4, None), _s(6, 2000, "activation", 5, 5)]
SAVES = [SaveEvent(2, 0, 5, "m.a", "forward", (250,), "float32", "ReluBackward0"),
         SaveEvent(4, 2, 4, "m", "forward", (75,), "float32", "MulBackward0"),
         SaveEvent(4, 2, 3, "m", "forward", (75,), "float32", "AddBackward0"),
         SaveEvent(0, 2, 4, "m", "forward", (25,), "float32", "MmBackward0"),
         SaveEvent(1, 0, 5, "m.a", "forward", (10,), "float32", "ReluBackward0")]


def test_liveness_timeline_and_peak_by_hand() -> None:
    g = _graph(STORAGES, SAVES, 6, {"forward": 0, "loss": 3, "backward": 4})
    g.check()
    lv = liveness(g)
    base = 100 + 40
    assert lv.baseline_bytes == base
    assert lv.timeline == (base + 1000, base + 1000 + 500, base + 1000 + 300, base + 1000 + 300,
                           base + 1000 + 300 + 100, base + 1000 + 100 + 2000)
    assert lv.peak_bytes == 3240 and lv.peak_index == 5 and lv.peak_phase == "backward"
    assert [t.sid for t in lv.live_at_peak] == [6, 2, 0, 5, 1]  # largest first
    assert lv.end_bytes == 100 + 40 + 100


def test_saved_dedup_categories_lifetimes_modules_by_hand() -> None:
    sv = saved(_graph(STORAGES, SAVES, 6, {"forward": 0, "loss": 3, "backward": 4}))
    # C is saved twice and counted once; the parameter is saved but not counted
    assert sv.activation_bytes == 1000 + 300 + 40
    assert sv.parameter_bytes_saved == 100
    assert sv.by_category == {"activation": 1300, "input": 40, "autocast copy": 0, "workspace": 0, "other": 0}
    c = next(t for t in sv.tensors if t.sid == 4)
    assert (c.created, c.released, c.saved_by) == (2, 4, ("MulBackward0", "AddBackward0"))
    modules = {m.path: m for m in sv.modules}
    assert modules[""].activation_bytes == 1340
    assert modules["m"].activation_bytes == 1340 and modules["m"].self_bytes == 300
    assert modules["m.a"].activation_bytes == 1040  # A, and the input first saved in m.a


def test_unreleased_save_has_no_release() -> None:
    saves = SAVES[:1] + [SaveEvent(2, 0, None, "m.a", "forward", (250,), "float32", "")]
    sv = saved(_graph(STORAGES, saves, 6, {"forward": 0, "loss": 3, "backward": 4}))
    assert next(t for t in sv.tensors if t.sid == 2).released is None


def test_backward_saves_are_not_activations() -> None:
    saves = [SaveEvent(5, 4, None, "m", "backward", (25,), "float32", "")]
    assert saved(_graph(STORAGES, saves, 6, {"forward": 0, "loss": 3, "backward": 4})).activation_bytes == 0


def test_autocast_copy_category() -> None:
    copy = Storage(7, 50, "activation", 1, 3, "m", "aten._to_copy.default", "bfloat16", (25,), source=0)
    sv = saved(_graph(STORAGES + [copy], [SaveEvent(7, 1, 3, "m", "forward", (25,), "bfloat16", "")], 6,
                      {"forward": 0, "loss": 3, "backward": 4}))
    assert sv.by_category["autocast copy"] == 50


def test_check_rejects_freed_before_created() -> None:
    bad = STORAGES + [_s(7, 8, "activation", 3, 1)]
    with pytest.raises(PassError, match="freed at 1 before created at 3"):
        _graph(bad, SAVES, 6, {"forward": 0, "loss": 3, "backward": 4}).check()


def test_check_rejects_unknown_saved_storage() -> None:
    with pytest.raises(PassError, match="unknown storage 99"):
        _graph(STORAGES, [SaveEvent(99, 0, 1, "m", "forward", (1,), "float32")], 6,
               {"forward": 0, "loss": 3, "backward": 4}).check()


def test_stepgraph_is_an_fx_graph_of_every_op() -> None:
    import graphmem

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU())
    g = graphmem.analyze(net, (torch.randn(4, 8),)).step
    g.check()
    calls = [n for n in g.graph.nodes if n.op == "call_function" and "index" in n.meta]
    assert len(calls) == g.num_ops
    assert [n.meta["index"] for n in calls] == list(range(g.num_ops))
    assert {n.meta["phase"] for n in calls} == {"forward", "loss", "backward"}
    ln = next(n for n in calls if n.target is torch.ops.aten.native_layer_norm.default)
    assert ln.meta["module"] == "1" and ln.meta["shape"] == (4, 16) and ln.meta["bytes"] == 4 * 16 * 4 + 2 * 4 * 4
    # the multi-output op's outputs are used through getitem nodes
    assert any(u.target.__name__ == "getitem" for u in ln.users)
    placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
    assert [n.meta["kind"] for n in placeholders] == ["parameter"] * 4 + ["input"]
    g.graph.lint()
