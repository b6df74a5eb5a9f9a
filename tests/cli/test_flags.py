"""Library errors name options as the API takes them, in backticks; the CLI prints each as the flag
that sets it (graphmem/cli/flags.py), so one message serves both."""
from __future__ import annotations

import pytest

from graphmem.cli.flags import flag, to_flags


@pytest.mark.parametrize("api, cli", [
    ("add `micro_batches=2` (or more)", "add --micro-batches 2 (or more)"),
    ("use `mode='eager'`", "use --mode eager"),
    ("drop `qlora`", "drop --qlora"),
    ("`fsdp='full'` is the formula", "--fsdp full is the formula"),
    ("add `fsdp`", "add --fsdp"),
    ("add `fsdp='fully_shard'`", "add --fsdp"),
    ("`reuse=False` captures every block", "--no-reuse captures every block"),
    ("`reshard_after_forward=False`", "--no-reshard-after-forward"),
    ("`loss_parallel=True` needs `tp=2`", "--loss-parallel needs --tp 2"),
    ("`input_shape='32x1024'`", "--input-shape 32x1024"),
    ("no option here: `x + y`", "no option here: `x + y`"),
    ("defines no `model`; add `model = MyModel(...)`", "defines no `model`; add `model = MyModel(...)`"),
])
def test_options_become_flags(api: str, cli: str) -> None:
    assert to_flags(api) == cli


def test_every_flag_of_the_cli_is_named_by_its_api_option() -> None:
    from graphmem.cli.main import parser

    flags = {o for a in parser()._subparsers._group_actions[0].choices.values()  # type: ignore[union-attr]
             for action in a._actions for o in action.option_strings if o.startswith("--")}
    for api in ("micro_batches", "world_size", "fsdp_param_dtype", "optimizer_impl", "lora_targets", "memory_budget",
                "qlora", "reuse", "reshard_after_forward", "loss_parallel", "decoder_length", "trust_remote_code"):
        assert flag(api) in flags, api
