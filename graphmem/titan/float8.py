"""Float8 training in a torchtitan job, through torchao, as torchtitan 0.3.0 configures it.

torchtitan's ``Float8LinearConverter`` (torchtitan/components/quantization/float8.py) rewrites the
model's config tree before the model is built: every ``Linear.Config`` whose dimensions divide by
16 (and whose name is not filtered) becomes a ``Float8Linear.Config``, which builds torchao's
``Float8Linear`` (torchao/float8/float8_linear.py). The registry applies it inside
``model_registry(..., converters=[...])`` (``llama3_debugmodel_float8``, ``llama3_405b``), so the
converter runs when the job is loaded; ``with_float8`` applies it to a loaded job the same way.

**The gate.** The converter refuses unless ``has_cuda_capability(8, 9)`` (or ROCm gfx942, or
``emulate`` without compile). On this machine there is no GPU, so graphmem answers that check as
the target GPU would (``answering_as``: H100 is sm90, graphmem/capture/target.py ``GPUS``), in
the modules that imported it by value (the quantization converters) and in torchtitan/tools/
utils.py itself.

**What runs.** torchao's own ``matmul_with_hp_or_float8_args`` autograd function, on graphmem's
fake tensors: the casts (amax, scale, ``to(float8_e4m3fn)``: 1 B an element) and, without
``emulate``, ``torch._scaled_mm`` on the float8 operands; with ``emulate`` (torchtitan's "for test
purposes"; it builds ``Float8LinearConfig(emulate=True)``, tensorwise scaling whatever the recipe)
the mm runs in high precision on the dequantized operands. What it saves for backward is what its
``forward`` hands ``ctx.save_for_backward``: the high-precision input and weight (torchao 0.18 casts
again in backward), so an eager float8 job saves what the same job with plain linears saves.

**``_scaled_mm`` on the GPU** (torch aten/src/ATen/native/cuda/ScaledBlas.cpp ``_scaled_mm_cuda``,
formerly Blas.cpp): the output is ``at::empty`` resized to (M, N) of ``out_dtype``, as a plain mm's;
on sm90 with cuBLAS >= 12.9 row-wise scales go to cuBLASLt (``_scaled_gemm``), whose workspace is the
context's one cuBLASLt workspace (aten/src/ATen/cuda/CUDABlas.cpp ``CublasLtWorkspace``,
``getCUDABlasLtWorkspace``), shared with every plain mm and made once outside the step. So the
fake op's output (torch's meta kernel) is the whole rule: no workspace of its own.
"""
from __future__ import annotations

import contextlib
import copy
import types
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

from graphmem.capture.target import GPUS
from graphmem.errors import UsageError

if TYPE_CHECKING:
    import torch.nn as nn
    from torchao.float8.float8_linear import Float8Linear
    from torchtitan.trainer import Trainer

INSTALL = "pip install torchao (or pip install 'graphmem[float8]')"
RECIPES = ("rowwise", "rowwise_with_gw_hp")  # torchtitan 0.3.0's Float8LinearConverter.Config.recipe_name
CONVERTER_MODULES = ("torchtitan.tools.utils", "torchtitan.components.quantization.float8",
                     "torchtitan.components.quantization.mx", "torchtitan.components.quantization.nvfp4")


def require_torchao() -> None:
    """One line naming the install when torchao is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UsageError(f"the job trains in float8 through torchao, which is not installed: {INSTALL}") from None


@contextlib.contextmanager
def answering_as(gpu: Optional[str]) -> Iterator[None]:
    """torchtitan's ``has_cuda_capability(major, minor)`` answered as ``gpu`` would (its compute
    capability, graphmem/capture/target.py ``GPUS``); ``None`` leaves torchtitan's own answer (this
    machine's). Restored after."""
    if gpu is None:
        yield
        return
    import importlib

    capability = GPUS[gpu]

    def has_cuda_capability(major: int, minor: int) -> bool:
        return capability >= (major, minor)

    kept: list[tuple[types.ModuleType, Callable[[int, int], bool]]] = []
    for name in CONVERTER_MODULES:
        mod: Any = importlib.import_module(name)  # its has_cuda_capability replaced (not declared on ModuleType)
        kept.append((mod, mod.has_cuda_capability))
        mod.has_cuda_capability = has_cuda_capability
    try:
        yield
    finally:
        for mod, fn in kept:
            mod.has_cuda_capability = fn


def with_float8(config: Trainer.Config, recipe: str = "rowwise", emulate: bool = False, filter_fqns: Sequence[str] = (),
                gpu: Optional[str] = "h100") -> Trainer.Config:
    """A copy of the job (a torchtitan ``Trainer.Config``) whose model config went through torchtitan's
    own ``Float8LinearConverter`` (recipe ``rowwise`` or ``rowwise_with_gw_hp``, ``emulate``,
    ``filter_fqns``), its gate answered as ``gpu`` would (``None``: as this machine does, which refuses
    unless ``emulate``)."""
    if recipe not in RECIPES:
        raise UsageError(f"`recipe={recipe!r}`: torchtitan 0.3.0's Float8LinearConverter takes {' or '.join(RECIPES)}")
    if gpu is not None and gpu not in GPUS:
        raise UsageError(f"unknown gpu {gpu!r}: use one of {', '.join(GPUS)}")
    require_torchao()
    from torchtitan.components.quantization import Float8LinearConverter

    cfg = copy.deepcopy(config)
    compiled = bool(cfg.compile.enable and "model" in cfg.compile.components)
    settings = Float8LinearConverter.Config(recipe_name=recipe, emulate=emulate, filter_fqns=list(filter_fqns),
                                            model_compile_enabled=compiled)  # type: ignore[arg-type]
    try:
        with answering_as(gpu):
            converter = settings.build()
    except ValueError as e:
        raise UsageError(f"torchtitan refused float8 on {gpu or 'this machine'}: {str(e).splitlines()[0]} "
                         "(give an sm89+ `gpu`, or `emulate=True` without compile)") from None
    cfg.model_spec.model = converter.convert(cfg.model_spec.model)
    return cfg


def float8_linears(model: nn.Module) -> list[Float8Linear]:
    """The torchao ``Float8Linear`` modules of a built model (empty without torchao)."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def describe(model: nn.Module) -> str:
    """The report's words for the model's float8 linears ("" without any): how many, and their scaling
    (torchao's ``ScalingGranularity``: axiswise is the rowwise recipes', tensorwise the emulated one's)."""
    found = float8_linears(model)
    if not found:
        return ""
    config = found[0].config
    scaling = {"axiswise": "row-wise", "tensorwise": "tensor-wise"}.get(
        config.cast_config_input.scaling_granularity.value, config.cast_config_input.scaling_granularity.value)
    return f"{len(found)} float8 linears (torchao, {scaling} scaling{', emulated' if config.emulate else ''})"


def check_target(model: nn.Module, device: str) -> None:
    """A non-emulated float8 linear runs ``torch._scaled_mm``, a CUDA sm89+ kernel: refused on the CPU
    target, as torchtitan refuses it on a machine without such a GPU."""
    if device == "cpu" and any(not m.config.emulate for m in float8_linears(model)):
        raise UsageError("the job's float8 linears run torch._scaled_mm, a CUDA sm89+ kernel: analyze them with "
                         "`device='cuda'`, or convert with `emulate=True` for the CPU")


__all__ = ["INSTALL", "RECIPES", "answering_as", "check_target", "describe", "float8_linears", "require_torchao",
           "with_float8"]
