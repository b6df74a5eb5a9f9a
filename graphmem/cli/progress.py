"""A progress bar (tqdm) for long library work (several captures, a search over plans).

It draws on stderr only when stderr is a terminal and the CLI is not printing JSON; anywhere
else (pipes, files, CI logs, pytest, JSON mode) it is silent, so it never mixes into output
that a program reads. The bar's line is cleared when the work ends.

    from graphmem.cli.progress import progress, Progress

    for shape in progress(shapes, desc="fitting"):       # wraps an iterable (len() used if it has one)
        ...
    with Progress(total=len(plans), desc="plans") as bar:  # or drive it by hand
        for plan in plans:
            ...
            bar.update()                                   # one step (bar.update(n) for n)

    with quiet():                                          # the CLI, around work whose output is JSON
        report = analyze(...)
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

from tqdm import tqdm

T = TypeVar("T")
_QUIET: ContextVar[bool] = ContextVar("graphmem_progress_quiet", default=False)


@contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No progress bars inside this block (when ``on``): the CLI's JSON mode."""
    token = _QUIET.set(on or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


class Progress:
    """A tqdm bar on ``stream`` (default stderr), on only for a terminal outside ``quiet()``."""

    def __init__(self, total: Optional[int] = None, desc: str = "", stream: Optional[TextIO] = None,
                 min_interval: float = 0.1) -> None:
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not _QUIET.get() and callable(isatty) and bool(isatty())
        self.done = 0
        self._bar = tqdm(total=total, desc=desc, file=self.stream, disable=not self.enabled, leave=False,
                         mininterval=min_interval, dynamic_ncols=True)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._bar.update(n)

    def close(self) -> None:
        """Clear the bar's line (a no-op when disabled or already closed)."""
        self._bar.close()


def progress(iterable: Iterable[T], total: Optional[int] = None, desc: str = "",
             stream: Optional[TextIO] = None, min_interval: float = 0.1) -> Iterator[T]:
    """Yield from ``iterable`` while drawing a bar (see the module docstring)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, desc, stream, min_interval) as bar:
        for item in iterable:
            yield item
            bar.update()
