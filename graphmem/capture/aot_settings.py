"""AOTAutograd's settings while graphmem compiles a step (graphmem/capture/compiled.py), each
restored after: the partitioner's activation memory budget, the backward compiled with the
forward, and no text dumps of the graphs that no log reads.

Known limitations: the settings are torch's process-wide config and module attributes, patched
for the duration of one compilation (not thread-safe, as torch's own ``config.patch`` is not).
"""
from __future__ import annotations

import contextlib
from typing import ContextManager, Iterator, Optional


def partition_config(budget: Optional[float]) -> ContextManager[object]:
    """AOTAutograd's settings while the step is compiled, restored after:
    ``activation_memory_budget`` set to ``budget`` (the partitioner reads it when it splits each
    joint graph; None keeps torch's), and the backward compiled with the forward."""
    from torch._functorch import config

    # the backward is compiled with the forward: lazily, AOTAutograd deep-copies the backward graph
    # inside loss.backward(), under graphmem's fake mode, where copying a lifted constant (a real
    # tensor) fails; compiled eagerly, it copies it outside any fake mode (graph_compile.py)
    changes: dict[str, bool | float] = {"force_non_lazy_backward_lowering": True}
    if budget is not None:
        changes["activation_memory_budget"] = budget
    return config.patch(changes)


@contextlib.contextmanager
def unlogged() -> Iterator[None]:
    """AOTAutograd writes the joint, forward and backward graphs out as text
    (``GraphModule.print_readable``) whether or not anyone logs them
    (torch/_functorch/_aot_autograd/graph_compile.py ``_log_joint_graph``, ``_log_fw_bw_graphs``:
    ``AOTConfig.enable_log`` defaults to True and dynamo's backends cannot set it): 0.47 s of a
    GPT-2 XL compilation's 10.1 s under cProfile. Skipped, as with ``enable_log=False``, unless torch's logs for them or
    its structured trace are written (``TORCH_LOGS=aot_graphs``, ``TORCH_TRACE``); the text only
    feeds those logs and AOTAutograd's cache, which ``aot_eager`` does not use."""
    import logging

    from torch._functorch._aot_autograd import graph_compile as gc

    if gc.aot_joint_log.isEnabledFor(logging.INFO) or gc.aot_graphs_log.isEnabledFor(logging.INFO) or _tracing():
        yield
        return
    joint, fw_bw = gc._log_joint_graph, gc._log_fw_bw_graphs
    gc._log_joint_graph = lambda *a, **k: None  # type: ignore[assignment]
    gc._log_fw_bw_graphs = lambda *a, **k: (None, None)  # type: ignore[assignment]
    try:
        yield
    finally:
        gc._log_joint_graph, gc._log_fw_bw_graphs = joint, fw_bw  # type: ignore[assignment]


def _tracing() -> bool:
    """torch's structured trace is written somewhere (``TORCH_TRACE=dir``): its handler has a
    directory. (torch always installs a ``LazyTraceHandler``; without a directory it writes only
    on Meta's internal hosts, torch/_logging/_internal.py ``LazyTraceHandler.emit``.)"""
    import logging
    import os

    from torch._logging._internal import LazyTraceHandler

    return bool(os.environ.get("TORCH_TRACE")) or any(
        isinstance(h, LazyTraceHandler) and h.root_dir is not None for h in logging.getLogger("torch.__trace").handlers)
