"""Bundled example models, addressable by preset name.

Each family module (gpt2, llama, mlp, resnet) is a self-contained model file
exposing a config dataclass, ``PRESETS``, ``build(config)``, ``model()``,
``example_inputs(shape, config=None)`` and ``loss(output, inputs)``. This
package only indexes them so callers can write ``build("llama-2-7b")``.
"""

import dataclasses
from types import ModuleType
from typing import Any, Union

import torch.nn as nn

from graphmem.models import gpt2, llama, mlp, resnet

# a family's config dataclass
Config = Union[gpt2.GPTConfig, llama.LlamaConfig, mlp.MLPConfig, resnet.ResNetConfig]

FAMILIES: dict[str, ModuleType] = {"gpt2": gpt2, "llama": llama, "mlp": mlp, "resnet": resnet}


def _collect_presets() -> dict[str, tuple[str, Config]]:
    presets: dict[str, tuple[str, Config]] = {}
    for family, module in FAMILIES.items():
        for name, config in module.PRESETS.items():
            if name in presets:  # a silent shadowing would make build() ambiguous
                raise RuntimeError(f"preset {name!r} defined by both {presets[name][0]} and {family}")
            presets[name] = (family, config)
    return presets


# preset name -> (family name, config)
PRESETS: dict[str, tuple[str, Config]] = _collect_presets()


def preset_names() -> list[str]:
    return list(PRESETS)


def _lookup(name: str) -> tuple[str, Config]:
    try:
        return PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}") from None


def family_of(name: str) -> ModuleType:
    """The family module (e.g. ``gpt2``) that defines preset ``name``."""
    return FAMILIES[_lookup(name)[0]]


def config_of(name: str, **overrides: Any) -> Config:  # (the config's own fields)
    """The preset's config with ``overrides`` applied (the stored preset is not modified)."""
    return dataclasses.replace(_lookup(name)[1], **overrides)


def build(name: str, **overrides: object) -> nn.Module:
    """Construct preset ``name`` on the current default device, e.g. inside ``torch.device("meta")``."""
    return family_of(name).build(config_of(name, **overrides))


__all__ = [
    "FAMILIES", "PRESETS", "build", "config_of", "family_of", "preset_names",
    "gpt2", "llama", "mlp", "resnet",
]
