"""graphmem.analyze: the user's module is left alone, inputs and losses follow the documented
conventions, and the byte counts follow the definitions in DESIGN.md."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_globals

import graphmem
from graphmem.models.gpt2 import GPT, GPTConfig
from graphmem.report import Report
from graphmem.validation.measure import measure_saved

F32 = 4  # bytes per float32 element
I64 = 8  # bytes per int64 element


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)  # has buffers that a real train-mode forward would update
        self.act = nn.GELU()
        self.proj = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.bn(self.fc(self.ln(x)))))  # (b, 16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))  # (b, 4)


def tiny_gpt_config() -> GPTConfig:
    return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=0.0)


# -- the module is left unchanged -------------------------------------------------------------

_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks", "_global_forward_hooks_with_kwargs",
                 "_global_forward_hooks_always_called")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                 "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                 "_forward_hooks_always_called", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def _global_hooks() -> dict[str, list[int]]:
    return {name: list(getattr(module_globals, name)) for name in _GLOBAL_HOOKS}


def _snapshot(net: nn.Module) -> dict[str, Any]:
    return {
        "params": [(name, p, p.detach().clone(), p.requires_grad) for name, p in net.named_parameters()],
        "buffers": [(name, b, b.detach().clone()) for name, b in net.named_buffers()],
        "training": [(name, m.training) for name, m in net.named_modules()],
        "hooks": [(name, {h: list(getattr(m, h)) for h in _MODULE_HOOKS}) for name, m in net.named_modules()],
    }


def _assert_unchanged(net: nn.Module, before: dict[str, Any]) -> None:
    after = list(net.named_parameters())
    assert [n for n, _ in after] == [n for n, *_ in before["params"]]
    for (name, p), (_, p0, value0, requires_grad0) in zip(after, before["params"]):
        assert p is p0, f"parameter {name} was replaced"
        assert p.device.type == "cpu" and not isinstance(p, torch._subclasses.FakeTensor)
        assert torch.equal(p, value0), f"parameter {name} changed value"
        assert p.requires_grad == requires_grad0
        assert p.grad is None, f"parameter {name} got a .grad"
    for (name, b), (_, b0, value0) in zip(net.named_buffers(), before["buffers"]):
        assert b is b0 and torch.equal(b, value0), f"buffer {name} changed"
    assert [(n, m.training) for n, m in net.named_modules()] == before["training"]
    hooks = [(n, {h: list(getattr(m, h)) for h in _MODULE_HOOKS}) for n, m in net.named_modules()]
    assert hooks == before["hooks"]


@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_analyze_leaves_the_module_unchanged(mode: str) -> None:
    # GIVEN a real CPU module in train mode, eval mode, or train with one block in eval
    torch.manual_seed(0)
    net = Net()
    net.train(mode != "eval")
    if mode == "mixed":
        net.blocks[1].eval()
    before = _snapshot(net)
    hooks_before = _global_hooks()
    # WHEN it is analyzed (a training step: train mode, BatchNorm statistics, backward)
    report = graphmem.analyze(net, (torch.randn(8, 16),))
    # THEN parameters, buffers, training flags and hooks are exactly as they were
    assert report.activation_bytes > 0
    _assert_unchanged(net, before)
    assert _global_hooks() == hooks_before


def test_analyze_leaves_the_module_unchanged_when_the_step_fails() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = Net()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x).view(-1, 3)  # (8, 4) cannot be viewed as (-1, 3)

    net = Boom().eval()
    before = _snapshot(net)
    hooks_before = _global_hooks()
    with pytest.raises(graphmem.CaptureError):
        graphmem.analyze(net, (torch.randn(8, 16),))
    _assert_unchanged(net, before)
    assert _global_hooks() == hooks_before


def test_user_hooks_survive_and_the_user_grad_is_untouched() -> None:
    net = Net()
    calls: list[str] = []
    handle = net.head.register_forward_hook(lambda m, args, out: calls.append("head"))
    net.head.weight.grad = torch.ones_like(net.head.weight)  # e.g. left from the user's own step
    graphmem.analyze(net, input_shape=(8, 16))
    assert list(net.head._forward_hooks) == [handle.id]
    assert torch.equal(net.head.weight.grad, torch.ones(4, 16))
    handle.remove()


# -- meta modules -----------------------------------------------------------------------------

def test_meta_module_gives_the_same_report_as_a_real_one() -> None:
    # GIVEN the same architecture built on the meta device and for real on the CPU
    with torch.device("meta"):
        meta = Net()
    assert meta.head.weight.is_meta
    real = Net()
    # WHEN both are analyzed THEN the byte counts agree
    r_meta = graphmem.analyze(meta, input_shape=(8, 16))
    r_real = graphmem.analyze(real, input_shape=(8, 16))
    assert r_meta.activation_bytes == r_real.activation_bytes > 0
    assert r_meta == r_real  # every reported field, not just the total
    assert meta.head.weight.is_meta  # and the meta module is still a meta module


def test_meta_gpt_gives_the_same_activation_bytes_as_a_real_one() -> None:
    cfg = tiny_gpt_config()
    with torch.device("meta"):
        meta = GPT(cfg)
    real = GPT(cfg)
    a = graphmem.analyze(meta, input_shape=(2, 8)).activation_bytes
    b = graphmem.analyze(real, input_shape=(2, 8)).activation_bytes
    assert a == b > 0


# -- inputs -----------------------------------------------------------------------------------

def _same_report(a: Report, b: Report) -> None:
    assert a == b
    assert a.input_shapes == b.input_shapes == ((2, 16),)


def test_input_shape_forms_equal_an_explicit_tensor() -> None:
    net = Net()
    explicit = graphmem.analyze(net, torch.randn(2, 16))
    _same_report(graphmem.analyze(net, input_shape=(2, 16)), explicit)
    _same_report(graphmem.analyze(net, input_shape="2x16"), explicit)
    _same_report(graphmem.analyze(net, input_shape=[2, 16]), explicit)
    _same_report(graphmem.analyze(net, (torch.randn(2, 16),)), explicit)
    _same_report(graphmem.analyze(net, (torch.empty(2, 16, device="meta"),)), explicit)
    assert explicit.input_bytes == 2 * 16 * F32


def test_default_input_is_int64_token_ids_for_an_embedding_model() -> None:
    # GIVEN a model whose first leaf module is an nn.Embedding
    net = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))
    # WHEN only a shape is given
    report = graphmem.analyze(net, input_shape="2x16")
    # THEN the batch is int64 token ids, saved by the embedding (its backward needs the indices)
    assert report.input_shapes == ((2, 16),)
    assert report.input_bytes == 2 * 16 * I64 == 256
    (batch,) = [t for t in report.saved if t.category == "input"]
    assert (batch.dtype, batch.bytes, batch.shape) == ("int64", 2 * 16 * I64, (2, 16))
    assert report.by_category["input"] == 256
    # embedding output (2, 16, 8) float32, saved by the Linear
    assert report.by_category["activation"] == 2 * 16 * 8 * F32
    # the same as passing int64 ids explicitly
    assert graphmem.analyze(net, torch.randint(0, 10, (2, 16))) == report


# -- the default loss -------------------------------------------------------------------------

class ScalarOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).pow(2).mean()  # a scalar: the loss itself


def test_default_loss_is_a_scalar_output_itself() -> None:
    default = graphmem.analyze(ScalarOut(), input_shape=(4, 16))
    explicit = graphmem.analyze(ScalarOut(), input_shape=(4, 16), loss=lambda out, inputs: out)
    # no op runs in the loss phase: the output is used as is
    assert default.phase_start["loss"] == default.phase_start["backward"]
    assert (default.activation_bytes, default.peak_bytes, default.num_ops) == \
        (explicit.activation_bytes, explicit.peak_bytes, explicit.num_ops)
    # x (4, 16) saved by the Linear + its output (4, 8) saved by pow
    assert default.activation_bytes == (4 * 16 + 4 * 8) * F32


@dataclasses.dataclass
class Extra:
    c: torch.Tensor
    steps: int


class Branches(nn.Module):
    """Four branches, each with its own weights; every output kind the default loss walks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(16, n) for n in (4, 5, 6, 7))

    def forward(self, x: torch.Tensor) -> Any:
        a = self.a(x).tanh()  # tanh saves its output: (2, 4)
        b = self.b(x).sigmoid()  # (2, 5)
        c = self.c(x).exp()  # (2, 6)
        d = self.d(x)  # (2, 7)
        return {
            "a": a,
            "rest": [(b, a.argmax(-1)), Extra(c, steps=3)],  # int64 argmax: not a loss term
            "d": d,
            "frozen": d.detach() * 2,  # floating but no grad: not a loss term
        }


def _summed_by_hand(out: Any, inputs: tuple) -> torch.Tensor:
    # the same terms in the same order as the default loss: a, b, c, d
    sums = [t.sum() for t in (out["a"], out["rest"][0][0], out["rest"][1].c, out["d"])]
    total = sums[0]
    for s in sums[1:]:
        total = total + s
    return total


def test_default_loss_sums_every_floating_tensor_in_nested_outputs() -> None:
    torch.manual_seed(0)
    net = Branches()
    default = graphmem.analyze(net, input_shape=(2, 16))
    by_hand = graphmem.analyze(net, input_shape=(2, 16), loss=_summed_by_hand)
    assert default.activation_bytes == by_hand.activation_bytes
    # x (2, 16) once, tanh/sigmoid/exp outputs: (2, 4) + (2, 5) + (2, 6); d is not saved
    assert default.activation_bytes == (2 * 16 + 2 * 4 + 2 * 5 + 2 * 6) * F32
    # every branch got a gradient: all four were in the loss
    assert default.gradient_bytes == default.parameter_bytes == by_hand.gradient_bytes
    # the loss phase ran the same ops: four sums and three adds, nothing for argmax or the detached copy
    assert default.peak_bytes == by_hand.peak_bytes and default.num_ops == by_hand.num_ops

    def ops(r: Report) -> list[str]:
        assert r.step is not None
        return [str(n.target) for n in r.step.ops[r.phase_start["loss"]:r.phase_start["backward"]]]

    assert ops(default) == ops(by_hand)
    assert ops(default) == ["aten.sum.default"] * 4 + ["aten.add.Tensor"] * 3


def test_a_loss_over_one_output_misses_the_other_branches() -> None:
    # the contrast: a loss over "a" alone leaves b, c and d without gradients
    net = Branches()
    only_a = graphmem.analyze(net, input_shape=(2, 16), loss=lambda out, inputs: out["a"].sum())
    assert only_a.gradient_bytes == (16 * 4 + 4) * F32 < only_a.parameter_bytes


class NoGradOut(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 4)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> Any:
        y = self.lin(x)
        if self.kind == "argmax":
            return y.argmax(-1)  # int64 only
        if self.kind == "detached":
            return {"y": y.detach()}
        return "not a tensor"


@pytest.mark.parametrize("kind", ["argmax", "detached", "string"])
def test_output_without_a_tensor_requiring_grad_raises_capture_error(kind: str) -> None:
    with pytest.raises(graphmem.CaptureError, match="no floating-point tensor that requires grad"):
        graphmem.analyze(NoGradOut(kind), input_shape=(2, 16))


# -- weight tying -----------------------------------------------------------------------------

def test_tied_weights_count_once() -> None:
    # GIVEN a tiny GPT-2, whose token embedding and lm_head share one weight
    net = GPT(tiny_gpt_config())
    assert net.transformer.wte.weight is net.lm_head.weight
    unique = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
              for _, p in net.named_parameters(remove_duplicate=False)}
    every = sum(p.nbytes for _, p in net.named_parameters(remove_duplicate=False))
    # WHEN analyzed
    report = graphmem.analyze(net, input_shape=(2, 8))
    # THEN the shared (64, 16) float32 weight is counted once, for parameters and gradients
    assert report.parameter_bytes == sum(unique.values())
    assert every - report.parameter_bytes == 64 * 16 * F32
    assert report.gradient_bytes == report.parameter_bytes


# -- views and in-place ops -------------------------------------------------------------------

class ViewsInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (4, 16)
        y = self.lin(x)  # storage A (4, 32); addmm saves x, not its output
        y += 1  # in place: still storage A, saves nothing
        a = y[:, :16].sin()  # sin saves its input: a view of A, which counts as all of A
        z = y.view(4, 8, 4).relu()  # relu saves its output: storage B (4, 8, 4)
        t = z.transpose(1, 2)  # a view of B
        return a.sum() + (t * t).sum()  # mul saves t twice: views of B, counted once


def test_views_and_in_place_ops_resolve_to_their_base_storage() -> None:
    torch.manual_seed(0)
    net = ViewsInPlace()
    x = torch.randn(4, 16)
    report = graphmem.analyze(net, (x,))
    expected = (
        4 * 16 * F32  # x, saved by the Linear: 256
        + 4 * 32 * F32  # A, the whole base (not the 4x16 slice sin saw): 512
        + 4 * 8 * 4 * F32  # B, saved by relu and twice by mul, counted once: 512
    )  # = 1280
    assert report.activation_bytes == expected == 1280
    by_op = {t.op: (t.bytes, t.shape) for t in report.saved}
    assert by_op == {"input": (256, (4, 16)), "aten.addmm.default": (512, (4, 32)),
                     "aten.relu.default": (512, (4, 8, 4))}
    # ground truth: a real CPU forward with saved_tensors_hooks, deduplicated by storage
    assert measure_saved(net, (x,)) == expected


# -- per-module attribution -------------------------------------------------------------------

def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


@pytest.mark.parametrize("build, shape", [
    (Net, (8, 16)),
    (lambda: GPT(tiny_gpt_config()), (2, 8)),
])
def test_module_sums_add_up(build: Any, shape: tuple[int, ...]) -> None:
    report = graphmem.analyze(build(), input_shape=shape)
    modules = {m.path: m for m in report.modules}
    assert modules[""].activation_bytes == report.activation_bytes
    assert modules[""].count == len(report.saved)
    assert sum(m.self_bytes for m in report.modules) == report.activation_bytes
    for m in report.modules:
        children = [c for c in report.modules if c.path and _parent(c.path) == m.path]
        assert m.activation_bytes == m.self_bytes + sum(c.activation_bytes for c in children), m.path
        assert m.count >= sum(c.count for c in children)
