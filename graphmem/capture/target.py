"""The target a step is predicted for: device, parameter dtype, autocast, SDPA backend.

The CPU target runs PyTorch's own CPU kernels' rules on fake tensors (exact, proven against
real CPU runs). The CUDA target cannot run backward on fake CUDA tensors without a GPU (the
autograd engine needs a CUDA context: pytorch/pytorch#92627, whose fix allocates a real CUDA
tensor), so graphmem runs the step on fake CPU tensors and applies CUDA's memory-relevant
rules itself (graphmem/capture/cuda_rules.py): dropout keeps a 1-byte bool mask (CUDA's fused
native_dropout) instead of the CPU's float noise; F.scaled_dot_product_attention runs the
backend CUDA would pick (flash, memory-efficient, cuDNN or math) through that backend's own
aten op, so its saved tensors are the kernel's; autocast follows CUDA's cast lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch

from graphmem.errors import UsageError
from graphmem.units import parse_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ATTENTION = ("auto", "flash", "efficient", "cudnn", "math", "eager")  # eager: HF models' own softmax attention
MODES = ("eager", "compiled", "compiled-blocks")
BLOCKS = "compiled-blocks"  # each block of the chain and the loss compiled, the loop eager (compiled_per_block.py)
# compute capability of the GPUs users name (NVIDIA's tables)
GPUS = {"v100": (7, 0), "v100-32gb": (7, 0), "t4": (7, 5), "a100": (8, 0), "a100-40gb": (8, 0), "a10": (8, 6),
        "l4": (8, 9), "h100": (9, 0), "h200": (9, 0), "b200": (10, 0)}
# Each card's memory as CUDA reports it: cudaMemGetInfo's total, which is
# torch.cuda.get_device_properties(0).total_memory, the OOM message's "total capacity" and deviceQuery's
# "Total amount of global memory"; nvidia-smi's Total less its Reserved (the driver's share). The
# caching allocator and everything outside it (the device total's rows) share this. It moves a little
# with the driver (H100 SXM: 79.11 GiB on driver 535, 79.21 GiB on 565): ``--memory`` with a number
# overrides it. Each figure as a public log printed it:
CAPACITY: dict[str, tuple[int, str]] = {
    "v100": (16160 * 2**20, "Tesla V100-SXM2-16GB, nvidia-smi 16160MiB on driver 440 (before the Reserved row): "
             "github.com/4paradigm/k8s-vgpu-scheduler/issues/7"),
    "v100-32gb": (round(31.74 * 2**30), "V100 32GB, OOM message \"31.74 GiB total capacity\": "
                  "github.com/liucongg/ChatGLM-Finetuning/issues/73"),
    "t4": (round(14.56 * 2**30), "Tesla T4 (GCP), OOM message \"total capacity of 14.56 GiB\": "
           "github.com/Zheng-Chong/CatVTON/issues/133"),
    "a100": (85_100_068_864, "A100-SXM4-80GB, deviceQuery on driver 555.42.02: github.com/thamada/nvidia-smi "
             "gls/A100SXMx4_deviceQuery.py"),
    "a100-40gb": (42_298_834_944, "A100-SXM4-40GB, deviceQuery: github.com/bottlerocket-os/bottlerocket/pull/3873"),
    "a10": (23_609_475_072, "NVIDIA A10, deviceQuery: github.com/aalanwyr/face2cuda step2cuda/README.md"),
    "l4": (23_570_219_008, "NVIDIA L4, deviceQuery on driver 550.90.07: github.com/thamada/nvidia-smi "
           "gls/L4_deviceQuery.py"),
    "h100": (85_045_477_376, "H100 80GB HBM3 (SXM), deviceQuery on driver 565.57.01: github.com/thamada/nvidia-smi "
             "nvsim/H100SXMx8_deviceQuery.py (79.11 GiB on driver 535: github.com/vllm-project/vllm/issues/27508)"),
    "h200": (143156 * 2**20, "NVIDIA H200, _CudaDeviceProperties total_memory=143156MB: github.com/ai-bot-pro/achatbot "
             "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"),
    "b200": (182642 * 2**20, "NVIDIA B200, _CudaDeviceProperties total_memory=182642MB: github.com/ai-bot-pro/achatbot "
             "deploy/modal/src/llm/vllm/vlm/skywork_r1v.py"),
}
CARD = "gpu"  # a memory size that names the target card's capacity: ``--memory gpu``, ``budget="gpu"``


@dataclass(frozen=True)
class Target:
    device: str = "cpu"  # "cpu" | "cuda"
    dtype: Optional[str] = None  # parameter dtype: None (as built, fp32) | "fp32" | "bf16" | "fp16"
    amp: Optional[str] = None  # autocast dtype: None | "bf16" | "fp16"
    attention: str = "auto"  # SDPA backend on the CUDA target
    gpu: str = "h100"  # GPU generation for the CUDA backend rules
    # "eager" | "compiled" (torch.compile of the model: AOTAutograd + min-cut partition) | "compiled-blocks"
    # (torch.compile of each block of its chain and of the loss, the rest eager: graphmem/capture/compiled_per_block.py)
    mode: str = "eager"
    # compiled mode: torch._functorch.config.activation_memory_budget for the partition (None: torch's own, 1.0)
    memory_budget: Optional[float] = None
    # compiled mode: the torch.compile backend whose partition is predicted: "aot_eager", or "inductor"
    # (its decompositions and pre-grad and joint-graph passes first: graphmem/capture/inductor_partition.py);
    # either way the split graphs run op by op (no Inductor code generated)
    compile_backend: str = "aot_eager"

    @property
    def param_dtype(self) -> Optional[torch.dtype]:
        return DTYPES[self.dtype] if self.dtype else None

    @property
    def amp_dtype(self) -> Optional[torch.dtype]:
        return DTYPES[self.amp] if self.amp else None

    @property
    def capability(self) -> tuple[int, int]:
        return GPUS[self.gpu]

    @property
    def capacity(self) -> int:
        """The card's memory as CUDA reports it (``CAPACITY``)."""
        return CAPACITY[self.gpu][0]

    def describe(self) -> str:
        parts = [self.device + (" (CUDA rules on fake CPU tensors)" if self.device == "cuda" else "")]
        if self.dtype:
            parts.append(f"params {self.dtype}")
        if self.amp:
            parts.append(f"amp {self.amp}")
        if self.device == "cuda":
            parts.append(f"attention {self.attention} on {self.gpu}")
        elif self.attention != "auto":
            parts.append(f"attention {self.attention}")
        if self.mode == "compiled":
            parts.append("torch.compile (AOTAutograd, min-cut partition"
                         + (", Inductor's decompositions and joint-graph passes" if self.compile_backend == "inductor" else "")
                         + (f", activation memory budget {self.memory_budget:g})" if self.memory_budget is not None else ")"))
        elif self.mode == BLOCKS:
            parts.append("torch.compile per block and loss (AOTAutograd, min-cut partition"
                         + (f", activation memory budget {self.memory_budget:g})" if self.memory_budget is not None else ")"))
        return ", ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {"device": self.device, "dtype": self.dtype or "fp32", "amp": self.amp,
                "attention": self.attention, "gpu": self.gpu if self.device == "cuda" else None,
                "mode": self.mode, "memory_budget": self.memory_budget,
                **({"compile_backend": self.compile_backend} if self.compile_backend != "aot_eager" else {})}


def make_target(device: str = "cpu", dtype: Optional[str] = None, amp: Optional[str] = None,
                attention: str = "auto", gpu: str = "h100", mode: str = "eager",
                memory_budget: Optional[float] = None) -> Target:
    """Check the options and name the fix when they do not fit together."""
    device = str(device)
    if device not in ("cpu", "cuda"):
        raise UsageError(f"unknown device {device!r}: use cpu or cuda")
    check_device(device)
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"unknown dtype {dtype!r}: use fp32, bf16 or fp16")
    if amp is not None and amp not in ("bf16", "fp16"):
        raise UsageError(f"unknown amp dtype {amp!r}: use bf16 or fp16")
    if amp is not None and dtype not in (None, "fp32"):
        raise UsageError(f"`amp={amp}` casts fp32 parameters; with `dtype={dtype}` there is nothing to cast: drop one")
    if attention not in ATTENTION:
        raise UsageError(f"unknown attention backend {attention!r}: use one of {', '.join(ATTENTION)}")
    if gpu not in GPUS:
        raise UsageError(f"unknown gpu {gpu!r}: use one of {', '.join(GPUS)}")
    if device == "cpu" and attention in ("efficient", "cudnn"):
        raise UsageError(f"`attention={attention}` is a CUDA kernel; on the CPU target use auto, flash or math")
    if mode not in MODES:
        raise UsageError(f"unknown mode {mode!r}: use eager, compiled or compiled-blocks")
    if memory_budget is not None:
        memory_budget = check_memory_budget(memory_budget)
        if mode not in ("compiled", BLOCKS):
            raise UsageError("`memory_budget` sets torch.compile's partitioner (activation_memory_budget): "
                             "add `mode='compiled'` (or `mode='compiled-blocks'`)")
    return Target(device, dtype, amp, attention, gpu, mode, memory_budget)


def check_memory_budget(value: object) -> float:
    """``activation_memory_budget`` is a fraction of the activations the default partition
    saves: 0 (recompute all it can) to 1 (PyTorch's default)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise UsageError(f"memory budget {value!r} is outside [0, 1]: give a fraction of the saved activations, "
                         "e.g. `memory_budget=0.5` (1 is torch.compile's default)")
    return float(value)


def check_device(device: str) -> None:
    """Fake CUDA tensors need a CUDA build of torch (no GPU needed); say so in one line."""
    if torch.device(device).type == "cuda" and torch.version.cuda is None:
        raise UsageError(
            f"`device='cuda'` needs a CUDA build of PyTorch (it runs without a GPU); this is torch "
            f"{torch.__version__} without CUDA: pip install torch==2.14.1 (the default PyPI wheel is a CUDA build)"
        )


def memory_limit(memory: Union[str, int, None], target: Optional[Target], what: str = "memory") -> int:
    """A budget in bytes: ``memory`` as ``parse_bytes`` reads it, or the CUDA target's card
    (``"gpu"``, or None where a budget is required) at its capacity as CUDA reports it (``CAPACITY``)."""
    if memory is None or (isinstance(memory, str) and memory.strip().lower() == CARD):
        if target is None or target.device != "cuda":
            raise UsageError(f"give a {what} size, e.g. 24GiB: the CPU target has no card whose capacity graphmem "
                             "knows (`gpu` names the CUDA target's, with device='cuda')")
        return target.capacity
    return parse_bytes(memory)
