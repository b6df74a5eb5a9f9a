"""The CLI declares its option choices without importing torch (fast --help); they must be
the library's own, and options reach the library as the frozen objects it takes."""
from __future__ import annotations

import subprocess
import sys

from graphmem.capture import target
from graphmem.cli import options
from graphmem.cli.main import parser
from graphmem.step import options as table
from graphmem.training import optim


def test_choices_are_the_librarys() -> None:
    assert table.DTYPES == tuple(target.DTYPES)
    assert table.ATTENTION == target.ATTENTION
    assert table.MODES == target.MODES
    assert table.OPTIMIZERS == optim.NAMES  # torch.optim's, then bitsandbytes'
    assert table.IMPLS == optim.IMPLS


def test_the_option_table_is_the_library_keywords_and_the_cli_flags() -> None:
    """graphmem/step/options.py is the one table: each keyword is one make_spec takes (through the builder the table
    names), each flag is the parser's with the table's doc as its help, and no flag of the shared groups is declared
    outside it."""
    import dataclasses
    import inspect

    from graphmem.capture.hf import HFOptions
    from graphmem.frontends.door import TRAINER
    from graphmem.report.live import Analysis
    from graphmem.step.spec import PARALLEL_OPTIONS, TARGET_OPTIONS, make_parallelism, spec_keywords
    from graphmem.training.spec import make_training

    keywords = {o.name for o in table.OPTIONS if o.takes in (table.SPEC, table.TARGET, table.TRAINING, table.PARALLEL)}
    assert keywords <= spec_keywords()
    assert set(table.names(table.PLAN)) <= set(inspect.signature(Analysis.plans).parameters)  # (the questions')
    assert set(table.names(table.TRAINER)) - {"train_dataset"} <= TRAINER  # (train_dataset: the CLI's file)
    assert set(table.names(table.HF)) == {f.name for f in dataclasses.fields(HFOptions)}  # (make_spec's ``hf``)
    assert TARGET_OPTIONS == table.names(table.TARGET) == tuple(inspect.signature(target.make_target).parameters)
    assert set(PARALLEL_OPTIONS) == set(inspect.signature(make_parallelism).parameters) - {"training"}
    assert set(table.names(table.TRAINING)) == set(inspect.signature(make_training).parameters) - {"dtype"}
    analyze = parser()._subparsers._group_actions[0].choices["analyze"]  # type: ignore[union-attr]
    actions = {a.option_strings[0]: a for a in analyze._actions if a.option_strings}
    given = vars(analyze.parse_args(["gpt2", "--input-shape", "2x16"]))
    for o in table.OPTIONS:
        action = actions[o.cli_flag]
        assert action.help == o.help, o.name
        value = given[action.dest]  # the keyword's value when the flag is not given: the table's default
        assert (not value if o.negated and o.cli.get("action") == "store_true" else value) == table.default(o.name), o.name


def test_options_become_one_target_and_one_training_spec() -> None:
    args = parser().parse_args(["analyze", "gpt2", "--input-shape", "2x16", "--device", "cuda", "--amp", "bf16",
                                "--micro-batches", "4", "--optimizer", "adam"])
    t, tr = options.target_of(args), options.training_of(args)
    assert (t.device, t.amp, t.mode) == ("cuda", "bf16", "eager")
    assert tr.train.micro_batches == 4 and tr.train.optimizer == "adam"
    # frozen: built and checked once, passed whole
    import dataclasses

    assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert dataclasses.is_dataclass(tr) and tr.__dataclass_params__.frozen  # type: ignore[attr-defined]


def test_help_does_not_import_torch() -> None:
    code = ("import sys; from graphmem.cli.main import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_public_names_still_work() -> None:
    import torch

    import graphmem

    net = torch.nn.Linear(4, 3)
    g = graphmem.capture(net, (torch.randn(2, 4),))  # the capture function, as before the package existed
    assert isinstance(g, graphmem.StepGraph)
    assert graphmem.analyze(net, (torch.randn(2, 4),)).activation_bytes == 2 * 4 * 4  # the input, saved by addmm
    import importlib
    import sys

    import pytest

    # graphmem 0.1's names, which plan.code() printed then, deprecated in 0.2, are gone in 0.3: plans print
    # graphmem.planning, where the code lives
    for name in ("graphmem.checkpointing", "graphmem.selective"):
        sys.modules.pop(name, None)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(name)
    assert graphmem.__version__ == "0.3.0"
    import graphmem.planning

    assert callable(graphmem.planning.apply_segments) and graphmem.planning.OpPolicy is not None
