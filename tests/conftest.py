"""Test setup: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path

import pytest

import hopperjax

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a train() call compiles and runs in seconds on 2 cores.
TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.max_len=32",
    "data.seq_len=32",
    "train.batch_size=16",
    "train.steps=20",
    "train.log_every=1",
    "train.eval_every=10",
    "train.eval_batches=2",
    "train.checkpoint_every=10",
    "optim.warmup_steps=2",
]


@pytest.fixture
def tiny_config(tmp_path):
    """``tiny_config(*overrides)`` -> quickstart shrunk to a tiny model, run_dir in tmp_path."""

    def make(*overrides: str) -> hopperjax.Config:
        return hopperjax.load_config(
            REPO / "configs" / "quickstart.yaml", [*TINY, f"run_dir={tmp_path / 'run'}", *overrides]
        )

    return make
