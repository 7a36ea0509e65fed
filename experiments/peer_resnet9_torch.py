"""The peer of ``configs/cifar10_resnet.yaml``'s step, measured on the same machine: ResNet-9 with
the same recipe (SGD + Nesterov, weight decay, label smoothing, crop + flip + cutout), written in
plain PyTorch, eager, fp32, channels-last.

    pip install torch==2.13.0 numpy      # in a separate venv: torch is not a hopperjax dependency
    python experiments/peer_resnet9_torch.py [--batch 512] [--steps 5] [--width 64]

Our own implementation of Page's DAWNBench network, layer for layer as ``models/resnet.py``
builds ``resnet9`` (no code from elsewhere): prep 3x3 convolution, three stages (3x3 convolution,
BatchNorm, ReLU, 2x2 max pool; residual pairs after stages 1 and 3), global max pool, a linear
classifier scaled by 0.125. Random uint8 images stand in for CIFAR-10 (the step's cost does not
depend on the pixels). Each step is timed from the uint8 batch to the loss read back on the host,
augmentation included; the first (warm-up) step is left out. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

MEAN = (0.4913, 0.4821, 0.4465)
STD = (0.2452, 0.2428, 0.2606)


def conv_bn(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout, momentum=0.1),
        nn.ReLU(inplace=True),
    )  # fmt: skip


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = conv_bn(width, width), conv_bn(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(self.a(x))


class ResNet9(nn.Module):
    def __init__(self, width: int = 64, classes: int = 10) -> None:
        super().__init__()
        w = width
        self.body = nn.Sequential(
            conv_bn(3, w),
            conv_bn(w, 2 * w), nn.MaxPool2d(2), Residual(2 * w),
            conv_bn(2 * w, 4 * w), nn.MaxPool2d(2),
            conv_bn(4 * w, 8 * w), nn.MaxPool2d(2), Residual(8 * w),
        )  # fmt: skip
        self.head = nn.Linear(8 * w, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(x).amax(dim=(2, 3))
        return self.head(x) * 0.125


def augment(images: torch.Tensor, padding: int = 4, cutout: int = 8) -> torch.Tensor:
    """uint8 [B, 32, 32, 3] -> normalized fp32 [B, 3, 32, 32] (channels-last memory):
    reflect-padded random crop, flip, normalization, cutout; per image."""
    b, h, w, _ = images.shape
    x = images.permute(0, 3, 1, 2).float().div_(255)
    x = F.pad(x, (padding,) * 4, mode="reflect")
    tops = torch.randint(0, 2 * padding + 1, (b,))
    lefts = torch.randint(0, 2 * padding + 1, (b,))
    rows = (tops[:, None] + torch.arange(h)[None, :])[:, None, :, None]
    x = x.gather(2, rows.expand(b, 3, h, x.shape[3]))
    cols = (lefts[:, None] + torch.arange(w)[None, :])[:, None, None, :]
    x = x.gather(3, cols.expand(b, 3, h, w))
    flip = torch.rand(b) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(3), x)
    mean = torch.tensor(MEAN)[None, :, None, None]
    std = torch.tensor(STD)[None, :, None, None]
    x = (x - mean) / std
    cy, cx = torch.randint(0, h, (b,)), torch.randint(0, w, (b,))
    r = torch.arange(h)[None, :] - (cy[:, None] - cutout // 2)
    c = torch.arange(w)[None, :] - (cx[:, None] - cutout // 2)
    inside = ((r >= 0) & (r < cutout))[:, :, None] & ((c >= 0) & (c < cutout))[:, None, :]
    x = x.masked_fill(inside[:, None], 0.0)
    return x.contiguous(memory_format=torch.channels_last)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ResNet9(args.width).to(memory_format=torch.channels_last)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    other = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.SGD(
        [{"params": decay, "weight_decay": 5e-4}, {"params": other, "weight_decay": 0.0}],
        lr=0.1, momentum=0.9, nesterov=True,
    )  # fmt: skip
    print(json.dumps(time_steps(model, opt, augment, args)))


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, prepare, args) -> dict:
    """The median of ``args.steps`` timed training steps on random uint8 images (after one
    untimed warm-up), each from the uint8 batch through ``prepare`` (the augmentation) to the
    loss read back on the host; a JSON-able summary. Shared with peer_airbench_torch.py."""
    images = torch.randint(0, 256, (args.batch, 32, 32, 3), dtype=torch.uint8)
    labels = torch.randint(0, 10, (args.batch,))
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        logits = model(prepare(images))
        loss = F.cross_entropy(logits, labels, label_smoothing=0.2)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss.item()
        times.append(time.perf_counter() - start)
    step = statistics.median(times[1:])
    return {
        "framework": f"torch {torch.__version__}", "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "batch": args.batch,
        "width": args.width, "step_s": round(step, 3),
        "images_per_s": round(args.batch / step, 1), "steps_timed": args.steps,
    }  # fmt: skip


if __name__ == "__main__":
    main()
