"""The per-op rule registry (graphmem/oprules/): one registry holds every family, each rule names
the kernel source it was derived from, and duplicates and unsourced rules are refused."""
from __future__ import annotations

import re

import pytest
import torch

import graphmem.oprules as oprules
from graphmem.oprules.registry import RULES, register_note, register_scratch

# a kernel or library source file: C++/CUDA (.cpp, .cu, .h, .hpp) or Python (.py)
_SOURCE_FILE = re.compile(r"\b[\w/]+\.(?:cpp|cu|h|hpp|py)\b")


def test_every_rule_names_its_source() -> None:
    if _has_bitsandbytes():  # its rules too
        oprules.load_bitsandbytes()
    unsourced = sorted(f"{r.kind} {r.op} {r.device}: {r.source!r}" for r in RULES.values()
                       if not r.source.strip() or not _SOURCE_FILE.search(r.source))
    assert RULES and not unsourced, "rules without a kernel source file:\n" + "\n".join(unsourced)


def test_registry_holds_the_known_families() -> None:
    families = {r.family for r in RULES.values()}
    assert {"matmul", "rnn", "flash_attention", "efficient_attention", "layer_norm", "embedding", "dropout", "conv",
            "collectives"} <= families
    kinds = {(r.family, r.kind) for r in RULES.values()}
    # the fake-kernel fixes, the collectives' scratch, the notes where no rule holds
    assert {("matmul", "kernel"), ("rnn", "kernel"), ("collectives", "kernel"), ("collectives", "scratch"),
            ("conv", "note"), ("rnn", "note"), ("efficient_attention", "note")} <= kinds


def test_bitsandbytes_rules_load_with_its_first_op() -> None:
    pytest.importorskip("bitsandbytes")
    oprules.load_bitsandbytes()
    bnb = {(str(r.op), r.device) for r in RULES.values() if r.family == "bnb"}
    assert {("bitsandbytes.gemm_4bit.default", "cpu"), ("bitsandbytes.gemm_4bit.default", "cuda")} <= bnb


def test_lookups_go_through_the_one_registry() -> None:
    aten = torch.ops.aten
    assert oprules.workspace_outputs(aten.mkldnn_rnn_layer.default) == (3,)
    assert oprules.kernel_rule(aten.mkldnn_rnn_layer.default, "cuda") is None  # oneDNN's workspace: CPU only
    assert oprules.note_rule(aten.convolution.default, "cuda") is not None
    assert oprules.scratch(aten.relu.default, "cpu", (torch.ones(2),), {}, None) == []  # no rule: no scratch


def test_a_rule_without_a_source_or_a_second_rule_is_refused() -> None:
    with pytest.raises(RuntimeError, match="must name its kernel source"):
        register_scratch(torch.ops.aten.relu.default, source=" ")
    with pytest.raises(RuntimeError, match="already registered"):
        register_note(torch.ops.aten.convolution.default, devices=("cuda",), source="x.cpp")(lambda node: "")


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True
