"""A Trainer whose TrainingArguments name ``deepspeed``, per rank: the Trainer built per rank and stepped by its
own code, accelerate running DeepSpeed (``_prepare_deepspeed`` -> ``deepspeed.initialize``; ``accelerator.backward``
-> ``engine.backward`` and ``engine.step``) on fake tensors under the fake process group
(graphmem/deepspeed/trainer.py, graphmem/deepspeed/trainer_capture.py), against the real Trainer
on 2 gloo CPU processes (tests/deepspeed_trainer_truth.py). Measured rows: docs/deepspeed.md "Through the Trainer"."""
from __future__ import annotations

import json
from typing import Any

import pytest

from graphmem.cli.main import main
from graphmem.errors import UsageError

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

BUCKETS = {"reduce_bucket_size": 10000, "allgather_bucket_size": 10000}  # (DeepSpeed's 5e8 default: 2 GB on ZeRO-2)


def ds_config(stage: int, **settings: Any) -> dict:
    """What a Trainer user writes: the batch sizes, accumulation and clipping left to the Trainer ("auto"), no
    ``train_batch_size`` (accelerate on CPUs counts one process: see graphmem/deepspeed/trainer.py)."""
    return {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", **settings, "zero_optimization": {"stage": stage, **BUCKETS}}


def _figures(report: Any) -> dict[str, Any]:
    from graphmem.deepspeed.report import host_bytes
    from graphmem.passes import liveness

    lv = liveness(report.step)
    host = host_bytes(report.step)
    return {"saved": report.activation_bytes, "before": lv.baseline_bytes, "after": lv.end_bytes,
            "peak": report.peak_bytes, "later": report.budget.rank.later_peak_bytes,
            "host": {k: dict(zip(("pinned", "pageable"), v)) for k, v in (("before", host.before), ("after", host.after))}}


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}  # ZeRO-2's optimizer on the host (pinned: DeepSpeed's default)
JOBS = {  # (ZeRO stage, the config's own settings, the zero_optimization settings, TrainingArguments fields)
    "zero2": (2, {}, {}, {}),
    "zero3": (3, {}, {}, {}),
    "zero1-bf16-accumulation-overlap": (1, {}, {"overlap_comm": True, "contiguous_gradients": True},
                                        {"bf16": True, "gradient_accumulation_steps": 2}),
    "zero2-offload": (2, {"zero_force_ds_cpu_optimizer": False}, OFFLOAD, {}),  # the Trainer's torch AdamW on the host
    "gpt2-zero3": (3, {}, {}, {}),  # the tiny GPT-2 (tests/deepspeed_truth.py decoder(kind="gpt2"))
    "zero2-4-processes": (2, {}, {}, {}),  # four ranks
}
# the decoder and the number of processes where not the Llama on 2
SHAPES = {"gpt2-zero3": ("gpt2", 2), "zero2-4-processes": ("llama", 4)}


@pytest.mark.parametrize("config, fields, message", [
    ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, {}, "`fp16.enabled`"),
    ({"zero_optimization": {"stage": 2}, "bf17": {"enabled": True}}, {}, "did you mean 'bf16'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, {}, "zero_force_ds_cpu_optimizer"),
])
def test_bad_deepspeed_trainer_inputs_are_one_line_errors(tmp_path: Any, config: dict, fields: dict,
                                                          message: str) -> None:
    import graphmem
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    with pytest.raises(UsageError) as e:
        graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), config, **fields), world_size=2)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_use_cpu_and_options_are_refused(tmp_path: Any) -> None:
    """``use_cpu`` turns DeepSpeed off in accelerate (its AcceleratorState picks DeepSpeed only where not cpu):
    refused in one line rather than analyzed as a one-process step; so are graphmem's own loop options."""
    import graphmem
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    with pytest.raises(UsageError, match="use_cpu") as e:
        graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), ds_config(2), use_cpu=True),
                         world_size=2)
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="drop optimizer"):
        graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), ds_config(2)), world_size=2,
                         optimizer="sgd")


def test_cli_training_args_with_deepspeed_refuses_in_one_line(tmp_path: Any, capsys: Any) -> None:
    from tests.deepspeed_truth import decoder

    decoder()[0].config.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "per_device_train_batch_size": 2,
                                "deepspeed": {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme"}}}}))
    assert main(["analyze", str(tmp_path / "config.json"), "--input-shape", "2x32", "--training-args", str(args),
                 "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("graphmem")]
    assert len(ours) == 1 and "nvme" in ours[0] and "Traceback" not in err, err


@pytest.mark.slow  # a real 2-process gloo job and 4 captures each: 3-8 min each on 2 shared cores
@pytest.mark.parametrize("job", [pytest.param("zero2", marks=pytest.mark.heavy),  # (CI time: ZeRO-2 fp32 runs with offload)
                                 "zero3", "zero1-bf16-accumulation-overlap", "zero2-offload",
                                 "gpt2-zero3",  # (heavy, CI time: 4 processes; the direct engine's 4-rank jobs too)
                                 pytest.param("zero2-4-processes", marks=pytest.mark.heavy)])
def test_trainer_deepspeed_ranks_match_a_real_gloo_job(tmp_path: Any, job: str) -> None:
    """GIVEN the tiny Llama (2 layers, hidden 64; or the tiny GPT-2), 2 x 32 tokens a rank, the Trainer's default
    AdamW, clipping 1.0, and ``job``'s DeepSpeed settings and TrainingArguments (bf16: DeepSpeed's bf16 engine; accumulation: the
    Trainer's own micro-steps; offload: the optimizer's partitions on the host)
    WHEN the real Trainer runs it through accelerate on 2 (or 4) gloo CPU processes and graphmem captures each rank
    through the same Trainer code on fake tensors
    THEN saved bytes, the bytes held before and after the first step, both steps' peaks and the host bytes (pinned
    and pageable, before and after) are equal to the byte on both ranks (docs/deepspeed.md "Through the Trainer")."""
    import graphmem
    from tests.deepspeed_trainer_truth import measure_trainer_ranks, trainer_args
    from tests.deepspeed_truth import decoder

    stage, own, zero, fields = JOBS[job]
    kind, world_size = SHAPES.get(job, ("llama", 2))
    config = ds_config(stage, **own)
    config["zero_optimization"].update(zero)
    real = measure_trainer_ranks(config, fields, world_size, kind)
    for rank, truth in enumerate(real):
        model, batch = decoder(kind=kind)
        report = graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), config, **fields),
                                  world_size=world_size, rank=rank)
        got = _figures(report)
        # the residual states and the ZeRO paper's cross-check, as on the direct engine path
        assert any(n.startswith("DeepSpeed's residual states") for n in report.notes)
        assert any(n.startswith("the ZeRO paper's model states") for n in report.notes)
        first, later = truth["first"], truth["later"]
        print(json.dumps({"job": job, "rank": rank, "graphmem": got, "real": truth}))  # (shown with -s)
        assert truth["unsettled"] == 0
        assert {k: got[k] for k in ("saved", "before", "after")} == {k: first[k] for k in ("saved", "before", "after")}
        assert later["saved"] == got["saved"]
        assert (got["peak"], got["later"]) == (first["peak"], later["peak"]), (rank, got, truth)
        assert got["host"] == truth["host"], (rank, got["host"], truth["host"])  # (0 B each without offload)


def test_a_built_trainer_and_the_cli_file_reach_the_same_rank(tmp_path: Any, monkeypatch: Any) -> None:
    """A Trainer built in this process with ``deepspeed`` in its arguments (accelerate's Accelerator sets
    ``ACCELERATE_USE_DEEPSPEED`` for the process: put back after) is analyzed as rank r of the job, rebuilt per
    rank; so is a ``--training-args`` file naming ``deepspeed`` (the CLI hands the arguments over)."""
    from graphmem.deepspeed.trainer import TrainerDeepSpeed
    from graphmem.frontends.door import spec_for
    from graphmem.frontends.trainer import trainer_from_file
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    model, batch = decoder()
    trainer = transformers.Trainer(model=model, args=trainer_args(str(tmp_path), ds_config(2)))
    spec = spec_for(trainer, batch, world_size=2, rank=1)
    assert isinstance(spec.parallel, TrainerDeepSpeed) and spec.parallel.describe() == \
        "DeepSpeed ZeRO-2 (accelerate), rank 1 of 2"
    assert spec.training.train.describe().endswith("DeepSpeed ZeRO-2 (accelerate), rank 1 of 2")
    with pytest.raises(UsageError, match="drop trainer_batch"):
        spec_for(trainer, batch, world_size=2, trainer_batch="longest")
    path = tmp_path / "args.json"
    path.write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "deepspeed": ds_config(3)}))
    args = trainer_from_file(model, str(path))
    assert isinstance(spec_for(model, batch, training_args=args, world_size=2).parallel, TrainerDeepSpeed)
    # a GPU user's file with bf16, read on this machine without a GPU: DeepSpeed's bf16 engine runs it (its CPU
    # accelerator), so transformers' bf16-GPU check is answered for it; without deepspeed the check stands
    path.write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "bf16": True,
                                "deepspeed": ds_config(1, bf16={"enabled": "auto"})}))
    spec = spec_for(model, batch, training_args=trainer_from_file(model, str(path)), world_size=2)
    assert spec.parallel.job is not None and spec.parallel.job.config["bf16"]["enabled"] is True
    assert spec.training.train.precision.startswith("bf16")
    path.write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "bf16": True}))
    with pytest.raises(UsageError, match="bf16"):
        trainer_from_file(model, str(path))


@pytest.mark.slow  # ~40 s: four Trainer ranks through DeepSpeed on fake tensors
def test_the_trainers_offloaded_optimizer_stays_off_the_gpu_on_the_cuda_target(tmp_path: Any) -> None:
    """GIVEN the Trainer's ZeRO-2 job with ``offload_optimizer`` (the zero2-offload job above, whose CPU figures equal
    a real Trainer's to the byte)
    WHEN analyzed with ``device='cuda'`` (the CUDA target's kernel rules around the Trainer's compute_loss)
    THEN the host bytes are the CPU target's, outside the GPU's figures (graphmem/deepspeed/host.py): the GPU's
    peaks drop by the host's share, no master copy or optimizer state is on it, the device total is shown; and
    without offload the inner torch AdamW steps foreach, torch.optim's pick for CUDA tensors."""
    import graphmem
    from graphmem.deepspeed.report import host_bytes
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    stage, own, zero, fields = JOBS["zero2-offload"]
    config = ds_config(stage, **own)
    config["zero_optimization"].update(zero)

    def analyzed(config: dict, device: str) -> Any:
        model, batch = decoder()
        return graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), config, **fields),
                                world_size=2, rank=0, device=device)

    cpu, gpu = analyzed(config, "cpu"), analyzed(config, "cuda")
    h, h_cpu = host_bytes(gpu.step), host_bytes(cpu.step)
    assert (h.before, h.after) == (h_cpu.before, h_cpu.after) and sum(h.after) > 0
    rows = {r.name: r.size for r in gpu.budget.rank.rows}
    assert rows["master copies"] == rows["optimizer states"] == 0
    # (not to the byte: the CUDA target's attention kernel saves other tensors than the CPU's)
    assert gpu.budget.rank.later_peak_bytes < cpu.budget.rank.later_peak_bytes - sum(h.after) // 2
    assert gpu.memory is not None and gpu.memory.device_total > gpu.memory.run_max_reserved
    plain = analyzed(ds_config(2), "cuda")
    inner = plain.step.ops[plain.step.phase_start["optimizer"]:]
    assert any(str(op.target).startswith("aten._foreach_") for op in inner)  # foreach on the GPU


@pytest.mark.slow  # ~25 s: two Trainer ranks through DeepSpeed on fake tensors
@pytest.mark.heavy  # (CI time) the API's twin above runs in CI
def test_cli_training_args_with_deepspeed_on_the_cuda_target(tmp_path: Any, capsys: Any) -> None:
    """``--training-args`` naming ``deepspeed`` with ``--device cuda``: the CUDA target's figures (its device total,
    the offloaded optimizer as host rows outside them), as graphmem.analyze(device='cuda') gives them."""
    import graphmem
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    model.config.to_json_file(str(tmp_path / "config.json"))
    stage, own, zero, _ = JOBS["zero2-offload"]
    config = ds_config(stage, **own)
    config["zero_optimization"].update(zero)
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "report_to": [], "per_device_train_batch_size": 2,
                                "deepspeed": config}))
    assert main(["analyze", str(tmp_path / "config.json"), "--input-shape", "2x32", "--training-args", str(args),
                 "--world-size", "2", "--device", "cuda", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["exact"]["device"] == "cuda"
    api = graphmem.analyze(model, batch, training_args=trainer_args(str(tmp_path), config), world_size=2, device="cuda")
    details = {d["name"]: d["bytes"] for d in out["budget"]["per_rank"]["details"]}
    assert (details["host (pinned)"], details["host (pageable)"]) == \
        next((d.size, e.size) for d in api.budget.rank.details for e in api.budget.rank.details
             if d.name == "host (pinned)" and e.name == "host (pageable)")


@pytest.mark.slow  # ~50 s: a real 2-process Trainer job and two ranks captured
def test_validate_runs_the_real_trainers_deepspeed_ranks(tmp_path: Any) -> None:
    """graphmem.validate(model, batch, training_args=args naming deepspeed, world_size=2): each rank's prediction
    beside the real Trainer on 2 gloo processes (graphmem/validation/deepspeed_ranks.py
    ``validate_deepspeed_trainer``), ZeRO-3 here: every row of both ranks equal to the byte."""
    import graphmem
    from graphmem.render.validate import render_validation
    from tests.deepspeed_trainer_truth import trainer_args
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    v = graphmem.validate(model, batch, training_args=trainer_args(str(tmp_path), ds_config(3)), world_size=2)
    assert v.ok, v.reason
    for rank in (0, 1):
        for name in ("saved for backward", "before the step", "after the step", "peak", "peak (later steps)"):
            assert v.row(name, rank).difference == 0, (name, rank)
    assert "2 gloo processes: DeepSpeed ZeRO-3 (accelerate)" in render_validation(v)
