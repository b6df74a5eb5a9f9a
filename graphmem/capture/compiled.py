"""Compiled mode: the step ``torch.compile(model)`` runs, with AOTAutograd's joint graph split by
PyTorch's default min-cut rematerialization partitioner and no Inductor code generation (the
``aot_eager`` backend's settings), so the saved set is what the compiled forward returns for
backward.

How: two runs of the step, both on fake tensors, nothing real allocated.

1. ``CompiledStep.trace``: ``torch.compile(model, backend=..., dynamic=False)`` runs forward
   and loss on a plain FakeTensorMode, and stops where backward would start: every backward
   graph is compiled with its forward graph (``partition_config``), and running them told
   nothing the replay does not. Dynamo captures the graphs exactly as it would for real tensors
   (graph breaks, lifted buffers, decompositions: dynamo makes its own fake copies either way),
   and the backend (``aot_eager`` itself, given recording compilers) keeps every forward and
   backward fx graph the partitioner produced. The trace runs the forward graphs' own code; the
   text dumps AOTAutograd makes of its graphs for logs nobody reads are skipped (graphmem/capture/aot_settings.py ``unlogged``).
2. ``CompiledStep.replay`` (inside graphmem's capture): the same call under
   ``torch._dynamo.run`` (run-only: the code cached in step 1, no new compilation) on
   graphmem's recorded fake tensors. AOTAutograd's runtime calls ``ctx.save_for_backward`` with
   the tensors the compiled forward returns for backward, so graphmem's ``saved_tensors_hooks``
   see exactly the compiled saved set; ops outside the graphs (graph breaks, the loss) run
   eagerly as they would for real. Each graph runs through an ``fx.Interpreter`` that tells the
   recorder the module of the node running (its ``nn_module_stack``), since module hooks inside
   a compiled graph never fire.

The partition runs at ``Target.memory_budget`` (``activation_memory_budget``, ``partition_config``);
with ``Target.compile_backend == "inductor"``, after Inductor's decompositions and joint-graph passes
(graphmem/capture/inductor_partition.py). A trainer's own step (a transformers Trainer's:
graphmem/training/hf_trainer.py) runs in both the trace and the replay, so the model is called as the
replay calls it.
On the CUDA target, dynamo's graphs run under the eager CUDA rules while AOTAutograd traces them
(graphmem/capture/compiled_cuda.py: autocast's CUDA casts, SDPA's backend op, fused dropout;
LayerNorm's fp32 statistics come from the recorder in the replay).

Every compiled forward graph must run as often in the replay as in the trace (``check_replayed``); the
cache entries the trace added are removed afterwards (``close``), so analyses do not pile up in
dynamo's cache or hit its recompile limit.
"""
from __future__ import annotations

import contextlib
import re
import types
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from graphmem.capture.aot_settings import partition_config, unlogged
from graphmem.capture.autograd_tags import _DONE, _tensors, node_metadata
from graphmem.capture.compiled_cuda import compiled_context as cuda_context
from graphmem.capture.compiled_cuda import cuda_graph, example_values_ruled, graphs_unruled
from graphmem.capture.dynamo_cache import cache_entries, cache_sizes, compiled_codes, guard_failure
from graphmem.capture.fakes import Inputs, fake_batch, fake_state, forward_context, translate_in
from graphmem.capture.inductor_partition import inductor_partition
from graphmem.capture.partition_record import Partition, recording
from graphmem.capture.target import Target
from graphmem.capture.widen_map import block_copies, rename
from graphmem.errors import CaptureError, GraphmemError
from graphmem.training.step import LossFn, run_step

if TYPE_CHECKING:
    from graphmem.capture.recorder import _Recorder

_INDEX = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")


def module_path(stack: Optional[dict], names: frozenset[str]) -> str:
    """The innermost module of an ``nn_module_stack`` entry, as a ``named_modules()`` path.

    Dynamo names modules from its sources: ``L['self'].transformer.h.0``, ``L['self'].h[0]``,
    ``L['self']._modules['attn']``; the root is ``L['self']`` (``torch.compile(model)``) or
    ``L['graphmem_root']`` (graphmem's own compiled call)."""
    if not stack:
        return ""
    source = list(stack.values())[-1][0]
    dotted = _INDEX.sub(r".\1", str(source)).replace("._modules.", ".")
    parts = [p for p in dotted.split(".") if p]
    if parts[:2] in (["L", "self"], ["L", _ROOT]):  # the module torch.compile was given
        parts = parts[2:]
    path = ".".join(parts)
    return path if path in names else ""


_ROOT = "graphmem_root"


def _call(graphmem_root: nn.Module, *args: object, **kwargs: object) -> object:
    """What gets compiled: a call of the model, as ``torch.compile(model)(*args, **kwargs)`` traces it."""
    return graphmem_root(*args, **kwargs)


def _fresh_call() -> types.FunctionType:
    """``_call`` with a code object of its own: dynamo keeps compiled code on code objects, so
    each analysis compiles, replays and then drops its own entries without touching others."""
    return types.FunctionType(_call.__code__.replace(), _call.__globals__, "graphmem_step")


@dataclass
class CompiledGraph:
    """One graph AOTAutograd compiled: ``kind`` is "forward" or "backward"."""

    kind: str
    graph: fx.GraphModule
    modules: dict[fx.Node, str]  # node -> module path ("" when unknown)
    calls: int = 0  # times run in the trace
    replays: int = 0  # times run in the replay


@dataclass(frozen=True)
class CompiledGraphs:
    """What a StepGraph keeps of the compilation: the graphs and dynamo's graph breaks."""

    graphs: tuple[CompiledGraph, ...]
    graph_breaks: tuple[str, ...] = ()
    widened: Optional[tuple[str, int, int]] = None  # depth reuse: (chain path + ".", blocks in the graphs, in the step)
    partitions: tuple[Partition, ...] = ()  # what the partitioner decided, per joint graph

    def paths(self, path: str) -> list[str]:
        """The module paths of the step that a graph node's module stands for: itself, or,
        in a widened step (graphmem/capture/widen.py), each block that copies its block."""
        if self.widened is None:
            return [path]
        prefix, k, n = self.widened
        head = path[len(prefix):].split(".", 1)[0] if path.startswith(prefix) else ""
        if not head.isdigit():
            return [path]
        return [rename(path, prefix, int(head), b) for b in block_copies(int(head), k, n)]

    @property
    def forward(self) -> tuple[CompiledGraph, ...]:
        return tuple(g for g in self.graphs if g.kind == "forward")

    @property
    def backward(self) -> tuple[CompiledGraph, ...]:
        return tuple(g for g in self.graphs if g.kind == "backward")


class _Run(fx.Interpreter):
    """Runs a compiled graph node by node; during the replay it sets the recorder's module."""

    def __init__(self, graph: CompiledGraph, backend: "_Backend") -> None:
        super().__init__(graph.graph)
        self.cg, self.backend = graph, backend

    def run_node(self, n: fx.Node) -> object:
        rec = self.backend.recorder
        if rec is None or n.op in ("placeholder", "output"):
            return super().run_node(n)
        before = rec.node_module
        rec.node_module = self.cg.modules.get(n, "")
        try:
            return super().run_node(n)
        finally:
            rec.node_module = before


class _Backend:
    """A dynamo backend: ``aot_eager`` (AOTAutograd, min-cut partition, nothing generated) with
    compilers that keep each graph and run it through ``_Run``."""

    def __init__(self, names: frozenset[str], target: Optional[Target] = None,
                 used: Optional[dict[str, int]] = None) -> None:
        self.names = names
        self.target = target
        self.used: dict[str, int] = {} if used is None else used  # CUDA target: SDPA backend -> calls
        self.graphs: list[CompiledGraph] = []
        self.recorder: Any = None  # graphmem's recorder during the replay
        self.replaying = False

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable[..., object]:
        from torch._dynamo.backends.debugging import aot_eager

        if self.target is not None and self.target.device == "cuda":
            cuda_graph(gm, self.target, self.used)
        if self.target is not None and self.target.compile_backend == "inductor":
            return inductor_partition(gm, example_inputs, self._compiler("forward"), self._compiler("backward"))
        return aot_eager(gm, example_inputs, fw_compiler=self._compiler("forward"),
                         bw_compiler=self._compiler("backward"))

    def _compiler(self, kind: str) -> Callable[[fx.GraphModule, list], Callable[[list], object]]:
        def compile(gm: fx.GraphModule, example_inputs: list) -> Callable[[list], object]:
            key = "nn_module_stack" if kind == "forward" else "fwd_nn_module_stack"
            modules = {n: module_path(n.meta.get("nn_module_stack") or n.meta.get(key), self.names)
                       for n in gm.graph.nodes}
            cg = CompiledGraph(kind, gm, modules)
            self.graphs.append(cg)
            interpreter = _Run(cg, self)

            def run(args: list) -> object:
                if not self.replaying:  # the trace: its own code, no recorder to tell (faster than the interpreter)
                    cg.calls += 1
                    return gm(*args)
                cg.replays += 1
                try:
                    return interpreter.boxed_run(args)  # boxed: frees the inputs as it goes, like aot_eager
                finally:
                    interpreter.env = {}  # the interpreter keeps the output node's value: let the caller own it
                    node = torch._C._current_autograd_node() if kind == "backward" else None
                    if node is not None:  # what capture's post hook does for other nodes
                        node_metadata(node)[_DONE] = True
            run._boxed_call = True  # type: ignore[attr-defined]
            return run
        return compile


def _unruled(compiled: Callable[..., object], *args: object, **kwargs: object) -> object:
    """The compiled call, with the CUDA target's rules for eager code lifted (their graphs carry them)."""
    with graphs_unruled():
        return compiled(*args, **kwargs)


class _Compiled(Exception):
    """The trace reached backward: every graph is compiled by then, so it stops there."""


def _stop_at_backward(phase: list[str], name: str) -> None:
    phase[0] = name
    if name == "backward":  # the backward graphs were compiled with their forward graphs (partition_config)
        raise _Compiled


class CompiledStep:
    """One model compiled by torch.compile on fake tensors, ready to replay under capture."""

    def __init__(self, model: nn.Module, backend: _Backend, call: types.FunctionType, codes: dict[int, int],
                 breaks: tuple[str, ...], module_inputs: dict[str, tuple[int, ...]]) -> None:
        self.model, self.backend, self.call = model, backend, call
        self.forwards = 0  # replays of the model's call: one per micro-step of the traced training step
        self._codes_before = codes
        self.graph_breaks = breaks
        self.module_inputs = module_inputs
        self.partitions: list[Partition] = []
        self.missed = ""  # the guard that failed first in the replay (dynamo_cache.guard_failure), if any

    @staticmethod
    def trace(model: nn.Module, inputs: Inputs, loss_fn: Optional[LossFn], target: Target,
              used: Optional[dict[str, int]] = None, runner: Optional[Callable[..., object]] = None) -> "CompiledStep":
        """Compile and run one step of ``model`` on a plain fake mode (step 1 above); on the CUDA
        target ``used`` counts the SDPA backends the graphs run. ``runner`` (a trainer's own step, as
        the capture takes it: graphmem/training/hf_trainer.py) runs the step in graphmem's place, so
        the model is called as the replay will call it (its keyword inputs, accelerate's autocast)."""
        from torch._dynamo.utils import counters

        names = frozenset(name for name, _ in model.named_modules())
        backend = _Backend(names, target, used)
        call = _fresh_call()
        optimized = torch.compile(call, backend=backend, dynamic=False)
        codes = cache_sizes()
        breaks_before = dict(counters["graph_break"])
        mode = FakeTensorMode()
        device = torch.device("cpu")
        module_inputs = _module_inputs(model, mode, inputs, target)
        step = CompiledStep(model, backend, call, codes, (), module_inputs)
        phase = ["forward"]
        try:  # a model compiled before in this process may have used up dynamo's recompile limit
            with mode, torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20), \
                    partition_config(target.memory_budget), recording(step.partitions), unlogged(), \
                    example_values_ruled(target):
                state, _ = fake_state(model, device, target.param_dtype)
                batch = fake_batch(inputs, mode, device, target.param_dtype)
                with torch.nn.utils.stateless._reparametrize_module(model, state, tie_weights=True, strict=False, stack_weights=True):
                    forward = partial(_unruled, optimized, model)
                    if runner is not None:
                        runner(forward, batch, loss_fn, partial(_stop_at_backward, phase), compiled_context(target),
                               fake=True)
                    else:
                        run_step(forward, batch, loss_fn, partial(_stop_at_backward, phase), compiled_context(target))
        except _Compiled:
            pass  # every graph is compiled: the backward graphs with their forward (partition_config)
        except GraphmemError:
            step.close()
            raise
        except Exception as e:
            step.close()
            raise _translate(e, phase[0], type(model).__name__) from e
        step.graph_breaks = tuple(f"{reason} (× {n - breaks_before.get(reason, 0)})"
                                  for reason, n in counters["graph_break"].items() if n > breaks_before.get(reason, 0))
        if not backend.graphs:
            step.close()
            raise CaptureError(f"torch.compile made no graph of {type(model).__name__}.forward (dynamo ran it "
                               "eagerly); compiled mode needs at least one compiled graph: check "
                               "torch._dynamo.explain(model)(*inputs)")
        return step

    def replay(self, rec: _Recorder, args: tuple, kwargs: dict[str, object]) -> object:
        """The forward, run from the compiled code on graphmem's fake tensors (step 2 above);
        the capture has put its fake parameters into the module."""
        self.backend.recorder, self.backend.replaying = rec, True
        self.forwards += 1
        if not self.missed:  # the frame _call's locals, as dynamo's guards read them
            self.missed = guard_failure(self.call.__code__, {"graphmem_root": self.model, "args": tuple(args),
                                                             "kwargs": dict(kwargs)})
        return _unruled(torch._dynamo.run(self.call), self.model, *args, **kwargs)

    def check_replayed(self) -> None:
        """The replay ran the same compiled forward graphs as the trace, as often per forward (the
        trace runs one forward and stops before backward; the replay runs one per micro-step; a
        backward graph runs only through its forward graph's autograd node)."""
        for g in self.backend.graphs:
            if g.kind != "forward":
                continue
            if g.calls * self.forwards != g.replays:
                raise CaptureError(
                    f"the replay of the compiled step ran a {g.kind} graph {g.replays} times in {self.forwards} "
                    f"forward(s), the trace {g.calls} times in one (dynamo's cached code did not match the replay: "
                    f"{self.missed or 'the first frame matched, a frame after a graph break did not'}); rerun with `debug` and report it")

    def summary(self) -> CompiledGraphs:
        return CompiledGraphs(tuple(self.backend.graphs), self.graph_breaks, partitions=tuple(self.partitions))

    def close(self) -> None:
        """Drop the cache entries this compilation added to code objects that had none."""
        from torch._dynamo.eval_frame import reset_code

        self.backend.recorder, self.backend.replaying = None, False
        reset_code(self.call.__code__)
        for code in compiled_codes():
            if self._codes_before.get(id(code), 0) == 0 and cache_entries(code):
                reset_code(code)


def compiled_context(target: Target, clearing: Callable[[], ContextManager[object]] = contextlib.nullcontext,
                     ) -> Callable[[], ContextManager[object]]:
    """What wraps forward and loss in compiled mode: the CPU target's (autocast, SDPA backend
    choice; dynamo guards on them), or on the CUDA target the CUDA rules around the eager code,
    lifted off around the compiled call, whose graphs carry them (graphmem/capture/compiled_cuda.py)."""
    return forward_context(target, {}) if target.device == "cpu" else cuda_context(target, clearing)


def _module_inputs(model: nn.Module, mode: FakeTensorMode, inputs: Inputs, target: Target) -> dict[str, tuple[int, ...]]:
    """First input shape of each module, from an eager forward without grad (graph code runs no
    module hooks; the shapes are the same either way)."""
    paths = {id(m): name for name, m in model.named_modules()}
    shapes: dict[str, tuple[int, ...]] = {}

    def pre(module: nn.Module, args: tuple) -> None:
        path = paths.get(id(module))
        if path is not None and path not in shapes:
            first = next(iter(_tensors(args)), None)
            shapes[path] = tuple(first.shape) if first is not None else ()

    device = torch.device("cpu")
    handle = nn.modules.module.register_module_forward_pre_hook(pre)
    try:
        with mode, torch.no_grad():
            state, _ = fake_state(model, device, target.param_dtype)
            batch = fake_batch(inputs, mode, device, target.param_dtype)
            # (not torch.func.functional_call: it restores a shared module's tensors in order, which
            # leaves the fakes in the model; stack_weights restores them last-in first-out)
            with torch.nn.utils.stateless._reparametrize_module(model, state, tie_weights=True, strict=False,
                                                                stack_weights=True):
                batch.call(model)
    except Exception:
        pass  # the compiled trace reports what fails, with its own message
    finally:
        handle.remove()
    return shapes


def _translate(e: Exception, phase: str, root: str) -> GraphmemError:
    """Dynamo wraps what fails while tracing; translate the innermost cause like an eager capture."""
    inner: BaseException = e
    while inner.__cause__ is not None and not isinstance(inner, GraphmemError):
        inner = inner.__cause__
    if isinstance(inner, GraphmemError):
        return inner
    err = translate_in(inner if isinstance(inner, Exception) else e, phase, root)
    if isinstance(err, CaptureError) and type(err) is CaptureError:
        msg = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
        return CaptureError(f"torch.compile of {root} failed on fake tensors in the {phase}: {type(inner).__name__}: "
                            f"{msg}; check that torch.compile(model, backend=\"aot_eager\") runs it, or use `mode='eager'`")
    return err


