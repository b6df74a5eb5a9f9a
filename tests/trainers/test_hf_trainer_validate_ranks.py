"""``graphmem.validate(trainer, world_size=N)`` and ``graphmem validate MODEL --training-args args.json
--world-size N [--rank R]``: each rank's prediction beside a real job of N gloo CPU processes in which
every rank rebuilds the Trainer and accelerate wraps DDP itself (graphmem/validation/trainer_ranks.py).
The figures agree with the test harness's own real job (tests/trainer_truth.py, docs/trainer.md)."""
from __future__ import annotations

import json
import tempfile
from typing import Any

import pytest
import torch

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.frontends.trainer import trainer_batch
from graphmem.render.validate import render_validation
from tests.trainers.test_hf_trainer import _llama
from tests.trainers.test_hf_trainer_ranks import llama_trainer

transformers = pytest.importorskip("transformers")


@pytest.mark.slow  # ~100 s: a real 2-process gloo job, 6 fresh Trainers per rank
def test_two_ranks_of_the_tiny_llama_trainer_against_a_real_ddp_job() -> None:
    """Saved and before-step bytes exact on both ranks, peaks within validate's 1 %; the real bytes
    before the step exceed one process's by at least DDP's buckets (the prediction's "communication
    buffers"; the used-parameter maps come on top): the real run is DDP, not the one-process step."""
    with tempfile.TemporaryDirectory() as out:
        trainer = llama_trainer(out)
        torch.manual_seed(0)
        v = graphmem.validate(trainer, input_shape=(2, 16), world_size=2)
        one = graphmem.analyze(trainer, input_shape=(2, 16))
    assert v.ok, v.reason
    assert v.ranks == (0, 1)
    assert v.report is not None and v.report.budget is not None
    buffers = v.report.budget.row("communication buffers").size
    assert buffers > 0
    for rank in (0, 1):
        for name in ("saved for backward", "before the step", "optimizer states"):
            assert v.row(name, rank).difference == 0
        for name in ("peak", "peak (later steps)"):
            row = v.row(name, rank)
            assert row.difference <= 0 and -row.difference <= 0.01 * row.measured
        # the real job holds DDP's bucket (107,136 B here) and used-parameter maps before the step
        assert v.row("before the step", rank).measured - one.baseline_bytes >= buffers
    text = render_validation(v)
    print(text)
    assert "2 gloo processes: DistributedDataParallel" in text and "accelerate wrapping DDP" in text


@pytest.mark.slow  # ~100 s: a real 2-process gloo job
def test_cli_validates_one_rank_of_the_training_args_ddp_job(tmp_path: Any, capsys: Any) -> None:
    """graphmem validate CONFIG --training-args args.json --world-size 2 --rank 1: rank 1's rows only."""
    _llama().config.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "optim": "adamw_torch",
                                "gradient_accumulation_steps": 2, "max_grad_norm": 1.0}))
    assert main(["validate", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args", str(args),
                 "--world-size", "2", "--rank", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["validation"]["rows"]
    assert {r["rank"] for r in rows} == {1} and len(rows) == 5
    by = {r["name"]: r for r in rows}
    assert by["saved for backward"]["difference"] == 0 and by["before the step"]["difference"] == 0
    assert all(r["ok"] for r in rows)


def _refused(trainer: Any, fix: str, **options: Any) -> None:
    torch.manual_seed(0)
    batch = trainer_batch(llama_trainer(trainer.args.output_dir), (2, 16))
    with pytest.raises(UsageError, match=fix) as e:
        graphmem.validate(trainer, batch, **options)
    assert "\n" not in str(e.value)


def test_what_the_ranks_cannot_rebuild_is_refused_in_one_line(tmp_path: Any) -> None:
    trainer = llama_trainer(str(tmp_path))
    _refused(trainer, "`world_size` must be a positive integer", world_size=0)
    _refused(trainer, "use 0 to 1", world_size=2, rank=2)
    _refused(trainer, "drop it", world_size=2, optimizer="sgd")

    base: Any = transformers.Trainer

    class Mine(base):  # defined in a function: no rank can import it by name
        pass

    _refused(Mine(model=_llama(), args=trainer.args), "define it at module level", world_size=2)
    model = _llama()
    given = transformers.Trainer(model=model, args=trainer.args,
                                 optimizers=(torch.optim.SGD(model.parameters(), lr=0.1), None))
    _refused(given, "drop `optimizers=`", world_size=2)

    class Wrapper(torch.nn.Module):  # an unpicklable model
        def __init__(self) -> None:
            super().__init__()
            self.inner = _llama()

        def forward(self, **kwargs: Any) -> Any:
            return self.inner(**kwargs)

    _refused(transformers.Trainer(model=Wrapper(), args=trainer.args), "not picklable", world_size=2)


def test_cli_refuses_other_splits_with_training_args(tmp_path: Any, capsys: Any) -> None:
    _llama().config.to_json_file(str(tmp_path / "config.json"))
    args = tmp_path / "args.json"
    args.write_text(json.dumps({"output_dir": str(tmp_path), "use_cpu": True, "report_to": []}))
    assert main(["validate", str(tmp_path / "config.json"), "--input-shape", "2x16", "--training-args", str(args),
                 "--world-size", "2", "--fsdp"]) == 2
    err = capsys.readouterr().err
    assert "drop --fsdp" in err and err.count("\n") == 1
