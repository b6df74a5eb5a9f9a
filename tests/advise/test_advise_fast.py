"""What advise no longer captures twice changes none of its answers: each checkpoint plan's capture is kept
per report (graphmem/planning/figures.py ``plan_memory``: the lowest-peak plan is asked again after no plan
fits; the planner's verifier keeps its lowest-peak plan's), and the advice is the same, row for row, as when
every plan is captured each time it is asked; the FSDP2 rows capture the single-device step beside rank 0's
once (graphmem/step/measure.py ``single_steps_once``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import pytest
from cases import MODELS, build

import graphmem
import graphmem.planning.figures as figures
import graphmem.planning.verify as verify
import graphmem.step.measure as measure
from graphmem.distributed.spec import Sharding
from graphmem.step.recapture import Recapture
from graphmem.step.spec import Ranks


class _NoMemo(dict[Any, Any]):
    """Every plan captured each time it is asked (what plan_memory did before it kept them): a memo that keeps none."""

    def __setitem__(self, key: Any, value: Any) -> None:
        pass


def _forgetting(m: pytest.MonkeyPatch) -> None:
    """Every report's source made from now on keeps no plan's run memory (``Recapture.plan_memories``)."""
    init = Recapture.__init__

    def forgetful(self: Recapture, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.plan_memories = _NoMemo()

    m.setattr(Recapture, "__init__", forgetful)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    capture = Recapture.capture

    def spy(self: Recapture, shape: Any = None) -> Any:
        calls.append(1)
        return capture(self, shape)

    monkeypatch.setattr(Recapture, "capture", spy)
    return calls


def _report() -> Any:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    return graphmem.analyze(module, inputs, loss=loss, device="cuda", optimizer="adamw")


def test_a_plan_is_captured_once_per_report(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a report and its planner's lowest-peak plan (its verifier captured it)
    report = _report()
    plan = report.plan(max_overhead=1.0)
    calls = _counting(monkeypatch)
    # WHEN the plan's run memory is asked twice, and once more with nothing kept
    first, again = figures.plan_memory(report, plan), figures.plan_memory(report, plan)
    kept = len(calls)
    monkeypatch.setattr(report.source, "plan_memories", _NoMemo())
    fresh = figures.plan_memory(report, plan)
    # THEN the first two took the verifier's capture, and they are a fresh capture's
    assert kept == 0 and len(calls) == 1
    assert first == again == fresh


@pytest.mark.slow  # every lever of a small GPT-2 captured twice (~90 s)
@pytest.mark.heavy  # (CI time) the quick test above holds a kept plan capture equal to a fresh one
def test_advice_is_the_same_when_each_plan_is_captured_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a GPT-2 step with AdamW on the CUDA target, in memory above its lowest-peak plan's tensors but
    # below that plan's device total: plan_within captures the plan, finds it over, and advise asks for it again
    probe = _report()
    lowest = probe.plan(max_overhead=1.0)
    memory = (lowest.peak_bytes + figures.plan_memory(probe, lowest).figure("device")) // 2
    calls = _counting(monkeypatch)
    # WHEN it is advised with every plan captured each time it is asked, then with each plan's capture kept
    with monkeypatch.context() as m:
        _forgetting(m)
        before = _report().advise(memory=memory)
    captured_before = len(calls)
    after = _report().advise(memory=memory)
    # THEN the advice is the same, row for row, with one capture fewer at least
    assert any(r.kind == "checkpoint" for r in (*before.levers, *before.left_out))  # (weighed: a row or why not)
    assert before.to_dict() == after.to_dict()
    assert len(calls) - captured_before <= captured_before - 1


def test_a_plan_whose_policy_is_unhashable_is_captured_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a plan whose policies cannot be a key (a selective policy may hold a list)
    report = _report()
    plan = report.plan(max_overhead=1.0)
    unhashable = dataclasses.replace(plan, policies=[[]] * len(plan.policies) if plan.policies else [[]])
    monkeypatch.setattr(verify, "apply_segments", lambda *a, **k: contextlib.nullcontext())
    calls = _counting(monkeypatch)
    # WHEN its run memory is asked twice: THEN each is captured, and neither fails on the memo
    first, again = figures.plan_memory(report, unhashable), figures.plan_memory(report, unhashable)
    assert len(calls) == 2 and first == again


def test_the_fsdp2_rows_capture_the_single_device_step_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a report's step as FSDP2's rank 0 of 2, resharded after forward and not (advise's two rows)
    report = _report()
    specs = [report.source.spec.replace(parallel=Ranks(Sharding(2, 0, fsdp=True, reshard_after_forward=r)))
             for r in (True, False)]
    singles: list[int] = []
    step_graph = measure.step_graph
    monkeypatch.setattr(measure, "step_graph", lambda *a, **k: singles.append(1) or step_graph(*a, **k))
    # WHEN both are measured within single_steps_once, then each without
    with measure.single_steps_once():
        shared = [measure.measure(s) for s in specs]
    once = len(singles)
    apart = [measure.measure(s) for s in specs]
    # THEN the single-device step beside rank 0's was captured once, not twice, and the rows are the same
    assert once == 1 and len(singles) == 3
    assert [m.notes for m in shared] == [m.notes for m in apart]
    assert [m.scope for m in shared] == [m.scope for m in apart]


@pytest.mark.slow  # a 16-layer Llama's advice twice (~150 s)
@pytest.mark.heavy  # (CI time) tests/capture/test_reuse_units.py holds each widened plan equal to its whole capture
def test_advice_is_the_same_with_plans_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN transformers' Llama, 16 layers, LoRA, AdamW on the CUDA target: its chain's pieces do not compose (the
    # KV cache), so the planner's verifier captures up to 10 plans, some of them with a long run of alike segments
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=16,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

    def advice() -> Any:
        import torch

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        report = graphmem.analyze(model, input_shape="1x256", device="cuda", optimizer="adamw", lora_rank=4,
                                  lora_targets="all-linear")
        return report.advise("1MiB", figure="allocated")

    widened: list[bool] = []
    plan_graph = verify.plan_graph
    monkeypatch.setattr(verify, "plan_graph", lambda *a, **k: widened.append((r := plan_graph(*a, **k)).used) or r)
    # WHEN it is advised with plans widened where they repeat, then with every plan captured whole
    after = advice()
    with monkeypatch.context() as m:
        m.setattr(verify, "capture_units", lambda model, chain, sizes, kinds, at: verify.Reused(at(), False, "off"))
        before = advice()
    # THEN some plans were widened, and the advice is the same, row for row
    assert any(widened)
    assert before.to_dict() == after.to_dict()
