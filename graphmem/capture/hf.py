"""Hugging Face models as users name them: a hub id, a config.json, a model directory or a
bundled config (graphmem/capture/presets_hf.py), built on the meta device from the config
alone (never weights), with the batch the model's ``forward`` expects.

Resolving the config: a local file or directory first; then the Hugging Face cache; then the
hub (only config.json, a few KB), when it answers within a second; otherwise one line that
names ``--config PATH``. A config whose code lives in the repository (``auto_map``) is refused
unless ``trust_remote_code`` is given, as transformers does.

Building: the class named first in ``architectures`` (``LlamaForCausalLM``, ``T5ForConditionalGeneration``,
``ViTForImageClassification``, ...), else the first auto class (causal LM, seq2seq LM, masked LM,
image classification, speech seq2seq, base model) whose mapping has the config; on the meta
device; ``attn_implementation`` from the target's attention (``eager``: HF's explicit softmax
attention; every other choice: ``sdpa``, with the target's SDPA backend rules picking the kernel,
so ``flash`` runs the flash kernel's own aten op as flash-attention 2 would); the parameter dtype
from ``--dtype``, else fp32 under ``--amp``, else the config's ``torch_dtype``.

The batch for ``--input-shape``: graphmem/capture/hf_batch.py (its padding and ``use_cache``
are ``HFOptions`` fields and named in the report).

Known limitations: transformers takes its tracing path when it sees fake tensors
(``is_tracing``); during a capture graphmem/capture/hf_paths.py answers its packed-sequence
check as the real run does (so Whisper's decoder, too, skips the causal mask a real step skips),
and graphmem/capture/values.py lets it read the batch's mask as the real run reads it. Weights are never read, so a checkpoint whose shapes differ from its config
(pruned, quantized) is analyzed as the config says; multimodal models (image + text) need a
batch of your own (``graphmem.analyze(model, batch)``).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import types
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional

import torch
import torch.nn as nn

from graphmem.capture.hf_batch import PADDINGS, batch  # noqa: F401  (hf.batch: the batch for an input shape)
from graphmem.capture.target import DTYPES, Target
from graphmem.errors import ModelLoadError, UsageError, one_line

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EXTRA = "pip install 'graphmem[hf]'"
AUTO_CLASSES = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForMaskedLM",
                "AutoModelForImageClassification", "AutoModelForSpeechSeq2Seq", "AutoModel")
TORCH_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class HFOptions:
    """How to load a Hugging Face model: ``config`` (a config.json or model directory used
    instead of resolving the name), ``trust_remote_code`` (run the repository's own code named
    by ``auto_map``), ``decoder_length`` (the label length of encoder-decoder models); for the
    batch made for an input shape (graphmem/capture/hf_batch.py): ``padding`` ("none", or
    "first-token": the first token of the first sequence is padding) and ``use_cache`` (None:
    as the model's config says)."""

    config: Optional[str] = None
    trust_remote_code: bool = False
    decoder_length: Optional[int] = None
    padding: str = "none"
    use_cache: Optional[bool] = None

    def __post_init__(self) -> None:
        d = self.decoder_length
        if d is not None and (isinstance(d, bool) or not isinstance(d, int) or d < 1):
            raise UsageError(f"`decoder_length` must be a positive integer, got {d!r}")
        if self.config is not None and not _local_config_file(self.config):
            raise UsageError(f"`config={self.config}`: no such config.json or model directory; check the path")
        if self.padding not in PADDINGS:
            raise UsageError(f"padding must be one of {', '.join(PADDINGS)}, got {self.padding!r}")
        if self.use_cache is not None and not isinstance(self.use_cache, bool):
            raise UsageError(f"use_cache must be True, False or None (the model's config), got {self.use_cache!r}")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' and peft's advice for inference users (generation flags, token ids outside a
    tiny vocabulary, deprecations) is not about memory: errors only while graphmem builds."""
    transformers = transformers_module()
    level = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(level)


def transformers_module() -> types.ModuleType:
    try:
        import transformers
    except ImportError:
        raise UsageError(f"Hugging Face models need transformers: {EXTRA}") from None
    return transformers


def _local_config_file(spec: str) -> Optional[str]:
    """The config.json that ``spec`` names on disk (the file, or a directory holding one)."""
    if os.path.isfile(spec) and spec.endswith(".json"):
        return spec
    path = os.path.join(spec, "config.json")
    return path if os.path.isdir(spec) and os.path.isfile(path) else None


def looks_like_hub_id(spec: str) -> bool:
    """``org/name`` (or a bare repository name) that is not a path on disk."""
    parts = spec.split("/")
    return (not os.path.exists(spec) and not spec.endswith((".py", ".pt2", ".json")) and len(parts) <= 2
            and all(p and not p.startswith(".") for p in parts))


def _hub_reachable(timeout: float = 1.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False") or \
            os.environ.get("TRANSFORMERS_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    host = os.environ.get("HF_ENDPOINT", "https://huggingface.co").split("://")[-1].split("/")[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def config_dict(spec: str, trust_remote_code: bool, bundled: Optional[dict] = None) -> tuple[dict, str]:
    """The config as a dict and where it came from (a path, "cache", "hub" or "bundled")."""
    if bundled is not None:
        return dict(bundled), "bundled"
    local = _local_config_file(spec)
    if local is not None:
        try:
            with open(local) as f:
                return json.load(f), local
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{local} is not a readable config.json ({type(e).__name__}: {e}); check the file") from e
    transformers = transformers_module()
    get = transformers.PretrainedConfig.get_config_dict
    try:
        return get(spec, local_files_only=True)[0], "cache"
    except (OSError, ValueError):
        pass
    if not _hub_reachable():
        raise ModelLoadError(
            f"{spec}: no config.json on disk or in the Hugging Face cache, and the hub is unreachable (offline); "
            f"download the model's config.json and pass `config=PATH` (or give the path itself)")
    try:
        return get(spec)[0], "hub"
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelLoadError(f"{spec}: the hub has no config.json for it ({first}); check the id, "
                             "or pass `config=PATH`") from e


def make_config(raw: dict, trust_remote_code: bool, name: str) -> PretrainedConfig:
    """The PretrainedConfig for ``raw``; ``auto_map`` (repository code) only when trusted."""
    transformers = transformers_module()
    if raw.get("auto_map") and not trust_remote_code:
        raise ModelLoadError(f"{name}: its config names custom code (auto_map: {', '.join(raw['auto_map'])}) that "
                             "graphmem would have to download and run; read it, then add `trust_remote_code`")
    model_type = raw.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{name}: the config has no model_type; it is not a transformers config.json")
    kwargs = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    if "torch_dtype" in kwargs:  # the published name; transformers 5 reads dtype
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    if model_type not in transformers.CONFIG_MAPPING:
        raise ModelLoadError(f"{name}: model_type {model_type!r} is unknown to transformers "
                             f"{transformers.__version__}; upgrade transformers ({EXTRA} -U)")
    try:
        with quiet():
            return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as e:  # a field's type or value refused by the config class (huggingface_hub's strict checks)
        raise ModelLoadError(f"{name}: not a valid {model_type} config ({one_line(e)}); fix the config.json") from e


def model_class(config: PretrainedConfig, trust_remote_code: bool) -> Any:  # a model class or an Auto class
    transformers = transformers_module()
    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in AUTO_CLASSES:
        auto_cls = getattr(transformers, auto)
        if type(config) in auto_cls._model_mapping:
            return auto_cls
    if trust_remote_code and getattr(config, "auto_map", None):
        return transformers.AutoModelForCausalLM if "AutoModelForCausalLM" in config.auto_map else transformers.AutoModel
    raise ModelLoadError(f"no transformers model class for {type(config).__name__} (architectures: "
                         f"{getattr(config, 'architectures', None)}); build the model yourself and call graphmem.analyze(model, batch)")


def param_dtype(config: PretrainedConfig, target: Target) -> torch.dtype:
    """--dtype, else fp32 under --amp (autocast casts fp32 weights), else the config's dtype."""
    if target.dtype is not None:
        return DTYPES[target.dtype]
    if target.amp is not None:
        return torch.float32
    dtype = getattr(config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if dtype in TORCH_DTYPES else torch.float32


def attn_implementation(target: Target, cls: type) -> str:
    """``eager`` when asked for, or when the class has no SDPA path (Gemma 2's soft-capping):
    transformers itself refuses ``sdpa`` there; else ``sdpa``."""
    if target.attention == "eager" or not getattr(cls, "_supports_sdpa", True):
        return "eager"
    return "sdpa"


def _concrete(cls: type, config: PretrainedConfig) -> type:
    mapping = getattr(cls, "_model_mapping", None)
    try:
        return mapping[type(config)] if mapping is not None else cls
    except KeyError:
        return cls


def build(config: PretrainedConfig, target: Target, trust_remote_code: bool, device: str = "meta") -> nn.Module:
    """The model on ``device`` as ``from_pretrained`` builds it (``use_cache`` as the config
    says: HFOptions.use_cache overrides it in the batch; graphmem's checkpoint plans pass no
    cache to a checkpointed block, graphmem/planning/apply.py)."""
    cls = model_class(config, trust_remote_code)
    dtype = param_dtype(config, target)
    kwargs: dict[str, object] = {"dtype": dtype, "attn_implementation": attn_implementation(target, _concrete(cls, config))}
    if trust_remote_code:
        kwargs["trust_remote_code"] = True
    try:
        with torch.device(device), quiet():
            if cls.__name__.startswith("AutoModel"):
                return cls.from_config(config, **kwargs)
            return cls._from_config(config, **kwargs)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ModelLoadError(f"building {cls.__name__} from the config failed: {type(e).__name__}: {first}") from e


def dtype_name(module: nn.Module) -> Optional[str]:
    """The built parameters' dtype as a Target dtype name (None for fp32)."""
    p = next(iter(module.parameters()), None)
    name = TORCH_DTYPES.get(p.dtype) if p is not None else None
    return None if name in (None, "fp32") else name
