"""The library's options and the command line's flags, in one table. Library errors name an
option as the API takes it, in backticks (```micro_batches=2```, ```qlora```); ``to_flags`` rewrites
each into the flag a command-line user types (``--micro-batches 2``, ``--qlora``) when
graphmem/cli/main.py prints the error."""
from __future__ import annotations

import re

from graphmem.step.options import OPTIONS as STEP_OPTIONS

# the step options' flags from their table (graphmem/step/options.py): a flag other than the name with dashes, a flag
# that sets the keyword False (``reuse=False`` is ``--no-reuse``), a bare flag's value (``fsdp='fully_shard'``)
_RENAMED = {o.name: o.flag for o in STEP_OPTIONS if o.flag}
_NEGATED = {o.name for o in STEP_OPTIONS if o.negated}
_BARE = {o.name: o.bare for o in STEP_OPTIONS if o.bare}
_OPTION = re.compile(r"`([a-z_]+)(?:=([^`]*))?`")
# the API's option names (the step's, and the commands' own: ``graphmem.analyze``'s and the questions'); any other
# name in backticks is code (```model```, ```loss(output, inputs)```) and stays as it is
OPTIONS = frozenset({o.name for o in STEP_OPTIONS} | {
    "input_shape", "qlora", "tolerance", "ranks", "memory", "seq", "batch", "debug", "json", "plan", "formula",
    "training_args", "d_model", "n_heads"})


def flag(name: str) -> str:
    """The command line's flag for API option ``name``."""
    return _RENAMED.get(name, "--" + name.replace("_", "-"))


def _one(m: re.Match[str]) -> str:
    name, value = m.group(1), m.group(2)
    if name not in OPTIONS:
        return m.group(0)
    if value is None:
        return flag(name)
    value = value.strip("'\"")
    if name in _NEGATED or value == "True" or _BARE.get(name) == value:
        return flag(name)
    return f"{flag(name)} {value}"


def to_flags(message: str) -> str:
    """``message`` with every option in backticks as the flag that sets it."""
    return _OPTION.sub(_one, message)
