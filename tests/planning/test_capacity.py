"""Each card's capacity (graphmem/capture/target.py ``CAPACITY``): the budget that fit, plan and advise
compare the device total with when the user names the card (``gpu``) or, for fit and advise on the
CUDA target, gives no size; the report says whether the run fits the card.
"""
from __future__ import annotations

import json

import pytest
import torch

import graphmem
from graphmem.capture.target import CAPACITY, GPUS, make_target, memory_limit
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.units import fmt_bytes


def _net() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64)), (torch.randn(32, 64),)


def test_every_gpu_has_a_sourced_capacity_below_its_marketed_size() -> None:
    assert set(CAPACITY) == set(GPUS)
    marketed = {"v100": 16, "v100-32gb": 32, "t4": 16, "a100": 80, "a100-40gb": 40, "a10": 24, "l4": 24, "h100": 80,
                "h200": 141, "b200": 192}  # GB (10^9 B) on NVIDIA's data sheets: CUDA's total is a little less
    for gpu, (nbytes, source) in CAPACITY.items():
        assert 0.9 * marketed[gpu] * 1e9 < nbytes < marketed[gpu] * 2 ** 30, gpu
        assert "github.com/" in source, gpu
    assert CAPACITY["l4"][0] == 23_570_219_008  # deviceQuery's "(23570219008 bytes)"


def test_gpu_names_the_card_and_a_size_stays_a_size() -> None:
    l4 = make_target("cuda", gpu="l4")
    assert memory_limit("gpu", l4) == memory_limit(None, l4) == CAPACITY["l4"][0]
    assert memory_limit("24GB", l4) == 24 * 10 ** 9
    with pytest.raises(UsageError, match="CPU target has no card"):
        memory_limit("gpu", make_target("cpu"))
    with pytest.raises(UsageError, match="no unit"):
        memory_limit("24", l4)


def test_fit_plan_and_advise_take_the_card() -> None:
    net, inputs = _net()
    r = graphmem.analyze(net, inputs, device="cuda", gpu="t4", optimizer="adamw")
    t4 = CAPACITY["t4"][0]
    fit = r.fit("gpu")
    assert fit.memory == t4 and fit.figure == "device" and fit.figure_bytes <= t4 < fit.figure_above
    assert r.advise("gpu").memory == t4
    assert r.memory.device_total <= t4 and "the t4's capacity 14.56 GiB (CUDA's total), fits" in str(r)


def test_cli_fit_and_advise_default_to_the_card_on_cuda_and_refuse_no_size_on_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["fit", "mlp-mnist", "--input-shape", "64x784", "--device", "cuda", "--gpu", "a10", "--json"]
    assert main(args) == 0
    fit = json.loads(capsys.readouterr().out)["fit"]
    assert fit["memory_bytes"] == CAPACITY["a10"][0] and fit["figure"] == "device"
    for command in (["fit", "mlp-mnist", "--input-shape", "64x784"], ["advise", "mlp-mnist", "--input-shape", "64x784"],
                    ["analyze", "mlp-mnist", "--input-shape", "64x784", "--plan", "--budget", "gpu"]):
        assert main(command) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "needs --device cuda" in err, err


def test_advise_on_cuda_judges_each_setting_on_its_device_total() -> None:
    """Each lever's figure is what ``graphmem.analyze`` of that setting reports as its device total
    (the caching allocator's reserved bytes plus the rows outside it: a sharding lever's NCCL
    communicator included); the answer names the figure."""
    torch.manual_seed(0)  # large enough for the states to move whole 2 MiB segments
    net = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    inputs = (torch.randn(64, 1024),)
    r = graphmem.analyze(net, inputs, device="cuda", optimizer="adamw")
    advice = r.advise(memory=r.memory.device_total - 1)
    assert advice.figure == "device" and advice.base_peak == r.memory.device_total
    rows = {row.name: row.peak_bytes for row in advice.levers}
    other = graphmem.analyze(net, inputs, device="cuda", optimizer="adafactor").memory
    assert rows["adafactor instead of adamw"] == other.device_total
    zero = graphmem.analyze(net, inputs, device="cuda", optimizer="adamw", world_size=8, zero=2).memory
    assert any(x.name.startswith("nccl") for x in zero.rows)  # its communicator (294 MiB) outweighs the states here
    assert f"ZeRO-2 over 8 ranks: the peak does not drop ({fmt_bytes(zero.device_total)})" in \
        [x.why for x in advice.left_out]
    assert "device total" in advice.answer
    allocated = r.advise(memory=r.memory.device_total - 1, figure="allocated")
    assert allocated.base_peak == r.memory.run_max_allocated and "the step already fits: peak" in allocated.answer
