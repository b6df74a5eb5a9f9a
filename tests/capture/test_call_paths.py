"""Module attribution by the call path (graphmem/capture/call_paths.py): one ``nn.SiLU`` and one
RoPE-like module shared by every block, as torchtune's Llama builders share them, are named by
the block that calls them (``blocks.2.mlp.act``), not by their first name, which put every
block's tensors on block 0. Ground truth: a real CPU forward, each saved storage (from
``saved_tensors_hooks``) on the module call stack at the op that made it (a dispatch mode; the
batch, made by no op, on the stack where it is first saved), each module named as its caller's
child.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphmem
from graphmem.capture.call_paths import call_path, module_names


class SharedRope(nn.Module):
    """Rotary embedding made per call from the positions: saves its cos and sin (b-independent)."""

    inv_freq: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (b, s, d)
        freqs = torch.outer(torch.arange(x.shape[1], dtype=x.dtype), self.inv_freq)  # (s, d/2)
        emb = torch.cat([freqs, freqs], -1)
        x1, x2 = x.chunk(2, -1)
        return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


class Attn(nn.Module):
    def __init__(self, d: int, rope: nn.Module) -> None:
        super().__init__()
        self.q, self.o, self.rope = nn.Linear(d, d), nn.Linear(d, d), rope

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(self.rope(self.q(x)).tanh())


class MLP(nn.Module):
    def __init__(self, d: int, act: nn.Module) -> None:
        super().__init__()
        self.gate, self.up, self.down, self.act = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d), nn.Linear(2 * d, d), act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, d: int, act: nn.Module, rope: nn.Module) -> None:
        super().__init__()
        self.attn, self.mlp = Attn(d, rope), MLP(d, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.mlp(x)


class SharedNet(nn.Module):
    def __init__(self, d: int, n: int) -> None:
        super().__init__()
        act, rope = nn.SiLU(), SharedRope(d)  # one instance each, in every block
        self.blocks = nn.ModuleList([Block(d, act, rope) for _ in range(n)])
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


class _Made(TorchDispatchMode):
    """Notes the call path at the op that makes each storage (outputs kept alive: no address reuse)."""

    def __init__(self, stack: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.stack, self.made, self.keep = stack, {}, []  # type: ignore[var-annotated]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.made.setdefault(t.untyped_storage()._cdata, self.stack[-1][0] if self.stack else "")
                self.keep.append(t)
        return out


def _truth(model: nn.Module, x: torch.Tensor) -> dict[str, int]:
    """Saved bytes per module (own, not subtree) from a real CPU forward."""
    stack: list[tuple[str, nn.Module]] = []

    def pre(m: nn.Module, args: Any) -> None:
        if m is model:
            stack.append(("", m))
            return
        parent_path, parent = stack[-1]
        child = next(n for n, c in parent.named_modules(remove_duplicate=False) if c is m and n)  # under the caller
        stack.append((f"{parent_path}.{child}" if parent_path else child, m))

    state = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    made = _Made(stack)
    saved: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in state and st._cdata not in saved:
            saved[st._cdata] = (made.made.get(st._cdata, stack[-1][0] if stack else ""), st.nbytes())
        return t

    h1 = nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = nn.modules.module.register_module_forward_hook(lambda m, a, o: stack.pop() and None)  # (None: output kept)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), made:
            model(x).sum()
    finally:
        h1.remove()
        h2.remove()
    out: dict[str, int] = {}
    for path, nbytes in saved.values():
        out[path] = out.get(path, 0) + nbytes
    return out


@pytest.mark.parametrize("blocks", [4, 16])  # 16: the chain is captured at 5 blocks and widened (graphmem/capture/reuse.py)
def test_shared_modules_are_attributed_to_the_calling_block(blocks: int) -> None:
    torch.manual_seed(0)
    model, x = SharedNet(8, blocks), torch.randn(2, 6, 8)
    report = graphmem.analyze(model, (x,))
    got = {m.path: m.self_bytes for m in report.modules if m.self_bytes}
    truth = _truth(model, x)
    assert got == truth
    for i in range(blocks):  # each block's call of the shared modules holds its own saved tensors
        assert got[f"blocks.{i}.mlp.act"] == 2 * 6 * 16 * 4  # SiLU's output, saved by the mul
        assert got[f"blocks.{i}.attn.rope"] == 2 * 6 * 8 * 4  # cos and sin, (s, d) each
    assert sum(got.values()) == report.activation_bytes
    paths = [m.path for m in report.modules]
    assert paths.index("blocks.1.mlp.act") < paths.index("blocks.2")  # in named_modules order, each name


def test_backward_ops_of_a_shared_module_carry_the_calling_block() -> None:
    torch.manual_seed(0)
    model = SharedNet(8, 4)
    report = graphmem.analyze(model, (torch.randn(2, 6, 8),))
    assert report.step is not None
    backward = {n.meta["module"] for n in report.step.ops if n.meta["phase"] == "backward"}
    assert {f"blocks.{i}.mlp.act" for i in range(4)} <= backward
    assert {f"blocks.{i}.attn.rope" for i in range(4)} <= backward


def test_call_path_picks_the_name_under_the_innermost_caller() -> None:
    model = SharedNet(8, 3)
    names = module_names(model)[id(model.get_submodule("blocks.0.mlp.act"))]
    assert names == ("blocks.0.mlp.act", "blocks.1.mlp.act", "blocks.2.mlp.act")
    assert call_path(names, ["", "blocks", "blocks.2", "blocks.2.mlp"]) == "blocks.2.mlp.act"
    assert call_path(names, [""]) == "blocks.0.mlp.act"  # called from the root: its first shortest name
    assert call_path(("norm",), ["", "blocks.1"]) == "norm"  # one name: that name


def test_analyze_leaves_a_shared_module_s_tensors_real() -> None:
    # the fake state is swapped in under every name of a shared module; restored first-in
    # first-out, the second name's "original" was the first name's fake, and the model kept it
    model = SharedNet(8, 4)
    before = {n: t for n, t in [*model.named_parameters(remove_duplicate=False),
                                *model.named_buffers(remove_duplicate=False)]}
    graphmem.analyze(model, (torch.randn(2, 6, 8),))
    after = dict([*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)])
    assert after.keys() == before.keys() and all(after[n] is t for n, t in before.items())
