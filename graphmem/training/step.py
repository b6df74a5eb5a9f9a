"""The training step graphmem analyzes, shared by the fake capture and the real measurements.

Keeping one definition is what makes predicted and measured numbers comparable: both run
``out = forward(*args, **kwargs); loss = loss_fn(out, inputs); loss.backward()`` with the
output still referenced during backward, as in ``logits = model(x); loss = ...; loss.backward()``
or ``out = model(**batch); out.loss.backward()`` (graphmem/training/batch.py: the batch forms).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch

from graphmem.errors import CaptureError
from graphmem.training.batch import as_batch

LossFn = Callable[[Any, Any], torch.Tensor]  # (output, inputs in the form given)


def _floating_tensors(obj: object) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in a (nested) output: tuples, lists, dicts, dataclasses.

    HF ``ModelOutput`` is an OrderedDict subclass, so the dict branch covers it.
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex():
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _floating_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _floating_tensors(v)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _floating_tensors(getattr(obj, f.name))


def own_loss(output: object) -> Optional[torch.Tensor]:
    """The loss the model computed itself: a ``loss`` field of the output (HF ``ModelOutput``
    given ``labels``, a dict, a dataclass or any object with a ``loss`` attribute) holding a
    scalar tensor; else None."""
    if isinstance(output, torch.Tensor):
        return None
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return loss
    return None


def default_loss(output: object, inputs: object) -> torch.Tensor:
    """The model's own loss (an output field ``loss``, see own_loss); else the output itself
    if it is a scalar tensor; else the sum of every floating-point tensor in it."""
    if isinstance(output, torch.Tensor) and output.dim() == 0 and output.is_floating_point():
        return output
    own = own_loss(output)
    if own is not None:
        return own
    parts = [t.sum() for t in _floating_tensors(output) if t.requires_grad]
    if not parts:
        raise CaptureError(
            "the model's output has no floating-point tensor that requires grad, so there is no "
            "backward to analyze; define loss(output, inputs) in the model file or pass loss= to analyze()"
        )
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    return total


def run_step(
    forward: Callable[..., object],
    inputs: object,
    loss_fn: Optional[LossFn],
    on_phase: Callable[[str], None] = lambda phase: None,
    forward_context: Callable[[], ContextManager[object]] = contextlib.nullcontext,
    release_output: bool = False,
) -> tuple[object, torch.Tensor]:
    """Forward, loss, backward. ``on_phase`` is told when each phase starts; forward and loss
    run inside ``forward_context()`` (autocast, target rules), backward outside it, as in
    ``with autocast(): loss = ...`` followed by ``loss.backward()``. ``inputs``: a tuple, a dict
    or ``(args, kwargs)`` (graphmem/training/batch.py); the loss gets it in that form.
    ``release_output``: the output is dropped once the loss is made, before backward, and None
    returned for it: what is left of it is what autograd saved (a model's own ``loss`` field is
    the loss, held on its own), as HF Trainer's ``compute_loss`` returns the loss alone and
    torchtune/torchtitan ``del logits`` (graphmem/training/loop_options.py)."""
    batch = as_batch(inputs)
    with forward_context():
        on_phase("forward")
        out = batch.call(forward)
        on_phase("loss")
        loss = (loss_fn or default_loss)(out, batch.given)
    if release_output:
        out = None  # the output object and its other tensors (logits) go; the loss stays
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise CaptureError(
            f"the loss must be a scalar tensor, got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
            + "; make loss(output, inputs) return a scalar (e.g. .mean() or .sum())"
        )
    if not loss.requires_grad:
        raise CaptureError(
            "the loss does not require grad (no parameter or input that requires grad reaches it); "
            "check that the model has trainable parameters and the loss uses the output"
        )
    on_phase("backward")
    loss.backward()
    return out, loss
