"""A torchtitan job as graphmem runs it: the job's own ``Trainer.Config`` (from torchtitan's config
registry and its own command-line overrides, ``torchtitan/config/manager.py`` ``ConfigManager``),
with only the parts that touch the outside world replaced, the same way for the fake capture
(graphmem/titan/capture.py) and for a real run (tests/titan_truth.py):

- the data: torchtitan's HF dataloader and tokenizer read files this machine does not have
  (``hf_assets_path``, the c4 dataset); ``SyntheticTokens`` yields batches of the same shape
  ((local batch, seq_len) token ids and their labels, as ``HuggingFaceTextDataLoader`` yields:
  ``({"input": x}, y)``), and ``NoTokenizer`` stands for the tokenizer;
- the metrics: ``QuietMetrics`` keeps the Trainer's bookkeeping attributes but never logs (so the
  step never reads a loss or a norm as a Python number: a logged step holds a 4-byte loss copy
  more, ``Trainer.train_step``'s ``accumulated_loss``);
- checkpointing, validation, profiling and CUDA graphs are off (no tensors of the step).

torchtitan picks its device as ``_get_available_device_type() or "cuda"`` (tools/utils.py), so on a
machine without a GPU it believes it is on CUDA; ``on_cpu()`` points the modules that imported
that choice at the CPU.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence, Union

import torch

from graphmem.errors import UsageError

if TYPE_CHECKING:
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.trainer import Trainer


def is_job_config(obj: object) -> bool:
    """A torchtitan ``Trainer.Config`` (or a subclass's), without importing torchtitan."""
    return any(c.__module__.startswith("torchtitan.") and c.__qualname__.endswith("Trainer.Config")
               for c in type(obj).__mro__)


def load_job(name: str, overrides: Sequence[str] = (), module: Optional[str] = None,
             gpu: Optional[str] = "h100") -> Trainer.Config:
    """The ``Trainer.Config`` torchtitan's own launcher builds for ``--config name`` plus its
    command-line ``overrides`` (``["--training.seq_len", "4096", ...]``), parsed by torchtitan's
    ``ConfigManager``. ``module`` (``llama3``, ``deepseek_v3``, ...) defaults to the model family
    whose config registry defines ``name``. The registry's quantization converters run here and
    ask for the GPU's compute capability: answered as ``gpu`` would (graphmem/titan/float8.py
    ``answering_as``; ``None``: as this machine does)."""
    _torchtitan()
    from torchtitan.config.manager import ConfigManager

    from graphmem.titan.float8 import INSTALL, answering_as

    module = module or _family(name)
    said = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(said), answering_as(gpu):
            return ConfigManager().parse_args(["--module", module, "--config", name, *overrides])
    except SystemExit:  # tyro's usage message for an unknown or malformed override, or a refused config
        why = _tyro_reason(said.getvalue())
        raise UsageError(f"torchtitan refused the overrides {' '.join(overrides)!r} for {name}: {why}") from None
    except ImportError as e:
        if "torchao" in str(e):  # torchtitan's float8 converter without torchao (components/quantization/float8.py)
            raise UsageError(f"the job {name} trains in float8 through torchao, which is not installed: {INSTALL}") \
                from None
        raise UsageError(f"torchtitan could not load the job {module}/{name}: {str(e).splitlines()[0]}") from None
    except (ValueError, AttributeError) as e:
        raise UsageError(f"torchtitan could not load the job {module}/{name}: {str(e).splitlines()[0]}") from None


def _tyro_reason(text: str) -> str:
    """The first line of tyro's boxed message that says what was wrong."""
    lines = [line.strip(" │╭╮╰╯─\n") for line in text.splitlines()]
    lines = [line for line in lines if line.strip("-─ ") and not line.startswith(("usage:", "For full helptext"))]
    for i, line in enumerate(lines):
        if "Error" in line or "Unrecognized" in line or "Invalid" in line:
            return " ".join(lines[i:i + 2]).strip()
    return "give them as torchtitan's own train.py takes them (e.g. --training.seq_len 4096)"


def _family(name: str) -> str:
    """The model family (torchtitan/models/<family>/config_registry.py) that defines ``name``."""
    import importlib

    from torchtitan.models import _supported_models

    found = []
    for family in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{family}.config_registry")
        except ImportError:
            continue
        if callable(getattr(registry, name, None)):
            found.append(family)
    if not found:
        raise UsageError(f"no torchtitan model family defines the config {name!r}: give one of its registries' names "
                         "(e.g. llama3_debugmodel, llama3_8b, deepseek_v3_debugmodel)")
    return found[0]


def _torchtitan() -> None:
    try:
        import torchtitan  # noqa: F401
    except ImportError:
        raise UsageError("torchtitan is not installed: pip install 'graphmem[titan]' (torchtitan 0.3.0)") from None


def prepared(config: Trainer.Config) -> Trainer.Config:
    """A copy of the job's config with the data, metrics, checkpointing, validation, profiling
    and CUDA graphs replaced or off (the module docstring); the model, parallelism, training
    loop, optimizer, scheduler, loss, activation checkpointing and compile settings untouched."""
    _torchtitan()
    cfg = copy.deepcopy(config)
    vocab = _vocab(cfg)
    cfg.tokenizer = _classes().NoTokenizer.Config()
    cfg.dataloader = _classes().SyntheticTokens.Config(vocab_size=vocab)
    cfg.metrics = _classes().QuietMetrics.Config()
    cfg.checkpoint.enable = False
    cfg.validator.enable = False
    cfg.profiler.enable_profiling = False
    cfg.profiler.enable_memory_snapshot = False
    cfg.training.disable_cuda_graphs = True
    return cfg


def with_sdpa(config: Trainer.Config) -> Trainer.Config:
    """A copy of the job with every FlexAttention inner attention replaced by torchtitan's
    ``ScaledDotProductAttention`` (``is_causal=True``, one document per sequence): the attention
    torchtitan's published Llama 3 runs used (torchtitan/benchmarks/llama3_h100_202412_torchtitan.md: SDPA),
    and the one a CPU can train (FlexAttention has no CPU backward: torch/nn/attention/
    flex_attention.py ``_validate_device``). Changed through the config tree's own ``traverse``."""
    _torchtitan()
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    cfg = copy.deepcopy(config)
    found = list(cfg.model_spec.model.traverse(FlexAttention.Config))
    for _fqn, _old, parent, attr in found:
        if parent is None:
            raise UsageError("the job's model is a bare attention module: nothing to swap")
        setattr(parent, attr, ScaledDotProductAttention.Config()) if isinstance(attr, str) \
            else parent.__setitem__(attr, ScaledDotProductAttention.Config())
    return cfg


def _vocab(config: Trainer.Config) -> int:
    model = getattr(config.model_spec, "model", None)
    vocab = getattr(model, "vocab_size", None)
    if not isinstance(vocab, int):
        raise UsageError(f"the job's model ({type(model).__name__}) names no vocab_size: graphmem runs torchtitan's "
                         "language models (llama3, qwen3, deepseek_v3, gpt_oss)")
    return vocab


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """torchtitan's device choice (``device_type``/``device_module``, imported by value into the
    modules below) pointed at the CPU while the job runs; restored after."""
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as tools

    kept: list[tuple[types.ModuleType, str, Union[str, types.ModuleType, Callable[[], torch.device]]]] = []
    cpu = torch.device("cpu")
    for mod in (tools, metrics, parallel_dims, dist_utils, token_dispatcher):
        for name, value in (("device_type", "cpu"), ("device_module", torch.cpu), ("get_local_device", lambda: cpu)):
            if hasattr(mod, name):
                kept.append((mod, name, getattr(mod, name)))
                setattr(mod, name, value)
    try:
        yield
    finally:
        for mod, name, value in kept:
            setattr(mod, name, value)


def synthetic_batches(config: Trainer.Config, count: int, seed: int = 0) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """``count`` batches as the job's dataloader yields them to ``Trainer.train_step``: for each
    data-parallel micro-step (and each pipeline micro-batch), (local batch or pipeline micro-batch
    size, seq_len) token ids and the next tokens as labels."""
    t = config.training
    b = config.parallelism.pipeline_parallel_microbatch_size if config.parallelism.pipeline_parallel_degree > 1 \
        else t.local_batch_size
    gen = torch.Generator().manual_seed(seed)
    return [_tokens(_vocab(config), b, t.seq_len, gen) for _ in range(count)]


def _tokens(vocab: int, b: int, s: int, gen: Optional[torch.Generator]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One batch as torchtitan's text dataloaders yield it: token ids, their per-document
    positions (one document per row: 0..s-1; the flex/varlen masks are built from them) and the
    next tokens as labels."""
    x = torch.randint(0, vocab, (b, s + 1), generator=gen)
    positions = torch.arange(s).expand(b, s).contiguous()
    return {"input": x[:, :-1].contiguous(), "positions": positions}, x[:, 1:].contiguous()


@functools.cache
def _classes() -> types.SimpleNamespace:
    """torchtitan ``Configurable`` components (defined on first use: torchtitan is optional)."""
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.config import Configurable

    class NoTokenizer(Configurable):
        """Stands for the tokenizer: the synthetic data needs none."""

        @dataclass(kw_only=True, slots=True)
        class Config(Configurable.Config):
            pass

        def __init__(self, config: NoTokenizer.Config, tokenizer_path: Optional[str] = None) -> None:
            self.config = config

    class SyntheticTokens(BaseDataLoader):
        """Random token batches of the job's shape (``synthetic_batches``), endlessly."""

        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            vocab_size: int = 2048

        def __init__(self, config: SyntheticTokens.Config, *, seq_len: int, local_batch_size: int,
                     **_: object) -> None:
            self.config, self.seq_len, self.batch = config, seq_len, local_batch_size

        def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
            while True:
                yield _tokens(self.config.vocab_size, self.batch, self.seq_len, None)

        def state_dict(self) -> dict[str, object]:
            return {}

        def load_state_dict(self, state_dict: dict[str, object]) -> None:
            pass

    return types.SimpleNamespace(NoTokenizer=NoTokenizer, SyntheticTokens=SyntheticTokens, QuietMetrics=_quiet_metrics())


def _quiet_metrics() -> type[MetricsProcessor]:
    from torchtitan.components.metrics import MetricsProcessor

    class QuietMetrics(MetricsProcessor):
        """The attributes ``Trainer`` reads and writes on its metrics processor, with no device
        memory monitor (torchtitan's asks the CUDA driver) and no logging."""

        @dataclass(kw_only=True, slots=True)
        class Config(MetricsProcessor.Config):
            pass

        def __init__(self, config: QuietMetrics.Config, **_: object) -> None:
            self.config = config
            self.ntokens_since_last_log = 0
            self.data_loading_times: list[float] = []
            self.num_flops_per_token = 0
            self.optimizers = self.model_parts = None
            self.color = _NoColor()
            self.device_memory_monitor = _NoMonitor()

        def should_log(self, step: int) -> bool:
            return False

        def log(self, *args: object, **kwargs: object) -> None:
            pass

        def close(self) -> None:
            pass

    return QuietMetrics


class _NoColor:
    def __getattr__(self, name: str) -> str:
        return ""


class _NoMonitor:
    device_name = "graphmem"

    def get_peak_stats(self) -> types.SimpleNamespace:
        return types.SimpleNamespace(max_reserved_gib=0.0, max_reserved_pct=0.0, max_active_gib=0.0,
                                     max_active_pct=0.0, num_alloc_retries=0, num_ooms=0)

    def reset_peak_stats(self) -> None:
        pass


__all__ = ["is_job_config", "load_job", "on_cpu", "prepared", "synthetic_batches", "with_sdpa"]
