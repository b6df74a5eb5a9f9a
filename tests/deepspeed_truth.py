"""Ground truth for DeepSpeed ranks: REAL DeepSpeed (``deepspeed.initialize`` + ``engine.backward`` +
``engine.step``, its CPU accelerator, ``DS_ACCELERATOR=cpu``) on gloo in ``world_size`` processes
(torch.multiprocessing.spawn, a file store so jobs do not collide), nothing of graphmem's. Each rank
measures, per step, what tests/dist_truth.py measures:

- saved bytes: the distinct storages autograd saves in forward and loss, the module's parameters
  and buffers (read at each save) excluded;
- held before and after the step: the bytes of the distinct storages of every tensor alive in the
  process (``gc.get_objects()``; meta tensors have none), so nothing DeepSpeed keeps is missed;
- the peak: the held bytes before the step plus the highest running sum of the CPU allocator's
  events under torch.profiler, gloo's collectives settled (tests/settle.py);
- with CPU offload, the host bytes before and after the first step (``host_bytes``): the buffers DeepSpeed
  places on its offload device, found by the attributes its ZeRO optimizers keep them in, each "pinned"
  when DeepSpeed passed it through its accelerator's ``pin_memory`` (recorded as it runs), else "pageable".
"""
from __future__ import annotations

import gc
import os
import tempfile
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.dist_truth import _profiled
from tests.settle import COLLECTIVES, addresses, high, settle


def decoder(dtype: torch.dtype = torch.float32, kind: str = "llama") -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny transformers Llama (2 layers, hidden 64), or with ``kind="gpt2"`` a tiny GPT-2 (2 layers, hidden 64, 4
    heads, its dropouts at transformers' 0.1, lm_head tied to the token embedding), and its batch (2 x 32 tokens,
    labels = inputs)."""
    import transformers

    torch.manual_seed(0)
    if kind == "gpt2":
        model: torch.nn.Module = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64))
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    return model.train(), {"input_ids": ids, "labels": ids}


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


# where DeepSpeed 0.19.8 keeps what it places on the offload device: ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py
# ``DeepSpeedZeroOptimizer.__init__``: ``self.device = 'cpu'`` under ``cpu_offload``) makes its fp32 partitions
# (their ``.grad``: ``initialize_optimizer_states``), the 16-bit copies of them and the gradient staging buffer there;
# ZeRO-3 (stage3.py ``DeepSpeedZeroOptimizer_Stage3``: ``self.device = OffloadDeviceEnum.cpu`` under
# ``offload_optimizer``) its fp32 partitions and the flat gradient partitions, and under ``offload_param`` the
# 16-bit partitions (``_create_param_groups_fp16_flat_cpu_memory``); the torch optimizer's states follow its
# parameters (the fp32 partitions) there
_OFFLOADED = ("single_partition_of_fp32_groups", "param_buffer_of_bit16_for_cpu_offload_groups",
              "temp_grad_buffer_for_cpu_offload", "accumulated_grads_in_cpu", "fp32_partitioned_groups_flat",
              "grad_partitions_flat_buffer")
_PARAM_OFFLOADED = ("param_groups_fp16_flat_cpu_memory",)


def _attr(obj: Any, name: str) -> Any:
    value = getattr(obj, name, None)
    return [] if value is None else value


def host_bytes(engine: Any, pinned: list) -> dict[str, int]:
    """The bytes of the distinct storages DeepSpeed keeps on its offload device (``_OFFLOADED``, the inner
    optimizer's states; ``_PARAM_OFFLOADED`` and the parameters' ``ds_tensor`` under ``offload_param``), split
    into "pinned" (a storage DeepSpeed's accelerator ``pin_memory`` returned and that still holds it) and
    "pageable"."""
    opt, zero = engine.optimizer, engine.zero_optimization()
    found: list[torch.Tensor] = []
    if engine.zero_cpu_offload():
        for name in _OFFLOADED:
            found += _tensors(_attr(opt, name))
        found += [t.grad for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                  for t in _attr(opt, name) if t.grad is not None]
        found += [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    if zero and engine.zero_offload_param() is not None and engine.zero_offload_param().device == "cpu":
        found += _tensors(_attr(opt, _PARAM_OFFLOADED[0]))
        found += [p.ds_tensor for p in engine.module.parameters() if hasattr(p, "ds_tensor")]
    pins = {ptr for ref, ptr in pinned if ref() is not None and ref().untyped_storage().data_ptr() == ptr}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    storages.pop(0, None)
    return {"pinned": sum(b for p, b in storages.items() if p in pins),
            "pageable": sum(b for p, b in storages.items() if p not in pins)}


_FLAT = ("bit16_groups_flat", "single_partition_of_fp32_groups", "lp_param_buffer", "fp16_partitioned_groups_flat",
         "param_groups_fp16_flat_cpu_memory", "fp32_partitioned_groups_flat", "grad_partitions_flat_buffer")


def residuals(engine: Any) -> dict[str, int]:
    """DeepSpeed's own figures of its residual states on this rank: the bytes of the distinct storages of its
    flat partitions (``_FLAT``, the attributes of its ZeRO optimizers) and its alignment padding in elements:
    ``flat_padding`` of the 16-bit flat buffer (stage 1/2: its length less the group's parameters'),
    ``padding`` of this rank's partitions (``groups_padding``, stage_1_and_2.py and stage3.py)."""
    opt = engine.optimizer
    found = [t for name in _FLAT for t in _tensors(_attr(opt, name))]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in found}
    storages.pop(0, None)
    flat = getattr(opt, "bit16_groups_flat", None)
    return {"flat": sum(storages.values()),
            "flat_padding": sum(f.numel() - sum(p.numel() for p in g) for f, g in zip(flat, opt.bit16_groups))
            if flat is not None else 0,
            "padding": sum(sum(p) if isinstance(p, list) else p for p in getattr(opt, "groups_padding", []))}


def _recording_pins(pinned: list) -> None:
    """Wrap DeepSpeed's accelerator ``pin_memory`` (on its CPU accelerator a no-op returning the tensor:
    deepspeed/accelerator/cpu_accelerator.py) to record what it returns, with its storage's address."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    pin = acc.pin_memory

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = pin(tensor, *args, **kwargs)
        pinned.append((weakref.ref(out), out.untyped_storage().data_ptr()))
        return out
    acc.pin_memory = recorded


def _worker(rank: int, world_size: int, init: str, cases: list[dict], out: str, kind: str = "llama") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), DS_ACCELERATOR="cpu")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    unsettled = settle((*COLLECTIVES, "broadcast", "reduce", "all_reduce_coalesced", "reduce_scatter_tensor"))
    import deepspeed

    pinned: list = []
    _recording_pins(pinned)
    try:
        results = []
        for config in cases:
            model, batch = decoder(kind=kind)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
            kept: list = []
            host = [host_bytes(engine, pinned)]
            steps = [_step(engine, batch, kept)]
            host.append(host_bytes(engine, pinned))
            steps.append(_step(engine, batch, kept))
            results.append({"first": steps[0], "later": steps[1], "unsettled": unsettled[0],
                            "host": {"before": host[0], "after": host[1]}, "residual": residuals(engine)})
            del engine, optimizer, model, kept
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_ds_ranks(cases: list[dict], world_size: int = 2, kind: str = "llama") -> list[list[dict]]:
    """For each DeepSpeed config, ``kind``'s decoder (``decoder``), each rank's {"first", "later": {"saved", "before", "after", "peak"}}, one
    job per config: DeepSpeed keeps references of an engine in module globals, so a second engine in the
    same process would find the first one's tensors alive (ZeRO-3 after ZeRO-1 read +904 KB held)."""
    results = []
    for config in cases:
        with tempfile.TemporaryDirectory() as tmp:
            init = f"file://{os.path.join(tmp, 'store')}"
            out = os.path.join(tmp, "result")
            mp.spawn(_worker, args=(world_size, init, [config], out, kind), nprocs=world_size, join=True)
            results.append([torch.load(f"{out}.{r}")[0] for r in range(world_size)])
    return results
