"""The process's peak memory, told apart from the shared libraries' pages (Linux's ``/proc/self/status``).

``ru_maxrss`` (VmHWM) counts every resident page of the process: its own memory (the heap, what Python and
graphmem allocate: ``RssAnon``) and the pages of the files it maps (``RssFile``), mostly torch's and the CUDA
libraries' ``.so`` files (libtorch_cpu, libcublasLt, libnvrtc, libnvJitLink: ~95, 66, 68 and 67 MB of them
in a venv installed minutes before). How many of a library's pages are resident is the kernel's page cache's
doing, not the process's: the same venv's ``import torch`` maps 233 MB of file pages when its files are old in
the cache and 419 MB right after ``pip install`` wrote them (same anonymous 287 MB, measured on this project's
2-core machine), and CI's machine maps more still. So the process's own peak is bounded from above by
``VmHWM - RssFile`` read once the imports are done (file pages, once mapped, stay mapped on a machine not short
of memory; any mapped later are counted as the process's own: an upper bound).
"""
from __future__ import annotations


def status_kib(field: str) -> int:
    """One ``kB`` field of ``/proc/self/status`` (``VmHWM``, ``RssFile``, ``RssAnon``), in KiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class PeakMemory:
    """Made once the imports are done; ``own()`` is the peak since the process started, less the file pages
    mapped by then (bytes), ``total()`` the plain peak RSS (bytes), ``files()`` the file pages (bytes)."""

    def __init__(self) -> None:
        self.files_at_start = status_kib("RssFile") * 1024

    def total(self) -> int:
        return status_kib("VmHWM") * 1024

    def files(self) -> int:
        return status_kib("RssFile") * 1024

    def own(self) -> int:
        return self.total() - self.files_at_start
