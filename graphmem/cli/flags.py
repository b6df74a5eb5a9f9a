"""The library's options and the command line's flags, in one table. Library errors name an
option as the API takes it, in backticks (```micro_batches=2```, ```qlora```); ``to_flags`` rewrites
each into the flag a command-line user types (``--micro-batches 2``, ``--qlora``) when
graphmem/cli/main.py prints the error."""
from __future__ import annotations

import re

# API option -> CLI flag (where the two names differ only by '_' vs '-', the flag is derived)
_RENAMED = {"qlora": "--qlora", "reuse": "--no-reuse", "reshard_after_forward": "--no-reshard-after-forward",
            "quantization": "--qlora", "ranks": "--ranks", "memory": "--memory"}
_NEGATED = {"reuse", "reshard_after_forward"}  # ``reuse=False`` is ``--no-reuse``
_BARE = {"fsdp": "fully_shard"}  # ``fsdp='fully_shard'`` is bare ``--fsdp``
_OPTION = re.compile(r"`([a-z_]+)(?:=([^`]*))?`")


def flag(name: str) -> str:
    """The command line's flag for API option ``name``."""
    return _RENAMED.get(name, "--" + name.replace("_", "-"))


def _one(m: re.Match[str]) -> str:
    name, value = m.group(1), m.group(2)
    if value is None:
        return flag(name)
    value = value.strip("'\"")
    if name in _NEGATED or value == "True" or _BARE.get(name) == value:
        return flag(name)
    return f"{flag(name)} {value}"


def to_flags(message: str) -> str:
    """``message`` with every option in backticks as the flag that sets it."""
    return _OPTION.sub(_one, message)
