"""DeepSpeed ranks through DeepSpeed's own engine on fake tensors (graphmem/deepspeed/), against real
DeepSpeed on 2 gloo CPU processes (tests/deepspeed_truth.py: DeepSpeed's and torch's code only)."""
from __future__ import annotations

import json

import pytest

from graphmem.deepspeed import make_job
from graphmem.errors import UsageError
from graphmem.stepgraph import StepGraph

BUCKETS = {"reduce_bucket_size": 10000, "allgather_bucket_size": 10000}  # (DeepSpeed's 5e8 default: 2 GB on ZeRO-2)


@pytest.mark.parametrize("config, message", [
    ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'"),
    ({"zero_optimization": {"stage": 4}}, "ZeRO stage 4 does not exist"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "nvme"),
    ({"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "DeepSpeedCPUAdam, a C++ op that fake tensors cannot run: set `\"zero_force_ds_cpu_optimizer\": false`"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "use it with `\"stage\": 3`"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}}, "ratio"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": "auto"}}, "scheduler": {"type": "WarmupLR",
      "params": {"warmup_num_steps": "auto"}}}, "\"auto\" for `scheduler.params.warmup_num_steps`"),
    ("/nonexistent/ds_config.json", "does not exist"),
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "`fp16.enabled`"),  # (this CPU: no oneDNN fp16)
    ({"bf16": True, "zero_optimization": {"stage": 2}}, "`bf16` must be an object"),
    ({"optimizer": "adamw"}, "`optimizer` must be an object"),
    ({"zero_optimization": {"stage": 3, "offload_param": "cpu"}}, "`zero_optimization.offload_param` must be an object"),
])
def test_bad_configs_are_one_line_errors(config: object, message: str) -> None:
    with pytest.raises(UsageError, match=None) as e:
        make_job(config, 2, 0)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_torch_optimizer_with_offload_needs_deepspeeds_flag() -> None:
    """DeepSpeed raises ``ZeRORuntimeException`` for a client optimizer under ZeRO-Offload unless
    ``zero_force_ds_cpu_optimizer`` is false (deepspeed/runtime/engine.py ``_configure_basic_optimizer``): one line."""
    import graphmem

    config = _config(2, BUCKETS | {"offload_optimizer": {"device": "cpu"}})
    with pytest.raises(UsageError) as e:
        graphmem.analyze(torch_net(), (torch_input(),), deepspeed=config, world_size=2, rank=0, optimizer="adamw")
    assert "`\"zero_force_ds_cpu_optimizer\": false`" in str(e.value) and "\n" not in str(e.value)
    assert "optimizer on the host (pinned)" in make_job(config | {"zero_force_ds_cpu_optimizer": False}).describe()


def test_a_deepspeed_job_is_analyzed_on_the_cuda_target_by_default(tmp_path: object, capsys: object) -> None:
    """A DeepSpeed job's ranks are GPUs: without ``device`` its step is the CUDA target's (kernel rules, caching
    allocator, device total), on the API and the command line; ``device='cpu'`` is DeepSpeed's CPU run, and
    ``validate`` (which runs the job for real here) stays on the CPU."""
    import argparse
    import importlib

    import graphmem
    from graphmem.cli.options import device_of

    cli = importlib.import_module("graphmem.cli.main")  # (graphmem.cli.main, the attribute, is the function)

    config = _config(2)
    job = {"deepspeed": config, "world_size": 2, "optimizer": "adamw"}
    assert graphmem.spec_for(torch_net(), (torch_input(),), **job).target.device == "cuda"
    assert graphmem.spec_for(torch_net(), (torch_input(),), device="cpu", **job).target.device == "cpu"
    assert graphmem.spec_for(torch_net(), (torch_input(),)).target.device == "cpu"
    # ZeRO-3's parameter offload runs on the CPU target only yet: its default stays there (the report says why)
    params_off = _config(3, {"offload_param": {"device": "cpu"}}, zero_force_ds_cpu_optimizer=False)
    assert graphmem.spec_for(torch_net(), (torch_input(),), **{**job, "deepspeed": params_off}).target.device == "cpu"
    seen: dict[str, str] = {}

    def spy(args: argparse.Namespace) -> int:  # (the device each command reads: graphmem/cli/options.py device_of)
        seen[args.command] = device_of(args)
        return 0

    ds = tmp_path / "ds.json"  # type: ignore[operator]
    ds.write_text(json.dumps(config))
    parser = cli.parser
    base = ["models/mlp.py", "--input-shape", "4x6"]
    ds_job = ["--deepspeed", str(ds), "--world-size", "2"]
    try:
        cli.parser = lambda: _spying(parser(), spy)  # type: ignore[assignment]
        for argv, device in ((["analyze", *base, *ds_job], "cuda"), (["advise", *base, *ds_job, "--memory", "1GB"], "cuda"),
                             (["analyze", *base, *ds_job, "--device", "cpu"], "cpu"), (["validate", *base, *ds_job], "cpu"),
                             (["analyze", *base], "cpu")):
            seen.clear()
            assert cli.main(argv) == 0 and seen == {argv[0]: device}, (argv, seen)
    finally:
        cli.parser = parser  # type: ignore[assignment]
    from graphmem.cli.options import target_of  # (a parser's args read without main: the same default)

    assert target_of(parser().parse_args(["analyze", *base, *ds_job])).device == "cuda"
    assert target_of(parser().parse_args(["analyze", *base])).device == "cpu"


def _spying(p: object, spy: object) -> object:
    """The CLI's parser with every command's ``run`` replaced by ``spy`` (what the command would be given)."""
    parse = p.parse_args  # type: ignore[attr-defined]

    def parse_args(argv: object = None) -> object:
        args = parse(argv)
        args.run = spy
        return args
    p.parse_args = parse_args  # type: ignore[attr-defined]
    return p


def torch_net() -> object:
    import torch

    return torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def torch_input() -> object:
    import torch

    return torch.randn(4, 6)


def test_a_json_path_is_a_config(tmp_path: object) -> None:
    path = tmp_path / "ds.json"  # type: ignore[operator]
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 1}}))
    job = make_job(str(path), 4, 3)
    assert (job.stage, job.rank, job.world_size) == (1, 3, 4)
    assert "ZeRO-1 (fp32), rank 3 of 4" in job.describe()
    job = make_job({"bf16": {"enabled": True}, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                    "zero_optimization": {"stage": 2}}, 2, 1)
    assert job.describe() == "DeepSpeed ZeRO-2 (bf16, 2 micro-steps, clipping 1), rank 1 of 2"


def _config(stage: int, buckets: dict = BUCKETS, **settings: object) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, **settings, "zero_optimization": {"stage": stage, **buckets}}


def _analyzed(config: dict, rank: int, world_size: int = 2, kind: str = "llama") -> dict:
    import graphmem
    from graphmem.deepspeed.report import residual
    from graphmem.passes import liveness
    from tests.deepspeed_truth import decoder

    model, batch = decoder(kind=kind)
    r = graphmem.analyze(model, batch, device="cpu", deepspeed=config, world_size=world_size, rank=rank, optimizer="adamw")
    lv = liveness(r.step)
    res = residual(r.step, lv, model, r.source.spec.parallel)
    host = {k: dict(zip(("pinned", "pageable"), v)) for k, v in (("before", res.host.before), ("after", res.host.after))}
    return {"saved": r.activation_bytes, "before": lv.baseline_bytes, "after": lv.end_bytes, "peak": r.peak_bytes,
            "later": r.budget.rank.later_peak_bytes, "host": host, "flat": sum(b for _, b in res.flat),
            "padding": [b for _, b in res.padding], "buckets": res.buckets, "notes": r.notes,
            "rows": {d.name: d.size for d in r.budget.rank.details}}


def _match_real(configs: list[dict], later: float = 0.02, residuals: bool = False, world_size: int = 2,
                kind: str = "llama") -> None:
    """Real DeepSpeed on ``world_size`` gloo ranks, all ``configs`` in one measurement; graphmem's figures per rank:
    saved bytes, bytes held before and after the first step and its peak equal to the byte; the later
    steps' peak (graphmem's second step, captured after an unrecorded first) within 2 % and never above
    (measured equal to the byte on every stage and setting here: docs/deepspeed.md)."""
    pytest.importorskip("deepspeed")
    from tests.deepspeed_truth import measure_ds_ranks

    real = measure_ds_ranks(configs, world_size, kind)
    for config, ranks in zip(configs, real):
        for rank, truth in enumerate(ranks):
            got = _analyzed(config, rank, world_size, kind)
            first = truth["first"]
            print(json.dumps({"config": config, "rank": rank, "graphmem": {k: v for k, v in got.items() if k != "notes"},
                              "real": truth}))  # (shown with -s)
            assert truth["unsettled"] == 0
            assert {k: got[k] for k in ("saved", "before", "after", "peak")} == \
                {k: first[k] for k in ("saved", "before", "after", "peak")}, (config, rank)
            assert truth["later"]["saved"] == got["saved"]
            assert 0 <= truth["later"]["peak"] - got["later"] <= later * truth["later"]["peak"], (config, rank, got, truth)
            assert got["host"] == truth["host"], (config, rank)  # (0 B each without offload)
            if residuals:
                _match_residual(config, rank, got, truth["residual"])


def _match_residual(config: dict, rank: int, got: dict, real: dict) -> None:
    """The residual states' figures against the real engine's: its flat partitions' bytes, and its padding
    (``groups_padding``, the 16-bit flat buffer's length) in the bytes graphmem names."""
    e = 2 if config.get("bf16", {}).get("enabled") else 4
    assert got["flat"] == real["flat"], (config, rank)
    stage = config["zero_optimization"]["stage"]
    assert got["padding"] == ([e * real["flat_padding"], 4 * real["padding"]] if stage < 3
                              else [e * real["padding"], 4 * real["padding"]]), (config, rank)
    # the budget's detail rows (graphmem/deepspeed/report.py ``residual_rows``) say the same: the flat partitions
    # (on the CPU target, the host's too), the padding, and the host bytes held when the step ends
    rows = got["rows"]
    assert sum(b for k, b in rows.items() if k.startswith("flat partition ")) == real["flat"], (config, rank, rows)
    assert [b for k, b in rows.items() if k.startswith("alignment padding")] == got["padding"]
    if any(got["host"]["after"].values()):
        assert (rows["host (pinned)"], rows["host (pageable)"]) == \
            (got["host"]["after"]["pinned"], got["host"]["after"]["pageable"])


# CI runs fp32 ZeRO-3 (ZeRO-2 fp32 in the settings and offload cases, ZeRO-1 and 2 in bf16); stages 1 and 2 in fp32
# are heavy (pyproject.toml: about 75 s each, a real 2-process job and two captures)
@pytest.mark.slow
@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.heavy), pytest.param(2, marks=pytest.mark.heavy), 3])
def test_zero_stages_match_real_deepspeed_on_two_gloo_ranks(stage: int) -> None:
    """GIVEN a tiny transformers Llama (2 layers, hidden 64), fp32, torch's AdamW, buckets of 10k elements
    WHEN real DeepSpeed runs ZeRO-``stage`` on 2 gloo processes and graphmem captures each rank on fake tensors
    THEN the figures match (``_match_real``)."""
    _match_real([_config(stage)])


@pytest.mark.slow
def test_bf16_zero_stages_match_real_deepspeed() -> None:
    """GIVEN the same decoder with ``bf16: {enabled: true}`` (DeepSpeed casts the module to bf16 and keeps
    fp32 master partitions; its overflow check reads a flag byte: graphmem/deepspeed/engine.py)
    WHEN real DeepSpeed runs ZeRO-1, 2 and 3 on its CPU accelerator, 2 gloo processes
    THEN the figures match (``_match_real``)."""
    _match_real([_config(s, bf16={"enabled": True}) for s in (1, 2, 3)])


@pytest.mark.slow
@pytest.mark.heavy  # 4 DeepSpeed processes and 12 ranks captured (its 2-rank twins above run in CI)
def test_zero_stages_match_real_deepspeed_on_four_gloo_ranks() -> None:
    """GIVEN the same decoder, buckets of 10k elements: ZeRO-1 fp32, ZeRO-2 bf16, ZeRO-3 fp32 (4 ranks: stage 1
    and 2 align each flat buffer to 2 x 4 elements, stage 3 pads each parameter to a multiple of 4)
    WHEN real DeepSpeed runs each on 4 gloo processes and graphmem captures each of the 4 ranks on fake tensors
    THEN the figures match (``_match_real``)."""
    _match_real([_config(1), _config(2, bf16={"enabled": True}), _config(3)], world_size=4)


@pytest.mark.slow
@pytest.mark.parametrize("config", [pytest.param(_config(2, gradient_clipping=1.0), id="zero2-clipping",
                                                 marks=pytest.mark.heavy),  # (CI time: ZeRO-3 bf16 runs in CI)
                                    pytest.param(_config(3, bf16={"enabled": True}), id="zero3-bf16")])
def test_gpt2_matches_real_deepspeed(config: dict) -> None:
    """GIVEN a tiny transformers GPT-2 (2 layers, hidden 64; its dropouts on; lm_head tied to the token embedding,
    one parameter to DeepSpeed), torch's AdamW, buckets of 10k elements
    WHEN real DeepSpeed runs ZeRO-2 fp32 with clipping and ZeRO-3 bf16 on 2 gloo processes
    THEN the figures match (``_match_real``), the residual states' too."""
    _match_real([config], residuals=True, kind="gpt2")


ZERO2_SETTINGS = {"clipping": _config(2, gradient_clipping=1.0),
                  "accumulation": _config(2, gradient_accumulation_steps=2, gradient_clipping=1.0),
                  "overlap": _config(2, BUCKETS | {"overlap_comm": True}),
                  "scattered": _config(2, BUCKETS | {"contiguous_gradients": False}),
                  "overlap-scattered": _config(2, BUCKETS | {"overlap_comm": True, "contiguous_gradients": False})}


# CI runs accumulation (with clipping) and overlap without contiguous gradients; each setting alone is heavy
@pytest.mark.slow
@pytest.mark.parametrize("setting", [pytest.param(k, marks=pytest.mark.heavy)
                                     if k in ("clipping", "overlap", "scattered") else k for k in ZERO2_SETTINGS])
def test_zero2_settings_match_real_deepspeed(setting: str) -> None:
    """GIVEN ZeRO-2 with ``gradient_clipping`` 1.0, with ``gradient_accumulation_steps`` 2 (2 micro-steps of the
    batch each, the optimizer stepping on the second), with ``overlap_comm`` true, with ``contiguous_gradients``
    false, and with both
    WHEN real DeepSpeed runs each on 2 gloo processes
    THEN the figures match (``_match_real``): rank 1's first peak under accumulation is its own (1,624,080 B)."""
    _match_real([ZERO2_SETTINGS[setting]])


# CPU offload: ZeRO-2's optimizer on the host, pinned (DeepSpeed's default); ZeRO-3's optimizer on the host,
# pageable, and its parameters on the host (pinned whatever pin_memory says: stage3.py
# ``_create_param_groups_fp16_flat_cpu_memory``); torch's AdamW steps the host partitions
OFFLOAD = [_config(2, BUCKETS | {"offload_optimizer": {"device": "cpu"}}, zero_force_ds_cpu_optimizer=False),
           _config(3, BUCKETS | {"offload_optimizer": {"device": "cpu", "pin_memory": False},
                                 "offload_param": {"device": "cpu"}}, zero_force_ds_cpu_optimizer=False)]


@pytest.mark.slow
def test_cpu_offload_matches_real_deepspeed() -> None:
    """GIVEN the decoder under ZeRO-2 with ``offload_optimizer`` to the CPU (pinned) and ZeRO-3 with
    ``offload_optimizer`` (pageable) and ``offload_param`` to the CPU, torch's AdamW (``zero_force_ds_cpu_optimizer``
    false)
    WHEN real DeepSpeed runs each on 2 gloo processes
    THEN the figures match (``_match_real``, the later steps' peak within 1 %) and so do the host bytes, pinned
    and pageable, before and after the step (tests/deepspeed_truth.py ``host_bytes``: the buffers DeepSpeed keeps
    on its offload device, pinned where its ``pin_memory`` returned them)."""
    _match_real(OFFLOAD, later=0.01, residuals=True)


@pytest.mark.slow
def test_default_buckets_allocate_two_gigabytes_on_zero2() -> None:
    """DeepSpeed's default ``reduce_bucket_size`` (5e8 elements) on ZeRO-2: rank 0's step peaks about 2 GB
    above what it holds before (the contiguous reduce bucket, ``ipg_buffer``, 5e8 fp32 elements), on
    fake tensors: nothing real is allocated."""
    pytest.importorskip("deepspeed")
    got = _analyzed(_config(2, {}), 0)
    assert got["peak"] - got["before"] == ABOVE
    # the residual states' reduce buckets: the one contiguous bucket of reduce_bucket_size fp32 elements (stage_1_and_2.py
    # ``ipg_buckets[dtype].buffer``), named as DeepSpeed releases it (graphmem/deepspeed/engine.py ``naming_buckets``)
    assert got["buckets"] == 500_000_000 * 4


# real DeepSpeed 0.19.8, this decoder, 2 gloo CPU processes (tests/deepspeed_truth.py with the config above):
# rank 0 held 543,168 B before the step and peaked at 2,001,238,480 B (both ranks); issue 38 measured
# 2,000,677,328 B above the baseline for its own tiny 2-layer hidden-64 decoder
ABOVE = 2_001_238_480 - 543_168


@pytest.mark.slow  # ~20 s: a ZeRO-3 engine on fake tensors
def test_zero3_leaves_torch_as_it_found_it() -> None:
    """ZeRO-3's ``Init`` replaces ``torch.nn.functional.linear`` for the process ("This will persist unless
    manually reset": deepspeed/runtime/zero/partition_parameters.py) and wraps torch's constructors; after
    graphmem's capture every one is back, and a plain step records the same ops as before it (a full
    suite once recorded fewer ops in every later report of the worker that had run ZeRO-3)."""
    pytest.importorskip("deepspeed")
    import torch

    import graphmem

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = (torch.randn(2, 8),)
    before = graphmem.analyze(net, x).num_ops
    kept = (torch.nn.functional.linear, torch.empty, torch.zeros, vars(torch.nn.Module).get("__init_subclass__"),
            vars(torch.nn.Module)["apply"], vars(torch.Tensor).get("__new__"))
    got = _analyzed({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, **BUCKETS}}, 0)
    assert got["saved"] > 0
    assert (torch.nn.functional.linear, torch.empty, torch.zeros, vars(torch.nn.Module).get("__init_subclass__"),
            vars(torch.nn.Module)["apply"], vars(torch.Tensor).get("__new__")) == kept
    assert graphmem.analyze(net, x).num_ops == before


@pytest.mark.parametrize("stage, bf16", [(1, True), (2, True), (3, True), (1, False)])
def test_the_zero_papers_model_states_beside_the_engines(stage: int, bf16: bool) -> None:
    """The report's cross-check line (graphmem/deepspeed/report.py ``zero_paper``): the paper's per-rank
    model states (2Ψ/4Ψ parameters, split at stage 3; the fp32 master 4Ψ/N_d; Adam 8Ψ/N_d) beside what
    DeepSpeed's engine holds; the differences are DeepSpeed's padding, by its own rules (stage 1 and 2:
    each group's flat buffer to a multiple of 2 N_d elements, stage_1_and_2.py "aligned_numel"; stage 3:
    each parameter to a multiple of N_d, partition_parameters.py ``_padding_size``) and the step counter."""
    import math

    import torch

    import graphmem
    from graphmem.deepspeed.report import held_by_origin, padding, zero_paper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))  # Ψ = 29: padded
    n, numels = 2, [p.numel() for p in model.parameters()]
    psi, e = sum(numels), 2 if bf16 else 4
    config = _config(stage, {"reduce_bucket_size": 1000, "allgather_bucket_size": 1000},
                     **({"bf16": {"enabled": True}} if bf16 else {}))
    config["train_micro_batch_size_per_gpu"] = 4
    r = graphmem.analyze(model, (torch.randn(4, 6),), device="cpu", deepspeed=config, world_size=n, rank=0, optimizer="adamw")
    states = next(row.size for row in r.budget.rank.rows if row.name == "optimizer states")
    rows = zero_paper(psi, r.source.spec.parallel, held_by_origin(r.step), states)
    if stage < 3:
        flat = math.ceil(psi / (2 * n)) * 2 * n  # the group's flat buffer, aligned
        engine = (e * flat, 4 * flat // n, 8 * flat // n + 4)
    else:
        flat = sum(math.ceil(k / n) * n for k in numels)  # each parameter padded, then split
        engine = (e * flat // n, 4 * flat // n, 8 * flat // n + 4)
    paper = (e * psi // n if stage == 3 else e * psi, 4 * psi // n if bf16 else 0, 8 * psi // n)
    # (in fp32 training DeepSpeed keeps an fp32 partition the paper's fp32 accounting has no row for: paper 0 B)
    assert [(x.paper, x.engine) for x in rows] == list(zip(paper, engine))
    assert all(x.difference > 0 for x in rows)  # Ψ = 29 is never aligned
    # the padding is a budget row of its own, under the parameters' row and the master copies' (rank 0: its share)
    details = {d.name: (d.within, d.size) for d in r.budget.rank.details}
    assert [details[f"alignment padding ({what})"] for what, _ in padding(model, r.source.spec.parallel)] == \
        [(w, b) for w, (_, b) in zip(("parameters", "master copies"), padding(model, r.source.spec.parallel))]
    line = next(x for x in r.notes if x.startswith("the ZeRO paper's model states"))
    assert f"paper {rows[0].paper} B, DeepSpeed {rows[0].engine} B" in line and "alignment padding" in line
    # the residual states' padding per rank, by the same rules: the last rank's partitions hold it
    last = make_job(config, n, n - 1)
    if stage < 3:
        mine = flat // n - (psi - (n - 1) * (flat // n))  # rank 1: 16 - 13 = 3 elements
        expected = [(("16-bit flat buffer", e * (flat - psi)), ("fp32 partition", 0)),
                    (("16-bit flat buffer", e * (flat - psi)), ("fp32 partition", 4 * mine))]
    else:
        mine = sum(-k % n for k in numels)  # Linear(6, 3)'s bias: 3 -> 4 elements
        expected = [(("16-bit partitions", 0), ("fp32 partitions", 0)),
                    (("16-bit partitions", e * mine), ("fp32 partitions", 4 * mine))]
    assert [padding(model, r.source.spec.parallel), padding(model, last)] == expected
    assert f"alignment padding {expected[0][0][0]} {expected[0][0][1]} B" in \
        next(x for x in r.notes if x.startswith("DeepSpeed's residual states"))


@pytest.mark.slow  # ~1 min: three engines and five steps of the decoder on fake tensors
@pytest.mark.heavy  # (pyproject.toml) a check of the capture's refactor; the real-DeepSpeed tests hold its figures in CI
@pytest.mark.parametrize("config", [_config(3, bf16={"enabled": True}),
                                    _config(2, BUCKETS | {"overlap_comm": True}, gradient_accumulation_steps=2)])
def test_one_engine_records_both_steps_as_two_engines_do(config: dict) -> None:
    """GIVEN the decoder under ZeRO-3 bf16, and ZeRO-2 with overlapped buckets and 2 micro-steps
    WHEN the first and second steps are recorded from one engine (``capture_engine_steps``, what analyze runs)
    THEN each graph equals, field by field (graphmem/capture/reuse.py ``signature``: every op, storage, save and
    phase), the one recorded from an engine of its own: the first step's (``capture_engine``) and the second
    step's after an unrecorded first (``capture_engine(warm=True)``), but the module path of ops in DeepSpeed's
    gradient hooks (below)."""
    pytest.importorskip("deepspeed")
    import graphmem
    from graphmem.capture.reuse import signature
    from graphmem.deepspeed.capture import capture_engine, capture_engine_steps
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    spec = graphmem.spec_for(model, batch, device="cpu", deepspeed=config, world_size=2, rank=1, optimizer="adamw")
    args = (spec.module, spec.inputs.captured, spec.loss, spec.target, spec.parallel, spec.training.train)
    first, later = capture_engine_steps(*args)
    alone = capture_engine(*args)
    assert signature(_by_order(first)) == signature(_by_order(alone))
    del alone
    warm = capture_engine(*args, warm=True)
    # but where the second step's ops run in gradient hooks on the AccumulateGrad nodes DeepSpeed keeps
    # (stage_1_and_2.py ``grad_accs``): those carry the tag of the step before, the module's path from a recorded
    # first step (as the first step's graph names them), the root's "" from an unrecorded one
    # (``_micro_steps`` tags the loss's nodes with the root, graphmem/capture/autograd_tags.py ``_tag_grad_fns``)
    relabelled = [(a.meta["module"], b.meta["module"]) for a, b in zip(later.ops, warm.ops)
                  if a.meta["module"] != b.meta["module"]]
    assert all(b == "" and a in {op.meta["module"] for op in first.ops} for a, b in relabelled), relabelled
    for a, b in zip(later.ops, warm.ops):
        a.meta["module"] = b.meta["module"]
    for st in later.storages.values():  # (ZeRO-2's reduce buckets, made in such a hook)
        st.module = warm.ops[st.created].meta["module"] if st.created >= 0 else st.module
    assert signature(_by_order(later)) == signature(_by_order(warm))
    assert len(later.ops) > 0 and later.placeholders != first.placeholders


def _by_order(g: StepGraph) -> StepGraph:
    """``g`` with DeepSpeed's parameter ids in its placeholders' names numbered by first appearance: ZeRO's
    ``param_id_to_grad_partition[i]`` takes ``i`` from a counter of the process (deepspeed/runtime/zero/
    partition_parameters.py gives each parameter a ``ds_id``), so each engine's names start where the last
    one's ended (4 parameters: [0..3], then [4..7]) though the tensors are the same."""
    import re

    ids: dict[str, int] = {}
    for p in g.placeholders:
        p.target = re.sub(r"(param_id_to_\w+)\[(\d+)\]",
                          lambda m: f"{m.group(1)}[{ids.setdefault(m.group(2), len(ids))}]", p.target)
    return g


@pytest.mark.slow  # ~40 s: Llama-2-70B's 80 layers through ZeRO-3's hooks, twice (benchmarks/bench_deepspeed.py times it)
def test_llama2_70b_zero3_at_64_ranks_holds_under_1_2_gb_of_its_own() -> None:
    """GIVEN Llama-2-70B (the bundled preset, built on the meta device), ZeRO-3 bf16, AdamW, batch 1 x 4096
    WHEN rank 0 of 64 is analyzed in a fresh process (``import deepspeed`` included)
    THEN that process's own peak memory stays at or under 1.2 GB (the issue's goal is 1.5 GB of RSS): nothing of
    the model's 140 GB is materialized. Its own: the peak RSS less the shared libraries' file pages mapped by the
    imports (benchmarks/process_memory.py), which the kernel's page cache decides: 233 to 419 MB for ``import
    torch`` alone on this project's machine, the same venv's files old or freshly written, more on CI's (a peak
    RSS of 1.78 GB there, 1.10-1.32 GB here, for the same code). Measured here: 0.89 GB of its own."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[2] / "benchmarks"
    code = ("import sys, graphmem, deepspeed\n"
            f"sys.path.insert(0, {str(benchmarks)!r})\n"
            "from process_memory import PeakMemory\n"
            "memory = PeakMemory()\n"
            "cfg = {'train_micro_batch_size_per_gpu': 'auto', 'bf16': {'enabled': True}, 'zero_optimization': {'stage': 3}}\n"
            "r = graphmem.analyze('llama-2-70b', input_shape='1x4096', deepspeed=cfg, world_size=64, rank=0, optimizer='adamw')\n"
            "print(r.budget.rank.later_peak_bytes, memory.own(), memory.total(), memory.files())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    later, own, total, files = (int(x) for x in out[-4:])
    assert later > 0
    assert own <= 1.2e9, f"own {own} B; peak RSS {total} B, the libraries' file pages {files} B"


@pytest.mark.slow  # ~40 s: four ZeRO-2 engines on fake tensors, two steps each
def test_the_cuda_target_keeps_the_offloaded_optimizer_off_the_gpu() -> None:
    """GIVEN the decoder under ZeRO-2 with ``offload_optimizer`` to the CPU (pinned), torch's AdamW, rank 0 of 2
    WHEN analyzed on the CUDA target (graphmem/deepspeed/host.py)
    THEN what DeepSpeed keeps on the host (the fp32 partition, its gradients, the pinned buffers, Adam's states)
    is host memory, outside the GPU's figures: the host bytes before and after the step are the CPU target's (which
    equal real DeepSpeed's: ``test_cpu_offload_matches_real_deepspeed``); nothing forward or backward makes is on the
    host, and what the optimizer's step makes from host tensors only is; the GPU holds no master copy and no optimizer
    state, and its later steps' peak drops below the same job's without offload by at least the host's states."""
    pytest.importorskip("deepspeed")
    import graphmem
    from graphmem.deepspeed.host import host_sids
    from graphmem.deepspeed.report import host_bytes
    from graphmem.passes import liveness
    from tests.deepspeed_truth import decoder

    def analyzed(config: dict, device: str) -> object:
        model, batch = decoder()
        return graphmem.analyze(model, batch, deepspeed=config, world_size=2, rank=0, optimizer="adamw", device=device)

    gpu, cpu = analyzed(OFFLOAD[0], "cuda"), analyzed(OFFLOAD[0], "cpu")
    plain = analyzed(_config(2), "cuda")
    g = gpu.step
    h, h_cpu = host_bytes(g), host_bytes(cpu.step)
    assert (h.before, h.after) == (h_cpu.before, h_cpu.after) and sum(h.after) > 0
    host = {sid for sid, s in g.storages.items() if s.host}
    assert host == host_sids(g) and all(g.storages[sid].nbytes == 0 for sid in host)
    optimizer = g.phase_start["optimizer"]
    made = {sid for sid in host if g.storages[sid].created >= 0}
    assert made and all(g.storages[sid].created >= optimizer for sid in made)  # the optimizer's step on the host
    rows = {r.name: r for r in gpu.budget.rank.rows}
    assert rows["master copies"].size == rows["optimizer states"].size == 0
    states = sum(s.host for s in g.storages.values() if s.kind in ("optimizer state", "master") and s.freed is None)
    # both later peaks fall in backward (op 248): the GPU is spared the states and masters, less the device buffer
    # offload adds for the gradients' copies to the host (stage_1_and_2.py ``temp_grad_buffer_for_gpu_offload``)
    added = sum(s.nbytes for s in g.storages.values() if s.name.startswith("optimizer.temp_grad_buffer_for_gpu_offload"))
    assert plain.budget.rank.later_peak_bytes - gpu.budget.rank.later_peak_bytes == states - added > 0
    assert liveness(g).peak_bytes == gpu.budget.rank.peak_bytes  # (the device's own figures)
    details = {d.name: d for d in gpu.budget.rank.details}
    assert (details["host (pinned)"].size, details["host (pageable)"].size) == h.after
    assert details["host (at most at once)"].size == h.peak >= sum(h.after)
    assert any("outside the GPU's figures" in n for n in gpu.notes)


def test_the_cuda_target_refuses_offload_param(tmp_path: object) -> None:
    """ZeRO-3's ``offload_param`` on the CUDA target (its gathers copy each host partition to the GPU, a copy the CPU
    accelerator never makes) is a one-line refusal, on the engine's path and the Trainer's."""
    import graphmem
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    with pytest.raises(UsageError, match="`offload_param` is analyzed on `device='cpu'` only"):
        graphmem.analyze(model, batch, deepspeed=OFFLOAD[1], world_size=2, optimizer="adamw", device="cuda")
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(str(tmp_path), report_to=[], deepspeed=OFFLOAD[1])
    with pytest.raises(UsageError, match="`offload_param` is analyzed on `device='cpu'` only"):
        graphmem.analyze(model, batch, training_args=args, world_size=2, device="cuda")


@pytest.mark.slow  # ~10 s: a ZeRO-3 engine's two steps on fake tensors
def test_offload_param_answers_on_the_cpu_target_by_default() -> None:
    """GIVEN ZeRO-3 with ``offload_param`` and no ``device`` (a DeepSpeed job's default target is the CUDA target,
    which does not run parameter offload yet)
    THEN the job is analyzed on the CPU target, which runs it, and the report says why."""
    import graphmem
    from tests.deepspeed_truth import decoder

    report = graphmem.analyze(*decoder(), deepspeed=OFFLOAD[1], world_size=2, optimizer="adamw")
    assert report.target is not None and report.target.device == "cpu"
    assert any(n.startswith("offload_param: analyzed on the CPU target") for n in report.notes)


@pytest.mark.slow  # ~40 s: a real 2-process DeepSpeed job and two ranks captured
@pytest.mark.heavy  # (CI time) the command line's twin below runs in CI
def test_validate_runs_the_real_deepspeed_ranks() -> None:
    """graphmem.validate(model, batch, deepspeed=config, world_size=2): each rank's prediction beside real DeepSpeed
    on 2 gloo processes (graphmem/validation/deepspeed_ranks.py: the capture's optimizer, resolved config and loop,
    run for real), ZeRO-3 in bf16 here: saved, before and after the step exact, both peaks within 1 % (measured
    equal)."""
    pytest.importorskip("deepspeed")
    import graphmem
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    v = graphmem.validate(model, batch, deepspeed=_config(3, bf16={"enabled": True}), world_size=2, optimizer="adamw")
    assert v.ok, v.reason
    for rank in (0, 1):
        for name in ("saved for backward", "before the step", "after the step", "peak", "peak (later steps)"):
            assert v.row(name, rank).difference == 0, (name, rank)


@pytest.mark.slow  # ~40 s: the same through the command line, on a model file
def test_cli_validates_a_deepspeed_config(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    """``graphmem validate MODEL --deepspeed ds.json --world-size 2``: every row of both ranks, the job named."""
    pytest.importorskip("deepspeed")
    capsys.readouterr()  # (DeepSpeed's first import prints its accelerator on stdout: the test's, not the command's)
    from graphmem.cli.main import main
    from tests.deepspeed_truth import decoder

    model, _ = decoder()
    model.config.to_json_file(str(tmp_path / "config.json"))  # type: ignore[operator]
    ds = tmp_path / "ds.json"  # type: ignore[operator]
    ds.write_text(json.dumps(_config(2)))
    assert main(["validate", str(tmp_path / "config.json"), "--input-shape", "2x32", "--deepspeed", str(ds),  # type: ignore[operator]
                 "--world-size", "2", "--optimizer", "adamw", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["validation"]["rows"]
    assert {(r["rank"], r["name"]) for r in rows} >= {(k, "after the step") for k in (0, 1)}
    assert all(r["ok"] for r in rows) and all(r["predicted"] == r["measured"] for r in rows)


@pytest.mark.slow  # ~10 s: rank 0 analyzed before the refusal
def test_validate_refuses_a_loss_the_ranks_cannot_unpickle() -> None:
    """A ``loss`` the spawned DeepSpeed ranks cannot unpickle (a lambda) is a one-line refusal before any rank starts."""
    pytest.importorskip("deepspeed")
    import graphmem
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    with pytest.raises(UsageError, match="`loss` pickled") as e:
        graphmem.validate(model, batch, deepspeed=_config(2), world_size=2, rank=0, optimizer="adamw",
                          loss=lambda out, given: out.loss)
    assert "\n" not in str(e.value)
