"""The run's memory (passes/run_memory.py, passes/device_rows.py) and the verdicts judged on one of its
figures (graphmem/planning/figures.py, graphmem/report/live.py ``Analysis._judged``).

GIVEN a real CPU step with an optimizer, the run's max allocated is the real SECOND step's peak (the
states live from its start), to the byte; on the CUDA target the device total carries one row per
item outside the caching allocator, each with its source, in the JSON; plans and fits never return
an answer whose device total (captured) exceeds the budget.
"""
from __future__ import annotations

import json

import pytest
import torch
from cases import MODELS
from cases import build as build_case

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.report import Report
from graphmem.training.loop import make_train_step
from graphmem.units import fmt_bytes
from graphmem.validation.measure import measure_peak


def _mlp(batch: int = 512) -> tuple:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 10))
    return net, (torch.randn(batch, 256),), lambda out, _: out.square().mean()


@pytest.mark.parametrize("build", [_mlp, lambda: build_case(MODELS, "gpt2_sdpa")], ids=["mlp_b512", "gpt2"])
def test_run_max_is_the_real_second_step_and_sgd_adamw_differ_by_the_states(build) -> None:
    module, inputs, loss = build()
    got = {}
    for opt in ("sgd", "adamw"):
        r = graphmem.analyze(module, inputs, loss=loss, optimizer=opt)
        real = measure_peak(module, inputs, loss, train=make_train_step(opt), warm_steps=1)
        assert r.memory.run_max_allocated == real.peak_bytes  # the second step's peak, to the byte
        assert r.run_peak_bytes == r.memory.run_max_allocated >= r.first_step_peak_bytes == r.peak_bytes
        assert r.memory.device_total == r.memory.run_max_reserved == r.memory.run_max_allocated  # CPU: no rows
        got[opt] = r
    states = got["adamw"].budget.row("optimizer states").size
    assert states > 0
    if got["adamw"].budget.rank.later_peak_phase == got["sgd"].peak_phase == "backward":  # both peak in backward
        assert got["adamw"].memory.run_max_allocated - got["sgd"].memory.run_max_allocated == states


def test_mlp_adamw_headline_names_the_run_maximum() -> None:
    """The issue's MLP (peak in backward): the first step hides AdamW's states; the headline shows them."""
    module, inputs, loss = _mlp()
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw")
    m = r.memory
    assert m.later_allocated > m.first_allocated == r.peak_bytes
    from graphmem.render.text import render_text

    text = render_text(r)
    assert f"peak (run)   {fmt_bytes(m.run_max_allocated)}" in text and fmt_bytes(m.first_allocated) in text
    assert "peak (run)" in text and "later steps (optimizer states from the start); first step" in text


ROWS = {"cuda_context", "cublas_workspace", "cudnn_workspace", "nccl data parallel", "torch_distributed"}


def _rows(d: dict) -> dict:
    return {r["name"]: r for r in d["memory"]["device_total"]["rows"]}


def test_device_total_rows_for_a_per_rank_nccl_job(capsys) -> None:
    """``--world-size 8 --fsdp --device cuda``: every row, its source, whether it is an estimate, and
    the overrides, in the JSON; the total is reserved plus the rows."""
    code = main(["analyze", "gpt2", "--input-shape", "1x16", "--device", "cuda", "--world-size", "8", "--fsdp",
                 "--optimizer", "adamw", "--overhead", "cuda_context=600MiB", "--json"])
    assert code == 0
    d = json.loads(capsys.readouterr().out)
    rows = _rows(d)
    missing = ROWS - rows.keys()
    assert not missing, f"rows missing: {missing}"
    assert all(r["source"] for r in rows.values())
    assert rows["cuda_context"] == {**rows["cuda_context"], "bytes": 600 * 2 ** 20, "overridden": True}
    assert d["memory"]["device_total"]["overrides"] == {"cuda_context": 600 * 2 ** 20}
    assert rows["nccl data parallel"]["estimate"] and rows["nccl data parallel"]["bytes"] > 0
    assert rows["cublas_workspace"]["bytes"] == 4096 * 8 * 1024  # h100: CublasHandlePool.cpp's sm 9.x default
    total = d["memory"]["device_total"]["bytes"]
    assert total == d["memory"]["run_max"]["reserved"] + sum(r["bytes"] for r in rows.values())
    assert d["memory"]["later_steps"]["max_reserved"] >= d["memory"]["first_step"]["max_reserved"]
    assert Report.from_dict(d).memory.device_total == total  # round trip


def test_tensor_parallel_job_has_a_communicator_per_dimension() -> None:
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    r = graphmem.analyze(net, (torch.randn(8, 16),), device="cuda", gpu="a100", world_size=8, tp=2, zero=1,
                         overheads={"nccl": 0})
    names = {row.name: row for row in r.memory.rows}
    assert {"nccl data parallel", "nccl tensor parallel"} <= names.keys()
    assert all(names[n].bytes == 0 and names[n].overridden for n in ("nccl data parallel", "nccl tensor parallel"))
    assert names["cublas_workspace"].bytes == 4096 * 1024 * 2 + 16 * 1024 * 8  # a100: ":4096:2:16:8"
    cpu = graphmem.analyze(net, (torch.randn(8, 16),), world_size=8, zero=1)
    assert cpu.memory.rows == () and cpu.memory.reserved_from.startswith("= allocated")


def test_overheads_are_checked() -> None:
    net = torch.nn.Linear(4, 4)
    with pytest.raises(UsageError, match="no device row named 'context'"):
        graphmem.analyze(net, (torch.randn(2, 4),), overheads={"context": "1GiB"})
    with pytest.raises(UsageError, match="non-negative"):
        graphmem.analyze(net, (torch.randn(2, 4),), overheads={"cuda_context": -1})


def _model(name: str) -> tuple:
    """Small models whose activations outweigh the allocator's 2 and 20 MiB segments (32x128 tokens)."""
    torch.manual_seed(0)
    if name == "hf_llama":
        transformers = pytest.importorskip("transformers")
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return transformers.LlamaForCausalLM(cfg), None, None
    from graphmem.models import gpt2, llama

    if name == "gpt2":
        return gpt2.build(gpt2.GPTConfig(vocab_size=101, block_size=256, n_layer=4, n_head=2, n_embd=64)), None, gpt2.loss
    return llama.build(llama.LlamaConfig(vocab_size=101, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                                         max_seq_len=256)), None, llama.loss


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", pytest.param("llama", marks=pytest.mark.heavy), "hf_llama"])  # heavy: ~70 s
def test_plan_and_fit_never_exceed_the_budget_on_the_device_total(name: str) -> None:
    """On the CUDA target the budget is compared with the device total (the default), captured with
    the plan applied / at the batch found: never above the budget, and the answer names the figure.
    The plan is checked again through the public API: applied to the model, analyzed afresh."""
    module, _, loss = _model(name)
    r = graphmem.analyze(module, input_shape="32x128", loss=loss, device="cuda", optimizer="adamw")
    m = r.memory
    budget = m.device_total - r.activation_bytes // 3  # below the step as it is: checkpoints are needed
    plan = r.plan(budget=budget)
    assert plan.figure == "device" and plan.figure_bytes <= budget and plan.segments
    handle = plan.apply(module)
    try:
        again = graphmem.analyze(module, input_shape="32x128", loss=loss, device="cuda", optimizer="adamw")
    finally:
        handle.remove()
    assert again.memory.device_total == plan.figure_bytes <= budget
    a = r.fit(m.device_total + r.activation_bytes, seq=128)
    assert a.figure == "device" and a.figure_bytes is not None and a.figure_bytes <= a.memory
    assert a.figure_above is None or a.figure_above > a.memory
    assert 32 <= a.value <= a.tensors_value


def test_assert_peak_bytes_names_the_figure_compared() -> None:
    module, inputs, loss = _mlp(64)
    r = graphmem.assert_peak_bytes(module, inputs, loss=loss, optimizer="adamw", max_bytes="64MiB")
    run = r.memory.run_max_allocated
    with pytest.raises(AssertionError, match="run max allocated is .* over the budget .*compared: the run max allocated"):
        graphmem.assert_peak_bytes(module, inputs, loss=loss, optimizer="adamw", max_bytes=run - 1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    with pytest.raises(AssertionError, match="device total"):  # the CUDA target's default: the context counts
        graphmem.assert_peak_bytes(net, (torch.randn(8, 16),), device="cuda", max_bytes="100MiB")
    assert graphmem.assert_peak_bytes(net, (torch.randn(8, 16),), device="cuda", max_bytes="100MiB",
                                      figure="reserved").memory.run_max_reserved <= 100 * 2 ** 20


def test_fit_cli_takes_the_step_options_and_names_the_figure(capsys) -> None:
    """``graphmem fit`` takes --optimizer as analyze does; the states count, and the answer says which
    figure it compared (allocated on the CPU target)."""
    args = ["fit", "mlp-mnist", "--input-shape", "64x784", "--memory", "64MiB", "--json"]
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)["fit"]
    assert main(args + ["--optimizer", "adamw"]) == 0
    adamw = json.loads(capsys.readouterr().out)["fit"]
    assert plain["figure"] == adamw["figure"] == "allocated"
    assert adamw["value"] < plain["value"]  # AdamW's states (2 x the parameters) take room from the batch
    assert 0 < adamw["value"] and adamw["figure_bytes"] <= 64 * 2 ** 20 < adamw["figure_above"]


@pytest.mark.slow
def test_a_plan_is_found_when_the_headroom_guess_is_below_every_plan() -> None:
    """GIVEN a tiny GPT-2 on the CUDA target, whose device total is mostly the 512 MiB context, so the
    budget lowered by the unplanned step's headroom is below every plan's peak
    WHEN the budget is the device total of its lowest-peak plan (captured with the plan applied)
    THEN a plan is still found (graphmem/planning/figures.py bisects the planner's budget), at or under it."""
    from graphmem.planning.figures import headroom, plan_memory

    module, _, loss = _model("gpt2")
    r = graphmem.analyze(module, input_shape="32x128", loss=loss, device="cuda", optimizer="adamw")
    lowest = r.plan(max_overhead=1.0)  # recompute is at most the forward: the lowest-peak plan
    budget = plan_memory(r, lowest).device_total
    assert budget - headroom(r, "device") < lowest.peak_bytes  # the guess alone finds nothing
    plan = r.plan(budget=budget)
    assert plan.figure == "device" and plan.figure_bytes is not None and plan.figure_bytes <= budget
