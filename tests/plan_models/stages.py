"""A chain of unlike blocks in two stages run one after another (as a ResNet's layer1..layer4):
the blocks differ in width, so no two are alike and the plan is made over heterogeneous
blocks measured at full depth, with segments that may span both stages."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.ln(x))))


class Model(nn.Module):
    def __init__(self, vocab: int = 101, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.stage1 = nn.Sequential(*(Block(d, h) for h in (32, 64, 128)))
        self.stage2 = nn.Sequential(*(Block(d, h) for h in (256, 96, 48)))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.stage2(self.stage1(self.emb(tokens)))))


def model() -> nn.Module:
    return Model()


def loss(output: torch.Tensor, inputs: tuple) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), inputs[0].reshape(-1))
