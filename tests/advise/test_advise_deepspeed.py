"""``report.advise`` on a DeepSpeed job's rank (graphmem/advise/deepspeed_levers.py): each lever that changes
the job's DeepSpeed config is DeepSpeed's engine run again with that config, what ``graphmem.analyze`` of the
changed job prints; the bucket lever is the one that fits where DeepSpeed's default 5e8-element reduce bucket
does not, and a real 2-rank gloo run of the chosen config confirms its peak."""
from __future__ import annotations

import json
from typing import Any

import pytest

from graphmem.errors import UsageError

pytest.importorskip("deepspeed")

# DeepSpeed's defaults on ZeRO-2: the 5e8-element reduce bucket (2 GB of fp32) is the rank's peak
CONFIG = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}
LIMIT = 50_000_000  # between the bucket lever's peak (a few MB) and every other row's (bf16's bucket: 1 GB)
BUCKET = 64 * 64  # the decoder's hidden_size², the bucket the lever sets


@pytest.fixture(scope="module")
def advised() -> Any:
    import graphmem
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    report = graphmem.analyze(model, batch, device="cpu", deepspeed=CONFIG, world_size=2, rank=0, optimizer="adamw")
    return report, report.advise(memory=LIMIT)


def _changed(**zero: Any) -> dict:
    return {**CONFIG, "zero_optimization": {**CONFIG["zero_optimization"], **zero}}


@pytest.mark.slow  # the job and each lever: DeepSpeed's engine on fake tensors, twice a setting (first and later step)
def test_each_deepspeed_lever_is_the_changed_job_analyzed(advised: Any) -> None:
    """GIVEN ZeRO-2 with DeepSpeed's default buckets, rank 0 of 2, on a tiny transformers Llama
    WHEN advise weighs the job's config levers
    THEN each row's peak is ``graphmem.analyze`` of the job with that config change, to the byte (ZeRO-3, which
    keeps the default bucket, is left out with its peak); what cannot apply is a row with its reason; CPU
    offload is the job with its torch optimizer on the host."""
    import graphmem
    from graphmem.units import fmt_bytes
    from tests.deepspeed_truth import decoder

    report, advice = advised
    rows = {r.name: r for r in advice.levers}
    expected = {f"buckets of {BUCKET:,} elements": _changed(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET),
                "DeepSpeed bf16": {**CONFIG, "bf16": {"enabled": True}},
                "2 micro-batches of 1": {**CONFIG, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2}}
    assert set(expected) <= set(rows), sorted(rows)
    for name, config in expected.items():
        model, batch = decoder()
        if name.startswith("2 micro-batches"):
            ids = batch["input_ids"][:1].clone()
            batch = {"input_ids": ids, "labels": ids}  # (one tensor, as decoder()'s and graphmem's resized batch)
        r = graphmem.analyze(model, batch, device="cpu", deepspeed=config, world_size=2, rank=0, optimizer="adamw")
        assert rows[name].peak_bytes == r.memory.figure("allocated"), name
        key = next(k for k in ("stage", "reduce_bucket_size", "bf16", "gradient_accumulation_steps", "offload_optimizer")
                   if k in rows[name].how)
        assert rows[name].how.startswith("DeepSpeed config") and key in rows[name].how
    why = {x.kind: x.why for x in advice.left_out}
    # ZeRO-3 keeps DeepSpeed's default 5e8-element reduce bucket: captured, and left out as its peak does not drop
    zero3 = graphmem.analyze(*decoder(), device="cpu", deepspeed=_changed(stage=3), world_size=2, rank=0, optimizer="adamw")
    assert why["zero stage"] == f"ZeRO-3 instead of ZeRO-2: the peak does not drop " \
        f"({fmt_bytes(zero3.memory.figure('allocated'))})"
    assert "not applicable" in why["sharding"] and "not applicable" in why["checkpoint"]
    # CPU offload: the job with its torch optimizer on the host, captured (on the CPU target the host bytes are the
    # allocator's too: a row where its peak drops, else left out with that peak)
    offloaded = graphmem.analyze(*decoder(), device="cpu", deepspeed={**_changed(offload_optimizer={"device": "cpu", "pin_memory": True}),
                                                       "zero_force_ds_cpu_optimizer": False},
                                 world_size=2, rank=0, optimizer="adamw").memory.figure("allocated")
    row = rows.get("optimizer offloaded to the CPU")
    assert (row is not None and row.peak_bytes == offloaded and "offload_optimizer" in row.how) or \
        why.get("offload") == f"optimizer offloaded to the CPU: the peak does not drop ({fmt_bytes(offloaded)})", \
        why.get("offload")
    assert "overlap_comm is off" in why["overlap_comm"]
    assert any("DeepSpeed rows" in n for n in advice.notes)


@pytest.mark.slow  # + one real 2-rank gloo DeepSpeed run
def test_the_bucket_lever_fits_and_a_real_run_confirms_it(advised: Any) -> None:
    """GIVEN the same job at a memory limit between the bucket lever's peak and the other rows'
    WHEN advise answers
    THEN its choice is the bucket lever, and real DeepSpeed on 2 gloo processes with that config peaks (rank 0,
    the higher of its first and second steps) within 1 % of the lever's figure (the later step: graphmem's second
    capture reads at most 2 % below the real one, docs/deepspeed.md)."""
    from tests.deepspeed_truth import measure_ds_ranks

    report, advice = advised
    assert report.peak_bytes > 2_000_000_000 > LIMIT  # DeepSpeed's default bucket
    choice = advice.choice
    assert choice is not None and choice.kind == "buckets" and choice.fits, advice.answer
    assert [r.name for r in advice.levers if r.fits] == [choice.name]
    (rank0, _), = measure_ds_ranks([_changed(reduce_bucket_size=BUCKET, allgather_bucket_size=BUCKET)])
    real = max(rank0["first"]["peak"], rank0["later"]["peak"])
    print(json.dumps({"graphmem": choice.peak_bytes, "real": rank0}))  # (shown with -s)
    assert abs(choice.peak_bytes - real) <= 0.01 * real


def test_deepspeed_refusing_a_combination_is_one_line() -> None:
    """A torch.optim class DeepSpeed has not tested under ZeRO (Adafactor) without its
    ``zero_allow_untested_optimizer``: DeepSpeed's own assertion, as one line naming the key."""
    import graphmem
    from tests.deepspeed_truth import decoder

    model, batch = decoder()
    with pytest.raises(UsageError) as e:
        graphmem.analyze(model, batch, device="cpu", deepspeed=CONFIG, world_size=2, rank=0, optimizer="adafactor")
    assert "zero_allow_untested_optimizer" in str(e.value) and "\n" not in str(e.value)


def test_the_cli_refuses_deepspeed_with_formula_sharding(tmp_path: Any, capsys: Any) -> None:
    """``graphmem advise ... --deepspeed cfg --zero 2``: one line on stderr, exit 2, before any capture."""
    from graphmem.cli.main import main

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(CONFIG))
    code = main(["advise", "models/gpt2.py", "--input-shape", "2x32", "--deepspeed", str(path), "--world-size", "2",
                 "--zero", "2", "--optimizer", "adamw", "--memory", "1GB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "zero_optimization.stage" in err and len(err.splitlines()) == 1


@pytest.mark.slow  # ~30 s: the job and its levers through DeepSpeed's engine on the CUDA target
def test_the_offload_lever_on_the_cuda_target_is_the_gpus_figure() -> None:
    """GIVEN ZeRO-1 with small buckets on the CUDA target, a limit just under the job's later steps' peak
    WHEN advised on the allocated figure
    THEN the offload row is ``graphmem.analyze(device='cuda')`` of the job with the optimizer on the host: the GPU's
    figure, the host's bytes outside it (graphmem/deepspeed/host.py), below the job's by the host's states."""
    import graphmem
    from tests.deepspeed_truth import decoder

    buckets = {"reduce_bucket_size": 10000, "allgather_bucket_size": 10000}
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1, **buckets}}
    report = graphmem.analyze(*decoder(), deepspeed=config, world_size=2, rank=0, optimizer="adamw", device="cuda")
    advice = report.advise(memory=report.budget.rank.later_peak_bytes - 1000, figure="allocated")
    row = next(r for r in advice.levers if r.name == "optimizer offloaded to the CPU")
    offloaded = {**config, "zero_force_ds_cpu_optimizer": False,
                 "zero_optimization": {**config["zero_optimization"], "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    gpu = graphmem.analyze(*decoder(), deepspeed=offloaded, world_size=2, rank=0, optimizer="adamw", device="cuda")
    assert row.peak_bytes == gpu.memory.figure("allocated") and row.fits
    host = next(d.size for d in gpu.budget.rank.details if d.name == "host (pinned)")
    assert gpu.memory.figure("allocated") < report.memory.figure("allocated") and host > 0
