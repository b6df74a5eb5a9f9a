"""A validation (graphmem/validation/validate.py) as text: predicted and measured bytes side
by side, and the verdict."""
from __future__ import annotations

from tabulate import tabulate

from graphmem.validation.ranks import REPEATS, TRAINER_REPEATS
from graphmem.validation.result import Row, Validation


def _verdict(r: Row, tolerance: float) -> str:
    if r.ok is None:
        return "-"
    rule = "exact" if r.rule == "exact" else f"within {tolerance:g} %, not above"
    return f"{'ok' if r.ok else 'FAIL'} ({rule})"


def render_validation(v: Validation) -> str:
    """The side-by-side table (exact bytes) and the verdict."""
    shapes = ", ".join("x".join(map(str, s)) for s in v.input_shapes) or "-"
    ranked = bool(v.ranks)  # a per-rank validation: each row names its gloo rank
    rows = [[*([r.rank] if ranked else []), r.name, f"{r.predicted:,}", f"{r.measured:,}", f"{r.difference:+,}",
             "-" if r.percent is None else f"{r.percent:+.3f} %", _verdict(r, v.tolerance)] for r in v.rows]
    table = tabulate(rows, headers=[*(["rank"] if ranked else []), "bytes", "predicted", "measured", "difference", "%",
                                    "verdict"],
                     tablefmt="simple", colalign=(*(("right",) if ranked else ()), "left", "right", "right", "right",
                                                  "right", "left"))
    if v.device == "cpu":
        how = ("measured: saved_tensors_hooks on the real forward (distinct storages) and the CPU allocator's "
               "events (torch.profiler). A kernel's scratch inside one op is invisible to fake tensors, so the "
               "prediction may be below the real peak, never above (CPU convnets: ~2.5 %, oneDNN scratch).")
    else:
        how = ("measured after a warm-up step: torch.cuda.max_memory_allocated() vs the allocated bytes at the step's "
               "start plus the predicted rise (caching-allocator model); reserved bytes depend on the cache the "
               "model build and warm-up left, shown for information.")
    verdict = "within tolerance" if v.ok else f"OUTSIDE tolerance: {v.reason}"
    budget = v.report.budget if v.report is not None else None
    loop = budget.training.train.describe(budget.device) if budget is not None else ""
    sharding = getattr(v.report, "sharding", None) if ranked else None
    ddp = getattr(budget.training.train, "world_size", 1) if ranked and budget is not None else 1  # a Trainer's DDP
    fsdp = bool(getattr(budget.training.train, "fsdp", False)) if budget is not None else False  # accelerate's FSDP2
    wrapper = "FSDP2 (accelerate)" if fsdp else "DistributedDataParallel"
    # a DeepSpeed job's rank ("DeepSpeed ZeRO-2 (fp32), rank 0 of 2"; through a Trainer "... (accelerate), ...")
    deepspeed = budget.whose if budget is not None and budget.whose.startswith("DeepSpeed") else ""
    job, _, of = deepspeed.partition(", rank ")
    where = f"{v.device}, {of.rpartition(' of ')[2]} gloo processes: {job}" if deepspeed else \
        f"{v.device}, {sharding.sharding.world_size} gloo processes: {sharding.wrappers()}" \
        if sharding is not None else f"{v.device}, {ddp} gloo processes: {wrapper}" if ddp > 1 else v.device
    if ranked:
        wrapped = ("rebuilding the Trainer as a torchrun rank does, accelerate running DeepSpeed's engine"
                   if "(accelerate)" in job else "running DeepSpeed's engine on its CPU accelerator with the capture's "
                   "optimizer, config and loop") if deepspeed else \
            f"rebuilding the Trainer as a torchrun rank does, accelerate wrapping {'FSDP2' if fsdp else 'DDP'}" \
            if ddp > 1 else "wrapped by the per-rank analysis's own call"
        repeats = TRAINER_REPEATS if ddp > 1 and not fsdp and not deepspeed else REPEATS
        how += (f" Each rank is a real process (gloo) {wrapped}; its collectives are held until gloo's thread has "
                "released them, so their buffers' frees are all seen"
                + ("." if repeats == 1 else f", and its least peak of {repeats} fresh steps is kept."))
    return (f"graphmem validate · {v.model} · input {shapes} · {where} · one real training step"
            f"{f' ({loop})' if loop else ''}\n\n"
            f"{table}\n\n{how}\n{verdict}\n")
