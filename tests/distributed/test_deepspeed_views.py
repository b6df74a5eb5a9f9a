"""DeepSpeed's views and cats by the meta kernel (graphmem/deepspeed/views.py) are FakeTensorMode's own answer."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from graphmem.capture.values import VALUE
from graphmem.deepspeed.views import device_of, fast_view, valueless_view

SLICE, VIEW, DETACH = torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default


def _described(t: torch.Tensor) -> tuple:
    return (type(t), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad,
            t.untyped_storage()._cdata, t.untyped_storage().nbytes())


@pytest.mark.parametrize("func, args", [
    (SLICE, (0, 64, 128)), (SLICE, (0, 1000, 2000)), (SLICE, (1, 3, None, 2)), (SLICE, (-1, -5, -1)),
    (SLICE, (0, 0, 0)), (SLICE, (1,)), (VIEW, ([-1],)), (VIEW, ([64, -1, 2],)), (DETACH, ()),
])
def test_a_view_is_what_fake_tensor_mode_makes(func: object, args: tuple) -> None:
    """GIVEN a fake bf16 tensor (a view of a larger one, as DeepSpeed's flattened gradients are)
    WHEN a slice, view or detach is made by ``fast_view`` and by FakeTensorMode's own dispatch
    THEN both are fake tensors of the mode, with the same sizes, strides, offset, dtype, device and storage, and the
    same attributes (``wrap``: those FakeTensor's constructor gives)."""
    mode = FakeTensorMode()
    with mode:
        base = torch.empty(4096, 32, dtype=torch.bfloat16)[8:]
    fast = fast_view(mode, func, (base, *args), {})
    with mode:
        slow = func(base, *args)
    assert fast is not None and isinstance(slow, FakeTensor) and fast.fake_mode is mode
    assert _described(fast) == _described(slow) and fast.untyped_storage()._cdata == base.untyped_storage()._cdata
    assert vars(fast) == vars(slow)
    if func is DETACH:
        assert fast.dispatch_keys == slow.dispatch_keys


def test_a_cat_is_what_fake_tensor_mode_makes() -> None:
    """GIVEN fake bf16 slices of one flat tensor and a padding tensor (a ZeRO-3 reduce-scatter's pieces,
    coalesced_collectives.py), 2-d tensors joined along either dim, and tensors on a fake CUDA device
    WHEN ``torch.cat`` is made by ``fast_view`` (``fast_cat``) and by FakeTensorMode's own dispatch
    THEN both are fake tensors of the mode on the same device, with the same sizes, strides, dtype and bytes, each in
    a storage of its own; inputs of two devices are left to the mode."""
    cat = torch.ops.aten.cat.default
    mode = FakeTensorMode()
    with mode:
        flat = torch.empty(4096, 32, dtype=torch.bfloat16).view(-1)
        pieces = [flat[i * 100:(i + 1) * 100] for i in range(64)] + [torch.empty(7, dtype=torch.bfloat16)]
        rows = [torch.empty(3, 5), torch.empty(2, 5)]
    cuda = [FakeTensor(mode, torch.empty(3, 4, device="meta"), torch.device("cuda", 0)) for _ in range(3)]
    for args in ((pieces,), (rows, 0), (rows,), (cuda, 1), ([r.t() for r in rows], 1)):
        fast = fast_view(mode, cat, args, {})
        with mode:
            slow = cat(*args)
        assert fast is not None and fast.fake_mode is mode
        assert _described(fast)[:7] == _described(slow)[:7] and _described(fast)[8] == _described(slow)[8]
        assert fast.untyped_storage()._cdata not in {t.untyped_storage()._cdata for t in args[0]}
    assert fast_view(mode, cat, ([cuda[0], rows[0].t()[:, :3]], 0), {}) is None


def test_anything_else_is_left_to_the_mode() -> None:
    """GIVEN calls FakeTensorMode would answer otherwise (another op, a constant it propagates, another mode's
    tensor, a real tensor, keyword arguments, a tensor argument)
    THEN ``fast_view`` declines (None) and the mode's own dispatch answers."""
    mode, other = FakeTensorMode(), FakeTensorMode()
    with mode:
        t = torch.empty(8, 8)
        constant = torch.tensor([2.0])  # (a lifted one-element constant: the mode keeps its value)
    with other:
        foreign = torch.empty(8, 8)
    assert constant.constant is not None
    assert fast_view(mode, torch.ops.aten.add.Tensor, (t, t), {}) is None
    assert fast_view(mode, SLICE, (constant, 0, 0, 1), {}) is None
    assert fast_view(mode, SLICE, (foreign, 0, 1, 2), {}) is None
    assert fast_view(mode, SLICE, (torch.empty(8, 8), 0, 1, 2), {}) is None
    assert fast_view(mode, SLICE, (t, 0), {"start": 1}) is None
    assert fast_view(mode, VIEW, (t, [torch.tensor(64)]), {}) is None


def test_a_fake_tensors_device_is_the_modes_answer() -> None:
    """GIVEN fake tensors (on the CPU and on a fake CUDA device)
    WHEN ``prim.device`` is answered by ``device_of``
    THEN it is what FakeTensorMode's own dispatch answers, outside a kernel and inside one (the meta device);
    anything but one fake tensor is left to the mode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        cpu = torch.empty(4)
    cuda = FakeTensor(mode, torch.empty(4, device="meta"), torch.device("cuda", 0))
    device = torch.ops.prim.device.default
    for t in (cpu, cuda):
        assert device_of((t,)) == mode.dispatch(device, [FakeTensor], (t,), {}) == t.fake_device
    mode.in_kernel_invocation = True
    try:
        assert device_of((cpu,)) == mode.dispatch(device, [FakeTensor], (cpu,), {}) == torch.device("meta")
    finally:
        mode.in_kernel_invocation = False
    assert device_of((torch.empty(4),)) is None and device_of((cpu, cpu)) is None


def test_only_a_view_of_a_tensor_without_values_skips_their_propagation() -> None:
    """GIVEN a fake tensor with the batch's values (graphmem/capture/values.py) and one without
    THEN ``valueless_view`` admits the views of the one without only (the other's view carries values on)."""
    mode = FakeTensorMode()
    with mode:
        plain, valued = torch.empty(8, 8), torch.empty(8, 8)
    setattr(valued, VALUE, torch.zeros(8, 8))
    assert valueless_view(SLICE, (plain, 0, 1, 4), {}) and valueless_view(VIEW, (plain, [-1]), {})
    assert not valueless_view(SLICE, (valued, 0, 1, 4), {})
    assert not valueless_view(torch.ops.aten.add.Tensor, (plain, plain), {})
    assert not valueless_view(SLICE, (plain, 0), {"start": 1})


@pytest.mark.slow  # ~1 min: two ZeRO-3 engines at 4 ranks and their four steps on fake tensors
def test_a_zero3_step_records_the_same_graph_with_and_without_fast_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """GIVEN the decoder of tests/deepspeed_truth.py under ZeRO-3 bf16 at 4 ranks (each gradient sliced per rank)
    WHEN both steps are recorded with the fast views and with FakeTensorMode's own dispatch for every op
    THEN the graphs are equal field by field (graphmem/capture/reuse.py ``signature``: every op, storage, save and
    phase), and so is what analyze prints."""
    pytest.importorskip("deepspeed")
    import graphmem
    import graphmem.deepspeed.views as views
    from graphmem.capture.reuse import signature
    from graphmem.deepspeed.capture import capture_engine_steps
    from tests.deepspeed_truth import decoder
    from tests.distributed.test_deepspeed import _by_order, _config

    model, batch = decoder()
    config = _config(3, bf16={"enabled": True})
    spec = graphmem.spec_for(model, batch, device="cpu", deepspeed=config, world_size=4, rank=1, optimizer="adamw")
    args = (spec.module, spec.inputs.captured, spec.loss, spec.target, spec.parallel, spec.training.train)
    fast = [signature(_by_order(g)) for g in capture_engine_steps(*args)]
    monkeypatch.setattr(views, "VIEWS", frozenset())
    monkeypatch.setattr(views, "FRESH", frozenset())
    slow = [signature(_by_order(g)) for g in capture_engine_steps(*args)]
    assert fast == slow
    assert sum(1 for op in fast[0][0] if op[0] == "aten.slice.Tensor") > 100  # (the views it is about)
    assert sum(1 for op in fast[0][0] if op[0] == "aten.cat.default") > 3  # (and the reduce-scatters' flat buffers)
