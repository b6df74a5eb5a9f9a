"""Ground truth for graphmem/distributed/pipeline.py: the same pipeline written as a user writes it
and run for real on the CPU, one process per rank with gloo (torch.multiprocessing.spawn), with
nothing of graphmem's own pipeline code: each stage a ``torch.distributed.pipelining.PipelineStage``
on a stage module written out here per model (the blocks the test names, the embedding before the
first, the final norm and head after the last), torch's own schedule (ScheduleGPipe, Schedule1F1B,
ScheduleInterleaved1F1B) and plain torch.optim over the stages' parameters. Each rank measures its
own step: saved bytes with saved_tensors_hooks, the peak from the CPU allocator's events under the
profiler (as graphmem/validation/measure.py measures a single step).

A stage after the first gets what the model's own forward hands its blocks besides the hidden state
(transformers' Llama: the rotary cos/sin and the position ids; GPT-2: the position ids) computed
once before the schedule, without grad, as constants it holds, as a user splitting the forward does.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch._C._profiler import _EventType
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.profiler import ProfilerActivity, profile

Split = list[tuple[int, int]]  # blocks [a, b) of each pipeline stage, in stage order (stage s on rank s % pp)
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved": ScheduleInterleaved1F1B}


def _hidden(h: Any) -> torch.Tensor:
    return h if isinstance(h, torch.Tensor) else h[0]


class Stage(nn.Module):
    """Blocks [a, b) of the model's chain, with the model's code before the chain on the first stage
    and the final norm and head on the last: bundled GPT-2 (models/gpt2.py, GPT.forward),
    transformers' Llama (LlamaModel.forward) or GPT-2 (GPT2Model.forward), copied out."""

    def __init__(self, model: Any, a: int, b: int, first: bool, last: bool, consts: dict[str, Any]) -> None:
        super().__init__()
        self.kind = type(model).__name__  # GPT | LlamaForCausalLM | GPT2LMHeadModel
        body = model.model if self.kind == "LlamaForCausalLM" else model.transformer
        self.blocks = nn.ModuleList(list(body.layers if self.kind == "LlamaForCausalLM" else body.h)[a:b])
        self.first, self.last, self.consts = first, last, consts
        if first:
            self.pre = nn.ModuleDict({"embed_tokens": body.embed_tokens, "rotary_emb": body.rotary_emb}
                                     if self.kind == "LlamaForCausalLM" else
                                     {"wte": body.wte, "wpe": body.wpe, "drop": body.drop})
        if last:
            self.post = nn.ModuleList([body.norm if self.kind == "LlamaForCausalLM" else body.ln_f, model.lm_head])

    def begin(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """The model's forward up to its first block: the hidden state and the blocks' other inputs."""
        pre, s = self.pre, ids.shape[1]
        if self.kind == "GPT":
            return pre["drop"](pre["wte"](ids) + pre["wpe"](torch.arange(s, dtype=torch.long))), {}
        position_ids = torch.arange(s).unsqueeze(0)
        if self.kind == "GPT2LMHeadModel":
            return pre["drop"](pre["wte"](ids) + pre["wpe"](position_ids)), {"position_ids": position_ids}
        h = pre["embed_tokens"](ids)
        return h, {"position_embeddings": pre["rotary_emb"](h, position_ids=position_ids), "position_ids": position_ids}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, consts = self.begin(x) if self.first else (x, self.consts)
        extra = {} if self.kind == "GPT" else {"use_cache": False}
        for block in self.blocks:
            h = _hidden(block(h, **consts, **extra))
        for m in self.post if self.last else ():
            h = m(h)
        return h


def _loss(model: Any, loss: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The last stage's loss of (logits, target = the micro-batch's ids): transformers' model's own
    ``loss_function`` (its shifted cross-entropy), else ``loss(logits, (target,))`` (models/gpt2.py)."""
    if loss is None:
        return lambda out, target: model.loss_function(logits=out, labels=target, vocab_size=model.config.vocab_size)
    return lambda out, target: loss(out, (target,))


def _stages(model: Any, loss: Any, batch: torch.Tensor, pp: int, rank: int, split: Split, schedule: str,
            m: int) -> tuple[Any, list[PipelineStage], list[torch.Tensor]]:
    """This rank's PipelineStages (stages rank, rank + pp, ...) over ``split``, torch's schedule over
    them, and the constants its later stages hold."""
    n, mb = len(split), batch.tensor_split(m)[0]
    dim = model.config.n_embd if hasattr(model.config, "n_embd") else model.config.hidden_size
    with torch.no_grad():  # what a later stage's blocks get besides the hidden state, made once
        _, consts = Stage(model, 0, 0, True, False, {}).begin(mb)
    stages, held = [], []
    for s in range(rank, n, pp):
        first, last = s == 0, s == n - 1
        if not first:
            held += [t for v in consts.values() for t in (v if isinstance(v, tuple) else (v,))]
        x = mb if first else torch.empty(mb.shape[0], mb.shape[1], dim, requires_grad=True)
        y = torch.empty(mb.shape[0], mb.shape[1], model.config.vocab_size if last else dim, requires_grad=True)
        stage = Stage(model, *split[s], first, last, consts)
        stages.append(PipelineStage(stage, s, n, torch.device("cpu"), input_args=(x,), output_args=(y,)))
    cls = SCHEDULES[schedule]
    engine = cls(stages, m, loss_fn=_loss(model, loss)) if schedule == "interleaved" else \
        cls(stages[0], m, loss_fn=_loss(model, loss))
    return engine, stages, held


@contextlib.contextmanager
def _profiled() -> Iterator[Any]:
    """The allocator's events under torch.profiler, the garbage collector paused inside (see
    graphmem/validation/measure.py's measure_peak: earlier garbage freed in the window would count)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield prof
    finally:
        if was:
            gc.enable()


_MARK = 987_653  # bytes of a marker allocated between two profiled steps (no step allocates this size here)


def _profiled_peaks(step: Callable[[], None], steps: int) -> list[int]:
    """Each of ``steps`` steps' highest bytes allocated above where the first started (the CPU
    allocator's events, one profile over all of them, so what a step keeps for the next, the
    optimizer's states and the schedule's receive buffers, counts in the later ones); a marker
    allocation between steps tells them apart."""
    with _profiled() as prof:
        for i in range(steps):
            if i:
                mark = torch.empty(_MARK, dtype=torch.uint8)
                del mark
            step()
    events, todo = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
        todo.extend(e.children)
    running, highs, skip = 0, [0], 0
    for _, size in sorted(events):
        if size == _MARK and skip == 0:  # the next step starts; its free follows
            highs.append(running)
            skip = 1
        elif size == -_MARK and skip == 1:
            skip = 0
        else:
            running += size
            highs[-1] = max(highs[-1], running)
    assert len(highs) == steps, "the marker allocation was not seen between the steps"
    return highs


def _bytes(tensors: list[torch.Tensor]) -> tuple[set[int], int]:
    keys = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return set(keys), sum(keys.values())


def _optimizer(name: str | None, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    """torch.optim as the test names it, lr 1e-3, the for-loop implementation (the CPU's default)."""
    if name is None:
        return None
    if name == "momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=False)
    assert name == "adamw", name
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _measure(model: nn.Module, batch: torch.Tensor, loss: Any, pp: int, rank: int, schedule: str, split: Split,
             m: int, optimizer: str | None) -> dict[str, int]:
    """One schedule's first step on this rank: its peak (profiled), then its saved bytes (a second step).
    With ``optimizer`` each step ends with the stages' optimizer step and ``zero_grad``, and a second step,
    profiled with the first, gives the later steps' peak ("later"; "states": the optimizer's bytes)."""
    engine, stages, consts = _stages(model, loss, batch, pp, rank, split, schedule, m)
    own = nn.ModuleList([s.submod for s in stages])
    own.zero_grad(set_to_none=True)
    excluded = _bytes([*own.parameters(), *own.buffers()])[0]  # saved bytes count the batch and the constants
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    baseline = _bytes([*own.parameters(), *own.buffers(), *consts, *([batch] if first or last else [])])[1]
    opt = _optimizer(optimizer, list(own.parameters()))

    def run() -> None:  # schedule.step as rank r calls it: the batch on the first stage, the target on the last
        args, kwargs = ((batch,) if first else ()), ({"target": batch, "losses": []} if last else {})
        engine.step(*args, **kwargs)

    def step() -> None:
        run()
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    dist.barrier()
    highs = _profiled_peaks(step, 2 if opt is not None else 1)
    result = {"baseline": baseline, "peak": baseline + highs[0]}
    if opt is not None:
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        result.update(states=_bytes(states)[1], later=baseline + highs[1])
    saved: dict[int, int] = {}
    keep: list[torch.Tensor] = []  # keeps saved storages alive so no address is reused while counting

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st._cdata not in excluded:
            saved[st._cdata] = st.nbytes()
            keep.append(t)
        return t

    own.zero_grad(set_to_none=True)
    dist.barrier()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    own.zero_grad(set_to_none=True)
    return {"saved": sum(saved.values()), **result}


def _rank(rank: int, build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, splits: dict[str, Split],
          micro_batches: int, store: str, folder: str, optimizer: str | None) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=pp)
    try:
        torch.manual_seed(0)
        model, batch, loss = build()
        model.train()
        results = {s: _measure(model, batch, loss, pp, rank, s, split, micro_batches, optimizer)
                   for s, split in splits.items()}
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


def measure_pipeline(build: Callable[[], tuple[nn.Module, Any, Any]], pp: int, splits: dict[str, Split],
                     micro_batches: int, folder: str, optimizer: str | None = None) -> dict[str, list[dict[str, int]]]:
    """Each schedule's per-rank measured {saved, peak, baseline}, one spawn for all: ``splits`` maps a
    schedule (1f1b | gpipe | interleaved) to its stages' blocks; ``build()`` returns (model, batch, loss)
    and must be a module-level function (it is pickled into the spawned processes)."""
    store = os.path.join(folder, "store")
    mp.spawn(_rank, args=(build, pp, splits, micro_batches, store, folder, optimizer), nprocs=pp, join=True)
    ranks = []
    for r in range(pp):
        with open(os.path.join(folder, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {s: [ranks[r][s] for r in range(pp)] for s in splits}
