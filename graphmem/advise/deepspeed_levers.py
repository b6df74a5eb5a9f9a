"""Advise for a DeepSpeed job's rank (graphmem/deepspeed/): levers that change the job's DeepSpeed config,
each a new ``DeepSpeedJob`` in the StepSpec (``make_job``: the config's own checks), so that every row's
peak is DeepSpeed's engine run again on fake tensors with that config (graphmem/step/measure.py), what
``graphmem.analyze(..., deepspeed=changed)`` prints, never a formula.

- the ZeRO stage: each stage above the job's, up to 3 (``zero_optimization.stage``);
- ``zero_optimization.offload_optimizer`` to the CPU, the job's torch optimizer stepping on the host
  (``zero_force_ds_cpu_optimizer: false``; a config's own optimizer, DeepSpeedCPUAdam, is config.py's one-line refusal);
- smaller buckets: ``reduce_bucket_size`` and ``allgather_bucket_size`` set to h² elements for a model with a
  ``config.hidden_size`` h, what transformers' DeepSpeed integration sets for ``"auto"``
  (transformers/integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.trainer_config_finalize``:
  ``zero_optimization.reduce_bucket_size`` = hidden_size * hidden_size), else the model's largest parameter's
  elements; DeepSpeed's own description of both keys: "Limits the memory required ... for large model sizes"
  (deepspeed/runtime/zero/config.py ``DeepSpeedZeroConfig``, default 5e8 elements each);
- ZeRO-3's ``stage3_prefetch_bucket_size`` and ``stage3_max_live_parameters`` at the same h²
  (DeepSpeedZeroConfig: "Smaller values use less memory, but perform more communication");
- ``overlap_comm`` off where it is on (ZeRO-3's default: DeepSpeedZeroConfig ``overlap_comm_valid``): with it
  DeepSpeed keeps two reduce buckets, the one being reduced and the one being filled;
- the loop's levers on the job: its ``bf16`` section, the optimizer passed to ``deepspeed.initialize`` (another
  torch.optim class with ``zero_allow_untested_optimizer``: DeepSpeedEngine refuses an optimizer outside
  deepspeed/runtime/zero/utils.py ``ZERO_SUPPORTED_OPTIMIZERS`` without it), micro-batches as
  ``gradient_accumulation_steps``; the chunked loss is the model's own change (graphmem/advise/levers.py).

What does not apply to a DeepSpeed job is a row with its reason (``not_applicable``): FSDP2 and the ZeRO
formulas (the job's sharding is its config's), pipeline stages, LoRA, the checkpoint planner and the batch
formula (both plan the single-device step).
"""
from __future__ import annotations

import json
from typing import Any, Callable

from graphmem.advise.levers import _FUSED, ALTERNATIVES, Change, LeftOut, loss
from graphmem.analysis import AnalysisView
from graphmem.deepspeed.config import DeepSpeedJob, make_job
from graphmem.step.measure import deepspeed_job as job_of
from graphmem.step.spec import StepSpec
from graphmem.training.optim import resolved_impl
from graphmem.units import fmt_bytes

Levers = tuple[list[Change], list[LeftOut]]

NOTE = ("DeepSpeed rows: each is the job with its config changed, run again through DeepSpeed's engine on fake "
        "tensors (what graphmem analyze --deepspeed prints for that config); communication: ring collectives, "
        "(N-1)/N of each buffer")
_DEFAULT_BUCKET = 500_000_000  # DeepSpeedZeroConfig's reduce_bucket_size and allgather_bucket_size


def _configured(edit: Callable[[dict[str, Any]], None]) -> Callable[[StepSpec], StepSpec]:
    """The spec with its DeepSpeed job's config edited (a copy), checked again by ``make_job``."""
    def apply(s: StepSpec) -> StepSpec:
        job = job_of(s)
        assert job is not None  # only offered on a DeepSpeed job
        config = job.config
        edit(config)
        return s.replace(parallel=make_job(config, job.world_size, job.rank))
    return apply


def _zero(**keys: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.setdefault("zero_optimization", {}).update(keys)


def _keys(**keys: Any) -> str:
    return json.dumps({"zero_optimization": keys})


def _hidden(module: Any) -> tuple[int, str]:
    """The bucket size the levers set (the module docstring) and where it comes from."""
    h = getattr(getattr(module, "config", None), "hidden_size", None)
    if isinstance(h, int) and h > 0:
        return h * h, f"hidden_size² ({h}²), the value transformers' DeepSpeed integration gives \"auto\""
    largest = max((p.numel() for p in module.parameters()), default=1)
    return largest, "the model's largest parameter"


def _elements(value: Any, default: int) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


def deepspeed_levers(report: AnalysisView, base: StepSpec, make: Callable[[tuple[int, ...]], Any]
                     ) -> tuple[tuple[str, Callable[[], Levers]], ...]:
    """The levers of a DeepSpeed job, by kind, as graphmem/advise/advise.py weighs them."""
    return (("zero stage", lambda: stages(base)), ("offload", lambda: offload(base)),
            ("buckets", lambda: buckets(base)), ("overlap_comm", lambda: overlap(base)),
            ("loss", lambda: loss(report, base, make)), ("precision", lambda: precision(base)),
            ("optimizer", lambda: optimizer(base)), ("micro-batches", lambda: micro_batches(base)),
            ("other", lambda: ([], not_applicable(base))))


def _volume(base: StepSpec, job: DeepSpeedJob) -> tuple[int, str]:
    """Bytes of the model's parameters as the engine holds them (bf16 or fp32), and (N-1)/N."""
    e = 2 if job.config.get("bf16", {}).get("enabled") is True else 4
    psi = sum(p.numel() for p in base.module.parameters())
    return e * psi * (job.world_size - 1) // job.world_size, f"{job.world_size} ranks"


def stages(base: StepSpec) -> Levers:
    """Each ZeRO stage above the job's: 2 partitions the gradients too (the same bytes sent: a reduce-scatter
    instead of ZeRO-1's all-reduce), 3 the parameters too (all-gathered again in forward and backward)."""
    job = job_of(base)
    assert job is not None
    if job.stage == 3:
        return [], [LeftOut("zero stage", "the job runs ZeRO-3 already: parameters, gradients and optimizer "
                            "states are partitioned")]
    params, ranks = _volume(base, job)
    out = []
    for z in range(job.stage + 1, 4):
        extra = 2 * params if z == 3 else 0  # ZeRO-3: the parameters all-gathered in forward and again in backward
        cost = (f"communication {fmt_bytes(extra)} more per rank per step over {ranks} (parameters all-gathered in "
                "forward and backward)" if z == 3 else
                f"communication: no more bytes than ZeRO-{job.stage} over {ranks} (gradients reduce-scattered)"
                if job.stage >= 1 else "communication: gradients reduce-scattered instead of all-reduced")
        out.append(Change("zero stage", f"ZeRO-{z} instead of ZeRO-{job.stage}",
                          f"DeepSpeed config {_keys(stage=z)}: zero_optimization.stage={z}", cost, "communication",
                          _configured(_zero(stage=z)), extra))
    return out, []


def offload(base: StepSpec) -> Levers:
    """The optimizer's states and step on the CPU (``offload_optimizer.device`` "cpu")."""
    job = job_of(base)
    assert job is not None
    zero = job.config.get("zero_optimization", {})
    if (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None):
        return [], [LeftOut("offload", "the job offloads the optimizer already")]
    if job.stage == 0:
        return [], [LeftOut("offload", "offload_optimizer needs ZeRO 1-3 (zero_optimization.stage)")]
    setting = {"device": "cpu", "pin_memory": True}

    def edit(c: dict[str, Any]) -> None:  # the job's torch optimizer steps on the host (DeepSpeed's own check)
        _zero(offload_optimizer=setting)(c)
        c.setdefault("zero_force_ds_cpu_optimizer", False)
    return [Change("offload", "optimizer offloaded to the CPU",
                   f"DeepSpeed config {_keys(offload_optimizer=setting)} with \"zero_force_ds_cpu_optimizer\": false: "
                   "the torch optimizer steps the fp32 partition in host memory",
                   "memory vs speed trade-off: gradients to host and parameters back every step; the optimizer "
                   "steps on the CPU, its states in (pinned) host memory", "trade-off", _configured(edit))], []


def buckets(base: StepSpec) -> Levers:
    """Smaller reduce and all-gather buckets (ZeRO 1-2; ZeRO-3's prefetch and live-parameter limits too)."""
    job = job_of(base)
    assert job is not None
    if job.stage == 0:
        return [], [LeftOut("buckets", "ZeRO stage 0 has no reduce or all-gather buckets")]
    zero = job.config.get("zero_optimization", {})
    size, why = _hidden(base.module)
    keys: tuple[str, ...] = ("reduce_bucket_size", "allgather_bucket_size")
    if job.stage == 3:
        keys += ("stage3_prefetch_bucket_size", "stage3_max_live_parameters")
    defaults = {"stage3_prefetch_bucket_size": 50_000_000, "stage3_max_live_parameters": 1_000_000_000}
    smaller = {k: size for k in keys if _elements(zero.get(k), defaults.get(k, _DEFAULT_BUCKET)) > size}
    if not smaller:
        return [], [LeftOut("buckets", f"the job's buckets are {size:,} elements or smaller already ({why})")]
    out = [Change("buckets", f"buckets of {size:,} elements",
                  f"DeepSpeed config {_keys(**smaller)}: {', '.join(f'zero_optimization.{k}={size}' for k in smaller)} "
                  f"({why})", "memory vs speed trade-off: more, smaller collectives (the same bytes sent)",
                  "trade-off", _configured(_zero(**smaller)))]
    return out, []


def overlap(base: StepSpec) -> Levers:
    """``overlap_comm`` off: one reduce bucket instead of two (the one being reduced and the one being filled)."""
    job = job_of(base)
    assert job is not None
    on = job.config.get("zero_optimization", {}).get("overlap_comm")
    if job.stage == 0 or not (on is True or (on is None and job.stage == 3)):
        return [], [LeftOut("overlap_comm", "overlap_comm is off (DeepSpeed's default below ZeRO-3): one reduce "
                            "bucket at a time")]
    return [Change("overlap_comm", "overlap_comm off",
                   f"DeepSpeed config {_keys(overlap_comm=False)}: zero_optimization.overlap_comm=false",
                   "memory vs speed trade-off: the gradients' reduction no longer overlaps backward", "trade-off",
                   _configured(_zero(overlap_comm=False)))], []


def precision(base: StepSpec) -> Levers:
    """DeepSpeed's own bf16 (its config's section): the module cast to bf16, fp32 master partitions."""
    job = job_of(base)
    assert job is not None
    autocast = LeftOut("precision", "torch.autocast around the engine: not weighed (DeepSpeed's precision is its "
                       "config's bf16/fp16 section, or its torch_autocast section, not checked against a real run)")
    if job.config.get("bf16", {}).get("enabled") is True:
        return [], [LeftOut("precision", "the job runs DeepSpeed's bf16 already"), autocast]
    return [Change("precision", "DeepSpeed bf16", "DeepSpeed config {\"bf16\": {\"enabled\": true}}: bf16.enabled=true "
                   "(DeepSpeed casts the module to bf16 and keeps fp32 master partitions)",
                   "none (bf16 weights in forward/backward; fp32 updates)", "none",
                   _configured(lambda c: c.setdefault("bf16", {}).update(enabled=True)))], [autocast]


def optimizer(base: StepSpec) -> Levers:
    """The torch.optim optimizer passed to ``deepspeed.initialize``: another implementation (DeepSpeed steps
    one flat partition per group), or another optimizer with ``zero_allow_untested_optimizer``."""
    train = base.training.train
    if train.optimizer is None:
        return [], [LeftOut("optimizer", "the optimizer is the DeepSpeed config's own (its `optimizer` section): "
                            "not changed here")]
    out = []
    impl = resolved_impl(train.impl, base.target.device)
    for other in ("forloop", "fused"):
        if other != impl and train.optimizer in _FUSED:
            flag = {"forloop": "foreach=False", "fused": "fused=True"}[other]
            out.append(Change("optimizer", f"{train.optimizer} {other}",
                              f"--optimizer-impl {other}: torch.optim ... ({flag}) passed to deepspeed.initialize",
                              "memory vs speed trade-off: kernels per parameter group", "trade-off",
                              _then(lambda s: s, impl=other)))
    untested = _configured(lambda c: c.update(zero_allow_untested_optimizer=True))
    for alt in ALTERNATIVES.get(train.optimizer, ()):
        out.append(Change("optimizer", f"{alt} instead of {train.optimizer}",
                          f"--optimizer {alt} and DeepSpeed config {{\"zero_allow_untested_optimizer\": true}} "
                          "(DeepSpeed refuses a torch.optim class outside its ZeRO-tested list without it)",
                          "memory vs speed trade-off: fewer optimizer states, a different convergence to check",
                          "trade-off", _then(untested, optimizer=alt, impl="auto")))
    return out, []


def _then(apply: Callable[[StepSpec], StepSpec], **train: Any) -> Callable[[StepSpec], StepSpec]:
    """The loop's options changed (graphmem/training/loop.py TrainStep), then ``apply``."""
    return lambda s: apply(s.with_train(**train))


def _resized(apply: Callable[[StepSpec], StepSpec], shape: tuple[int, ...]) -> Callable[[StepSpec], StepSpec]:
    """The batch at ``shape``, then ``apply``."""
    return lambda s: apply(s.at(shape))


def micro_batches(base: StepSpec) -> Levers:
    """k micro-batches of b/k (``train_micro_batch_size_per_gpu`` b/k, ``gradient_accumulation_steps`` times k):
    the same samples per optimizer step."""
    job = job_of(base)
    assert job is not None
    b = base.shape[0]
    ks = [k for k in (2, 4, 8) if b % k == 0]
    if not ks:
        return [], [LeftOut("micro-batches", f"batch {b} has no divisor 2, 4 or 8 to split into micro-batches")]
    c = job.config
    steps = _elements(c.get("gradient_accumulation_steps"), 1)
    out = []
    for k in ks:
        shape = (b // k, *base.shape[1:])

        def edit(conf: dict[str, Any], k: int = k) -> None:
            if conf.get("train_micro_batch_size_per_gpu") != "auto":  # ("auto": the batch's own, resolved)
                conf["train_micro_batch_size_per_gpu"] = b // k
            conf["gradient_accumulation_steps"] = steps * k

        change = _configured(edit)
        out.append(Change("micro-batches", f"{k} micro-batches of {b // k}",
                          f"DeepSpeed config {{\"train_micro_batch_size_per_gpu\": {b // k}, "
                          f"\"gradient_accumulation_steps\": {steps * k}}}: the engine accumulates {steps * k} "
                          "micro-steps, then one optimizer step",
                          f"none in FLOPs; {k} sequential micro-steps of smaller kernels", "trade-off",
                          _resized(change, shape), extent=k))
    return out, []


def not_applicable(base: StepSpec) -> list[LeftOut]:
    """The single-device step's levers that a DeepSpeed job does not take, each with its reason."""
    job = job_of(base)
    assert job is not None
    split = f"the job is {job.describe()}: its sharding is its config's zero_optimization (the ZeRO stage rows)"
    one = "plans the single-device step, not DeepSpeed's engine"
    return [LeftOut("sharding", f"FSDP2 and the ZeRO formulas: not applicable: {split}"),
            LeftOut("pipeline", "not applicable: DeepSpeed's pipeline engine (deepspeed.pipe.PipelineModule) is not "
                    "analyzed here"),
            LeftOut("lora", "not applicable: a DeepSpeed job is analyzed over the model it is given; peft's adapters "
                    "under DeepSpeed are not captured yet"),
            LeftOut("checkpoint", f"not applicable: the planner {one} (DeepSpeed's activation_checkpointing or "
                    "model.gradient_checkpointing_enable() are not weighed yet)"),
            LeftOut("batch", f"not applicable: graphmem fit's formula {one}; the micro-batch rows keep the samples per "
                    "step (a smaller train_micro_batch_size_per_gpu changes the run)"),
            LeftOut("attention", "not weighed: the SDPA backend's lever is the module's target option; a DeepSpeed "
                    "job's rows change its config only")]


__all__ = ["NOTE", "deepspeed_levers", "job_of"]
