"""What DeepSpeed's engine needs to run on fake tensors under the fake process group, each at the
narrowest point, and the tensors the engine holds, named by where DeepSpeed keeps them.

Patches (each undone on exit):
- ``deepspeed.comm.torch.build_shm_op`` returns None: ``TorchBackend.__init__`` JIT-compiles and
  initializes a shared-memory all-reduce across the node's real processes; DeepSpeed uses it only in
  ``inference_all_reduce`` (deepspeed/comm/torch.py), never in a training step, and there is one process here.
- ``module.to(engine.device)`` is the identity: ``DeepSpeedEngine._configure_distributed_model``
  (deepspeed/runtime/engine.py) moves the module to the accelerator's device, the CPU where the fake
  copy already is (a real ``.to`` returns the same tensors); ``Module._apply`` would instead swap each
  fake parameter with itself (``torch.utils.swap_tensors``), which a tensor with weak references
  (the recorder's) refuses.
- ZeRO-3's cross-rank checks of parameter ids and orders (deepspeed/runtime/zero/utils.py
  ``assert_lst_len_same_as_other_ranks``, ``get_lst_from_rank0``, called by ``assert_ints_same_as_other_ranks``)
  make and broadcast the same small int64 tensors, but return this rank's own list instead of reading
  rank 0's back: under the fake group the broadcast moves no data, and every rank holds the same lists.
- Reads of a tensor's value (``.item()``, ``bool()``) are answered by the fake mode: a bool False (the
  overflow and non-finite-norm checks: deepspeed/runtime/utils.py ``is_invalid_grad_norm``,
  ``CheckOverflow``; a real fp32/bf16 step has none), a uint8 0 (the ZeRO optimizers' overflow flag,
  ``overflow_gpu[0].item()`` in ``has_overflow``: deepspeed/runtime/zero/stage_1_and_2.py and stage3.py,
  read under bf16 where ``bf16.check_grad_overflow`` defaults to true, and under fp16), a float 1.0 (a
  norm that scales the clipping coefficient, a Python number), any other int 1. None decides a size.

- DeepSpeed's accelerator ``pin_memory`` (on its CPU accelerator a no-op that returns the tensor:
  deepspeed/accelerator/cpu_accelerator.py ``CPU_Accelerator.pin_memory``) is wrapped to record what it returns:
  the buffers DeepSpeed pins on the host (CUDA's accelerator pins each with ``tensor.pin_memory()``).

CPU offload (``host_tensors``): DeepSpeed places its optimizer side on the host under
``offload_optimizer.device: cpu``. ZeRO-1/2 (deepspeed/runtime/zero/stage_1_and_2.py
``DeepSpeedZeroOptimizer.__init__``, ``self.device = 'cpu'`` under ``cpu_offload``): the fp32 partitions
``single_partition_of_fp32_groups`` and their gradients (``initialize_optimizer_states``, reached through
``offload_gradient_dict``), the 16-bit staging copies ``param_buffer_of_bit16_for_cpu_offload_groups``, the
gradient staging buffer ``temp_grad_buffer_for_cpu_offload`` and ``accumulated_grads_in_cpu`` (gradient
accumulation); ``temp_grad_buffer_for_gpu_offload`` stays on the accelerator. ZeRO-3 (stage3.py
``DeepSpeedZeroOptimizer_Stage3``, ``self.device = OffloadDeviceEnum.cpu`` under ``offload_optimizer``): the fp32
partitions ``fp32_partitioned_groups_flat`` (never pinned) and their gradients, ``grad_partitions_flat_buffer``;
under ``offload_param.device: cpu`` the 16-bit partitions in ``param_groups_fp16_flat_cpu_memory``
(``_create_param_groups_fp16_flat_cpu_memory``, pinned whatever ``pin_memory`` says) that each parameter's
``ds_tensor`` and ``fp16_partitioned_groups_flat`` view. The torch optimizer's states are made beside its
parameters, the fp32 partitions: on the host, pageable. Which are pinned is what DeepSpeed passes through
``pin_memory`` (each ``if ...pin_memory:`` in the code above), recorded as it runs.

Known limitations: NVMe swapping is not run here (graphmem/deepspeed/config.py refuses it); DeepSpeedCPUAdam
(a C++ op) is not run: a torch optimizer steps the host partitions (``zero_force_ds_cpu_optimizer: false``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import deque
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from graphmem.capture.recorder import _Mode


def _answer(t: torch.Tensor) -> Any:
    return False if t.dtype == torch.bool else 0 if t.dtype == torch.uint8 else 1.0 if t.is_floating_point() else 1


Pins = list[tuple["weakref.ref[torch.Tensor]", int]]  # what DeepSpeed's pin_memory returned, with its storage


@contextlib.contextmanager
def engine_on_fake(mode: _Mode, pins: Optional[Pins] = None) -> Iterator[None]:
    """The patches of the module docstring around DeepSpeed's initialize and step; what DeepSpeed pins is
    appended to ``pins``."""
    import deepspeed  # noqa: F401  (deepspeed.comm.torch imported with it)
    import deepspeed.runtime.zero.utils as zero_utils
    from deepspeed.accelerator import get_accelerator

    comm: Any = sys.modules["deepspeed.comm.torch"]  # (``deepspeed.comm.torch`` as an attribute is torch itself)
    built, answer = comm.build_shm_op, mode.scalar_answer
    checks = zero_utils.assert_lst_len_same_as_other_ranks, zero_utils.get_lst_from_rank0
    accelerator = get_accelerator()
    pin, own = accelerator.pin_memory, dict(vars(accelerator))
    comm.build_shm_op = lambda: None
    mode.scalar_answer = _answer
    zero_utils.assert_lst_len_same_as_other_ranks, zero_utils.get_lst_from_rank0 = _length_broadcast, _list_broadcast
    accelerator.pin_memory = lambda t, *a, **k: _pinned(pin(t, *a, **k), pins if pins is not None else [])
    try:
        yield
    finally:
        comm.build_shm_op, mode.scalar_answer = built, answer
        zero_utils.assert_lst_len_same_as_other_ranks, zero_utils.get_lst_from_rank0 = checks
        if "pin_memory" in own:
            accelerator.pin_memory = own["pin_memory"]
        else:
            del accelerator.pin_memory  # (the class's method again)


def _pinned(t: torch.Tensor, pins: Pins) -> torch.Tensor:
    pins.append((weakref.ref(t), t.untyped_storage()._cdata))
    return t


def pinned_storages(pins: Pins) -> set[int]:
    """The storages (``_cdata``) DeepSpeed pinned that a tensor it pinned still holds (ZeRO-3 moves a pinned
    ``ds_tensor`` into a flat buffer: ``src.data = dest.data``, stage3.py ``_move_to_flat_buffer``)."""
    return {cd for ref, cd in pins if (t := ref()) is not None and t.untyped_storage()._cdata == cd}


# where DeepSpeed keeps what it places on the host (the module docstring): optimizer offload, parameter offload
_OFFLOADED = ("optimizer.single_partition_of_fp32_groups", "optimizer.offload_gradient_dict",
              "optimizer.param_buffer_of_bit16_for_cpu_offload_groups", "optimizer.temp_grad_buffer_for_cpu_offload",
              "optimizer.accumulated_grads_in_cpu", "optimizer.fp32_partitioned_groups_flat",
              "optimizer.grad_partitions_flat_buffer")
_MASTERS = ("optimizer.single_partition_of_fp32_groups", "optimizer.fp32_partitioned_groups_flat")  # (their .grad)
_PARAM_OFFLOADED = ("optimizer.param_groups_fp16_flat_cpu_memory", "optimizer.fp16_partitioned_groups_flat")


PINNED, PAGEABLE = " (host, pinned)", " (host, pageable)"  # how a host storage's name ends


def name_host(cap: Any, engine: Any, pins: Pins) -> None:
    """End the name of each live storage of ``host_tensors(engine)`` with where DeepSpeed placed it,
    ``PINNED`` or ``PAGEABLE`` (``cap``: the recorder, its live storages by ``_cdata``)."""
    pinned = pinned_storages(pins)
    for path, t in host_tensors(engine):
        cd = t.untyped_storage()._cdata
        s = cap.live.get(cd)
        if s is not None and not s.name.endswith((PINNED, PAGEABLE)):
            # (ZeRO-3's fp32 partitions' ``.grad``, which ``held_tensors`` does not walk: met first as an op's input)
            s.name = (path if s.name.startswith("external_") else s.name) + (PINNED if cd in pinned else PAGEABLE)


def host_tensors(engine: Any) -> list[tuple[str, torch.Tensor]]:
    """The tensors DeepSpeed's ``engine`` keeps on the host under CPU offload (the module docstring), by path."""
    offload_param = engine.zero_offload_param()
    keys = (_OFFLOADED if engine.zero_cpu_offload() else ()) \
        + (_PARAM_OFFLOADED if offload_param is not None and offload_param.device == "cpu" else ())
    if not keys:
        return []
    out = [(p, t) for p, t in held_tensors(engine) if p.startswith(keys)
           or (keys[-1] == _PARAM_OFFLOADED[-1] and p.endswith(".ds_tensor"))]
    grads = [(f"{p}.grad", t.grad) for p, t in out if p.startswith(_MASTERS) and isinstance(t.grad, torch.Tensor)]
    inner = getattr(engine.optimizer, "optimizer", None) if engine.zero_cpu_offload() else None
    states = [(f"optimizer.optimizer.state[{i}].{k}", v) for i, st in enumerate(getattr(inner, "state", {}).values())
              for k, v in st.items() if isinstance(v, torch.Tensor)]  # (beside the fp32 partitions they step)
    return out + grads + states


@contextlib.contextmanager
def naming_buckets(cap: Any, engine: Any) -> Iterator[None]:
    """ZeRO-1/2's reduce buckets (``ipg_buckets[dtype].buffer``: made as backward starts, released at its end by
    ``_release_ipg_buffers``, deepspeed/runtime/zero/stage_1_and_2.py) named "communication" (the budget's
    communication buffers row) just before DeepSpeed releases them. ZeRO-3's exist before the step, named by path."""
    opt = engine.optimizer
    release = getattr(opt, "_release_ipg_buffers", None)
    if release is None or not hasattr(opt, "ipg_buckets"):
        yield
        return

    def named() -> Any:
        for dtype, bucket in opt.ipg_buckets.items():
            for i, t in enumerate(bucket.buffer):
                cap.relabel(t, "communication", f"optimizer.ipg_buckets[{dtype}].buffer[{i}] (reduce bucket)")
        return release()
    opt._release_ipg_buffers = named
    try:
        yield
    finally:
        del opt._release_ipg_buffers


def _broadcast(values: Any) -> torch.Tensor:
    """DeepSpeed's tensor of ``values`` (int64 on the CPU accelerator), broadcast from rank 0, and its ``.cpu()``."""
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.int64, device=torch.device("cpu"), requires_grad=False)
    dist.broadcast(t, src=0, async_op=False)
    return t.cpu()


def _length_broadcast(lst: list[int]) -> None:
    _broadcast(len(lst))


def _list_broadcast(lst: list[int]) -> list[int]:
    _broadcast(lst)
    return list(lst)


# What DeepSpeed patches process-wide and leaves patched (deepspeed/runtime/zero/partition_parameters.py):
# ZeRO-3's ``Init`` swaps ``torch.nn.functional.linear`` for its memory-efficient ``zero3_linear_wrap``
# ("This will persist unless manually reset", ``_enable_mem_efficient_linear``), and ``patch_init_and_builtins``
# wraps Module's ``__init_subclass__`` and ``apply``, ``Tensor.__new__`` and torch's tensor constructors. In
# the job's own process that is DeepSpeed's step; after graphmem's capture it would change every later step
# the process records (another linear's ops), so ``launched`` puts each one back.
_PATCHED = ((torch.nn.functional, "linear"), (torch.nn.functional, "embedding"), (nn.Module, "__init_subclass__"),
            (nn.Module, "apply"), (torch.Tensor, "__new__"),
            *((torch, f) for f in ("tensor", "empty", "zeros", "ones", "full", "arange", "eye", "randn")))
_MISSING = object()


@contextlib.contextmanager
def launched(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank``'s launcher environment (``LOCAL_RANK``, which ``DeepSpeedEngine._do_args_sanity_check``
    asserts, and torchrun's others: graphmem/training/hf_trainer_fsdp.py ``torchrun_env``) and DeepSpeed's
    CPU accelerator (``DS_ACCELERATOR=cpu``, read by deepspeed/accelerator/real_accelerator.py when deepspeed
    is first imported); the environment, DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``) and
    its cached process groups (deepspeed/utils/groups.py globals), bound to this fake group, put back after."""
    import deepspeed.utils.groups as groups

    from graphmem.training.hf_trainer_fsdp import torchrun_env

    kept = {k: v for k, v in vars(groups).items() if k.startswith("_") and k.endswith(("_GROUP", "_GROUP_RANKS", "_RANK",
                                                                                        "_WORLD_SIZE"))}
    kept["mesh_device"] = groups.mesh_device
    patched = {(owner, name): vars(owner).get(name, _MISSING) for owner, name in _PATCHED}  # the raw descriptors
    env = dict(os.environ)
    os.environ.update(torchrun_env(rank, world_size, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed.comm.comm as ds_comm
        from deepspeed.accelerator import get_accelerator

        if get_accelerator().device_name() != "cpu":  # (deepspeed imported before, on a GPU machine)
            from deepspeed.accelerator import set_accelerator
            from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            set_accelerator(CPU_Accelerator())
        yield
    finally:
        ds_comm.cdb = None
        for k, v in kept.items():  # DeepSpeed's process groups (deepspeed/utils/groups.py), made over this fake group
            setattr(groups, k, v.copy() if isinstance(v, dict) else v)
        os.environ.clear()
        os.environ.update(env)
        for (owner, name), value in patched.items():  # DeepSpeed's process-wide patches, as they were
            if value is _MISSING and name in vars(owner):
                delattr(owner, name)
            elif value is not _MISSING and vars(owner).get(name) is not value:
                setattr(owner, name, value)


@contextlib.contextmanager
def staying(module: nn.Module) -> Iterator[None]:
    """``module.to(...)`` as the identity while DeepSpeed sets up (the module docstring)."""
    module.to = lambda *args, **kwargs: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.to


_SKIP = (type, type(len), type(_answer), type(sys))  # classes, builtins, functions, modules


def held_tensors(engine: Any, limit: int = 40) -> list[tuple[str, torch.Tensor]]:
    """Every tensor reachable from ``engine`` through attributes, lists, tuples and dicts (and a
    tensor's own attributes: ZeRO-3's ``param.ds_tensor``), first found breadth first, with the
    path it was found by (``optimizer.bit16_groups_flat[0]``): the tensors the engine holds."""
    seen: set[int] = set()
    out: list[tuple[str, torch.Tensor]] = []
    todo: deque[tuple[str, Any, int]] = deque([("", engine, 0)])
    while todo:
        path, obj, depth = todo.popleft()
        if id(obj) in seen or isinstance(obj, _SKIP) or depth > limit:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type != "meta":  # (ZeRO-1/2's ``round_robin_bit16_meta``: shapes only, no memory)
                out.append((path, obj))
            # (ZeRO-3's ``param.ds_tensor``; not a fake tensor's ``constant``: the fake mode's real copy of a
            # lifted constant, e.g. torch's AdamW ``step``, is its bookkeeping, not memory DeepSpeed holds)
            children: Any = [(k, v) for k, v in vars(obj).items() if not (k == "constant" and isinstance(obj, FakeTensor))] \
                if hasattr(obj, "__dict__") else ()
        elif isinstance(obj, dict):
            children = [(k if isinstance(k, (str, int)) else f"#{i}", v) for i, (k, v) in enumerate(obj.items())]
        elif isinstance(obj, (list, tuple)):
            children = list(enumerate(obj))
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in ("deepspeed", "torch", "transformers") \
                or isinstance(obj, (nn.Module, torch.optim.Optimizer)):
            children = vars(obj).items()
        else:
            continue
        for key, value in children:
            if isinstance(key, str) and (key.startswith("__") and key.endswith("__") or key.startswith("_graphmem")):
                continue
            name = f"{path}[{key}]" if not isinstance(key, str) else f"{path}.{key}" if path else key
            todo.append((name.replace("._modules.", ".").replace("._parameters.", ".").replace("._buffers.", "."),
                         value, depth + 1))
    return out


__all__ = ["PAGEABLE", "PINNED", "Pins", "engine_on_fake", "held_tensors", "host_tensors", "launched", "name_host", "naming_buckets", "pinned_storages", "staying"]
