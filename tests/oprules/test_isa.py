"""graphmem/oprules/isa.py: the kernels oneDNN runs, as oneDNN decides them (the CPU's flags capped by
ONEDNN_MAX_CPU_ISA), for any CPU and cap; and the convolution rules follow it, named or read."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import graphmem.oprules.conv_gemm as gemm
import graphmem.oprules.isa as isa


@pytest.mark.parametrize("hardware,setting,runs", [
    (isa.AVX512, "", isa.AVX512), (isa.AVX512, "avx512_core_amx", isa.AVX512), (isa.AVX512, "avx10_1_512", isa.AVX512),
    (isa.AVX512, "avx2", isa.AVX2), (isa.AVX512, "avx2_vnni_2", isa.AVX2), (isa.AVX512, "sse41", isa.OTHER),
    (isa.AVX512, "nonsense", isa.AVX512),  # oneDNN ignores a value it does not know
    (isa.AVX2, "", isa.AVX2), (isa.AVX2, "avx512_core", isa.AVX2), (isa.AVX2, "avx", isa.OTHER),
    (isa.OTHER, "avx2", isa.OTHER),
])
def test_a_cap_lowers_the_level_never_raises_it(hardware: str, setting: str, runs: str) -> None:
    assert isa.capped(hardware, setting) == runs


def test_the_setting_is_read_as_onednn_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    assert isa.max_isa_setting() == "avx2"  # lower-cased; the DNNL_ name when ONEDNN_ is unset
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    assert isa.max_isa_setting() == "avx512_core"  # ONEDNN_ first (src/common/utils.cpp getenv_string_user)
    assert isa.onednn_isa() == isa.capped(isa.hardware_isa(), "avx512_core")


def test_named_isa_drives_the_rules_on_any_cpu() -> None:
    with isa.assume(isa.AVX512):
        assert gemm.avx512() and gemm.onednn_x64() and gemm.simd_w() == 16
    with isa.assume(isa.AVX2):
        assert not gemm.avx512() and gemm.onednn_x64() and gemm.simd_w() == 8
    with isa.assume(isa.OTHER):
        assert not gemm.onednn_x64()
    with pytest.raises(ValueError, match="avx512_core"):
        with isa.assume("avx512"):
            pass


def test_this_process_runs_what_the_rules_read() -> None:
    """The tests' pin (tests/conftest.py) reaches oneDNN: on an x86-64 CPU with AVX2 the rules read AVX2
    kernels and PyTorch sends no bf16 GEMM to oneDNN, whatever the CPU's own level."""
    if isa.hardware_isa() == isa.OTHER or isa.max_isa_setting() != "avx2":
        pytest.skip("the kernels are not pinned to AVX2 in this run")
    assert isa.onednn_isa() == isa.AVX2 and torch.backends.cpu.get_cpu_capability() == "AVX2"
    assert not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_this_torch_builds_onednn_with_the_cap() -> None:
    """The installed torch's oneDNN honours ONEDNN_MAX_CPU_ISA (built with DNNL_ENABLE_MAX_CPU_ISA): a
    process capped at SSE4.1 runs SSE4.1 kernels (its verbose header names the ISA), and graphmem's
    rules decline there."""
    if isa.hardware_isa() == isa.OTHER:
        pytest.skip("not an x86-64 CPU with AVX2")
    code = ("import torch, graphmem.oprules.isa as isa\n"
            "x = torch.randn(2, 8, 8, 8, requires_grad=True)\n"
            "torch.nn.functional.conv2d(x, torch.randn(8, 8, 3, 3)).sum().backward()\n"
            "print('rules:', repr(isa.onednn_isa()))\n")
    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="SSE41", ONEDNN_VERBOSE="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-500:]
    assert "isa:Intel SSE4.1" in done.stdout and "rules: ''" in done.stdout
