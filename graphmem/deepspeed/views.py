"""DeepSpeed's views of a fake tensor made by the meta kernel directly: the same tensor, without FakeTensorMode's
per-op machinery.

ZeRO-3 slices every gradient into ``world_size`` chunks as it reduces it (deepspeed/runtime/comm/
coalesced_collectives.py ``reduce_scatter_coalesced``: ``flattened_tensor[rank * chunk_sz:...]`` for each rank,
then ``narrow`` for its own), and each all-gathered parameter into partitions; at 64 ranks those slices
are most of the step's ops (about 2,700 of a 4-layer decoder's 4,900). FakeTensorMode answers each
``aten.slice.Tensor`` through its Python rule (torch/_subclasses/fake_impls.py ``slice_forward``, written for
symbolic sizes), which makes an ``aten.as_strided`` that goes through the mode again, each a cache miss (the
start differs), ~3 ms of CPU a slice on this machine; the meta kernel itself computes the same view in
microseconds. ``fast_view`` runs it as FakeTensorMode runs a meta kernel (``in_kernel_invocation_manager``,
torch/_subclasses/fake_tensor.py ``_dispatch_impl``) and wraps the result as ``wrap_meta_outputs_with_default_device_logic``
does (a FakeTensor of this mode on the input's device; ``detach`` keeps the input's dispatch keys), for the
views of ``VIEWS`` only and only where FakeTensorMode's answer could be nothing else: the input a fake tensor
of this mode with static sizes, no constant (whose values the mode would propagate) and no real tensor beside
it, every other argument a plain int or None. The view shares the input's storage, with the sizes, strides
and offset the Python rule computes (tests/test_deepspeed_views.py checks both, and a DeepSpeed step's
recorded graph equal op for op, storage for storage with and without it).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch._C import _DisablePythonDispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager

VIEWS = frozenset((torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.detach.default))


def fast_view(mode: FakeTensorMode, func: Any, args: Any, kwargs: Any) -> Optional[FakeTensor]:
    """``func(*args)`` as FakeTensorMode ``mode`` would answer it, where ``func`` is one of ``VIEWS`` and
    the call is one the module docstring admits; else None (the mode's own dispatch answers)."""
    if func not in VIEWS or kwargs or not args or mode.shape_env is not None or mode.propagate_real_tensors:
        return None
    a = args[0]
    if type(a) is not FakeTensor or a.fake_mode is not mode or a.constant is not None \
            or a.real_tensor is not None or a._has_symbolic_sizes_strides:
        return None
    for x in args[1:]:
        if not (x is None or type(x) is int or type(x) in (list, tuple) and all(type(i) is int for i in x)):
            return None
    with _DisablePythonDispatcher(), in_kernel_invocation_manager(mode):
        out = func(*args)
    keys = a.dispatch_keys if func is torch.ops.aten.detach.default else None
    return FakeTensor(mode, out, a.fake_device, dispatch_keys=keys)


__all__ = ["VIEWS", "fast_view"]
