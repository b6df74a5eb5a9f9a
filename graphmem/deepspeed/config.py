"""A DeepSpeed job as one frozen value: its config (a dict or a JSON path, as ``deepspeed.initialize(config=...)``
takes it), checked once where it is built, and the rank analyzed.

Checked here, each a one-line error naming the fix: a config file that does not exist or is not JSON, a
top-level key DeepSpeed does not know (DeepSpeed itself ignores one; a typo would silently change the
job), a ZeRO stage other than 0-3, a ``zero_optimization`` key DeepSpeed's own pydantic model refuses
(deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``, ``extra="forbid"``), NVMe offload, what of CPU
offload does not run on fake tensors (``_check_offload``: DeepSpeedCPUAdam; a torch optimizer needs
``zero_force_ds_cpu_optimizer: false``, as DeepSpeed itself says), and fp16 (``_check_fp16``).

``"auto"`` values are resolved as transformers' ``HfTrainerDeepSpeedConfig`` resolves them
(transformers/integrations/deepspeed.py ``trainer_config_process`` and ``trainer_config_finalize``)
with TrainingArguments' defaults: the batch sizes from the batch (``train_micro_batch_size_per_gpu``:
its first dimension; ``gradient_accumulation_steps``: 1; ``train_batch_size``: world size x both),
``gradient_clipping`` 1.0 (``max_grad_norm``), the optimizer's ``lr`` 5e-5, ``betas`` [0.9, 0.999],
``eps`` 1e-8, ``weight_decay`` 0.0, ``fp16``/``bf16.enabled`` false, and from the model's
``config.hidden_size`` h: ``reduce_bucket_size`` h², ZeRO-3's ``stage3_prefetch_bucket_size`` 0.9 h²
and ``stage3_param_persistence_threshold`` 10 h. Any other ``"auto"`` is refused in one line.
"""
from __future__ import annotations

import copy
import difflib
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch.nn as nn

from graphmem.errors import UsageError
from graphmem.jsontypes import JSON
from graphmem.passes.budget import Parallel

if TYPE_CHECKING:
    from graphmem.capture.target import Target
    from graphmem.training.spec import Training

# top-level sections DeepSpeed 0.19 reads (deepspeed/runtime/config.py DeepSpeedConfig._initialize_params and the
# string constants of deepspeed/runtime/constants.py, read at check time); these are read by other modules
_SECTIONS = {"zero_optimization", "optimizer", "scheduler", "fp16", "bf16", "amp", "activation_checkpointing",
             "flops_profiler", "comms_logger", "monitor_config", "tensorboard", "wandb", "csv_monitor", "comet",
             "aio", "autotuning", "compression_training", "data_efficiency", "checkpoint", "elasticity",
             "nebula", "pipeline", "curriculum_learning", "zero_allow_untested_optimizer",
             "zero_force_ds_cpu_optimizer", "torch_autocast", "compile", "weight_quantization", "hybrid_engine",
             "tensor_parallel", "data_types", "timers", "dataloader_drop_last", "eigenvalue", "progressive_layer_drop",
             "quantize_training", "sparse_attention", "sparse_gradients", "gradient_predivide_factor",
             "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "seq_parallel_communication_data_type",
             "communication_data_type", "prescale_gradients", "disable_allgather", "train_batch_size",
             "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping", "graph_harvesting",
             "use_data_before_expert_parallel_", "zenflow", "expert_data_topo_config", "mpu", "mics_shard_size"}
_BATCH = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
_TRAINING_ARGS: dict[str, JSON] = {"gradient_clipping": 1.0, "optimizer.params.lr": 5e-5, "optimizer.params.betas": [0.9, 0.999],
                  "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.0, "fp16.enabled": False,
                  "bf16.enabled": False}
_HIDDEN = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
           "zero_optimization.stage3_param_persistence_threshold")

class SpecView(Protocol):
    """What a DeepSpeed setting's ``check`` reads of the step (graphmem/step/spec.py ``StepSpec``, a layer above)."""

    @property
    def target(self) -> Target: ...

    @property
    def training(self) -> Training: ...


@dataclass(frozen=True)
class DeepSpeedJob:
    """Rank ``rank`` of ``world_size`` ranks of a job that DeepSpeed's own engine runs
    (``deepspeed.initialize`` + ``engine.backward`` + ``engine.step``: graphmem/deepspeed/capture.py)."""

    text: str  # the config as canonical JSON (what the job compares by)
    world_size: int = 2
    rank: int = 0
    formula = Parallel()  # the engine splits the step itself: no formula over it

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.text)

    @property
    def stage(self) -> int:
        return int(self.config.get("zero_optimization", {}).get("stage", 0))

    def describe(self) -> str:
        c = self.config
        dtype = "bf16" if c.get("bf16", {}).get("enabled") is True else "fp16" \
            if c.get("fp16", {}).get("enabled") is True else "fp32"
        gas, clip = c.get("gradient_accumulation_steps"), c.get("gradient_clipping")
        clip = _TRAINING_ARGS["gradient_clipping"] if clip == "auto" else clip
        parts = [dtype] + ([f"{gas} micro-steps"] if isinstance(gas, int) and gas > 1 else []) \
            + ([f"clipping {clip:g}"] if isinstance(clip, (int, float)) and clip > 0 else [])
        for part, what in (("offload_optimizer", "optimizer"), ("offload_param", "parameters")):
            if _offloads(c, part):  # (pin_memory: DeepSpeed's default true, deepspeed/runtime/zero/offload_config.py)
                parts.append(f"{what} on the host" + (" (pinned)" if c["zero_optimization"][part].get("pin_memory", True)
                                                       else ""))
        return f"DeepSpeed ZeRO-{self.stage} ({', '.join(parts)}), rank {self.rank} of {self.world_size}"

    def check_cuda(self) -> None:
        """What of the job the CUDA target does not run yet (graphmem/deepspeed/host.py), in one line."""
        if _offloads(self.config, "offload_param"):
            raise UsageError("`offload_param` is analyzed on `device='cpu'` only yet: on a GPU, ZeRO-3 copies each "
                             "host partition to the device before its all-gather, a copy DeepSpeed's CPU accelerator, "
                             "which graphmem runs, never makes (graphmem/deepspeed/host.py)")

    def offloads(self, part: str) -> bool:
        """Its config offloads ``part`` ("offload_optimizer" or "offload_param") to the CPU."""
        return _offloads(self.config, part)

    def check(self, spec: SpecView) -> None:
        """What of graphmem's own loop does not combine with DeepSpeed's (its config says it)."""
        tr = spec.training
        train = tr.train
        if tr.lora is not None or tr.quantization is not None or train.master_weights or train.loop_options \
                or train.micro_batches > 1 or spec.target.mode == "compiled":
            raise UsageError("a DeepSpeed job's step is its config's: give `gradient_accumulation_steps`, "
                             "`gradient_clipping`, `bf16`/`fp16` there, and drop `micro_batches`, `master_weights`, "
                             "`lora_rank`, `qlora`, the loop options and `mode='compiled'`")
        if spec.target.device == "cuda":
            self.check_cuda()
        if train.optimizer is None and "optimizer" not in self.config:
            raise UsageError("a DeepSpeed job needs an optimizer: an `optimizer` section in its config, or "
                             "`optimizer='adamw'` (a torch.optim class passed to deepspeed.initialize)")
        if train.optimizer is not None and "optimizer" in self.config:
            raise UsageError("the DeepSpeed config names an optimizer and so does `optimizer`: give one")
        if train.optimizer is not None:
            check_torch_optimizer_offload(self.config)

def _load(config: object) -> dict[str, Any]:
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if not os.path.isfile(path):
            raise UsageError(f"DeepSpeed config {path!r} does not exist: give a JSON file or a dict")
        try:
            with open(path) as f:
                loaded = json.load(f)
        except json.JSONDecodeError as e:
            raise UsageError(f"DeepSpeed config {path!r} is not JSON ({e.msg}, line {e.lineno})") from None
        if not isinstance(loaded, dict):
            raise UsageError(f"DeepSpeed config {path!r} must hold a JSON object")
        return loaded
    raise UsageError(f"`deepspeed` takes a config dict or a JSON path, not {type(config).__name__}")

_OBJECTS = (("zero_optimization", '{"stage": 2}'), ("bf16", '{"enabled": true}'), ("fp16", '{"enabled": true}'),
            ("optimizer", '{"type": "AdamW", "params": {"lr": 1e-3}}'), ("scheduler", '{"type": "WarmupLR"}'),
            ("activation_checkpointing", '{"partition_activations": false}'))


def _check_keys(c: dict[str, Any]) -> None:
    for key in c:
        if key not in _SECTIONS:
            close = difflib.get_close_matches(key, sorted(_SECTIONS), n=1)
            raise UsageError(f"unknown DeepSpeed config key {key!r}" + (f": did you mean {close[0]!r}?" if close else
                             " (DeepSpeed would ignore it): remove it"))
    for section, example in _OBJECTS:  # (DeepSpeed's pydantic models take these as objects only)
        if section in c and not isinstance(c[section], dict):
            raise UsageError(f"DeepSpeed's `{section}` must be an object, e.g. {example}, not {c[section]!r}")
    for part in ("offload_optimizer", "offload_param"):
        if not isinstance(c.get("zero_optimization", {}).get(part) or {}, dict):
            raise UsageError(f"DeepSpeed's `zero_optimization.{part}` must be an object, e.g. {{\"device\": \"cpu\"}}")
    zero = c.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        raise UsageError(f"ZeRO stage {stage!r} does not exist: `zero_optimization.stage` is 0, 1, 2 or 3")
    for part in ("offload_optimizer", "offload_param"):
        device = (zero.get(part) or {}).get("device", "none")
        if device == "nvme":
            raise UsageError(f"`zero_optimization.{part}.device` \"nvme\" (ZeRO-Infinity) is not analyzed: its "
                             "buffers live in files and pinned host memory outside torch's allocator; use \"cpu\" or none")
    _check_offload(c, zero)


def check_torch_optimizer_offload(c: dict[str, Any]) -> None:
    """A torch optimizer (``optimizer=``, or a Trainer's) under CPU offload: DeepSpeed raises
    ``ZeRORuntimeException`` unless the config sets ``zero_force_ds_cpu_optimizer`` false
    (deepspeed/runtime/engine.py ``_configure_basic_optimizer``), in one line."""
    if _offloads(c, "offload_optimizer") and c.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise UsageError("DeepSpeed refuses a torch optimizer with CPU offload unless the config sets "
                         "`\"zero_force_ds_cpu_optimizer\": false` (its DeepSpeedCPUAdam, a C++ op, does not run "
                         "on fake tensors): add it")


def offloads_parameters(config: object) -> bool:
    """A DeepSpeed config (a dict or a JSON path, as ``make_job`` takes it) that offloads ZeRO-3's parameters to the
    CPU; False where it cannot be read or is malformed (``make_job`` says why, in one line, where the job is built)."""
    try:
        return _offloads(_load(config), "offload_param")
    except (UsageError, OSError, AttributeError):
        return False


def _offloads(c: dict[str, Any], part: str) -> bool:
    return (c.get("zero_optimization", {}).get(part) or {}).get("device") == "cpu"


def _check_offload(c: dict[str, Any], zero: dict[str, Any]) -> None:
    """CPU offload runs through DeepSpeed's engine with a torch optimizer stepping the host partitions; what
    does not, in one line: DeepSpeedCPUAdam (deepspeed/runtime/engine.py ``get_optimizer_configuration`` picks it
    for a config optimizer under offload unless its params say ``torch_adam``; its step, deepspeed/ops/adam/
    cpu_adam.py ``step`` -> ``ds_opt_adam.adam_update``, reads ``params.data_ptr()`` in its C++ op,
    csrc/adam/cpu_adam_impl.cpp, which a fake tensor refuses; not built here), ``offload_param`` below ZeRO-3 (stage3.py reads it), and the partial and Superchip
    offloads (``ratio``, ``super_offload``: not checked against a real run)."""
    if _offloads(c, "offload_param") and zero.get("stage", 0) != 3:
        raise UsageError("`zero_optimization.offload_param` offloads ZeRO-3's parameter partitions: use it with "
                         "`\"stage\": 3` (or `offload_optimizer` on stage 1/2)")
    if not _offloads(c, "offload_optimizer"):
        return
    opt = zero["offload_optimizer"]
    if opt.get("ratio", 1.0) != 1.0 or opt.get("super_offload"):
        raise UsageError("`zero_optimization.offload_optimizer.ratio` below 1 and `super_offload` are not checked "
                         "against a real run yet: offload the whole optimizer (drop them)")
    optimizer = c.get("optimizer")
    if isinstance(optimizer, dict) and not (optimizer.get("params") or {}).get("torch_adam"):
        raise UsageError("CPU offload steps a config optimizer with DeepSpeedCPUAdam, a C++ op that fake tensors "
                         "cannot run: set `\"zero_force_ds_cpu_optimizer\": false` with a torch optimizer "
                         "(`optimizer='adamw'`), or `\"torch_adam\": true` in the optimizer's params")

def _check_zero_model(zero: dict[str, JSON]) -> None:
    """DeepSpeed's own check of the ZeRO section (pydantic, unknown keys forbidden), in one line."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    try:
        DeepSpeedZeroConfig(**{k: v for k, v in zero.items() if v != "auto"})
    except Exception as e:  # pydantic's ValidationError: the first problem, one line
        errors: list[dict[str, Any]] = list(getattr(e, "errors", lambda: [])())
        first = errors[0] if errors else {"loc": (), "msg": str(e).splitlines()[0]}
        where = ".".join(str(p) for p in first.get("loc", ()))
        close = difflib.get_close_matches(where, sorted(DeepSpeedZeroConfig.model_fields), n=1) \
            if first.get("type") == "extra_forbidden" else []
        raise UsageError(f"DeepSpeed refuses `zero_optimization.{where}`: {first['msg']}"
                         + (f" (did you mean {close[0]!r}?)" if close else "")) from None

def _check_fp16(c: dict[str, JSON]) -> None:
    """fp16 runs only where DeepSpeed's CPU accelerator says it does: ``CPU_Accelerator.is_fp16_supported``
    (deepspeed/accelerator/cpu_accelerator.py) asks oneDNN (``torch.ops.mkldnn._is_mkldnn_fp16_supported``),
    and ``DeepSpeedEngine._do_sanity_check`` (deepspeed/runtime/engine.py) raises "Type fp16 is not supported
    on your device." where it is not; where it is, fp16 and its loss scaler are not checked against a real run yet."""
    fp16 = c.get("fp16")
    if not isinstance(fp16, dict) or fp16.get("enabled") is not True:
        return
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    why = "is not checked against a real run yet" if CPU_Accelerator().is_fp16_supported() else \
        "does not run on DeepSpeed's CPU accelerator here (oneDNN has no fp16 on this CPU: its is_fp16_supported() is false)"
    raise UsageError(f"DeepSpeed's `fp16.enabled` {why}: use `bf16` ({{\"bf16\": {{\"enabled\": true}}}}) or fp32")

def _autos(c: JSON, prefix: str = "") -> list[str]:
    if isinstance(c, dict):
        return [k for key, v in c.items() for k in _autos(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if c == "auto" else []

def make_job(config: object, world_size: int = 2, rank: Optional[int] = None) -> DeepSpeedJob:
    """The job of ``config`` (a dict or a JSON path) at ``rank`` of ``world_size``, checked."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"`world_size` must be a positive integer, got {world_size!r}")
    r = 0 if rank is None else rank
    if not 0 <= r < world_size:
        raise UsageError(f"`rank={r}` is not one of the job's {world_size} ranks: use 0 to {world_size - 1}")
    c = _load(config)
    _check_keys(c)
    _check_zero_model(c.get("zero_optimization", {}))
    _check_fp16(c)
    left = [k for k in _autos(c) if k not in _BATCH and k not in _TRAINING_ARGS and k not in _HIDDEN]
    if left:
        raise UsageError(f"DeepSpeed config value \"auto\" for `{left[0]}` is not resolved here (only what "
                         "transformers' HfTrainerDeepSpeedConfig fills from TrainingArguments' defaults, the batch "
                         "and the model's hidden size): give a value")
    return DeepSpeedJob(json.dumps(c, sort_keys=True), world_size, r)

def _set(c: dict[str, Any], dotted: str, value: JSON) -> None:
    *path, last = dotted.split(".")
    for p in path:
        c = c.get(p, {})
    if c.get(last) == "auto":
        c[last] = value

def resolved(job: DeepSpeedJob, model: nn.Module, micro_batch: int) -> dict[str, Any]:
    """The config with its ``"auto"`` values filled as the module docstring says."""
    c = job.config
    for key, value in _TRAINING_ARGS.items():
        _set(c, key, value)
    _set(c, "train_micro_batch_size_per_gpu", micro_batch)
    _set(c, "gradient_accumulation_steps", 1)
    micro, accumulation = c.get("train_micro_batch_size_per_gpu"), c.get("gradient_accumulation_steps", 1)
    if isinstance(micro, int) and isinstance(accumulation, int):
        _set(c, "train_batch_size", job.world_size * micro * accumulation)
    if c.get("train_batch_size") is None and c.get("train_micro_batch_size_per_gpu") is None:
        c["train_micro_batch_size_per_gpu"] = micro_batch  # what the analyzed batch is
    if any(k in _autos(c) for k in _HIDDEN):
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        if not isinstance(hidden, int):
            raise UsageError("DeepSpeed's \"auto\" bucket sizes come from the model's `config.hidden_size`, which this "
                             "model has not: give them values")
        _set(c, "zero_optimization.reduce_bucket_size", hidden * hidden)
        _set(c, "zero_optimization.stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        _set(c, "zero_optimization.stage3_param_persistence_threshold", 10 * hidden)
    return c

__all__ = ["DeepSpeedJob", "check_torch_optimizer_offload", "make_job", "offloads_parameters", "resolved"]

