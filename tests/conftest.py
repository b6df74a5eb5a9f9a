"""Shared test set-up: golden-file checks, and torch's process-wide settings kept as the session
found them. The ``slow`` marker is declared in pyproject.toml (CI runs slow tests too; ``-m "not
slow"`` skips them locally); the shared tiny models live in tests/cases.py.

Process-wide settings (the CPU thread count, which graphmem's CPU scratch rules read,
graphmem/oprules/registry.py; the default dtype; deterministic algorithms; grad mode) outlive the
test that changes them, and under ``-n 2`` which tests share a worker varies, so a leaked change
makes results depend on test order. Change them only inside ``torch_settings(...)`` (or the
``one_thread`` fixture); ``_settings_kept`` fails a test or fixture that leaves them changed.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
import torch

UPDATE_GOLDEN = os.environ.get("GRAPHMEM_UPDATE_GOLDEN") == "1"


def check_golden(text: str, path: Path) -> None:
    """``text`` must equal the golden file; ``GRAPHMEM_UPDATE_GOLDEN=1`` rewrites it (check the diff)."""
    if UPDATE_GOLDEN:
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; create it with GRAPHMEM_UPDATE_GOLDEN=1"
    assert text == path.read_text(encoding="utf-8"), f"output differs from {path}; GRAPHMEM_UPDATE_GOLDEN=1 if intended"


def _settings() -> dict[str, Any]:
    return {"num_threads": torch.get_num_threads(), "default_dtype": torch.get_default_dtype(),
            "deterministic": (torch.are_deterministic_algorithms_enabled(),
                              torch.is_deterministic_algorithms_warn_only_enabled()),
            "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
            "grad_enabled": torch.is_grad_enabled()}


def _restore(s: dict[str, Any]) -> None:
    torch.set_num_threads(s["num_threads"])
    torch.set_default_dtype(s["default_dtype"])
    torch.use_deterministic_algorithms(s["deterministic"][0], warn_only=s["deterministic"][1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = s["cudnn"]
    torch.set_grad_enabled(s["grad_enabled"])


SESSION_SETTINGS = _settings()  # as this process (xdist worker) started


@contextlib.contextmanager
def torch_settings(num_threads: Optional[int] = None, default_dtype: Optional[torch.dtype] = None,
                   deterministic: Optional[bool] = None) -> Iterator[None]:
    """Change torch's process-wide settings for a block; every one of them is restored on exit."""
    before = _settings()
    try:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if default_dtype is not None:
            torch.set_default_dtype(default_dtype)
        if deterministic is not None:
            torch.use_deterministic_algorithms(deterministic)
        yield
    finally:
        _restore(before)


@pytest.fixture
def threads() -> Iterator[None]:
    """The test sets the thread count itself (the scratch rules' per-thread buffers); restored after."""
    with torch_settings():
        yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The test runs with one CPU thread, as each real gloo rank does (tests/dist_truth.py)."""
    with torch_settings(num_threads=1):
        yield


def _changed(now: dict[str, Any]) -> str:
    return ", ".join(f"{k} {SESSION_SETTINGS[k]} -> {v}" for k, v in now.items() if v != SESSION_SETTINGS[k])


@pytest.fixture(autouse=True)
def _settings_kept(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the test whose fixtures (set up before this one: wider scopes first) or body leave
    torch's settings changed, restores them, so the tests after it run as the session started."""
    now = _settings()
    if now != SESSION_SETTINGS:
        _restore(SESSION_SETTINGS)
        pytest.fail(f"a fixture of {request.node.nodeid} left torch's settings changed ({_changed(now)}); "
                    "change them inside tests/conftest.py's torch_settings(...) or the one_thread fixture")
    yield
    now = _settings()
    if now != SESSION_SETTINGS:
        _restore(SESSION_SETTINGS)
        pytest.fail(f"{request.node.nodeid} left torch's settings changed ({_changed(now)}); change them "
                    "inside tests/conftest.py's torch_settings(...) or the one_thread fixture")


# Tests that compare graphmem's oneDNN rules (graphmem/oprules/: convolution, LSTM, CPU flash-attention
# and bf16 GEMM scratch) with the real kernels of THIS machine. The rules were derived from, and are
# checked against, oneDNN's AVX-512 kernels; an AVX2-only CPU runs other kernels with other scratch
# (all of these failed on an AVX2 host while passing on AVX-512 ones, at the same commit). There they
# are skipped, with this reason, rather than compared with kernels the rules do not describe.
AVX512_KERNELS = (
    "tests/test_workspace.py::test_onednn_lstm_workspace_equals_real_kernel",
    "tests/test_workspace.py::test_flash_attention_cpu_scratch",
    "tests/test_workspace_conv.py::test_depthwise_channels_last_scratch_equals_real_kernel",
    "tests/test_workspace_conv.py::test_depthwise_models_peak_equals_real_step",
    "tests/test_workspace_conv_dw.py::test_plain_depthwise_1d_backward_equals_real_kernel",
    "tests/test_workspace_conv_dw.py::test_plain_depthwise_backward_equals_real_kernel",
    "tests/test_workspace_conv_dw.py::test_plain_depthwise_models_peak_equals_real_step[timm_test_efficientnet]",
    "tests/test_workspace_conv_gemm.py::test_gemm_convolution_backward_equals_real_kernel",
    "tests/test_workspace_conv_jit.py::test_patch_embedding_weight_grad_equals_real_kernel",
    "tests/test_compiled_rules.py::test_compiled_peak_equals_real_compiled_step[timm_convnext_atto]",
    "tests/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[timm_resnet18]",
    "tests/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[torchvision_resnet18]",
    "tests/test_zoo_accuracy.py::test_zoo_saved_exact_and_peak_within_named_tolerance[timm_convnext_atto]",
    "tests/test_zoo_plans.py::test_a_plan_holds_on_a_real_step[convnext]",
    "tests/test_checkpoint_plans.py::test_autocast_plans_match_real_cpu_autocast_runs",
    "tests/test_hf_trainer.py::test_gpt2_bf16_with_gradient_checkpointing_later_steps",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    isa = torch.backends.cpu.get_cpu_capability()
    if isa.startswith("AVX512"):
        return
    skip = pytest.mark.skip(reason=f"compares oneDNN rules derived for AVX-512 kernels with this {isa} CPU's kernels")
    for item in items:
        if item.nodeid.startswith(AVX512_KERNELS):
            item.add_marker(skip)
