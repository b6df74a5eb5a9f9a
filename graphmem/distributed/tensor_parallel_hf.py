"""Tensor parallel for Hugging Face models through transformers' own TP engine
(transformers/distributed/tensor_parallel.py, ``apply_tensor_parallelism``), the code that
``from_pretrained(tp_plan="auto")`` / ``DistributedConfig(tp_size=T)`` runs
(transformers/distributed/mixin.py, ``maybe_distribute_model``).

The plan is the model's own: the config's ``base_model_tp_plan`` (``"layers.*.self_attn.q_proj":
"colwise"``, ...), the class's ``_tp_plan`` (``lm_head``: ``colwise_gather_output``) and the
vocabulary-sharded input embedding that transformers adds, resolved and expanded to concrete
module names by ``_resolve_parallel_plans`` (the model's method), then applied by
``apply_tensor_parallelism``: its ColwiseParallel / RowwiseParallel / EmbeddingParallel styles
shard each parameter with ``distribute_tensor(..., src_data_rank=None)`` (rank r keeps its chunk,
no communication) and wrap each module's forward to redistribute DTensor inputs and outputs. All of
it runs on the fake copy under the fake process group as on real tensors under gloo or NCCL.

Heads per rank: transformers' attention modules reshape their projections with
``view(*input_shape, -1, head_dim)``, so each rank runs the heads of its column shard with no
attribute changed (as under ``from_pretrained(tp_plan="auto")``). Tied weights (an input embedding
shared with the head) are untied while the plan applies and tied again after, as ``from_pretrained``
does (it builds the model untied and calls ``tie_weights`` after loading). A ``--tp`` that does not divide
the query or key/value heads is refused here, as transformers' ``get_kv_heads_per_rank`` finds
them not evenly sharded.

Known limitations: sequence parallel is not offered: transformers 5.x wires no sequence-parallel
plan (``DistributedConfig.enable_sequence_parallel`` is "Reserved for sequence parallelism. Not
wired up yet", and no model config has a ``sequence_parallel`` entry), so ``--sp`` on a Hugging Face
model is refused in one line; models without a TP plan (GPT-2, BERT, T5 in transformers 5.24) and
peft-wrapped models (the plan names the base linears, not LoRA's wrappers) are refused in one line
too. With FSDP, FSDP2 wraps the chain's blocks (graphmem/distributed/fsdp.py), not transformers'
``fsdp_plan``.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from graphmem.distributed.process_group import Meshes
from graphmem.distributed.spec import Sharding
from graphmem.errors import UsageError


def is_hf(model: nn.Module) -> bool:
    """A transformers PreTrainedModel (it resolves its own parallel plans)."""
    return callable(getattr(model, "_resolve_parallel_plans", None))


def hf_plan(model: nn.Module, tp: int) -> dict[str, str]:
    """The model's TP plan as transformers resolves it for ``tp`` ranks: one entry per concrete
    module or parameter name (``model.layers.3.mlp.up_proj``) -> a style of ALL_PARALLEL_STYLES."""
    from transformers.distributed.configuration_utils import DistributedConfig

    name = type(model).__name__
    if not (getattr(model, "tp_plan", None) or {}):
        raise UsageError(f"{name} has no tensor-parallel plan in transformers (no base_model_tp_plan in its config): "
                         "drop `rank` for the Korthikanti formula over any model")
    try:
        plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=tp))  # type: ignore[operator]
    except ValueError as e:
        raise UsageError(f"transformers refuses the tensor-parallel plan of {name}: {e}") from e
    return plan


def _check_heads(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    from transformers.distributed.tensor_parallel import get_kv_heads_per_rank

    config = model.config.get_text_config()  # type: ignore[operator, union-attr]
    heads = getattr(config, "num_attention_heads", None)
    if heads is None:
        return
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % tp or get_kv_heads_per_rank(plan, kv, tp) is None:
        raise UsageError(f"`tp={tp}` does not divide the {heads} attention heads ({kv} key/value heads) of "
                         f"{type(model).__name__}: pick a divisor")


def parallelize_hf(model: nn.Module, sharding: Sharding, meshes: Meshes) -> None:
    """transformers' ``apply_tensor_parallelism`` on ``model`` over ``meshes.tp`` (in place)."""
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    if sharding.sp:
        raise UsageError(f"`sp`: transformers has no sequence-parallel plan for {type(model).__name__} "
                         "(DistributedConfig.enable_sequence_parallel is not wired up yet): drop `sp`")
    plan = hf_plan(model, sharding.tp)
    _check_heads(model, plan, sharding.tp)
    assert meshes.tp is not None
    # from_pretrained builds the model untied (transformers' init.no_tie_weights), shards it, then ties
    # the weights again after loading (tie_weights): the tied head shares the embedding's shard
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    for target in tied:
        owner, _, pname = target.rpartition(".")
        module = model.get_submodule(owner)
        param = module._parameters[pname]
        assert param is not None
        module._parameters[pname] = nn.Parameter(torch.empty_like(param), requires_grad=param.requires_grad)
    apply_tensor_parallelism(model, meshes.tp, plan)
    if tied:
        model.tie_weights(recompute_mapping=False)  # type: ignore[operator]

