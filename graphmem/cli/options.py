"""The whole-step options of ``graphmem analyze`` (optimizer, precision recipe, LoRA,
micro-batches, per-rank parallelism); any of them adds the budget table to the report."""
from __future__ import annotations

import argparse

from graphmem.training.optim import IMPLS, OPTIMIZERS


def add_training_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training step (any of these adds the per-rank budget table)")
    g.add_argument("--optimizer", choices=list(OPTIMIZERS), help="run this torch.optim optimizer after backward, then zero_grad")
    g.add_argument("--optimizer-impl", default="auto", choices=list(IMPLS),
                   help="auto (torch.optim's choice on the target: foreach on cuda, for-loop on cpu), foreach, forloop, fused")
    g.add_argument("--master-weights", action="store_true",
                   help="fp32 master copy of the 16-bit parameters for the optimizer (with --dtype bf16/fp16: ZeRO's 16-psi recipe)")
    g.add_argument("--micro-batches", type=int, default=1, metavar="K", help="gradient accumulation: K micro-steps of --input-shape")
    g.add_argument("--lora-rank", type=int, metavar="R", help="LoRA adapters of rank R; every other parameter frozen")
    g.add_argument("--lora-targets", metavar="NAMES", help="comma-separated module-name substrings of the nn.Linear layers to adapt, e.g. c_attn,c_proj")
    g.add_argument("--world-size", type=int, default=1, metavar="N", help="ranks (data parallel x tensor parallel)")
    g.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage over the data-parallel ranks")
    g.add_argument("--fsdp", choices=["full", "grad-op"], help="FSDP sharding: full (FULL_SHARD) or grad-op (SHARD_GRAD_OP)")
    g.add_argument("--tp", type=int, default=1, metavar="T", help="tensor-parallel size (Megatron column/row linears, from the graph)")
    g.add_argument("--sp", action="store_true", help="sequence parallel with --tp: the tensors outside the TP regions split too")


def training_options(args: argparse.Namespace) -> dict:
    return {"optimizer": args.optimizer, "optimizer_impl": args.optimizer_impl, "master_weights": args.master_weights,
            "micro_batches": args.micro_batches, "lora_rank": args.lora_rank, "lora_targets": args.lora_targets,
            "world_size": args.world_size, "zero": args.zero, "fsdp": args.fsdp, "tp": args.tp, "sp": args.sp}
