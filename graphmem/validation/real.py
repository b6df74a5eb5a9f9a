"""The real model's pieces both validations build: the one-device step (graphmem/validation/validate.py)
and each gloo rank's (graphmem/validation/ranks.py): the module as the analysis prepared its fake one,
the batch on the real device, and the memory the machine can give."""
from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn

from graphmem.capture.load import Loaded, make_inputs
from graphmem.capture.target import Target
from graphmem.errors import UsageError
from graphmem.training.batch import Batch
from graphmem.training.lora import apply_lora
from graphmem.training.spec import Training

RAM_SHARE = 0.5  # of MemAvailable: the page cache and other programs keep the rest


def available_memory() -> int:
    """Bytes the OS can hand out without swapping: ``MemAvailable`` from /proc/meminfo, else
    (no /proc, e.g. macOS) the physical memory size, which the 50 % share keeps conservative."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))


def prepared(module: nn.Module, training: Training, target: Target) -> nn.Module:
    """The real module the step trains: ``module`` itself, or a copy in the spec's dtype and with
    its LoRA adapters (graphmem/training/lora.py, peft for a Hugging Face model), as the analysis
    prepared its fake one; the user's module is never changed (an optimizer steps a copy too)."""
    if training.lora is None and target.param_dtype is None and training.train.optimizer is None:
        return module
    model = copy.deepcopy(module)
    if target.param_dtype is not None and not training.keeps_dtypes(module):
        model = model.to(target.param_dtype)
    if training.lora is not None:
        model, _ = apply_lora(model, training.lora, inplace=True)
    return model


def real_inputs(loaded: Loaded, shape: tuple[int, ...], dev: torch.device) -> Batch:
    """The model file's example_inputs, or the default-input rule, on the real device."""
    with torch.device(dev):
        made = make_inputs(loaded, shape)
    return made.map(lambda x: to_device(x, dev))  # example_inputs may name a device itself


def to_device(x: object, dev: torch.device) -> object:
    if not isinstance(x, torch.Tensor) or x.device == dev:
        return x
    if x.device.type == "meta":
        raise UsageError("an input is on the meta device: a real run needs real inputs (or give input_shape)")
    return x.detach().to(dev).requires_grad_(x.requires_grad)
