"""A plain multi-layer perceptron classifier.

The simplest possible training step: a stack of Linear layers with an
activation (plus optional LayerNorm and Dropout) per hidden layer.
Self-contained: it imports only torch and the standard library so it can be
loaded directly by path as a model file.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class MLPConfig:
    in_features: int = 784
    hidden: tuple[int, ...] = (1024, 1024)  # width of each hidden layer
    out_features: int = 10
    activation: str = "relu"  # one of ACTIVATIONS
    dropout: float = 0.0  # 0 means no Dropout module at all
    layernorm: bool = False  # LayerNorm after each hidden Linear, before the activation


PRESETS: dict[str, MLPConfig] = {
    # Classic MNIST MLP: 28*28 pixels -> 1024 -> 1024 -> 10 classes.
    "mlp-mnist": MLPConfig(),
    # A wide, transformer-FFN-sized stack: 4096 -> 16384 -> 4096 -> 4096.
    "mlp-large": MLPConfig(
        in_features=4096, hidden=(16384, 4096), out_features=4096,
        activation="gelu", dropout=0.1, layernorm=True,
    ),
}

ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
}


class MLP(nn.Module):
    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        if config.activation not in ACTIVATIONS:
            raise ValueError(
                f"unknown activation {config.activation!r}; expected one of {sorted(ACTIVATIONS)}"
            )
        self.config = config
        layers: list[nn.Module] = []
        width = config.in_features
        for h in config.hidden:
            layers.append(nn.Linear(width, h))
            if config.layernorm:
                layers.append(nn.LayerNorm(h))
            layers.append(ACTIVATIONS[config.activation]())
            if config.dropout > 0:
                layers.append(nn.Dropout(config.dropout))
            width = h
        layers.append(nn.Linear(width, config.out_features))  # classifier head, no activation
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (b, in_features) -> (b, out_features)


def build(config: MLPConfig) -> MLP:
    return MLP(config)


def model() -> MLP:
    return MLP(PRESETS["mlp-mnist"])


def example_inputs(shape: tuple[int, ...], config: MLPConfig | None = None) -> tuple[torch.Tensor]:
    """Random float features of `shape` (b, in_features) on the current default device.

    `config` is accepted for a uniform interface; the shape already fixes everything.
    """
    return (torch.randn(tuple(shape)),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross entropy against class 0: the value is meaningless, the graph is realistic."""
    targets = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)  # (b,)
    return F.cross_entropy(output, targets)
