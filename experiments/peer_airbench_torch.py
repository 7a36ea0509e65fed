"""The peer of ``configs/cifar10_airbench.yaml``'s step, measured on the same machine: the airbench
network with the same recipe (SGD + Nesterov with BatchNorm biases at 64x the learning rate,
weight decay, label smoothing, 2-pixel translation + flip), written in plain PyTorch, eager,
fp32, channels-last.

    pip install torch==2.13.0 numpy      # in a separate venv: torch is not a hopperjax dependency
    python experiments/peer_airbench_torch.py [--batch 1000] [--steps 5] [--width 64]

Our own implementation, layer for layer as ``models/resnet.py`` builds ``airbench``: a frozen 2x2
whitening convolution (24 filters, with a trained bias), GELU, three groups of (3x3 convolution,
2x2 max pool, BatchNorm without scale, GELU, 3x3 convolution, BatchNorm, GELU) of 64, 256, 256
channels, a global max pool and a bias-free classifier scaled by 1/9. Random uint8 images stand
in for CIFAR-10 and random filters for the whitening ones (the step's cost depends on neither).
Each step is timed from the uint8 batch to the loss read back on the host, augmentation
included; the first (warm-up) step is left out. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

import torch
from peer_resnet9_torch import augment, time_steps
from torch import nn
from torch.nn import functional as F


def norm(channels: int) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(channels, eps=1e-12, momentum=0.1)
    bn.weight.requires_grad = False  # the scale stays 1; the bias trains
    return bn


class Group(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv0 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.conv1 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn0, self.bn1 = norm(cout), norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.bn0(F.max_pool2d(self.conv0(x), 2)))
        return F.gelu(self.bn1(self.conv1(x)))


class Airbench(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        self.whiten = nn.Conv2d(3, 24, 2, bias=True)
        self.whiten.weight.requires_grad = False
        widths = (width, 4 * width, 4 * width)
        self.groups = nn.Sequential(
            *(Group(cin, cout) for cin, cout in zip((24, *widths[:-1]), widths, strict=True))
        )
        self.head = nn.Linear(widths[-1], classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(F.gelu(self.whiten(x))).amax(dim=(2, 3))
        return self.head(x) / 9


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Airbench(args.width).to(memory_format=torch.channels_last)
    lr, decay = 1.27, 1.5e-3  # the recipe's peak; the value does not change the step's cost
    biases = [p for n, p in model.named_parameters() if ".bn" in n and p.requires_grad]
    other = [p for n, p in model.named_parameters() if ".bn" not in n and p.requires_grad]
    opt = torch.optim.SGD(
        [{"params": biases, "lr": 64 * lr, "weight_decay": decay / 64},
         {"params": other, "lr": lr, "weight_decay": decay}],
        momentum=0.85, nesterov=True,
    )  # fmt: skip
    print(json.dumps(time_steps(model, opt, lambda x: augment(x, padding=2, cutout=0), args)))


if __name__ == "__main__":
    main()
