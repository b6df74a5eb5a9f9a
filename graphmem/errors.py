"""Errors graphmem raises. Each message says what went wrong and what to do.

Only the CLI turns these into a stderr line and an exit code: ``UsageError`` → 2 (the
command line or model file is wrong), every other ``GraphmemError`` → 1 (the analysis failed).
"""
from __future__ import annotations

import difflib
from typing import Iterable


def one_line(e: BaseException) -> str:
    """``e``'s message as one line: its first line, and while that line ends in ":" (a heading whose
    reason follows, as huggingface_hub's validation errors), the next ones joined to it."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text += " " + line
    return text


def check_keywords(given: Iterable[str], accepted: Iterable[str], call: str) -> None:
    """Raise a UsageError naming each keyword of ``given`` that ``accepted`` lacks, with the accepted
    ones closest to it (difflib). ``call``: the function, e.g. "graphmem.analyze"."""
    known = sorted(set(accepted))
    unknown = [k for k in given if k not in known]
    if not unknown:
        return
    parts, hinted = [], False
    for k in unknown:
        near = difflib.get_close_matches(k, known, n=3, cutoff=0.6)
        hinted = hinted or bool(near)
        parts.append(f"`{k}`" + (f" (did you mean {' or '.join(f'`{m}`' for m in near)}?)" if near else ""))
    tail = "" if hinted and len(unknown) == 1 else f"; see help({call}) for the keywords it takes"
    raise UsageError(f"{call}() got an unknown keyword{'s' if len(unknown) > 1 else ''}: {', '.join(parts)}{tail}")


class GraphmemError(Exception):
    """Base class: a one-line message naming the fix."""

    exit_code = 1


class UsageError(GraphmemError):
    """Bad input from the user: a malformed shape, a missing file, a file without a model."""

    exit_code = 2


def no_source(scope: object = None) -> UsageError:
    """Why a report cannot be captured again (plans, formulas, budget sweeps, advice): it was built
    by hand, or it is one rank's step (``scope``: its ``Report.sharding``, whose ``describe()`` names it)."""
    describe = getattr(scope, "describe", None)
    if describe is None:
        return UsageError("this report has no model to capture again (built by hand)")
    return UsageError(f"this report is {describe()}: plans, formulas, budget sweeps and advice capture the "
                      "single-device step again, so analyze without `rank`/`fsdp`/`tp`/`pp` for them "
                      "(`zero`, `fsdp='full'` and `tp` without `rank` give the per-rank formulas)")


class ModelLoadError(UsageError):
    """The model file or preset could not be turned into an nn.Module."""


class CaptureError(GraphmemError):
    """The training step could not be run on fake tensors."""


class DataDependentError(CaptureError):
    """The model needs real tensor values (``.item()``, ``nonzero`` used for indexing, ...)."""


class UnsupportedOpError(CaptureError):
    """An operator has no fake/meta implementation."""


class PassError(GraphmemError):
    """A pass found the StepGraph inconsistent; names the pass and the node."""
