"""DeepSpeed's views of a fake tensor made by the meta kernel directly: the same tensor, without FakeTensorMode's
per-op machinery.

ZeRO-3 slices every gradient into ``world_size`` chunks as it reduces it (deepspeed/runtime/comm/
coalesced_collectives.py ``reduce_scatter_coalesced``: ``flattened_tensor[rank * chunk_sz:...]`` for each rank,
then ``narrow`` for its own), and each all-gathered parameter into partitions; at 64 ranks those slices
are most of the step's ops (about 2,700 of a 4-layer decoder's 4,900). FakeTensorMode answers each
``aten.slice.Tensor`` through its Python rule (torch/_subclasses/fake_impls.py ``slice_forward``, written for
symbolic sizes), which makes an ``aten.as_strided`` that goes through the mode again, each a cache miss (the
start differs), ~3 ms of CPU a slice on this machine; the meta kernel itself computes the same view in
microseconds. ``fast_view`` runs it on a plain meta alias of the input (``_meta_alias``: its storage, offset, sizes
and strides, so the kernel asks no fake tensor its device) and wraps the result as
``wrap_meta_outputs_with_default_device_logic`` does (``wrap``: a FakeTensor of this mode on the input's device, with
the attributes FakeTensor's constructor gives; ``detach`` keeps the input's dispatch keys), for the
views of ``VIEWS`` only and only where FakeTensorMode's answer could be nothing else: the input a fake tensor
of this mode with static sizes, no constant (whose values the mode would propagate) and no real tensor beside
it, every other argument a plain int or None. The view shares the input's storage, with the sizes, strides
and offset the Python rule computes (tests/distributed/test_deepspeed_views.py checks both, and a DeepSpeed step's
recorded graph equal op for op, storage for storage with and without it).

Two more per-op costs of the same slices, answered in ``_EngineMode.__torch_dispatch__`` (graphmem/deepspeed/
capture.py): C++ asks a fake tensor's device three times a slice (``prim.device``: a fake tensor's device is
Python's to say), which ``device_of`` answers as FakeTensorMode's handler does; and the recorder's propagation of
the batch's values (graphmem/capture/values.py ``Values.propagate``) has nothing to do for a view of a tensor
that carries none (``valueless_view``: no value to give, and a view writes nothing whose value it would drop).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch._C import (
    _DisablePythonDispatcher,
    _DisableTorchDispatch,
    _PreserveDispatchKeyGuard,
    _set_meta_in_tls_dispatch_include,
)
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from graphmem.capture.values import VALUE

DEVICE = torch.ops.prim.device.default
VIEWS = frozenset((torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default))
# ops that make a new tensor of fake tensors, answered by the meta kernel as for the views: ZeRO-3's flat buffer of
# each reduce-scatter, ``torch.cat`` of ``world_size`` slices of every gradient it reduces (coalesced_collectives.py),
# whose cache key FakeTensorMode hashes over every slice (torch/_subclasses/fake_tensor.py ``_prep_args_for_hash``)
FRESH = frozenset((torch.ops.aten.cat.default,))


def _plain(args: Any) -> bool:
    """Every argument but the first a plain int, None, or a list or tuple of ints."""
    return all(x is None or type(x) is int or type(x) in (list, tuple) and all(type(i) is int for i in x)
               for x in args[1:])


def _own(mode: FakeTensorMode, a: object) -> bool:
    """``a`` is a fake tensor of ``mode`` whose answer the mode could not change: static sizes, no constant
    (whose values it propagates), no real tensor beside it."""
    return type(a) is FakeTensor and a.fake_mode is mode and a.constant is None and a.real_tensor is None \
        and not a._has_symbolic_sizes_strides


def fast_view(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> Optional[FakeTensor]:
    """``func(*args)`` as FakeTensorMode ``mode`` would answer it, where ``func`` is one of ``VIEWS`` (or
    ``FRESH``: ``fast_cat``) and the call is one the module docstring admits; else None (the mode's own
    dispatch answers)."""
    if kwargs or not args or mode.shape_env is not None or mode.propagate_real_tensors:
        return None
    if func in FRESH:
        return fast_cat(mode, func, args)
    a = args[0]
    if func not in VIEWS or not _own(mode, a) or not _plain(args) or mode.in_kernel_invocation:
        return None
    with _DisableTorchDispatch():  # (no mode below this one sees the alias or its view)
        out = func(_meta_alias(a), *args[1:])
    return wrap(mode, out, a.fake_device, a.dispatch_keys if func is torch.ops.aten.detach.default else None)


def _meta_alias(a: FakeTensor) -> torch.Tensor:
    """A plain meta tensor on ``a``'s storage with its offset, sizes and strides: a view's meta kernel run on it
    computes the view of ``a`` (the same storage, the same geometry), without the Python call a fake tensor's
    device costs each time a kernel asks it (``dispatch_device``: ~5 µs of a slice's ~10)."""
    return torch.empty((0,), device="meta", dtype=a.dtype).set_(a.untyped_storage(), a.storage_offset(), a.size(),
                                                                a.stride())


def _meta_kernel(mode: FakeTensorMode, func: Any, args: Any) -> Any:
    """``func(*args)`` by its meta kernel, inside the mode's kernel invocation as ``in_kernel_invocation_manager``
    (torch/_subclasses/fake_tensor.py) enters it (fake tensors read as meta, no torch dispatch mode), without its
    generator: the caller checked the mode is not already inside one."""
    with _DisablePythonDispatcher(), _DisableTorchDispatch(), _PreserveDispatchKeyGuard():
        mode.in_kernel_invocation = True
        _set_meta_in_tls_dispatch_include(True)
        try:
            return func(*args)
        finally:
            mode.in_kernel_invocation = False


def wrap(mode: FakeTensorMode, out: torch.Tensor, device: torch.device, keys: Any = None) -> FakeTensor:
    """``FakeTensor(mode, out, device, dispatch_keys=keys)`` for a meta tensor ``out`` and a normalized
    ``device``, without the constructor's argument checks: the subclass made as ``FakeTensor.__new__`` makes it
    (``_make_subclass`` with the device for the backend keys, mutable data pointers refused unless the mode
    allows them), its attributes those the constructor gives a tensor of this mode on this device (``_state``:
    copied from one it made)."""
    t = torch.Tensor._make_subclass(FakeTensor, out, out.requires_grad, dispatch_device=True,
                                    device_for_backend_keys=device)
    if mode._allow_unsafe_data_ptr_access:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(t)
    else:
        torch._C._set_throw_on_mutable_data_ptr(t)
    state = t.__dict__
    state.update(_state(mode, device))
    if keys is not None:
        state["dispatch_keys"] = keys
    return t  # type: ignore[return-value]


def _state(mode: FakeTensorMode, device: torch.device) -> dict[str, Any]:
    """The attributes ``FakeTensor(mode, elem, device)`` gives a tensor (its device, mode, no constant, no real
    tensor, empty memos), read once per mode and device from one it constructs."""
    cache = mode.__dict__.setdefault(_STATES, {})
    state = cache.get(device)
    if state is None:
        with _DisablePythonDispatcher():
            made = FakeTensor(mode, torch.empty(0, device="meta"), device)
        state = cache[device] = dict(vars(made))
    return state


_STATES = "_graphmem_fake_states"


def fast_cat(mode: FakeTensorMode, func: Any, args: Any) -> Optional[FakeTensor]:
    """``torch.cat`` of fake tensors of ``mode`` on one device (``FRESH``), as the mode answers it: its meta kernel
    run as ``_dispatch_impl`` runs one, the new tensor wrapped on that device (``wrap_meta_outputs_with_default_
    device_logic``: the inputs' common device); None for anything else (a tensor of another mode or device, a
    constant, a dim that is not a plain int)."""
    tensors = args[0]
    if type(tensors) not in (list, tuple) or not tensors or not _plain(args) \
            or not all(_own(mode, t) for t in tensors):
        return None
    device = tensors[0].fake_device
    if any(t.fake_device != device for t in tensors):
        return None
    if mode.in_kernel_invocation:
        return None
    return wrap(mode, _meta_kernel(mode, func, args), device)


def valueless_view(func: Any, args: Any, kwargs: Any) -> bool:
    """Whether ``func(*args)`` is one of ``VIEWS`` of a fake tensor that carries no batch values (graphmem/capture/
    values.py ``VALUE``), every other argument plain: the recorder's propagation of values has nothing to give
    it (its one tensor has none) and nothing to drop (no view writes), so the recorder may skip it."""
    return func in VIEWS and not kwargs and bool(args) and type(args[0]) is FakeTensor \
        and getattr(args[0], VALUE, None) is None and _plain(args)


def device_of(args: Any) -> Any:
    """``prim.device`` of a fake tensor as FakeTensorMode answers it (torch/_subclasses/fake_tensor.py
    ``_device_handler``: the meta device inside a kernel, else the tensor's fake device); None for any other
    argument (the mode's own dispatch answers). C++ asks it of each tensor an index or a view reads (a fake
    tensor's device is Python's to say): three times a slice."""
    if len(args) != 1 or type(args[0]) is not FakeTensor:
        return None
    return torch.device("meta") if args[0].fake_mode.in_kernel_invocation else args[0].fake_device


__all__ = ["DEVICE", "FRESH", "VIEWS", "device_of", "fast_cat", "fast_view", "valueless_view", "wrap"]
