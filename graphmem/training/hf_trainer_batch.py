"""The batch a transformers ``Trainer`` trains on, drawn by its own dataloader.

``trainer.train()`` builds its dataloader with ``get_train_dataloader()`` (transformers 5.24
``trainer.py`` 916-931, ``_get_dataloader`` 1007-1069): batches of ``per_device_train_batch_size``
samples of ``train_dataset`` in the order of ``_get_train_sampler`` (a ``RandomSampler``, which
accelerate's ``prepare_data_loader`` makes a ``SeedableRandomSampler`` seeded with ``data_seed``, else
torch's initial seed when the dataloader is made: ``args.seed``, which ``Trainer.__init__`` sets, 419),
the columns the model does not take removed (``_remove_unused_columns``, or
``_get_collator_with_removed_columns`` for other datasets), collated by ``data_collator``.
``_run_epoch`` sets the epoch on it (1859-1866) and draws ``gradient_accumulation_steps`` batches per
optimizer step (``get_batch_samples``, 1881). graphmem calls the same code, with torch's RNG forked
(the user's left as it was) and accelerate's list of prepared dataloaders restored, and takes:

- ``"first"`` (the default): the first batch ``train()`` draws, its first step's first micro-batch;
- ``"longest"``: of every batch the run draws (each epoch, up to ``max_steps``, as
  ``set_initial_training_values`` counts them), the one whose tensors hold the most bytes (the first
  such): under a padding collator (``DataCollatorWithPadding``, ``DataCollatorForLanguageModeling``)
  the batch that decides the run's maximum. It collates the whole run's batches: seconds on a large
  dataset.

The batch's tensors are real (one collated batch is small); the capture runs on fake copies of them.
Rank ``r`` of a DDP job on ``N`` processes trains on every ``N``-th batch from the ``r``-th (accelerate's
``BatchSamplerShard``, ``split_batches=False``: "process 0 yields [0, 1, 2, 3], process 1 [4, 5, 6, 7]").

Known limitations: the step's k micro-batches are the chosen batch k times (the runner takes one batch),
where padding may make the real ones differ in length; a ``group_by_length`` sampler draws its order from
torch's global RNG when iterated, so anything that moves the RNG before ``train()`` changes it.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch

from graphmem.errors import GraphmemError, UsageError

if TYPE_CHECKING:
    from transformers import Trainer

CHOICES = ("first", "longest")


def drawn_batch(trainer: Trainer, which: str = "first", world_size: int = 1, rank: int = 0
                ) -> tuple[dict[str, object], dict[str, str]]:
    """The batch (``which``: ``CHOICES``) ``trainer.train()`` draws for rank ``rank`` of ``world_size``,
    and what the report says of it (``Report.batch``)."""
    if which not in CHOICES:
        raise UsageError(f"`trainer_batch={which!r}`: use 'first' (the first batch train() draws) or 'longest' "
                         "(the largest the run draws)")
    if trainer.train_dataset is None:
        raise UsageError("the Trainer has no train_dataset to draw its batch from: give it one (`train_dataset`), "
                         "or give `input_shape` (batch, seq) or inputs= (a batch dict)")
    best, index, drawn = _choose(trainer, which, world_size, rank)
    if best is None:
        raise UsageError(f"the Trainer's dataloader yields no batch (train_dataset of {_length(trainer)} samples, "
                         f"per_device_train_batch_size {trainer.args.per_device_train_batch_size}): give `inputs` or `input_shape`")
    if not hasattr(best, "items"):
        raise UsageError(f"the Trainer's data_collator returned {type(best).__name__}, not a dict of tensors: "
                         "pass inputs= (the batch dict the model takes)")
    settings = {"dataset": f"{_length(trainer)} samples, {_sampler(trainer)}, {collator_name(trainer.data_collator)}",
                "batch": "the first train() draws" if which == "first" else
                         f"the longest of the {drawn} the run draws (no. {index})"}
    if world_size > 1:
        settings["batch"] += f" for rank {rank} of {world_size}"
    if trainer.args.gradient_accumulation_steps > 1:
        settings["micro-batches"] = f"this batch x{trainer.args.gradient_accumulation_steps}"
    return dict(best), settings


def _choose(trainer: Trainer, which: str, world_size: int, rank: int) -> tuple[Any, int, int]:
    """The chosen batch of rank ``rank``, its number among the rank's batches, and how many it drew; the
    Trainer's own failure to draw one (a collator that cannot stack samples of unequal lengths) in one line."""
    best: Any = None
    index = size = drawn = 0
    try:
        for i, batch in enumerate(_run_batches(trainer, first_only=which == "first", world_size=world_size)):
            if i % world_size != rank:
                continue
            drawn += 1
            nbytes = _bytes(batch)
            if best is None or nbytes > size:
                best, index, size = batch, drawn, nbytes
            if which == "first":
                break
    except GraphmemError:
        raise
    except Exception as e:  # the Trainer's dataloader, sampler or collator
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"the Trainer's dataloader could not draw a batch of its train_dataset ({type(e).__name__}: "
                         f"{first}); give the Trainer a data_collator that pads (DataCollatorWithPadding), or "
                         "`inputs` (a batch dict)") from None
    return best, index, drawn


def _run_batches(trainer: Trainer, first_only: bool, world_size: int) -> Iterator[Any]:
    """The batches ``train()`` draws, in order, through the Trainer's own dataloader (``first_only``: as
    many as the first batch of each rank needs)."""
    acc, args = trainer.accelerator, trainer.args
    kept = list(acc._dataloaders)  # accelerator.prepare appends the dataloader it made
    with torch.random.fork_rng(devices=[]):
        if trainer.model_init is not None:  # train() seeds before it calls model_init (1484-1487)
            torch.manual_seed(args.seed)
        try:
            loader = trainer.get_train_dataloader()
        finally:
            acc._dataloaders[:] = kept
        epochs, _, _, _, _, per_epoch, max_steps = trainer.set_initial_training_values(args, loader)
        k = args.gradient_accumulation_steps
        steps = drawn = 0
        for epoch in range(epochs):
            _set_epoch(loader, epoch)
            for i, batch in enumerate(loader):
                yield batch
                drawn += 1
                if first_only and drawn >= world_size:
                    return
                # _run_epoch's steps: k batches of each rank (N x k here), the epoch's rest last
                if (i + 1) % (k * world_size) == 0 or i + 1 == per_epoch:
                    steps += 1
                    if steps >= max_steps:
                        return
            if drawn == 0:
                return


def _set_epoch(loader: Any, epoch: int) -> None:
    """As ``_run_epoch`` does (1859-1866): the dataloader's epoch and its wrapped batch sampler's."""
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    inner: Any = getattr(getattr(loader, "batch_sampler", None), "batch_sampler", None)
    if hasattr(inner, "set_epoch"):
        inner.set_epoch(epoch)


def _bytes(batch: Any) -> int:
    """Bytes of the batch's distinct tensor storages."""
    values = batch.values() if hasattr(batch, "values") else batch if isinstance(batch, (list, tuple)) else [batch]
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in values if isinstance(t, torch.Tensor)}
    return sum(storages.values())


def _length(trainer: Any) -> str:
    with contextlib.suppress(TypeError):
        return f"{len(trainer.train_dataset):,}"
    return "an iterable of"


def _sampler(trainer: Trainer) -> str:
    """The sampler ``train()`` uses, with its seed where it is a seeded one."""
    args = trainer.args
    seed = args.data_seed if args.data_seed is not None else args.seed if trainer.model_init is not None \
        else torch.random.initial_seed()
    with contextlib.suppress(Exception):
        sampler = trainer._get_train_sampler(trainer.train_dataset)
        if sampler is None:
            return "the dataset's own order"
        if isinstance(sampler, torch.utils.data.RandomSampler):
            return f"random order (seed {seed})"
        return f"{type(sampler).__name__} (seed {seed})"
    return f"(seed {seed})"


def collator_name(collator: object) -> str:
    return getattr(collator, "__name__", None) or type(collator).__name__


def fit_to_shape(batch: dict[str, object], shape: tuple[int, ...], made_from: str) -> dict[str, object]:
    """``batch`` at ``shape`` (``input_shape`` as given: never changed): every tensor dimension equal to
    the reference tensor's (the first of ``len(shape)`` dimensions) resized with it, integer values
    repeated (graphmem/training/batch.py ``resizer``). A batch with no such tensor is refused in one line."""
    from graphmem.training.batch import resizer

    named = [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    ref = next((k for k, v in named if v.dim() == len(shape)), None)
    if ref is None:
        shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in named)
        raise UsageError(f"`input_shape={shape}` fits no tensor of the Trainer's batch ({shapes}, {made_from}): "
                         "give an input_shape of as many dimensions, or inputs= (the batch dict)")
    ordered = {ref: batch[ref], **{k: v for k, v in batch.items() if k != ref}}
    resized = resizer(ordered)(tuple(shape)).kwargs
    return {k: resized[k] for k in batch}


__all__ = ["CHOICES", "collator_name", "drawn_batch", "fit_to_shape"]
