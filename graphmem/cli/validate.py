"""`graphmem validate`: one REAL training step beside the prediction (graphmem/validation/validate.py).

Exit codes: 0 within tolerance; 1 outside it (the table still goes to stdout, the reason is
one stderr line); 2 usage errors (no GPU for --device cuda, a step over the memory budget).
"""
from __future__ import annotations

import argparse
import json
import sys

from graphmem.cli.options import (
    add_debug_argument,
    add_loop_arguments,
    add_model_arguments,
    add_parallel_arguments,
    add_trainer_batch_arguments,
    hf_of,
    loop_options,
    per_rank_options,
)
from graphmem.errors import UsageError
from graphmem.step.options import AMP, DTYPES


class Validate:
    name = "validate"
    help = "run one training step for real and compare it with the prediction"

    def prepare_parser(self, p: argparse.ArgumentParser) -> None:
        add_model_arguments(p, shape_required=False, real=True)  # --training-args with --train-dataset: the Trainer's
        p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where to run the real step (default cpu)")
        p.add_argument("--dtype", choices=DTYPES, help="parameter dtype of the real model (default: as built)")
        p.add_argument("--amp", choices=AMP, help="autocast with fp32 parameters")
        add_parallel_arguments(p, add_loop_arguments(p))  # --world-size with --fsdp/--tp: real gloo ranks, one row set each
        p.add_argument("--tolerance", type=float, metavar="PCT",
                       help="allowed peak gap, percent of the measured peak (default 1; CPU convnets need ~2.5)")
        p.add_argument("--json", action="store_true", help="print the comparison as JSON (exact integers)")
        p.add_argument("--training-args", metavar="PATH",
                       help="a JSON or YAML file of transformers TrainingArguments: validate the step a Trainer "
                            "around the (Hugging Face) model runs, on the CPU; with --world-size N [--rank R], its DDP "
                            "ranks against a real job of N gloo processes")
        add_trainer_batch_arguments(p)
        add_debug_argument(p)

    def run(self, args: argparse.Namespace) -> int:
        return _validate(args)


def _validate(args: argparse.Namespace) -> int:
    from graphmem.cli.progress import quiet
    from graphmem.render.validate import render_validation
    from graphmem.validation.validate import validate

    if args.train_dataset and not args.training_args:
        raise UsageError("--train-dataset is the Trainer's: give --training-args too")
    if args.input_shape is None and not args.train_dataset:
        raise UsageError("give --input-shape (e.g. 2x128), or --training-args with --train-dataset: the batch the "
                         "Trainer's dataloader yields")
    with quiet(args.json):
        if args.training_args:  # a transformers Trainer around the model, built for real on the CPU
            from graphmem.capture.load import load
            from graphmem.frontends.trainer import trainer_from_file
            from graphmem.training.hf_trainer import is_trainer
            from graphmem.validation.trainer import trainer_on_cuda, validate_trainer

            if args.device != "cpu":  # on a machine without a GPU, first say so (as validate --device cuda does)
                trainer_on_cuda("--training-args validates the Trainer's step on the CPU only yet: drop --device cuda "
                                "(analyze --device cuda predicts its CUDA step)")
            split = sorted(set(per_rank_options(args)) - {"world_size", "rank"})
            if split:
                raise UsageError("--training-args validates the Trainer's own step, per rank as a DDP job (--world-size N "
                                 f"[--rank R]); drop {', '.join('--' + k.replace('_', '-') for k in split)}")
            module = load(args.model, device="cpu", options=hf_of(args)).module
            trainer = trainer_from_file(module, args.training_args, train_dataset=args.train_dataset)
            if is_trainer(trainer):
                result = validate_trainer(trainer, input_shape=args.input_shape, tolerance=args.tolerance,
                                          world_size=args.world_size, rank=args.rank, trainer_batch=args.trainer_batch)
            else:  # FSDP arguments: the Trainer is built per rank (graphmem/validation/trainer_fsdp.py)
                result = validate(module, input_shape=args.input_shape, tolerance=args.tolerance, training_args=trainer,
                                  world_size=args.world_size, rank=args.rank)
        else:
            result = validate(args.model, input_shape=args.input_shape, device=args.device, tolerance=args.tolerance,
                              hf=hf_of(args), dtype=args.dtype, amp=args.amp, **loop_options(args),
                              **per_rank_options(args))
    sys.stdout.write(json.dumps({"validation": result.to_dict()}, indent=2) + "\n" if args.json
                     else render_validation(result))
    sys.stdout.flush()  # the table comes before the stderr line of a failure
    result.check()  # outside the tolerance: ValidationError, exit 1
    return 0
