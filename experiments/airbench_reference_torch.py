"""airbench94's published recipe, trained to the end in plain PyTorch on the images hopperjax
trains on: the control that says whether a missed 94 % is the data's or the trainer's.

    pip install torch==2.13.0 numpy      # in a separate venv: torch is not a hopperjax dependency
    python experiments/export_images.py --shards data/cifar10_shards --out cifar10.npz  # hopperjax
    python experiments/airbench_reference_torch.py --data cifar10.npz [--seed 0] [--out run.json]

Jordan's airbench94 (KellerJordan/cifar10-airbench, ``airbench94.py``) reports 94.01 % mean test
accuracy over 1,000 runs on the official CIFAR-10 files. This is our own implementation of that
recipe, written from its description, with every hyperparameter of the published script: batch
1,024 for 9.9 epochs (476 steps); Nesterov SGD, momentum 0.85, lr 11.5 and weight decay 0.0153 per
1,024 examples in its decoupled form over a summed loss; BatchNorm biases at 64x the lr with the
same decay per step; label smoothing 0.2; a triangular schedule 0.2 -> 1 at 23 % -> 0.07; the
2x2 whitening convolution frozen at the training patches' eigenvectors, its bias trained for the
first 3 epochs only; BatchNorm momentum 0.6 (PyTorch 0.4), eps 1e-12, scales frozen at 1;
identity-initialized convolutions; every image flipped once at random, then all flipped together
every other epoch, and a random 2-pixel translation (reflect padded) drawn each epoch; a
lookahead average of the weights from epoch 3, every 5 steps, its decay 0.95^5 x (step /
steps)^3, copied back into the network at the end of each epoch; eval with the mirror and two
1-pixel shifts (6 views, weights 1/4, 1/4, 1/8 x 4). Differences from the published run: fp32 on
a CPU (it runs fp16 on an A100), and the data is whatever ``--data`` holds.

Prints (and with ``--out`` writes) one JSON object: test accuracy with and without test-time
augmentation, steps, epochs, wall time and the final training loss.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

MEAN = (0.4914, 0.4822, 0.4465)  # the published script's CIFAR-10 statistics
STD = (0.2470, 0.2435, 0.2616)
HYP = {
    "epochs": 9.9, "batch": 1024, "lr": 11.5, "momentum": 0.85, "wd": 0.0153, "bias_scale": 64.0,
    "smoothing": 0.2, "whiten_bias_epochs": 3, "ema_start_epochs": 3, "ema_every": 5,
    "ema_base": 0.95, "ema_pow": 3.0, "translate": 2, "bn_momentum": 0.6, "width": 64,
    "logit_scale": 1 / 9,
}  # fmt: skip


class Norm(nn.BatchNorm2d):
    def __init__(self, channels: int) -> None:
        super().__init__(channels, eps=1e-12, momentum=1 - HYP["bn_momentum"])
        self.weight.requires_grad = False


def conv(cin: int, cout: int, kernel: int = 3, padding: str | int = "same", bias=False):
    layer = nn.Conv2d(cin, cout, kernel, padding=padding, bias=bias)
    with torch.no_grad():
        if bias:
            layer.bias.zero_()
        n = min(cin, cout)  # the first filters pass their own input channel on
        layer.weight[:n] = 0
        layer.weight[torch.arange(n), torch.arange(n), kernel // 2, kernel // 2] = 1
    return layer


class Group(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = conv(cin, cout), conv(cout, cout)
        self.norm1, self.norm2 = Norm(cout), Norm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.norm1(F.max_pool2d(self.conv1(x), 2)))
        return F.gelu(self.norm2(self.conv2(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        w = HYP["width"]
        self.whiten = conv(3, 24, kernel=2, padding=0, bias=True)
        self.whiten.weight.requires_grad = False
        self.groups = nn.Sequential(Group(24, w), Group(w, 4 * w), Group(4 * w, 4 * w))
        self.head = nn.Linear(4 * w, 10, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.groups(F.gelu(self.whiten(x))).amax(dim=(2, 3))
        return self.head(x) * HYP["logit_scale"]


def normalize(images: np.ndarray) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> normalized fp32 [N, 3, H, W]."""
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float().div_(255)
    mean, std = torch.tensor(MEAN)[:, None, None], torch.tensor(STD)[:, None, None]
    return (x - mean) / std


def fit_whitening(layer: nn.Conv2d, images: torch.Tensor, eps: float = 5e-4) -> None:
    """The kernel: eigenvectors of the uncentred covariance of every 2x2 patch (channel, row,
    column order), over sqrt(eigenvalue + eps), largest first, and their negatives."""
    k = layer.kernel_size[0]
    patches = images.unfold(2, k, 1).unfold(3, k, 1)  # [N, C, H', W', k, k]
    flat = patches.permute(0, 2, 3, 1, 4, 5).reshape(-1, images.shape[1] * k * k).double()
    values, vectors = torch.linalg.eigh(flat.T @ flat / len(flat))
    values, vectors = values.flip(0), vectors.flip(1)
    scaled = (vectors / torch.sqrt(values + eps)).T.reshape(-1, images.shape[1], k, k)
    with torch.no_grad():
        layer.weight.copy_(torch.cat([scaled, -scaled]).float())


def translate(padded: torch.Tensor, side: int, pad: int, gen: torch.Generator) -> torch.Tensor:
    """A random side x side window of each reflect-padded image (shifts up to ``pad``)."""
    n = len(padded)
    shifts = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    out = torch.empty((n, padded.shape[1], side, side))
    for dy in range(2 * pad + 1):
        for dx in range(2 * pad + 1):
            rows = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            out[rows] = padded[rows, :, dy : dy + side, dx : dx + side]
    return out


def tta_logits(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    def mirrored(v: torch.Tensor) -> torch.Tensor:
        return (net(v) + net(v.flip(-1))) / 2

    padded = F.pad(x, (1,) * 4, mode="reflect")
    side = x.shape[-1]
    shifted = [padded[..., :side, :side], padded[..., 2:, 2:]]
    return mirrored(x) / 2 + sum(mirrored(v) for v in shifted) / 4


def evaluate(net: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    net.eval()
    plain = tta = 0
    with torch.no_grad():
        for x, y in zip(images.split(1000), labels.split(1000), strict=True):
            plain += (net(x).argmax(1) == y).sum().item()
            tta += (tta_logits(net, x).argmax(1) == y).sum().item()
    net.train()
    return {"test_accuracy": tta / len(labels), "test_accuracy_no_tta": plain / len(labels)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--data", required=True, help="npz: train_images/labels, test_images/labels"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--epochs", type=float, default=HYP["epochs"], help="shorter: a smoke run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    data = np.load(args.data)
    train_x, test_x = normalize(data["train_images"]), normalize(data["test_images"])
    train_y = torch.from_numpy(data["train_labels"]).long()
    test_y = torch.from_numpy(data["test_labels"]).long()
    h = {**HYP, "epochs": args.epochs}
    batch, momentum = h["batch"], h["momentum"]
    kilostep = 1024 * (1 + 1 / (1 - momentum))
    lr, wd = h["lr"] / kilostep, h["wd"] * batch / kilostep
    per_epoch = len(train_x) // batch
    steps = math.ceil(per_epoch * h["epochs"])
    xp, fp = [0, int(0.23 * steps), steps], [0.2, 1.0, 0.07]

    net = Net().to(memory_format=torch.channels_last)
    # 5,000 training images at random: the published script takes the first 5,000 of the official
    # files, which are in no class order; an image folder's (and so the npz's) are by class.
    fit_whitening(net.whiten, train_x[torch.randperm(len(train_x), generator=gen)[:5000]])
    biases = [p for n, p in net.named_parameters() if "norm" in n and p.requires_grad]
    other = [p for n, p in net.named_parameters() if "norm" not in n and p.requires_grad]
    lr_b = lr * h["bias_scale"]
    opt = torch.optim.SGD(
        [{"params": biases, "lr": lr_b, "weight_decay": wd / lr_b},
         {"params": other, "lr": lr, "weight_decay": wd / lr}],
        momentum=momentum, nesterov=True,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: float(np.interp(i, xp, fp)))

    flipped = torch.where((torch.rand(len(train_x), generator=gen) < 0.5)[:, None, None, None],
                          train_x.flip(-1), train_x)  # fmt: skip
    padded = F.pad(flipped, (h["translate"],) * 4, mode="reflect")
    ema, step, start, log = None, 0, time.perf_counter(), []
    for epoch in range(math.ceil(h["epochs"])):
        net.whiten.bias.requires_grad = epoch < h["whiten_bias_epochs"]
        images = translate(padded, train_x.shape[-1], h["translate"], gen)
        if epoch % 2 == 1:
            images = images.flip(-1)
        order = torch.randperm(len(images), generator=gen)
        for i in range(per_epoch):
            rows = order[i * batch : (i + 1) * batch]
            x = images[rows].contiguous(memory_format=torch.channels_last)
            loss = F.cross_entropy(net(x), train_y[rows], label_smoothing=h["smoothing"],
                                   reduction="sum")  # fmt: skip
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if epoch >= h["ema_start_epochs"] and step % h["ema_every"] == 0:
                if ema is None:
                    ema = {k: v.clone() for k, v in net.state_dict().items()}
                else:
                    rho = h["ema_base"] ** h["ema_every"] * (step / steps) ** h["ema_pow"]
                    _lookahead(net, ema, rho)
            if step >= steps:
                break
        if ema is not None:
            _lookahead(net, ema, 1.0)
        log.append({"epoch": epoch + 1, "step": step, "train_loss": loss.item() / batch,
                    "seconds": round(time.perf_counter() - start, 1)})  # fmt: skip
        print(json.dumps(log[-1]), flush=True)
    train_s = time.perf_counter() - start
    result = {
        "recipe": "airbench94 (published hyperparameters), our PyTorch implementation, fp32",
        "framework": f"torch {torch.__version__}", "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "data": args.data, "seed": args.seed,
        "steps": steps, "epochs": h["epochs"], "train_s": round(train_s, 1),
        **evaluate(net, test_x, test_y), "log": log,
    }  # fmt: skip
    print(json.dumps({k: v for k, v in result.items() if k != "log"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def _lookahead(net: nn.Module, ema: dict[str, torch.Tensor], decay: float) -> None:
    """ema <- decay x ema + (1 - decay) x weights, then the weights <- ema (floats only: the
    BatchNorm running statistics included, its step counter not)."""
    with torch.no_grad():
        for value, avg in zip(net.state_dict().values(), ema.values(), strict=True):
            if value.is_floating_point():
                avg.lerp_(value, 1 - decay)
                value.copy_(avg)


if __name__ == "__main__":
    main()
