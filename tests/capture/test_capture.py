"""Capture details: module attribution of backward ops."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphmem


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # the mul belongs to SwiGLU, not to w2


def test_backward_ops_carry_the_module_that_ran_their_forward_op() -> None:
    g = graphmem.analyze(SwiGLU(), (torch.randn(4, 8),)).step
    fwd = {n.target: n.meta["module"] for n in g.ops if n.meta["phase"] == "forward"}
    assert fwd[torch.ops.aten.mul.Tensor] == ""
    bwd = [n for n in g.ops if n.meta["phase"] == "backward"]
    # MulBackward0 runs two muls: both belong to the root module, where the forward mul ran
    muls = [n.meta["module"] for n in bwd if n.target is torch.ops.aten.mul.Tensor]
    assert muls == ["", ""]
    assert {n.meta["module"] for n in bwd if n.target is torch.ops.aten.silu_backward.default} == {""}
    mms = {n.meta["module"] for n in bwd if n.target is torch.ops.aten.mm.default}
    assert mms == {"w1", "w2", "w3"}
