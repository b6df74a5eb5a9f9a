"""Ground truth for DeepSpeed ranks: REAL DeepSpeed (``deepspeed.initialize`` + ``engine.backward`` +
``engine.step``, its CPU accelerator, ``DS_ACCELERATOR=cpu``) on gloo in ``world_size`` processes
(torch.multiprocessing.spawn, a file store so jobs do not collide), nothing of graphmem's. Each rank
measures, per step, what tests/dist_truth.py measures:

- saved bytes: the distinct storages autograd saves in forward and loss, the module's parameters
  and buffers (read at each save) excluded;
- held before and after the step: the bytes of the distinct storages of every tensor alive in the
  process (``gc.get_objects()``; meta tensors have none), so nothing DeepSpeed keeps is missed;
- the peak: the held bytes before the step plus the highest running sum of the CPU allocator's
  events under torch.profiler, gloo's collectives settled (tests/settle.py).
"""
from __future__ import annotations

import gc
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_truth import _profiled
from tests.settle import COLLECTIVES, addresses, high, settle


def decoder(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny transformers Llama (2 layers, hidden 64) and its batch (2 x 32 tokens, labels = inputs)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(config).train(), {"input_ids": ids, "labels": ids}


def held_bytes(kept: list) -> int:
    """The bytes of the distinct storages of every tensor alive in this process (meta excluded), but
    those of ``kept`` (earlier steps' outputs, kept alive for the profiler: see tests/dist_truth.py ``_step``;
    a user's loop drops them before the next step)."""
    gc.collect()
    seen: dict[int, int] = {}
    for o in gc.get_objects():
        if isinstance(o, torch.Tensor) and o.device.type != "meta":
            st = o.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    for ptr in addresses(kept) | {0}:  # (0: empty storages)
        seen.pop(ptr, None)
    return sum(seen.values())


def _tensors(obj: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in a model output, through dicts, lists and objects' attributes: transformers' ``DynamicCache``
    (``past_key_values``) holds its keys and values in objects that tests/settle.py ``addresses`` does not walk
    (missed, the last step's cache read as held before the next: +32,768 B on this decoder in fp32)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if depth > 6:
        return []
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else \
        vars(obj).values() if type(obj).__module__.startswith("transformers") else ()
    return [t for v in items for t in _tensors(v, depth + 1)]


def _step(engine: Any, batch: dict, kept: list) -> dict[str, int]:
    """One optimizer step as a user's loop runs it: ``gradient_accumulation_steps`` micro-steps of
    ``out = engine(**batch); engine.backward(out.loss); engine.step()`` (DeepSpeed's engine steps the
    optimizer on the last: deepspeed/runtime/engine.py ``is_gradient_accumulation_boundary``), the
    previous micro-step's output held until the next one returns."""
    params = {p.untyped_storage().data_ptr() for p in engine.module.parameters()}
    saved: dict[int, int] = {}
    on = [True]

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if on[0] and st.data_ptr() not in params and st.data_ptr() not in \
                {p.untyped_storage().data_ptr() for p in engine.module.parameters()}:
            saved[st.data_ptr()] = st.nbytes()
        return t

    before = held_bytes(kept)
    with _profiled() as prof, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for _ in range(engine.gradient_accumulation_steps()):  # micro-steps: the optimizer steps on the last
            on[0] = True
            saved.clear()  # each micro-step saves the same: the last one's set is the step's
            out = engine(**batch)
            on[0] = False
            engine.backward(out.loss)
            engine.step()
    after = held_bytes(kept)
    held = addresses([t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type != "meta"])
    kept.append(_tensors(out))
    return {"saved": sum(saved.values()), "before": before, "after": after, "peak": before + high(prof, held)}


def _worker(rank: int, world_size: int, init: str, cases: list[dict], out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    unsettled = settle((*COLLECTIVES, "broadcast", "reduce", "all_reduce_coalesced", "reduce_scatter_tensor"))
    import deepspeed

    try:
        results = []
        for config in cases:
            model, batch = decoder()
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            kept: list = []
            steps = [_step(engine, batch, kept) for _ in range(2)]
            results.append({"first": steps[0], "later": steps[1], "unsettled": unsettled[0]})
            del engine, optimizer, model, kept
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_ds_ranks(cases: list[dict], world_size: int = 2) -> list[list[dict]]:
    """For each DeepSpeed config, each rank's {"first", "later": {"saved", "before", "after", "peak"}}, one
    job per config: DeepSpeed keeps references of an engine in module globals, so a second engine in the
    same process would find the first one's tensors alive (ZeRO-3 after ZeRO-1 read +904 KB held)."""
    results = []
    for config in cases:
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'store')}"
            out = os.path.join(tmp, "result")
            mp.spawn(_worker, args=(world_size, init, [config], out), nprocs=world_size, join=True)
            results.append([torch.load(f"{out}.{r}")[0] for r in range(world_size)])
    return results
