"""Ground truth for a Trainer's DeepSpeed ranks: a REAL transformers Trainer with ``deepspeed=`` in its
TrainingArguments on gloo in ``world_size`` processes (torch.multiprocessing.spawn, a file store, the torchrun
environment, ``DS_ACCELERATOR=cpu``, ``use_cpu`` unset: it turns DeepSpeed off in accelerate). Each rank builds
the Trainer as graphmem does (graphmem/deepspeed/trainer.py ``build_ds_trainer``: the Trainer's
own ``__init__``), prepares it by the Trainer's own ``_prepare_for_training`` (accelerate's ``_prepare_deepspeed``
-> ``deepspeed.initialize`` on the real model) and steps it twice with the runner the capture runs
(``DeepSpeedRunner``: ``training_step`` -> ``accelerator.backward`` -> ``engine.backward`` and ``engine.step``,
then ``_clip_grad_norm``, the scheduler, ``zero_grad``), measured as tests/deepspeed_truth.py measures
DeepSpeed's engine: saved bytes with saved_tensors_hooks (the module's parameters excluded), held bytes of every
tensor alive in the process before and after each step (``gc.get_objects()``), the peak from the CPU allocator's
events with gloo's collectives settled.
"""
from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.deepspeed_truth import _recording_pins, decoder, held_bytes, host_bytes
from tests.dist_truth import _profiled
from tests.settle import COLLECTIVES, addresses, high, settle

# where DeepSpeed's communication backend JIT-builds its shared-memory all-reduce op (deepspeed/comm/torch.py
# ``build_shm_op``, for inference; nothing of a training step): this checkout's own cache, built once, so that
# ranks never wait on another environment's build of it in the shared ~/.cache/torch_extensions
EXTENSIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".venv", "torch_extensions")


def trainer_args(out: str, config: dict, **fields: Any) -> Any:
    """The TrainingArguments of these jobs: DeepSpeed's ``config``, 2 rows a rank, the Trainer's default optimizer.
    With ``bf16=True`` they are built as on a GPU machine: transformers' check for a bf16 GPU
    (training_args.py ``_validate_args``, ``is_torch_bf16_gpu_available``) answers yes while they are built, as
    DeepSpeed's bf16 engine, not torch's autocast, runs the bf16 (and ``use_cpu`` would turn DeepSpeed off)."""
    import transformers
    import transformers.training_args as training_args

    kept = training_args.is_torch_bf16_gpu_available
    training_args.is_torch_bf16_gpu_available = lambda *a, **k: True
    try:
        return transformers.TrainingArguments(output_dir=out, report_to=[], deepspeed=config,
                                              per_device_train_batch_size=2, save_strategy="no", **fields)
    finally:
        training_args.is_torch_bf16_gpu_available = kept


def _step(runner: Any, batch: dict, kept: list) -> dict[str, int]:
    """One Trainer step, measured (the module docstring); its last loss kept alive for the profiler, left out."""
    module = runner.engine.module
    params = lambda: {p.untyped_storage().data_ptr() for p in module.parameters()}  # noqa: E731 (ZeRO-3 gathers)
    saved: dict[int, int] = {}
    on = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if on[0] and st.data_ptr() not in params():
            saved[st.data_ptr()] = st.nbytes()
        return t

    def phase(name: str) -> None:
        if name == "forward":
            saved.clear()  # each micro-step saves the same: the last one's set is the step's
        on[0] = name in ("forward", "loss")

    before = held_bytes(kept)
    with _profiled() as prof, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = runner.run(module, batch, None, phase, contextlib.nullcontext)
    kept.append([loss])
    after = held_bytes(kept)
    held = addresses([t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type != "meta"])
    return {"saved": sum(saved.values()), "before": before, "after": after, "peak": before + high(prof, held)}


def _worker(rank: int, world_size: int, init: str, config: dict, fields: dict, out: str, kind: str = "llama") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
                      DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
                      OMP_NUM_THREADS=str(torch.get_num_threads()), TORCH_EXTENSIONS_DIR=EXTENSIONS)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size)
    unsettled = settle((*COLLECTIVES, "broadcast", "reduce", "all_reduce_coalesced", "reduce_scatter_tensor"))
    import accelerate.utils.deepspeed  # noqa: F401
    import deepspeed  # noqa: F401
    import transformers.integrations.deepspeed  # noqa: F401
    from transformers import Trainer

    from graphmem.deepspeed.trainer import DeepSpeedRunner

    try:
        # what these imports leave alive (module-level tensors: 144 B here, two int64 scalars and two (16,) fp32
        # tensors, from transformers.trainer's imports), made before any job and not the rank's memory, left out of the held bytes
        kept: list = [[t for t in gc.get_objects() if isinstance(t, torch.Tensor) and t.device.type != "meta"]]
        pinned: list = []
        _recording_pins(pinned)
        model, batch = decoder(kind=kind)
        args = trainer_args(os.path.dirname(out), config, **fields)
        trainer = Trainer(model=model, args=args)
        assert trainer.is_deepspeed_enabled
        runner = DeepSpeedRunner(trainer)
        with runner.session():
            runner.prepare()
            host = [host_bytes(runner.engine, pinned)]
            steps = [_step(runner, batch, kept)]
            host.append(host_bytes(runner.engine, pinned))
            steps.append(_step(runner, batch, kept))
        torch.save({"first": steps[0], "later": steps[1], "unsettled": unsettled[0],
                    "host": {"before": host[0], "after": host[1]}}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def measure_trainer_ranks(config: dict, fields: dict, world_size: int = 2, kind: str = "llama") -> list[dict]:
    """Each rank's {"first", "later": {"saved", "before", "after", "peak"}, "unsettled", "host": {"before", "after":
    {"pinned", "pageable"}}} (the host bytes under CPU offload, tests/deepspeed_truth.py ``host_bytes``), one job."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        mp.spawn(_worker, args=(world_size, f"file://{os.path.join(tmp, 'store')}", config, fields, out, kind),
                 nprocs=world_size, join=True)
        return [torch.load(f"{out}.{r}") for r in range(world_size)]


__all__ = ["measure_trainer_ranks", "trainer_args"]
