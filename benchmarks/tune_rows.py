"""graphmem's predictions for the rows of torchtune's "optimization flags" table: a full fine-tune of
Llama-3.2-3B on one A100 80GB, each row adding one flag to the one before, with the time and memory each
prediction took.

The job as torchtune's single-device full-finetune recipe runs it (recipes/full_finetune_single_device.py):
pure bf16 parameters (no fp32 master, no autocast), batch 2 x 4096 tokens, torch.optim.AdamW, the logits
dropped before backward (``del logits``: ``release_output=True``). The model is transformers'
``LlamaForCausalLM`` built from the bundled ``llama-3.2-3b`` preset (meta-llama/Llama-3.2-3B's config.json)
on the meta device, SDPA attention; torchtune runs its own Llama module, which this does not. The loss
(``--loss``): ``hf``, transformers' own loss over the whole logits (``labels``), or ``chunked``, torchtune's
``CEWithChunkedOutputLoss`` as its 3B configs set it (the output projection per chunk, outside the model's
forward). The published figures are not in this repository: the script prints predictions only.

    python benchmarks/tune_rows.py                     # every row (minutes each on 2 CPU cores)
    python benchmarks/tune_rows.py --rows 1 2          # the baseline and + activation checkpointing
    python benchmarks/tune_rows.py --loss chunked      # torchtune's chunked cross-entropy
    python benchmarks/tune_rows.py --layers 2 --shape 2x128   # a quick smoke run on a 2-layer model
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

GIB = 2 ** 30

# (row, analyze keywords, activation checkpointing of every decoder layer); each adds to the one before
ROWS: list[tuple[str, dict[str, Any], bool]] = [
    ("baseline", {"optimizer": "adamw"}, False),
    ("+ activation checkpointing", {"optimizer": "adamw"}, True),
    ("+ optimizer step fused into backward", {"optimizer": "adamw", "optimizer_in_backward": True}, True),
    ("+ activation offloading", {"optimizer": "adamw", "optimizer_in_backward": True,
                                 "offload_activations": True}, True),
    ("+ 8-bit AdamW (bitsandbytes)", {"optimizer": "adamw8bit", "optimizer_in_backward": True,
                                      "offload_activations": True}, True),
]
TARGET = {"device": "cuda", "gpu": "a100", "dtype": "bf16", "attention": "auto"}


def build(layers: int | None) -> Any:
    """transformers' Llama-3.2-3B from the bundled preset, bf16 on the meta device (``layers``: fewer decoder
    layers, for a quick run)."""
    from graphmem.capture.hf import build as build_hf
    from graphmem.capture.hf import make_config
    from graphmem.capture.presets_hf import HF_PRESETS
    from graphmem.capture.target import Target

    raw = dict(HF_PRESETS["llama-3.2-3b"][1])
    if layers is not None:
        raw["num_hidden_layers"] = layers
    config = make_config(raw, False, "llama-3.2-3b")
    return build_hf(config, Target(device="cuda", dtype="bf16", gpu="a100"), False)


CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default num_output_chunks


class ChunkedOutput(torch.nn.Module):
    """The transformers model's decoder, then its output projection per chunk of the sequence, as torchtune's
    ``TransformerDecoder`` does after ``set_num_output_chunks`` (torchtune/modules/transformer.py
    ``chunked_output``: ``[self.output(chunk) for chunk in h.chunk(n, dim=1)]``)."""

    def __init__(self, lm: Any) -> None:  # a transformers LlamaForCausalLM
        super().__init__()
        self.lm = lm

    def forward(self, tokens: torch.Tensor) -> list[torch.Tensor]:
        h = self.lm.model(input_ids=tokens, use_cache=False).last_hidden_state
        return [self.lm.lm_head(chunk) for chunk in h.chunk(CHUNKS, dim=1)]


def chunked_loss(logits: list[torch.Tensor], inputs: tuple[torch.Tensor]) -> torch.Tensor:
    """torchtune's ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py): per chunk
    ``F.cross_entropy(chunk.float(), labels, reduction="sum")``, summed, over the number of labels; the labels
    shifted by one as the recipe does (``torch.hstack((labels[..., 1:], ignore))``)."""
    tokens = inputs[0]
    ignore = torch.full_like(tokens[:, :1], -100)
    labels = torch.hstack((tokens[:, 1:], ignore))
    total = torch.zeros((), device=tokens.device)
    for chunk, target in zip(logits, labels.chunk(CHUNKS, dim=1)):
        total = total + F.cross_entropy(chunk.reshape(-1, chunk.size(-1)).float(), target.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total / (labels != -100).sum()


def predict(options: dict[str, Any], checkpoint: bool, shape: str, layers: int | None, chunked: bool) -> dict[str, Any]:
    import graphmem
    from graphmem.capture.load import parse_shape
    from graphmem.passes.allocator import allocator, later_steps_events, simulate

    model = build(layers)
    if checkpoint:  # every decoder layer, non-reentrant, as torchtune's checkpoint_wrapper
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    t0 = time.perf_counter()
    if chunked:
        tokens = torch.zeros(parse_shape(shape), dtype=torch.long, device="meta")
        report = graphmem.analyze(ChunkedOutput(model), (tokens,), loss=chunked_loss, release_output=True,
                                  **TARGET, **options)
    else:
        report = graphmem.analyze(model, input_shape=shape, release_output=True, **TARGET, **options)
    b = report.budget
    assert b is not None and report.step is not None
    first, later = allocator(report.step), simulate(later_steps_events(report.step))
    seconds = time.perf_counter() - t0
    return {"peak": b.peak_bytes / GIB, "at": f"{b.rank.peak_phase}, {b.rank.peak_op}",
            "later": b.rank.later_peak_bytes / GIB, "later at": b.rank.later_peak_phase, "first alloc": first.max_allocated / GIB,
            "later alloc": later.max_allocated / GIB, "host": b.host_bytes / GIB, "seconds": seconds,
            "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", help="row numbers (1-based); default all")
    p.add_argument("--shape", default="2x4096", help="batch x tokens (default 2x4096)")
    p.add_argument("--layers", type=int, help="decoder layers (default the published 28)")
    p.add_argument("--loss", choices=["hf", "chunked"], default="hf",
                   help="hf: transformers' own loss over the whole logits; chunked: torchtune's "
                   f"CEWithChunkedOutputLoss ({CHUNKS} chunks)")
    args = p.parse_args(argv)
    print(f"Llama-3.2-3B{'' if args.layers is None else f' ({args.layers} layers)'}, {args.shape}, pure bf16, {args.loss} loss, "
          "CUDA target (A100), release_output=True; predictions (the published figures are not in this repository)")
    print("| row | peak, first step (GiB) | peak at | later steps (GiB), at | max allocated first / later (GiB) | "
          "host bytes (GiB) | time (s) | peak RSS (GiB) |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for i, (name, options, checkpoint) in enumerate(ROWS, 1):
        if args.rows and i not in args.rows:
            continue
        r = predict(options, checkpoint, args.shape, args.layers, args.loss == "chunked")
        print(f"| {i}. {name} | {r['peak']:.2f} | {r['at']} | {r['later']:.2f}, {r['later at']} | {r['first alloc']:.2f} / "
              f"{r['later alloc']:.2f} | {r['host']:.2f} | {r['seconds']:.0f} | {r['rss']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
