"""How users build a pipeline of a model, run by graphmem/distributed/pipeline.py on fake tensors
and by its tests for real: the model's chain of identical blocks (graphmem/chains.py) split
evenly over the stages, each stage a ``PipelineStage`` on a submodule (stage 0 with the model's
own code before the chain, the last stage with the modules after it and the loss), and the
torch schedule over this rank's stages (torch/distributed/pipelining/schedules.py)."""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.utils.stateless import _reparametrize_module

from graphmem.capture.fakes import Inputs, fake_batch, fake_state
from graphmem.capture.hf_paths import real_paths
from graphmem.chains import Chain, find_chain
from graphmem.errors import UsageError
from graphmem.jsontypes import JSON
from graphmem.training.step import LossFn, default_loss

if TYPE_CHECKING:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
    from torch.distributed.pipelining.stage import _PipelineStageBase

    Schedule = Union[PipelineScheduleSingle, PipelineScheduleMulti]  # what build_schedule makes

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

    def describe(self) -> str:
        """The report's scope: which rank, under which schedule (the first line of every view)."""
        return f"pipeline rank {self.rank} of {self.pp}, {self.schedule} schedule, {self.micro_batches} micro-batches"

    def to_dict(self) -> dict[str, JSON]:
        return {"kind": "pipeline", "pp": self.pp, "rank": self.rank, "schedule": self.schedule,
                "micro_batches": self.micro_batches, "stages": list(self.stages)}


def make_pipeline(pp: int, rank: int, schedule: str, micro_batches: int) -> Pipeline:
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 2:
        raise UsageError(f"`pp` must be an integer >= 2 (pipeline ranks; `rank` and `schedule` need it), got {pp!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < pp:
        raise UsageError(f"`rank` must be in 0..{pp - 1} for `pp={pp}`, got {rank!r}")
    if schedule not in SCHEDULES:
        raise UsageError(f"unknown `schedule={schedule!r}`; choose one of {', '.join(SCHEDULES)}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise UsageError(f"`micro_batches` must be a positive integer, got {micro_batches!r}")
    if schedule == "1f1b" and micro_batches < pp:  # torch/distributed/pipelining/schedules.py, Schedule1F1B.__init__
        raise UsageError(f"the 1f1b schedule needs at least as many micro-batches as stages: `micro_batches={pp}` "
                         f"or more for `pp={pp}` (or `schedule='gpipe'`)")
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


def block_inputs(model: nn.Module, chain: Chain, call: Callable[[], object]) -> tuple[tuple, dict]:
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


def run_model(model: nn.Module, x: torch.Tensor) -> object:
    """``model(x)``; with ``use_cache=False`` where its forward takes one (a Hugging Face decoder's
    KV cache would otherwise carry one micro-batch's keys into the next)."""
    if "use_cache" in inspect.signature(model.forward).parameters:
        return model(x, use_cache=False)
    return model(x)


def _first(out: Union[torch.Tensor, Sequence[torch.Tensor]]) -> torch.Tensor:
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


def parent_tensors(stage: _PipelineStageBase) -> dict[str, str]:
    """The stage's StageModule's ``parent_tensors`` (build_schedule's stages each run one)."""
    mod = stage.submod
    assert isinstance(mod, StageModule)
    return mod.parent_tensors


def probe(model: nn.Module, batch: Inputs, micro_batches: int, dtype: Optional[torch.dtype] = None,
          context: Callable[[], ContextManager[object]] = contextlib.nullcontext) -> Layout:
    """Run the model once on fake tensors (whole batch, no grad; parameters in ``dtype``, forward
    in ``context()``: the target's autocast) and note which modules run before its chain and
    after it, and the shapes and dtypes at the cut for one micro-batch."""
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
    seen: dict[str, torch.Tensor] = {}

    def pre(m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        path = paths.get(id(m))
        if m is first_block:
            where[0] = "chain"
            seen["hidden"] = _first(args)
        if path is not None and path not in parents and where[0] != "chain":
            order.append((where[0], path))

    def post(m: nn.Module, args: tuple[torch.Tensor, ...], out: Union[torch.Tensor, Sequence[torch.Tensor]]) -> None:
        if m is last_block:
            where[0] = "after"
            seen["last"] = _first(out)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        state, _ = fake_state(model, torch.device("cpu"), dtype)
        fb = fake_batch(batch, mode, torch.device("cpu"), dtype)
        h1 = nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = nn.modules.module.register_module_forward_hook(post)
        try:
            with torch.no_grad(), _reparametrize_module(model, state, tie_weights=True, strict=False, stack_weights=True), real_paths(), \
                    context():
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
    _check_epilogue(chain.path, epilogue, y, out)
    b = y.shape[0]
    if b % micro_batches:
        raise UsageError(f"the batch ({b}) must split evenly into `micro_batches={micro_batches}`")

    def per_mb(t: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
        return (t.shape[0] // micro_batches, *t.shape[1:]), t.dtype

    return Layout(chain, tuple(_outermost([p for w, p in order if w == "before"])), parents, tuple(epilogue),
                  per_mb(seen["hidden"]), per_mb(y))


def _check_epilogue(chain: str, epilogue: list[str], y: torch.Tensor,
                    out: Union[torch.Tensor, dict[str, torch.Tensor], Sequence[torch.Tensor]]) -> None:
    """The modules after the chain, applied in order to its output, must give the model's output: else the
    model runs other code there, which a stage split cannot see."""
    logits = out if isinstance(out, torch.Tensor) else out["logits"] if isinstance(out, dict) else _first(out)
    if tuple(y.shape) != tuple(logits.shape):
        raise UsageError(f"pipeline split: the modules after {chain} ({', '.join(epilogue) or 'none'}) applied in "
                         f"order give shape {tuple(y.shape)}, the model's output is {tuple(logits.shape)}; "
                         "the model runs other code there, which a stage split cannot see")


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
                   group: Optional[dist.ProcessGroup] = None) -> tuple[Schedule, list[_PipelineStageBase]]:
    """This rank's PipelineStage(s) and the torch schedule over them (the engine users run)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    n = plan.pp * plan.virtual
    if layout.chain.length < n:
        raise UsageError(f"{layout.chain.path} has {layout.chain.length} blocks, fewer than the {n} pipeline stages")
    bounds = layout.bounds(n)
    stages: list[_PipelineStageBase] = []
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


def run_schedule(schedule: Schedule, stages: list[_PipelineStageBase], batch: torch.Tensor) -> list[torch.Tensor]:
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
