"""tests/conftest.py's guard on torch's process-wide settings: a test or fixture that leaves the
thread count (or the default dtype) changed fails, and the tests after it run as the session
started; changes made through ``torch_settings`` / ``one_thread`` are restored and pass."""
from __future__ import annotations

import pytest
import torch
from paths import TESTS

pytest_plugins = ["pytester"]

HERE = TESTS


def test_leaked_thread_count_fails_the_test_that_leaked_it(pytester: pytest.Pytester) -> None:
    pytester.makeconftest((HERE / "conftest.py").read_text(encoding="utf-8"))
    n = torch.get_num_threads() + 1
    pytester.makepyfile(test_inner=f"""
import pytest
import torch
from conftest import torch_settings

@pytest.fixture(scope="module")
def leaky():
    torch.set_num_threads({n})  # never restored

def test_body_leaks():
    torch.set_num_threads({n})

def test_after_runs_as_the_session_started():
    assert torch.get_num_threads() != {n}

def test_module_fixture_leaks(leaky):
    pass

def test_dtype_leaks():
    torch.set_default_dtype(torch.float64)

def test_restored(one_thread):
    assert torch.get_num_threads() == 1
    with torch_settings(num_threads={n}, default_dtype=torch.float64):
        assert torch.get_num_threads() == {n}

def test_last():
    assert torch.get_default_dtype() == torch.float32
""")
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=5, errors=3)  # the three leaks, each reported against its own test
    out = result.stdout.str()
    assert f"test_body_leaks left torch's settings changed (num_threads {n - 1} -> {n})" in out
    assert "a fixture of test_inner.py::test_module_fixture_leaks left torch's settings changed" in out
    assert "default_dtype torch.float32 -> torch.float64" in out
