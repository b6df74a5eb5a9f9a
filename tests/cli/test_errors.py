"""Bad input gets ONE line on stderr, no traceback, and the right exit code.

Exit codes (graphmem/errors.py): 2 = usage errors (the command line or the model file is
wrong), 1 = the analysis failed (the model cannot run on fake tensors). The library raises
GraphmemError subclasses; only the CLI turns them into a stderr line.

The bad model files live in tests/badmodels/.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch.nn as nn
from paths import TESTS

import graphmem
from graphmem import cli
from graphmem.errors import (
    CaptureError,
    DataDependentError,
    GraphmemError,
    ModelLoadError,
    UnsupportedOpError,
    UsageError,
)

BAD = TESTS / "badmodels"


def bad(name: str) -> str:
    return str(BAD / f"{name}.py")


def run_cli(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, out: str) -> str:
    """stderr is exactly one non-empty line starting with 'graphmem: error:'; stdout is empty."""
    assert out == ""
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("graphmem: error: "), err
    return lines[0]


def import_file(name: str) -> ModuleType:
    """Import tests/badmodels/<name>.py as a fresh module (real CPU tensors)."""
    spec = importlib.util.spec_from_file_location(f"graphmem_test_bad_{name}", BAD / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# -- usage errors: exit 2 ---------------------------------------------------------------------

@pytest.mark.parametrize("shape", ["32x", "0x5", "abc", "-1x5", "32x1024x"])
def test_malformed_input_shape_exits_2_naming_the_value_and_an_example(
        capsys: pytest.CaptureFixture[str], shape: str) -> None:
    # GIVEN a valid preset and a malformed shape (the `=` form, so argparse hands it over as is)
    # WHEN the CLI runs
    code, out, err = run_cli(capsys, ["analyze", "mlp-mnist", f"--input-shape={shape}"])
    # THEN one line, exit 2, naming the bad value and showing the expected form
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "invalid input shape" in line
    assert repr(shape) in line
    assert "32x1024" in line


def test_negative_input_shape_given_as_separate_argument_names_the_value(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", "mlp-mnist", "--input-shape", "-1x5"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "-1x5" in line and "32x1024" in line


@pytest.mark.parametrize("shape", ["32x", "0x5", "abc", "32x1024x"])
def test_malformed_input_shape_as_separate_argument(capsys: pytest.CaptureFixture[str], shape: str) -> None:
    code, out, err = run_cli(capsys, ["analyze", "mlp-mnist", "--input-shape", shape])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert repr(shape) in line and "32x1024" in line


def test_missing_input_shape_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", "mlp-mnist"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "--input-shape" in line and "required" in line
    assert "--help" in line  # what to do


def test_missing_model_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "no_such_model.py"
    code, out, err = run_cli(capsys, ["analyze", str(path), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "not found" in line and str(path) in line
    assert "check the path" in line


def test_model_file_without_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("no_model"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "defines no `model`" in line
    assert "add `model = " in line  # what to do


def test_model_file_whose_import_raises_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("import_raises"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "importing" in line and "failed" in line
    assert "RuntimeError: boom while building the model" in line  # the original cause
    assert "fix the file" in line


def test_unknown_preset_exits_2_listing_presets(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", "gpt5-ultra", "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert "'gpt5-ultra' is neither a model file nor a preset" in line
    assert "gpt2" in line and "mlp-mnist" in line  # the known names, so the user can pick one


# -- analysis errors: exit 1 ------------------------------------------------------------------

def test_forward_that_raises_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("forward_raises"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 1
    assert "BadView.forward raised RuntimeError" in line
    assert "shape '[-1, 3]' is invalid" in line  # torch's own reason, first line only
    assert "check that the input shape fits the model" in line


def test_item_in_forward_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("item"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 1
    assert "reads tensor values" in line
    assert ".item()" in line and "shape-based code" in line  # what to do


def test_nonzero_indexing_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("nonzero"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 1
    assert "aten.nonzero" in line and "depends on tensor values" in line
    assert "torch.where" in line  # what to do


def test_custom_op_without_fake_impl_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, ["analyze", bad("custom_op"), "--input-shape", "2x4"])
    line = assert_one_line_error(err, out)
    assert code == 1
    assert "custom op graphmem_badop_" in line and "::double" in line
    assert "no fake-tensor implementation" in line
    assert "register_fake" in line  # what to do


# -- --debug re-raises ------------------------------------------------------------------------

def test_debug_reraises_the_graphmem_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(DataDependentError, match="reads tensor values"):
        cli.main(["analyze", bad("item"), "--input-shape", "2x4", "--debug"])
    out, err = capsys.readouterr()
    assert out == "" and err == ""  # nothing printed: the exception carries the message


def test_debug_reraises_usage_errors_too() -> None:
    with pytest.raises(UsageError, match="invalid input shape"):
        cli.main(["analyze", "mlp-mnist", "--input-shape", "32x", "--debug"])


# -- the real console script ------------------------------------------------------------------

def test_console_script_exit_code_and_single_stderr_line() -> None:
    script = Path(sys.executable).parent / "graphmem"
    exe = str(script) if script.exists() else shutil.which("graphmem")
    assert exe, "the graphmem console script is not installed (pip install -e .)"
    proc = subprocess.run([exe, "analyze", bad("item"), "--input-shape", "2x4"],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    # torch can print a UserWarning (e.g. "Failed to initialize NumPy") when a dependency is
    # missing; that is torch's noise, not graphmem's output, so such lines are not counted.
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "Warning" not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("graphmem: error:")
    assert "reads tensor values" in lines[0]


# -- the library raises GraphmemError subclasses directly --------------------------------------

@pytest.mark.parametrize("name, error, phrase", [
    ("item", DataDependentError, "reads tensor values"),
    ("nonzero", DataDependentError, "depends on tensor values"),
    ("custom_op", UnsupportedOpError, "no fake-tensor implementation"),
    ("forward_raises", CaptureError, "BadView.forward raised RuntimeError"),
])
def test_library_raises_capture_errors_for_real_modules(name: str, error: type[GraphmemError], phrase: str) -> None:
    # GIVEN a real CPU nn.Module (not a file) that cannot run on fake tensors
    module = import_file(name).model
    assert isinstance(module, nn.Module)
    # WHEN/THEN analyze raises the specific GraphmemError subclass, with exit code 1 semantics
    with pytest.raises(error, match=phrase) as info:
        graphmem.analyze(module, input_shape=(2, 4))
    assert info.value.exit_code == 1
    assert isinstance(info.value, CaptureError)


def test_library_forward_error_is_a_plain_capture_error() -> None:
    with pytest.raises(CaptureError) as info:
        graphmem.analyze(import_file("forward_raises").model, input_shape=(2, 4))
    assert not isinstance(info.value, (DataDependentError, UnsupportedOpError))
    assert isinstance(info.value.__cause__, RuntimeError)  # the original error is chained


@pytest.mark.parametrize("name, phrase", [
    ("no_model", "defines no `model`"),
    ("import_raises", "importing .* failed"),
])
def test_library_raises_model_load_error_for_bad_files(name: str, phrase: str) -> None:
    with pytest.raises(ModelLoadError, match=phrase) as info:
        graphmem.analyze(bad(name), input_shape=(2, 4))
    assert info.value.exit_code == 2


@pytest.mark.parametrize("kwargs, phrase", [
    (dict(input_shape="32x"), "invalid input shape"),
    (dict(input_shape=(0, 5)), "invalid input shape"),
    (dict(input_shape=(2.0, 4)), "invalid input shape"),
    (dict(), "no inputs"),
])
def test_library_raises_usage_error_for_bad_shapes(kwargs: dict, phrase: str) -> None:
    with pytest.raises(UsageError, match=phrase) as info:
        graphmem.analyze(nn.Linear(4, 4), **kwargs)
    assert info.value.exit_code == 2


def test_library_usage_errors_for_bad_model_arguments(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="neither a model file nor a preset"):
        graphmem.analyze("gpt5-ultra", input_shape=(2, 4))
    with pytest.raises(UsageError, match="not found"):
        graphmem.analyze(tmp_path / "missing.py", input_shape=(2, 4))
    with pytest.raises(UsageError, match="must be an nn.Module"):
        graphmem.analyze(42, input_shape=(2, 4))  # type: ignore[arg-type]


def test_parse_shape_is_public_and_raises_usage_error() -> None:
    assert graphmem.parse_shape("32x1024") == (32, 1024)
    assert graphmem.parse_shape(" 8X3x224x224 ") == (8, 3, 224, 224)
    for text in ["32x", "0x5", "abc", "-1x5", "32x1024x", ""]:
        with pytest.raises(UsageError, match="32x1024"):
            graphmem.parse_shape(text)


# -- issue 36: config files, memory sizes, keywords, the distributed traceback prefix -----------

def test_nonsense_config_json_names_the_field_and_the_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text('{"model_type": "llama", "hidden_size": "abc"}')
    code, out, err = run_cli(capsys, ["analyze", str(path), "--input-shape", "2x16"])
    line = assert_one_line_error(err, out)
    assert code == 2
    assert str(path) in line and "'hidden_size'" in line and "expected int, got str" in line
    assert "fix the config.json" in line and "internal error" not in line
    with pytest.raises(ModelLoadError, match="hidden_size.*expected int"):
        graphmem.analyze(str(path), input_shape=(2, 16))


def test_config_json_that_fails_a_class_check_is_a_usage_error(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 30, "num_attention_heads": 4}')
    with pytest.raises(ModelLoadError, match="not a valid llama config .*not a multiple of the number of attention heads"):
        graphmem.analyze(str(tmp_path), input_shape=(2, 16))


@pytest.mark.slow
def test_shape_mismatch_prints_graphmem_line_only() -> None:
    """torch's fake tensor mode logs the meta kernel's traceback (17 lines) before it raises; only
    graphmem's line reaches stderr (a real process: torch's log handler holds the real stderr)."""
    code = ("import sys, torch.nn as nn\nfrom graphmem.cli.main import main\n"
            f"sys.exit(main(['analyze', {bad('mismatch')!r}, '--input-shape', '2x4']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("graphmem: error: Sequential.forward raised RuntimeError: a and b must have same "
                               "reduction dim")


@pytest.mark.parametrize("argv, phrase", [
    (["fit", "gpt2", "--memory", "24", "--seq", "128"], "invalid memory size '24': no unit; write 24GB or 24GiB"),
    (["fit", "gpt2", "--memory", "-5GB", "--seq", "128"], "invalid memory size '-5GB': it must be positive"),
    (["advise", "gpt2", "--input-shape", "1x16", "--memory", "-5GB"], "invalid memory size '-5GB': it must be positive"),
    (["advise", "gpt2", "--input-shape", "1x16", "--memory", "-5"], "invalid memory size '-5': it must be positive"),
    (["analyze", "gpt2", "--input-shape", "1x16", "--plan", "--budget", "12"], "invalid memory size '12': no unit"),
])
def test_memory_sizes_need_a_unit_and_a_positive_value(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                       phrase: str) -> None:
    code, out, err = run_cli(capsys, argv)
    line = assert_one_line_error(err, out)
    assert code == 2 and phrase in line
    assert "expected one argument" not in line
    if "no unit" in line:
        assert "KiB" in line and "GB" in line  # the units named


def test_parse_bytes_refuses_a_bare_number_but_takes_an_int() -> None:
    from graphmem.units import parse_bytes

    with pytest.raises(UsageError, match="no unit"):
        parse_bytes("24")
    assert parse_bytes("24B") == 24 and parse_bytes(24) == 24 and parse_bytes("1.5 GiB") == 3 * 2**29


@pytest.mark.parametrize("call", ["analyze", "validate", "make_spec"])
def test_unknown_keyword_names_the_close_match(call: str) -> None:
    with pytest.raises(UsageError, match=rf"graphmem\.{call}\(\) got an unknown keyword: `optimiser` \(did you "
                                         r"mean `optimizer`") as info:
        getattr(graphmem, call)(nn.Linear(4, 4), input_shape=(2, 4), optimiser="adamw")
    assert info.value.exit_code == 2


def test_unknown_keywords_without_a_close_match_point_to_help() -> None:
    with pytest.raises(UsageError, match=r"unknown keywords: `tolerence` \(did you mean `tolerance`\?\), `zzz`; "
                                         r"see help\(graphmem.validate\)"):
        graphmem.validate(nn.Linear(4, 4), input_shape=(2, 4), tolerence=2, zzz=1)


def test_fake_process_groups_leave_the_traceback_hook_as_it_was() -> None:
    """init_process_group wraps sys.excepthook to prefix every traceback line with [rank0]: and
    destroy_process_group leaves it: each fake group graphmem opened added one prefix."""
    from graphmem.fake_group import fake_group

    hook = sys.excepthook
    for _ in range(2):
        with fake_group(0, 2):
            assert sys.excepthook is not hook  # torch's wrapper, while the group is up
    assert sys.excepthook is hook
