"""A model calling a torch.library.custom_op that has no fake implementation (exit 1).

The op namespace is unique per import: the tests import this file more than once, and
registering the same op name twice would fail at import (a different error).
"""
import uuid

import torch
import torch.nn as nn

_NAME = f"graphmem_badop_{uuid.uuid4().hex[:12]}::double"


@torch.library.custom_op(_NAME, mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2  # a real kernel only; deliberately no register_fake


class CustomOpModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return double(self.lin(x))


model = CustomOpModel()
