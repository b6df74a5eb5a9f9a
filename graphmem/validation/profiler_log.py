"""kineto (torch.profiler's C++ side) writes its own log lines to stderr whatever KINETO_LOG_LEVEL
says; the CLI promises one stderr line on failure, so the real runs under the profiler drop them."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from typing import Iterator

# kineto (torch.profiler's C++ side) logs "USDT:2026-01-01 12:00:00 123:123 File.cpp:39] profiler_start"
# lines to file descriptor 2 whatever KINETO_LOG_LEVEL says.
_KINETO_LINE = re.compile(rb"^[A-Z]+:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \S+:\d+\] ")


@contextlib.contextmanager
def without_profiler_log() -> Iterator[None]:
    """Drop kineto's log lines from stderr (the CLI promises one stderr line on failure); every
    other line written to stderr meanwhile (warnings) is passed on afterwards."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            rest = b"".join(line for line in tmp.read().splitlines(keepends=True) if not _KINETO_LINE.match(line))
            if rest:
                sys.stderr.write(rest.decode(errors="replace"))


