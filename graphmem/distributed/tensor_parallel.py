"""Tensor (and sequence) parallel through DTensor's ``parallelize_module``
(torch/distributed/tensor/parallel/api.py) with ColwiseParallel / RowwiseParallel /
SequenceParallel / PrepareModuleInput plans, on the fake copy of the model
(graphmem/distributed/capture.py).

Plans: the bundled Llama (models/llama.py), sharded as torchtitan shards its Llama
(torchtitan/models/llama3/infra/parallelize.py, apply_tp): attention heads and FFN columns over
the ranks, the rows of wo/w2 back; with sequence parallel the norms and the residual stream are
split along the sequence. Each attention module then runs its rank's heads (``n_heads // tp``).

Known limitations: other models (GPT-2's fused c_attn, Hugging Face decoders) have no plan yet
and are refused with a one-line error; loss parallel is not used (the logits are gathered).
"""
from __future__ import annotations

from typing import Any

import torch.nn as nn

from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.errors import UsageError


def parallelize(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    """``parallelize_module`` on ``model`` over ``meshes.tp`` (in place)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from graphmem.models.llama import Transformer

    if not isinstance(model, Transformer):
        raise UsageError(f"no tensor-parallel plan for {type(model).__name__}: --tp with --rank runs the bundled "
                         "Llama (models/llama.py); drop --rank for the Korthikanti formula over any model")
    tp = sharding.tp
    for layer in model.layers:
        attention = layer.attention
        if attention.n_heads % tp or attention.n_kv_heads % tp:
            raise UsageError(f"--tp {tp} does not divide the {attention.n_heads} heads ({attention.n_kv_heads} "
                             "key/value heads): pick a divisor")
    assert meshes.tp is not None
    parallelize_module(model, meshes.tp, _root_plan(sharding.sp))
    for layer in model.layers:
        parallelize_module(layer, meshes.tp, _block_plan(sharding.sp))
        layer.attention.n_heads //= tp  # each rank runs its share of the heads
        layer.attention.n_kv_heads //= tp


def _root_plan(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sp:
        return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": ColwiseParallel(output_layouts=Replicate())}
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def _block_plan(sp: bool) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {
        "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
        "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
    }
    if not sp:
        return {**plan, "attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()}
    return {**plan,
            "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
