"""How each test model is wrapped for a real multi-process run, written out here as a user writes
it, with nothing from graphmem's own wrappers (graphmem/distributed/): which modules FSDP2 wraps,
the tensor-parallel plan of every model, the heads each rank runs. tests/dist_truth.py runs them;
graphmem's prediction must agree with these, so a wrong unit, plan or split in graphmem shows up.

- FSDP2 (torch/distributed/fsdp/_fully_shard/_fully_shard.py): ``fully_shard`` on each decoder
  block (BLOCKS names the ModuleList per model), then on the root, as PyTorch's FSDP2 examples
  and torchtitan's apply_fsdp wrap transformers' layers.
- Tensor parallel of the bundled Llama (models/llama.py): torchtitan's plan
  (torchtitan/models/llama3/infra/parallelize.py, apply_tp) through ``parallelize_module``.
- Tensor parallel of the bundled GPT-2 (models/gpt2.py): Megatron-LM's split, the fused c_attn
  keeping rank r's rows of q, of k and of v (``_StridedShard(0, split_factor=3)``).
- Tensor parallel of transformers' Llama / Qwen2: the plan ``from_pretrained(tp_plan="auto")``
  applies, written out module by module, through transformers' own engine
  (transformers/distributed/tensor_parallel.py ``apply_tensor_parallelism``: its styles, not
  torch's, run the model's forward).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

# the chain of blocks fully_shard wraps one by one, per case name (tests/dist_truth.py case)
BLOCKS = {"chain": "blocks", "llama_gqa": "model.layers", "gpt2_sdpa": "transformer.h", "llama_bundled": "layers",
          "gpt2_bundled": "transformer.h", "qwen2_gqa8": "model.layers", "lora_llama": "base_model.model.model.layers"}

_DTYPES = {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}


def fully_shard_blocks(model: nn.Module, name: str, mesh: DeviceMesh, reshard_after_forward: bool,
                       param_dtype: str | None, reduce_dtype: str | None) -> None:
    """FSDP2 as the case asks: each block, then the root, one MixedPrecisionPolicy for all."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=_DTYPES[param_dtype], reduce_dtype=_DTYPES[reduce_dtype])
    for block in model.get_submodule(BLOCKS[name]).children():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)


def tensor_parallel(model: nn.Module, name: str, mesh: DeviceMesh, sp: bool, loss_parallel: bool) -> None:
    """Split ``model`` over ``mesh`` in place with its plan (see the module's docstring)."""
    base = name.split("+")[0]
    if base == "llama_bundled":
        _llama(model, mesh, sp, loss_parallel)
    elif base == "gpt2_bundled":
        _gpt2(model, mesh, sp, loss_parallel)
    else:
        assert not sp and not loss_parallel, "transformers wires no sequence-parallel plan and gathers the logits"
        _transformers(model, mesh)


def _head(sp: bool, loss_parallel: bool) -> ColwiseParallel:
    """The LM head: logits gathered whole, or left split over the vocabulary for loss_parallel()."""
    inputs = Shard(1) if sp else None
    if loss_parallel:
        return ColwiseParallel(input_layouts=inputs, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=inputs, output_layouts=Replicate())


def _llama(model: Any, mesh: DeviceMesh, sp: bool, loss_parallel: bool) -> None:
    if sp:
        root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "norm": SequenceParallel(), "output": _head(sp, loss_parallel)}
    else:
        root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()), "output": _head(sp, loss_parallel)}
    parallelize_module(model, mesh, root)
    tp = mesh.size()
    for layer in model.layers:
        plan: dict[str, Any] = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                "attention.wv": ColwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                                "feed_forward.w3": ColwiseParallel()}
        if sp:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                         "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                         desired_input_layouts=(Replicate(), None, None)),
                         "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                                            desired_input_layouts=(Replicate(),)),
                         "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                         "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
        else:
            plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        parallelize_module(layer, mesh, plan)
        layer.attention.n_heads //= tp  # each rank runs its own heads
        layer.attention.n_kv_heads //= tp


class _QKVColwise(ColwiseParallel):
    """Column-parallel for GPT-2's fused c_attn ([q; k; v] rows): rank r keeps the r-th chunk of
    each of q, k and v, its local output is [q_r, k_r, v_r] (Megatron-LM's split of a fused QKV)."""

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for pname, param in module.named_parameters():
            module.register_parameter(pname, nn.Parameter(
                distribute_tensor(param, device_mesh, [_StridedShard(0, split_factor=3)]),
                requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: DTensor,
                           device_mesh: DeviceMesh) -> torch.Tensor:
        return outputs.to_local()


def _gpt2(model: Any, mesh: DeviceMesh, sp: bool, loss_parallel: bool) -> None:
    root: dict[str, Any] = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": _head(sp, loss_parallel)}
    if sp:  # the residual stream split along the sequence from the first block on
        root.update({"transformer.h.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                                           use_local_output=True),
                     "transformer.ln_f": SequenceParallel()})
    parallelize_module(model, mesh, root)
    model.transformer.wte.weight = model.lm_head.weight  # tied again: one vocabulary shard for both
    tp = mesh.size()
    for block in model.transformer.h:
        plan: dict[str, Any] = {"attn.c_attn": _QKVColwise(), "mlp.c_fc": ColwiseParallel()}
        if sp:
            plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(),
                         "attn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                         "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                         "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))})
        else:
            plan.update({"attn.c_proj": RowwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        parallelize_module(block, mesh, plan)
        block.attn.n_head //= tp
        block.attn.n_embd //= tp


def _transformers(model: Any, mesh: DeviceMesh) -> None:
    """transformers' plan for a Llama-family decoder (LlamaConfig / Qwen2Config base_model_tp_plan,
    the class's lm_head entry and the vocabulary-sharded input embedding), every module and its
    parameters named. As from_pretrained, the model is sharded untied and tied again after."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    styles = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
              "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
              "mlp.down_proj": "rowwise"}
    modules = {"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_gather_output"}
    for i in range(len(model.model.layers)):
        modules.update({f"model.layers.{i}.{m}": style for m, style in styles.items()})
    plan = {}
    for path, style in modules.items():
        plan.update({f"{path}.{p}": style for p, _ in model.get_submodule(path).named_parameters()})
        plan[path] = style
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tied:
        model.lm_head.weight = nn.Parameter(torch.empty_like(model.lm_head.weight))
    apply_tensor_parallelism(model, mesh, plan)
    if tied:
        model.tie_weights(recompute_mapping=False)
