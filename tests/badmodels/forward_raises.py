"""A model whose forward raises: a view to a shape the input does not have (exit 1)."""
import torch
import torch.nn as nn


class BadView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1, 3)  # (b, 4) has no view with 3 columns for b=2


model = BadView()
