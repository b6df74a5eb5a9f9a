"""Checkpoint plans: the program is optimal (brute force), its peaks are exact (re-captured on
fake tensors: 0 B; real CPU runs: within the ground-truth tolerance), never worse than the
baselines, and `apply` is real torch.utils.checkpoint that leaves the module as it was."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from cases import tiny_gpt, tokens
from random_chains import rand_chain, rand_micro

import graphmem
from graphmem.capture.capture import capture
from graphmem.chains import find_chain
from graphmem.errors import PassError, UsageError
from graphmem.models import gpt2, llama
from graphmem.passes import liveness
from graphmem.passes.budget import later_steps_peak
from graphmem.passes.checkpoint import (
    Piece,
    all_plans,
    evaluate,
    frontier,
    optimal,
    optimal_many,
    segments_of,
)
from graphmem.planning.apply import apply_segments
from graphmem.planning.planner import chain_costs
from graphmem.validation.measure import measure_peak

LM_TOLERANCE = 0.001  # as tests/capture/test_ground_truth.py: the real CPU peak, LMs


# -- the program -----------------------------------------------------------------------------------
def _best(evaluated: list, budget: int) -> int | None:
    fits = [e.recompute_flops for e in evaluated if e.peak_bytes <= budget]
    return min(fits) if fits else None


@pytest.mark.parametrize("seed", range(12))
def test_program_equals_brute_force_on_random_chains(seed: int) -> None:
    # GIVEN a random heterogeneous chain of 1..12 blocks (12 only for one seed: 75k plans)
    r = random.Random(seed)
    n = 12 if seed == 0 else r.randint(1, 9)
    costs = rand_chain(r, n)
    costs.check()
    every = [evaluate(costs, plan) for plan in all_plans(n)]
    peaks = sorted({e.peak_bytes for e in every})
    budgets = [peaks[0] - 1, peaks[0], peaks[-1]] + r.sample(peaks, min(6, len(peaks)))
    for budget in budgets:
        # WHEN the program plans for the budget
        got = optimal(costs, budget)
        # THEN it finds the fewest recompute FLOPs any plan that fits has, and its plan fits
        want = _best(every, budget)
        assert (got.recompute_flops if got else None) == want, (n, budget)
        if got is not None:
            assert got.peak_bytes <= budget
            assert got == evaluate(costs, got.segments)


def test_program_on_identical_blocks_and_many_budgets() -> None:
    costs = rand_chain(random.Random(7), 9, homogeneous=True)
    every = [evaluate(costs, plan) for plan in all_plans(9)]
    budgets = sorted({e.peak_bytes for e in every})
    for budget, got in zip(budgets, optimal_many(costs, budgets)):
        assert got is not None and got.recompute_flops == _best(every, budget)


def test_frontier_is_pareto_optimal() -> None:
    costs = rand_chain(random.Random(3), 8)
    every = [evaluate(costs, plan) for plan in all_plans(8)]
    front = frontier(costs, points=40)
    assert front[0].recompute_flops == 0  # no checkpoints is on it
    assert front[-1].peak_bytes == min(e.peak_bytes for e in every)  # and the smallest peak
    for p in front:  # nothing does better on one axis without doing worse on the other
        assert not any(q.peak_bytes <= p.peak_bytes and q.recompute_flops < p.recompute_flops for q in every)
    assert [p.peak_bytes for p in front] == sorted((p.peak_bytes for p in front), reverse=True)


def test_pieces_that_do_not_compose_are_refused() -> None:
    costs = rand_chain(random.Random(1), 3)
    st = list(costs.stages)
    st[1] = type(st[1])(**{**st[1].__dict__, "bwd_first": Piece(10, st[1].bwd_first.net + 8)})
    with pytest.raises(PassError, match="do not compose"):
        type(costs)(tuple(st), costs.base, costs.before, costs.head, costs.after).check()


def test_piece_composition() -> None:
    a, b = Piece(100, 40), Piece(30, -10)
    assert a.then(b) == Piece(100, 30) and b.then(a) == Piece(90, 30)


# -- real models -----------------------------------------------------------------------------------
def _gpt(layers: int = 6) -> tuple:
    model = tiny_gpt(layers, "explicit", dropout=0.1)
    return model, tokens(), gpt2.loss


def _llama(layers: int = 6) -> tuple:
    torch.manual_seed(0)
    cfg = llama.LlamaConfig(vocab_size=101, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                            max_seq_len=32)
    return llama.build(cfg), (torch.randint(0, 101, (2, 16)),), llama.loss


MODELS = {"gpt2": _gpt, "llama": _llama}


@pytest.fixture(scope="module", params=sorted(MODELS))
def planned(request: pytest.FixtureRequest) -> tuple:
    model, x, loss = MODELS[request.param]()
    report = graphmem.analyze(model, x, loss=loss)
    return request.param, model, x, loss, report, report.planner


def _recaptured(model: torch.nn.Module, x: tuple, loss: object, chain: str, segments: list) -> int:
    with apply_segments(model, chain, segments):
        return liveness(capture(model, x, loss)).peak_bytes


def test_identical_blocks_are_measured_at_depth_4_exactly(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    assert planner.depth == 4 and planner.costs.n == 6
    full = chain_costs(model, find_chain(model), lambda: capture(model, x, loss), None)
    assert full.stages == planner.costs.stages  # the depth-4 interior block stands for every other
    assert evaluate(planner.costs, segments_of(6, [])).peak_bytes == report.peak_bytes


def test_plan_peaks_equal_recaptured_peaks(planned: tuple) -> None:
    # GIVEN random plans, the baselines and the frontier of a 6-block chain
    name, model, x, loss, report, planner = planned
    r = random.Random(5)
    plans = [tuple((a, b) for a, b, ck in p if ck) for p in r.sample(list(all_plans(6)), 10)]
    plans += [p.segments for p in planner.frontier(20)] + [b.segments for b, _ in planner.baselines()]
    for segments in plans:
        # WHEN graphmem predicts the plan's peak and the plan is applied and captured again
        predicted = evaluate(planner.costs, segments_of(6, segments)).peak_bytes
        # THEN they are equal to the byte
        assert predicted == _recaptured(model, x, loss, planner.costs.chain, list(segments)), segments


def test_plan_peaks_match_real_cpu_runs(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    low = planner.minimum_peak()
    for plan in (planner.plan(budget=(low + report.peak_bytes) // 2), planner.plan(budget=low),
                 planner._plan("one segment", evaluate(planner.costs, segments_of(6, [(1, 4)])))):
        with plan.apply(model):
            real = measure_peak(model, x, loss)
        assert plan.peak_bytes <= real.peak_bytes
        assert real.peak_bytes - plan.peak_bytes <= LM_TOLERANCE * real.peak_bytes, (plan.segments, real.peak_bytes)


def test_activation_bytes_of_a_plan_are_what_the_forward_keeps(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    plan = planner.plan(budget=planner.minimum_peak())
    with plan.apply(model):
        g = capture(model, x, loss)
    lv = liveness(g)
    at_loss = g.phase_start["loss"] - 1  # live after the forward, before the loss
    plain = report.liveness.timeline[report.phase_start["loss"] - 1]
    assert plan.activation_bytes - report.activation_bytes == lv.timeline[at_loss] - plain
    assert plan.activation_bytes < report.activation_bytes


def test_graphmem_plan_is_never_worse_than_the_baselines(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    names = [b.name for b, _ in planner.baselines()]
    assert names[:2] == ["none", "every block"] and names[2].startswith("sqrt(n) segments")
    for base, mine in planner.baselines():
        assert mine.peak_bytes <= base.peak_bytes and mine.recompute_flops <= base.recompute_flops


def test_max_overhead_picks_the_lowest_peak_within_it(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    plan = report.plan(max_overhead="10%")
    assert plan.overhead <= 0.10
    assert plan.budget is None and plan.max_overhead == 0.10 and plan.to_dict()["max_overhead"] == 0.10
    tighter = optimal(planner.costs, plan.peak_bytes - 1, planner.tables)  # any lower peak costs more
    assert tighter is None or tighter.recompute_flops > 0.10 * planner.step_flops


def test_recompute_flops_are_forward_flops(planned: tuple) -> None:
    name, model, x, loss, report, planner = planned
    every = dict((b.name, b) for b, _ in planner.baselines())["every block"]
    # every block checkpointed recomputes each block's forward once, less what early stop skips
    forward = sum(s.flops for s in planner.costs.stages)
    assert 0 < every.recompute_flops <= forward
    assert every.recompute_flops >= forward - sum(s.flops - s.one_re_flops for s in planner.costs.stages)


# -- apply --------------------------------------------------------------------------------------------------------
def test_apply_is_real_checkpointing_and_remove_restores() -> None:
    model, x, loss = _gpt(4)
    keys = list(model.state_dict())
    torch.manual_seed(1)
    ref = loss(model(*x), x)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    report = graphmem.analyze(model, x, loss=loss)
    plan = report.plan(budget=report.planner.minimum_peak())
    handle = plan.apply(model)
    assert list(model.state_dict()) == keys  # no wrapper modules, no renamed keys
    torch.manual_seed(1)
    out = loss(model(*x), x)
    out.backward()  # recompute with the same dropout masks (checkpoint restores the RNG state)
    assert torch.equal(out, ref)
    assert all(torch.allclose(p.grad, g) for p, g in zip(model.parameters(), ref_grads))
    handle.remove()
    assert all("forward" not in vars(b) for b in model.transformer.h)


def test_a_deepcopy_of_a_planned_model_runs_its_own_blocks() -> None:
    """GIVEN a plan applied to a model (segments of two and three blocks: heads and members patched)
    WHEN the model is deep-copied (an optimizer's or EMA copy; graphmem.validate's real step trains a copy) and the
    copy runs a step
    THEN the copy's own parameters get every gradient, the original's none (the patched forwards used to close over
    the original blocks: the copy's checkpointed blocks ran the original's, and its optimizer had no states for
    them), and the copy's plan is removed like the original's."""
    import copy

    model, x, loss = _gpt(6)
    torch.manual_seed(1)
    ref = loss(model(*x), x)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    handle = apply_segments(model, "transformer.h", [(0, 1), (3, 5)])
    twin = copy.deepcopy(model)
    torch.manual_seed(1)
    out = loss(twin(*x), x)
    out.backward()
    assert torch.equal(out, ref)
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and torch.allclose(p.grad, g) for p, g in zip(twin.parameters(), ref_grads))
    handle.remove()
    assert all("forward" not in vars(b) and "_graphmem_segment" not in vars(b) for b in model.transformer.h)


def test_apply_refuses_bad_segments() -> None:
    model, x, loss = _gpt(4)
    with pytest.raises(UsageError, match="overlaps"):
        apply_segments(model, "transformer.h", [(0, 2), (2, 3)])
    with pytest.raises(UsageError, match="outside"):
        apply_segments(model, "transformer.h", [(3, 4)])
    with apply_segments(model, "transformer.h", [(0, 1)]):
        with pytest.raises(UsageError, match="already checkpointed"):
            apply_segments(model, "transformer.h", [(0, 0)])
    report = graphmem.analyze(model, x, loss=loss)
    plan = report.plan(budget=report.peak_bytes)
    with pytest.raises(UsageError, match="4 blocks"):
        plan.apply(_gpt(3)[0])


def test_plan_limits_are_checked() -> None:
    model, x, loss = _gpt(4)
    report = graphmem.analyze(model, x, loss=loss)
    with pytest.raises(UsageError, match="give a memory budget"):
        report.plan()
    with pytest.raises(UsageError, match="not both"):
        report.plan(budget="1GiB", max_overhead="5%")
    with pytest.raises(UsageError, match="invalid overhead"):
        report.plan(max_overhead="lots")
    with pytest.raises(graphmem.GraphmemError, match="smallest peak any plan"):
        report.plan(budget=1000)


def test_a_model_without_a_chain_gets_one_line() -> None:
    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(self.a(x))

    with pytest.raises(graphmem.GraphmemError, match="no chain of blocks to checkpoint"):
        graphmem.analyze(Two(), (torch.randn(2, 8),)).plan(budget="1GiB")
    # a Sequential of single layers is a chain whose pieces do not compose: the program is an
    # estimate, and the plan returned is one whose capture fits, said so
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    report = graphmem.analyze(net, (torch.randn(2, 8),))
    plan = report.plan(budget="1GiB")
    assert not report.planner.exact and report.planner.problem  # says what disagreed
    assert plan.verification is not None and not plan.verification.proven
    assert plan.peak_bytes == plan.verification.captured_peak <= 2**30
    assert "best of" in plan.verification.line()


# -- CLI ---------------------------------------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "graphmem.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_plan_text_and_json() -> None:
    r = _cli("plan", "gpt2", "--input-shape", "8x1024", "--max-overhead", "10%")
    assert r.returncode == 0, r.stderr
    assert "Chosen plan (recompute cap 10.0%)" in r.stdout and "gc.apply_segments(model, 'transformer.h'" in r.stdout
    assert "Pareto frontier" in r.stdout and "every block" in r.stdout
    j = _cli("analyze", "gpt2", "--input-shape", "8x1024", "--plan", "--max-overhead", "10%", "--json")
    assert j.returncode == 0, j.stderr
    plan = json.loads(j.stdout)["plan"]
    assert plan["chain"] == "transformer.h" and plan["blocks"] == 12
    assert 0 < plan["chosen"]["overhead"] <= 0.10 and plan["chosen"]["segments"] and plan["frontier"][0]["recompute_flops"] == 0
    assert [b["baseline"]["name"] for b in plan["baselines"]][:2] == ["none", "every block"]


def test_cli_plan_mistakes_are_one_line() -> None:
    r = _cli("analyze", "gpt2", "--input-shape", "2x64", "--budget", "1GiB")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "add --plan" in r.stderr
    r = _cli("plan", "gpt2", "--input-shape", "2x64", "--budget", "1MiB")
    assert r.returncode == 1 and "No plan chosen" in r.stdout
    assert r.stderr.strip().startswith("graphmem: no checkpoint plan fits 1.00 MiB") and r.stderr.count("\n") == 1


def test_plans_that_are_not_made_say_so_in_one_line() -> None:
    for extra, phrase in ((["--mode", "compiled"], "plan with --mode eager"),):
        r = _cli("plan", "tests/formula_models/tiny_gpt.py", "--input-shape", "4x32", "--max-overhead", "30%", *extra)
        assert r.returncode == 1 and r.stderr.count("\n") == 1 and phrase in r.stderr, r.stderr


@pytest.mark.parametrize("k,opt", [(2, "adam"), (3, None)])
def test_plans_over_micro_batches_equal_recaptured_peaks_and_real_steps(k: int, opt: str | None) -> None:
    # GIVEN gradient accumulation over k micro-batches, then Adam: every micro-step runs the
    # plan's forward and recompute; the later ones beside the gradients of the earlier ones
    from graphmem.training.loop import TrainStep

    model, x, loss = _gpt(6)
    report = graphmem.analyze(model, x, loss=loss, micro_batches=k, optimizer=opt)
    planner = report.planner
    assert planner.costs.later is not None and planner.costs.micro_steps == k and planner.depth == 4
    train = TrainStep(opt, micro_batches=k)
    for segments in ([(0, 0)], [(0, 2), (3, 5)], [(i, i) for i in range(6)], [(1, 4)]):
        # WHEN a plan is predicted and applied and the whole step captured again
        e = evaluate(planner.costs, segments_of(6, segments))
        with apply_segments(model, planner.costs.chain, segments):
            g = capture(model, x, loss, report.target, train=train)
            again = later_steps_peak(g, liveness(g))  # every step's peak: Adam's states made by the first
        # THEN the peaks are equal, and each micro-step recomputes: k times one step's FLOPs
        assert e.peak_bytes == again, segments
        one = evaluate(replace(planner.costs, later=None, micro_steps=1), segments_of(6, segments))
        assert e.recompute_flops == k * one.recompute_flops
    # (with Adam, the first step's peak is its update, which no plan lowers; every later step
    # holds the states from its start, so its peak is in backward, and checkpoints lower it)
    lowest = planner.plan(budget=planner.minimum_peak())
    assert lowest.segments and lowest.peak_bytes < planner.no_plan_peak()
    for plan in [lowest] + [planner._plan("plan", evaluate(planner.costs, segments_of(6, segs)))
                            for segs in ([(i, i) for i in range(6)], [(1, 4)])]:
        with plan.apply(model):
            real = measure_peak(model, x, loss, train=train, warm_steps=1 if opt else 0)  # a later step: states exist
        assert 0 <= real.peak_bytes - plan.peak_bytes <= LM_TOLERANCE * real.peak_bytes, plan.segments


def test_plans_with_the_optimizer_step_equal_recaptured_peaks() -> None:
    # GIVEN a step that ends with Adam's update (graphmem plan --optimizer adam)
    from graphmem.training.loop import TrainStep

    model, x, loss = _gpt(6)
    report = graphmem.analyze(model, x, loss=loss, optimizer="adam")
    planner = report.planner
    assert planner.depth == 4  # 4 blocks captured; the optimizer step cut from the report's whole step
    # plans are for every step: after the first, Adam's states live from the start
    assert evaluate(planner.costs, segments_of(6, [])).peak_bytes == later_steps_peak(report.step, report.liveness)
    for segments in ([(0, 0)], [(0, 2), (3, 5)], [(i, i) for i in range(6)], [(1, 4)]):
        # WHEN a plan is predicted and applied and the whole step captured again
        predicted = evaluate(planner.costs, segments_of(6, segments)).peak_bytes
        with apply_segments(model, planner.costs.chain, segments):
            g = capture(model, x, loss, report.target, train=TrainStep("adam"))
        # THEN the peaks are equal; and a real later CPU step with the plan is within the tolerance
        assert predicted == later_steps_peak(g, liveness(g)), segments
    plan = planner.plan(budget=planner.minimum_peak())
    with plan.apply(model):
        real = measure_peak(model, x, loss, train=TrainStep("adam"), warm_steps=1)
    assert 0 <= real.peak_bytes - plan.peak_bytes <= LM_TOLERANCE * real.peak_bytes


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_a_plan_fits_every_step_not_only_the_first(optimizer: str) -> None:
    # GIVEN a step with an optimizer whose states the first step makes (Adam's moments); SGD makes none
    from graphmem.training.loop import TrainStep

    model, x, loss = _gpt(6)
    report = graphmem.analyze(model, x, loss=loss, optimizer=optimizer)
    planner = report.planner
    states = sum(s.nbytes for s in report.step.storages.values() if s.kind == "optimizer state")
    assert (states > 0) == (optimizer == "adam")
    assert report.budget is not None  # the report's own later-steps line is the same pass's
    assert report.budget.rank.later_peak_bytes == later_steps_peak(report.step, report.liveness)
    # WHEN planning for a budget halfway between the smallest and the unplanned peak
    budget = (planner.minimum_peak() + planner.no_plan_peak()) // 2
    plan = planner.plan(budget=budget)
    # THEN a real later step (the states made by a warm-up step) stays within the budget
    with plan.apply(model):
        real = measure_peak(model, x, loss, train=TrainStep(optimizer), warm_steps=1)
    assert plan.peak_bytes <= budget
    assert 0 <= real.peak_bytes - plan.peak_bytes <= LM_TOLERANCE * real.peak_bytes
    # and the unplanned peak the planner starts from is the later steps', above the first step's by the states
    assert planner.no_plan_peak() >= report.peak_bytes
    assert (planner.no_plan_peak() > report.peak_bytes) == (optimizer == "adam")


def test_cpu_attention_kernels_count_their_flops() -> None:
    # the flop counter has no entry for the CPU flash kernel; graphmem counts it as its CUDA twin
    from graphmem.planning.planner import op_flops

    model = gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=32, n_layer=1, n_head=2, n_embd=32, dropout=0.0))
    report = graphmem.analyze(model, (torch.randint(0, 101, (2, 16)),), loss=gpt2.loss)
    fwd = [op_flops(op) for op in report.step.ops if "flash_attention_for_cpu.default" in str(op.target)]
    bwd = [op_flops(op) for op in report.step.ops if "flash_attention_for_cpu_backward" in str(op.target)]
    b, h, s, hd = 2, 2, 16, 16
    assert fwd == [4 * b * h * s * s * hd]  # q @ k^T and p @ v, 2 FLOPs per multiply-add
    assert bwd == [10 * b * h * s * s * hd]  # flop_counter's backward formula: 2.5x the forward


@pytest.fixture(scope="module", params=["gpt2-cpu", "llama-cpu", "gpt2-cuda"])
def planned_amp(request: pytest.FixtureRequest) -> tuple:
    name, device = request.param.split("-")
    model, x, loss = MODELS[name]()
    report = graphmem.analyze(model, x, loss=loss, amp="bf16", device=device)
    return name, device, model, x, loss, report, report.planner


def test_autocast_plans_equal_recaptured_peaks(planned_amp: tuple) -> None:
    # GIVEN bf16 autocast, whose cast cache frees checkpointed blocks' weight copies only when
    # the forward (or a segment's recompute) ends, and random plans, baselines, the frontier
    name, device, model, x, loss, report, planner = planned_amp
    assert planner.tables.cached and planner.depth == 4
    assert any(s.c_first for s in planner.costs.stages)  # the copies the cache holds were found
    r = random.Random(8)
    plans = [tuple((a, b) for a, b, ck in p if ck) for p in r.sample(list(all_plans(6)), 8)]
    plans += [p.segments for p in planner.frontier(20)] + [b.segments for b, _ in planner.baselines()]
    for segments in plans:
        # WHEN graphmem predicts each plan and the plan is applied and captured again
        predicted = evaluate(planner.costs, segments_of(6, segments)).peak_bytes
        with apply_segments(model, planner.costs.chain, list(segments)):
            again = liveness(capture(model, x, loss, report.target)).peak_bytes
        # THEN they are equal to the byte
        assert predicted == again, segments


def _matmul_scratch(model: torch.nn.Module, x: tuple, loss: object) -> int:
    """The largest allocation a real CPU bf16 autocast step makes inside a matmul kernel that
    is not a tensor the fake step has: oneDNN's bf16 GEMM scratch, which no fake tensor sees."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from graphmem.training.step import run_step

    model.train()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, l = run_step(model, x, loss, forward_context=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    del out, l
    model.zero_grad(set_to_none=True)
    fake = {s.nbytes for s in graphmem.analyze(model, x, loss=loss, amp="bf16").step.storages.values()}
    found, todo = [0], [(e, "") for e in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        e, parent = todo.pop()
        if e.tag == _EventType.Allocation:
            size = e.extra_fields.alloc_size
            if parent in ("aten::mm", "aten::addmm", "aten::bmm") and size > 0 and size not in fake:
                found.append(size)
        else:
            todo.extend((c, e.name) for c in e.children)
    return max(found)


def test_autocast_plans_match_real_cpu_autocast_runs(planned_amp: tuple) -> None:
    name, device, model, x, loss, report, planner = planned_amp
    if device != "cpu":
        pytest.skip("a real run of the CUDA target needs a GPU")
    scratch = _matmul_scratch(model, x, loss)
    # measured on this machine: 0 B without checkpoints (llama), up to two bf16 GEMM scratch
    # buffers (34,432 B each for the tiny llama) when a plan's peak lands in a recompute's matmul
    # (none where oneDNN has no bf16 GEMM: an AVX2-only CPU's bf16 matmuls allocate nothing more, measured)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert 0 < scratch < 0.1 * report.peak_bytes  # a few % of this toy step (38,528 B of 733,072 B for llama)
    else:
        assert scratch == 0
    low = planner.minimum_peak()
    for plan in (planner.plan(budget=(low + report.peak_bytes) // 2), planner.plan(budget=low),
                 planner._plan("one segment", evaluate(planner.costs, segments_of(6, [(1, 4)])))):
        with plan.apply(model):
            real = measure_peak(model, x, loss, amp=torch.bfloat16)
        assert plan.peak_bytes <= real.peak_bytes <= plan.peak_bytes + 2 * scratch, (plan.segments, real.peak_bytes)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_segments_recompute_keeps_its_cast_cache_to_the_end(device: str) -> None:
    # GIVEN blocks 0..3 checkpointed as one segment under bf16 autocast: torch.utils.checkpoint
    # recomputes the segment inside one autocast context (CPU: PyTorch's own; CUDA target:
    # graphmem's rules, entered once per segment as torch enters autocast once)
    model, x, loss = _gpt(4)
    target = graphmem.analyze(model, x, loss=loss, amp="bf16", device=device).target
    with apply_segments(model, "transformer.h", [(0, 3)]):
        g = capture(model, x, loss, target)
    back = g.phase_start["backward"]
    recomputed = [s for s in g.storages.values() if s.cache_freed and s.created >= back]
    # THEN the bias copies every block's recompute casts are freed together, when it ends
    blocks = {s.module.split(".")[2] for s in recomputed}
    assert blocks == {"0", "1", "2", "3"}
    assert len({s.freed for s in recomputed}) == 1
    # (bf16 biases; on the CPU also each block's `* (1.0 / math.sqrt(hd))` double, kept by the
    # recomputed MulBackward0 that never runs: graphmem/capture/wrapped_numbers.py)
    scale = 4 * 8 if device == "cpu" else 0
    assert sum(s.nbytes for s in recomputed) == 4 * 2 * (3 * 32 + 32 + 4 * 32 + 32) + scale


@pytest.mark.parametrize("k", [1, 2])
def test_plans_with_tensors_only_checkpoints_keep(k: int) -> None:
    # GIVEN blocks given a tensor the model makes each step and no block saves (as HF models
    # pass attention masks and rotary tables): it dies at the forward's end without
    # checkpoints, after the lowest checkpointed segment's backward with them
    mod = _load("tests/plan_models/shared_inputs.py")
    torch.manual_seed(0)
    model, x = mod.model(), (torch.randint(0, 101, (4, 32)),)
    from graphmem.training.loop import TrainStep

    report = graphmem.analyze(model, x, loss=mod.loss, micro_batches=k)
    planner = report.planner
    train = TrainStep(micro_batches=k) if k > 1 else None
    assert planner.costs.shared == 32 * 32 * 4  # pos: (s, d) fp32, made again in each micro-step
    assert planner.costs.entry == 4 * 32 * 32 * 4  # the embeddings: (b, s, d) fp32
    assert k == 1 or (planner.costs.later.shared, planner.costs.later.entry) == (32 * 32 * 4, 4 * 32 * 32 * 4)
    r = random.Random(3)
    plans = [tuple((a, b) for a, b, ck in p if ck) for p in r.sample(list(all_plans(6)), 8)]
    plans += [p.segments for p in planner.frontier(20)] + [((2, 3),), ((0, 0),)]  # first stored / alone
    for segments in plans:
        # WHEN predicted, then applied and captured again, and run for real
        predicted = evaluate(planner.costs, segments_of(6, segments)).peak_bytes
        with apply_segments(model, planner.costs.chain, list(segments)):
            again = liveness(capture(model, x, mod.loss, train=train)).peak_bytes
            real = measure_peak(model, x, mod.loss, train=train).peak_bytes
        # THEN equal to the byte, and within the ground-truth tolerance of reality
        assert predicted == again, segments
        assert 0 <= real - predicted <= LM_TOLERANCE * real, (segments, real - predicted)


def _load(path: str) -> object:
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.rsplit("/", 1)[-1][:-3], path)
    mod = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_plans_over_unlike_blocks_in_several_stages() -> None:
    # GIVEN two Sequential stages of blocks of different widths, run one after another
    mod = _load("tests/plan_models/stages.py")
    torch.manual_seed(0)
    model, x = mod.model(), (torch.randint(0, 101, (4, 32)),)  # type: ignore[attr-defined]
    report = graphmem.analyze(model, x, loss=mod.loss)  # type: ignore[attr-defined]
    planner = report.planner
    assert planner.costs.chain == "stage1,stage2" and planner.costs.n == 6 and planner.depth == 6
    assert len({s.fwd for s in planner.costs.stages}) == 6  # no two blocks alike
    r = random.Random(4)
    plans = [tuple((a, b) for a, b, ck in p if ck) for p in r.sample(list(all_plans(6)), 8)]
    plans += [p.segments for p in planner.frontier(20)] + [((1, 4),)]  # (1, 4) spans both stages
    for segments in plans:
        # WHEN predicted, then applied and captured again, and run for real
        predicted = evaluate(planner.costs, segments_of(6, segments)).peak_bytes
        with apply_segments(model, planner.costs.chain, list(segments)):
            again = liveness(capture(model, x, mod.loss)).peak_bytes  # type: ignore[attr-defined]
            real = measure_peak(model, x, mod.loss).peak_bytes  # type: ignore[attr-defined]
        # THEN equal to the byte, and within the ground-truth tolerance of reality
        assert predicted == again, segments
        assert 0 <= real - predicted <= LM_TOLERANCE * real, (segments, real - predicted)
    plan = planner._plan("x", evaluate(planner.costs, segments_of(6, [(1, 4)])))
    assert plan.paths == ("stage1.1..stage2.1",)
    assert "gc.apply_segments(model, 'stage1,stage2', [(1, 4)])" in plan.code()


def test_autocast_plan_cli_prints_a_plan() -> None:
    r = subprocess.run([sys.executable, "-m", "graphmem.cli", "plan", "tests/formula_models/tiny_gpt.py",
                        "--input-shape", "4x32", "--device", "cuda", "--amp", "bf16", "--max-overhead", "30%"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "checkpointed segments of" in r.stdout and "apply it:" in r.stdout


# -- autocast: cast-cache copies freed later than the block that made them ---------------------------
@pytest.mark.parametrize("seed", range(10))
def test_program_equals_brute_force_with_deferred_cache_frees(seed: int) -> None:
    # GIVEN random chains whose roles leave bytes in autocast's cache (freed at the forward's
    # exit, or at the end of a segment's recompute): the peak depends on more than kept bytes
    r = random.Random(100 + seed)
    n = 10 if seed == 0 else r.randint(1, 8)
    costs = rand_chain(r, n, homogeneous=seed % 3 == 1, cached=True)
    _program_is_brute_force(costs, r)


def _program_is_brute_force(costs: object, r: random.Random) -> None:
    """WHEN the program plans for budgets at and around every plan's peak THEN it is as cheap
    as the best plan that fits, and its plan fits."""
    costs.check()  # type: ignore[attr-defined]
    n = costs.n  # type: ignore[attr-defined]
    every = [evaluate(costs, plan) for plan in all_plans(n)]  # type: ignore[arg-type]
    peaks = sorted({e.peak_bytes for e in every})
    for budget in [peaks[0] - 1, peaks[0], peaks[-1]] + r.sample(peaks, min(8, len(peaks))):
        got = optimal(costs, budget)  # type: ignore[arg-type]
        assert (got.recompute_flops if got else None) == _best(every, budget), (n, budget)
        if got is not None:
            assert got.peak_bytes <= budget and got == evaluate(costs, got.segments)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", range(8))
def test_program_equals_brute_force_over_micro_steps(seed: int) -> None:
    # GIVEN random chains run as 3 micro-steps: the later ones start higher (gradients exist)
    # and run their own backward; each recomputes the checkpointed segments
    r = random.Random(200 + seed)
    n = 9 if seed == 0 else r.randint(1, 7)
    costs = rand_micro(r, n)
    assert all(evaluate(costs, plan).recompute_flops % 3 == 0 for plan in all_plans(n))
    _program_is_brute_force(costs, r)


@pytest.mark.parametrize("seed", range(14))
def test_program_equals_brute_force_with_shared_tensors(seed: int) -> None:
    # GIVEN random chains passed tensors made before them (a mask, rotary tables) that only
    # checkpointed segments keep: they live until the lowest checkpointed segment's backward
    r = random.Random(300 + seed)
    n = 10 if seed == 0 else r.randint(1, 8)
    costs = rand_chain(r, n, homogeneous=seed % 3 == 1, cached=seed % 2 == 1, shared=True)
    _program_is_brute_force(costs, r)


def test_cache_held_until_the_forward_exits_by_hand() -> None:
    # GIVEN one block: stored, its forward keeps 2000 B; checkpointed, it keeps a 100 B
    # boundary plus 1000 B of cast copies only autocast's cache holds, its recompute brings
    # back 1900 B; the head runs a 500 B transient before the forward's context exits
    from graphmem.passes.checkpoint import NOTHING, ChainCosts, Stage

    p = Piece
    st = Stage("b0", fwd=p(2000, 2000), bwd=p(300, -2000), fwd_first=p(1100, 1100), fwd_member=NOTHING,
               one_pre=NOTHING, one_re=p(1900, 1900), one_post=p(300, -2000), pre=NOTHING, re_first=NOTHING,
               re_member=NOTHING, re_last=NOTHING, post=NOTHING, bwd_member=NOTHING, bwd_first=NOTHING,
               flops=7, one_re_flops=7, re_first_flops=0, re_member_flops=0, re_last_flops=0, c_first=1000)
    costs = ChainCosts((st,), base=0, before=NOTHING, head=p(500, 0), after=NOTHING)
    costs.check()
    # WHEN the checkpointed plan is stitched
    e = evaluate(costs, segments_of(1, [(0, 0)]))
    # THEN the copies are live in the head (1100 + 500) and gone before backward, whose
    # recompute tops out at 100 + 1900 + 300: 2300 B, keeping 100 B for backward
    assert (e.peak_bytes, e.kept_bytes) == (2300, 100)
    assert evaluate(costs, segments_of(1, [])).peak_bytes == 2500  # stored: 2000 + 500
    assert optimal(costs, 2400).segments == ((0, 0, True),) and optimal(costs, 2500).recompute_flops == 0
    # and a head transient of 1500 B makes the forward side the peak: 1100 + 1500
    assert evaluate(replace(costs, head=p(1500, 0)), segments_of(1, [(0, 0)])).peak_bytes == 2600
