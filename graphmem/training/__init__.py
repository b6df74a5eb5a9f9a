"""The training step around forward and backward: the step itself (step.py: forward, loss,
backward), micro-batches and the optimizer step (loop.py, optim.py), LoRA adapters (lora.py),
and the training spec with the per-rank budget it reports (spec.py)."""
from graphmem.training.spec import StepBudget, Training, make_training
from graphmem.training.step import LossFn, default_loss, run_step

__all__ = ["LossFn", "default_loss", "run_step", "Training", "make_training", "StepBudget"]
