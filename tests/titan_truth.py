"""Ground truth for torchtitan jobs: torchtitan's own ``Trainer`` and ``train_step`` run for real,
one CPU process per rank over gloo (torch.multiprocessing.spawn), each rank measuring what
tests/dist_truth.py measures: the distinct storages autograd saves in forward and loss
(parameters and buffers excluded, a DTensor counts its local shard), and the peak from the CPU
allocator's events under torch.profiler plus the bytes live before the step (the rank's parameter
shards, buffers, gradients and optimizer states).

The job is made runnable by graphmem/titan/job.py (``on_cpu``, ``prepared``, ``with_sdpa``: the
same job the prediction captures); two changes here are
gloo's alone: FSDP2 reduces gradients with ``ReduceOp.SUM`` (torchtitan's gradient divide factor
1.0 makes FSDP2 ask for ``PREMUL_SUM(1.0)``, which gloo does not have; the sum is the same and no
division runs), and every collective is settled (tests/settle.py) so the profiler sees its frees.
"""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType
from torch.distributed.tensor import DTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.profiler import ProfilerActivity, profile

from graphmem.capture.collector import quiet_gc
from graphmem.capture.sac import through_hooks
from tests.settle import addresses, high, settle

LATER = 3  # later steps measured: the least of their peaks (a free the profiler misses only raises one)


def small_llama3(sdpa: bool = True) -> Any:
    """torchtitan's ``llama3_debugmodel`` (models/llama3/config_registry.py) shrunk for a CPU:
    dim 64, 4 heads (2 key/value heads), 4 layers, vocabulary 256, 32 tokens, 2 sequences a
    rank, float32 parameters. Attention is torchtitan's ``ScaledDotProductAttention`` (causal,
    graphmem/titan/job.py ``with_sdpa``): FlexAttention has no CPU backward (``sdpa=False``
    keeps it, for the CUDA target). No activation checkpointing, so every save is visible to
    the hooks."""
    from torchtitan.models.common import ComplexRoPE
    from torchtitan.models.llama3 import _build_llama3_layers, _output_linear_init
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from graphmem.titan.job import with_sdpa

    config = llama3_debugmodel()
    model = config.model_spec.model  # type: ignore[union-attr]
    dim, heads, vocab = 64, 4, 256
    model.dim, model.vocab_size = dim, vocab
    model.tok_embeddings.num_embeddings, model.tok_embeddings.embedding_dim = vocab, dim
    model.norm.normalized_shape = dim
    model.lm_head.in_features, model.lm_head.out_features = dim, vocab
    model.lm_head.param_init = _output_linear_init(dim)
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=131072, theta=500000, scaling="llama")
    model.layers = _build_llama3_layers(n_layers=4, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=192,
                                        rope=rope, attn_backend="flex")
    config.loss.loss_fn.global_vocab_size = vocab
    config.training.seq_len, config.training.local_batch_size = 32, 2
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    return with_sdpa(config) if sdpa else config


def small_qwen3_moe() -> Any:
    """torchtitan's ``qwen3_moe_debug`` (models/qwen3/config_registry.py) shrunk as ``small_llama3``:
    dim 64, 4 heads of 16 (2 key/value heads), 2 layers of 4 experts of hidden 64 (top 2),
    vocabulary 256, SDPA attention, no activation checkpointing. Its routers use torchtitan's own
    balanced round-robin routing (``_debug_force_load_balance``), the routing graphmem reads."""
    from torchtitan.models.common import CosSinRoPE
    from torchtitan.models.common.moe import TokenChoiceTopKRouter
    from torchtitan.models.qwen3 import _build_qwen3_moe_layers
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    from graphmem.titan.job import with_sdpa

    config = qwen3_moe_debug()
    model = config.model_spec.model  # type: ignore[union-attr]
    dim, vocab = 64, 256
    model.dim, model.vocab_size = dim, vocab
    model.tok_embeddings.num_embeddings, model.tok_embeddings.embedding_dim = vocab, dim
    model.norm.normalized_shape = dim
    model.lm_head.in_features, model.lm_head.out_features = dim, vocab
    model.layers = _build_qwen3_moe_layers(
        fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, head_dim=16, moe_hidden_dim=64,
        num_experts=4, top_k=2, attn_backend="flex", rope=CosSinRoPE.Config(dim=16, max_seq_len=4096, theta=1e6),
        moe_comm_backend="standard")
    for _fqn, router, _parent, _attr in model.traverse(TokenChoiceTopKRouter.Config):
        router._debug_force_load_balance = True  # routing balanced, as graphmem reads it (graphmem/titan/moe.py)
    config.loss.loss_fn.global_vocab_size = vocab
    config.training.seq_len, config.training.local_batch_size = 32, 2
    config.training.mixed_precision_param = "float32"
    config.activation_checkpoint = None
    return with_sdpa(config)


def model_bytes(config_fn: Callable[[], Any] = small_llama3) -> tuple[int, int, int]:
    """(parameter bytes, buffer bytes, parameter count) of ``config_fn()``'s model as the Trainer
    builds it (on the meta device, its RoPE cache sized to the training sequence by
    ``update_from_config``)."""
    config = config_fn()
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    params, buffers = list(model.parameters()), list(model.buffers())
    return (sum(t.numel() * t.element_size() for t in params), sum(t.numel() * t.element_size() for t in buffers),
            len(params))


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def _join(rank: int, world_size: int, init: str) -> list[int]:
    """Join the gloo job as ``rank`` (torchtitan's ``init_distributed`` then skips its own init);
    the environment torchtitan reads, one thread, autograd's device threads off as
    ``init_distributed`` sets them, every collective settled (tests/settle.py: FSDP2's, and the
    ones spmd_types calls). The list counts unsettled ones."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    torch.autograd.set_multithreading_enabled(False)
    return settle()


def _gloo_reductions(trainer: Any) -> None:
    """FSDP2 sums gradients with ``ReduceOp.SUM`` instead of ``PREMUL_SUM(1.0)`` (see the module
    docstring; torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py _get_gradient_divide_factors)."""
    from torch.distributed.fsdp import FSDPModule

    for part in trainer.model_parts:
        for m in part.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)


def _held(trainer: Any) -> list[torch.Tensor]:
    """What lives between steps on this rank: parameters, gradients, buffers, optimizer states,
    a pipeline stage's receive buffers."""
    held = []
    for part in trainer.model_parts:
        for p in part.parameters():
            held += [local(p)] + ([local(p.grad)] if p.grad is not None else [])
        held += [local(b) for b in part.buffers()]
    for opt in trainer.optimizers.optimizers:
        for state in opt.state.values():
            held += [local(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return held + _pipeline_buffers(trainer)


def _pipeline_buffers(trainer: Any) -> list[torch.Tensor]:
    """A pipeline stage's receive buffers, one per micro-batch for its activations and one for
    their gradients, made at the first step and reused by every later one
    (torch/distributed/pipelining/stage.py ``_setup_forward_recv_info``, ``_create_grad_recv_info``)."""
    schedule = getattr(trainer, "pp_schedule", None)
    if schedule is None:
        return []
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return [info.buffer for stage in stages for infos in (*stage.args_recv_info.values(),
                                                          *stage.grad_recv_info.values())
            for info in infos if isinstance(getattr(info, "buffer", None), torch.Tensor)]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


class _Saves:
    """Bytes of the distinct storages saved. A storage is known by its address while it lives:
    torchtitan's ``ChunkedLossWrapper`` (components/loss.py) runs each chunk's lm_head and loss
    forward and backward inside the loss, so a chunk's own storages are freed before the next
    chunk saves its own, which may reuse their addresses; each of those counts. A storage that
    is still alive when saved again (each chunk re-saves a view of the same hidden states) is
    the same memory and counts once (a weak reference to the storage tells the two apart)."""

    def __init__(self) -> None:
        self.live: dict[int, tuple[int, StorageWeakRef]] = {}
        self.retired = 0

    def add(self, t: torch.Tensor, st: torch.UntypedStorage) -> None:
        key = st._cdata
        if key in self.live and self.live[key][1].expired():
            self.retired += self.live.pop(key)[0]
        self.live.setdefault(key, (st.nbytes(), StorageWeakRef(st)))

    def total(self) -> int:
        return self.retired + sum(n for n, _ in self.live.values())


def _step(trainer: Any, data: Iterator, later: bool = False) -> dict[str, int]:
    """One ``train_step`` of ``trainer`` profiled: saved bytes (forward and loss: no backward
    graph task is running; parameters as registered at the save, the unsharded ones under FSDP2,
    excluded), the peak, and the bytes live before the step. A ``later`` step's peak also counts
    what lived before it unnamed by ``_held`` (``_unheld_before``)."""
    saves = _Saves()

    def pack(t: torch.Tensor) -> torch.Tensor:
        state = {local(p).untyped_storage()._cdata for part in trainer.model_parts
                 for p in [*part.parameters(), *part.buffers()]}
        st = local(t).untyped_storage()
        if torch._C._current_graph_task_id() == -1 and st._cdata not in state:
            saves.add(t, st)
        return t

    before = _storage_bytes(_held(trainer))
    held_before = {t.untyped_storage().data_ptr() for t in _held(trainer)}
    trainer.step += 1  # as Trainer.train counts steps
    with quiet_gc(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), through_hooks():  # SAC's kept tensors too
        trainer.train_step(data)
    unheld = _unheld_before(prof, held_before) if later else 0
    return {"saved": saves.total(), "peak": before + unheld + high(prof, addresses(_held(trainer))), "before": before}


def _unheld_before(prof: Any, held_before: set[int]) -> int:
    """Bytes live before the step that ``_held`` does not name, told by their frees in the step:
    the last batch of the previous step, which the Trainer's batch generator holds until it makes
    the next one (torchtitan/trainer.py ``batch_generator``), freed after this step's first batch
    is made (later peaks read 1,536 B low without it, a pipeline's 520 B: one micro-batch's int64
    tokens and positions; graphmem holds the step's own batches from before the step). A block
    whose first event in the window is a free, at an address no held tensor had, is one."""
    first: dict[int, int] = {}
    for _, size, ptr in sorted(_allocations(prof)):
        first.setdefault(ptr, size)
    return sum(-size for ptr, size in first.items() if size < 0 and ptr not in held_before)


def _allocations(prof: Any) -> Iterator[tuple[int, int, int]]:
    """The allocator's events of a profiled window: (time, size, address), frees negative."""
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            yield e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr
        todo.extend(e.children)


def _worker(rank: int, world_size: int, init: str, config_fn: Callable, overrides: dict, out: str) -> None:
    unsettled = _join(rank, world_size, init)
    try:
        from torchtitan.trainer import Trainer

        from graphmem.titan.job import on_cpu, prepared

        with on_cpu():
            config = prepared(config_fn())
            for path, value in overrides.items():
                *parents, name = path.split(".")
                target = config
                for p in parents:
                    target = getattr(target, p)
                setattr(target, name, value)
            trainer = Trainer(config)
            _gloo_reductions(trainer)
            data = trainer.batch_generator(trainer.dataloader)
            first = _step(trainer, data)
            later = [_step(trainer, data, later=True) for _ in range(LATER)]
        if len({(r["saved"], r["before"]) for r in later}) != 1:  # the later steps repeat each other
            raise AssertionError(f"rank {rank}: the later steps differ in saved or held bytes: {later}")
        torch.save({"saved_bytes": first["saved"], "peak_bytes": first["peak"], "before_bytes": first["before"],
                    "later_saved_bytes": later[0]["saved"], "later_before_bytes": later[0]["before"],
                    "later_peak_bytes": min(r["peak"] for r in later), "unsettled": unsettled[0]}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def real_titan(config_fn: Callable[[], Any], world_size: int, overrides: dict[str, Any]) -> list[dict[str, int]]:
    """Each rank's measurements of a real torchtitan job of ``world_size`` CPU processes:
    ``config_fn()`` (a module-level function returning a ``Trainer.Config``) prepared by
    graphmem/titan/job.py, with ``overrides`` set by dotted path (e.g.
    ``{"parallelism.tensor_parallel_degree": 2}``). Per rank: ``saved_bytes``, ``peak_bytes`` and
    ``before_bytes`` of the first ``train_step``; ``later_saved_bytes``, ``later_peak_bytes`` (the
    least of ``LATER`` steps) and ``later_before_bytes`` of the later ones (gradients and optimizer
    states then live before the step); ``unsettled`` collectives (0 when every free was seen).

    A pipeline's first step saves more than its later ones: torch's PipelineStage runs the first
    micro-batch's forward once more, with grad, to infer the shapes it sends
    (torch/distributed/pipelining/stage.py ``_forward_metadata_inference``). The first step's peak is
    one measurement (a second Trainer in the same process fails under tensor parallel: FSDP2 finds
    the parameters on another mesh object). It moved between runs by up to ~150 KB until the
    collectives spmd_types calls (``dist.all_to_all`` over lists of chunks,
    ``all_gather_into_tensor``, ``reduce_scatter_tensor``) were settled too: their buffers had
    died on gloo's thread, unseen (expert parallel's first peak read +131,120 B on one CI run)."""
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'store')}"
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world_size, init, config_fn, overrides, out), nprocs=world_size, join=True)
        return [torch.load(f"{out}.{r}") for r in range(world_size)]
