"""A Trainer whose TrainingArguments ask for FSDP, per rank: accelerate's own FSDP2 code
(``Accelerator._prepare_fsdp2``: ``fsdp2_prepare_model`` and the optimizer-parameter switch) wraps a
fake copy of the model under graphmem's fake process group (graphmem/training/hf_trainer_fsdp.py,
graphmem/distributed/trainer_fsdp.py), and ``graphmem.validate`` runs the same Trainer on real
gloo CPU ranks set up by the same call (graphmem/validation/trainer_fsdp.py). Measured rows: docs/trainer.md."""
from __future__ import annotations

import json
from typing import Any

import pytest
import torch

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.render.validate import render_validation
from tests.trainers.test_hf_trainer import _gpt2, _llama

transformers = pytest.importorskip("transformers")


def fsdp_args(out: str, **kwargs: Any) -> Any:
    """FSDP2 through the Trainer's arguments (``fsdp=True``, transformers 5's spelling of "full_shard
    auto_wrap"): auto-wrap by the model's ``_no_split_modules``, AdamW,
    clipping, two accumulation steps."""
    return transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0,
                                          gradient_accumulation_steps=2, per_device_train_batch_size=2,
                                          optim="adamw_torch", fsdp=True,
                                          fsdp_config={"version": 2}, **kwargs)


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16))
    return {"input_ids": ids, "labels": ids.clone()}


def test_each_rank_holds_its_shards_wrapped_by_accelerate(tmp_path: Any) -> None:
    """Rank r's parameters, gradients and AdamW states are 1/2 of the model's (every dimension of the tiny
    Llama splits evenly): accelerate's fully_shard ran; its collective buffers are the budget's
    "communication buffers"; the user's model is left as it was."""
    model = _llama()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    for rank in (0, 1):
        r = graphmem.analyze(model, _batch(), training_args=fsdp_args(str(tmp_path)), world_size=2, rank=rank)
        budget = r.budget
        assert budget is not None
        assert budget.row("parameters").size == whole // 2
        assert budget.row("gradients").size == whole // 2
        steps = 4 * len(list(model.parameters()))  # AdamW's step counters, one fp32 scalar per parameter
        assert budget.row("optimizer states").size == 2 * (whole // 2) + steps
        assert budget.row("communication buffers").size > 0
        assert f"FSDP2 (accelerate), rank {rank} of 2" in budget.training.train.describe()
        assert budget.whose == f"FSDP2 (accelerate), rank {rank} of 2"
        assert r.activation_bytes > 0
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_one_process_fsdp_arguments_are_refused_naming_world_size(tmp_path: Any) -> None:
    with pytest.raises(UsageError, match="`world_size`") as e:
        graphmem.analyze(_llama(), _batch(), training_args=fsdp_args(str(tmp_path)))
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="use 0 to 1"):
        graphmem.analyze(_llama(), _batch(), training_args=fsdp_args(str(tmp_path)), world_size=2, rank=2)
    no_fsdp = transformers.TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(UsageError, match="graphmem.analyze\\(trainer\\)"):
        graphmem.analyze(_llama(), _batch(), training_args=no_fsdp, world_size=2)
    with pytest.raises(UsageError, match="drop"):
        graphmem.analyze(_llama(), _batch(), training_args=fsdp_args(str(tmp_path)), world_size=2, optimizer="sgd")
    offload = fsdp_args(str(tmp_path))
    offload.fsdp_config["cpu_offload"] = True  # (read again when each rank rebuilds its arguments)
    with pytest.raises(UsageError, match="not run per rank yet"):
        graphmem.analyze(_llama(), _batch(), training_args=offload, world_size=2)


def test_cli_training_args_with_fsdp(tmp_path: Any, capsys: Any) -> None:
    """``--training-args`` asking for FSDP: one process refused in one line; ``--world-size 2 --rank 1``
    analyzes that rank, the header naming accelerate's FSDP2."""
    _llama().config.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "optim": "adamw_torch",
                                "gradient_accumulation_steps": 2, "max_grad_norm": 1.0, "fsdp": True,
                                "fsdp_config": {"version": 2}}))
    assert main(["analyze", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args", str(args)]) == 2
    err = capsys.readouterr().err
    # one line of graphmem's and no traceback (torchao's first import may log a pytree warning of torch's beside it)
    ours = [line for line in err.splitlines() if line.startswith("graphmem")]
    assert "give --world-size (> 1)" in ours[0] and len(ours) == 1 and "Traceback" not in err, err
    assert main(["analyze", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args", str(args),
                 "--world-size", "2", "--rank", "1"]) == 0
    assert "FSDP2 (accelerate), rank 1 of 2" in capsys.readouterr().out


def _exact(v: Any, gap: int = 0) -> None:
    """Saved, before-step and state bytes exact on both ranks; each peak ``gap`` bytes under the real one."""
    assert v.ok, v.reason
    assert v.ranks == (0, 1)
    for rank in (0, 1):
        for name in ("saved for backward", "before the step", "optimizer states"):
            assert v.row(name, rank).difference == 0, (name, rank)
        for name in ("peak", "peak (later steps)"):
            assert v.row(name, rank).difference == -gap, (name, rank, v.row(name, rank))


@pytest.mark.slow  # ~120 s each: a real 2-process gloo job
@pytest.mark.parametrize("accumulation", [2, pytest.param(4, marks=pytest.mark.heavy)])  # heavy: ~55 s
def test_tiny_llama_fsdp_ranks_against_a_real_gloo_job(tmp_path: Any, accumulation: int) -> None:
    """Every row exact on both ranks; with 4 micro-batches accelerate's ``no_sync`` (FSDP2's
    ``set_requires_gradient_sync(False)``) keeps the unsharded gradients between them, traced as the
    first, a middle and the last micro-step."""
    args = fsdp_args(str(tmp_path))
    args.gradient_accumulation_steps = accumulation
    v = graphmem.validate(_llama(), _batch(), training_args=args, world_size=2)
    print(render_validation(v))
    _exact(v)
    assert "2 gloo processes: FSDP2 (accelerate)" in render_validation(v)


@pytest.mark.slow  # ~120 s: a real 2-process gloo job
def test_gpt2_fsdp_ranks_in_bf16_against_a_real_gloo_job(tmp_path: Any) -> None:
    """bf16: accelerate's MixedPrecisionPolicy (bf16 parameters in compute, fp32 shards) on CPU; tied
    embeddings (accelerate's tail unit holds the embedding with the LM head). The peaks are exact: HF
    GPT-2's NewGELUActivation multiplies by three Python floats that eager wraps in 0-dim float64
    tensors (8 B each), kept by MulBackward0 (2 blocks x 3 x 8 B), which read 48 B under the real
    peaks until the capture counted them (graphmem/capture/wrapped_numbers.py)."""
    v = graphmem.validate(_gpt2(), _batch(), training_args=fsdp_args(str(tmp_path), bf16=True), world_size=2)
    print(render_validation(v))
    _exact(v)
    assert "bf16 MixedPrecisionPolicy" in render_validation(v)


@pytest.mark.slow  # ~2.5 min each: a real 2-process gloo job, each rank compiling first
# heavy (pyproject.toml): 2 to 5.5 minutes each; CI runs the bf16 aot_eager case
@pytest.mark.parametrize("backend,bf16", [pytest.param("aot_eager", False, marks=pytest.mark.heavy), ("aot_eager", True),
                                          pytest.param("inductor", False, marks=pytest.mark.heavy)])
def test_tiny_llama_fsdp_ranks_compiled_against_a_real_gloo_job(tmp_path: Any, backend: str, bf16: bool) -> None:
    """``torch_compile``: accelerate's ``_prepare_fsdp2`` compiles the model, then fully_shard's it; dynamo
    breaks at FSDP2's disabled hooks on both sides (graphmem/distributed/trainer_fsdp_compiled.py). Every
    row exact on both ranks (Inductor's peaks are shown without a verdict: measured equal here, the
    peaks fall at FSDP2's collectives, outside its fused kernels). The compiled graphs' nodes are named
    by their full module paths (the FSDP unit entered at its unshard)."""
    args = fsdp_args(str(tmp_path), torch_compile=True, torch_compile_backend=backend, bf16=bf16)
    v = graphmem.validate(_llama(), _batch(), training_args=args, world_size=2)
    print(render_validation(v))
    _exact(v)
    assert f"torch.compile ({backend}), FSDP2 (accelerate)" in render_validation(v)
    report = v.report
    assert report is not None and report.step is not None
    modules = {s.module for s in report.step.storages.values() if s.kind == "activation"}
    assert "model.layers.1.mlp.gate_proj" in modules and "mlp.gate_proj" not in modules
