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
