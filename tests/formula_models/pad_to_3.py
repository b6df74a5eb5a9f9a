"""A model that pads the sequence to a multiple of 3: its bytes are not a polynomial in s."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Padded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (b, s, 16)
        pad = (-x.shape[1]) % 3
        x = F.pad(x, (0, 0, 0, pad))  # (b, ceil(s / 3) * 3, 16)
        return torch.tanh(self.out(x))


model = Padded
