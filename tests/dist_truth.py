"""Ground truth for per-rank captures: a REAL multi-process CPU step with gloo
(torch.multiprocessing.spawn), each rank measuring what graphmem/validation/measure.py measures
on one device: the distinct storages autograd saves in forward and loss (parameters excluded:
under FSDP2 the registered parameters during forward are the unsharded ones, so they are read
at each save; a saved DTensor counts its local shard), and the peak from the CPU allocator's events under torch.profiler, plus the bytes
live before the step (rank r's shards, buffers, the batch)."""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from graphmem.distributed.fsdp import local, shard
from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.distributed.tensor_parallel import parallelize, step_context
from graphmem.training.batch import as_batch
from graphmem.training.loop import Session, TrainStep
from graphmem.training.optim import state_tensors
from graphmem.training.step import LossFn, run_step
from graphmem.validation.measure import _allocation_events

REPEAT = 5  # steps per case: a free the profiler misses (see _settled) only raises the running sum,
# so the least of the measured peaks is the allocator's peak


def _keys(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _step(model: nn.Module, batch: Any, loss_fn: LossFn | None, kept: list) -> tuple[int, int]:
    """(saved bytes, peak bytes) of one real step of the wrapped ``model`` on this rank. What
    the step leaves alive is appended to ``kept`` and never freed: the CPU allocator's profiler
    reporter (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter) remembers the sizes of blocks
    allocated while profiling, and a block freed after profiling stopped would leave an entry
    that a later case's block at the same address, freed while profiling, reports as its own."""
    saved: dict[int, int] = {}
    phase = ["forward"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = _keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()])
        st = local(t).untyped_storage()  # a DTensor (tensor parallel) holds its local shard
        if phase[0] != "backward" and st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    baseline = sum(_keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()]
                         + list(as_batch(batch).tensors())).values())
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, loss = run_step(model, batch, loss_fn, lambda p: phase.__setitem__(0, p))
    kept.append((model, batch, out, loss))
    running = high = 0
    for _, size in _allocation_events(prof):
        running += size
        high = max(high, running)
    return sum(saved.values()), baseline + high


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Chain(nn.Module):
    """A torch.nn chain of blocks and a head (fully_shard per block, the head in the root unit)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


CE = "+ce"  # a case name ending so trains on the bundled model's next-token cross-entropy (models/*.py ``loss``)


def loss_of(name: str) -> LossFn | None:
    """The loss a case trains on: the bundled model's cross-entropy for "<name>+ce", else the default."""
    if not name.endswith(CE):
        return None
    from graphmem.models import gpt2, llama

    return llama.loss if name.startswith("llama") else gpt2.loss


def case(name: str) -> tuple[nn.Module, tuple]:
    """(model in train mode, inputs) of a named case, the same on every call: the Chain above,
    or a tests/zoo.py model (transformers' Llama, GPT-2 with tied embeddings, ...)."""
    torch.manual_seed(0)
    name = name.removesuffix(CE)
    if name == "chain":
        return Chain().train(), (torch.randn(8, 64, generator=torch.Generator().manual_seed(1)),)
    ids = (torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1)),)
    if name == "llama_bundled":  # models/llama.py, the decoder the tensor-parallel plan covers
        from graphmem.models.llama import LlamaConfig, Transformer

        config = LlamaConfig(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)
        return Transformer(config).train(), ids
    if name == "gpt2_bundled":  # models/gpt2.py: fused c_attn, tied embeddings
        from graphmem.models.gpt2 import GPT, GPTConfig

        return GPT(GPTConfig(vocab_size=128, block_size=64, n_layer=2, n_head=4, n_embd=64)).train(), ids
    if name == "qwen2_gqa8":  # transformers' Qwen2: q/k/v biases, tied head, 8 heads and 4 key/value heads (--tp 4 divides both)
        import transformers

        config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                                          tie_word_embeddings=True)
        return transformers.Qwen2ForCausalLM(config).train(), ids
    from tests.zoo import build

    return build(name)


def _settled(collective: Any) -> Any:
    """``collective`` waited on, then held for a moment before it returns: gloo's worker thread
    drops its reference to the Work (which holds the buffers) once it has run it, and a buffer
    whose last reference dies there is freed on a thread torch.profiler does not watch (its free
    event is lost and the measured running sum stays too high). Held here, the last reference
    dies on the profiled thread, where FSDP2 drops it."""

    def call(*args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        work = collective(*args, async_op=True, **kwargs)
        work.wait()
        time.sleep(0.02)
        return work if async_op else None
    return call


def _settled_wait(wait: Any) -> Any:
    """The same for DTensor's functional collectives: their ``wait_tensor`` (torch/distributed/
    _functional_collectives.py) returns once the work is done; the moment after lets gloo's
    thread drop its reference first."""

    def call(tensor: torch.Tensor) -> torch.Tensor:
        out = wait(tensor)
        time.sleep(0.02)
        return out
    return call


def _join(rank: int, world_size: int, init: str) -> None:
    """Join the real gloo job as ``rank``, one thread as each rank runs, every collective settled."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)  # (a spawned rank process: nothing to restore, it ends with the job)
    dist.all_gather_single = _settled(dist.all_gather_single)  # type: ignore[attr-defined]
    dist.reduce_scatter_single = _settled(dist.reduce_scatter_single)  # type: ignore[attr-defined]
    funcol.wait_tensor = _settled_wait(funcol.wait_tensor)


def _spawn(worker: Any, cases: list, world_size: int) -> list[list[dict[str, int]]]:
    """Run ``worker`` in ``world_size`` real processes; each case's per-rank results."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        out = os.path.join(tmp, "result")
        mp.spawn(worker, args=(world_size, init, cases, out), nprocs=world_size, join=True)
        per_rank = [torch.load(f"{out}.{r}") for r in range(world_size)]
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def _worker(rank: int, world_size: int, init: str, cases: list[tuple[str, Sharding]], out: str) -> None:
    _join(rank, world_size, init)
    try:
        results, kept = [], []  # type: ignore[var-annotated]
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        for name, sharding in cases:
            meshes = Meshes(mesh, mesh if sharding.fsdp else None, mesh if sharding.tp > 1 else None)
            if sharding.fsdp and sharding.tp > 1:  # FSDP x TP: the 2-D mesh graphmem's fake process group builds
                world = init_device_mesh("cpu", (sharding.dp, sharding.tp), mesh_dim_names=("dp", "tp"))
                meshes = Meshes(world, world["dp"], world["tp"])
            runs = []
            for _ in range(REPEAT):  # a fresh model each time; everything kept alive (see _step)
                model, batch = case(name)
                if sharding.tp > 1:
                    parallelize(model, sharding, meshes)
                if sharding.fsdp:
                    shard(model, sharding, meshes)
                with step_context(sharding):  # loss_parallel() around the step when the logits stay split
                    runs.append(_step(model, batch, loss_of(name), kept))
            saved = {s for s, _ in runs}
            assert len(saved) == 1, saved  # autograd saves the same every time
            results.append({"saved": saved.pop(), "peak": min(p for _, p in runs)})
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_ranks(cases: list[tuple[str, Sharding]], world_size: int) -> list[list[dict[str, int]]]:
    """For each case (a name for ``case``, its sharding), each rank's {"saved", "peak"} from one
    real gloo job of ``world_size`` processes running all the cases in turn."""
    return _spawn(_worker, cases, world_size)


# -- whole training steps per rank: micro-batches and torch.optim over FSDP2's DTensor parameters --------

# Whole steps under tensor parallel: a free of a functional collective's buffer the profiler misses
# (see _settled_wait) stays in the running sum through the optimizer step, where these steps peak,
# so every miss in backward counts (measured here: about 3 in 5 first steps); the least of 12 is the peak
REPEAT_TP = 12


def _train_steps(model: nn.Module, batch: Any, train: TrainStep, sharding: Sharding, kept: list) -> dict[str, int]:
    """Two real whole steps (graphmem/training/loop.py's Session: micro-batches, optimizer.step(),
    zero_grad) of the wrapped ``model`` on this rank: the last micro-step's saved bytes (as
    ``_step`` counts them), the first step's peak, the second's (the optimizer states exist
    before it: they are in its baseline) and the states' bytes (local shards). With
    ``sharding.no_sync`` every micro-batch but the last runs ``set_requires_gradient_sync(False)``."""
    session = Session(train, dict(model.named_parameters()), "cpu")
    saved: dict[int, int] = {}
    phase = ["forward"]

    def on_phase(p: str) -> None:
        if p == "forward":
            saved.clear()  # each micro-step saves the same: the last one's set is the step's
        phase[0] = p

    def pack(t: torch.Tensor) -> torch.Tensor:
        params = _keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()])
        st = local(t).untyped_storage()
        if phase[0] != "backward" and st._cdata not in params:
            saved[st._cdata] = st.nbytes()
        return t

    def micro_step(i: int, runs: int) -> None:
        if sharding.no_sync:
            model.set_requires_gradient_sync(i == runs - 1)  # type: ignore[operator]

    def states() -> list[torch.Tensor]:
        return [local(t) for _, _, t in state_tensors(session.optimizer)] if session.optimizer is not None else []

    peaks, kept_saved = [], {}  # type: ignore[var-annotated]
    for _ in range(2):
        baseline = sum(_keys([local(p) for p in model.parameters()] + [local(b) for b in model.buffers()]
                             + list(as_batch(batch).tensors()) + states()).values())
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, loss = session.run(model, batch, None, on_phase, contextlib.nullcontext, micro_step=micro_step)
        kept.append((out, loss))  # freed after profiling would confuse the next profile (see _step)
        kept_saved = kept_saved or dict(saved)  # the first step's
        running = high = 0
        for _, size in _allocation_events(prof):
            running += size
            high = max(high, running)
        peaks.append(baseline + high)
    kept.append((model, batch, session))
    return {"saved": sum(kept_saved.values()), "peak": peaks[0], "later": peaks[1],
            "states": sum(_keys(states()).values())}


def _train_worker(rank: int, world_size: int, init: str, cases: list[tuple[str, Sharding, TrainStep]], out: str) -> None:
    _join(rank, world_size, init)
    try:
        results, kept = [], []  # type: ignore[var-annotated]
        mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
        for name, sharding, train in cases:
            runs = []
            for _ in range(REPEAT if sharding.tp == 1 else REPEAT_TP):  # a fresh model each time; all kept (see _step)
                model, batch = case(name)
                if sharding.tp > 1:  # one dimension: tensor parallel over every rank
                    parallelize(model, sharding, Meshes(mesh, None, mesh))
                if sharding.fsdp:
                    shard(model, sharding, Meshes(mesh, mesh, None))
                runs.append(_train_steps(model, batch, train, sharding, kept))
            for key in ("saved", "states"):
                assert len({r[key] for r in runs}) == 1, runs  # the same every time
            results.append({"saved": runs[0]["saved"], "states": runs[0]["states"],
                            "peak": min(r["peak"] for r in runs), "later": min(r["later"] for r in runs)})
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_train_ranks(cases: list[tuple[str, Sharding, TrainStep]], world_size: int) -> list[list[dict[str, int]]]:
    """For each case (a name for ``case``, its sharding over one mesh dimension: FSDP2 or tensor
    parallel, the training step), each rank's
    {"saved", "peak", "later", "states"} (see _train_steps) from one real gloo job."""
    return _spawn(_train_worker, cases, world_size)
