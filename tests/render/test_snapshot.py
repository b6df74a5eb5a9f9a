"""The memory_viz snapshot: the format of torch.cuda.memory._snapshot(), read by PyTorch's own
tooling (torch.cuda._memory_viz), and a trace whose allocated bytes peak at the predicted peak."""
from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cases import tiny_gpt
from test_render import analyze
from torch.cuda import _memory_viz

import graphmem
from graphmem.render.snapshot import ALIGN, BASE_ADDRESS, memory_snapshot, snapshot_bytes
from graphmem.report import Report

# The opcodes the unpickler of https://pytorch.org/memory_viz (torch/utils/viz/MemoryViz.js) reads.
VIEWER_OPCODES = {"PROTO", "APPEND", "APPENDS", "LIST", "TUPLE", "NEWFALSE", "NEWTRUE", "NONE", "BINGET", "BININT",
                  "BININT1", "BININT2", "EMPTY_DICT", "EMPTY_LIST", "FRAME", "LONG1", "LONG_BINGET", "MARK",
                  "MEMOIZE", "BINPUT", "LONG_BINPUT", "SETITEMS", "SETITEM", "DICT", "SHORT_BINUNICODE",
                  "BINUNICODE", "STOP", "EMPTY_TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "BINFLOAT"}


def _gpt() -> Report:
    return graphmem.analyze(tiny_gpt(2, "explicit", dropout=0.1), input_shape=(2, 16))


REPORTS = {"nested": lambda: analyze("nested"), "gpt2-tiny": _gpt}


def _trace_max(snap: dict[str, Any]) -> int:
    """The largest running sum of the trace's allocations (what the step adds to what it found)."""
    live = top = 0
    for e in snap["device_traces"][0]:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        top = max(top, live)
    return top


def _viewer_max(snap: dict[str, Any]) -> int:
    """The maximum the Active Memory Timeline of MemoryViz.js draws (process_alloc_data): blocks
    active in the segments that the trace did not allocate, and frees of allocations the trace never
    saw, are allocated from the start; then every alloc adds and every free subtracts."""
    trace = snap["device_traces"][0]
    allocated = {e["addr"] for e in trace if e["action"] == "alloc"}
    live = sum(b["requested_size"] for seg in snap["segments"] for b in seg["blocks"]
               if b["state"] == "active_allocated" and b["address"] not in allocated)
    live += sum(e["size"] for e in trace if e["action"] == "free_completed" and e["addr"] not in allocated)
    top = live
    for e in trace:
        live += e["size"] if e["action"] == "alloc" else -e["size"] if e["action"] == "free_completed" else 0
        top = max(top, live)
    return top


@pytest.mark.parametrize("name", sorted(REPORTS))
def test_trace_peaks_at_the_predicted_peak(name: str) -> None:
    r = REPORTS[name]()
    snap = memory_snapshot(r)
    # the step's own allocations peak at the peak minus what existed before the step ...
    assert _trace_max(snap) == r.peak_bytes - r.baseline_bytes
    # ... and the viewer, which adds the pre-existing blocks, shows the peak itself
    assert _viewer_max(snap) == r.peak_bytes


def test_nested_numbers_by_hand() -> None:
    r = analyze("nested")
    snap = memory_snapshot(r)
    # before the step: parameters 4688 + batch 512 (test_render_text_nested_numbers_by_hand)
    assert r.baseline_bytes == 5200 and _trace_max(snap) == 12008 - 5200
    trace = snap["device_traces"][0]
    # every storage an op makes is allocated once: 54 ops, the 4 parameters' + batch's blocks are not
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert r.step is not None
    assert len(allocs) == sum(1 for s in r.step.storages.values() if s.created >= 0 and s.nbytes)
    first = allocs[0]  # LayerNorm's output, op 0
    assert first["size"] == 512 and first["frames"][0] == {
        "filename": "forward", "line": 0, "name": "aten.native_layer_norm.default [activations]"}
    assert [f["filename"] for f in first["frames"][1:]] == ["block.ln", "block", "(model)"]


def test_format_of_torch_cuda_memory_snapshot() -> None:
    snap = memory_snapshot(analyze("nested"))
    assert set(snap) == {"segments", "device_traces"} and len(snap["device_traces"]) == 1
    for e in snap["device_traces"][0]:
        assert e["action"] in ("alloc", "free_requested", "free_completed")
        assert {"addr", "size", "stream", "frames"} <= set(e) and e["addr"] % ALIGN == 0
        assert all(set(f) == {"filename", "line", "name"} for f in e["frames"])
    # a free is requested, then completed, right after
    actions = [e["action"] for e in snap["device_traces"][0]]
    assert all(actions[i + 1] == "free_completed" for i, a in enumerate(actions) if a == "free_requested")
    (seg,) = snap["segments"]
    assert seg["device"] == 0 and seg["address"] == BASE_ADDRESS and seg["stream"] == 0
    addr = seg["address"]  # the viewer places blocks by adding up their sizes from the segment's address
    for b in seg["blocks"]:
        assert b["address"] == addr and b["state"] in ("active_allocated", "inactive")
        addr += b["size"]
    assert addr == seg["address"] + seg["total_size"]
    assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")


def test_pytorch_memory_viz_reads_it(tmp_path: Path) -> None:
    data = snapshot_bytes(_gpt())
    snap = pickle.loads(data)
    flame = lambda lines: lines  # noqa: E731 -- the flamegraph text, without fetching flamegraph.pl
    assert "segments: 1" in _memory_viz.segsum(snap)  # checks that the segment's bytes add up
    assert "forward:" in _memory_viz.segments(snap, format_flamegraph=flame)
    assert "(model):0:forward" in _memory_viz.memory(snap, format_flamegraph=flame)
    assert _memory_viz.compare(snap["segments"], snap["segments"], format_flamegraph=flame) == ""  # takes segments
    assert "TOTAL MEM:" in _memory_viz.trace(snap)
    for html in (_memory_viz.trace_plot(snap), _memory_viz.segment_plot(snap),
                 _memory_viz.trace_plot(pickle.loads(data), filter_freed=True)):
        assert "MemoryViz.js" in html and "snapshot.pickle" in html
    # the file as torch's own command line reads it
    path = tmp_path / "step.pickle"
    path.write_bytes(data)
    out = tmp_path / "step.html"
    subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", str(path), "-o", str(out)],
                   check=True, capture_output=True)
    assert "add_local_files" in out.read_text()
    # and the browser viewer's unpickler knows every opcode in it
    assert {op.name for op, _, _ in pickletools.genops(data)} <= VIEWER_OPCODES


def test_snapshot_is_deterministic() -> None:
    assert snapshot_bytes(analyze("nested")) == snapshot_bytes(analyze("nested"))
