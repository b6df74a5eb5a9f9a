"""A data-dependent model: `.item()` in forward needs real values (exit 1)."""
import torch
import torch.nn as nn


class ItemModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        scale = y.abs().max().item()  # reads a value: impossible on fake tensors
        return y / scale


model = ItemModel()
