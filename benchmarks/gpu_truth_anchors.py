"""PyTorch's own GPU memory tests as anchors for benchmarks/gpu_truth.py: the figures they assert,
written down here with their source, reproduced by graphmem's CUDA target (fake tensors: runs
anywhere) and, on a GPU, re-measured the way the test measures them.

1. ``test/functorch/test_ac.py`` (pytorch/pytorch at 05cb3f646c60154f4db13d95eb2decf922bcb9dd),
   class ``MemoryBudgetTest`` (runs only with a GPU: ``torch.set_default_device(GPU_TYPE)``).
   ``get_act_mem``: ``torch.accelerator.memory_stats()["requested_bytes.all.current"]`` after a
   forward minus before it (what forward leaves alive: the saved activations and the scalar
   output), in MiB rounded to 0.1; every 512x512 fp32 tensor is 1 MiB. The compiled side is
   ``torch.compile(f, backend="aot_eager_decomp_partition")`` under
   ``torch._functorch.config.patch(activation_memory_budget=b)``. graphmem's side: the same
   function as a module whose tensors are parameters, ``graphmem.analyze(device="cuda",
   mode="compiled", memory_budget=b)`` (eager: ``mode="eager"``), the bytes live after the last
   forward op minus those live before the step. Cases (each expected figure is an assertEqual in
   the test): see ``AC_CASES``. Left out: ``test_profile`` (its budget is solved with the
   ``"profile"`` runtime estimator, which times kernels on the GPU), ``test_custom_triton_kernel``
   (asserts values, not memory); FLOPs assertions are not memory figures.
2. ``test/distributed/fsdp/test_fsdp_memory.py`` (pytorch/pytorch at
   050b2f2c90422c7b2aa898ad5177270de1da00c1), ``TestFSDPMemory.test_fsdp_memory``: 2 GPUs, FSDP1
   (``FullyShardedDataParallel``) over ``Model(hidden_dim=128)`` (stem Conv2d(3, 64, 3) + BN +
   ReLU(inplace); three Conv2d(., 128, 5, padding=2) + BN + ReLU(inplace); avgpool, flatten,
   Linear(128, 10); each BN, the stem, the blocks, the head and the root wrapped), batch
   ``randn(2, 3, 224, 224)``, loss ``MSELoss(sum(o.sum() for o in out[0]), 0)``;
   ``round(memory_allocated() / MiB)`` per rank with a 1 MiB allowance. Iteration 0: start =
   sharded model + 1 (the batch, 1.15 MiB), after forward = after loss = 340 MiB (51 MiB with
   ``checkpoint(self.blocks, use_reentrant=True)``), after backward = 2 x sharded + 1; the
   sharded model is ``int(round(model MiB) / 2)`` = 2 MiB. graphmem's side: rank 0 of 2 under
   ``fully_shard`` (FSDP2 through the fake process group: ``analyze(world_size=2, rank=0,
   fsdp="fully_shard")``); FSDP1's flat parameters differ from FSDP2's per-parameter shards by
   padding only (bytes, not MiB). The real side needs 2 GPUs and is not run here.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from gpu_truth_report import SKIPPED, AnchorRow
from gpu_truth_steps import error_line
from torch.utils.checkpoint import checkpoint

import graphmem

MiB = 1 << 20
TEST_AC = "test/functorch/test_ac.py@05cb3f6"
TEST_FSDP = "test/distributed/fsdp/test_fsdp_memory.py@050b2f2"
QUICK_AC = ("rematerializes_cheap", "prioritize_cheaper_matmul", "attention_vs_linear S=2 D=1", "manual_ac")


@dataclass(frozen=True)
class AcCase:
    """One function of test_ac.py: ``fn(*tensors)`` with tensors of ``shapes`` (in units of 512),
    the eager figure and each budget's figure the test asserts (MiB; None: the test asserts no
    eager figure); ``same_as_eager``: the test asserts the budget's figure equals eager's."""

    name: str
    fn: Callable[..., torch.Tensor]
    shapes: tuple[tuple[float, float], ...]
    eager: Optional[float]
    budgets: tuple[tuple[float, float], ...]
    same_as_eager: bool = False


def _cheap(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.mm(x.cos(), w).sum()


def _even(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    x = x.cos()
    for w in ws:
        x = torch.mm(x, w).cos()
    return x.sum()


def _uneven(x: torch.Tensor, *ws: torch.Tensor) -> torch.Tensor:
    xs = [torch.mm(x, w).cos() for w in ws]
    return sum(x.sum() for x in xs)  # type: ignore[return-value]


def _pairs(*xw: torch.Tensor) -> torch.Tensor:
    xs = [torch.mm(x, w).cos() for x, w in zip(xw[::2], xw[1::2])]
    return sum(x.sum() for x in xs)  # type: ignore[return-value]


def _attention(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(1, 1, *shape)
    x = F.scaled_dot_product_attention(x, x, x, is_causal=False).reshape(*shape)
    return torch.mm(x, w).cos().sum()


def _manual(x: torch.Tensor) -> torch.Tensor:
    def f(x: torch.Tensor) -> torch.Tensor:
        t = torch.matmul(x, x.T)
        t = torch.matmul(t, t)
        t = torch.matmul(t, t)
        return torch.matmul(t, x)
    x = checkpoint(f, x, use_reentrant=False)
    return checkpoint(f, x, use_reentrant=False).sum()


def _uneven_case(tag: str, dims: list[int], solves: list[int]) -> AcCase:
    total = sum(dims)
    return AcCase(f"matmul_uneven_chain {tag}", _uneven, ((1, 1), *((1, d) for d in dims)), float(total),
                  tuple((m / total, float(m)) for m in solves))


def _random_config() -> tuple[list[int], list[int]]:
    """test_matmul_uneven_chain's third configuration: random.seed(0), ten randint(0, 50), and the
    sums of the first i after each shuffle (the same draws from a Random(0) of its own)."""
    rng = random.Random(0)
    arr = [rng.randint(0, 50) for _ in range(10)]
    sums = []
    for i in range(10):
        rng.shuffle(arr)
        sums.append(sum(arr[:i]))
    return list(arr), sums


def ac_cases() -> list[AcCase]:
    even = tuple((b / 10, float(b if b <= 5 else 5 if b < 10 else 10)) for b in range(11))
    attention = [AcCase(f"attention_vs_linear S={s} D={d}", _attention, ((s, d), (d, d)), float(s * d * 2),
                        ((0.6, float(s * d)),)) for s, d in [(1, 1), (1, 3), (2, 2), (2, 1), (2, 5), (4, 7), (4, 9)]]
    return [
        AcCase("rematerializes_cheap", _cheap, ((1, 1), (1, 1)), 1.0, ((1.0, 1.0), (0.5, 0.0))),
        AcCase("matmul_even_chain", _even, ((1, 1),) * 6, None, even),
        _uneven_case("[11,3,4,2]", [11, 3, 4, 2], [18, 17, 16, 15, 14, 13, 11, 7, 6, 5]),
        _uneven_case("[3,5,11,17,14]", [3, 5, 11, 17, 14], [42, 30, 19, 8, 3]),
        _uneven_case("random(seed 0)", *_random_config()),
        AcCase("prioritize_cheaper_matmul", _pairs, ((1, 1), (1, 4), (2, 2), (2, 2)), 8.0, ((0.5, 4.0),)),
        AcCase("prioritize_cheaper_matmul2", _pairs, ((4, 4), (4, 4), (6, 6), (6, 2), (2, 2), (2, 6)), 40.0,
               ((28 / 40, 28.0), (16 / 40, 12.0))),
        *attention,
        AcCase("manual_ac", _manual, ((64 / 512, 2),), None, ((0.01, 0.0),), same_as_eager=True),
    ]


class _Fn(nn.Module):
    """A test_ac function over parameters (dynamo lifts parameters to graph inputs, as the test's
    leaf tensors): analyze needs a module and an input, which the function ignores."""

    def __init__(self, fn: Callable[..., torch.Tensor], shapes: tuple[tuple[float, float], ...]) -> None:
        super().__init__()
        self.fn = fn
        self.ts = nn.ParameterList([nn.Parameter(torch.empty(int(r * 512), int(c * 512), device="meta"))
                                    for r, c in shapes])

    def forward(self, ignored: torch.Tensor) -> torch.Tensor:
        return self.fn(*self.ts)


def after_phase(report: Any, phase: str) -> int:
    """Bytes live once the last op before ``phase`` has run (``"end"``: when the step ends)."""
    g = report.step
    i = g.phase_start[phase] - 1 if phase != "end" else g.num_ops - 1
    return sum(s.nbytes for s in g.storages.values() if s.created <= i and (s.freed is None or s.freed > i))


def graphmem_act_mib(case: AcCase, budget: Optional[float]) -> float:
    """get_act_mem's figure predicted: live after forward minus live before, MiB to 0.1."""
    mode = "eager" if budget is None else "compiled"
    report = graphmem.analyze(_Fn(case.fn, case.shapes), (torch.empty(1),), device="cuda", mode=mode,
                              memory_budget=budget, loss=lambda out, inputs: out)
    return round((after_phase(report, "loss") - report.baseline_bytes) / MiB, 1)


def real_act_mib(case: AcCase, budget: Optional[float]) -> float:
    """get_mem_and_flops' memory on the GPU, as test_ac.py measures it."""
    import torch._functorch.config as config

    ts = [torch.randn(int(r * 512), int(c * 512), device="cuda", requires_grad=True) for r, c in case.shapes]
    f: Callable[[], torch.Tensor] = lambda: case.fn(*ts)
    stats = getattr(torch.accelerator, "memory_stats", None) or torch.cuda.memory_stats  # torch < 2.9: no accelerator API
    torch._dynamo.reset()
    with config.patch(activation_memory_budget=budget):
        if budget is not None:
            f = torch.compile(f, backend="aot_eager_decomp_partition")
        f().backward()
        start = stats()["requested_bytes.all.current"]
        out = f()
        mem = (stats()["requested_bytes.all.current"] - start) / MiB
        out.backward()
    return round(mem, 1)


# -- test_fsdp_memory.py ---------------------------------------------------------------------------

class FsdpModel(nn.Module):
    """test_fsdp_memory.py's ``Model`` without its FSDP wrappers (graphmem applies fully_shard)."""

    def __init__(self, hidden_dim: int = 128, with_checkpoint: bool = False) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, kernel_size=3), nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        blocks: list[nn.Module] = []
        for c in (64, hidden_dim, hidden_dim):
            blocks += [nn.Conv2d(c, hidden_dim, kernel_size=5, padding=2), nn.BatchNorm2d(hidden_dim),
                       nn.ReLU(inplace=True)]
        self.blocks = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(output_size=(1, 1)), nn.Flatten())
        self.head = nn.Linear(hidden_dim, 10)
        self.with_checkpoint = with_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.with_checkpoint:
            return self.head(checkpoint(self.blocks, self.stem(x), use_reentrant=True))
        return self.head(self.blocks(self.stem(x)))


def fsdp_loss(out: torch.Tensor, inputs: Any) -> torch.Tensor:
    """``out = sum(o.sum() for o in out[0]); fake_loss = criterion(out, torch.tensor(0.0))``."""
    total = sum(o.sum() for o in out[0])
    return F.mse_loss(total, torch.tensor(0.0))  # type: ignore[arg-type]


def fsdp_expected(ckpt: bool, model_mib: int = 4, world: int = 2) -> dict[str, int]:
    """Iteration 0's expected MiB per rank (the test's ``expected`` dict; model_size_mb is
    ``round(memory_allocated() / MiB)`` of the unwrapped model on the GPU: 3.92 MiB -> 4)."""
    sharded = int(model_mib / world)
    activations = 51 if ckpt else 340
    return {"start": sharded + 1, "after fwd": activations, "after loss": activations, "after bwd": 2 * sharded + 1}


def fsdp_graphmem(ckpt: bool) -> dict[str, float]:
    """Rank 0 of 2 under fully_shard on the CUDA target: live MiB at the test's four points, to 0.01
    (the test rounds to whole MiB and allows 1 MiB: AnchorRow.verdict)."""
    with torch.device("meta"):
        model = FsdpModel(128, ckpt)
    report = graphmem.analyze(model, (torch.empty(2, 3, 224, 224),), device="cuda", loss=fsdp_loss, world_size=2,
                              rank=0, fsdp="fully_shard")
    points = {"start": report.baseline_bytes, "after fwd": after_phase(report, "loss"),
              "after loss": after_phase(report, "backward"), "after bwd": after_phase(report, "end")}
    return {k: round(v / MiB, 2) for k, v in points.items()}


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the table names every failure
        return error_line(e)


def graphmem_rows(which: str, seconds: float) -> tuple[list[AnchorRow], float]:
    """graphmem's side of every anchor (``which``: all; quick: four test_ac cases and FSDP without
    checkpoint) and the seconds it took; no case starts after ``seconds``."""
    start = time.perf_counter()
    rows: list[AnchorRow] = []
    for ckpt in (False,) if which == "quick" else (False, True):
        got = _try(lambda: fsdp_graphmem(ckpt))
        for point, expected in fsdp_expected(ckpt).items():
            rows.append(AnchorRow(TEST_FSDP, "test_fsdp_memory rank 0 of 2, iteration 0",
                                  f"{'ckpt' if ckpt else 'no_ckpt'}: {point}", float(expected),
                                  float(got[point]) if isinstance(got, dict) else got, "needs 2 GPUs", allowance=1.0))
    for case in ac_cases():
        if which == "quick" and case.name not in QUICK_AC:
            continue
        if time.perf_counter() - start > seconds:
            rows.append(AnchorRow(TEST_AC, case.name, "all", None, f"{SKIPPED} (time guard)"))
            continue
        eager = _try(lambda: graphmem_act_mib(case, None))
        rows.append(AnchorRow(TEST_AC, case.name, "eager", case.eager, eager))
        for budget, mib in case.budgets:
            rows.append(AnchorRow(TEST_AC, case.name, f"budget {budget:.4g}",
                                  eager if case.same_as_eager and isinstance(eager, float) else mib,
                                  _try(lambda: graphmem_act_mib(case, budget)), budget=budget))
    return rows, time.perf_counter() - start
