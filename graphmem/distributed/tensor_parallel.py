"""Tensor (and sequence) parallel through DTensor's ``parallelize_module``
(torch/distributed/tensor/parallel/api.py) with ColwiseParallel / RowwiseParallel /
SequenceParallel / PrepareModuleInput plans, on the fake copy of the model
(graphmem/distributed/capture.py). Hugging Face models run transformers' own TP engine instead
(graphmem/distributed/tensor_parallel_hf.py).

Plans:
- the bundled Llama (models/llama.py), sharded as torchtitan shards its Llama
  (torchtitan/models/llama3/infra/parallelize.py, apply_tp): attention heads and FFN columns over
  the ranks, the rows of wo/w2 back; with sequence parallel the norms and the residual stream are
  split along the sequence. Each attention module then runs its rank's heads (``n_heads // tp``).
- the bundled GPT-2 (models/gpt2.py), split as Megatron-LM splits GPT-2: the fused ``c_attn``
  (rows [q; k; v], 3d x d) keeps on rank r the rows of its own heads of each of q, k and v
  (DTensor's ``_StridedShard(0, split_factor=3)``: 3d/T rows, q_r, k_r, v_r in that order), so its
  local output splits into the rank's q, k and v; ``c_fc`` is column-split, both ``c_proj`` are
  row-split, and the tied ``wte``/``lm_head`` weight is split along the vocabulary (one shard,
  tied again after both modules are parallelized). Each attention module runs ``n_head // tp`` heads.
  With sequence parallel the token and position embeddings are summed over the whole sequence,
  the residual stream is split along it from the first block on, and the LayerNorms run on
  sequence shards (as the Llama plan).

Known limitations: loss parallel is not used (the logits are gathered); models other than these
and Hugging Face models with a TP plan are refused in one line.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, ContextManager

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.errors import UsageError

if TYPE_CHECKING:
    from graphmem.models.gpt2 import Block


def parallelize(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    """Split ``model`` over ``meshes.tp`` in place: transformers' own plan for a Hugging Face
    model, ``parallelize_module`` with the plans above for the bundled Llama and GPT-2."""
    from graphmem.distributed.tensor_parallel_hf import is_hf, parallelize_hf
    from graphmem.models.gpt2 import GPT
    from graphmem.models.llama import Transformer

    if type(model).__module__.split(".")[0] == "peft":
        raise UsageError(f"`tp` with `rank` on a peft-wrapped model ({type(model).__name__}) is not modelled: "
                         "transformers' TP plan shards the base model's linears, not LoRA's wrappers; drop `rank` "
                         "for the Korthikanti formula")
    if is_hf(model):
        if sharding.loss_parallel:
            raise UsageError("`loss_parallel` on a Hugging Face model is not modelled: transformers' TP plan gathers the "
                             "head's logits (colwise_gather_output) into the model's own loss; drop `loss_parallel`")
        parallelize_hf(model, sharding, meshes)
    elif _is_bundled(model, Transformer):
        _parallelize_llama(model, sharding, meshes)
    elif _is_bundled(model, GPT):
        _parallelize_gpt2(model, sharding, meshes)
    else:
        raise UsageError(f"no tensor-parallel plan for {type(model).__name__}: `tp` with `rank` runs Hugging Face "
                         "models with a TP plan and the bundled Llama and GPT-2 (models/llama.py, models/gpt2.py); "
                         "drop `rank` for the Korthikanti formula over any model")


def tp_engine(model: nn.Module) -> str:
    """What splits ``model``'s layers, as a report names it."""
    from graphmem.distributed.tensor_parallel_hf import is_hf

    return "transformers' apply_tensor_parallelism" if is_hf(model) else "parallelize_module"


def _is_bundled(model: nn.Module, cls: type[nn.Module]) -> bool:
    """``model`` is the bundled class ``cls``, imported as graphmem.models or loaded by file path
    (``graphmem analyze models/gpt2.py``: the same source file, another module object)."""
    if isinstance(model, cls):
        return True
    try:  # the class's own forward names its source file (a module loaded by path is not in sys.modules)
        return type(model).__qualname__ == cls.__qualname__ and \
            os.path.samefile(type(model).forward.__code__.co_filename, cls.forward.__code__.co_filename)
    except (AttributeError, OSError):
        return False


def _parallelize_llama(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp = sharding.tp
    for layer in model.layers:  # type: ignore[union-attr]
        attention = layer.attention
        if attention.n_heads % tp or attention.n_kv_heads % tp:
            raise UsageError(f"`tp={tp}` does not divide the {attention.n_heads} heads ({attention.n_kv_heads} "
                             "key/value heads): pick a divisor")
    assert meshes.tp is not None
    parallelize_module(model, meshes.tp, _root_plan(sharding.sp, sharding.loss_parallel))
    for layer in model.layers:  # type: ignore[union-attr]
        parallelize_module(layer, meshes.tp, _block_plan(sharding.sp))
        layer.attention.n_heads //= tp  # each rank runs its share of the heads
        layer.attention.n_kv_heads //= tp


def _parallelize_gpt2(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    from torch.distributed.tensor.parallel import parallelize_module

    tp = sharding.tp
    blocks: list[Block] = list(model.transformer.h)  # type: ignore[union-attr, arg-type]
    for block in blocks:
        if block.attn.n_head % tp:
            raise UsageError(f"`tp={tp}` does not divide the {block.attn.n_head} heads: pick a divisor")
    assert meshes.tp is not None
    tied = model.transformer.wte.weight is model.lm_head.weight  # type: ignore[union-attr]
    parallelize_module(model, meshes.tp, _gpt2_root_plan(sharding.sp, sharding.loss_parallel))
    if tied:  # one vocabulary shard for both, as before
        model.transformer.wte.weight = model.lm_head.weight  # type: ignore[union-attr]
    for block in blocks:
        parallelize_module(block, meshes.tp, _gpt2_block_plan(sharding.sp))
        block.attn.n_head //= tp  # each rank runs its own heads
        block.attn.n_embd //= tp


def _head(sp: bool, loss_parallel: bool) -> ParallelStyle:
    """The LM head's plan: its logits gathered whole on every rank, or (loss parallel, torchtitan's
    default with TP: torchtitan/models/llama3/infra/parallelize.py apply_tp) left split over the
    vocabulary as a DTensor for ``loss_parallel()``'s cross-entropy."""
    from torch.distributed.tensor import Replicate, Shard

    inputs = Shard(1) if sp else None  # None: ColwiseParallel's default, a replicated input
    if loss_parallel:
        return ColwiseParallel(input_layouts=inputs, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=inputs, output_layouts=Replicate())


def step_context(sharding: Sharding) -> ContextManager[None]:
    """What wraps the loss and backward of rank r's step: ``loss_parallel()`` when the head's
    logits stay split (torch/distributed/tensor/parallel/loss.py: cross-entropy over a vocabulary-
    sharded DTensor, forward and backward), else nothing."""
    import contextlib

    if not sharding.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _gpt2_root_plan(sp: bool, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, ParallelStyle] = {"transformer.wte": RowwiseParallel(input_layouts=Replicate())}
    if not sp:
        return {**plan, "lm_head": _head(sp, loss_parallel)}
    # the token and position embeddings are summed over the whole sequence; the residual stream is
    # split along it from the first block on (Replicate -> Shard(1) is a local chunk, no collective)
    return {**plan,
            "transformer.h.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                  use_local_output=True),
            "transformer.ln_f": SequenceParallel(),
            "lm_head": _head(sp, loss_parallel)}


def _gpt2_block_plan(sp: bool) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, ParallelStyle] = {"attn.c_attn": FusedColwise(3), "mlp.c_fc": ColwiseParallel()}
    if not sp:
        return {**plan, "attn.c_proj": RowwiseParallel(), "mlp.c_proj": RowwiseParallel()}
    return {**plan,
            "ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}


class FusedColwise(ColwiseParallel):
    """ColwiseParallel for a linear whose output packs ``parts`` projections ([q; k; v]): rank r
    keeps the r-th chunk of each part (Megatron's split of a fused QKV), and its local output is
    those chunks in order, with no collective."""

    def __init__(self, parts: int) -> None:
        super().__init__()
        self.parts = parts

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in module.named_parameters():
            placement = _StridedShard(0, split_factor=self.parts)
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts: tuple[Placement, ...], use_local_output: bool, mod: nn.Module, outputs: DTensor,
                           device_mesh: DeviceMesh) -> torch.Tensor:
        return outputs.to_local()  # (b, s, 3d/T): [q_r, k_r, v_r]


def _root_plan(sp: bool, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    if not sp:
        return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                "output": _head(sp, loss_parallel)}
    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": _head(sp, loss_parallel)}


def _block_plan(sp: bool) -> dict[str, ParallelStyle]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, ParallelStyle] = {
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
