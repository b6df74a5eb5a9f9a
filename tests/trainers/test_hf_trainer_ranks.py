"""``graphmem.analyze(trainer, world_size=N, rank=r)``: a transformers Trainer's step as rank r of a DDP
job runs it (graphmem/training/hf_trainer_ddp.py: torch's DistributedDataParallel under the fake
process group), against the same Trainer launched for real on 2 CPU processes over gloo
(tests/trainer_truth.py): saved bytes and the bytes held before the step to the byte, the peaks
within ``PEAK_TOLERANCE``; the gaps measured are in docs/trainer.md."""
from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

import graphmem
from graphmem.errors import UsageError
from graphmem.frontends.trainer import trainer_batch
from graphmem.render import render_text
from graphmem.training.hf_trainer_ddp import BUCKET
from tests.trainers.test_hf_trainer import _gpt2, _llama  # the one-process Trainer tests' tiny models

transformers = pytest.importorskip("transformers")
PEAK_TOLERANCE = 0.01  # the brief's 1 %; the gaps measured are bytes (docs/trainer.md)


def llama_trainer(out: str) -> Any:
    """The tiny Llama of tests/trainers/test_hf_trainer.py, AdamW, clipping, 2 accumulation steps (module level:
    spawned ranks build it)."""
    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True,
                                          max_grad_norm=1.0, gradient_accumulation_steps=2, optim="adamw_torch",
                                          per_device_train_batch_size=2)
    return transformers.Trainer(model=_llama(), args=args)


def gpt2_checkpointing_trainer(out: str) -> Any:
    """GPT-2 with gradient checkpointing (so find_unused_parameters=False), one micro-batch."""
    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True,
                                          max_grad_norm=1.0, optim="adamw_torch", per_device_train_batch_size=2,
                                          gradient_checkpointing=True)
    return transformers.Trainer(model=_gpt2(), args=args)


def llama_four_steps_trainer(out: str) -> Any:
    """4 accumulation steps (the capture traces 2; 3 run under no_sync for real), and
    ``ddp_find_unused_parameters=False``: no used-parameter maps, DDP rebuilds its buckets in step 2."""
    torch.manual_seed(0)
    args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True, max_grad_norm=1.0,
                                          gradient_accumulation_steps=4, optim="adamw_torch",
                                          per_device_train_batch_size=2, ddp_find_unused_parameters=False)
    return transformers.Trainer(model=_llama(), args=args)


def _predicted(make: Any, world_size: int, rank: int) -> Any:
    with tempfile.TemporaryDirectory() as out:
        trainer = make(out)
        torch.manual_seed(0)
        batch = trainer_batch(trainer, (2, 16))
        return graphmem.analyze(trainer, batch, world_size=world_size, rank=rank)


def test_ddp_rank_holds_the_buckets_and_names_them() -> None:
    """Per rank, DDP's Reducer holds one flat bucket as large as the gradients (here one, under the
    1 MiB first bucket) from before the step: one device's peak plus the bucket, nothing divided."""
    one, rank1 = _predicted(llama_trainer, 1, 0), _predicted(llama_trainer, 2, 1)
    grads = one.budget.row("gradients").size
    buckets = [t for t in rank1.step.storages.values() if t.name.startswith(BUCKET)]
    assert [t.nbytes for t in buckets] == [grads] and buckets[0].created < 0 and buckets[0].kind == "communication"
    assert rank1.activation_bytes == one.activation_bytes
    assert rank1.budget.peak_bytes >= one.budget.peak_bytes + grads
    # the bucket is a budget row of its own, not a temporary; one device's step has no such row
    assert rank1.budget.row("communication buffers").size == grads
    assert rank1.budget.row("temporaries").size < grads
    assert sum(r.at_peak for r in rank1.budget.rows) == rank1.budget.peak_bytes
    assert "communication buffers" not in [r.name for r in one.budget.rows]
    d = rank1.to_dict()["budget"]
    assert d["ddp"] == {"world_size": 2, "rank": 1} and "DistributedDataParallel, rank 1 of 2" in render_text(rank1)
    # the budget is rank 1's, so named (graphmem/training/hf_trainer_ddp.py TrainerDDP), not one device's "1 rank"
    assert rank1.budget.whose == "DDP (accelerate), rank 1 of 2" and d["rank"] == rank1.budget.whose
    assert "· 1 rank" not in render_text(rank1) and one.budget.whose == ""


def test_ddp_rank_is_its_own_parallel_setting() -> None:
    """A Trainer's DDP rank is a Parallelism variant (graphmem/training/hf_trainer_ddp.py TrainerDDP), not one
    device: the spec says which rank of how many, and on the CUDA target the job's process group gets its NCCL
    communicator's row, which one device's step does not have."""
    from graphmem.frontends.door import spec_for
    from graphmem.step.spec import Single
    from graphmem.training.hf_trainer_ddp import TrainerDDP

    with tempfile.TemporaryDirectory() as out:
        trainer = llama_trainer(out)
        batch = trainer_batch(trainer, (2, 16))
        assert spec_for(trainer, batch, world_size=2, rank=1).parallel == TrainerDDP(2, 1)
        assert spec_for(trainer, batch).parallel == Single()
        rows = {n: [r.name for r in graphmem.analyze(trainer, batch, device="cuda", **o).memory.rows]
                for n, o in (("one", {}), ("rank", {"world_size": 2, "rank": 1}))}
        spec = spec_for(trainer, batch, world_size=2, rank=1)
    assert [n for n in rows["rank"] if n not in rows["one"]] == ["nccl world", "torch_distributed"]
    with pytest.raises(UsageError, match="needs the Trainer's step built for it"):
        spec.replace(parallel=TrainerDDP(4, 1))  # the step runs as rank 1 of 2: no other rank can be claimed


def test_bad_ranks_are_one_line() -> None:
    with tempfile.TemporaryDirectory() as out:
        trainer = llama_trainer(out)
        for options, fix in (({"world_size": 0}, "`world_size`"), ({"world_size": 2, "rank": 2}, "use 0 to 1"),
                             ({"world_size": 2, "zero": 1}, "drop zero")):
            with pytest.raises(UsageError, match=fix) as e:
                graphmem.analyze(trainer, input_shape=(2, 16), **options)
            assert "\n" not in str(e.value)


@pytest.mark.slow  # ~45 s each: a real 2-process gloo job, its steps run 3 times per rank
@pytest.mark.parametrize("make", [llama_trainer, llama_four_steps_trainer, gpt2_checkpointing_trainer],
                         ids=["llama", "llama-4-steps", "gpt2-checkpointing"])
def test_ddp_ranks_match_a_real_two_process_trainer(make: Any) -> None:
    from tests.trainer_truth import real_trainer_ranks

    real = real_trainer_ranks(make, world_size=2)
    for rank, got in enumerate(real):
        r = _predicted(make, 2, rank)
        b = r.budget.rank
        print(f"rank {rank}: saved {r.activation_bytes} / {got['saved']}, held {r.baseline_bytes} / {got['built']}, "
              f"peak {b.peak_bytes} / {got['peak']}, later {b.later_peak_bytes} / {got['later']}")
        assert r.activation_bytes == got["saved"]
        assert r.baseline_bytes == got["built"]
        assert abs(got["peak"] - b.peak_bytes) <= PEAK_TOLERANCE * got["peak"]
        assert abs(got["later"] - b.later_peak_bytes) <= PEAK_TOLERANCE * got["later"]


def test_training_args_file_with_world_size_from_the_cli(tmp_path: Any, capsys: Any) -> None:
    """graphmem analyze MODEL --training-args args.json --world-size 2 --rank 1: the loaded (meta) model's
    Trainer as rank 1 of a DDP job, GPT-2's gradients in DDP's buckets (``bucket_cap_mb`` 25) live at
    the peak; the formulas' options, and FSDP arguments in one process, are refused in one line."""
    import json

    from graphmem.cli.main import main

    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "optim": "adamw_torch"}))
    base = ["analyze", "hf-gpt2", "--input-shape", "2x32", "--training-args", str(args)]
    assert main([*base, "--world-size", "2", "--rank", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["budget"]["ddp"] == {"world_size": 2, "rank": 1}
    buckets = [t for t in d["peak"]["live"] if t["name"].startswith(BUCKET)]  # 25 MiB each, the first 1 MiB
    assert len(buckets) > 1 and sum(t["bytes"] for t in buckets) == d["gradient_bytes"]
    assert main([*base, "--world-size", "2", "--zero", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--training-args" in err[0] and "drop --zero" in err[0]
    fsdp = tmp_path / "fsdp.json"
    fsdp.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "fsdp": "full_shard",
                                "fsdp_config": {"fsdp_version": 2}}))
    assert main(["analyze", "hf-gpt2", "--input-shape", "2x32", "--training-args", str(fsdp)]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # (per rank they run: tests/trainers/test_hf_trainer_fsdp.py)
    assert len(err) == 1 and "FSDP" in err[0] and "--world-size" in err[0]
