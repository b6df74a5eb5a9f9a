"""The public entry point: ``graphmem.analyze``."""
from __future__ import annotations

from typing import Any, Optional, Union

from graphmem.capture.collector import gc_paused
from graphmem.errors import UsageError
from graphmem.frontends.door import spec_for
from graphmem.noise import quiet
from graphmem.passes.device_rows import NAMES, check_overrides
from graphmem.report.live import Analysis, report_of
from graphmem.step.measure import measure
from graphmem.step.spec import ModelLike, StepSpec, UserInputs
from graphmem.units import parse_bytes


@quiet  # third-party warnings about graphmem's own work, not the user's step (graphmem/noise.py)
def analyze(model: Union[ModelLike, StepSpec], inputs: Optional[UserInputs] = None, *,
            overheads: Optional[dict[str, Any]] = None, **options: Any) -> Analysis:
    """Analyze one training step (forward, loss, backward) on fake tensors.

    ``model`` is a transformers ``Trainer`` (its own step: graphmem/frontends/trainer.py; the batch its
    dataloader yields, ``trainer_batch="longest"`` for the run's largest, or ``inputs`` or ``input_shape``, ``device="cuda"`` for its step on the CUDA target, and ``world_size``/``rank`` for one rank of its DDP job; a Hugging Face model with
    ``training_args=`` TrainingArguments that ask for FSDP, ``world_size`` and ``rank``: that rank of the
    Trainer's job, accelerate's own FSDP2 wrapping it, graphmem/training/hf_trainer_fsdp.py), an nn.Module (real, or built under ``torch.device("meta")``; an fx.GraphModule
    is one), a ``torch.export.ExportedProgram`` (its example inputs are used when none are
    given), a path to a model file or a ``.pt2`` exported program, or a preset name. Give ``inputs`` (a tensor or tuple of tensors; only shapes
    and dtypes are used) or ``input_shape``. Nothing real is allocated and the module is left
    as it was. The target: ``device`` ("cpu" or "cuda"), ``dtype`` of the parameters ("fp32",
    "bf16", "fp16"), ``amp`` (autocast "bf16"/"fp16" with fp32 parameters), ``attention`` (the
    SDPA backend: "auto", "flash", "efficient", "cudnn", "math") and ``gpu`` ("h100", "a100", ...)
    for the CUDA backend rules. ``mode="compiled"`` predicts ``torch.compile(model)``'s step
    (AOTAutograd's graphs split by the min-cut partitioner, as the ``aot_eager`` backend runs
    them) and puts eager beside it in ``report.compiled``; ``memory_budget`` (0 to 1) sets
    torch.compile's ``activation_memory_budget`` for the partition (``report.memory_budgets``
    sweeps several values). ``reuse`` (default on): a chain of
    >= 16 identical blocks is captured at depth 5 and the other blocks copied, after a check at
    depth 6 (graphmem/capture/reuse.py), in eager and compiled mode (where the partition must
    also repeat at full depth; if not, every block is compiled and a note says why);
    ``reuse=False`` captures every block.

    The training loop (optimizer, micro-batches, LoRA/QLoRA), the per-rank budgets (ZeRO, FSDP, tensor,
    sequence and pipeline parallel) and rank r's step through PyTorch's own wrappers or DeepSpeed's engine
    are keyword options too (docs/spec.md, "Options"): they build the step as one frozen value, a ``StepSpec``
    (graphmem/step/spec.py ``make_spec``), checked once, which ``graphmem.analyze(spec)`` also takes directly.

    ``report.memory`` is the run's (passes/run_memory.py): the first and later steps' max allocated
    and reserved, the run's maximum and, on the CUDA target, the device total with the rows outside
    the caching allocator (passes/device_rows.py); ``overheads`` replaces their figures, e.g.
    ``overheads={"cuda_context": "600MiB", "nccl": "300MiB"}``.

    >>> import torch, graphmem
    >>> net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    >>> report = graphmem.analyze(net, (torch.randn(8, 16),))
    >>> report.activation_bytes          # input (512 B) + ReLU output (1024 B), saved for backward
    1536
    """
    given = parse_overheads(overheads)
    with gc_paused():  # (each recorded step still starts from a collection: graphmem/capture/collector.py)
        return report_of(measure(spec_for(model, inputs, **options)), given)


def parse_overheads(overheads: Optional[dict[str, Any]]) -> dict[str, int]:
    """``overheads`` (row name -> bytes or a size like "600MiB") checked: names from
    passes/device_rows.py's NAMES."""
    if overheads is None:
        return {}
    if not isinstance(overheads, dict):
        raise UsageError(f"overheads must be a dict of row name -> size, e.g. {{'cuda_context': '600MiB'}}, "
                         f"not {type(overheads).__name__}")
    unknown = check_overrides(overheads)
    if unknown is not None:
        raise UsageError(f"overheads: no device row named {unknown!r}; the rows are {', '.join(NAMES)}")
    out = {}
    for name, size in overheads.items():
        value = parse_bytes(size) if isinstance(size, str) else size
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"overheads[{name!r}] must be a non-negative int (bytes) or a size like '600MiB', "
                             f"not {size!r}")
        out[name] = value
    return out


__all__ = ["analyze", "parse_overheads", "report_of"]
