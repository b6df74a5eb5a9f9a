"""Depth reuse for per-rank captures (graphmem/capture/reuse.py, graphmem/capture/widen.py): rank r's
step through fully_shard / parallelize_module captured with 5 blocks and widened to 8 is the
8-block capture, op for op, storage for storage, save for save; and analyze's fast path gives the
report the full capture gives."""
from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn

import graphmem
import graphmem.step.captured as captured
from graphmem.capture.reuse import signature
from graphmem.capture.target import Target, make_target
from graphmem.capture.widen import widen
from graphmem.chains import find_chain, truncated
from graphmem.distributed import capture_rank, make_sharding
from graphmem.distributed.spec import Sharding
from graphmem.distributed.view import rank_view
from graphmem.models import llama
from graphmem.passes import liveness, saved
from graphmem.passes.timeline import category_timeline

N = 8  # blocks of the full capture; the widened one is captured with 5


def _bundled(n: int = N) -> tuple[nn.Module, tuple]:
    model = llama.build(llama.LlamaConfig(vocab_size=101, dim=32, n_layers=n, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                                          max_seq_len=32))
    return model, (torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1)),)


def _hf_llama() -> tuple[nn.Module, tuple]:
    from tests.zoo import _SMALL, _hf

    model, x = _hf("LlamaConfig:LlamaForCausalLM", num_key_value_heads=2, **{**_SMALL, "num_hidden_layers": N})()
    return model.train(), x


CASES: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], Sharding, str]] = {
    "fsdp2": (_bundled, make_sharding(4, 1, fsdp=True), "cpu"),
    "fsdp2_kept_bf16": (_bundled, make_sharding(4, 3, fsdp=True, reshard_after_forward=False, param_dtype="bf16",
                                                reduce_dtype="fp32"), "cpu"),
    "tp_sp": (_bundled, make_sharding(2, 1, tp=2, sp=True), "cpu"),
    "fsdp_x_tp_sp_cuda": (_bundled, make_sharding(8, 5, fsdp=True, tp=2, sp=True), "cuda"),
    "hf_llama_fsdp2": (_hf_llama, make_sharding(4, 2, fsdp=True), "cpu"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_widened_rank_is_the_full_capture(name: str) -> None:
    # GIVEN a model of 8 identical blocks and rank r's wrappers (FSDP2's prefetch of the next block
    # in backward, its lazy init and final callback touching every block, DTensor's collectives)
    build, sharding, device = CASES[name]
    model, x = build()
    loss = llama.loss if isinstance(model, llama.Transformer) else None
    target = make_target("cuda", "bf16") if device == "cuda" else Target("cpu")
    chain = find_chain(model)
    assert chain is not None and chain.length == N
    # WHEN rank r's step is captured with 5 blocks and widened to 8, and captured with 8
    with truncated(model, chain, 5):
        small = capture_rank(model, x, loss, target, sharding)
    full = capture_rank(model, x, loss, target, sharding)
    widened = widen(small, chain, 5, N, [m for m, _ in model.named_modules()])
    # THEN they are the same step: every op, storage (kind, lifetime, module), save and gradient
    widened.check()
    assert signature(widened) == signature(full)
    a, b = liveness(widened), liveness(full)
    assert widened.num_ops == full.num_ops and a.timeline == b.timeline and a.peak_bytes == b.peak_bytes
    assert saved(widened).activation_bytes == saved(full).activation_bytes
    ca, cb = category_timeline(widened, a, saved(widened).tensors), category_timeline(full, b, saved(full).tensors)
    assert ca.by_category == cb.by_category  # communication buffers and gathered parameters included
    assert rank_view(widened, a, saved(widened), sharding, None, ()) == rank_view(full, b, saved(full), sharding, None, ())


@pytest.mark.slow
def test_analyze_takes_the_fast_path_and_reports_what_the_full_capture_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN a 16-block Llama (deep enough for reuse) on FSDP 4 x TP 2 + SP, CUDA target
    model, x = _bundled(16)
    depths: list[int] = []
    capture = captured.capture_rank

    def counting(module: nn.Module, *args: object) -> object:
        depths.append(len(module.layers))
        return capture(module, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(captured, "capture_rank", counting)  # the rank engine (graphmem/step/captured.py)
    options = dict(world_size=8, rank=6, fsdp="fully_shard", tp=2, sp=True, device="cuda", dtype="bf16")
    # WHEN it is analyzed with depth reuse and without
    fast = graphmem.analyze(model, x, loss=llama.loss, **options)
    assert depths == [5, 6]  # captured at depth 5, checked at depth 6, never at 16
    slow = graphmem.analyze(model, x, loss=llama.loss, reuse=False, **options)
    # THEN the reports are equal, the formula beside the rank's step included (its single-device step
    # widened: every gradient's owner copied, so the formula counts the trainable parameters)
    assert depths == [5, 6, 16]
    assert fast.to_dict() == slow.to_dict()
    assert fast.sharding.formula_peak == slow.sharding.formula_peak and fast.num_ops == slow.num_ops


def test_ranks_one_after_another_in_one_process() -> None:
    # GIVEN tensor parallel steps of two ranks analyzed one after the other (DTensor caches specs by
    # device mesh, and meshes of one layout compare equal across process groups)
    model, x = _bundled(2)
    options = dict(world_size=8, fsdp="fully_shard", tp=2, sp=True)
    # WHEN rank 5 then rank 6 run, THEN the second does not meet the first one's process groups
    # (it failed: "Could not resolve the process group registered under the name 5")
    five = graphmem.analyze(model, x, loss=llama.loss, rank=5, **options)
    six = graphmem.analyze(model, x, loss=llama.loss, rank=6, **options)
    assert five.sharding.sharding.rank == 5 and six.sharding.sharding.rank == 6
    assert six.activation_bytes == five.activation_bytes > 0  # the same activation shapes on every rank


@pytest.mark.parametrize("size,n,dim", [(64, 1024, 0), (100, 8, 0), (7, 3, 0), (5, 8, 1), (1, 4, 0), (16, 4, 0)])
def test_lazy_chunks_are_torch_chunks(size: int, n: int, dim: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from graphmem.distributed.chunks import _Chunks

    t = torch.randn((size, 3) if dim == 0 else (3, size))
    theirs, mine = _chunk_with_empty(t, n, dim), _Chunks(t, n, dim)
    assert len(mine) == len(theirs) == n
    for i in (0, 1, n // 2, n - 1, -1):
        a, b = theirs[i], mine[i]
        assert (a.shape, a.stride(), a.storage_offset(), a.numel() and a.data_ptr()) == \
            (b.shape, b.stride(), b.storage_offset(), b.numel() and b.data_ptr())


def test_lazy_chunks_capture_what_torch_chunks_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    # GIVEN FSDP2 at a world size far above the parameters' first dims (64 vs 16-64 rows)
    import contextlib

    import graphmem.distributed.wrappers as wrappers  # (apply_wrappers runs fully_shard under lazy_chunks)

    model, x = _hf_llama()
    sharding = make_sharding(64, 63, fsdp=True)
    fast = capture_rank(model, x, None, Target("cpu"), sharding)
    monkeypatch.setattr(wrappers, "lazy_chunks", contextlib.nullcontext)  # torch's own _chunk_with_empty
    slow = capture_rank(model, x, None, Target("cpu"), sharding)
    assert signature(fast) == signature(slow) and liveness(fast).peak_bytes == liveness(slow).peak_bytes


class _Odd(nn.Module):
    """16 identical blocks, but the loop treats block 5 differently (what widening must not copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 16) for _ in range(16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, b in enumerate(self.blocks):
            x = torch.tanh(b(x))
            if i == 5:
                x = x * torch.sigmoid(x)
        return x


def test_a_rank_whose_blocks_differ_is_captured_whole_and_says_so() -> None:
    model, x = _Odd(), (torch.randn(4, 16),)
    r = graphmem.analyze(model, x, world_size=2, rank=1, fsdp="fully_shard")
    full = graphmem.analyze(model, x, world_size=2, rank=1, fsdp="fully_shard", reuse=False)
    assert any(n.startswith("depth reuse not taken (the widened graph differs") for n in r.notes)
    assert signature(r.step) == signature(full.step) and r.peak_bytes == full.peak_bytes
