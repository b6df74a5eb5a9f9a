"""A torchtitan training job made runnable on a CPU without its data, files or side effects.

torchtitan's Trainer (torchtitan/trainer.py, ``Trainer.__init__``) builds, besides the model and
the optimizer, a tokenizer from ``hf_assets_path`` and a Hugging Face dataloader (the ``c4_test``
data set lives in torchtitan's repository, not in its wheel), a checkpointer, a metrics processor
(whose ``DeviceMemoryMonitor`` asks the device module for its name, properties and memory stats,
which ``torch.cpu`` does not have), a validator and CUDA graphs. ``prepared`` returns a copy of a
``Trainer.Config`` with those switched off or replaced by the small Configurables below, so the
Trainer's own ``__init__`` and ``train_step`` run unchanged on synthetic batches of the configured
shape. ``use_cpu`` points torchtitan at the CPU on a machine without an accelerator.

Both sides of a check use this module: the real multi-process run (tests/titan_truth.py) and a
prediction that runs the same Trainer on fake tensors.
"""
from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.config import Configurable
from torchtitan.tools import utils as titan_utils
from torchtitan.trainer import Trainer


def use_cpu() -> None:
    """Make torchtitan run on the CPU: ``torchtitan.tools.utils`` picks
    ``_get_available_device_type() or "cuda"`` at import, so without an accelerator it names CUDA.
    Sets ``device_type``/``device_module`` to "cpu"/``torch.cpu`` there and in every loaded
    torchtitan module that imported them by value (distributed/utils.py, parallel_dims.py, ...)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and isinstance(module, types.ModuleType):
            if isinstance(getattr(module, "device_type", None), str):
                module.device_type = "cpu"  # type: ignore[attr-defined]
            if isinstance(getattr(module, "device_module", None), types.ModuleType):
                module.device_module = torch.cpu  # type: ignore[attr-defined]
    titan_utils.device_type, titan_utils.device_module = "cpu", torch.cpu  # type: ignore[assignment]


class NoTokenizer(Configurable):
    """The tokenizer slot when batches are synthetic: nothing is read from ``hf_assets_path``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, **_: Any) -> None:
        self.config = config
        self.eos_id = None


class SyntheticData(BaseDataLoader):
    """Endless ``({"input": tokens}, labels)`` batches of ``local_batch_size`` x ``seq_len``
    token ids below ``vocab_size``, the same on every rank of the same data-parallel rank and
    different across data-parallel ranks (the seed is ``seed + dp_rank``). ``Trainer.__init__``
    builds it with the data-parallel rank and degree, the batch size (the pipeline micro-batch
    size under pipeline parallel) and the sequence length."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab_size: int = 256
        seed: int = 0

    def __init__(self, config: Config, *, dp_rank: int, local_batch_size: int, seq_len: int, **_: Any) -> None:
        self.config = config
        self.shape = (local_batch_size, seq_len)
        self.generator = torch.Generator().manual_seed(config.seed + dp_rank)

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        while True:
            tokens = torch.randint(0, self.config.vocab_size, (self.shape[0], self.shape[1] + 1),
                                   generator=self.generator)
            yield {"input": tokens[:, :-1].clone()}, tokens[:, 1:].clone()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _CpuMonitor:
    """What the Trainer reads from the metrics' device monitor (its name, for the peak-flops
    lookup, and its peak stats, for one log line)."""

    device_name = "cpu"

    def get_peak_stats(self) -> Any:
        return types.SimpleNamespace(max_reserved_gib=0.0, max_reserved_pct=0.0)


class QuietMetrics(Configurable):
    """Metrics that never log: ``should_log`` is false, so ``train_step`` ends after the optimizer
    and scheduler steps (no loss reduction across ranks, no ``.item()``), and nothing is written."""

    @dataclass(kw_only=True, slots=True)
    class Config(Configurable.Config):
        pass

    def __init__(self, config: Config, **_: Any) -> None:
        self.config = config
        self.device_memory_monitor = _CpuMonitor()
        self.color = titan_utils.NoColor()
        self.num_flops_per_token = -1
        self.ntokens_since_last_log = 0
        self.data_loading_times: list[float] = []
        self.optimizers: Any = None
        self.model_parts: Any = None

    def should_log(self, step: int) -> bool:
        return False

    def close(self) -> None:
        pass


def prepared(config: Trainer.Config, *, synthetic_batches: bool = True) -> Trainer.Config:
    """A copy of ``config`` that runs without files or side effects: no checkpoint, validator,
    profiler, compile or CUDA graphs, quiet metrics, and (``synthetic_batches``) ``SyntheticData``
    batches below the model's vocabulary size with ``NoTokenizer`` in place of the dataset and
    tokenizer. Everything else (model, parallelism, optimizer, schedule, loss, activation
    checkpointing) is ``config``'s."""
    config = copy.deepcopy(config)
    config.checkpoint.enable = False
    config.validator.enable = False
    config.profiler.enable_profiling = False
    config.profiler.enable_memory_snapshot = False
    config.compile.enable = False
    config.training.disable_cuda_graphs = True
    config.metrics = QuietMetrics.Config()  # type: ignore[assignment]
    if synthetic_batches:
        assert config.model_spec is not None
        vocab = config.model_spec.model.vocab_size  # type: ignore[attr-defined]
        config.tokenizer = NoTokenizer.Config()  # type: ignore[assignment]
        config.dataloader = SyntheticData.Config(vocab_size=vocab)
    return config
