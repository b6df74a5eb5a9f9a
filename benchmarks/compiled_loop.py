"""The loop options with each block and the loss compiled (``mode="compiled-blocks"``), predicted beside a
real compiled CPU step: the table of docs/loop.md's "Compiled blocks" section.

Each row: ``graphmem.analyze(model, batch, loss=loss, mode="compiled-blocks", **options)`` and the real step,
the same blocks compiled by ``torch.compile`` (``backend="aot_eager"``, graphmem/capture/compiled_per_block.py
``blocks_compiled``, compiled before the measured steps) through the same loop
(graphmem/validation/measure.py ``measure_peak``): saved bytes (saved_tensors_hooks), the first step's peak,
the later steps' peak (one whole step run first), the bytes the offloading hooks moved.

    python benchmarks/compiled_loop.py                       # both models, every row (minutes on 2 cores)
    python benchmarks/compiled_loop.py --models gpt2 --rows offload_activations
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

import graphmem
from graphmem.capture.compiled_per_block import blocks_compiled
from graphmem.models import gpt2
from graphmem.training.loop import make_train_step
from graphmem.training.step import run_step
from graphmem.validation.measure import measure_peak

ROWS: dict[str, dict[str, Any]] = {
    "plain": {},
    "release_output": {"release_output": True},
    "offload_activations": {"offload_activations": True},
    "adamw": {"optimizer": "adamw"},
    "optimizer_in_backward": {"optimizer": "adamw", "optimizer_in_backward": True},
    "adamw8bit": {"optimizer": "adamw8bit"},
    "torchtune": {"optimizer": "adamw8bit", "optimizer_in_backward": True, "offload_activations": True,
                  "release_output": True},
}


def _gpt2() -> tuple:
    """The bundled GPT-2 (SDPA), 2 blocks, its own loss function (compiled like the blocks)."""
    torch.manual_seed(0)
    cfg = gpt2.GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=32, attention="sdpa")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return gpt2.build(cfg), (ids,), gpt2.loss


def _hf_llama() -> tuple:
    """transformers' LlamaForCausalLM, tiny, its own loss (``labels``: computed in its forward, not compiled)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    return transformers.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}, None


MODELS: dict[str, Callable[[], tuple]] = {"gpt2": _gpt2, "hf_llama": _hf_llama}


def predicted(build: Callable[[], tuple], options: dict[str, Any]) -> dict[str, int]:
    model, inputs, loss = build()
    r = graphmem.analyze(model, inputs, loss=loss, mode="compiled-blocks", **options)
    b = r.budget
    return {"saved": r.activation_bytes, "first": r.peak_bytes,
            "later": b.rank.later_peak_bytes if b is not None and options.get("optimizer") else r.peak_bytes,
            "host": b.host_bytes if b is not None else 0}


def real(build: Callable[[], tuple], options: dict[str, Any]) -> dict[str, int]:
    """The real step: the blocks and the loss compiled, compiled before the measured steps."""
    model, inputs, loss = build()
    keys = dict(options)
    train = make_train_step(keys.pop("optimizer", None), **keys)
    with blocks_compiled(model, loss) as compiled_loss:
        run_step(model, inputs, compiled_loss)
        model.zero_grad(set_to_none=True)
        first = measure_peak(model, inputs, compiled_loss, train=train)
        later = measure_peak(model, inputs, compiled_loss, train=train, warm_steps=1) if options.get("optimizer") \
            else first
    return {"saved": first.saved_bytes, "first": first.peak_bytes, "later": later.peak_bytes, "host": first.host_bytes}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--rows", nargs="*", default=list(ROWS), choices=list(ROWS))
    args = p.parse_args(argv)
    print("| model | options | saved (predicted / real) | first step peak (predicted / real) | "
          "later steps peak (predicted / real) | host bytes (predicted / real) | time |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        for row in args.rows:
            start = time.time()
            pr, re = predicted(MODELS[name], ROWS[row]), real(MODELS[name], ROWS[row])
            cells = " | ".join(f"{pr[k]:,} / {re[k]:,}" for k in ("saved", "first", "later", "host"))
            opts = ", ".join(f"{k}={v}" for k, v in ROWS[row].items()) or "(plain loop)"
            print(f"| {name} | `{opts}` | {cells} | {time.time() - start:.0f} s |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
