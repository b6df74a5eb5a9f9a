"""The levers that change a step's setting (graphmem/advise/setting.py), each with the exact change
to make and its cost, and the reasons a lever is left out. Costs are graphmem's own measures
(recompute FLOPs, bytes moved by collectives) or a stated trade-off: never times."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, cast

import torch

from graphmem import losses
from graphmem.analysis import AnalysisView
from graphmem.chains import find_chain
from graphmem.distributed.pipeline import Pipeline
from graphmem.distributed.spec import Sharding
from graphmem.errors import UsageError
from graphmem.models import gpt2, llama
from graphmem.passes.budget import make_parallel
from graphmem.step.spec import Formula, Inputs, Ranks, Single, Stages, StepSpec
from graphmem.training.batch import Batch
from graphmem.training.lora import make_lora, meta_copy
from graphmem.training.optim import resolved_impl
from graphmem.training.peft_lora import is_hf_model
from graphmem.training.qlora import make_quantization
from graphmem.units import fmt_bytes

# what a lever costs, cheapest first: the order the answer line picks a fitting lever in
COST_RANK = {"none": 0, "trade-off": 1, "recompute": 2, "communication": 3, "changes the run": 4}


@dataclass(frozen=True)
class Change:
    kind: str  # loss | cache | attention | precision | optimizer | micro-batches | sharding | pipeline | lora
    name: str  # the row's label
    how: str  # the exact change: options, or a few lines of code
    cost: str  # what it costs, in words
    cost_class: str  # a key of COST_RANK
    apply: Callable[[StepSpec], StepSpec]
    extent: float = 0.0  # within a cost class, how much: micro-steps, bytes communicated


@dataclass(frozen=True)
class LeftOut:
    kind: str
    why: str


# each lever's change of the setting
def _target(**changes: Any) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.with_target(**changes)


def _train(**changes: Any) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.with_train(**changes)


def _both(target: dict[str, Any], train: dict[str, Any]) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.with_target(**target).with_train(**train)


def _sharded(sharding: Sharding) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.replace(parallel=Ranks(sharding))


def _piped(plan: Pipeline) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.replace(parallel=Stages(plan))


def _micro(shape: tuple[int, ...], total: int) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.at(shape).with_train(micro_batches=total)


def _split(layout: Any) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.replace(parallel=Formula(layout))


def _training(**changes: Any) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.replace(training=dataclasses.replace(s.training, **changes))


def _module(module: Any) -> Callable[[StepSpec], StepSpec]:
    return lambda s: s.replace(module=module, loss=None)


def _bundled_loss(fn: Any) -> Any:
    """``gpt2.loss`` or ``llama.loss`` when ``fn`` is one of them, imported as graphmem.models or
    loaded by file path (``graphmem advise models/gpt2.py``: the same source, another module object)."""
    for known in (gpt2.loss, llama.loss):
        if fn is known:
            return known
        try:
            if fn.__qualname__ == known.__qualname__ and \
                    os.path.samefile(fn.__code__.co_filename, known.__code__.co_filename):
                return known
        except (AttributeError, OSError):
            continue
    return None


def loss(report: AnalysisView, base: StepSpec, make: Callable[[tuple[int, ...]], Any]) -> tuple[list[Change], list[LeftOut]]:
    """The LM head and cross-entropy in chunks (graphmem/losses.py): the (tokens, vocab) logits and
    their fp32 log-softmax are never whole. Weighed for graphmem's bundled language models and
    Hugging Face causal LMs trained on their own loss; other losses are the user's code."""
    module = base.module
    bundled = _bundled_loss(base.loss)
    if bundled is not None:
        head = "lm_head" if bundled is gpt2.loss else "output"
        wrapped: Any = losses.ChunkedNextToken(meta_copy(module), head)
        how = (f"model = graphmem.losses.ChunkedNextToken(model, {head!r}); loss = model(ids)  # head + cross-entropy, "
               f"{losses.CHUNK} tokens at a time")
    elif base.loss is None and is_hf_model(module) and type(module).__name__.endswith("ForCausalLM"):
        config = cast(Any, module).config  # a transformers PreTrainedModel
        if any(config.to_dict().get(k) for k in ("final_logit_softcapping", "logit_scale")):
            return [], [LeftOut("loss", f"{type(module).__name__} scales or caps its logits before the loss; "
                                "the chunked loss would drop that")]
        if "labels" not in make(base.shape).kwargs:
            return [], [LeftOut("loss", "the batch has no labels: the model computes no loss of its own")]
        wrapped = losses.ChunkedCausalLM(meta_copy(module))
        how = ("model = graphmem.losses.ChunkedCausalLM(model); loss = model(**batch)  # lm_head + cross-entropy, "
               f"{losses.CHUNK} tokens at a time")
    else:
        return [], [LeftOut("loss", "not a language model's own next-token loss: for your own head and loss, "
                            "graphmem.losses.chunked_cross_entropy(hidden, head.weight, targets) computes it in chunks")]
    return [Change("loss", "chunked LM head + cross-entropy", how,
                   "the head's forward again in backward, one chunk at a time", "recompute",
                   _module(wrapped))], []


def without_cache(spec: StepSpec) -> Optional[StepSpec]:
    """``spec`` with its Hugging Face model called with ``use_cache=False`` (``--use-cache off``), or None when
    there is no cache to turn off: the model's forward takes no ``use_cache``, the cache is already off, or the
    batch is not graphmem's to change (the user's own batch, a Trainer's step)."""
    if not _cache_on(spec) or spec.inputs.given is not None or spec.training.train.external is not None:
        return None
    make = spec.inputs.make

    def off(shape: tuple[int, ...]) -> Any:
        batch = make(shape)
        if isinstance(batch, Batch):  # graphmem's Hugging Face batches: model(**kwargs) (capture/hf_batch.py)
            return dataclasses.replace(batch, kwargs={**batch.kwargs, "use_cache": False})
        if isinstance(batch, dict):
            return {**batch, "use_cache": False}
        raise UsageError(f"the batch is a {type(batch).__name__}, not the keyword batch graphmem makes for a "
                         "transformers model: pass use_cache=False in it yourself")

    settings = {**dict(spec.inputs.settings), "use_cache": "off"}
    return spec.replace(inputs=Inputs(off, spec.inputs.shape, settings=tuple(settings.items())))


def _cache_on(spec: StepSpec) -> bool:
    """The batch graphmem made calls the model with its KV cache on (capture/hf_batch.py ``settings``: "on", or
    "on (the model's config)")."""
    return dict(spec.inputs.settings).get("use_cache", "").startswith("on")


def cache(report: AnalysisView, base: StepSpec) -> tuple[list[Change], list[LeftOut]]:
    """A transformers decoder called with ``use_cache`` on (its config's default, as ``from_pretrained`` leaves
    it) fills a DynamicCache with every layer's keys and values, which the output holds to the step's end; a
    training step never reads it (transformers' own gradient checkpointing turns it off)."""
    if without_cache(base) is None:
        why = "the batch is not graphmem's to change: pass use_cache=False in it" if _cache_on(base) \
            else "the step has no key/value cache to turn off"
        return [], [LeftOut("cache", why)]
    return [Change("cache", "KV cache off", "--use-cache off: model(**batch, use_cache=False), or "
                   "model.config.use_cache = False before training",
                   "none: a training step never reads the cache (transformers' gradient checkpointing turns it off "
                   "too)", "none", lambda s: without_cache(s) or s)], []


def attention(report: AnalysisView, base: StepSpec) -> tuple[list[Change], list[LeftOut]]:
    """SDPA's math kernel keeps the (b, h, s, s) attention matrix; flash and efficient do not."""
    kernels = dict(report.attention_backends)
    if base.target.device != "cuda":
        return [], [LeftOut("attention", "the SDPA backend is a CUDA kernel choice (the CPU target runs PyTorch's "
                            "CPU kernels); analyze with --device cuda to weigh it")]
    if base.target.attention == "eager":
        return [], [LeftOut("attention", "the model runs Hugging Face's eager softmax attention: reload it with "
                            "attn_implementation='sdpa' (--attention auto) to weigh the SDPA kernels")]
    if not kernels:
        return [], [LeftOut("attention", "no scaled_dot_product_attention call in the step")]
    if "math" not in kernels:
        return [], [LeftOut("attention", f"SDPA already runs {', '.join(sorted(kernels))} (no (s, s) matrix kept)")]
    if base.target.attention == "auto":
        return [], [LeftOut("attention", "PyTorch's own choice for these SDPA calls is the math kernel: flash and "
                            "memory-efficient refuse them (head dim, dtype, mask or unequal head counts; "
                            "graphmem/capture/cuda_rules.py, select_backend), so forcing one would raise")]
    return [Change("attention", "attention auto",
                   "--attention auto: drop the sdpa_kernel(SDPBackend.MATH) context (PyTorch picks flash or "
                   "memory-efficient where they accept the call)", "none (same FLOPs; a fused kernel)", "none",
                   _target(attention="auto"))], []


def precision(report: AnalysisView, base: StepSpec) -> tuple[list[Change], list[LeftOut]]:
    t, train = base.target, base.training.train
    if t.amp is not None or t.dtype in ("bf16", "fp16"):
        what = f"autocast {t.amp}" if t.amp is not None else f"{t.dtype} parameters"
        if t.dtype in ("bf16", "fp16") and train.optimizer is not None and not train.master_weights:
            what += " without fp32 masters"
        return [], [LeftOut("precision", f"the step already runs in 16 bits ({what})")]
    out = [Change("precision", "bf16 autocast", "--amp bf16: with torch.autocast(device_type, dtype=torch.bfloat16): "
                  "forward and loss", "none (bf16 matmuls; fp32 parameters and optimizer)", "none",
                  _target(amp="bf16"))]
    if train.optimizer is None:
        return out, [LeftOut("precision", "bf16 parameters with fp32 master weights need an optimizer in the step "
                             "(--optimizer)")]
    out.append(Change("precision", "bf16 params + fp32 masters",
                      "--dtype bf16 --master-weights: model.to(torch.bfloat16); the optimizer steps an fp32 copy",
                      "none (bf16 weights in forward/backward; fp32 updates)", "none",
                      _both({"dtype": "bf16"}, {"master_weights": True})))
    return out, []


ALTERNATIVES = {"adam": ("adafactor", "momentum"), "adamw": ("adafactor", "momentum"),
                "momentum": ("sgd",), "adafactor": (), "sgd": (), "adam8bit": (), "adamw8bit": (), "paged_adamw8bit": ()}
_FUSED = ("adam", "adamw", "sgd", "momentum")


def optimizer(report: AnalysisView, base: StepSpec) -> tuple[list[Change], list[LeftOut]]:
    train = base.training.train
    if train.optimizer is None:
        return [], [LeftOut("optimizer", "no optimizer in the step: add --optimizer adamw (or another) to weigh "
                            "the optimizer's states and its temporaries")]
    impl = resolved_impl(train.impl, base.target.device)
    out = []
    impls = [i for i in ("forloop", "fused") if i != impl and (i != "fused" or train.optimizer in _FUSED)
             and train.optimizer in ALTERNATIVES and not train.optimizer.endswith("8bit")]  # bitsandbytes': one impl
    for other in impls:
        flag = {"forloop": "foreach=False", "fused": "fused=True"}[other]
        out.append(Change("optimizer", f"{train.optimizer} {other}",
                          f"--optimizer-impl {other}: torch.optim.{_cls(train.optimizer)}(..., {flag})",
                          "memory vs speed trade-off: " + ("one kernel launch per parameter instead of one per group"
                                                           if other == "forloop" else "one fused kernel per parameter group"),
                          "trade-off", _train(impl=other)))
    for alt in ALTERNATIVES[train.optimizer]:
        out.append(Change("optimizer", f"{alt} instead of {train.optimizer}",
                          f"--optimizer {alt}: {_code(alt)}",
                          "memory vs speed trade-off: fewer optimizer states, a different convergence to check",
                          "trade-off", _train(optimizer=alt, impl="auto")))
    return out, []


def _cls(name: str) -> str:
    return {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "momentum": "SGD", "adafactor": "Adafactor"}[name]


def _code(name: str) -> str:
    return {"adafactor": "torch.optim.Adafactor(params)", "momentum": "torch.optim.SGD(params, lr, momentum=0.9)",
            "sgd": "torch.optim.SGD(params, lr)"}[name]


def micro_batches(report: AnalysisView, base: StepSpec) -> tuple[list[Change], list[LeftOut]]:
    """k micro-batches of b/k: the same samples per optimizer step (k divides b)."""
    b = base.shape[0]
    ks = [k for k in (2, 4, 8) if b % k == 0]
    if not ks:
        return [], [LeftOut("micro-batches", f"batch {b} has no divisor 2, 4 or 8 to split into micro-batches")]
    out = []
    for k in ks:
        shape = (b // k, *base.shape[1:])
        total = base.training.train.micro_batches * k
        out.append(Change("micro-batches", f"{k} micro-batches of {b // k}",
                          f"--input-shape {'x'.join(map(str, shape))} --micro-batches {total}: accumulate gradients over "
                          f"{total} backward passes, then one optimizer step",
                          f"none in FLOPs; {k} sequential micro-steps of smaller kernels", "trade-off",
                          _micro(shape, total),
                          extent=k))
    return out, []


def sharding(report: AnalysisView, base: StepSpec, ranks: int) -> tuple[list[Change], list[LeftOut]]:
    """Data parallel over ``ranks`` ranks, per rank. FSDP2 (``fully_shard`` on each block of the
    chain, then the root, with and without ``reshard_after_forward``): rank 0's step captured
    through torch.distributed's own code under a fake process group (every rank holds shards
    padded to the same size, so rank 0 stands for all). DeepSpeed's ZeRO-1/2, which graphmem does
    not run: passes/budget.py's per-rank formulas on the captured step. Communication per rank and
    step, ring collectives moving (N-1)/N of a buffer each: ZeRO-1/2 and FSDP2 without
    resharding reduce-scatter the gradients and all-gather the parameters once (what DDP's
    all-reduce moves); FSDP2 resharding after forward all-gathers the parameters again in
    backward."""
    if base.parallel != Single():
        return [], [LeftOut("sharding", f"the step is already split: {base.parallel.describe()}")]
    if ranks < 2:
        return [], [LeftOut("sharding", "one rank (--ranks 1): nothing to shard over")]
    share = (ranks - 1) / ranks
    grads, params = report.gradient_bytes, report.parameter_bytes
    once, twice = int(share * (grads + params)), int(share * (grads + 2 * params))

    def cost(volume: int) -> str:
        return f"communication {fmt_bytes(volume)} per rank per step on {ranks} GPUs"

    out = [Change("sharding", f"FSDP2 over {ranks} ranks" + ("" if reshard else ", no reshard after forward"),
                  f"--world-size {ranks} --rank 0 --fsdp{'' if reshard else ' --no-reshard-after-forward'}: "
                  f"fully_shard(block, reshard_after_forward={reshard}) for each block, then the root "
                  "(rank 0's step, captured through torch.distributed's fully_shard)",
                  cost(twice if reshard else once), "communication",
                  _sharded(Sharding(ranks, 0, fsdp=True, reshard_after_forward=reshard)), twice if reshard else once)
           for reshard in (True, False)]
    out += [Change("sharding", f"ZeRO-{z} over {ranks} ranks",
                   f"--world-size {ranks} --zero {z}: DeepSpeed zero_optimization.stage={z} (the row: passes/budget.py's "
                   "per-rank formula; DeepSpeed is not run)", cost(once), "communication",
                   _split(make_parallel(ranks, z)), once)
            for z in ((1, 2) if base.training.train.optimizer else (2,))]
    return out, []


def pipeline(report: AnalysisView, base: StepSpec, ranks: int) -> tuple[list[Change], list[LeftOut]]:
    """Pipeline stages over ``ranks`` ranks: torch.distributed.pipelining's 1F1B schedule over the
    model's chain split evenly, each rank's step captured with its own stage's optimizer
    (graphmem/distributed/pipeline.py); the row is the highest rank's peak. Micro-batches: the
    smallest divisor of the batch that is at least ``ranks`` (1F1B idles (P-1)/(M+P-1) of the
    step: the bubble). Communication per rank and step: the block input of the whole batch
    forward and its gradient backward."""
    if base.parallel != Single():
        return [], [LeftOut("pipeline", f"the step is already split: {base.parallel.describe()}")]
    if ranks < 2:
        return [], [LeftOut("pipeline", "one rank (--ranks 1): nothing to split into stages")]
    if base.training.train.micro_batches > 1:
        return [], [LeftOut("pipeline", "the step already accumulates micro-batches; pipeline stages split the batch "
                            "into their own (--pp with --micro-batches)")]
    chain = find_chain(base.module)
    b = base.shape[0]
    if chain is None:
        return [], [LeftOut("pipeline", "no chain of identical blocks to split into stages")]
    if b < ranks:
        return [], [LeftOut("pipeline", f"batch {b} has fewer samples than the {ranks} stages: 1F1B needs a micro-batch "
                            "per stage at least")]
    m = next(d for d in range(ranks, b + 1) if b % d == 0)
    hidden = report.step.module_inputs.get(f"{chain.path}.0") if report.step is not None else None
    volume = 2 * math.prod(hidden) * (base.target.param_dtype or torch.float32).itemsize if hidden else 0
    bubble = (ranks - 1) / (m + ranks - 1)
    cost = (f"communication {fmt_bytes(volume)} per rank per step on {ranks} GPUs (block inputs and their gradients); "
            f"1F1B's bubble idles {bubble:.0%} of the step")
    how = (f"--pp {ranks} --micro-batches {m} --schedule 1f1b --rank R for R in 0..{ranks - 1}: torch.distributed."
           f"pipelining's Schedule1F1B over PipelineStage({chain.path} split in {ranks}); the row is the highest rank's")
    return [Change("pipeline", f"pipeline over {ranks} ranks (1F1B, {m} micro-batches)", how, cost, "communication",
                   _piped(Pipeline(ranks, 0, "1f1b", m)), volume)], []


def lora(report: AnalysisView, base: StepSpec, rank: int = 16) -> tuple[list[Change], list[LeftOut]]:
    """Fine-tuning with LoRA adapters: the frozen weights keep no gradient or optimizer state."""
    if base.training.lora is not None:
        return [], [LeftOut("lora", f"the step already trains {base.training.lora.describe()}")]
    if base.training.train.optimizer is None:
        return [], [LeftOut("lora", "no optimizer in the step: LoRA saves the frozen weights' gradients and "
                            "optimizer states (add --optimizer)")]
    adapters = make_lora(rank, "all-linear")
    out = [Change("lora", f"LoRA r={rank} all-linear (fine-tuning)",
                  f"--lora-rank {rank} --lora-targets all-linear: peft.get_peft_model(model, "
                  f"LoraConfig(r={rank}, target_modules='all-linear'))",
                  "changes the run: only the adapters train (fine-tuning, not pre-training)", "changes the run",
                  _training(lora=adapters))]
    if not is_hf_model(base.module):
        return out, [LeftOut("lora", "QLoRA: the model is not a Hugging Face model (transformers' bitsandbytes "
                             "integration replaces its linear layers)")]
    if importlib.util.find_spec("bitsandbytes") is None:
        return out, [LeftOut("lora", "QLoRA: bitsandbytes is not installed (pip install 'graphmem[qlora]')")]
    out.append(Change("lora", f"QLoRA r={rank} all-linear (fine-tuning, 4-bit NF4 base)",
                      f"--qlora --lora-rank {rank} --lora-targets all-linear: from_pretrained(..., quantization_config="
                      "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True, "
                      "bnb_4bit_compute_dtype=torch.bfloat16)), then peft.get_peft_model",
                      "changes the run: only the adapters train, over 4-bit base weights (their rounding)",
                      "changes the run", _training(lora=adapters, quantization=make_quantization("nf4")), 1.0))
    return out, []
