"""A tiny progress bar for long library work (several captures, a search over plans).

It draws on stderr only when stderr is a terminal and the CLI is not printing JSON; anywhere
else (pipes, files, CI logs, pytest, JSON mode) it is silent, so it never mixes into output
that a program reads. Library code may use it freely: it is not output, and it leaves nothing
behind (the line is cleared when the work ends).

    from graphmem.progress import progress, Progress

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
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterable, Iterator, Optional, TextIO, TypeVar

T = TypeVar("T")
_QUIET: ContextVar[bool] = ContextVar("graphmem_progress_quiet", default=False)
WIDTH = 24  # characters of the bar itself


@contextmanager
def quiet(on: bool = True) -> Iterator[None]:
    """No progress bars inside this block (when ``on``): the CLI's JSON mode."""
    token = _QUIET.set(on or _QUIET.get())
    try:
        yield
    finally:
        _QUIET.reset(token)


class Progress:
    """``[#########...............]  3/8  fitting`` on one stderr line, redrawn in place."""

    def __init__(self, total: Optional[int] = None, desc: str = "", stream: Optional[TextIO] = None,
                 min_interval: float = 0.1) -> None:
        self.total, self.desc, self.done = total, desc, 0
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval  # seconds between redraws (the last step always draws)
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = not _QUIET.get() and callable(isatty) and bool(isatty())
        self._last_draw = float("-inf")
        self._width = 0  # of the last line drawn, to clear it

    def __enter__(self) -> "Progress":
        self._draw(force=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, n: int = 1) -> None:
        self.done += n
        self._draw(force=self.total is not None and self.done >= self.total)

    def close(self) -> None:
        """Clear the bar's line (a no-op when disabled or already closed)."""
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
        self._width = 0

    def line(self) -> str:
        if self.total:
            filled = min(WIDTH, WIDTH * self.done // self.total)
            text = f"[{'#' * filled}{'.' * (WIDTH - filled)}] {self.done}/{self.total}"
        else:
            text = f"[{self.done}]"
        return f"{text}  {self.desc}" if self.desc else text

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        text = self.line()
        self.stream.write("\r" + text + " " * max(0, self._width - len(text)))
        self.stream.flush()
        self._width = max(self._width, len(text))


def progress(iterable: Iterable[T], total: Optional[int] = None, desc: str = "",
             stream: Optional[TextIO] = None, min_interval: float = 0.1) -> Iterator[T]:
    """Yield from ``iterable`` while drawing a bar (see the module docstring)."""
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    with Progress(total, desc, stream, min_interval) as bar:
        for item in iterable:
            yield item
            bar.update()
