"""Target device checks."""
from __future__ import annotations

import torch

from .errors import UsageError


def check_device(device: str) -> None:
    """Fake CUDA tensors need a CUDA build of torch (no GPU needed); say so in one line."""
    if torch.device(device).type == "cuda" and torch.version.cuda is None:
        raise UsageError(
            f"--device cuda needs a CUDA build of PyTorch (it runs without a GPU); this is torch "
            f"{torch.__version__} without CUDA: pip install torch==2.14.1 (the default PyPI wheel is a CUDA build)"
        )
