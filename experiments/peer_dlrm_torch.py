"""The peer of ``configs/dlrm_criteo.yaml``'s step, measured on the same machine: the same DLRM in
plain PyTorch, eager, fp32.

    pip install torch numpy      # in a separate venv: torch is not a hopperjax dependency
    python experiments/peer_dlrm_torch.py [--batch 2048] [--steps 20] [--sparse]

Our own implementation, layer for layer as ``models/dlrm.py`` builds the recipe (no code from
elsewhere): 26 ``EmbeddingBag`` tables of the recipe's row counts (16 wide, summed bags of one
id), bottom MLP 13-512-256-64-16 with ReLU, the pairwise dot products of the 27 vectors (upper
triangle) beside the bottom vector, top MLP 367-512-256-1, binary cross-entropy. Dense (the
default): every parameter through AdamW (lr 1e-3, no weight decay), as the recipe. ``--sparse``:
the tables take sparse gradients and ``torch.optim.Adagrad`` (element-wise; ours is row-wise),
the MLPs AdamW, as ``model.sparse_updates=true``. Random ids and dense features stand in for
Criteo (the cost does not depend on the values). Each step is timed from the batch to the loss
read back on the host; warm-up steps left out. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import time

import torch
from torch import nn

# configs/dlrm_criteo.yaml's model.table_sizes
TABLES = [
    131072, 39104, 17344, 7424, 20288, 64, 7168, 1600, 64, 131072, 131072, 131072, 64, 2240,
    11968, 192, 64, 1024, 64, 131072, 131072, 131072, 131072, 12992, 128, 64,
]  # fmt: skip


def mlp(sizes: list[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_relu:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(nn.Module):
    def __init__(self, sparse: bool, dim: int = 16) -> None:
        super().__init__()
        self.tables = nn.ModuleList(
            nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for rows in TABLES
        )
        for table in self.tables:
            nn.init.normal_(table.weight, std=0.05)
        self.bottom = mlp([13, 512, 256, 64, dim], last_relu=True)
        features = len(TABLES) + 1
        self.top = mlp([features * (features - 1) // 2 + dim, 512, 256, 1], last_relu=False)
        self.upper = torch.triu_indices(features, features, offset=1)

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        bottom = self.bottom(dense)
        bags = [table(ids[:, t : t + 1]) for t, table in enumerate(self.tables)]
        stacked = torch.stack([bottom, *bags], dim=1)  # [batch, 27, dim]
        gram = torch.bmm(stacked, stacked.transpose(1, 2))
        pairs = gram[:, self.upper[0], self.upper[1]]
        return self.top(torch.cat([bottom, pairs], dim=1)).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--sparse", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = DLRM(args.sparse)
    mlps = [p for n, p in model.named_parameters() if not n.startswith("tables")]
    tables = [p for n, p in model.named_parameters() if n.startswith("tables")]
    if args.sparse:
        optimizers = [torch.optim.AdamW(mlps, lr=1e-3, weight_decay=0.0),
                      torch.optim.Adagrad(tables, lr=0.05)]  # fmt: skip
    else:
        optimizers = [torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)]
    loss_fn = nn.BCEWithLogitsLoss()
    generator = torch.Generator().manual_seed(1)
    sizes = torch.tensor(TABLES)
    batches = [
        (
            torch.rand(args.batch, 13, generator=generator),
            (torch.rand(args.batch, len(TABLES), generator=generator) * sizes).long(),
            (torch.rand(args.batch, generator=generator) < 0.25).float(),
        )
        for _ in range(4)
    ]
    times = []
    for step in range(args.warmup + args.steps):
        dense, ids, labels = batches[step % len(batches)]
        start = time.perf_counter()
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(dense, ids), labels)
        loss.backward()
        for opt in optimizers:
            opt.step()
        loss.item()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    median = statistics.median(times)
    print(json.dumps({
        "peer": "pytorch", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(), "batch": args.batch,
        "sparse": args.sparse, "step_s": median, "examples_per_s": args.batch / median,
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
