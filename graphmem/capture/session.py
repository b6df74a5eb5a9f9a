"""One recording session: what every engine records its step through.

``Recording`` builds the recorder (graphmem/capture/recorder.py; built here only) and its fake
mode, installs the module hooks and closes the recorder after the step (``hooks``), enters what
every recorded step runs under (``running``: the fake mode, the saved_tensors_hooks, the CPU RNG
states checkpoint stashes, autocast's cache clears; what fails inside translated into a one-line
error naming the fix) and builds the StepGraph from what was recorded (``graph``). An engine
supplies only what differs: how its step is built and run, its process group, its own hooks and
contexts. The engines: graphmem/capture/capture.py (one device, eager or compiled),
graphmem/distributed/capture.py (rank r through PyTorch's wrappers), graphmem/distributed/pipeline.py
(a pipeline stage), graphmem/distributed/trainer_fsdp.py (a Trainer's FSDP rank),
graphmem/titan/capture.py (a torchtitan job's rank), graphmem/deepspeed/capture.py (DeepSpeed's engine).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.capture.autograd_tags import _unique_counts
from graphmem.capture.collector import quiet_gc
from graphmem.capture.cuda_rules import CudaRules
from graphmem.capture.fakes import translate_error
from graphmem.capture.recorder import _Mode, _Recorder
from graphmem.capture.rng_states import rng_states
from graphmem.capture.target import Target
from graphmem.errors import GraphmemError
from graphmem.stepgraph import StepGraph

Hook = Callable[..., Any]


@contextlib.contextmanager
def _cache_clears(cap: _Recorder) -> Iterator[None]:
    """Mark what CPU autocast's cache clears free (``torch.autocast.__exit__`` calls
    ``torch.clear_autocast_cache`` when the outermost context exits, in forward and in a
    checkpoint's recompute)."""
    clear = torch.clear_autocast_cache

    def marked() -> None:
        with cap.clearing_cache():
            clear()

    torch.clear_autocast_cache = marked  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.clear_autocast_cache = clear  # type: ignore[assignment]


class Recording:
    """One step's recording on ``target``: ``cap`` (the recorder) and ``mode`` (its fake mode).
    ``paths``: the module names (graphmem/capture/call_paths.py module_names), when the module is
    known already. On the CUDA target the recorder's recomputes run under CUDA's rules and its
    LayerNorm keeps fp32 statistics, unless ``cuda_recorder_rules`` is off (a pipeline stage's
    recorder has never taken them: graphmem/distributed/pipeline.py)."""

    def __init__(self, target: Target, paths: Optional[dict[int, tuple[str, ...]]] = None,
                 cuda_recorder_rules: bool = True) -> None:
        _unique_counts()  # calibrate before entering the fake mode
        self.target = target
        self.backends: dict[str, int] = {}  # the CUDA target's SDPA kernels -> calls
        cap = _Recorder(paths or {})
        cap.device, cap.gpu = target.device, target.gpu
        if target.device == "cuda" and cuda_recorder_rules:
            backends = self.backends
            cap.recompute_rules = lambda: CudaRules(target, backends, cap.clearing_cache)
            cap.fp32_norm_stats = True
        self.cap = cap
        self.mode = _Mode(cap)

    @contextlib.contextmanager
    def hooks(self, wrap: Callable[[Hook], Hook] = lambda hook: hook, install: bool = True) -> Iterator[None]:
        """Within: the recorder's module hooks (through ``wrap``) on every module (unless not
        ``install``); after, the recorder closed, before the fake tensors die with the caller's
        frame (those frees are after the step)."""
        cap = self.cap
        handles = [nn.modules.module.register_module_forward_pre_hook(wrap(cap.pre_hook)),
                   nn.modules.module.register_module_forward_hook(wrap(cap.post_hook), always_call=True),
                   ] if install else []  # (always_call: also when a recompute stops early)
        try:
            yield
        finally:
            cap.closed = True
            for h in handles:
                h.remove()

    @contextlib.contextmanager
    def running(self, root: str, *around: ContextManager[object],
                saved: Optional[tuple[Hook, Hook]] = None) -> Iterator[None]:
        """What a recorded step runs under: Python's collector paused after a collection of its young
        generations (graphmem/capture/collector.py ``quiet_gc``; nothing frozen: an explicit collection the engine
        makes inside, as DeepSpeed's, frees what it frees in the real step), the fake mode, the recorder's saved_tensors_hooks (or
        ``saved``: (pack, unpack)), the CPU target's RNG states, autocast's cache clears, then the
        engine's own contexts ``around`` (entered in order); recording from there on. What fails
        inside is translated into a one-line error naming the fix (``root``: the model's name)."""
        cap = self.cap
        pack, unpack = saved if saved is not None else (cap.pack, cap.unpack)
        try:
            with quiet_gc(1), self.mode, torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
                    rng_states(cap, self.target.device == "cpu"), _cache_clears(cap), contextlib.ExitStack() as stack:
                for context in around:
                    stack.enter_context(context)
                cap.recording = True
                yield
        except GraphmemError:
            raise
        except Exception as e:
            raise translate_error(e, cap, root) from e

    def graph(self, root: str, modules: list[str], gradients: list[int], kind: type[StepGraph] = StepGraph,
              phase_start: Optional[dict[str, int]] = None, **fields: Any) -> StepGraph:  # StepGraph's own fields
        """The StepGraph of the recorded step (``kind``: StepGraph or a subclass): ``root`` the
        model's name, ``modules`` its module paths, ``gradients`` the storage ids of its gradients;
        ``phase_start`` (default: where each phase began, and the end) and the graph's other
        fields (``fields``) where the engine knows them better."""
        cap = self.cap
        if phase_start is None:
            phase_start = {**cap.phase_start, "end": len(cap.ops)}
        given = {"module_inputs": cap.module_inputs, "micro_steps": tuple(cap.micro_steps),
                 "first_step_only": cap.first_step_only, **fields}
        return kind(cap.placeholders, cap.ops, cap.storages, cap.saves, phase_start, self.target.device,
                    list(dict.fromkeys(gradients)), root, modules, target=self.target,
                    attention_backends=self.backends, **given)


__all__ = ["Recording"]
