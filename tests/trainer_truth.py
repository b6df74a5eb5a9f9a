"""Ground truth for a transformers Trainer's step per rank: a REAL job of ``world_size`` CPU processes
over gloo (torch.multiprocessing.spawn), each rank's Trainer built as ``torchrun`` would build it
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT in the environment, which accelerate's
PartialState reads through ``TrainingArguments(use_cpu=True)``: the accelerator is MULTI_CPU,
its backend gloo, accelerate's default there (``ddp_backend="gloo"`` says the same, but such
arguments cannot be built in the one analysis process: accelerate's PartialState then asks
torch.distributed for a world size it has not got) and ``accelerator.prepare`` wraps the model in DistributedDataParallel
itself). Nothing of graphmem's runner or wrappers runs here: the step is the Trainer's own code,
called as ``Trainer.train`` (activation checkpointing, 1502-1528), ``_prepare_for_training`` and
``_run_epoch`` call it (transformers 5.24 ``trainer.py`` 1741-1778, 1881-1954), written out below.

Each rank measures, from the CPU allocator's events under one torch.profiler window spanning
``accelerator.prepare`` and two steps (tests/dist_truth.py ``_profiled``, the garbage collector
paused; phases told apart by marker allocations as tests/zero_truth.py does): the bytes held once
DDP and the optimizer are built (the parameters, buffers and batch, live before the window, plus
what ``prepare`` left: DDP's buckets), each step's peak, and the distinct storages autograd saves
in the last micro-step's forward and loss (parameters and buffers excluded; in a third step).
``accelerator.prepare_model`` moves the model to ``accelerator.device``, ``cpu:0`` on a MULTI_CPU
job, and ``Tensor.to`` from ``cpu`` to ``cpu:0`` copies every parameter and buffer into a new
storage (seen in the profiler: ``aten::_to_copy`` under ``prepare_model``'s ``model.to``); the old
storages, allocated before the window, die inside it without a free event (the allocator's
profiler reporter knows only blocks allocated while a profile ran): the bytes of the copies held
at the first marker (allocations under ``aten::_to_copy``, each as large as its original) are
taken off (``moved``). The collectives the
Trainer calls from Python (accelerate's gather of the token count) are settled (tests/settle.py:
held until gloo's thread has released their work, no sleeps); DDP's all-reduce runs in place on
buckets the Reducer holds, but the Reducer runs small collectives of its own in C++, out of Python's
reach (tests/zero_truth.py saw a 4 B block left unfreed there in one run of two): each figure is
still the least of ``REPEAT`` runs (fresh Trainers)."""
from __future__ import annotations

import contextlib
import functools
import os
import socket
import tempfile
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType

from tests.dist_truth import _grads, _held, _keys, _profiled
from tests.settle import addresses, settle
from tests.zero_truth import MARK, _mark, _phases

REPEAT = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _environment(rank: int, world_size: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _step(trainer: Any, model: Any, batch: dict, saved: Optional[dict[int, Any]] = None,
          excluded: frozenset[int] = frozenset()) -> None:
    """One optimizer step as ``_run_epoch`` runs it (1881-1954): k prefetched micro-batches, all but
    the last under ``accelerator.no_sync``, clipping, the optimizer and scheduler steps, zero_grad.
    ``saved``: the storages autograd saves in the last micro-step's forward and loss, by address,
    each held (so no address is reused for another while counting: a step of its own, unprofiled)."""
    k = trainer.args.gradient_accumulation_steps
    batches = [batch] + [{n: v.clone() for n, v in batch.items()} for _ in range(k - 1)]
    samples, num_items = trainer.get_batch_samples(iter(batches), k, trainer.args.device)
    trainer.current_gradient_accumulation_steps = len(samples)
    compute_loss = trainer.compute_loss
    on = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if on[0] and saved is not None and st._cdata not in excluded:
            saved[st._cdata] = st
        return t

    def counted(*args: Any, **kwargs: Any) -> Any:  # the last micro-step's forward and loss
        if saved is not None:
            saved.clear()
        on[0] = True
        try:
            return compute_loss(*args, **kwargs)
        finally:
            on[0] = False

    trainer.compute_loss = counted
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for i, inputs in enumerate(samples):
                last = i == len(samples) - 1
                trainer.accelerator.gradient_state._set_sync_gradients(last)
                sync: Callable = contextlib.nullcontext if last else functools.partial(trainer.accelerator.no_sync,
                                                                                        model=model)
                with sync():
                    loss = trainer.training_step(model, inputs, num_items)
                trainer._tr_loss += loss
    finally:
        del trainer.compute_loss
    grad_norm = trainer._clip_grad_norm(model) if trainer.args.max_grad_norm > 0 else None
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    del grad_norm  # _run_epoch's ``grad_norm`` holds the norm's tensor through the optimizer step (1937-1958)


def _run(make: Callable[[str], Any], kept: list) -> dict[str, int]:
    """One real job's figures on this rank, in bytes (the held ones with the parameters, buffers and batch)."""
    from graphmem.frontends.trainer import trainer_batch

    with tempfile.TemporaryDirectory() as out:
        trainer = make(out)
    assert trainer.accelerator.distributed_type.value == "MULTI_CPU", trainer.accelerator.distributed_type
    torch.manual_seed(0)
    batch = trainer_batch(trainer, (trainer.args.per_device_train_batch_size, 16))  # (only makes the batch)
    args = trainer.args
    if args.activation_checkpointing:  # Trainer.train (1502-1528), before _prepare_for_training
        kwargs = dict(args.activation_checkpointing_kwargs or {})
        every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
        trainer.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                                      every_n_layers=every_n_layers, offload=offload)
    base = sum(_keys(_held(trainer.model) + list(batch.values())).values())
    with _profiled() as prof:
        trainer.create_optimizer()
        model, trainer.optimizer = trainer.accelerator.prepare(trainer.model, trainer.optimizer)
        trainer.create_scheduler(num_training_steps=2)
        _mark(0)
        trainer._tr_loss = torch.tensor(0.0)  # _inner_training_loop; the runner makes it in the first step
        for step in range(2):
            _step(trainer, model, batch)
            _mark(step + 1)
    saved: dict[int, Any] = {}
    _step(trainer, model, batch, saved, frozenset(_keys(_held(trainer.model))))
    states = [t for s in trainer.optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    held = addresses([*_held(trainer.model), *_grads(trainer.model), *batch.values(), *states, trainer._tr_loss])
    kept.append((trainer, model, batch))  # freed after profiling would confuse the next window
    at, highs = _phases(prof, 3, held)
    moved = _copies(prof)
    base -= moved
    return {"built": base + at[0], "between": base + at[1], "peak": base + highs[0], "later": base + highs[1],
            "saved": sum(st.nbytes() for st in saved.values()), "moved": moved}


def _copies(prof: Any) -> int:
    """Bytes of the ``aten::_to_copy`` blocks made before the first marker (``prepare_model``'s
    ``model.to``) and still held there: one per original storage from before the window. (A tied
    weight is copied once per module holding it, ``Module._apply``; the first copy's free is seen.)"""
    events: list[tuple[int, int, int, bool]] = []  # (time, size, ptr, made by _to_copy)
    todo = list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            copy = e.parent is not None and e.parent.parent is not None and e.parent.parent.name == "aten::_to_copy"
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr, copy))
        todo.extend(e.children)
    events.sort()
    start = next(t for t, size, _, _ in events if size == MARK)
    held: dict[int, int] = {}
    for t, size, ptr, copy in events:
        if t >= start:
            break
        if size > 0 and copy:
            held[ptr] = size
        elif size < 0:
            held.pop(ptr, None)
    return sum(held.values())


def _worker(rank: int, world_size: int, port: int, make: Callable[[str], Any], out: str, unsettled: list[int]) -> None:
    _environment(rank, world_size, port)
    torch.set_num_threads(1)
    try:
        kept: list = []
        runs = [_run(make, kept) for _ in range(REPEAT)]
        assert dist.is_initialized() and dist.get_world_size() == world_size and dist.get_backend() == "gloo"
        assert len({r["saved"] for r in runs}) == 1, runs
        torch.save({**{k: min(r[k] for r in runs) for k in runs[0]}, "unsettled": unsettled[0]}, f"{out}.{rank}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawned(rank: int, world_size: int, port: int, make: Callable[[str], Any], out: str) -> None:
    _worker(rank, world_size, port, make, out, settle(("all_gather_into_tensor", "all_gather")))


def real_trainer_ranks(make: Callable[[str], Any], world_size: int = 2) -> list[dict[str, int]]:
    """Each rank's {"built", "between", "peak", "later", "saved"} from a real gloo job of
    ``world_size`` processes, the Trainer made by ``make(output_dir)`` in each (a picklable,
    module-level function)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_spawned, args=(world_size, _free_port(), make, out), nprocs=world_size, join=True)
        ranks = [torch.load(f"{out}.{r}") for r in range(world_size)]
    assert all(r["unsettled"] == 0 for r in ranks), ranks  # every gather's work was released on the rank's thread
    return ranks
