"""Turn what the user names (a model file, a preset, an nn.Module) and an input shape into
a module and an input factory, without allocating real weights.

Model files are imported under ``torch.device("meta")``: a module-level ``model = GPT(cfg)``
or a ``def model()`` factory both build on the meta device.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import logging
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn

from graphmem.capture.hf import HFOptions, config_dict, dtype_name, looks_like_hub_id, make_config
from graphmem.capture.hf import batch as hf_batch
from graphmem.capture.hf import build as build_model
from graphmem.capture.hf_batch import settings as hf_settings
from graphmem.capture.presets_hf import HF_PRESETS, hub_ids
from graphmem.capture.target import Target
from graphmem.errors import ModelLoadError, UsageError
from graphmem.models import PRESETS, config_of, family_of, preset_names
from graphmem.training.batch import Batch, as_batch
from graphmem.training.step import LossFn

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from graphmem.capture.fakes import Inputs

_SHAPE = re.compile(r"^\d+(x\d+)*$")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"32x1024"`` -> ``(32, 1024)``; raises UsageError naming the expected form."""
    t = str(text).strip().lower().replace("×", "x")
    if not _SHAPE.match(t):
        raise UsageError(f"invalid input shape {text!r}: expected positive integers joined by 'x', e.g. 32x1024 or 8x3x224x224")
    dims = tuple(int(d) for d in t.split("x"))
    if any(d <= 0 for d in dims):
        raise UsageError(f"invalid input shape {text!r}: every dimension must be at least 1, e.g. 32x1024")
    return dims


@dataclass
class Loaded:
    """A model ready for analysis: ``module`` lives on the meta device (or is the user's own)."""

    name: str
    module: nn.Module
    example_inputs: Optional[Callable[[tuple[int, ...]], Inputs]]  # a tuple, dict or (args, kwargs)
    loss: Optional[LossFn]
    config: Optional[PretrainedConfig] = None  # a Hugging Face model's
    dtype: Optional[str] = None  # the parameter dtype it was built in, when chosen by its config (HF)
    batch_settings: dict[str, str] = field(default_factory=dict)  # what example_inputs chose (hf_batch.settings)


def default_inputs(module: nn.Module, shape: tuple[int, ...]) -> tuple[torch.Tensor]:
    """int64 token ids in [0, vocab) if the model's first leaf module is an nn.Embedding
    (it takes the input first in every bundled and HF-style language model), else float32."""
    first = next((m for m in module.modules() if not list(m.children())), None)
    if isinstance(first, nn.Embedding):
        return (torch.randint(0, first.num_embeddings, shape),)
    return (torch.randn(shape),)


def make_inputs(loaded: Loaded, shape: tuple[int, ...]) -> Batch:
    """The batch for ``shape``: the model file's ``example_inputs(shape)`` (a tensor, tuple, dict
    or ``(args, kwargs)``), else the default-input rule."""
    if loaded.example_inputs is not None:
        return as_batch(loaded.example_inputs(shape))
    return as_batch(default_inputs(loaded.module, shape))


def all_preset_names() -> list[str]:
    return [*preset_names(), *HF_PRESETS]


def load(spec: str, device: str = "meta", target: Optional[Target] = None,
         options: Optional[HFOptions] = None) -> Loaded:
    """A path to a model file, a preset name (``gpt2``, ``llama-2-7b``, ``llama-3.1-8b``, ...), a
    Hugging Face config.json, model directory or hub id (graphmem/capture/hf.py), built on
    ``device``: the meta device for analysis, a real one for ``graphmem validate``. ``target``
    chooses an HF model's dtype and attention; ``options`` how to load it."""
    target = target or Target()
    options = options or HFOptions()
    if spec in PRESETS:
        family = family_of(spec)
        config = config_of(spec)
        with torch.device(device):
            module = family.build(config)
        return Loaded(spec, module, lambda shape: family.example_inputs(shape, config), family.loss, config)
    if spec in HF_PRESETS or options.config is not None:
        return load_hf(spec, device, target, options)
    if spec.endswith(".pt2"):
        return load_exported(spec)
    if os.path.isdir(spec) or (spec.endswith(".json") and os.path.isfile(spec)):
        return load_hf(spec, device, target, options)
    if spec.endswith(".py") or os.sep in spec and not looks_like_hub_id(spec) or os.path.exists(spec):
        return load_file(spec, device)
    if "/" in spec and looks_like_hub_id(spec):
        return load_hf(spec, device, target, options)
    if looks_like_hub_id(spec) and _in_hf_cache(spec):
        return load_hf(spec, device, target, options)
    raise UsageError(
        f"{spec!r} is neither a model file nor a preset; give a path to a .py file that defines "
        f"`model`, a Hugging Face config.json, model directory or hub id (org/name), or one of: "
        f"{', '.join(all_preset_names())}"
    )


def _in_hf_cache(spec: str) -> bool:
    try:
        import transformers
    except ImportError:
        return False
    try:
        transformers.PretrainedConfig.get_config_dict(spec, local_files_only=True)
        return True
    except (OSError, ValueError):
        return False


def load_hf(spec: str, device: str, target: Target, options: HFOptions) -> Loaded:
    """A Hugging Face model from its config alone; the batch from its signature (hf.batch);
    its own loss (the ``labels`` in that batch)."""
    name = spec
    source = options.config or spec
    bundled = HF_PRESETS[spec][1] if spec in HF_PRESETS and options.config is None else None
    try:
        raw, _where = config_dict(source, options.trust_remote_code, bundled)
    except ModelLoadError as e:
        preset = hub_ids().get(spec.lower())
        if preset is None:
            raise
        raise ModelLoadError(f"{e}, or use the bundled preset {preset} (the same config.json)") from e
    config = make_config(raw, options.trust_remote_code, name)
    module = build_model(config, target, options.trust_remote_code, device)
    length = options.decoder_length
    if target.attention != "eager" and getattr(module.config, "_attn_implementation", "") == "eager":
        name += " (eager attention: transformers has no SDPA path for it)"
    return Loaded(name, module,
                  lambda shape: hf_batch(module, shape, length, options.padding, options.use_cache), None, config,
                  dtype_name(module), hf_settings(module, options.padding, options.use_cache))


def from_exported(ep: torch.export.ExportedProgram, name: str = "ExportedProgram") -> Loaded:
    """A torch.export.ExportedProgram: its unlifted module, analyzed like any module; inputs for
    another shape keep the exported example inputs' dtypes."""
    example = getattr(ep, "example_inputs", None)
    args = tuple(example[0]) if example else ()

    def make(shape: tuple[int, ...]) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise UsageError("this exported program has no example tensor input to resize; pass inputs instead")
        first = args[0]
        x = (torch.randint(0, 2, shape) if not first.is_floating_point() else torch.randn(shape)).to(first.dtype)
        return (x, *args[1:])
    return Loaded(name, ep.module(), make, None)


def load_exported(path: str) -> Loaded:
    if not os.path.isfile(path):
        raise UsageError(f"exported program {path!r} not found; check the path")
    log = logging.getLogger("torch.export")  # it logs a traceback before raising; the one line below says it
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        ep = torch.export.load(path)
    except Exception as e:
        raise ModelLoadError(f"{path} is not a loadable torch.export program: {type(e).__name__}: {_first_line(e)}; "
                             "save it with torch.export.save(torch.export.export(model, args), path)") from e
    finally:
        log.setLevel(level)
    return from_exported(ep, os.path.basename(path))


def load_file(path: str, device: str = "meta") -> Loaded:
    if not os.path.isfile(path):
        raise UsageError(f"model file {path!r} not found; check the path (or name a preset, see `graphmem presets`)")
    name = f"graphmem_model_{device}_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelLoadError(f"cannot import {path!r}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    try:
        with torch.device(device):
            spec.loader.exec_module(mod)
    except Exception as e:
        raise ModelLoadError(f"importing {path} failed: {type(e).__name__}: {_first_line(e)}; fix the file so `python {path}` runs") from e
    if not hasattr(mod, "model"):
        raise ModelLoadError(
            f"{path} defines no `model`; add `model = MyModel(...)` (an nn.Module) or `def model(): return MyModel(...)`")
    obj = mod.model
    if not isinstance(obj, nn.Module):
        if not callable(obj):
            raise ModelLoadError(f"`model` in {path} is a {type(obj).__name__}, not an nn.Module or a function returning one")
        try:
            with torch.device(device):
                obj = obj()
        except Exception as e:
            raise ModelLoadError(f"calling model() from {path} on the {device} device failed: {type(e).__name__}: {_first_line(e)}") from e
        if not isinstance(obj, nn.Module):
            raise ModelLoadError(f"model() in {path} returned a {type(obj).__name__}, not an nn.Module")
    example = getattr(mod, "example_inputs", None)
    loss = getattr(mod, "loss", None)
    for fname, fn in (("example_inputs", example), ("loss", loss)):
        if fn is not None and not callable(fn):
            raise ModelLoadError(f"`{fname}` in {path} must be a function")
    if loss is not None and len(inspect.signature(loss).parameters) < 2:
        raise ModelLoadError(f"loss in {path} must take (output, inputs)")
    return Loaded(os.path.basename(path), obj, example, loss)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
