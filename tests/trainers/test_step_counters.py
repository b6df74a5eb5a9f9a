"""Where torch.optim keeps Adam/AdamW's step counters (torch/optim/adam.py ``_init_group``):
``torch.tensor(0.0, device="cpu")`` for the for-loop and foreach implementations (host memory
whatever the parameters' device), ``torch.zeros((), device=p.device)`` when fused. On the CPU
target every counter is CPU memory (4 B each, as a real CPU step has: tests/trainers/test_training.py);
on the CUDA target only fused ones take device bytes."""
from __future__ import annotations

import pytest
import torch

import graphmem


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))  # 4 parameters


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
@pytest.mark.parametrize("impl,on_cuda", [("forloop", 0), ("foreach", 0), ("fused", 4 * 4)])
def test_step_counters_on_the_device_the_implementation_uses(optimizer: str, impl: str, on_cuda: int) -> None:
    cpu = graphmem.analyze(_net(), (torch.randn(8, 16),), optimizer=optimizer, optimizer_impl=impl)
    cuda = graphmem.analyze(_net(), (torch.randn(8, 16),), device="cuda", optimizer=optimizer, optimizer_impl=impl)
    assert cpu.budget.rank.step_counter_bytes == 4 * 4
    assert cuda.budget.rank.step_counter_bytes == on_cuda
    # the rest of the states are the same bytes on both targets: exp_avg and exp_avg_sq, fp32
    states = cpu.budget.row("optimizer states").size - 16
    assert cuda.budget.row("optimizer states").size == states + on_cuda
    steps = [s for s in cuda.step.storages.values() if s.name.endswith("host memory)")]
    assert len(steps) == (4 if on_cuda == 0 else 0)


def test_real_cpu_optimizer_keeps_forloop_and_foreach_counters_on_the_host() -> None:
    """The rule's premise on real tensors: the non-fused counters are CPU tensors made with an
    explicit device="cpu" (so they stay on the host for CUDA parameters too); fused ones follow p."""
    for flags in ({"foreach": False}, {"foreach": True}, {"fused": True}):
        net = _net()
        opt = torch.optim.Adam(net.parameters(), **flags)
        net(torch.randn(8, 16)).sum().backward()
        opt.step()
        steps = [st["step"] for st in opt.state.values()]
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 and t.numel() == 1 for t in steps)
