"""FSDP2 on a fake copy of the model: ``fully_shard`` per block of the chain, then the root.

What the recorder cannot see by itself (graphmem/capture/recorder.py records dispatched ops and
storages dying): FSDP2 frees an unsharded parameter with ``UntypedStorage.resize_(0)`` and
allocates it again with ``resize_(nbytes)`` (torch/distributed/fsdp/_fully_shard/_fsdp_param.py,
``free_storage`` / ``alloc_storage``), and its collectives' buffers are ordinary op outputs.
``watching`` reports both to the recorder while the step runs, and names the buffers:

- ``fsdp.all_gather_copy_in``'s flat output (the all-gather buffer, ``world_size`` x the unit's
  shards; its input is a view of it) and ``fsdp.chunk_cat``'s output (the reduce-scatter input):
  kind "communication";
- the ``out`` tensors of ``fsdp.split_with_sizes_copy`` (FSDPParam.all_gather_outputs, the
  unsharded parameters' storage): kind "gathered parameter";
- ``c10d._reduce_scatter_base_``'s output: "communication" until it becomes the sharded
  gradients (capture marks it "gradient" then);
- the outputs of the functional collectives DTensor's redistributions run (tensor parallel):
  "communication".

With ``set_requires_gradient_sync(False)`` the unsharded gradients stay on the rank between
micro-batches (``unsharded_grads`` names them "gradient": the rank holds them whole until the
micro-batch that reduce-scatters them).
"""
from __future__ import annotations

import contextlib
import copy
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, Union

import torch
import torch.nn as nn

from graphmem.capture.fakes import _fake_like
from graphmem.capture.recorder import _Recorder
from graphmem.chains import find_chain
from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext
    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._op_schema import OpSchema
    from torch.distributed.tensor._sharding_prop import ShardingPropagator


def fake_copy(model: nn.Module, dtype: Optional[torch.dtype]) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fresh fake tensors (run under the
    fake mode); tied parameters stay tied, the given module is untouched and nothing real is
    copied (deepcopy's memo hands it the fake tensors)."""
    memo: dict[int, torch.Tensor] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(_fake_like(p, torch.device("cpu"), dtype), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = _fake_like(b, torch.device("cpu"), dtype)
    return copy.deepcopy(model, memo)


def units(model: nn.Module) -> list[nn.Module]:
    """What fully_shard wraps, innermost first: each block of the chain (graphmem/chains.py,
    as transformers' layers are wrapped in PyTorch's FSDP2 examples), then the root."""
    chain = find_chain(model)
    blocks = list(model.get_submodule(chain.path).children()) if chain is not None else []
    return [*blocks, model]


def shard(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    """fully_shard (torch/distributed/fsdp/_fully_shard/_fully_shard.py) on each unit."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=sharding.dtype(sharding.param_dtype),
                                  reduce_dtype=sharding.dtype(sharding.reduce_dtype))
    offload = CPUOffloadPolicy(pin_memory=False) if sharding.offload else OffloadPolicy()
    for unit in units(model):
        fully_shard(unit, mesh=meshes.dp, reshard_after_forward=sharding.reshard_after_forward,
                    mp_policy=policy, offload_policy=offload)


def unsharded_grads(model: nn.Module) -> list[torch.Tensor]:
    """The unsharded gradients FSDP2 keeps between micro-batches without gradient sync: each
    FSDPParam's ``unsharded_accumulated_grad`` (in the reduce dtype) or its unsharded parameter's
    ``.grad`` (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, post_backward)."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for p in group.fsdp_params if group is not None else ():
            grad = p.unsharded_accumulated_grad
            if grad is None and hasattr(p, "_unsharded_param"):
                grad = p.unsharded_param.grad
            if grad is not None:
                out.append(grad)
    return out


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what rank r holds); a plain tensor itself. The DTensor's own
    ``_local_tensor`` object, not ``to_local()``'s view of it: FSDP2 takes that object (its
    lazy init views it, ``FSDPParam.reset_sharded_param``), and the recorder knows a tensor by
    the object it marked (else each use would be a nameless "external" tensor)."""
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


@contextlib.contextmanager
def watching(cap: _Recorder) -> Iterator[None]:
    """Tell the recorder of FSDP2's storage resizes, the stream each allocation runs on
    (``streams``) and name its collectives' buffers; pause it while DTensor propagates shapes."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    alloc, free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

    def alloc_storage(t: torch.Tensor) -> None:
        was = t.untyped_storage().nbytes()
        alloc(t)
        if was == 0 and t.untyped_storage().nbytes() and cap.recording:
            cap.storage(t, "gathered parameter", "all-gather output (unsharded parameter)", len(cap.ops),
                        cap.module_now()).kind = "gathered parameter"

    def free_storage(t: torch.Tensor) -> None:
        if t.untyped_storage().nbytes():
            cap.released(t)
        free(t)

    init_outputs = _fsdp_param.FSDPParam.init_all_gather_outputs

    def init_all_gather_outputs(self: FSDPParam, *args: Any, **kwargs: Any) -> None:  # (torch's own arguments)
        # over a one-rank mesh FSDP2 gathers nothing: wait_for_unshard copies each shard into these,
        # made here at their full size, the unsharded parameters' storage (_fsdp_param_group.py)
        fresh = not self.all_gather_outputs
        init_outputs(self, *args, **kwargs)
        if fresh and cap.recording:
            for t in self.all_gather_outputs:
                cap.relabel(t, "gathered parameter", "all-gather output (unsharded parameter)")

    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate_paused(self: ShardingPropagator, op_schema: OpSchema
                         ) -> Union[TensorMeta, Sequence[Optional[TensorMeta]], None]:
        # DTensor learns an op's output shape by running it on fake tensors (torch/distributed/tensor/
        # _sharding_prop.py); a real run does that in a fake mode of its own, so it is no step memory
        with cap.paused():
            return propagate(self, op_schema)

    named = _Streams(_fsdp_param_group.FSDPCommContext.lazy_init)
    patched = [(_fsdp_param, "alloc_storage", alloc_storage), (_fsdp_param, "free_storage", free_storage),
               (_fsdp_param_group, "alloc_storage", alloc_storage),
               (_fsdp_param.FSDPParam, "init_all_gather_outputs", init_all_gather_outputs),
               (ShardingPropagator, "_propagate_tensor_meta_non_cached", propagate_paused),
               (_fsdp_param_group.FSDPCommContext, "lazy_init",
                lambda ctx, *args, **kwargs: named.lazy_init(ctx, *args, **kwargs))]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patched]
    for m, name, fn in patched:
        setattr(m, name, fn)
    cap.on_op = lambda func, args, kwargs, out: _label(cap, func, args, kwargs, out)
    cap.stream, stream = named.current, cap.stream
    try:
        yield
    finally:
        cap.on_op, cap.stream = None, stream
        for m, name, fn in saved:
            setattr(m, name, fn)


_COMM_STREAMS = ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream")


class _Streams:
    """Names the stream current at each allocation. FSDP2 runs on the parameters' device type's
    handle (``_get_device_handle``: ``torch.cpu`` for graphmem's fake CPU tensors), whose
    ``stream(s)`` context sets what ``current_stream()`` returns (torch/cpu/__init__.py,
    ``StreamContext``); FSDP2 makes its streams in ``FSDPCommContext.lazy_init``
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py), named here after the attributes
    holding them. Which allocations land on them, read from torch 2.14's
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py:

    - ``foreach_all_gather``: the all-gather buffer (``all_gather_comm.allocate``) and the
      ``param_dtype`` copies of the shards (``_get_param_all_gather_inputs``'s
      ``flat_foreach_copy_input``) are made under ``all_gather_copy_in_stream``, which
      ``FSDPCommContext.get_all_gather_streams`` gives for a synchronous unshard in forward or
      pre-backward (otherwise the current stream);
    - ``foreach_reduce``: the reduce-scatter output ``reduce_output`` (the sharded gradients are
      views of it, kept until ``zero_grad``) and its cast to the parameters' dtype
      (``_to_dtype_if_needed``) are made under ``reduce_scatter_stream``; the reduce-scatter input
      (``reduce_scatter_input``) under the current stream;
    - ``foreach_all_gather_copy_out`` (``wait_for_unshard``) allocates the unsharded parameters
      (``alloc_all_gather_outputs``) on the current stream.

    The stream current when ``watching`` starts is "default"; a stream neither that nor FSDP2's
    is "stream N"."""

    def __init__(self, lazy_init: Callable[..., None]) -> None:  # FSDPCommContext.lazy_init
        self.default = torch.cpu.current_stream()
        self.named: list[tuple[object, str]] = []  # (a stream, its name): told apart by identity
        self._lazy_init = lazy_init

    def lazy_init(self, ctx: FSDPCommContext, *args: object, **kwargs: object) -> None:
        self._lazy_init(ctx, *args, **kwargs)
        for attr in _COMM_STREAMS:
            if hasattr(ctx, attr):
                self.named.append((getattr(ctx, attr), attr.removesuffix("_stream")))

    def current(self) -> str:
        s = torch.cpu.current_stream()
        if s is self.default:
            return "default"
        name = next((n for t, n in self.named if t is s), None)
        if name is None:
            name = f"stream {len(self.named)}"
            self.named.append((s, name))
        return name


_ALL_GATHER_COPY_IN = "fsdp::all_gather_copy_in"
_SPLIT_COPY = "fsdp::split_with_sizes_copy"
_CHUNK_CAT = "fsdp::chunk_cat"
_REDUCE_SCATTER = "c10d::_reduce_scatter_base_"


_FUNCTIONAL = "_c10d_functional::"  # DTensor's redistributions: all_gather_into_tensor, reduce_scatter_tensor, all_reduce


def _label(cap: _Recorder, func: object, args: tuple, kwargs: dict, out: Any) -> None:  # out: the op's output
    schema = getattr(func, "_schema", None)  # a higher-order operator (FlexAttention's) has none
    name = schema.name if schema is not None else ""
    if name.startswith(_FUNCTIONAL) and name != "_c10d_functional::wait_tensor" and isinstance(out, torch.Tensor):
        cap.relabel(out, "communication", f"{name.split('::')[1]} output (DTensor redistribute)")
    elif name == _ALL_GATHER_COPY_IN:
        cap.relabel(out[1], "communication", "all-gather buffer (fsdp.all_gather_copy_in)")
    elif name == _CHUNK_CAT:
        cap.relabel(kwargs["out"] if "out" in kwargs else args[3], "communication",
                    "reduce-scatter input (fsdp.chunk_cat)")
    elif name == _REDUCE_SCATTER:
        cap.relabel(args[0], "communication", "reduce-scatter output (c10d._reduce_scatter_base_)")
    elif name == _SPLIT_COPY:
        for t in kwargs.get("out", args[2] if len(args) > 2 else ()):
            cap.relabel(t, "gathered parameter", "all-gather output (unsharded parameter)")
