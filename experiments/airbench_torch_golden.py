"""The PyTorch reference's outputs for one set of weights, kept as a golden file: hopperjax's
``model.arch=airbench`` must compute the same function (tests/test_airbench.py reads the file;
torch is not needed to run the tests).

    python experiments/airbench_torch_golden.py      # in the torch venv; writes the golden file

The network is ``airbench_reference_torch.Net`` (our PyTorch implementation of airbench94's),
at width 16, given weights drawn here with numpy in hopperjax's layout (``weights``) and
transposed into PyTorch's. On four fixed inputs it records the logits in training mode (batch
statistics) and in eval mode (the running statistics drawn here), the label-smoothed (0.2) mean
cross-entropy in training mode, the running statistics after that training-mode pass (BatchNorm
momentum 0.6 in airbench's convention, PyTorch's 0.4), and for every parameter the norm of its
gradient and the gradient's dot product with a fixed random probe (sensitive to every entry,
small enough to keep). And the whitening filters ``fit_whitening`` computes from 64 smooth uint8
images (``smooth_images``), normalized with the reference's statistics, in hopperjax's layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WIDTH, SEED, BATCH, SIDE = 16, 0, 4, 32
GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "airbench_torch.json"


def _shapes(width: int = WIDTH) -> dict[str, tuple[int, ...]]:
    """hopperjax's parameter paths and shapes (kernels HWIO, head [in, out])."""
    shapes = {"whiten/kernel": (2, 2, 3, 24), "whiten/bias": (24,)}
    cin = 24
    for g, cout in enumerate((width, 4 * width, 4 * width)):
        shapes[f"group{g}/conv0/kernel"] = (3, 3, cin, cout)
        shapes[f"group{g}/conv1/kernel"] = (3, 3, cout, cout)
        shapes[f"group{g}/bn0/bias"] = shapes[f"group{g}/bn1/bias"] = (cout,)
        cin = cout
    shapes["head/kernel"] = (cin, 10)
    return shapes


def weights(width: int = WIDTH, seed: int = SEED) -> tuple[dict, dict]:
    """(params, running statistics), flat dicts of float32 arrays keyed by hopperjax path;
    kernels scaled by 1 / sqrt(fan-in), so activations stay of order 1."""
    rng = np.random.default_rng(seed)
    params = {}
    for path, shape in _shapes(width).items():
        fan_in = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
        scale = 1 / np.sqrt(fan_in) if len(shape) > 1 else 0.1
        params[path] = (rng.normal(size=shape) * scale).astype(np.float32)
    stats = {}
    for path, shape in _shapes(width).items():
        if path.endswith("/bias") and "/bn" in path:
            base = path.removesuffix("/bias")
            stats[f"{base}/mean"] = (rng.normal(size=shape) * 0.3).astype(np.float32)
            stats[f"{base}/var"] = rng.uniform(0.5, 2.0, size=shape).astype(np.float32)
    return params, stats


def inputs(seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Normalized images [4, 32, 32, 3] (NHWC) and labels [4]."""
    rng = np.random.default_rng(seed + 1)
    images = rng.normal(size=(BATCH, SIDE, SIDE, 3)).astype(np.float32)
    return images, np.array([3, 0, 7, 3], np.int32)


def smooth_images(count: int = 64, side: int = 16, seed: int = SEED + 3) -> np.ndarray:
    """uint8 [count, side, side, 3] whose neighbouring pixels and channels correlate, as photos'
    do (their 2x2 patches far from white)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, side, side, 1)).cumsum(1).cumsum(2)
    x = x + 0.3 * rng.normal(size=(count, side, side, 3))
    x = (x - x.min()) / (x.max() - x.min())
    return (x * 255).astype(np.uint8)


def probes(width: int = WIDTH, seed: int = SEED) -> dict[str, np.ndarray]:
    """One fixed random array per parameter (hopperjax layout) to project its gradient on."""
    rng = np.random.default_rng(seed + 2)
    return {path: rng.normal(size=shape) for path, shape in _shapes(width).items()}


def _torch_path(path: str) -> str:
    """hopperjax path -> the reference Net's parameter name."""
    if path.startswith("group"):
        group, layer, leaf = path.split("/")
        number = int(layer[-1]) + 1
        name = f"conv{number}" if layer.startswith("conv") else f"norm{number}"
        leaf = "weight" if leaf == "kernel" else leaf
        return f"groups.{group[5:]}.{name}.{leaf}"
    return path.replace("/", ".").replace("kernel", "weight")


def _to_torch(path: str, value: np.ndarray) -> np.ndarray:
    if value.ndim == 4:  # HWIO -> OIHW
        return value.transpose(3, 2, 0, 1)
    if value.ndim == 2:  # [in, out] -> [out, in]
        return value.T
    return value


def torch_outputs(width: int = WIDTH, seed: int = SEED) -> dict:
    import torch
    from airbench_reference_torch import HYP, Net, fit_whitening, normalize
    from torch.nn import functional as F

    torch.manual_seed(0)
    HYP["width"], HYP["bn_momentum"] = width, 0.6
    net = Net().double()
    params, stats = weights(width, seed)
    named = dict(net.named_parameters())
    with torch.no_grad():
        for path, value in params.items():
            named[_torch_path(path)].copy_(torch.from_numpy(_to_torch(path, value)).double())
            named[_torch_path(path)].requires_grad_(True)
        buffers = dict(net.named_buffers())
        for path, value in stats.items():
            base, leaf = path.rsplit("/", 1)
            name = _torch_path(base + "/bias").removesuffix(".bias")
            key = "running_mean" if leaf == "mean" else "running_var"
            buffers[f"{name}.{key}"].copy_(torch.from_numpy(value).double())
    images, labels = inputs(seed)
    x = torch.from_numpy(images).permute(0, 3, 1, 2).double()
    y = torch.from_numpy(labels).long()
    net.eval()
    with torch.no_grad():
        eval_logits = net(x)
    net.train()
    logits = net(x)
    loss = F.cross_entropy(logits, y, label_smoothing=0.2)
    loss.backward()
    running = {}
    for path in stats:
        base, leaf = path.rsplit("/", 1)
        name = _torch_path(base + "/bias").removesuffix(".bias")
        key = "running_mean" if leaf == "mean" else "running_var"
        running[path] = dict(net.named_buffers())[f"{name}.{key}"].numpy().tolist()
    whiten = torch.nn.Conv2d(3, 24, 2)
    fit_whitening(whiten, normalize(smooth_images(seed=seed + 3)))
    filters = whiten.weight.detach().numpy().transpose(2, 3, 1, 0)  # OIHW -> HWIO
    grads = {}
    for path, probe in probes(width, seed).items():
        grad = named[_torch_path(path)].grad.numpy()
        grad = grad.transpose(2, 3, 1, 0) if grad.ndim == 4 else grad.T if grad.ndim == 2 else grad
        grads[path] = {"norm": float(np.linalg.norm(grad)), "probe": float((grad * probe).sum())}
    return {
        "network": "experiments/airbench_reference_torch.py Net, float64",
        "framework": f"torch {torch.__version__}", "width": width, "seed": seed,
        "train_logits": logits.detach().numpy().tolist(),
        "eval_logits": eval_logits.numpy().tolist(), "loss": float(loss.detach()), "grads": grads,
        "bn_momentum": 0.6, "running_stats": running, "whitening_filters": filters.tolist(),
    }  # fmt: skip


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(torch_outputs(), indent=1) + "\n")
    print(f"wrote {GOLDEN}")
