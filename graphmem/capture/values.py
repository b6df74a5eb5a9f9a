"""The batch's values on fake tensors: data-dependent reads answered as the real step answers them.

A real step may read tensor values to choose its path: transformers skips the causal mask
when the attention mask is all ones (``masking_utils._ignore_causal_mask_sdpa``: SDPA then
runs ``is_causal=True`` with no (b, 1, s, s) mask). A fake tensor has no values, so such a
read fails, or the library takes its tracing path and builds the mask (6.6 % more saved bytes
on a tiny Qwen2). graphmem is handed the user's real batch, so it keeps the values:

- each real tensor of the batch keeps its value beside its fake (``attach``);
- an op whose tensor inputs all have values (a factory op has none) and whose outputs are
  small (at most ``limit`` elements: the largest integer batch tensor, or 2**20) runs for real on
  those values (``propagate``), so ``mask.bool()``, ``mask[:, :s]``, ``mask.sum() == n`` carry
  theirs; seeded random ops (``randint``, dropout) and uninitialized ones (``empty``: the fake
  parameters are made so) do not;
- a read of a value (``.item()``, ``bool(t)``: ``aten._local_scalar_dense``; ``torch.equal``)
  on a tensor with a value returns the real answer (``read``); without one the fake mode
  raises as before (graphmem/capture/fakes.py says which call to change);
- an in-place write that cannot be replayed (an input without a value) drops the value of the
  storage it writes, so no stale value is read.

transformers asks ``is_tracing(tensor)`` before reading, and a FakeTensor counts as tracing
(``transformers.utils.import_utils.is_fake_tensor``); ``knowing`` makes a fake tensor with a
value count as the real tensor it stands for, while a capture runs.

Known limitations: a batch given as meta or fake tensors, or only as a shape with random
contents, has no values to read (its masks are read as transformers reads them when tracing);
reads on tensors larger than ``limit`` fail as before.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Optional

import torch
from torch._ops import HigherOrderOperator, OpOverload
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map

VALUE = "_graphmem_value"  # attribute on a fake tensor: the real tensor whose values it has
MIN_LIMIT = 2 ** 20
_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default)
NO_ANSWER = object()  # read's "no answer"


class Values:
    """The values the fake tensors of one capture carry (see the module docstring)."""

    def __init__(self) -> None:
        self.limit = MIN_LIMIT
        self.stale: set[int] = set()  # data pointers of real storages written without a replay

    def attach(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """``fake`` stands for the real batch tensor ``real`` (left as it is)."""
        if not isinstance(real, torch.Tensor) or isinstance(real, FakeTensor) or real.device.type == "meta" \
                or type(real) is not torch.Tensor and not isinstance(real, torch.nn.Parameter):
            return
        if tuple(real.shape) != tuple(fake.shape) or real.dtype != fake.dtype and real.numel() > self.limit:
            return  # a large floating batch cast to the target's dtype: no copy of it
        with unset_fake_temporarily():
            value = real.detach().to("cpu", fake.dtype)
        self._admit(value)
        setattr(fake, VALUE, value)

    @contextlib.contextmanager
    def making_batch(self) -> Iterator[None]:
        """Within: the batch is made under the fake mode (``torch.ones(b, s)`` for a mask), so
        every deterministic op gets its value, whatever its size."""
        limit, self.limit = self.limit, sys.maxsize
        try:
            yield
        finally:
            self.limit = limit

    def admit(self, fake: torch.Tensor) -> None:
        """``fake``, made under the fake mode, is a batch tensor."""
        if self.of(fake) is not None:
            self._admit(fake)

    def _admit(self, t: torch.Tensor) -> None:
        """Tensors the size of an integer batch tensor (ids, a mask) are small; floating ones
        (pixels, features) do not raise the limit, so their compute never runs for real."""
        if not t.is_floating_point():
            self.limit = max(self.limit, t.numel())

    def of(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """The real value of ``t`` (a fake tensor's, or a real constant itself), or None."""
        if not isinstance(t, FakeTensor):
            return None if t.device.type == "meta" or type(t) is not torch.Tensor else t
        value = getattr(t, VALUE, None)
        if value is None or value.untyped_storage().data_ptr() in self.stale:
            return None
        return value

    def read(self, func: OpOverload | HigherOrderOperator, args: tuple, kwargs: Optional[dict]) -> object:
        """The real answer of a value read on tensors with values, else ``NO_ANSWER``."""
        if func not in _READS:
            return NO_ANSWER
        real = self._reals(args, kwargs)
        if real is None:
            return NO_ANSWER
        with unset_fake_temporarily():
            return func(*real[0], **real[1])

    def propagate(self, func: Any, args: tuple, kwargs: Optional[dict], out: object) -> None:  # func: an OpOverload or a HOP
        """Give ``out`` the values ``func`` makes from its inputs' values, when it can."""
        if not hasattr(func, "_schema"):  # a higher-order operator (FlexAttention's): its own ops carry values
            return
        outs = [out] if isinstance(out, torch.Tensor) else [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        real = None
        if outs and torch.Tag.nondeterministic_seeded not in func.tags and "empty" not in func.__name__ and \
                all(o.numel() <= self.limit for o in outs):
            real = self._reals(args, kwargs)
        if real is None:
            self._drop_written(func, args, kwargs)
            return
        try:
            with unset_fake_temporarily():
                result = func(*real[0], **real[1])
        except Exception:  # a kernel the CPU lacks, a device it cannot reach: no value, as without this
            self._drop_written(func, args, kwargs)
            return
        values = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor)]
        if len(values) != len(outs):
            self._drop_written(func, args, kwargs)
            return
        for o, v in zip(outs, values):
            if isinstance(o, FakeTensor) and tuple(o.shape) == tuple(v.shape) and o.dtype == v.dtype:
                setattr(o, VALUE, v)

    def _reals(self, args: tuple, kwargs: Optional[dict]) -> Optional[tuple[tuple, dict]]:
        """``(args, kwargs)`` with every tensor replaced by its value; None if one has none."""
        if any(isinstance(a, torch.Tensor) and self.of(a) is None for a in args):  # (most ops: an activation, at once)
            return None
        flat = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
        if not all(self.of(x) is not None for x in flat):
            return None
        return tree_map(lambda x: self.of(x) if isinstance(x, torch.Tensor) else x, (tuple(args), dict(kwargs or {})))

    def _drop_written(self, func: OpOverload, args: tuple, kwargs: Optional[dict]) -> None:
        schema = func._schema
        if not schema.is_mutable:
            return
        given = dict(zip((a.name for a in schema.arguments), args))
        given.update(kwargs or {})
        for arg in schema.arguments:
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_flatten(given.get(arg.name))[0] if written else ():
                value = getattr(t, VALUE, None) if isinstance(t, torch.Tensor) else None
                if value is not None:
                    self.stale.add(value.untyped_storage().data_ptr())


@contextlib.contextmanager
def knowing(values: Values) -> Iterator[None]:
    """Within: transformers (if imported) treats a fake tensor with a value as a real tensor."""
    utils: Any = sys.modules.get("transformers.utils.import_utils")
    original = getattr(utils, "is_fake_tensor", None) if utils is not None else None
    if original is None:
        yield
        return

    def is_fake_tensor(x: Any) -> bool:
        return bool(original(x)) and values.of(x) is None

    utils.is_fake_tensor = is_fake_tensor
    try:
        yield
    finally:
        utils.is_fake_tensor = original
