"""Which of oneDNN's x86-64 kernels this process runs on the CPU, decided as oneDNN decides it, so the
convolution rules (conv.py, conv_gemm.py, conv_dw.py, conv_jit.py, conv_brgemm.py) follow the kernels
that really run.

oneDNN picks its kernels by ``mayiuse(isa)`` (src/cpu/x64/cpu_isa_traits.hpp): the CPU's CPUID flags
(``avx512_core`` = AVX-512 F, BW, VL and DQ; ``avx2``), masked by the largest ISA the process allows,
``ONEDNN_MAX_CPU_ISA`` (or ``DNNL_MAX_CPU_ISA``), read once, at oneDNN's first use, lower-cased
(src/cpu/x64/cpu_isa_traits.cpp ``init_max_cpu_isa``; src/common/utils.cpp ``getenv_string_user``;
an unknown value caps nothing). PyTorch's own oneDNN routing goes through the same mask: ATen's
``mkldnn_bf16_device_check`` is ``ideep::has_bf16_type_support()`` on x86-64 (oneDNN's effective ISA),
and ``cpublas::could_pack`` reads ``dnnl::get_effective_cpu_isa()`` (aten/src/ATen/native/mkldnn/Utils.h,
aten/src/ATen/native/CPUBlas.cpp). ATen's ``torch.backends.cpu.get_cpu_capability()`` is not the
same thing: ``ATEN_CPU_CAPABILITY`` moves it without moving oneDNN, so it is read only where the
CPU's flags cannot be (no /proc/cpuinfo).

``assume(isa)`` computes the rules for a named ISA on any machine: the golden reports of both ISAs are
checked everywhere (tests/render/test_report_golden.py), and the rules' own tests can name theirs.

Known limitations: x86-64 only (another CPU gets ``OTHER``: the rules decline there and the report's
note stays); an ``ONEDNN_MAX_CPU_ISA`` changed after oneDNN's first use is seen here but not by
oneDNN, which keeps the value it read.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
from typing import Iterator, Optional

AVX512 = "avx512_core"  # oneDNN's name (cpu_isa_traits.hpp user_option_env)
AVX2 = "avx2"
OTHER = ""  # no x86-64 AVX2: the convolution rules decline

# ONEDNN_MAX_CPU_ISA values (cpu_isa_traits.hpp ``user_option_env``) whose mask leaves out a level
_BELOW_AVX512 = frozenset({"sse41", "avx", "avx2", "avx2_vnni", "avx2_vnni_2"})
_BELOW_AVX2 = frozenset({"sse41", "avx"})
_AVX512_CORE_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})  # mayiuse(avx512_core)

_assumed: Optional[str] = None


def max_isa_setting() -> str:
    """The cap this process asks oneDNN for, as oneDNN reads it (``ONEDNN_`` before ``DNNL_``,
    lower-cased); "" when none is set."""
    for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        value = os.environ.get(name, "")
        if value:
            return value.lower()
    return ""


def _cpuinfo_flags() -> Optional[frozenset[str]]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


@functools.lru_cache(maxsize=1)
def hardware_isa() -> str:
    """The CPU's own level, uncapped: AVX512, AVX2 or OTHER (Linux: /proc/cpuinfo's flags, which
    the kernel reports from CPUID; elsewhere ATen's capability)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return OTHER
    flags = _cpuinfo_flags()
    if flags is None:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
        return AVX512 if capability.startswith("AVX512") else AVX2 if capability == "AVX2" else OTHER
    return AVX512 if _AVX512_CORE_FLAGS <= flags else AVX2 if "avx2" in flags else OTHER


def capped(hardware: str, setting: str) -> str:
    """The level oneDNN runs at on ``hardware`` under the cap ``setting`` (``mayiuse``'s mask)."""
    if hardware == AVX512 and setting in _BELOW_AVX512:
        hardware = AVX2
    if hardware == AVX2 and setting in _BELOW_AVX2:
        hardware = OTHER
    return hardware


def onednn_isa() -> str:
    """The kernels oneDNN runs in this process: AVX512, AVX2 or OTHER (or the ISA ``assume`` names)."""
    if _assumed is not None:
        return _assumed
    return capped(hardware_isa(), max_isa_setting())


@contextlib.contextmanager
def assume(isa: str) -> Iterator[None]:
    """Compute the rules for ``isa`` (AVX512, AVX2 or OTHER) whatever this CPU is, for the block."""
    global _assumed
    if isa not in (AVX512, AVX2, OTHER):
        raise ValueError(f"unknown ISA {isa!r}: use {AVX512!r}, {AVX2!r} or {OTHER!r}")
    before, _assumed = _assumed, isa
    try:
        yield
    finally:
        _assumed = before
