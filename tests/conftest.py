"""Test setup: 8 fake CPU devices, set before JAX starts a backend anywhere."""

import os
import random
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # before testenv, whose probe imports JAX

from testenv import xla_flags

os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags(8)}".strip()
# Measured peaks (observe/flops.py) are kept per machine; the tests keep theirs apart (one
# directory per process: the controller's and each worker's, each removed at its session's end).
_PEAKS = os.environ["HOPPERJAX_CACHE_DIR"] = tempfile.mkdtemp(prefix="hopperjax-test-cache-")

from pathlib import Path

import jax
import pytest

import hopperjax
from hopperjax import workloads

REPO = Path(__file__).resolve().parents[1]
EXPERIMENTS = REPO / "experiments"


def load_script(name: str):
    """An ``experiments/`` script as a module (its directory on sys.path, for its own imports)."""
    import importlib.util
    import sys

    sys.path.insert(0, str(EXPERIMENTS))
    spec = importlib.util.spec_from_file_location(name, EXPERIMENTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Many tests compile the same tiny programs; a persistent compilation cache for this test run
# (made by the controller, shared by its workers and the CLI subprocesses) turns the repeats into
# cache hits. The process that made it removes it at the end of the run.
_CACHE_OWNER = "HOPPERJAX_TEST_JIT_CACHE" not in os.environ
if _CACHE_OWNER:
    os.environ["HOPPERJAX_TEST_JIT_CACHE"] = tempfile.mkdtemp(prefix="hopperjax-test-jit-cache-")
_CACHE = os.environ["HOPPERJAX_TEST_JIT_CACHE"]
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
jax.config.update("jax_compilation_cache_dir", _CACHE)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# A model small enough that a train() call compiles and runs in seconds on 2 cores: the LM
# workload's own smoke shapes, and a short run.
TINY = [
    *workloads.get("lm").smoke_overrides,
    "train.steps=20",
    "train.log_every=1",
    "train.eval_every=10",
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


def corpus_bytes(size: int = 20_000) -> bytes:
    """~20 KB of varied, deterministic English-like text; numbered so that windows are unique.
    A corpus of the tests' own, where a result hangs on the data: the LM's default corpus is the
    package's own source, which every commit changes."""
    rng = random.Random(1234)
    subjects = [
        "The mesh",
        "A shard",
        "Every token",
        "The optimizer",
        "One batch",
        "The kernel",
        "A worker",
        "The schedule",
        "Each layer",
        "The prefetcher",
    ]
    verbs = ["splits", "carries", "reads", "updates", "rotates", "scales", "gathers", "holds"]
    objects = [
        "the logits",
        "a window of bytes",
        "its gradient",
        "the learning rate",
        "every device",
        "the embedding",
        "a checkpoint",
        "eight heads",
    ]
    lines, i = [], 0
    while sum(len(s) for s in lines) < size:
        # Numbers between the phrases keep every window of 33 bytes distinct.
        lines.append(
            f"{i}. {rng.choice(subjects)} ({rng.randint(0, 999)}) {rng.choice(verbs)} "
            f"{rng.choice(objects)} at step {rng.randint(0, 99999)}.\n"
        )
        i += 1
    return "".join(lines).encode()[:size]


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(corpus_bytes())
    return path


# The longest tests (~10-50 s each on 2 CPU cores), dispatched first: with two xdist workers a
# long test that starts last leaves the other worker idle until it ends.
LONGEST_FIRST = (
    "test_multiprocess.py::",
    "test_precision.py::test_policies_reach_the_fp32_eval_loss",
    "test_mig_launch.py::",
    "test_recommendation.py::test_row_sparse_updates_equal_dense_row_wise_adagrad",
    "test_workload_contract.py::test_trains_evaluates_resumes_exactly_and_restores_params",
    "test_mol_graphs.py::test_gin_reads_the_molecule",
    "test_readme.py::test_library_example_runs",
    "test_precision.py::test_fp8_and_loss_scale_state_evolve_and_resume_exactly",
    "test_memory.py::test_fp8_microbatches_combine_amax_by_max",
    "test_bench_loop.py::",
    "test_images.py::test_imagenet_recipe_trains",
    "test_memory.py::test_find_batch_cli",
    "test_experiments.py::",
    "test_compress.py::",
)


def _dispatch_rank(item) -> int:
    path = item.nodeid.rpartition("tests/")[2]
    return next((i for i, p in enumerate(LONGEST_FIRST) if path.startswith(p)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    """The longest tests first (``LONGEST_FIRST``), the rest in file order; tests marked ``gpu``
    are skipped, with the backend named, where JAX has no GPU."""
    items.sort(key=_dispatch_rank)  # stable: file order within each rank
    backend = jax.default_backend()
    if backend == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU; JAX's backend here is {backend}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    shutil.rmtree(_PEAKS, ignore_errors=True)
    if _CACHE_OWNER:
        shutil.rmtree(_CACHE, ignore_errors=True)
