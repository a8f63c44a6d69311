"""A ResNet-50-layout classifier defined in PyTorch (torchvision does not import beside the CPU torch here).

Bottleneck blocks (1x1, 3x3, 1x1 convolutions with batch norm, projection shortcuts), layout
(3, 4, 6, 3), 1000 classes, 224x224 input: the same architecture as torchvision's resnet50, with
seeded random weights. The last batch norm of each residual branch starts at 0.2 so activations
stay bounded through depth, as a trained network's do.

    accel-opt build examples/resnet_torch.py:resnet50 --shapes image:1x3x224x224
"""

from __future__ import annotations

import torch
from torch import nn

LAYOUT = (3, 4, 6, 3)
SHAPES = {"image": [1, 3, 224, 224]}


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, mid: int, stride: int = 1):
        super().__init__()
        c_out = mid * self.expansion
        self.conv1, self.bn1 = nn.Conv2d(c_in, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.conv2, self.bn2 = nn.Conv2d(mid, mid, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(mid)
        self.conv3, self.bn3 = nn.Conv2d(mid, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet(nn.Module):
    def __init__(self, layout: tuple[int, ...] = LAYOUT, width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages, c_in = [], width
        for index, blocks in enumerate(layout):
            mid = width * 2**index
            for block in range(blocks):
                stages.append(Bottleneck(c_in, mid, stride=2 if index > 0 and block == 0 else 1))
                c_in = mid * Bottleneck.expansion
        self.layers = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.layers(self.stem(image))), 1))


def _init(model: ResNet) -> None:
    for module in model.modules():
        if isinstance(module, nn.Conv2d):
            nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(module, nn.BatchNorm2d):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
    for block in model.layers:
        nn.init.constant_(block.bn3.weight, 0.2)


def resnet50(num_classes: int = 1000, seed: int = 0) -> nn.Module:
    """Factory: ResNet-50 layout with seeded weights, eval mode (the global RNG is left untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = ResNet(LAYOUT, num_classes=num_classes)
        _init(model)
    return model.eval()
