"""The library's options and the command line's flags, in one table. Library errors name an
option as the API takes it, in backticks (```micro_batches=2```, ```qlora```); ``to_flags`` rewrites
each into the flag a command-line user types (``--micro-batches 2``, ``--qlora``) when
graphmem/cli/main.py prints the error."""
from __future__ import annotations

import re

# API option -> CLI flag (where the two names differ only by '_' vs '-', the flag is derived)
_RENAMED = {"reuse": "--no-reuse", "reshard_after_forward": "--no-reshard-after-forward", "quantization": "--qlora",
            "clip_foreach": "--no-clip-foreach"}
_NEGATED = {"reuse", "reshard_after_forward", "clip_foreach"}  # ``reuse=False`` is ``--no-reuse``
_BARE = {"fsdp": "fully_shard"}  # ``fsdp='fully_shard'`` is bare ``--fsdp``
_OPTION = re.compile(r"`([a-z_]+)(?:=([^`]*))?`")
# the API's option names (``graphmem.analyze``'s keywords and the commands' own); any other name in
# backticks is code (```model```, ```loss(output, inputs)```) and stays as it is
OPTIONS = frozenset({
    "input_shape", "device", "dtype", "amp", "attention", "gpu", "mode", "memory_budget", "reuse", "optimizer",
    "optimizer_impl", "master_weights", "micro_batches", "lora_rank", "lora_targets", "lora_alpha", "qlora",
    "quantization", "world_size", "zero", "fsdp", "tp", "sp", "pp", "schedule", "rank", "reshard_after_forward",
    "fsdp_param_dtype", "fsdp_reduce_dtype", "fsdp_offload", "fsdp_no_sync", "loss_parallel", "decoder_length",
    "config", "trust_remote_code", "budget", "max_overhead", "selective", "points", "tolerance", "ranks", "memory",
    "seq", "batch", "debug", "json", "plan", "formula", "release_output", "clip_grad_norm", "clip_foreach",
    "optimizer_in_backward", "offload_activations", "training_args", "deepspeed", "padding", "use_cache", "d_model", "n_heads",
    "train_dataset", "trainer_batch",
})


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
