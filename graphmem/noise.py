"""Third-party noise silenced while graphmem works: the warnings and log lines that torch,
transformers, torchtitan, bitsandbytes and their kin print while graphmem builds, captures and
runs a step, which are about graphmem's fake tensors and stand-ins, not about the user's step.

    with quiet_third_party():      # the front doors: graphmem.analyze, graphmem.validate, the CLI,
        ...                        # and the report's answers that capture again (formulas, plans)

Inside the block:

- Python warnings attributed to a third-party module (or to graphmem's own, where torch's
  ``stacklevel`` points) are ignored; a warning attributed to the user's code (their model's
  forward, a torch warning whose ``stacklevel`` points at their call) still shows.
- Log records at WARNING and ERROR from third-party loggers are dropped: torch's (the fake
  tensor mode logs a traceback before it raises the error graphmem reports in one line;
  ``register_constant`` deprecations from torchao's import), transformers', bitsandbytes' (a
  missing inference kernel on import), and torchtitan's, which logs on the root logger (told
  apart by the file that logged). DEBUG and INFO records pass: they are only made where the user
  turned them on (``TORCH_LOGS``, a logger's level); so do CRITICAL ones.

Everything is restored on exit (nested blocks are one block); nothing is changed at import.

Known limitations: output written to the process's file descriptor 2 by C++ code or a child
process bypasses Python and is not filtered (graphmem avoids the one it knows of, torchtitan's
``lspci`` call: graphmem/titan/capture.py). Log records are filtered where a logger hands them
to its handlers (``logging.Logger.callHandlers``, wrapped for the block), so handlers that
libraries create inside the block (transformers' on import) are covered as well.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import sys
import threading
import warnings
from typing import Callable, Iterator, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

# top-level packages whose warnings and logs are not about the user's step
THIRD_PARTY = ("torch", "torchtitan", "torchao", "transformers", "peft", "accelerate", "bitsandbytes",
               "huggingface_hub", "safetensors", "deepspeed", "torchvision", "timm", "datasets", "triton",
               "functorch", "sympy", "networkx", "tqdm", "graphmem")
_MODULES = re.compile("(" + "|".join(THIRD_PARTY) + r")(\.|$)")
_LOCK = threading.Lock()
_depth = 0
_call_handlers = logging.Logger.callHandlers


def _package_dirs() -> tuple[str, ...]:
    """The folders of the third-party packages that are imported (where a root-logger record's file lies)."""
    dirs = []
    for name in THIRD_PARTY:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(path) + os.sep)
    return tuple(dirs)


def is_noise(record: logging.LogRecord) -> bool:
    """A third-party WARNING or ERROR record (by its logger's name, lower-cased: DeepSpeed logs as
    "DeepSpeed", to stdout; or by the file that logged: the root logger's, torchtitan's)."""
    if not logging.WARNING <= record.levelno < logging.CRITICAL:
        return False
    if _MODULES.match(record.name.lower()):
        return True
    return record.pathname.startswith(_package_dirs())


def _filtered(self: logging.Logger, record: logging.LogRecord) -> None:
    if not is_noise(record):
        _call_handlers(self, record)


@contextlib.contextmanager
def quiet_third_party() -> Iterator[None]:
    """Third-party warnings and WARNING/ERROR log records silenced for the block (see the module)."""
    global _depth
    with _LOCK:
        _depth += 1
        if _depth == 1:
            logging.Logger.callHandlers = _filtered  # type: ignore[method-assign]
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=_MODULES.pattern)
            yield
    finally:
        with _LOCK:
            _depth -= 1
            if _depth == 0:
                logging.Logger.callHandlers = _call_handlers  # type: ignore[method-assign]


def quiet(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` run inside ``quiet_third_party()``: for the library's front doors."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        with quiet_third_party():
            return fn(*args, **kwargs)

    return wrapped


__all__ = ["quiet", "quiet_third_party", "is_noise", "THIRD_PARTY"]
