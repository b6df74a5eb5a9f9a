"""The frozen sharding spec of a per-rank capture: which of PyTorch's own wrappers run, for which rank.

``fsdp``: ``fully_shard`` (FSDP2) per block of the model's chain and on the root, with
``reshard_after_forward``, a ``MixedPrecisionPolicy`` (``param_dtype``, ``reduce_dtype``) and
``CPUOffloadPolicy`` (``offload``); ``no_sync``: with micro-batches, ``set_requires_gradient_sync(False)``
before all but the last (unsharded gradients accumulate on the rank; one reduce-scatter per step,
the common memory-for-communication trade), instead of FSDP2's default reduce-scatter after
every micro-batch. ``tp``/``sp``: DTensor ``parallelize_module`` over ``tp`` ranks
(graphmem/distributed/tensor_parallel.py). Checked once, here, with the training step that runs
through them (optimizer, micro-batches, LoRA: graphmem/training/spec.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from graphmem.errors import UsageError
from graphmem.jsontypes import JSON
from graphmem.training.spec import Training

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Sharding:
    world_size: int
    rank: int = 0
    fsdp: bool = False
    reshard_after_forward: bool = True
    param_dtype: Optional[str] = None  # MixedPrecisionPolicy.param_dtype ("bf16", ...)
    reduce_dtype: Optional[str] = None  # MixedPrecisionPolicy.reduce_dtype
    offload: bool = False  # CPUOffloadPolicy
    tp: int = 1
    sp: bool = False
    no_sync: bool = False  # set_requires_gradient_sync(False) for all micro-batches but the last
    loss_parallel: bool = False  # the head's logits stay split over the vocabulary into loss_parallel()'s cross-entropy

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    def dtype(self, name: Optional[str]) -> Optional[torch.dtype]:
        return _DTYPES[name] if name is not None else None

    def to_dict(self) -> dict[str, JSON]:
        return {"world_size": self.world_size, "rank": self.rank, "fsdp": self.fsdp,
                "reshard_after_forward": self.reshard_after_forward, "param_dtype": self.param_dtype,
                "reduce_dtype": self.reduce_dtype, "offload": self.offload, "tp": self.tp, "sp": self.sp,
                "no_sync": self.no_sync, "loss_parallel": self.loss_parallel}


def wants_wrappers(rank: Optional[int], fsdp: Optional[str], reshard_after_forward: bool = True,
                   param_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None, offload: bool = False,
                   no_sync: bool = False, loss_parallel: bool = False) -> bool:
    """Whether the options ask for rank r's step through PyTorch's wrappers (a rank, bare --fsdp
    or a fully_shard option); otherwise --zero/--fsdp full|grad-op/--tp are the per-rank formulas."""
    return rank is not None or fsdp == "fully_shard" or bool(param_dtype or reduce_dtype or offload or no_sync
                                                             or loss_parallel) \
        or not reshard_after_forward


def make_sharding(world_size: int, rank: int = 0, fsdp: bool = False, reshard_after_forward: bool = True,
                  param_dtype: Optional[str] = None, reduce_dtype: Optional[str] = None, offload: bool = False,
                  tp: int = 1, sp: bool = False, no_sync: bool = False, training: Optional[Training] = None,
                  loss_parallel: bool = False) -> Sharding:
    """Check the options together, and with the training step that runs through the wrappers
    (graphmem/training/spec.py); the error names the fix."""
    for name, v in (("`world_size`", world_size), ("`tp`", tp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise UsageError(f"{name} must be a positive integer, got {v!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise UsageError(f"`rank={rank!r}` is not one of the {world_size} ranks: use 0 to {world_size - 1}")
    if world_size % tp:
        raise UsageError(f"`world_size={world_size}` is not a multiple of `tp={tp}`: world = data parallel x tensor parallel")
    for name, d in (("`fsdp_param_dtype`", param_dtype), ("`fsdp_reduce_dtype`", reduce_dtype)):
        if d is not None and d not in _DTYPES:
            raise UsageError(f"unknown {name} {d!r}: use one of {', '.join(_DTYPES)}")
    if not fsdp and (param_dtype or reduce_dtype or offload or not reshard_after_forward or no_sync):
        raise UsageError("the mixed-precision, offload, reshard and no-sync options configure fully_shard: add `fsdp`")
    if training is not None:
        check_training(training, no_sync)
    if sp and tp == 1:
        raise UsageError("`sp` splits the sequence over the tensor-parallel ranks: add `tp=2` (or more)")
    if tp > 1 and not fsdp and world_size != tp:
        raise UsageError(f"`world_size={world_size}` with `tp={tp}` and no `fsdp` leaves {world_size // tp} data-parallel "
                         "replicas, and graphmem runs no replicating wrapper (DDP): add `fsdp` to shard over them, "
                         f"or use `world_size={tp}` (each replica's tensor-parallel step is the same)")
    if fsdp and world_size // tp == 1:
        raise UsageError(f"`fsdp` shards over the data-parallel ranks, and `world_size={world_size}` / `tp={tp}` "
                         "leaves one: raise `world_size`")
    if loss_parallel and tp == 1:
        raise UsageError("`loss_parallel` keeps the logits split over the tensor-parallel ranks: add `tp=2` (or more)")
    return Sharding(world_size, rank, fsdp, reshard_after_forward, param_dtype, reduce_dtype, offload, tp, sp, no_sync,
                    loss_parallel)


def check_training(training: Training, no_sync: bool) -> None:
    """What of the training step runs per rank. torch.optim on DTensor parameters (torch 2.14;
    DTensor's sharding propagation refuses these, on fake tensors as in a real job): fused SGD has
    no sharding strategy (``aten._fused_sgd_``), and Adafactor's in-place update of a partial
    (row/column norm) DTensor is refused."""
    train = training.train
    if no_sync and train.micro_batches < 2:
        raise UsageError("`fsdp_no_sync` skips the gradient reduce-scatter of all micro-batches but the last: "
                         "add `micro_batches=2` (or more)")
    if train.master_weights:
        raise UsageError("`master_weights` is the single-device mixed-precision recipe; FSDP2's is fp32 sharded "
                         "parameters with `fsdp_param_dtype='bf16'` (MixedPrecisionPolicy): use that instead")
    if train.optimizer in ("sgd", "momentum") and train.impl == "fused":
        raise UsageError("torch.optim's fused SGD has no DTensor sharding strategy (aten._fused_sgd_), so it does not "
                         "run on FSDP2/TP parameters: use `optimizer_impl='foreach'` or forloop")
    if train.optimizer is not None and train.optimizer.endswith("8bit"):
        raise UsageError(f"bitsandbytes' {train.optimizer} is analyzed on one device here (not run on FSDP2/TP "
                         "DTensor parameters): use `optimizer='adamw'` per rank, or drop `rank`/`fsdp`")
    if train.optimizer == "adafactor":
        raise UsageError("torch.optim.Adafactor does not run on DTensor parameters (its in-place update of a partial "
                         "norm is refused by DTensor): use `optimizer='adamw'`, adam, momentum or sgd per rank")
    if training.quantization is not None:
        raise UsageError("`qlora` is analyzed on one device (bitsandbytes' 4-bit weights are not sharded by fully_shard "
                         "here): drop `qlora`, or drop `rank`/`fsdp`")
