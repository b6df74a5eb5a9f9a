"""A step's inputs as the model is called with them: positional, keyword, or both.

``analyze``, ``validate``, the plans and the formulas accept a batch in the three forms a
training loop uses::

    (x, y)                                  # model(x, y)
    {"input_ids": ids, "labels": ids}       # model(**batch), as every Hugging Face loop does
    ((x,), {"attention_mask": m})           # model(x, attention_mask=m)

A 2-tuple whose first item is a tuple or list and whose second is a mapping is read as
``(args, kwargs)``. A loss function gets the batch back in the form it was given.

Resizing (formulas, plans and fits capture the step at other sizes): every top-level tensor
dimension equal to the first tensor's size at the same position is resized with it, so
``input_ids``, ``attention_mask`` and ``labels`` of shape (b, s) grow together and
``labels`` of shape (b,) beside ``pixel_values`` (b, c, h, w) follows b. Known limitation: a
dimension that only happens to be equal (a decoder length equal to the encoder's) is resized
too.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, TypeVar, Union

import torch

FORMS = ("tuple", "dict", "both")

R = TypeVar("R")
# the batch in the caller's form: a tuple, a dict, or ``(args, kwargs)``
Given = Union[tuple, dict[str, object], tuple[tuple, dict[str, object]]]


@dataclass(frozen=True)
class Batch:
    """``model(*args, **kwargs)``; ``form`` is how the caller gave it (what the loss sees)."""

    args: tuple = ()
    kwargs: Mapping[str, object] = field(default_factory=dict)
    form: str = "tuple"

    def call(self, fn: Callable[..., R]) -> R:
        return fn(*self.args, **self.kwargs)

    @property
    def given(self) -> Given:
        """The batch in the caller's form: a tuple, a dict, or ``(args, kwargs)``."""
        if self.form == "dict":
            return dict(self.kwargs)
        if self.form == "both":
            return (self.args, dict(self.kwargs))
        return self.args

    def named(self) -> list[tuple[str, object]]:
        """Every top-level item with a name: ``input_<i>`` for positional ones, the key for keywords."""
        return [(f"input_{i}", x) for i, x in enumerate(self.args)] + list(self.kwargs.items())

    def tensors(self) -> list[torch.Tensor]:
        return [x for _, x in self.named() if isinstance(x, torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], object]) -> "Batch":
        """The same batch with ``fn`` applied to each top-level tensor, once per tensor: a tensor
        given twice (``labels`` that are ``input_ids``) stays one tensor, as in the real step."""
        done: dict[int, object] = {}

        def one(x: object) -> object:
            if not isinstance(x, torch.Tensor):
                return x
            if id(x) not in done:
                done[id(x)] = fn(x)
            return done[id(x)]
        return Batch(tuple(one(x) for x in self.args), {k: one(v) for k, v in self.kwargs.items()}, self.form)


def as_batch(inputs: object) -> Batch:
    """A tensor, tuple/list, mapping (``BatchEncoding`` too) or ``(args, kwargs)`` as a Batch."""
    if isinstance(inputs, Batch):
        return inputs
    if isinstance(inputs, Mapping):
        return Batch((), dict(inputs), "dict")
    if isinstance(inputs, (tuple, list)):
        if len(inputs) == 2 and isinstance(inputs[0], (tuple, list)) and isinstance(inputs[1], Mapping):
            return Batch(tuple(inputs[0]), dict(inputs[1]), "both")
        return Batch(tuple(inputs), {}, "tuple")
    return Batch((inputs,), {}, "tuple")


def resizer(example: object) -> Callable[[tuple[int, ...]], Batch]:
    """Batches like ``example`` at another size of its first tensor (see the module docstring);
    a resized integer or bool tensor (ids, an attention mask) repeats the example's values, so a
    data-dependent read (an all-ones mask: graphmem/capture/values.py) answers as the example's;
    a resized floating one is left empty (the captures run on fake tensors)."""
    batch = as_batch(example)
    first = next(iter(batch.tensors()), None)
    base = tuple(first.shape) if first is not None else ()

    def make(shape: tuple[int, ...]) -> Batch:
        def resized(x: torch.Tensor) -> torch.Tensor:
            dims = [shape[i] if i < len(base) and n == base[i] and i < len(shape) else n for i, n in enumerate(x.shape)]
            if tuple(dims) == tuple(x.shape):
                return x
            if x.is_floating_point() or x.is_complex() or x.device.type == "meta" or 0 in x.shape or 0 in dims:
                return torch.empty(dims, dtype=x.dtype).requires_grad_(x.requires_grad and x.is_floating_point())
            return _tiled(x, dims)
        return batch.map(resized)
    return make


def _tiled(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
    """``x`` repeated along each dimension and cut to ``dims``: real, also when the batch is made
    under a capture's fake mode (graphmem/capture/fakes.py ``fake_batch``), which then keeps its values."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    repeats = [-(-d // n) for d, n in zip(dims, x.shape)]
    with unset_fake_temporarily():
        return x.detach().repeat(repeats)[tuple(slice(0, d) for d in dims)].contiguous()


__all__ = ["Batch", "as_batch", "resizer", "FORMS"]
