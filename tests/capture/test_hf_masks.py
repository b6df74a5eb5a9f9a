"""Hugging Face attention masks and KV caches as the real step reads them (graphmem/capture/values.py,
graphmem/capture/hf_batch.py).

transformers reads the attention mask's values to choose its path: an all-ones mask is skipped and
SDPA runs ``is_causal=True`` with no (b, 1, s, s) mask; a padded one is materialized. graphmem keeps
the batch's values beside its fakes, so each family takes the real step's path. Ground truth: a real
CPU step (graphmem/validation/measure.py: saved bytes from saved_tensors_hooks, deduplicated by
storage; the peak from the CPU allocator's events), tiny configs, random weights, b=2, s=16.

Before the values (saved bytes over the real step): Qwen2 with an all-ones mask +20,480 B, OLMo
+4,096 B, BART +12,288 B (ones) / +4,096 B (padded, absent: its decoder's own all-ones mask); the
other families already matched. Now every case is 0 B off; the peak is at most 48 B (GPT-2) under
the real one, one CPU kernel's scratch inside an op (0.1 % is the bound, as tests/capture/test_hf.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.nn as nn

import graphmem
from graphmem.capture import hf
from graphmem.capture.hf_batch import settings
from graphmem.errors import UsageError
from graphmem.render.text import render_text
from graphmem.validation.measure import measure_peak

transformers = pytest.importorskip("transformers")

V, B, S = 128, 2, 16
PEAK_TOLERANCE = 0.001  # one CPU kernel's scratch inside an op, unseen by fake tensors (tests/capture/test_hf.py)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
FAMILIES: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=V, num_key_value_heads=2, **_DECODER)),
    "qwen2": lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=V, num_key_value_heads=2, **_DECODER)),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
        vocab_size=V, num_key_value_heads=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=4, num_experts_per_tok=2, **_DECODER)),
    "olmo": lambda: transformers.OlmoForCausalLM(transformers.OlmoConfig(vocab_size=V, **_DECODER)),
    "gpt_neox": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(vocab_size=V, **_DECODER)),
    "bart": lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=V, d_model=64, encoder_ffn_dim=128, decoder_ffn_dim=128, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, max_position_embeddings=64)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_embd=64, n_layer=2, n_head=4,
                                                                         n_positions=64)),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(vocab_size=V, num_key_value_heads=2,
                                                                                  **_DECODER)),
}


def _model(family: str) -> nn.Module:
    torch.manual_seed(0)
    with hf.quiet():
        return FAMILIES[family]()


def _batch(mask: str, use_cache: Optional[bool] = None) -> dict[str, Any]:
    """A tokenizer-like batch: ``ones`` (equal lengths), ``padded`` (the first sequence left-padded
    by 3 tokens) or ``absent`` (no attention_mask)."""
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    batch: dict[str, Any] = {"input_ids": ids, "labels": ids}
    if mask != "absent":
        batch["attention_mask"] = torch.ones(B, S, dtype=torch.long)
        if mask == "padded":
            batch["attention_mask"][0, :3] = 0
    if use_cache is not None:
        batch["use_cache"] = use_cache
    return batch


def _assert_real(model: nn.Module, batch: Any, report: graphmem.Report) -> None:
    real = measure_peak(model, batch)
    assert report.activation_bytes == real.saved_bytes, (report.activation_bytes, real.saved_bytes)
    gap = real.peak_bytes - report.peak_bytes
    assert 0 <= gap <= PEAK_TOLERANCE * real.peak_bytes, (report.peak_bytes, real.peak_bytes)


@pytest.mark.parametrize("family", list(FAMILIES))  # the whole file: ~30 s on 2 cores
@pytest.mark.parametrize("mask", ["ones", "padded", "absent"])
def test_masks_take_the_real_steps_path(family: str, mask: str) -> None:
    # GIVEN a real batch whose mask is all ones, padded, or absent
    model, batch = _model(family), _batch(mask)
    # WHEN graphmem analyzes the step on fake tensors
    report = graphmem.analyze(model, batch)
    # THEN it saves exactly what the real step saves (all ones: no materialized mask, as SDPA's is_causal)
    _assert_real(model, batch, report)


def test_all_ones_mask_is_skipped_where_a_padded_one_is_built() -> None:
    """Qwen2: the padded mask is materialized (more saved), the all-ones one skipped like none."""
    model = _model("qwen2")
    ones, padded, absent = (graphmem.analyze(model, _batch(m)).activation_bytes for m in ("ones", "padded", "absent"))
    assert ones == absent < padded


@pytest.mark.parametrize("use_cache", [True, False])
def test_use_cache_in_training_as_the_real_step(use_cache: bool) -> None:
    """GPT-NeoX with use_cache on (from_pretrained's default) and off: both as the real step."""
    model = _model("gpt_neox")
    batch = _batch("ones", use_cache)
    _assert_real(model, batch, graphmem.analyze(model, batch))


def test_input_shape_batch_defaults_to_no_padding_and_the_configs_cache() -> None:
    # GIVEN an HF model and only a shape
    model = _model("qwen2")
    report = graphmem.analyze(model, input_shape=(B, S))
    # THEN the batch is a tokenizer's of equal lengths (an all-ones mask) with the config's use_cache
    assert report.batch == {"padding": "none", "use_cache": "on (the model's config)"}
    made = hf.batch(model, (B, S))
    assert bool(made["attention_mask"].all()) and "use_cache" not in made
    _assert_real(model, made, report)
    padded = graphmem.analyze(model, input_shape=(B, S), hf=hf.HFOptions(padding="first-token", use_cache=False))
    assert padded.batch == {"padding": "first-token", "use_cache": "off"}
    made = hf.batch(model, (B, S), padding="first-token", use_cache=False)
    assert made["attention_mask"][0, 0] == 0 and made["use_cache"] is False
    _assert_real(model, made, padded)
    assert padded.activation_bytes > report.activation_bytes


def test_header_and_json_name_padding_and_use_cache() -> None:
    report = graphmem.analyze(_model("llama"), input_shape=(B, S), hf=hf.HFOptions(use_cache=False))
    header = render_text(report).splitlines()[0]
    assert "input 2x16, 2x16, 2x16 · padding none · use_cache off · target" in header
    assert report.to_dict()["batch"] == {"padding": "none", "use_cache": "off"}
    given = graphmem.analyze(_model("llama"), _batch("ones"))  # the user's batch: nothing graphmem chose
    assert given.batch == {} and "batch" not in given.to_dict() and "padding" not in render_text(given)


def test_cli_padding_and_use_cache_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from graphmem import cli

    config: Any = _model("llama").config
    config.save_pretrained(tmp_path)
    code = cli.main(["analyze", str(tmp_path), "--input-shape", "2x16", "--padding", "first-token",
                     "--use-cache", "on", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    assert json.loads(out)["batch"] == {"padding": "first-token", "use_cache": "on"}


def test_settings_and_bad_options() -> None:
    assert settings(_model("gpt2"), "none", None) == {"padding": "none", "use_cache": "on (the model's config)"}
    with pytest.raises(UsageError, match="padding must be one of none, first-token"):
        hf.HFOptions(padding="left")
    with pytest.raises(UsageError, match="use_cache must be True, False or None"):
        hf.HFOptions(use_cache="yes")  # type: ignore[arg-type]


def test_a_read_of_a_tensor_without_values_still_fails_as_before() -> None:
    """A meta batch has no values: a model that reads one says so in one line, as before."""

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            return self.lin(x) if bool(m.all()) else self.lin(x) * m

    x, m = torch.randn(2, 4), torch.ones(2, 4)
    assert graphmem.analyze(Reads(), (x, m)).activation_bytes == measure_peak(Reads(), (x, m)).saved_bytes
    with pytest.raises(graphmem.GraphmemError, match="reads tensor values"):
        graphmem.analyze(Reads(), (x.to("meta"), m.to("meta")))


def test_a_value_written_from_the_model_is_not_read_stale() -> None:
    """A batch tensor overwritten in place from a parameter's output loses its value: its read is
    refused (one line), never answered from the batch's old values."""

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
            m = m.clone()
            m[0] = self.lin(x)[0] > 0  # values the fake run does not have
            return self.lin(x) if bool(m.all()) else self.lin(x) * m

    x, m = torch.randn(2, 4), torch.ones(2, 4)
    with pytest.raises(graphmem.GraphmemError, match="reads tensor values"):
        graphmem.analyze(Writes(), (x, m))
