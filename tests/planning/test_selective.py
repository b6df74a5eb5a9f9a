"""Selective (op-level) checkpointing: the knapsack is exact, the program over segments that
each run plainly checkpointed or under a selective level equals brute force, and on real
models a selective plan's predicted peak equals its re-captured peak to the byte and a real
CPU run within the ground-truth tolerance, with the policy really installed."""
from __future__ import annotations

import itertools
import json
import random

import pytest
import torch
from random_chains import _stage, piece
from test_checkpoint_plans import LM_TOLERANCE, MODELS

import graphmem
from graphmem.capture.capture import capture
from graphmem.errors import PassError, UsageError
from graphmem.passes import liveness
from graphmem.passes.checkpoint import ChainCosts
from graphmem.passes.checkpoint import optimal as plain_optimal
from graphmem.passes.selective import (
    Modes,
    all_modal_plans,
    brute_force,
    evaluate_modes,
    every_block,
    knapsack,
    levels,
    modal_frontier,
    modal_minimum_peak,
    optimal,
)
from graphmem.planning.apply import apply_segments
from graphmem.planning.planner import op_flops
from graphmem.planning.selective import OpPolicy, block_ops
from graphmem.validation.measure import measure_peak


# -- the pure parts ----------------------------------------------------------------------------------
def rand_modes(r: random.Random, n: int, count: int) -> Modes:
    """A random chain with ``count`` ways to run a checkpointed segment: the stored pieces and
    the pieces around the chain are shared, each way has its own forward nets and highs."""
    shape = [(r.randint(100, 1000), r.randint(0, 300)) for _ in range(n)]  # stored fwd net A, net h
    fixed = (r.randint(0, 1000), piece(r, r.randint(0, 100)), piece(r, r.randint(-50, 100)),
             piece(r, r.randint(-100, 0)))
    out: list[ChainCosts] = []
    for _ in range(count):
        w = [r.randint(-100, 100) for _ in range(n + 1)]
        st = [_stage(r, i, A, h, r.randint(10, 120), r.randint(-60, 60), w[i], w[i + 1])
              for i, (A, h) in enumerate(shape)]
        if out:  # stored blocks run alike in every way
            st = [type(s)(**{**s.__dict__, "fwd": s0.fwd, "bwd": s0.bwd, "flops": s0.flops})
                  for s, s0 in zip(st, out[0].stages)]
        out.append(ChainCosts(tuple(st), *fixed))
    return Modes(tuple(out))


def test_knapsack_is_every_pareto_subset() -> None:
    r = random.Random(0)
    for _ in range(20):
        items = [(r.randint(0, 50), r.randint(0, 40)) for _ in range(r.randint(0, 8))]
        front = knapsack(items)
        every = [(sum(items[i][0] for i in s), sum(items[i][1] for i in s))
                 for k in range(len(items) + 1) for s in itertools.combinations(range(len(items)), k)]
        for cap in {0, *(w for w, _ in every)}:  # the front's best within any cap is the true best
            assert max(f for b, f, _ in front if b <= cap) == max(f for b, f in every if b <= cap)
        for b, f, s in front:
            assert (b, f) == (sum(items[i][0] for i in s), sum(items[i][1] for i in s))
        assert [b for b, _, _ in front] == sorted(b for b, _, _ in front)


def test_levels_end_with_every_item_worth_keeping() -> None:
    items = [(40, 10), (10, 50), (0, 0), (30, 30)]
    got = levels(items, 3)
    assert got[-1] == frozenset({0, 1, 3}) and all(got)  # an item that saves no FLOPs is never kept
    assert levels(items, 1) == [frozenset({0, 1, 3})]
    with pytest.raises(PassError):
        levels(items, 0)


@pytest.mark.parametrize("seed", range(8))
def test_program_with_levels_equals_brute_force(seed: int) -> None:
    # GIVEN a random chain of 1..6 blocks whose checkpointed segments can run in 2 or 3 ways
    r = random.Random(seed)
    n, count = r.randint(1, 6), r.choice((2, 3))
    modes = rand_modes(r, n, count)
    modes.check()
    every = [evaluate_modes(modes, plan) for plan in all_modal_plans(n, count)]
    peaks = sorted({e.peak_bytes for e in every})
    for budget in [peaks[0] - 1, peaks[0], peaks[-1], *r.sample(peaks, min(8, len(peaks)))]:
        # WHEN the program plans for the budget
        got, want = optimal(modes, budget), brute_force(modes, budget)
        # THEN it finds the fewest recompute FLOPs of any plan in any modes that fits
        assert (got.recompute_flops if got else None) == (want.recompute_flops if want else None), (n, budget)
        if got is not None:
            assert got.peak_bytes <= budget and got == evaluate_modes(modes, got.segments)
            plain = plain_optimal(modes.plain, budget)  # never worse than plain checkpointing alone
            assert plain is None or got.recompute_flops <= plain.recompute_flops


def test_modal_frontier_is_pareto_optimal() -> None:
    modes = rand_modes(random.Random(11), 5, 3)
    every = [evaluate_modes(modes, plan) for plan in all_modal_plans(5, 3)]
    front = modal_frontier(modes, points=40)
    assert front[-1].peak_bytes == modal_minimum_peak(modes) == min(e.peak_bytes for e in every)
    for p in front:
        assert not any(q.peak_bytes <= p.peak_bytes and q.recompute_flops < p.recompute_flops for q in every)


def test_one_mode_is_the_plain_program() -> None:
    modes = rand_modes(random.Random(4), 6, 1)
    for budget in range(modes.plain.base, modes.plain.base + 20000, 997):
        a, b = optimal(modes, budget), plain_optimal(modes.plain, budget)
        assert (a and (a.recompute_flops, a.peak_bytes)) == (b and (b.recompute_flops, b.peak_bytes))


def test_levels_that_do_not_compose_are_refused() -> None:
    modes = rand_modes(random.Random(2), 3, 2)
    other = modes.levels[1]
    st = list(other.stages)
    st[0] = type(st[0])(**{**st[0].__dict__, "fwd": piece(random.Random(0), st[0].fwd.net + 4)})
    with pytest.raises(PassError, match="do not compose"):
        Modes((modes.plain, type(other)(tuple(st), other.base, other.before, other.head, other.after))).check()
    with pytest.raises(PassError, match="not a plan"):
        evaluate_modes(modes, [(0, 2, 3)])


# -- real models -----------------------------------------------------------------------------------
LEVELS = 2  # levels measured in these tests (the default is 3; each costs a few captures)


@pytest.fixture(scope="module", params=sorted(MODELS))
def sac(request: pytest.FixtureRequest) -> tuple:
    model, x, loss = MODELS[request.param]()
    report = graphmem.analyze(model, x, loss=loss)
    return request.param, model, x, loss, report, report.planner_for(LEVELS)


def _policies(planner: object, segments: tuple) -> tuple[list, list]:
    pol = (None, None, *planner.levels.policies)  # by mode: stored, plain, L1, L2, ...
    return [(a, b) for a, b, m in segments if m], [pol[m] for _, _, m in segments if m]


def test_selective_plan_peaks_equal_recaptured_peaks(sac: tuple) -> None:
    # GIVEN random plans whose segments run stored, plainly checkpointed or at a level, the
    # frontier and the baselines
    name, model, x, loss, report, planner = sac
    modes = planner.modes
    r = random.Random(9)
    plans = r.sample(list(all_modal_plans(6, LEVELS + 1)), 3)
    plans += [e.segments for e in modal_frontier(modes, 12)][-2:]
    plans += [tuple((i, i, m) for i in range(6)) for m in range(2, LEVELS + 2)]
    for segments in plans:
        # WHEN graphmem predicts the plan's peak and the plan is applied and captured again
        predicted = evaluate_modes(modes, segments).peak_bytes
        with apply_segments(model, planner.costs.chain, *_policies(planner, segments)):
            got = liveness(capture(model, x, loss)).peak_bytes
        # THEN they are equal to the byte
        assert predicted == got, segments


def test_selective_plans_under_autocast_equal_recaptured_peaks() -> None:
    # GIVEN bf16 autocast (cast copies held by autocast's cache until the forward or a
    # recompute ends) and a selective planner over LLaMA
    model, x, loss = MODELS["llama"]()
    report = graphmem.analyze(model, x, loss=loss, amp="bf16")
    planner = report.planner_for(LEVELS)
    r = random.Random(4)
    plans = r.sample(list(all_modal_plans(6, LEVELS + 1)), 3) + [tuple((i, i, 2) for i in range(6))]
    for segments in plans:
        # WHEN a plan is predicted and applied and captured again THEN the peaks are equal
        predicted = evaluate_modes(planner.modes, segments).peak_bytes
        with apply_segments(model, planner.costs.chain, *_policies(planner, segments)):
            assert predicted == liveness(capture(model, x, loss, report.target)).peak_bytes, segments


def test_selective_plans_over_micro_batches_equal_recaptured_peaks() -> None:
    # GIVEN two micro-batches (the second beside the first's gradients) and selective levels
    from graphmem.training.loop import TrainStep

    model, x, loss = MODELS["gpt2"]()
    report = graphmem.analyze(model, x, loss=loss, micro_batches=2)
    planner = report.planner_for(LEVELS)
    assert planner.modes.plain.later is not None
    r = random.Random(6)
    for segments in r.sample(list(all_modal_plans(6, LEVELS + 1)), 3) + [tuple((i, i, 3) for i in range(6))]:
        # WHEN a plan is predicted and applied and captured again THEN the peaks are equal
        predicted = evaluate_modes(planner.modes, segments).peak_bytes
        with apply_segments(model, planner.costs.chain, *_policies(planner, segments)):
            again = liveness(capture(model, x, loss, report.target, train=TrainStep(micro_batches=2))).peak_bytes
        assert predicted == again, segments


def test_selective_plan_peaks_match_real_cpu_runs(sac: tuple) -> None:
    name, model, x, loss, report, planner = sac
    low = planner.minimum_peak()
    plans = [planner.plan(budget=(low + report.peak_bytes) // 2),
             planner._plan("every block L1", every_block(planner.modes, 2))]
    assert any(p is not None for plan in plans for p in plan.policies)
    for plan in plans:
        with plan.apply(model):
            real = measure_peak(model, x, loss)
        assert plan.peak_bytes <= real.peak_bytes
        assert real.peak_bytes - plan.peak_bytes <= LM_TOLERANCE * real.peak_bytes, (plan.segments, real.peak_bytes)


def test_selective_plans_beat_plain_checkpointing(sac: tuple) -> None:
    # GIVEN the plain planner's frontier and baselines
    name, model, x, loss, report, planner = sac
    plain = report.planner
    budgets = [p.peak_bytes for p in plain.frontier(20)] + [b.peak_bytes for b, _ in plain.baselines()]
    for budget in budgets:
        # WHEN both plan for the same budget THEN selective plans never recompute more
        assert planner.plan(budget=budget).recompute_flops <= plain.plan(budget=budget).recompute_flops
    # and where keeping the blocks' matmul outputs fits, strictly less: at the peak of
    # checkpointing every block (what gradient_checkpointing_enable() does)
    every = dict((b.name, b) for b, _ in plain.baselines())["every block"]
    mine = planner.plan(budget=every.peak_bytes)
    assert mine.recompute_flops < plain.plan(budget=every.peak_bytes).recompute_flops
    assert any(p is not None for p in mine.policies)
    # and every block at a level recomputes fewer FLOPs than every block plainly
    for base, _ in planner.baselines():
        if base.name.startswith("every block, selective"):
            assert base.recompute_flops < every.recompute_flops and base.peak_bytes >= every.peak_bytes


def test_policy_is_installed_for_real(sac: tuple) -> None:
    # GIVEN a plan that checkpoints every block at the top level (keeps every keepable matmul)
    name, model, x, loss, report, planner = sac
    top = planner.levels.policies[-1]
    chain = planner.costs.chain
    torch.manual_seed(3)
    ref = loss(model(*x), x)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with apply_segments(model, chain, [(i, i) for i in range(6)], [top] * 6):
        # WHEN the step runs for real THEN the loss and gradients are those of the unchecked step
        torch.manual_seed(3)
        out = loss(model(*x), x)
        out.backward()
        assert torch.equal(out, ref)
        assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), grads))
        model.zero_grad(set_to_none=True)
        # WHEN it is captured THEN each block's recompute runs exactly the ops with FLOPs it did not keep
        g = capture(model, x, loss)
    want = [o for o in planner.levels.ops if o.key not in top.keep]
    for j in range(6):
        here = f"{chain}.{j}"
        rec = [op for op in g.ops if op.meta.get("recompute") and op_flops(op) > 0
               and (op.meta["module"] == here or op.meta["module"].startswith(here + "."))]
        assert sorted(str(op.target) for op in rec) == sorted(o.key[0] for o in want), j
    # and the kept outputs are saved for backward (SAC's cache goes through the saved-tensor hooks)
    kept_bytes = sum(o.nbytes for o in planner.levels.ops if o.key in top.keep)
    plain_saves = {s.sid for s in capture_plain(model, x, loss, chain).saves if s.phase == "forward"}
    assert kept_bytes > 0 and len({s.sid for s in g.saves if s.phase == "forward"}) > len(plain_saves)


def capture_plain(model: torch.nn.Module, x: tuple, loss: object, chain: str):  # type: ignore[no-untyped-def]
    with apply_segments(model, chain, [(i, i) for i in range(6)]):
        return capture(model, x, loss)


def test_plan_code_applies_the_plan(sac: tuple) -> None:
    name, model, x, loss, report, planner = sac
    plan = planner.plan(budget=planner.minimum_peak())
    assert "OpPolicy(frozenset({" in plan.code() and "policies=[" in plan.code()
    scope: dict = {"model": model}
    exec(plan.code(), scope)  # installs the plan as the user would
    try:
        assert liveness(capture(model, x, loss)).peak_bytes == plan.peak_bytes
    finally:
        for blk in model.get_submodule(planner.costs.chain):
            if "forward" in vars(blk):
                del blk.forward
    d = plan.to_dict()
    assert len(d["policies"]) == len(d["segments"]) and set(d["policies"]) <= {None, "L1", "L2"}


# -- which ops can be kept ---------------------------------------------------------------------------
class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.mul_(0.5)  # changes the linear's output in place: SAC could not keep it
        q = h.view(2, 4, 2, 4).transpose(1, 2)  # (b, heads, s, hd)
        y = torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=0.5)  # random
        z = torch.nn.functional.scaled_dot_product_attention(y, q, q, dropout_p=0.0)  # not random
        return x + self.b(z.transpose(1, 2).reshape(2, 4, 8))


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return x


def test_ops_that_cannot_be_kept_are_named() -> None:
    # GIVEN a block with an op changed in place later, a random attention and a plain one, on
    # the CUDA target (the CPU runs attention with dropout as explicit ops)
    torch.manual_seed(0)
    model, x = _Chain(), (torch.randn(2, 4, 8),)
    g = capture(model, x, None, "cuda")
    # WHEN graphmem lists the block's ops with FLOPs
    ops = {o.label: o for o in block_ops(g, "blocks.", 1)}
    # THEN each is named by (op, call index in the block), with why it cannot be kept
    assert ops["a addmm#0"].why_not == "changed in place later"
    random_sdpa, plain_sdpa = [o for o in ops.values() if "attention" in o.key[0]]
    assert random_sdpa.why_not == "random" and plain_sdpa.why_not == "" and plain_sdpa.key[1] == 1
    assert ops["b addmm#1"].why_not == "" and ops["b addmm#1"].flops == 2 * 8 * 8 * 8
    # and the knapsack keeps only what can be kept
    report = graphmem.analyze(model, x, device="cuda")
    planner = report.planner_for(2)
    kept = set().union(*(p.keep for p in planner.levels.policies))
    assert kept == {plain_sdpa.key, ops["b addmm#1"].key}
    # and a plan keeping what the CPU can keep runs for real with the unchecked step's gradients
    # (there the random attention runs as bmm, softmax, dropout, bmm: its bmms can be kept, the
    # dropout is recomputed with the generator state checkpoint restores)
    cpu = {o.key for o in block_ops(capture(model, x), "blocks.", 1) if not o.why_not}
    assert cpu == {ops["b addmm#1"].key, ("aten.bmm.default", 0), ("aten.bmm.default", 1),
                   ("aten._scaled_dot_product_flash_attention_for_cpu.default", 0)}  # the plain attention
    top = OpPolicy(frozenset(cpu))
    # (an op whose output leaves the block cannot be kept: it would live as long as its later use)
    linears = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    assert [o.why_not for o in block_ops(capture(linears, (torch.randn(2, 8),)), "", 1)] == ["used after the block"]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(*x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with apply_segments(model, "blocks", [(0, 2)], [top]):
        torch.manual_seed(1)
        model(*x).sum().backward()
    assert all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(), grads))


def test_selective_mistakes_are_refused(sac: tuple) -> None:
    name, model, x, loss, report, planner = sac
    with pytest.raises(UsageError, match="number of levels"):
        report.plan(budget=report.peak_bytes, selective=0)
    with pytest.raises(UsageError, match="one per segment"):
        apply_segments(model, planner.costs.chain, [(0, 1), (2, 2)], [None])
    assert report.plan(budget=report.peak_bytes, selective=LEVELS).recompute_flops == 0


def test_cli_selective(tmp_path: object, capsys: pytest.CaptureFixture) -> None:
    from graphmem.cli.main import main

    model = tmp_path / "tiny_gpt.py"  # type: ignore[operator]
    model.write_text("from graphmem.models import gpt2\n"
                     "cfg = gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=3, n_head=2, n_embd=32)\n"
                     "model = lambda: gpt2.build(cfg)\nloss = gpt2.loss\n")
    assert main(["analyze", str(model), "--input-shape", "2x16", "--selective"]) == 2
    assert "add --plan" in capsys.readouterr().err
    assert main(["plan", str(model), "--input-shape", "2x16", "--selective", "1", "--max-overhead", "5%", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    sel = plan["selective"]
    assert sel["block"] == "transformer.h.1" and [lv["name"] for lv in sel["levels"]] == ["L1"]
    keep = {tuple(k) for k in sel["levels"][0]["keep"]}
    assert keep == {(o["op"], o["index"]) for o in sel["ops"] if o["keepable"]}  # one level keeps them all
    assert "policies" in plan["chosen"] and plan["chosen"]["overhead"] <= 0.05


def test_selective_plans_as_text(sac: tuple) -> None:
    from graphmem.planning.planner import summarize
    from graphmem.render.plan import render_plan

    name, model, x, loss, report, planner = sac
    text = render_plan(summarize(planner, budget=planner.minimum_peak(), points=10))
    assert "Selective levels" in text and "every block, selective L1" in text and "OpPolicy(frozenset({" in text
    first = planner.levels.ops[0]
    assert f"{first.label} " in text  # each candidate op by module and (op, call index)
    assert any(f" L{k}" in line for line in text.splitlines() if "checkpointed segments" in line for k in (1, 2))
