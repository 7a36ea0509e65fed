"""The peer of ``nanogpt_parity.py``, measured on the same machine: the nanoGPT CPU recipe
(issue 8's facts, key for key) written in plain PyTorch, eager and fp32, as nanoGPT runs it.

    pip install torch==2.13.0 numpy      # in a separate venv: torch is not a hopperjax dependency
    python experiments/peer_nanogpt_torch.py --data data/tinyshakespeare/input.txt \
        [--seeds 0,1,2] [--out runs/peer_nanogpt_torch.json]

Our own implementation of the published recipe (no nanoGPT code): 4 pre-norm blocks, width 128,
4 heads, MLP 512 with exact GELU, no biases, tied embedding, init N(0, 0.02) with the residual
projections at 0.02 / sqrt(8); AdamW (0.9, 0.99), eps 1e-8, weight decay 0.1 on tensors of 2+
dims; clip 1.0; lr 1e-3 (s + 1) / 101 for 100 steps, then cosine to 1e-4 at step 2,000. Each
step is timed from drawing its batch to the loss read back on the host (``loss.item()``, which
is where nanoGPT's loop waits), evaluations excluded. Prints one JSON object per seed and the
summary, the same figures ``nanogpt_parity.py`` reports for hopperjax.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

LAYERS, HEADS, WIDTH, MLP, CONTEXT, BATCH = 4, 4, 128, 512, 64, 12
STEPS, WARMUP, PEAK_LR, MIN_LR, EVAL_EVERY, EVAL_BATCHES = 2000, 100, 1e-3, 1e-4, 250, 20


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(WIDTH, bias=False)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.attn_out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.mlp_norm = nn.LayerNorm(WIDTH, bias=False)
        self.mlp_in = nn.Linear(WIDTH, MLP, bias=False)
        self.mlp_out = nn.Linear(MLP, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(WIDTH, dim=2)
        q, k, v = (z.view(b, t, HEADS, WIDTH // HEADS).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_out(attn.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class CharGPT(nn.Module):
    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.token_embed = nn.Embedding(vocab, WIDTH)
        self.pos_embed = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.final_norm = nn.LayerNorm(WIDTH, bias=False)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                residual = name.endswith(("attn_out.weight", "mlp_out.weight"))
                std = 0.02 / math.sqrt(2 * LAYERS) if residual else 0.02
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.token_embed(tokens) + self.pos_embed(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.final_norm(x) @ self.token_embed.weight.T  # tied output head
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step: int) -> float:
    if step < WARMUP:
        return PEAK_LR * (step + 1) / (WARMUP + 1)
    progress = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (PEAK_LR - MIN_LR)


def random_batch(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(len(data) - CONTEXT, (BATCH,))
    x = torch.stack([data[i : i + CONTEXT] for i in starts])
    y = torch.stack([data[i + 1 : i + 1 + CONTEXT] for i in starts])
    return x, y


@torch.no_grad()
def sampled_loss(model: CharGPT, data: torch.Tensor) -> float:
    return statistics.fmean(model(*random_batch(data)).item() for _ in range(EVAL_BATCHES))


@torch.no_grad()
def whole_split_loss(model: CharGPT, data: torch.Tensor) -> float:
    """Windows of 64 in strides of 64, as ``nanogpt_parity.full_validation_loss``."""
    n = (len(data) - 1) // CONTEXT
    x = data[: n * CONTEXT].view(n, CONTEXT)
    y = data[1 : n * CONTEXT + 1].view(n, CONTEXT)
    losses = [model(x[i : i + 256], y[i : i + 256]).item() * len(x[i : i + 256]) for i in
              range(0, n, 256)]  # fmt: skip
    return sum(losses) / n


def run_seed(text: str, seed: int) -> dict:
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    data = torch.tensor(np.array([lookup[c] for c in text], dtype=np.int64))
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    torch.manual_seed(seed)
    model = CharGPT(len(chars))
    decayed = [p for p in model.parameters() if p.dim() >= 2]
    plain = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
        lr=PEAK_LR,
        betas=(0.9, 0.99),
        eps=1e-8,
    )
    n_params = sum(p.numel() for p in model.parameters())
    evals, times = {}, []
    start = time.perf_counter()
    for step in range(STEPS + 1):
        if step % EVAL_EVERY == 0:
            model.eval()
            evals[step] = sampled_loss(model, val)
            model.train()
        if step == STEPS:
            break
        t0 = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss = model(*random_batch(train))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - start
    model.eval()
    median = statistics.median(times[1:])
    return {
        "seed": seed,
        "params": n_params,
        "val_loss": evals,
        "whole_split_val_loss": whole_split_loss(model, val),
        "median_step_ms": 1e3 * median,
        "tokens_per_s": BATCH * CONTEXT / median,
        "wall_s": wall,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="runs/peer_nanogpt_torch.json")
    args = parser.parse_args(argv)
    text = Path(args.data).read_text(encoding="utf-8")
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        runs.append(run_seed(text, seed))
        print(json.dumps(runs[-1]), flush=True)

    def spread(values: list[float]) -> str:
        return f"{statistics.fmean(values):.4f} ± {np.std(values):.4f}"

    summary = {
        "val_loss_2000": spread([r["val_loss"][STEPS] for r in runs]),
        "whole_split_val_loss": spread([r["whole_split_val_loss"] for r in runs]),
        "median_step_ms": spread([r["median_step_ms"] for r in runs]),
        "tokens_per_s": spread([r["tokens_per_s"] for r in runs]),
        "wall_s": spread([r["wall_s"] for r in runs]),
    }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
