"""Compiled mode on the CUDA target: the CUDA rules (SDPA backend ops, fused dropout's bool mask,
LayerNorm's fp32 statistics, autocast's CUDA cast lists) hold in the graphs AOTAutograd partitions.

No GPU here, so the check is against the eager CUDA-target rules (themselves checked in
tests/capture/test_targets.py), op by op, where the two must agree: models the partitioner recomputes
nothing in, whose compiled saved set is then the eager one tensor for tensor.
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from cases import MODELS, build
from torch.utils._ordered_set import OrderedSet
from zoo import _LM, ACCURACY, _hf

import graphmem
from graphmem import cli
from graphmem.models import mlp


class Block(nn.Module):
    """LayerNorm, qkv, SDPA (causal), projection, dropout."""

    def __init__(self, d: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.ln, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.drop, self.heads = nn.Dropout(0.1), heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, s, hd)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, s, d)))


def _saved(report: graphmem.Report) -> Counter:
    return Counter((t.op, t.shape, t.dtype, t.bytes) for t in report.saved)


@pytest.mark.parametrize("options,backend", [({"dtype": "bf16"}, "flash"), ({"dtype": "bf16", "attention": "efficient"},
                                             "efficient"), ({"dtype": "bf16", "attention": "math"}, "math"),
                                            ({}, "efficient")])
def test_compiled_saved_set_is_the_eager_cuda_rules(options: dict, backend: str) -> None:
    torch.manual_seed(0)
    module, inputs = Block(), (torch.randn(2, 32, 64),)
    eager = graphmem.analyze(module, inputs, device="cuda", **options)
    compiled = graphmem.analyze(module, inputs, device="cuda", mode="compiled", **options)
    compiled.step.check()
    assert compiled.compiled.recomputed == ()  # nothing recomputed: the two saved sets must coincide
    assert _saved(compiled) == _saved(eager)
    assert compiled.activation_bytes == eager.activation_bytes == compiled.compiled.eager_bytes
    assert compiled.attention_backends == eager.attention_backends == {backend: 1}
    ops = {t.op for t in compiled.saved}
    assert "aten.native_dropout.default" in ops  # CUDA's fused dropout: a bool mask
    stats = [t for t in compiled.saved if t.op == "aten.native_layer_norm.default" and t.shape == (2, 32, 1)]
    assert stats and all(t.dtype == "float32" for t in stats)  # fp32 mean/rstd, as CUDA's kernel keeps


def test_bundled_gpt2_flash_bf16_matches_eager_cuda() -> None:
    module, inputs, loss = build(MODELS, "gpt2_sdpa")
    eager = graphmem.analyze(module, inputs, loss=loss, device="cuda", dtype="bf16")
    compiled = graphmem.analyze(module, inputs, loss=loss, device="cuda", dtype="bf16", mode="compiled")
    assert compiled.compiled.recomputed == ()
    assert _saved(compiled) == _saved(eager)
    assert compiled.attention_backends == eager.attention_backends and "flash" in compiled.attention_backends
    assert "aten._scaled_dot_product_flash_attention.default" in {t.op for t in compiled.saved}


@pytest.fixture
def nothing_recomputed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The partitioner's saved set without recomputation: only views stay recomputable, so
    ``solve_min_cut`` bans every other forward op from recomputation (torch/_functorch/partitioners.py
    ``get_default_op_list``, ``should_ban_recomputation``: "not in recomputable allowlist") and
    saves what backward reads, as eager autograd does."""
    from torch._functorch import partitioners as parts

    default = parts.get_default_op_list

    def views_only() -> Any:
        ops = default()
        return dataclasses.replace(ops, recomputable_ops=OrderedSet(ops.view_ops))
    monkeypatch.setattr(parts, "get_default_op_list", views_only)


def _mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10)), (torch.randn(8, 64),)


def _block() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 32, 64),)


def _amp_pair(module: nn.Module, inputs: tuple, amp: str = "bf16") -> tuple[graphmem.Report, graphmem.Report]:
    eager = graphmem.analyze(module, inputs, device="cuda", amp=amp)
    compiled = graphmem.analyze(module, inputs, device="cuda", amp=amp, mode="compiled")
    compiled.step.check()
    assert compiled.compiled.recomputed == ()
    low = {"bf16": "bfloat16", "fp16": "float16"}[amp]
    assert any(t.dtype == low and t.op == "aten._to_copy.default" for t in compiled.saved)  # autocast's casts, saved
    assert compiled.attention_backends == eager.attention_backends
    return eager, compiled


@pytest.mark.parametrize("name,amp", [("mlp", "bf16"), ("mlp", "fp16"), ("block", "bf16"), ("timm_vit", "bf16")])
def test_compiled_amp_saved_set_is_the_eager_cuda_autocast(name: str, amp: str) -> None:
    """torch.nn's MLP and a transformer block (Linear, LayerNorm, SDPA, Dropout), timm's ViT: the
    partitioner recomputes nothing in them, so the compiled saved set under CUDA autocast is the
    eager one, op by op, and so are the totals."""
    module, inputs = {"mlp": _mlp, "block": _block, "timm_vit": ACCURACY["timm_vit_tiny"][0]}[name]()
    eager, compiled = _amp_pair(module, inputs, amp)
    assert _saved(compiled) == _saved(eager)
    assert compiled.activation_bytes == eager.activation_bytes == compiled.compiled.eager_bytes
    if name != "mlp":
        assert set(compiled.attention_backends) == {"flash"}  # autocast's bf16 q, k, v: flash on an H100


def _shape_key(report: graphmem.Report) -> Counter:
    return Counter((t.shape, t.dtype, t.bytes) for t in report.saved)


@pytest.mark.slow
def test_compiled_amp_hf_gpt2_without_recomputation_is_the_eager_cuda_autocast(nothing_recomputed: None) -> None:
    """transformers' GPT-2 (the Trainer's ``bf16=True, torch_compile=True``): without recomputation,
    every saved tensor is eager's (dtype, shape, bytes) and the totals are equal. One pair of
    equal-size tensors differs in the op that made it: gelu_new's ``pow(x, 3)`` (fp32 under
    autocast) saves x, the fp32 cast of the bf16 c_fc output, in eager; the min cut keeps
    ``3 * x`` (of pow's backward, ``x.pow(2) * 3`` decomposed) instead, a tie of equal cost."""
    module, inputs = ACCURACY["hf_gpt2"][0]()
    eager, compiled = _amp_pair(module, inputs)
    assert _shape_key(compiled) == _shape_key(eager)
    assert compiled.activation_bytes == eager.activation_bytes
    only_eager, only_compiled = _saved(eager) - _saved(compiled), _saved(compiled) - _saved(eager)
    cfg: Any = module.config
    shape, nbytes = (*inputs[0].shape, 4 * cfg.n_embd), 4 * inputs[0].numel() * 4 * cfg.n_embd  # fp32 c_fc outputs
    layers = cfg.n_layer
    assert only_eager == Counter({("aten._to_copy.default", shape, "float32", nbytes): layers})
    assert only_compiled == Counter({("aten.mul.Scalar", shape, "float32", nbytes): layers})


@pytest.mark.slow
def test_compiled_amp_hf_llama_without_recomputation_is_the_eager_cuda_autocast(nothing_recomputed: None) -> None:
    """transformers' Llama: without recomputation the compiled saved set is eager's op by op but
    for the casts AOTAutograd's CSE merges (torch/_functorch/partitioners.py: ``fx_graph_cse``
    before the min cut): autocast casts a non-parameter for each op (its cast cache keeps only
    leaves that require grad), so eager saves one bf16 copy of the normed hidden state for each
    of q_proj, k_proj, v_proj and one for each of gate_proj, up_proj; compiled, one each."""
    module, inputs = _hf("LlamaConfig:LlamaForCausalLM", 16, **_LM)()
    eager, compiled = _amp_pair(module, inputs)
    only_eager, only_compiled = _saved(eager) - _saved(compiled), _saved(compiled) - _saved(eager)
    cfg: Any = module.config
    shape, merged = (*inputs[0].shape, cfg.hidden_size), ((3 - 1) + (2 - 1)) * cfg.num_hidden_layers
    nbytes = 2 * inputs[0].numel() * cfg.hidden_size
    assert only_compiled == Counter()
    assert only_eager == Counter({("aten._to_copy.default", shape, "bfloat16", nbytes): merged})
    assert eager.activation_bytes - compiled.activation_bytes == merged * nbytes


def test_cli_compiled_cuda_amp(capsys: pytest.CaptureFixture[str]) -> None:
    """``--mode compiled --device cuda --amp bf16`` runs (it was refused before) and reports the
    compiled saved set beside eager's."""
    args = ["analyze", mlp.__file__, "--input-shape", "4x784", "--device", "cuda", "--amp", "bf16", "--json"]
    assert cli.main(args) == 0
    eager = json.loads(capsys.readouterr().out)
    assert cli.main([*args, "--mode", "compiled"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert compiled["target"]["mode"] == "compiled" and compiled["target"]["amp"] == "bf16"
    assert compiled["activation_bytes"] == eager["activation_bytes"] > 0


@pytest.mark.parametrize("name", ["encoder_dropout", "encoder", "mha_weights", "autocast_off"])
def test_compiled_amp_runs_mha_and_the_models_autocast_regions_under_the_cuda_rules(name: str) -> None:
    """Dynamo keeps ``F.multi_head_attention_forward`` as one node, and the model's
    ``torch.autocast(x.device.type, enabled=False)`` as ``_enter_autocast``/``_exit_autocast``
    nodes: under the CUDA rules the compiled saved set is the one CUDA autocast's lists give
    (tests/capture/test_targets.py), tensor for tensor."""
    from tests.capture.test_targets import Attention, AutocastOff, autocast_off_expected, encoder, encoder_expected

    torch.manual_seed(0)
    module, inputs, expected = {
        "encoder_dropout": lambda: (*encoder(0.1), encoder_expected(0.1)),
        "encoder": lambda: (*encoder(0.0), encoder_expected(0.0)),
        "mha_weights": lambda: (Attention(), (torch.randn(2, 16, 64),), None),
        "autocast_off": lambda: (AutocastOff(), (torch.randn(16, 32),), autocast_off_expected()),
    }[name]()
    eager = graphmem.analyze(module, inputs, device="cuda", amp="bf16")
    compiled = graphmem.analyze(module, inputs, device="cuda", amp="bf16", mode="compiled")
    assert compiled.step is not None and compiled.compiled is not None
    compiled.step.check()
    assert compiled.compiled.recomputed == ()
    assert _saved(compiled) == _saved(eager) == (expected if expected is not None else _saved(eager))
    assert compiled.attention_backends == eager.attention_backends


def test_compiled_amp_opens_transformers_maybe_autocast_regions(nothing_recomputed: None) -> None:
    """Dynamo traces transformers' ``maybe_autocast`` question (``torch.is_autocast_enabled`` about
    the fake tensors' device type) as the model sees it in eager: GPT-2's upcast q and k stay fp32."""
    from tests.capture.test_targets import upcast_gpt2

    module, inputs, upcast = upcast_gpt2()
    eager, compiled = _amp_pair(module, inputs)
    assert {k: _shape_dtype(compiled)[k] for k in upcast} == {k: _shape_dtype(eager)[k] for k in upcast} == upcast


def _shape_dtype(report: graphmem.Report) -> Counter:
    return Counter((t.shape, t.dtype) for t in report.saved)
