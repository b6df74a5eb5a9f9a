"""Third-party noise (graphmem/noise.py): what torch, transformers, torchtitan and bitsandbytes warn
and log about graphmem's own work is silenced at the front doors, for the duration only; a
warning about the user's own code still shows. The plain runs below, each in its own process
(torch's log handler writes to the real stderr), print nothing on stderr."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from paths import ROOT

from graphmem.noise import quiet_third_party


def _record(name: str, level: int, pathname: str = __file__) -> logging.LogRecord:
    return logging.LogRecord(name, level, pathname, 1, "a note", None, None)


def test_third_party_log_records_are_dropped_inside_the_block_only(caplog: pytest.LogCaptureFixture) -> None:
    # GIVEN bitsandbytes' CPU backend logger, which warns on import on AVX-512-BF16 machines
    log = logging.getLogger("bitsandbytes.backends.cpu.ops")
    # WHEN it warns inside and outside the block
    with caplog.at_level(logging.WARNING):
        with quiet_third_party():
            log.warning("Failed to load CPU gemm_4bit_forward from kernels-community")
            logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta")
            logging.getLogger("user.code").warning("the user's own note")
        log.warning("after the block")
    # THEN only the user's note and the one after the block reach the handlers
    assert [r.getMessage() for r in caplog.records] == ["the user's own note", "after the block"]


def test_torchtitans_root_logger_records_are_told_apart_by_file() -> None:
    # torchtitan logs on the root logger (torchtitan/tools/logging.py: logging.getLogger())
    import graphmem.noise as noise

    titan = pytest.importorskip("torchtitan")
    inside = os.path.join(os.path.dirname(titan.__file__), "tools", "utils.py")
    assert noise.is_noise(_record("root", logging.WARNING, inside))
    assert not noise.is_noise(_record("root", logging.WARNING, "/home/user/train.py"))
    assert not noise.is_noise(_record("root", logging.INFO, inside))  # only made where the user asked for them
    assert not noise.is_noise(_record("torch", logging.CRITICAL))


def test_deepspeeds_logger_is_told_apart_by_its_name_or_its_file() -> None:
    # DeepSpeed logs as "DeepSpeed" to stdout (deepspeed/utils/logging.py): its "Setting accelerator to CPU"
    # warning, on the first get_accelerator() (transformers and accelerate import deepspeed where it is
    # installed), once broke the JSON that `graphmem validate --json` printed
    import graphmem.noise as noise

    assert noise.is_noise(_record("DeepSpeed", logging.WARNING, "/site-packages/deepspeed/accelerator/x.py"))
    deepspeed = pytest.importorskip("deepspeed")
    inside = os.path.join(os.path.dirname(deepspeed.__file__), "accelerator", "real_accelerator.py")
    assert noise.is_noise(_record("ds_logger", logging.WARNING, inside))
    assert not noise.is_noise(_record("user.code", logging.WARNING, "/home/user/train.py"))


def test_warnings_from_libraries_are_silenced_and_the_users_kept() -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with quiet_third_party():
            exec(compile("import warnings; warnings.warn('library note')", "lib.py", "exec"),
                 {"__name__": "torch.distributed.tensor._random"})
            warnings.warn("the user's own warning", stacklevel=1)  # attributed to this test module
        exec(compile("import warnings; warnings.warn('after')", "lib.py", "exec"), {"__name__": "torch.x"})
    assert [str(w.message) for w in seen] == ["the user's own warning", "after"]


def test_the_block_restores_logging_and_nests() -> None:
    before = logging.Logger.callHandlers
    with quiet_third_party():
        with quiet_third_party():
            pass
        assert logging.Logger.callHandlers is not before  # still inside the outer block
    assert logging.Logger.callHandlers is before


def _stderr_of(*argv: str) -> str:
    script = Path(sys.executable).parent / "graphmem"
    proc = subprocess.run([str(script), *argv], capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("graphmem ·")
    return proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("argv", [
    ("analyze", "models/gpt2.py", "--input-shape", "2x16"),
    ("analyze", "models/gpt2.py", "--input-shape", "2x16", "--fsdp", "--world-size", "2"),
    ("analyze", "hf-gpt2", "--input-shape", "1x16"),  # transformers' import: torchao's register_constant notes
], ids=["plain", "fsdp", "hf"])
def test_plain_runs_print_nothing_on_stderr(argv: tuple[str, ...]) -> None:
    if argv[1] == "hf-gpt2":
        pytest.importorskip("transformers")
    assert _stderr_of(*argv) == ""


@pytest.mark.slow
def test_a_torchtitan_run_prints_nothing_on_stderr() -> None:
    """torchtitan's lspci call, its peak-FLOPs and checkpoint notes (root logger), DTensor's CPU-mesh
    notes and dynamo's saved-tensors-hooks FutureWarning: none reaches stderr."""
    pytest.importorskip("torchtitan")
    assert _stderr_of("analyze", "--torchtitan", "llama3_debugmodel", "--world-size", "2", "--device", "cpu", "--sdpa",
                      "--", "--training.local_batch_size", "2", "--training.seq_len", "64",
                      "--parallelism.data_parallel_shard_degree", "2") == ""
