"""AsyncTP (``compile.enable_async_tensor_parallel``): Inductor's micro-pipeline pass on a job's
compiled blocks, as Inductor runs it.

What torchtitan does (torchtitan/distributed/compile.py ``_maybe_enable_async_tp``, from
``apply_compile`` when tensor parallel is on): ``enable_symm_mem_for_group`` on the TP group and
``torch._inductor.config._micro_pipeline_tp = True``. Only Inductor reads that flag: its
post-grad passes (torch/_inductor/fx_passes/post_grad.py ``post_grad_passes``) run
``micro_pipeline_tp_pass`` on each partitioned forward and backward graph, after AOTAutograd's
partition (the saved set is the partition's, unchanged). ``aot_eager`` runs no post-grad passes,
so a job that compiles with it runs plain TP with the flag set, and graphmem analyzes it so; a
FlexAttention job on ``aot_eager`` lowers only its flex regions with Inductor
(``regional_inductor``), which hold no TP collective.

graphmem's backend (graphmem/titan/compiled.py) generates no code, so it runs the pass itself on
each split graph, before the graph is kept and replayed:

- ``view_to_reshape`` first, as Inductor does before its post-grad passes
  (torch/_inductor/compile_fx.py ``_compile_fx_inner``): the pass matches ``aten.reshape``
  around ``mm`` (micro_pipeline_tp.py ``_find_reshape_mm_reshape``); a reshape of a viewable
  tensor is the same view;
- then ``micro_pipeline_tp_pass`` itself, Inductor's own pattern matching. Its preconditions
  are answered as on the job's CUDA ranks: ``is_symm_mem_enabled_for_group`` by torchtitan's own
  ``enable_symm_mem_for_group`` call (under the fake process group it registers the group as on
  a cluster), ``torch.distributed.is_nccl_available()`` as True (a CUDA build has NCCL), and
  ``reorder_for_compute_comm_overlap`` is Inductor's default (off). The post-grad passes that
  precede it in ``post_grad_passes`` (``remove_noop_ops``, the pattern passes) are not run:
  graphmem's plain compiled blocks do not run them either, so the two jobs differ by the pass
  alone (on the debug model they change no match: checked with ``remove_noop_ops`` run too);
- ``inductor_force_stride_order``, which the pass puts before each fused op's operand
  (``restride_A_shard_for_fused_all_gather_matmul``), replays as Inductor lowers it
  (torch/_inductor/ir.py ``ExternKernel.require_strides``): an operand whose strides already
  agree on its dimensions of size over 1, or made by a pointwise kernel (a flexible layout,
  frozen in the required order), is used with no copy (``as_strided`` of the same storage
  here); any other (a graph input, an extern kernel's output, laid out otherwise) is copied, as
  the prim's eager implementation does.

Nodes the pass adds carry no module stack; graphmem attributes them to the block running.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from torchtitan.trainer import Trainer


def runs_pass(cfg: Trainer.Config) -> bool:
    """Whether the job's compiled blocks get Inductor's micro-pipeline pass: AsyncTP on, tensor
    parallel on (torchtitan passes no mesh otherwise), the blocks compiled with Inductor."""
    c, p = cfg.compile, cfg.parallelism
    return bool(getattr(c, "enable_async_tensor_parallel", False)) and p.tensor_parallel_degree > 1 \
        and c.backend == "inductor"


def micro_pipeline(gm: fx.GraphModule) -> None:
    """The pass on one partitioned graph (module docstring), in place."""
    from torch._inductor import config
    from torch._inductor.fx_passes.micro_pipeline_tp import micro_pipeline_tp_pass
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    view_to_reshape(gm)
    with _nccl_answered(), config.patch(reorder_for_compute_comm_overlap=False):
        micro_pipeline_tp_pass(gm.graph)
    _layouts_as_inductor(gm.graph)
    gm.recompile()


@contextlib.contextmanager
def _nccl_answered() -> Iterator[None]:
    """``fuse_all_gather_matmul`` and ``fuse_matmul_reduce_scatter`` return early without NCCL
    (micro_pipeline_tp.py): the job runs on CUDA ranks, which have it."""
    import torch.distributed as dist

    kept = dist.is_nccl_available
    dist.is_nccl_available = lambda: True  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.is_nccl_available = kept  # type: ignore[assignment]


_FORCE = "inductor_force_stride_order"


def _layouts_as_inductor(graph: fx.Graph) -> None:
    """Each ``inductor_force_stride_order`` whose operand Inductor lays out freely (a pointwise
    kernel's output) becomes an ``as_strided`` view of that operand: no copy (module docstring)."""
    for n in list(graph.nodes):
        if n.op != "call_function" or getattr(n.target, "__name__", "").split(".")[0] != _FORCE:
            continue
        x, stride = n.args
        if _flexible(x) or _significantly_equal(x, stride):
            with graph.inserting_before(n):
                view = graph.call_function(torch.ops.aten.as_strided.default,
                                           (x, list(x.meta["val"].shape), list(stride)))
            view.meta.update(n.meta)
            n.replace_all_uses_with(view)
            graph.erase_node(n)


def _significantly_equal(x: fx.node.Argument, stride: Sequence[int]) -> bool:
    """``x`` already has the strides asked, on its dimensions of size over 1 (Inductor compares
    significant strides, ir.py ``significant_strides_equal``; the eager prim compares all and
    copies a tensor whose size-1 dimension alone differs)."""
    if not (isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)):
        return False
    t = x.meta["val"]
    return all(size == 1 or a == b for size, a, b in zip(t.shape, t.stride(), stride))


def _flexible(x: fx.node.Argument) -> bool:
    """A node whose output Inductor computes into a buffer of flexible layout: a pointwise kernel's."""
    return isinstance(x, fx.Node) and x.op == "call_function" and "val" in x.meta \
        and torch.Tag.pointwise in getattr(x.target, "tags", ())


@contextlib.contextmanager
def async_tp_state() -> Iterator[None]:
    """What torchtitan's ``_maybe_enable_async_tp`` sets process-wide, put back after the capture:
    Inductor's ``_micro_pipeline_tp`` flag (the symmetric-memory group registrations stay: the
    fake group's names are the same in the next capture, and torch registers a group once)."""
    from torch._inductor import config

    kept = config._micro_pipeline_tp
    try:
        yield
    finally:
        config._micro_pipeline_tp = kept


def graph_pass(cfg: Trainer.Config) -> Optional[Callable[[fx.GraphModule], None]]:
    """The pass the job's compiled blocks run on each split graph, or None."""
    return micro_pipeline if runs_pass(cfg) else None


__all__ = ["async_tp_state", "graph_pass", "micro_pipeline", "runs_pass"]
