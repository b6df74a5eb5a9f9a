"""The CUDA target in compiled mode: dynamo's graphs run under the eager CUDA target's rules
(graphmem/capture/cuda_rules.py ``CudaRules``) while AOTAutograd traces them.

In real torch, ``torch.autocast("cuda")`` around a compiled call is traced into the graphs: dynamo
guards on the autocast state, and AOTAutograd traces each graph with CUDA's Autocast dispatch key
on, so the casts of CUDA's cast lists (aten/src/ATen/autocast_mode.cpp: ``lower_precision_fp``
ops such as mm/linear/conv/baddbmm run in the autocast dtype, ``fp32`` ops such as softmax,
log_softmax, layer_norm in fp32) are ``_to_copy`` nodes of the joint graph, partitioned like any
op. graphmem's fake tensors are CPU tensors, where CUDA's Autocast key never fires; so each call
node of dynamo's graph runs inside ``CudaRules``, the TorchFunctionMode the eager CUDA target
runs the model in: its cast lists, SDPA's backend op and CUDA's fused dropout become aten ops of
the joint graph (``cuda_graph``); dynamo's own fake run of each node runs inside it as well
(``example_values_ruled``), so the dtypes the model's code reads while dynamo traces it are
autocast's. Autocast's cast cache does not matter here: make_fx traces
with it off (torch/fx/experimental/proxy_tensor.py ``disable_autocast_cache``), and the casts of
one parameter that it would have shared are one node after AOTAutograd's CSE.

The eager code around the graphs (the loss) runs inside ``CudaRules`` as in eager mode
(``compiled_context``); the compiled call itself runs with the mode lifted off the stack
(``graphs_unruled``), so dynamo neither traces it nor guards on it, in the trace and the replay
alike. Known limitation: eager code dynamo runs between graphs at a graph break runs without
the CUDA rules (real torch would cast it under autocast).
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, ContextManager, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from graphmem.capture.cuda_rules import CudaRules
from graphmem.capture.target import Target

if TYPE_CHECKING:
    from torch._dynamo.output_graph import OutputGraph


def cuda_graph(gm: fx.GraphModule, target: Target, used: dict[str, int]) -> None:
    """The CUDA target's rules in a graph dynamo captured, before AOTAutograd traces it: each
    call node runs inside ``CudaRules`` (the eager rules: autocast's casts under ``amp``, each
    ``scaled_dot_product_attention`` as the backend op CUDA would run, fused dropout, the calls
    inside a Python function dynamo keeps as one node, such as ``multi_head_attention_forward``),
    so the joint graph, the partition and the saved set hold what the CUDA kernels keep. ``used``
    counts the SDPA backends each node's last run picked (AOTAutograd runs the graph more than
    once). The nodes read CUDA's autocast state (the eager context around the compiled call sets
    it, the model's ``torch.autocast`` nodes change it) and do not set it."""
    rules = CudaRules(target, owns_state=False)  # its own cast cache, entered node by node
    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.target = _ruled(rules, n.target, used)
        elif n.op == "call_method":
            n.op, n.target = "call_function", _ruled(rules, _method(n.target), used)
    gm.recompile()


def _ruled(rules: CudaRules, fn: Callable[..., object], used: dict[str, int]) -> Callable[..., object]:
    last: dict[str, int] = {}  # the SDPA backends this node's previous run counted into ``used``

    def run(*args: object, **kwargs: object) -> object:
        rules.backends = {}
        with rules:
            out = fn(*args, **kwargs)
        for backend in set(last) | set(rules.backends):
            used[backend] = used.get(backend, 0) - last.get(backend, 0) + rules.backends.get(backend, 0)
            if not used[backend]:
                del used[backend]
        last.clear()
        last.update(rules.backends)
        return out
    run.__name__ = getattr(fn, "__name__", "ruled")  # the fx code names the call after it
    return run


def _method(name: str) -> Callable[..., object]:
    """A ``call_method`` node's call as a function (what fx.Interpreter does for the node)."""
    def call(self: object, *args: object, **kwargs: object) -> object:
        return getattr(self, name)(*args, **kwargs)
    call.__name__ = name
    return call


@contextlib.contextmanager
def example_values_ruled(target: Target) -> Iterator[None]:
    """Dynamo's own fake run of each node (``torch._dynamo.utils.get_fake_value`` calls
    ``run_node``) inside ``CudaRules`` too, so the example values the model's code reads while
    dynamo traces it have the dtypes CUDA autocast gives them (a KV cache made with
    ``key.dtype`` is bf16, as under real autocast, where dynamo's fake CUDA tensors take the
    Autocast key); no-op on the CPU target."""
    from torch._dynamo import utils

    if target.device != "cuda":
        yield
        return
    run_node, rules = utils.run_node, CudaRules(target, owns_state=False)

    def ruled(tracer: OutputGraph, node: fx.Node, args: tuple, kwargs: dict, nnmodule: Optional[nn.Module]) -> object:
        if node.op not in ("call_function", "call_method"):
            return run_node(tracer, node, args, kwargs, nnmodule)
        with rules:
            return run_node(tracer, node, args, kwargs, nnmodule)
    utils.run_node = ruled
    try:
        yield
    finally:
        utils.run_node = run_node


@contextlib.contextmanager
def graphs_unruled() -> Iterator[None]:
    """``CudaRules`` off the torch function mode stack while the compiled call runs (its graphs
    carry the rules, ``cuda_graph``), back on after; other modes stay as they are."""
    stack = [torch._C._pop_torch_function_stack() for _ in range(torch._C._len_torch_function_stack())][::-1]
    for mode in stack:
        if not isinstance(mode, CudaRules):
            torch._C._push_on_torch_function_stack(mode)
    try:
        yield
    finally:
        for _ in range(torch._C._len_torch_function_stack()):
            torch._C._pop_torch_function_stack()
        for mode in stack:
            torch._C._push_on_torch_function_stack(mode)


def compiled_context(target: Target, clearing: Callable[[], ContextManager[object]] = contextlib.nullcontext,
                     ) -> Callable[[], ContextManager[object]]:
    """What wraps forward and loss on the CUDA target in compiled mode: ``CudaRules`` for the eager
    code (the loss; ``clearing`` wraps its cast cache's emptying), lifted around the compiled
    call (``graphs_unruled``)."""
    def rules() -> CudaRules:
        return CudaRules(target, {}, clearing)  # SDPA backends are counted in the graphs (``cuda_graph``)
    return rules
