"""Ground truth for per-rank captures: a REAL multi-process CPU step with gloo
(torch.multiprocessing.spawn), the model wrapped as a user wraps it (tests/dist_plans.py: torch's
fully_shard, parallelize_module, transformers' TP engine; nothing of graphmem/distributed/) and
the step and optimizer written out here in plain torch. Each rank measures what
graphmem/validation/measure.py measures on one device: the distinct storages autograd saves in
forward and loss (parameters excluded: under FSDP2 the registered parameters during forward are
the unsharded ones, so they are read at each save; a saved DTensor counts its local shard), and
the peak from the CPU allocator's events under torch.profiler, plus the bytes live before the
step (rank r's shards, buffers, the batch)."""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

from tests.dist_plans import fully_shard_blocks, tensor_parallel
from tests.settle import COLLECTIVES, addresses, high, settle

LossFn = Callable[[Any, tuple], torch.Tensor]

# steps per case, each on a fresh model: every collective is settled (tests/settle.py), so no free
# is missed and each step's peak is the allocator's; the runs must agree to the byte (they were the
# least of 5, and of 12 whole steps under tensor parallel, while the settle slept and frees were missed)
REPEAT = 2


@dataclass(frozen=True)
class Wrap:
    """How a case wraps the model on ``world`` ranks, as graphmem.analyze's options name it."""

    world: int
    fsdp: bool = False
    reshard_after_forward: bool = True
    param_dtype: Optional[str] = None  # MixedPrecisionPolicy's, "bf16" | "fp32"
    reduce_dtype: Optional[str] = None
    tp: int = 1  # tensor-parallel ranks (FSDP2 over world / tp when both)
    sp: bool = False
    loss_parallel: bool = False
    no_sync: bool = False  # set_requires_gradient_sync(False) on all micro-batches but the last

    def options(self) -> dict[str, Any]:
        """The same wrapping as graphmem.analyze's keywords (with ``rank`` to add)."""
        return {"world_size": self.world, "fsdp": "fully_shard" if self.fsdp else None,
                "reshard_after_forward": self.reshard_after_forward, "fsdp_param_dtype": self.param_dtype,
                "fsdp_reduce_dtype": self.reduce_dtype, "tp": self.tp, "sp": self.sp,
                "loss_parallel": self.loss_parallel, "fsdp_no_sync": self.no_sync}

    def describe(self) -> str:
        tp = f"tp{self.tp}-sp={self.sp}" + ("-loss-parallel" if self.loss_parallel else "") if self.tp > 1 else ""
        fsdp = f"fsdp-reshard={self.reshard_after_forward}-mp={self.param_dtype}" if self.fsdp else ""
        return "-".join(p for p in (fsdp, tp, "no-sync" if self.no_sync else "") if p)


@dataclass(frozen=True)
class Train:
    """A whole step: ``micro_batches`` forward/backward, then torch.optim's ``optimizer`` (lr 1e-3,
    its for-loop or foreach implementation) and ``zero_grad(set_to_none=True)``."""

    optimizer: str = "adamw"  # adamw | momentum (SGD, momentum 0.9)
    foreach: bool = False  # False: the for-loop one, torch's default on the CPU
    micro_batches: int = 1

    def make(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        if self.optimizer == "momentum":
            return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=self.foreach)
        assert self.optimizer == "adamw", self.optimizer
        return torch.optim.AdamW(params, lr=1e-3, foreach=self.foreach)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank holds); a plain tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _keys(tensors: list[torch.Tensor]) -> dict[int, int]:
    return {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}


def _held(model: nn.Module) -> list[torch.Tensor]:
    return [_local(t) for t in (*model.parameters(), *model.buffers())]


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [_local(p.grad) for p in model.parameters() if p.grad is not None]


@contextlib.contextmanager
def _profiled() -> Iterator[Any]:
    """torch.profiler with the CPU allocator's events, the garbage collector paused inside (as
    graphmem/validation/measure.py's measure_peak after the T5 flake): garbage from before the
    window, freed inside it, would be reported as the step's own frees (the allocator's profiler
    reporter, c10/core/CPUAllocator.cpp, remembers blocks allocated while any profile ran)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield prof
    finally:
        if was:
            gc.enable()


class _Saves:
    """saved_tensors_hooks counting the distinct storages autograd saves while ``on`` (forward and
    loss), the model's parameters and buffers (local shards, read at each save) excluded."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.on = model, True
        self.saved: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = _local(t).untyped_storage()
        if self.on and st._cdata not in _keys(_held(self.model)):
            self.saved[st._cdata] = st.nbytes()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _step(model: nn.Module, batch: tuple, loss_fn: LossFn, kept: list, context: Any) -> tuple[int, int]:
    """(saved bytes, peak bytes) of one real step on this rank: ``out = model(*batch); loss =
    loss_fn(out, batch); loss.backward()`` inside ``context`` (loss_parallel(), as torchtitan's train_context).
    What the step leaves alive is appended to ``kept`` and never freed: the CPU allocator's profiler
    reporter (c10/core/CPUAllocator.cpp, ProfiledCPUMemoryReporter) remembers the sizes of blocks
    allocated while profiling, and a block freed after profiling stopped would leave an entry
    that a later case's block at the same address, freed while profiling, reports as its own."""
    saves = _Saves(model)
    baseline = sum(_keys(_held(model) + list(batch)).values())
    with _profiled() as prof, saves.hooks(), context:
        out = model(*batch)
        loss = loss_fn(out, batch)
        saves.on = False
        loss.backward()
    held = addresses([*_held(model), *_grads(model), *batch, out, loss])
    kept.append((model, batch, out, loss))
    return sum(saves.saved.values()), baseline + high(prof, held)


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


def _user_loss(name: str) -> LossFn:
    """What the real step trains on: ``loss_of``'s, else the sum of the output (of a transformers
    model's logits): what graphmem's default loss takes of an output with no loss of its own."""
    return loss_of(name) or (lambda out, batch: (out if isinstance(out, torch.Tensor) else out.logits).sum())


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


def _join(rank: int, world_size: int, init: str) -> list[int]:
    """Join the real gloo job as ``rank``, one thread as each rank runs, every collective settled
    (tests/settle.py: FSDP2's, DTensor's functional ones); the list counts unsettled ones."""
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)  # (a spawned rank process: nothing to restore, it ends with the job)
    return settle((*COLLECTIVES, "broadcast"))  # (ZeroRedundancyOptimizer broadcasts: tests/zero_truth.py)


def _spawn(worker: Any, cases: list, world_size: int) -> list[list[dict[str, int]]]:
    """Run ``worker`` in ``world_size`` real processes; each case's per-rank results."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        out = os.path.join(tmp, "result")
        mp.spawn(worker, args=(world_size, init, cases, out), nprocs=world_size, join=True)
        per_rank = [torch.load(f"{out}.{r}") for r in range(world_size)]
    for r, results in enumerate(per_rank):  # every collective's work was released on the rank's thread
        assert all(c["unsettled"] == 0 for c in results), (r, results)
    return [[per_rank[r][i] for r in range(world_size)] for i in range(len(cases))]


def _wrapped(name: str, wrap: Wrap) -> tuple[nn.Module, tuple]:
    """A fresh copy of case ``name``, split as ``wrap`` says: tensor parallel first (over the
    whole world, or the inner dimension of a (world / tp, tp) mesh), then FSDP2 over the rest."""
    model, batch = case(name)
    mesh: DeviceMesh = init_device_mesh("cpu", (wrap.world,), mesh_dim_names=("dp",))
    dp = tp = mesh
    if wrap.fsdp and wrap.tp > 1:
        world = init_device_mesh("cpu", (wrap.world // wrap.tp, wrap.tp), mesh_dim_names=("dp", "tp"))
        dp, tp = world["dp"], world["tp"]
    if wrap.tp > 1:
        tensor_parallel(model, name, tp, wrap.sp, wrap.loss_parallel)
    if wrap.fsdp:
        fully_shard_blocks(model, name, dp, wrap.reshard_after_forward, wrap.param_dtype, wrap.reduce_dtype)
    return model, batch


def _worker(rank: int, world_size: int, init: str, cases: list[tuple[str, Wrap]], out: str) -> None:
    unsettled = _join(rank, world_size, init)
    try:
        results, kept = [], []  # type: ignore[var-annotated]
        for name, wrap in cases:
            runs, before = [], unsettled[0]
            for _ in range(REPEAT):  # a fresh model each time; everything kept alive (see _step)
                model, batch = _wrapped(name, wrap)
                context = loss_parallel() if wrap.loss_parallel else contextlib.nullcontext()
                runs.append(_step(model, batch, _user_loss(name), kept, context))
            saved = {s for s, _ in runs}
            assert len(saved) == 1, saved  # autograd saves the same every time
            peaks = [p for _, p in runs]
            assert len(set(peaks)) == 1, (name, wrap, peaks)  # no free missed, none made up
            results.append({"saved": saved.pop(), "peak": peaks[0], "unsettled": unsettled[0] - before})
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_ranks(cases: list[tuple[str, Wrap]], world_size: int) -> list[list[dict[str, int]]]:
    """For each case (a name for ``case``, its wrapping), each rank's {"saved", "peak"} from one
    real gloo job of ``world_size`` processes running all the cases in turn."""
    return _spawn(_worker, cases, world_size)


# -- whole training steps per rank: micro-batches and torch.optim over the wrapped DTensor parameters ------


def _train_steps(model: nn.Module, batch: tuple, name: str, wrap: Wrap, train: Train, kept: list) -> dict[str, int]:
    """Two real whole steps of the wrapped ``model`` on this rank, written as a user writes them::

        def micro_step():
            out = model(*batch); loss = loss_fn(out, batch) / k; loss.backward(); return out, loss
        for i in range(k):
            model.set_requires_gradient_sync(i == k - 1)  # no_sync only
            out, loss = micro_step()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

    (the previous micro-step's output and loss held until the next one returns). The first step's
    last micro-step's saved bytes (as ``_step`` counts them), the first step's peak, the second's
    (the optimizer states exist before it: they are in its baseline) and the states' bytes."""
    optimizer = train.make([p for p in model.parameters() if p.requires_grad])
    k, loss_fn, saves = train.micro_batches, _user_loss(name), _Saves(model)

    def micro_step() -> tuple[Any, torch.Tensor]:
        saves.on = True
        saves.saved.clear()  # each micro-step saves the same: the last one's set is the step's
        out = model(*batch)
        loss = loss_fn(out, batch) if k == 1 else loss_fn(out, batch) / k
        saves.on = False
        loss.backward()
        return out, loss

    def states() -> list[torch.Tensor]:
        return [_local(t) for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    peaks, first_saved = [], {}  # type: ignore[var-annotated]
    for _ in range(2):
        baseline = sum(_keys(_held(model) + list(batch) + states()).values())
        with _profiled() as prof, saves.hooks():
            for i in range(k):
                if wrap.no_sync:
                    model.set_requires_gradient_sync(i == k - 1)  # type: ignore[operator]
                out, loss = micro_step()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        held = addresses([*_held(model), *_grads(model), *batch, *states(), out, loss])
        kept.append((out, loss))  # freed after profiling would confuse the next profile (see _step)
        first_saved = first_saved or dict(saves.saved)
        peaks.append(baseline + high(prof, held))
    kept.append((model, batch, optimizer))
    return {"saved": sum(first_saved.values()), "peak": peaks[0], "later": peaks[1],
            "states": sum(_keys(states()).values())}


def _train_worker(rank: int, world_size: int, init: str, cases: list[tuple[str, Wrap, Train]], out: str) -> None:
    unsettled = _join(rank, world_size, init)
    try:
        results, kept = [], []  # type: ignore[var-annotated]
        for name, wrap, train in cases:
            runs, before = [], unsettled[0]
            for _ in range(REPEAT):  # a fresh model each time; all kept (see _step)
                model, batch = _wrapped(name, wrap)
                runs.append(_train_steps(model, batch, name, wrap, train, kept))
            for key in ("saved", "states", "peak", "later"):
                assert len({r[key] for r in runs}) == 1, (name, wrap, runs)  # the same every time, to the byte
            results.append({**runs[0], "unsettled": unsettled[0] - before})
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_train_ranks(cases: list[tuple[str, Wrap, Train]], world_size: int) -> list[list[dict[str, int]]]:
    """For each case (a name for ``case``, its wrapping over one mesh dimension: FSDP2 or tensor
    parallel, the training step), each rank's
    {"saved", "peak", "later", "states"} (see _train_steps) from one real gloo job."""
    return _spawn(_train_worker, cases, world_size)
