"""ResNet (He et al. 2016, "Deep Residual Learning for Image Recognition").

BasicBlock (ResNet-18/34) and Bottleneck (ResNet-50/101) variants. The
Bottleneck puts the stride on the 3x3 conv ("ResNet v1.5"), which changes
activation shapes slightly but not the parameter count. Self-contained: it
imports only torch and the standard library so it can be loaded directly by
path as a model file.
"""

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ResNetConfig:
    block: str = "basic"  # "basic" or "bottleneck"
    layers: tuple[int, int, int, int] = (2, 2, 2, 2)  # blocks per stage (default: ResNet-18)
    num_classes: int = 1000
    width: int = 64  # channels of the stem and first stage; stages use width * (1, 2, 4, 8)
    in_channels: int = 3


# Published depths: He et al. 2016, Table 1.
PRESETS: dict[str, ResNetConfig] = {
    "resnet18": ResNetConfig(block="basic", layers=(2, 2, 2, 2)),
    "resnet34": ResNetConfig(block="basic", layers=(3, 4, 6, 3)),
    "resnet50": ResNetConfig(block="bottleneck", layers=(3, 4, 6, 3)),
    "resnet101": ResNetConfig(block="bottleneck", layers=(3, 4, 23, 3)),
}


def conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    # Bias is redundant before BatchNorm, so every conv here has bias=False.
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return conv, nn.BatchNorm2d(c_out)


def projection(c_in: int, c_out: int, stride: int) -> nn.Module | None:
    # 1x1 projection shortcut (option B) only where the residual shape changes.
    if stride == 1 and c_in == c_out:
        return None
    conv, bn = conv_bn(c_in, c_out, 1, stride)
    return nn.Sequential(conv, bn)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = conv_bn(c_in, planes, 3, stride)
        self.conv2, self.bn2 = conv_bn(planes, planes, 3)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = projection(c_in, planes, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (b, c, h', w')
        out = self.relu(self.bn1(self.conv1(x)))  # (b, c, h', w')
        out = self.bn2(self.conv2(out))
        out += identity  # in-place, as in the reference implementation
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        c_out = planes * self.expansion
        self.conv1, self.bn1 = conv_bn(c_in, planes, 1)  # reduce
        self.conv2, self.bn2 = conv_bn(planes, planes, 3, stride)  # spatial (carries the stride)
        self.conv3, self.bn3 = conv_bn(planes, c_out, 1)  # expand
        self.relu = nn.ReLU(inplace=True)
        self.downsample = projection(c_in, c_out, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)  # (b, 4p, h', w')
        out = self.relu(self.bn1(self.conv1(x)))  # (b, p, h, w)
        out = self.relu(self.bn2(self.conv2(out)))  # (b, p, h', w')
        out = self.bn3(self.conv3(out))  # (b, 4p, h', w')
        out += identity
        return self.relu(out)


BLOCKS: dict[str, type[BasicBlock] | type[Bottleneck]] = {"basic": BasicBlock, "bottleneck": Bottleneck}


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        if config.block not in BLOCKS:
            raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {config.block!r}")
        if len(config.layers) != 4:
            raise ValueError(f"layers must have 4 stages, got {tuple(config.layers)}")
        self.config = config
        block = BLOCKS[config.block]
        w = config.width
        # Stem: 7x7/2 conv + 3x3/2 max-pool, i.e. 4x spatial reduction.
        self.conv1 = nn.Conv2d(config.in_channels, w, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(w)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        c_in = w
        stages: list[nn.Sequential] = []
        for i, n_blocks in enumerate(config.layers):
            planes = w * 2**i
            stride = 1 if i == 0 else 2  # stages 2-4 halve the spatial size
            blocks: list[nn.Module] = []
            for j in range(n_blocks):
                blocks.append(block(c_in, planes, stride if j == 0 else 1))
                c_in = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))  # any input size works, even 32x32
        self.fc = nn.Linear(c_in, config.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))  # (b, w, H/4, W/4)
        x = self.layer1(x)  # (b, w*e, H/4, W/4)
        x = self.layer2(x)  # (b, 2w*e, H/8, W/8)
        x = self.layer3(x)  # (b, 4w*e, H/16, W/16)
        x = self.layer4(x)  # (b, 8w*e, H/32, W/32)
        x = torch.flatten(self.avgpool(x), 1)  # (b, 8w*e)
        return self.fc(x)  # (b, num_classes)


def build(config: ResNetConfig) -> ResNet:
    return ResNet(config)


def model() -> ResNet:
    return ResNet(PRESETS["resnet50"])


def example_inputs(shape: tuple[int, ...], config: ResNetConfig | None = None) -> tuple[torch.Tensor]:
    """Random images of `shape` (b, in_channels, H, W) on the current default device."""
    return (torch.randn(tuple(shape)),)


def loss(output: torch.Tensor, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Cross entropy against class 0: the value is meaningless, the graph is realistic."""
    targets = torch.zeros(output.shape[0], dtype=torch.long, device=output.device)  # (b,)
    return F.cross_entropy(output, targets)
