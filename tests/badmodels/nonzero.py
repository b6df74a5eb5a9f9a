"""A data-dependent model: `torch.nonzero` used for indexing has a value-dependent shape (exit 1)."""
import torch
import torch.nn as nn


class NonzeroModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        idx = torch.nonzero(y > 0)[:, 0]  # how many rows depends on the values
        return y[idx]


model = NonzeroModel()
