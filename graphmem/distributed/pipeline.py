"""Pipeline parallelism: stage r's step as torch.distributed.pipelining's real schedules run it.

The model's chain of identical blocks (graphmem/chains.py) is split evenly over the stages
(``pp`` ranks, two virtual stages each for the interleaved schedule); stage 0 also runs the
model's own code before the first block (embeddings), the last stage the modules after the
last block (final norm, head) and the loss. Each stage is a ``PipelineStage`` on a submodule,
as users build them; rank r runs the real ``Schedule1F1B`` / ``ScheduleGPipe`` /
``ScheduleInterleaved1F1B`` ``step`` in this process on PyTorch's fake process group
(torch/testing/_internal/distributed/fake_pg.py: its send/recv complete at once and leave the
receive buffers as they are), on fake tensors, under graphmem's recorder. The step graph is
stage r's: its forward and backward of every micro-batch in the schedule's order, the
schedule's receive buffers, the loss and the merged output on the last stage.

Shapes are given to ``PipelineStage`` (``input_args``/``output_args``: its static mode, torch/
distributed/pipelining/stage.py ``PipelineStage.__init__``), so no metadata is exchanged.

Known limitations: the modules after the chain are applied in the order the model calls them,
one after another (checked: their output must have the model's output shape), so code the
model runs between them is not run; a stage after the first receives the block inputs other
than the hidden state (masks, rotary tables) computed once before the step, as torchtitan
precomputes them per stage; the batch's first tensor is the stage-0 input and the loss target.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from graphmem.capture.capture import _cache_clears
from graphmem.capture.fakes import _fake_like, fake_batch, fake_state, forward_context, translate_error
from graphmem.capture.hf_paths import real_paths
from graphmem.capture.recorder import _Mode, _Recorder, _rng_states, _tag_grad_fns, _tensors, _unique_counts
from graphmem.capture.target import Target
from graphmem.chains import Chain, find_chain
from graphmem.errors import GraphmemError, UsageError
from graphmem.stepgraph import StepGraph
from graphmem.training.batch import as_batch
from graphmem.training.step import LossFn, default_loss

SCHEDULES = ("1f1b", "gpipe", "interleaved")


@dataclass(frozen=True)
class Pipeline:
    pp: int  # pipeline ranks
    rank: int
    schedule: str = "1f1b"  # 1f1b | gpipe | interleaved
    micro_batches: int = 1  # the schedule's n_microbatches: the batch is split into this many

    @property
    def virtual(self) -> int:
        return 2 if self.schedule == "interleaved" else 1

    @property
    def stages(self) -> tuple[int, ...]:
        """This rank's stage indices (interleaved: r and r + pp, torch's looped placement)."""
        return tuple(self.rank + v * self.pp for v in range(self.virtual))


def make_pipeline(pp: int, rank: int, schedule: str, micro_batches: int) -> Pipeline:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise UsageError(f"--pp must be an integer >= 2 (pipeline ranks), got {pp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise UsageError(f"--rank must be in 0..{pp - 1} for --pp {pp}, got {rank!r}")
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UsageError(f"--micro-batches must be a positive integer, got {micro_batches!r}")
    return Pipeline(pp, rank, schedule, micro_batches)


@dataclass(frozen=True)
class Layout:
    """Where the model splits: found once by a probe forward (see ``probe``)."""

    chain: Chain
    prologue: tuple[str, ...]  # modules called before the first block (and outside the chain's parents)
    parents: tuple[str, ...]  # the chain's ancestors: their own tensors go with stage 0
    epilogue: tuple[str, ...]  # modules called after the last block, in call order
    hidden: tuple[tuple[int, ...], torch.dtype]  # a block's input, for one micro-batch
    output: tuple[tuple[int, ...], torch.dtype]  # the last stage's output, for one micro-batch

    def bounds(self, n_stages: int) -> list[tuple[int, int]]:
        """Blocks [a, b) of each stage: an even split, earlier stages take the remainder."""
        q, extra = divmod(self.chain.length, n_stages)
        out, a = [], 0
        for i in range(n_stages):
            b = a + q + (1 if i < extra else 0)
            out.append((a, b))
            a = b
        return out


class _Stop(Exception):
    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("stop before the first block")
        self.block_args, self.block_kwargs = args, kwargs


def block_inputs(model: nn.Module, chain: Chain, call: Callable[[], Any]) -> tuple[tuple, dict]:
    """The model's own code up to its first block: the first block's (args, kwargs)."""
    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        raise _Stop(args, kwargs)

    handle = _blocks(model, chain)[0].register_forward_pre_hook(stop, with_kwargs=True)
    try:
        call()
    except _Stop as s:
        return s.block_args, s.block_kwargs
    finally:
        handle.remove()
    raise UsageError(f"the model's forward never called {chain.path}.0; pipeline stages split that chain")


def _blocks(model: nn.Module, chain: Chain) -> list[nn.Module]:
    return list(model.get_submodule(chain.path).children())  # a ModuleList / Sequential (graphmem/chains.py)


def run_model(model: nn.Module, x: torch.Tensor) -> Any:
    """``model(x)``; with ``use_cache=False`` where its forward takes one (a Hugging Face decoder's
    KV cache would otherwise carry one micro-batch's keys into the next)."""
    if "use_cache" in inspect.signature(model.forward).parameters:
        return model(x, use_cache=False)
    return model(x)


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]  # a block's hidden state (HF blocks may return tuples)


class StageModule(nn.Module):
    """One pipeline stage: [the model's code before the chain,] blocks [a, b) [, the modules after it]."""

    def __init__(self, model: nn.Module, layout: Layout, a: int, b: int, first: bool, last: bool,
                 consts: tuple[tuple, dict] = ((), {})) -> None:  # the first block's inputs after the hidden state
        super().__init__()
        self._root = (model,)  # not registered: only this stage's modules are its parameters
        self.first, self.last = first, last
        self.layout = layout
        self.blocks = nn.ModuleList(_blocks(model, layout.chain)[a:b])
        self.pre = nn.ModuleList([model.get_submodule(n) for n in layout.prologue] if first else [])
        self.post = nn.ModuleList([model.get_submodule(n) for n in layout.epilogue] if last else [])
        self.consts = consts
        self.parent_tensors: dict[str, str] = {}  # the chain's ancestors' own tensors: this name -> the model's
        for i, p in enumerate(layout.parents if first else ()):
            for name, param in model.get_submodule(p).named_parameters(recurse=False):
                self.register_parameter(f"parent{i}_{name}", param)
                self.parent_tensors[f"parent{i}_{name}"] = f"{p}.{name}".lstrip(".")
            for name, t in model.get_submodule(p).named_buffers(recurse=False):
                self.register_buffer(f"parent{i}_{name}", t)
                self.parent_tensors[f"parent{i}_{name}"] = f"{p}.{name}".lstrip(".")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            args, kwargs = block_inputs(self._root[0], self.layout.chain, lambda: run_model(self._root[0], x))
            h, rest = args[0], args[1:]
        else:
            h, rest, kwargs = x, self.consts[0], self.consts[1]
        for block in self.blocks:
            h = _first(block(h, *rest, **kwargs))
        for m in self.post:
            h = _first(m(h))
        return h


def probe(model: nn.Module, batch: Any, micro_batches: int) -> Layout:
    """Run the model once on fake tensors (whole batch, no grad) and note which modules run
    before its chain and after it, and the shapes at the cut for one micro-batch."""
    chain = find_chain(model)
    if chain is None:
        raise UsageError("pipeline stages split a chain of identical blocks (a ModuleList/Sequential); "
                         "this model has none")
    paths = {id(m): n for n, m in model.named_modules()}
    blocks = _blocks(model, chain)
    first_block, last_block = blocks[0], blocks[-1]
    parents = tuple(p for p in paths.values() if chain.path == p or chain.path.startswith(p + ".") or p == "")
    parents = tuple(p for p in parents if p != chain.path)
    order: list[tuple[str, str]] = []  # (when, path)
    where = ["before"]
    seen: dict[str, Any] = {}

    def pre(m: nn.Module, args: Any) -> None:
        path = paths.get(id(m))
        if m is first_block:
            where[0] = "chain"
            seen["hidden"] = _first(args)
        if path is not None and path not in parents and where[0] != "chain":
            order.append((where[0], path))

    def post(m: nn.Module, args: Any, out: Any) -> None:
        if m is last_block:
            where[0] = "after"
            seen["last"] = _first(out)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state, _ = fake_state(model, torch.device("cpu"), None)
        fb = fake_batch(batch, mode, torch.device("cpu"), None)
        h1 = nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = nn.modules.module.register_module_forward_hook(post)
        try:
            with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True, strict=False), real_paths():
                out = fb.call(model)
                if "last" not in seen:
                    raise UsageError(f"the model's forward did not run {chain.path}'s blocks in order")
                epilogue = _outermost([p for w, p in order if w == "after"])
                y = seen["last"]
                for name in epilogue:
                    y = _first(model.get_submodule(name)(y))
        finally:
            h1.remove()
            h2.remove()
    logits = out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, dict) else _first(out)
    if tuple(y.shape) != tuple(logits.shape):
        raise UsageError(f"pipeline split: the modules after {chain.path} ({', '.join(epilogue) or 'none'}) applied in "
                         f"order give shape {tuple(y.shape)}, the model's output is {tuple(logits.shape)}; "
                         "the model runs other code there, which a stage split cannot see")
    b = logits.shape[0]
    if b % micro_batches:
        raise UsageError(f"the batch ({b}) must split evenly into --micro-batches {micro_batches}")

    def per_mb(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        return (t.shape[0] // micro_batches, *t.shape[1:]), t.dtype

    return Layout(chain, tuple(_outermost([p for w, p in order if w == "before"])), parents, tuple(epilogue),
                  per_mb(seen["hidden"]), per_mb(y))


def _outermost(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in dict.fromkeys(paths):
        if not any(p.startswith(o + ".") for o in out):
            out.append(p)
    return out


def stage_loss(model: nn.Module, loss: Optional[LossFn]) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss of (output, target = the micro-batch's first input): a Hugging Face
    model's own ``loss_function`` (transformers/loss/loss_utils.py), else ``loss(output, (target,))``."""
    hf_loss = getattr(model, "loss_function", None)
    config = getattr(model, "config", None)
    if loss is None and callable(hf_loss) and config is not None:
        vocab = config.get_text_config().vocab_size
        return lambda out, target: hf_loss(logits=out, labels=target, vocab_size=vocab)
    fn = loss or default_loss
    return lambda out, target: fn(out, (target,))


def build_schedule(model: nn.Module, layout: Layout, plan: Pipeline, loss: Callable[..., torch.Tensor],
                   device: torch.device, consts: tuple[tuple, dict], example: torch.Tensor,
                   group: Any = None) -> tuple[Any, list[Any]]:
    """This rank's PipelineStage(s) and the torch schedule over them (the engine users run)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    n = plan.pp * plan.virtual
    if layout.chain.length < n:
        raise UsageError(f"{layout.chain.path} has {layout.chain.length} blocks, fewer than the {n} pipeline stages")
    bounds = layout.bounds(n)
    stages: list[Any] = []
    for s in plan.stages:
        first, last = s == 0, s == n - 1
        mod = StageModule(model, layout, *bounds[s], first, last, consts)
        x_in = example if first else torch.empty(layout.hidden[0], dtype=layout.hidden[1], device=device,
                                                 requires_grad=True)
        out_meta = layout.output if last else layout.hidden
        y_out = torch.empty(out_meta[0], dtype=out_meta[1], device=device, requires_grad=True)
        stages.append(PipelineStage(mod, s, n, device, input_args=(x_in,), output_args=(y_out,), group=group))
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, plan.micro_batches, loss_fn=loss), stages
    cls = Schedule1F1B if plan.schedule == "1f1b" else ScheduleGPipe
    return cls(stages[0], plan.micro_batches, loss_fn=loss), stages


def run_schedule(schedule: Any, stages: list[Any], batch: torch.Tensor) -> list[torch.Tensor]:
    """``schedule.step`` as rank r calls it: the batch on the first stage, the target on the last."""
    first = any(s.is_first for s in stages)
    last = any(s.is_last for s in stages)
    losses: list[torch.Tensor] = []
    args = (batch,) if first else ()
    if last:
        schedule.step(*args, target=batch, losses=losses)
    else:
        schedule.step(*args)
    return losses


@contextlib.contextmanager
def fake_group(rank: int, world_size: int) -> Iterator[None]:
    """torch.distributed's fake process group for ``rank`` (one process, no communication)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UsageError("a torch.distributed process group is already initialized in this process; "
                         "graphmem runs rank r on its own fake process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Held:
    """A work that holds its tensor until it is destroyed, as gloo's SendWork/RecvWork do
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp); the fake process group's FakeWork holds
    nothing, so without this a sent activation would die earlier than in a real run (the
    schedule keeps the last send's works until its next send: Schedule1F1B ``send_work``)."""

    def __init__(self, work: Any, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self, *args: Any) -> Any:
        return self.work.wait(*args) if self.work is not None else True


@contextlib.contextmanager
def _works_hold_tensors() -> Iterator[None]:
    """Within: isend/irecv return works that hold their tensor; batch_isend_irecv issues them one
    by one (its path for a backend without coalescing, gloo's; torch/distributed/distributed_c10d.py)."""
    c10d = dist.distributed_c10d
    isend, irecv = c10d.isend, c10d.irecv

    def held(op: Callable[..., Any]) -> Callable[..., Any]:
        def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return _Held(op(tensor, *args, **kwargs), tensor)
        return run

    def batch(ops: list[Any]) -> list[Any]:
        return [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]

    patched = {"isend": held(isend), "irecv": held(irecv), "batch_isend_irecv": batch}
    originals = {name: getattr(c10d, name) for name in patched}
    for name, fn in patched.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


@dataclass(frozen=True)
class Segment:
    kind: str  # forward | loss | backward
    stage: int
    micro_batch: int
    first_op: int
    first_save: int


class StageGraph(StepGraph):
    """A stage's step interleaves micro-batches' forwards and backwards: an op's phase is its own."""

    def phase_of(self, index: int) -> str:
        return "before" if index < 0 else str(self.ops[min(index, self.num_ops - 1)].meta["phase"])


@dataclass(frozen=True)
class InFlight:
    """Micro-batches whose saved activations are held: at the peak and at most."""

    segments: tuple[Segment, ...]
    per_micro_batch: tuple[int, ...]  # saved bytes of each (stage, micro-batch) forward, in schedule order
    at_peak: int  # micro-batches (per stage) with activations held at the peak op
    bytes_at_peak: int
    most: int  # the most held at any op


def in_flight(g: StepGraph, segments: tuple[Segment, ...], peak: int) -> InFlight:
    owner: dict[int, tuple[int, int]] = {}  # save event index -> (stage, micro-batch)
    bounds = [s.first_save for s in segments] + [len(g.saves)]
    for seg, end in zip(segments, bounds[1:]):
        if seg.kind != "backward":
            for i in range(seg.first_save, end):
                owner[i] = (seg.stage, seg.micro_batch)
    per: dict[tuple[int, int], dict[int, int]] = {}
    for i, key in owner.items():
        e = g.saves[i]
        if g.storages[e.sid].kind not in ("parameter", "buffer"):
            per.setdefault(key, {})[e.sid] = g.storages[e.sid].nbytes

    def held(at: int) -> dict[tuple[int, int], set[int]]:
        out: dict[tuple[int, int], set[int]] = {}
        for i, key in owner.items():
            e = g.saves[i]
            if e.packed_at <= at and (e.released_at is None or e.released_at >= at) \
                    and g.storages[e.sid].kind not in ("parameter", "buffer"):
                out.setdefault(key, set()).add(e.sid)
        return out

    at = held(peak)
    starts = sorted({s.first_op for s in segments if s.kind == "backward"} | {g.num_ops - 1})
    most = max((len(held(i - 1)) for i in starts), default=0)  # holdings grow until a backward starts
    live_bytes = sum(g.storages[sid].nbytes for sid in set().union(*at.values()))
    return InFlight(segments, tuple(sum(v.values()) for v in per.values()), len(at), live_bytes, most)


def capture_stage(model: nn.Module, inputs: Any, loss: Optional[LossFn], target: Target,
                  plan: Pipeline) -> tuple[StageGraph, tuple[Segment, ...], Layout]:
    """Record rank ``plan.rank``'s step of the pipeline on fake tensors (see the module docstring)."""
    device = torch.device("cpu")  # the CUDA target runs on fake CPU tensors (graphmem/capture/target.py)
    layout = probe(model, inputs, plan.micro_batches)
    _unique_counts()
    cap = _Recorder({id(m): n for n, m in model.named_modules()})
    cap.device = target.device
    mode = _Mode(cap)
    segments: list[Segment] = []
    training = [(m, m.training) for m in model.modules()]
    handles: list[Any] = []
    try:
        for m in model.modules():
            m.training = True
        with fake_group(plan.rank, plan.pp), _works_hold_tensors():
            with mode:
                batch = as_batch(fake_batch(inputs, mode, device, target.param_dtype).given).tensors()[0]
                consts = _consts(model, layout, batch, plan, mode)
                for i, t in enumerate(_tensors(consts)):  # held by the stage from before the step
                    cap.preexisting(t, "external", f"stage constant {i} (the first block's inputs)")
                schedule, stages = build_schedule(model, layout, plan, stage_loss(model, loss), device, consts,
                                                  batch.tensor_split(plan.micro_batches)[0])
                own = nn.ModuleList([s.submod for s in stages])
                for s in stages:
                    cap.paths[id(s.submod)] = ""
                names = {id(t): n for n, t in [*model.named_parameters(remove_duplicate=False),
                                               *model.named_buffers(remove_duplicate=False)]}
                mine = dict([*own.named_parameters(remove_duplicate=False), *own.named_buffers(remove_duplicate=False)])
                state, seen = fake_state(own, device, target.param_dtype,  # named as in the model
                                         lambda t, kind, n: cap.preexisting(t, kind, names.get(id(mine[n]), n)))
                root_state = {name: state[f"{k}.{attr}"] for k, s in enumerate(stages)  # the model's code reads them
                              for attr, name in s.submod.parent_tensors.items()}
                if any(s.is_first or s.is_last for s in stages):
                    cap.preexisting(batch, "input", "input")
            _phases(cap, schedule, stages, segments, forward_context(target, {}, cap.clearing_cache))
            handles = [nn.modules.module.register_module_forward_pre_hook(cap.pre_hook),
                       nn.modules.module.register_module_forward_hook(cap.post_hook, always_call=True)]
            try:
                with mode, torch.autograd.graph.saved_tensors_hooks(cap.pack, cap.unpack), \
                        _reparametrize_module(own, state, tie_weights=True, strict=False), \
                        _reparametrize_module(model, root_state, strict=False), \
                        _rng_states(cap, target.device == "cpu"), _cache_clears(cap), real_paths():
                    cap.recording = True
                    out = run_schedule(schedule, stages, batch)
                    grads = [cap.storage(p.grad, "gradient", "grad", len(cap.ops) - 1, "").sid
                             for p in seen.values() if p.grad is not None]
                    for sid in grads:
                        cap.storages[sid].kind = "gradient"
                    del out
            except GraphmemError:
                raise
            except Exception as e:
                raise translate_error(e, cap, type(model).__name__) from e
        # micro-batches' forwards and backwards interleave: each op keeps its own phase (StageGraph.phase_of);
        # phase_start says where the first backward begins
        first_bwd = next((seg.first_op for seg in segments if seg.kind == "backward"), len(cap.ops))
        starts = {"forward": 0, "loss": first_bwd, "backward": first_bwd, "end": len(cap.ops)}
        g = StageGraph(cap.placeholders, cap.ops, cap.storages, cap.saves, starts, target.device, grads,
                       type(model).__name__, [n for n, _ in model.named_modules()], cap.module_inputs, target)
        return g, tuple(segments), layout
    finally:
        cap.closed = True
        for h in handles:
            h.remove()
        for m, was in training:
            m.training = was


def _consts(model: nn.Module, layout: Layout, batch: torch.Tensor, plan: Pipeline,
            mode: FakeTensorMode) -> tuple[tuple, dict]:
    """The first block's inputs besides the hidden state, for stages after the first: the model's
    code before the chain run once before the step (unrecorded) on fake copies of its tensors."""
    if plan.stages == (0,):
        return (), {}
    state: dict[str, torch.Tensor] = {}
    for path in (*layout.prologue, *layout.parents):
        holder = model.get_submodule(path)
        recurse = path not in layout.parents
        for name, t in [*holder.named_parameters(recurse=recurse), *holder.named_buffers(recurse=recurse)]:
            state[f"{path}.{name}".lstrip(".")] = _fake_like(t, torch.device("cpu"))
    mb = batch.tensor_split(plan.micro_batches)[0]
    with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True, strict=False), real_paths():
        args, kwargs = block_inputs(model, layout.chain, lambda: run_model(model, mb))
    return args[1:], kwargs


def _phases(cap: _Recorder, schedule: Any, stages: list[Any], segments: list[Segment],
            context: Callable[[], Any]) -> None:
    """Tell the recorder each forward, loss and backward of a micro-batch as the schedule runs
    it (wrapping this rank's own stage and schedule objects)."""
    def mark(kind: str, stage: int, mb: int) -> None:
        cap.set_phase(kind)
        segments.append(Segment(kind, stage, mb, len(cap.ops), len(cap.saves)))

    for st in stages:
        fwd, bwd = st.forward_one_chunk, st.backward_one_chunk

        def forward_one_chunk(mb: int, *a: Any, _f: Any = fwd, _s: Any = st, **k: Any) -> Any:
            mark("forward", _s.stage_index, mb)
            with context():
                return _f(mb, *a, **k)

        def backward_one_chunk(mb: int, *a: Any, _f: Any = bwd, _s: Any = st, **k: Any) -> Any:
            mark("backward", _s.stage_index, mb)
            return _f(mb, *a, **k)

        st.forward_one_chunk, st.backward_one_chunk = forward_one_chunk, backward_one_chunk
    compute = schedule._compute_loss

    def compute_loss(output: Any, target: Any, *a: Any, **k: Any) -> Any:
        last = segments[-1]
        mark("loss", last.stage, last.micro_batch)
        loss = compute(output, target, *a, **k)
        _tag_grad_fns(loss, "")
        return loss

    schedule._compute_loss = compute_loss


@dataclass(frozen=True)
class StageStep:
    """What graphmem.analyze builds rank r's Report from."""

    graph: StageGraph
    liveness: Any  # passes/liveness.py Liveness
    saved: Any  # passes/saved.py SavedSet
    notes: tuple[str, ...]
    in_flight: InFlight
    blocks: tuple[tuple[int, int], ...]  # blocks [a, b) of each of this rank's stages


def analyze_stage(model: nn.Module, inputs: Any, loss: Optional[LossFn], target: Target,
                  plan: Pipeline) -> StageStep:
    """Rank ``plan.rank``'s step graph, saved set, peak and micro-batches in flight."""
    from graphmem.passes import liveness, notes, saved

    g, segments, layout = capture_stage(model, inputs, loss, target, plan)
    lv, sv = liveness(g), saved(g)
    flight = in_flight(g, segments, lv.peak_index)
    bounds = layout.bounds(plan.pp * plan.virtual)
    blocks = tuple(bounds[s] for s in plan.stages)
    where = ", ".join(f"stage {s} ({layout.chain.path}.{a}..{b - 1})" for s, (a, b) in zip(plan.stages, blocks))
    line = (f"pipeline rank {plan.rank} of {plan.pp}, {plan.schedule} schedule, {plan.micro_batches} micro-batches, "
            f"{where}: at the peak {flight.at_peak} micro-batches' activations held "
            f"({flight.bytes_at_peak:,} B), at most {flight.most}; forwards and backwards interleave from op "
            f"{g.phase_start['backward']} (each op's phase is its own)")
    return StageStep(g, lv, sv, (line, *notes(g)), flight, blocks)
