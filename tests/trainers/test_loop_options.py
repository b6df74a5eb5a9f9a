"""The loop options real trainers use (graphmem/training/loop_options.py) against real CPU steps that
run the same loop (graphmem/validation/measure.py ``measure_peak``): the bundled GPT-2 and transformers'
Llama and GPT-2 at tiny sizes, given labels so the loss is the model's own ``loss`` field.

Saved bytes, optimizer states, offloaded host bytes and the peaks to the byte (the eager Adam step's
12 B and transformers' GPT-2's 48 B of GELU scalars, once the plain loop's gaps, are Python numbers
made tensors, counted by graphmem/capture/wrapped_numbers.py).
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from cases import MODELS
from cases import build as build_case

import graphmem
from graphmem.cli.main import main
from graphmem.errors import UsageError
from graphmem.training.loop import make_train_step
from graphmem.validation.measure import measure_peak


def _hf(cls: str, vocab: int = 128, **config: Any) -> Callable[[], tuple]:
    def build() -> tuple:
        transformers = pytest.importorskip("transformers")
        torch.manual_seed(0)
        model = getattr(transformers, cls + "ForCausalLM" if cls == "Llama" else cls + "LMHeadModel")(
            getattr(transformers, cls + "Config")(vocab_size=vocab, **config))
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
        return model, {"input_ids": ids, "labels": ids}, None
    return build


_LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)
_GPT2 = dict(n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
BUILDERS: dict[str, Callable[[], tuple]] = {
    "gpt2_bundled": lambda: build_case(MODELS, "gpt2_sdpa"),
    "hf_llama": _hf("Llama", **_LLAMA),
    "hf_gpt2": _hf("GPT2", **_GPT2),
}
OPTIONS: dict[str, dict[str, Any]] = {
    "release_output": dict(release_output=True),
    "release_output_adamw": dict(optimizer="adamw", release_output=True),
    "clip_foreach": dict(optimizer="adamw", clip_grad_norm=1.0),
    "clip_per_tensor": dict(optimizer="sgd", clip_grad_norm=0.5, clip_foreach=False),
    "clip_micro_batches": dict(optimizer="adam", clip_grad_norm=1.0, micro_batches=2),
    "optimizer_in_backward": dict(optimizer="adamw", optimizer_in_backward=True),
    "in_backward_foreach": dict(optimizer="adam", optimizer_impl="foreach", optimizer_in_backward=True),
    "offload": dict(offload_activations=True),
    "offload_adamw_released": dict(optimizer="adamw", offload_activations=True, release_output=True),
}


def _step(options: dict[str, Any]) -> Any:
    keys = dict(options)
    impl = keys.pop("optimizer_impl", "auto")
    return make_train_step(keys.pop("optimizer", None), impl, **keys)


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("name", BUILDERS)
def test_each_option_matches_a_real_step(name: str, option: str) -> None:
    module, inputs, loss = BUILDERS[name]()
    options = OPTIONS[option]
    r = graphmem.analyze(module, inputs, loss=loss, **options)
    r.step.check()
    real = measure_peak(module, inputs, loss, train=_step(options))
    assert r.activation_bytes == real.saved_bytes  # offloading moves the saves; the saved set is the same
    assert r.budget.row("optimizer states").size == real.state_bytes
    assert r.budget.host_bytes == real.host_bytes  # what the real hooks moved
    assert (real.host_bytes > 0) == bool(options.get("offload_activations"))
    # to the byte: the eager Adam step's 12 B and transformers' GPT-2's 48 B of GELU scalars, the gaps
    # these rows had, are Python numbers made tensors, counted now (graphmem/capture/wrapped_numbers.py)
    assert r.peak_bytes == real.peak_bytes


@pytest.mark.parametrize("options", [dict(optimizer="adamw", optimizer_in_backward=True),
                                     dict(optimizer="adam", offload_activations=True, clip_grad_norm=1.0)])
@pytest.mark.parametrize("name", ["gpt2_bundled", "hf_llama"])
def test_later_steps_peak_matches_a_real_second_step(name: str, options: dict[str, Any]) -> None:
    """The per-parameter optimizers' states exist before a later step, like one optimizer's: to the byte."""
    module, inputs, loss = BUILDERS[name]()
    b = graphmem.analyze(module, inputs, loss=loss, **options).budget.rank
    real = measure_peak(module, inputs, loss, train=_step(options), warm_steps=1)
    assert real.peak_bytes == b.later_peak_bytes


@pytest.mark.parametrize("name", ["gpt2_bundled", "hf_llama"])
def test_options_change_the_peak_as_real_steps_do(name: str) -> None:
    """Each option against the plain step, both sides: releasing the output, offloading and stepping in
    backward lower the peak where the real steps' peaks are lower."""
    module, inputs, loss = BUILDERS[name]()

    def both(**options: Any) -> tuple[int, int]:
        r = graphmem.analyze(module, inputs, loss=loss, **options)
        return r.peak_bytes, measure_peak(module, inputs, loss, train=_step(options)).peak_bytes

    plain, released = both(), both(release_output=True)
    assert released[0] < plain[0] and released[1] < plain[1]
    offloaded = both(offload_activations=True)
    assert offloaded[0] < plain[0] and offloaded[1] < plain[1]
    adamw, in_backward = both(optimizer="adamw"), both(optimizer="adamw", optimizer_in_backward=True)
    assert in_backward[0] < adamw[0] and in_backward[1] < adamw[1]


def test_releasing_the_logits_lowers_the_peak_of_an_lm_whose_logits_dominate() -> None:
    """A 4096-token vocabulary on a 32-wide Llama: logits (2, 16, 4096) fp32 = 512 KiB, held through
    backward unless released, as HF Trainer's compute_loss releases them."""
    module, inputs, _ = _hf("Llama", vocab=4096, **_LLAMA)()
    held = graphmem.analyze(module, inputs)
    released = graphmem.analyze(module, inputs, release_output=True)
    real_held = measure_peak(module, inputs, train=_step({}))
    real_released = measure_peak(module, inputs, train=_step(dict(release_output=True)))
    logits = 2 * 16 * 4096 * 4
    assert held.peak_bytes - released.peak_bytes == logits  # exactly the logits
    assert real_held.peak_bytes - real_released.peak_bytes == logits
    assert real_released.peak_bytes == released.peak_bytes


@pytest.mark.parametrize("options", [dict(optimizer="adamw", optimizer_in_backward=True),
                                     dict(optimizer="adamw", offload_activations=True, release_output=True,
                                          clip_grad_norm=1.0)])
def test_peft_lora_with_the_loop_options(options: dict[str, Any]) -> None:
    """Frozen base weights: no hook, no state and no offloaded copy for them; the peaks to the byte, as
    the plain AdamW step's (32 B under both ways before LoRA's ``* scaling`` doubles were counted)."""
    peft = pytest.importorskip("peft")
    module, inputs, _ = BUILDERS["hf_llama"]()
    module = peft.get_peft_model(module, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0))
    r = graphmem.analyze(module, inputs, **options)
    real = measure_peak(module, inputs, train=_step(options))
    plain = graphmem.analyze(module, inputs, optimizer="adamw").peak_bytes
    plain_real = measure_peak(module, inputs, train=_step(dict(optimizer="adamw"))).peak_bytes
    assert r.activation_bytes == real.saved_bytes and r.budget.host_bytes == real.host_bytes
    assert r.budget.row("optimizer states").size == real.state_bytes
    assert (r.peak_bytes, plain) == (real.peak_bytes, plain_real)


def test_host_bytes_are_what_save_on_cpu_style_hooks_move() -> None:
    """An independent count: every tensor saved in a real forward that is not a parameter, at its
    size as save_on_cpu copies it (``torch.empty(t.size())``), against the report."""
    module, inputs, loss = BUILDERS["hf_llama"]()
    params = {p.untyped_storage()._cdata for p in module.parameters()}
    moved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in params:
            moved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(**inputs).loss.backward()
    module.zero_grad(set_to_none=True)
    r = graphmem.analyze(module, inputs, offload_activations=True)
    assert r.budget.host_bytes == moved[0] > r.activation_bytes  # per saved tensor: views are copied again
    assert r.budget.to_dict()["host_bytes"] == moved[0]


def test_offloading_on_the_cuda_target_drops_device_bytes() -> None:
    module, inputs, loss = BUILDERS["gpt2_bundled"]()
    plain = graphmem.analyze(module, inputs, loss=loss, device="cuda", amp="bf16")
    off = graphmem.analyze(module, inputs, loss=loss, device="cuda", amp="bf16", offload_activations=True)
    assert off.peak_bytes < plain.peak_bytes and off.budget.host_bytes > 0
    assert off.activation_bytes == plain.activation_bytes


def test_the_report_describes_the_loop() -> None:
    module, inputs, loss = BUILDERS["gpt2_bundled"]()
    r = graphmem.analyze(module, inputs, loss=loss, optimizer="adamw", clip_grad_norm=1.0, release_output=True,
                         offload_activations=True)
    d = r.budget.to_dict()
    assert d["clip_grad_norm"] == 1.0 and d["clip_foreach"] is True and d["release_output"] is True
    assert d["offload_activations"] is True and d["optimizer_in_backward"] is False
    text = r.budget.training.train.describe()
    assert "clip_grad_norm_ 1 (foreach)" in text and "output released before backward" in text


def test_cli_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x16", "--optimizer", "adamw", "--clip-grad-norm", "1.0",
                 "--no-clip-foreach", "--release-output", "--offload-activations"]) == 0
    out = capsys.readouterr().out
    assert "clip_grad_norm_ 1 (per tensor)" in out and "activations offloaded to host" in out
    assert "offloaded activations:" in out
    assert main(["analyze", "gpt2", "--input-shape", "1x16", "--optimizer", "adamw", "--optimizer-in-backward"]) == 0
    assert "optimizer in backward" in capsys.readouterr().out


@pytest.mark.parametrize("options,phrase", [
    (dict(optimizer="adamw", optimizer_in_backward=True, micro_batches=2), "micro_batches > 1"),
    (dict(optimizer="adamw", optimizer_in_backward=True, clip_grad_norm=1.0), "clip_grad_norm"),
    (dict(optimizer_in_backward=True), "add optimizer="),
    (dict(clip_grad_norm=1.0), "add optimizer="),
    (dict(optimizer="adamw", clip_grad_norm=-1.0), "positive number"),
    (dict(optimizer="adamw", clip_foreach=False), "add clip_grad_norm="),
    (dict(release_output=True, mode="compiled"), "mode='compiled-blocks'"),
    (dict(offload_activations=True, world_size=2, rank=0, fsdp="fully_shard"), "one device only"),
    (dict(optimizer="adamw", release_output=True, pp=2, micro_batches=2), "loop options"),
])
def test_bad_combinations_are_one_line(options: dict[str, Any], phrase: str) -> None:
    module, inputs, loss = BUILDERS["gpt2_bundled"]()
    with pytest.raises(UsageError) as e:
        graphmem.analyze(module, inputs, loss=loss, **options)
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_cli_mistakes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["analyze", "gpt2", "--input-shape", "1x8", "--optimizer", "adamw", "--optimizer-in-backward",
                 "--micro-batches", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer_in_backward" in err[0], err
