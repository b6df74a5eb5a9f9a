"""The engine's in-place gradient sums (torch/csrc/autograd/input_buffer.cpp, InputBuffer::add →
accumulate: ``old.add_(new)`` when the engine holds the only reference to the buffered gradient
and its storage, it is dense and no subclass) as graphmem's capture records them
(graphmem/capture/recorder.py ``_accumulates_inplace``): the engine's sums are told from the
model's adds by a post hook on every autograd node (graphmem/capture/autograd_tags.py
``_tag_grad_fns``), so every node a module made must be tagged, including those behind an inner
module's nodes (a scan's slices feeding the output projection). Ground truth: a real CPU step.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.validation.measure import measure_peak

STEPS = 16


class Scan(nn.Module):
    """One tensor fans out to ``STEPS`` consumers (``a[:, i]``, ``u[:, i]``): the engine sums
    their ``STEPS`` full-size gradients into ``a``'s and ``u``'s input buffers. The scan's ops are
    the module's own and lie behind ``out``'s nodes."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (b, STEPS, d)
        a, u = self.inp(x).sigmoid().chunk(2, dim=-1)  # (b, STEPS, d) each
        h = torch.zeros_like(a[:, 0])
        hs = []
        for i in range(a.shape[1]):
            h = a[:, i] * h + u[:, i]
            hs.append(h)
        return self.out(torch.stack(hs, dim=1))


def _scan() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return nn.Sequential(Scan(), Scan()), (torch.randn(4, STEPS, 64),)


def _mamba() -> tuple[nn.Module, tuple]:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.MambaConfig(vocab_size=128, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                   conv_kernel=4, use_mambapy=False)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return transformers.MambaForCausalLM(cfg), (ids,)


@pytest.mark.parametrize("build", [_scan, _mamba], ids=["fan_out_scan", "hf_mamba_slow_path"])
def test_fan_out_sums_in_place_as_a_real_step(build: object) -> None:
    # GIVEN a model whose tensors fan out to many consumers inside a module, behind an inner
    # module's nodes (transformers' Mamba without its CUDA kernels: the selective scan's Python loop)
    model, inputs = build()  # type: ignore[operator]
    # WHEN graphmem captures the step and a real CPU step is measured
    report = graphmem.analyze(model, inputs)
    assert report.step is not None
    report.step.check()
    real = measure_peak(model, inputs)
    # THEN the saved bytes and the peak are exact (Mamba was 7.05 % over: the sums out of place)
    assert report.activation_bytes == real.saved_bytes
    assert report.peak_bytes == real.peak_bytes


def test_the_engine_sums_of_a_scan_are_in_place_and_belong_to_the_module() -> None:
    model, inputs = _scan()
    step = graphmem.analyze(model, inputs).step
    assert step is not None
    backward = [op for op in step.ops if op.meta["phase"] == "backward"]
    sums = [op for op in backward if op.target is torch.ops.aten.add_.Tensor]
    # a's and u's buffers in each block: the slices' full-size (b, STEPS, d) gradients, in place
    assert sorted(op.meta["shape"] for op in sums) == [(4, STEPS, 64)] * (2 * 2 * (STEPS - 1))
    # h's buffer sums out of place, as the engine does: its first gradient is a view of
    # stack's gradient (unbind), whose storage the engine does not hold alone
    kept = [op for op in backward if op.target is torch.ops.aten.add.Tensor]
    assert sorted(op.meta["shape"] for op in kept) == [(4, 64)] * (2 * (STEPS - 1))
    # the scan's backward ops carry its module's path, not the root's
    assert {op.meta["module"] for op in sums} == {"0", "1"}
    mul = [op.meta["module"] for op in backward if op.target is torch.ops.aten.mul.Tensor]
    assert mul and set(mul) == {"0", "1"}
