"""The batch a Hugging Face model's ``forward`` takes, made for ``--input-shape`` (passed as
``model(**batch)``, graphmem/training/batch.py), by the model's ``main_input_name`` and signature:

- text ``b x s``: ``input_ids``, ``attention_mask`` and ``labels`` (a copy of the ids, as
  DataCollatorForLanguageModeling makes them; ``(b,)`` class ids for sequence classification)
  when ``forward`` takes them, so the model computes its own loss;
- encoder-decoder: ``labels`` (or ``decoder_input_ids``) of length ``decoder_length`` (default s);
- vision ``b`` or ``b x c x h x w``: ``pixel_values`` (c, h, w from the config) and class labels;
- speech ``b`` or ``b x frames``: ``input_features`` (mel bins from the config; Whisper needs its
  3000 frames) and ``labels`` of ``decoder_length`` tokens (required).

Two choices change the step, so the report names them (``settings``) and the user sets them:

- ``padding`` of the attention mask: ``"none"`` (default: a tokenizer's batch of equal-length
  sequences, as packed or fixed-length language-model training makes, has an all-ones mask;
  transformers then skips the causal mask and SDPA runs ``is_causal=True``) or
  ``"first-token"`` (the first token of the first sequence is padding: every layer gets a
  materialized (b, 1, s, s) mask, as in any padded batch);
- ``use_cache``: None (default) leaves it to the model's config, as a model from
  ``from_pretrained`` trains (``use_cache=True`` for most decoders: each layer's keys and values
  go into a DynamicCache that the output holds; transformers' own gradient checkpointing turns
  it off); True or False passes ``use_cache`` to ``forward``.

The values of the mask are known to the capture (graphmem/capture/values.py), so either padding
takes the path the real step takes.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch
import torch.nn as nn

from graphmem.errors import UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig

PADDINGS = ("none", "first-token")


def base_model(model: nn.Module) -> nn.Module:
    """A peft model's base model (its batch is the base model's), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def batch(model: nn.Module, shape: tuple[int, ...], decoder_length: Optional[int] = None, padding: str = "none",
          use_cache: Optional[bool] = None) -> dict[str, Any]:
    """The keyword batch ``model`` takes at ``shape`` (see the module docstring)."""
    if padding not in PADDINGS:
        raise UsageError(f"padding must be one of {', '.join(PADDINGS)}, got {padding!r}")
    model = base_model(model)
    config: Any = model.config
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    kind = type(model).__name__
    if main == "input_ids":
        out = _text(model, shape, decoder_length, padding, params)
    elif main == "pixel_values":
        out = _vision(config, shape, kind, params)
    elif main in ("input_features", "input_values"):
        out = _speech(config, shape, decoder_length, main, kind, params)
    else:
        raise UsageError(f"graphmem cannot make a batch for {kind} (main input {main!r}); "
                         "call graphmem.analyze(model, batch) with a batch of your own")
    if use_cache is not None and "use_cache" in params:
        out["use_cache"] = use_cache
    return out


def settings(model: nn.Module, padding: str = "none", use_cache: Optional[bool] = None) -> dict[str, str]:
    """What the report says of the batch ``batch`` makes: its padding (text models that take an
    attention mask) and ``use_cache`` (models whose forward takes it), with where it came from."""
    model = base_model(model)
    params = inspect.signature(model.forward).parameters
    out: dict[str, str] = {}
    if getattr(model, "main_input_name", "input_ids") == "input_ids" and "attention_mask" in params:
        out["padding"] = padding
    if "use_cache" in params:
        config_says = getattr(model.config, "use_cache", None)
        if use_cache is not None:
            out["use_cache"] = "on" if use_cache else "off"
        elif config_says is not None:
            out["use_cache"] = f"{'on' if config_says else 'off'} (the model's config)"
    return out


def _text(model: nn.Module, shape: tuple[int, ...], decoder_length: Optional[int], padding: str,
          params: Mapping[str, inspect.Parameter]) -> dict[str, torch.Tensor | bool]:
    config: Any = model.config
    kind = type(model).__name__
    if len(shape) != 2:
        raise UsageError(f"{kind} takes token ids: give `input_shape` BATCHxSEQ, e.g. 8x1024")
    b, s = shape
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 2) or 2)
    out: dict[str, Any] = {"input_ids": torch.randint(0, vocab, (b, s))}
    if "attention_mask" in params:
        mask = torch.ones(b, s, dtype=torch.long)
        if padding == "first-token":
            mask[0, 0] = 0
        out["attention_mask"] = mask
    if getattr(config, "is_encoder_decoder", False):
        key = "labels" if "labels" in params else "decoder_input_ids"
        out[key] = torch.randint(0, vocab, (b, decoder_length or s))
    elif "labels" in params:
        out["labels"] = (torch.randint(0, max(int(getattr(config, "num_labels", 2)), 1), (b,))
                         if "SequenceClassification" in kind else out["input_ids"].clone())
    return out


def _vision(config: PretrainedConfig, shape: tuple[int, ...], kind: str, params: Mapping[str, inspect.Parameter],
            ) -> dict[str, torch.Tensor | bool]:
    vision = getattr(config, "vision_config", None) or config
    b = shape[0]
    if len(shape) == 1:
        size = getattr(vision, "image_size", 224)
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        shape = (b, int(getattr(vision, "num_channels", 3)), h, w)
    if len(shape) != 4:
        raise UsageError(f"{kind} takes images: give `input_shape=BATCH` or BATCHxCxHxW, e.g. 32x3x224x224")
    out: dict[str, torch.Tensor | bool] = {"pixel_values": torch.randn(shape)}
    if "labels" in params:
        out["labels"] = torch.randint(0, max(int(getattr(config, "num_labels", 2)), 1), (b,))
    return out


def _speech(config: PretrainedConfig, shape: tuple[int, ...], decoder_length: Optional[int], main: str, kind: str,
            params: Mapping[str, inspect.Parameter]) -> dict[str, torch.Tensor | bool]:
    b = shape[0]
    out: dict[str, torch.Tensor | bool] = {}
    if main == "input_features":
        frames = shape[1] if len(shape) == 2 else 2 * int(getattr(config, "max_source_positions", 1500))
        out[main] = torch.randn(b, int(getattr(config, "num_mel_bins", 80)), frames)
    else:
        if len(shape) != 2:
            raise UsageError(f"{kind} takes raw audio: give `input_shape` BATCHxSAMPLES, e.g. 4x16000")
        out[main] = torch.randn(shape)
    if getattr(config, "is_encoder_decoder", False):
        if decoder_length is None:
            raise UsageError(f"{kind} is an encoder-decoder: give the label length with `decoder_length=T`")
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        vocab = int(getattr(text, "vocab_size", 2) or 2)
        out["labels" if "labels" in params else "decoder_input_ids"] = torch.randint(0, vocab, (b, decoder_length))
    return out
