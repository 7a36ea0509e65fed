"""The drug-target affinity model and workload end to end: per-batch dedup is exact and saves the
FLOPs it claims, a short run learns, and the DeepDTA folds give the documented splits.

Every test builds tiny models on synthetic pairs or a DeepDTA directory it writes itself; none
reads shared data.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pickle
import subprocess
import sys

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import REPO
from infer_helpers import predict_batch

import hopperjax
from hopperjax.data import ProcessShard, dta_batches, dta_shards, molecules
from hopperjax.infer.quantize import quantize_restored
from hopperjax.inspect import inspect_config
from hopperjax.workloads import dta as dta_workload

# The Davis recipe shrunk to a model that compiles and runs in seconds on 2 cores.
TINY_DTA = [
    "model.embed_dim=8",
    "model.filters=4",
    "model.head_dims=32,16",
    "model.d_model=16",
    "model.layers=1",
    "model.heads=2",
    "data.source=synthetic",
    "data.path=null",  # the recipe's ../shared/data/davis must never be read by tests
    "data.drug_max_len=24",
    "data.protein_max_len=64",
    "data.synthetic_drugs=6",
    "data.synthetic_proteins=4",
    "data.synthetic_pairs=400",
    "train.batch_size=32",
    "train.eval_batch_size=32",
    "optim.warmup_steps=2",
]
TRANSFORMER = ["model.drug_encoder=transformer", "model.protein_encoder=transformer"]


def dta_config(tmp_path, *overrides: str) -> hopperjax.Config:
    return hopperjax.load_config(
        REPO / "configs" / "dta_davis.yaml",
        [*TINY_DTA, f"run_dir={tmp_path / 'run'}", *overrides],
    )


def _pairs_batch(config, indices):
    """The pairs ``indices`` of the config's data as one batch of pairs (one row per pair)."""
    data = dta_workload.load_pairs(config)
    drug_tokens, protein_tokens = data.tokens
    items = [data.pairs[int(i)] for i in indices]
    return {
        "drug": np.stack([drug_tokens[x["drug_id"]] for x in items]),
        "protein": np.stack([protein_tokens[x["protein_id"]] for x in items]),
        "affinity": np.array([x["affinity"] for x in items], np.float32),
        "weight": np.ones(len(items), np.float32),
    }


MODEL_KEYS = ("drug_tokens", "protein_tokens", "drug_index", "protein_index")


def _predictions_and_grads(config, same_shape, other):
    """Initializes the config's model, then returns (predictions [n, B] and MSE gradients
    (leaves [n, ...]) of the n ``same_shape`` batches, predictions [B] of the ``other`` batch).

    One jitted program (one vmapped forward and backward, one forward), so one compile: XLA:CPU
    compiles are the slow part of these tests.
    """
    model = hopperjax.build_model(config)

    def inputs(batch):
        return {k: batch[k] for k in MODEL_KEYS}

    @jax.jit
    def run(stack, other):
        first = jax.tree.map(lambda x: x[0], inputs(stack))
        # rbg keys: XLA:CPU compiles threefry's init for ~8 s, rng_bit_generator's in ~1 s.
        variables = nn.meta.unbox(model.init(jax.random.key(0, impl="rbg"), first))
        params = variables.pop("params")  # the rest: constants (the recipe's target_stats)

        def loss(p, b):
            pred = model.apply({"params": p, **variables}, inputs(b), deterministic=True)
            return ((pred - b["affinity"]) ** 2).mean(), pred

        grad_fn = jax.vmap(jax.value_and_grad(loss, has_aux=True), in_axes=(None, 0))
        (_, preds), grads = grad_fn(params, stack)
        return preds, grads, model.apply({"params": params, **variables}, inputs(other))

    keys = (*MODEL_KEYS, "affinity")
    stack = {k: np.stack([b[k] for b in same_shape]) for k in keys}
    return jax.device_get(run(stack, {k: other[k] for k in keys}))


@pytest.mark.parametrize("encoders", ["cnn", "transformer"])
def test_dedup_gives_the_per_pair_predictions_and_gradients(tmp_path, encoders):
    transformer = encoders == "transformer"
    config = dta_config(tmp_path, *(TRANSFORMER if transformer else []))
    pairs = 24
    batch = _pairs_batch(config, np.arange(pairs))
    drugs = len(np.unique(batch["drug"], axis=0))
    proteins = len(np.unique(batch["protein"], axis=0))
    assert drugs <= 6 and proteins <= 4  # many pairs share a molecule: dedup has work to do

    def model_batch(rows, dedup):
        return dta_batches.to_model_batch(
            batch, drug_rows=rows, protein_rows=rows, block=0, dedup=dedup
        )

    per_pair, dedup = model_batch(pairs, False), model_batch(pairs, True)
    assert per_pair["drug_tokens"].shape == dedup["drug_tokens"].shape == (pairs, 24)
    # The dedup tables end in all-zero padding rows that no pair points at.
    assert not dedup["drug_tokens"][drugs:].any() and not dedup["protein_tokens"][proteins:].any()
    assert dedup["drug_index"].max() < drugs and dedup["protein_index"].max() < proteins
    # Junk in the padding rows must change no prediction...
    junk = {k: v.copy() for k, v in dedup.items()}
    rng = np.random.default_rng(0)
    junk["drug_tokens"][drugs:] = rng.integers(1, 40, junk["drug_tokens"][drugs:].shape)
    junk["protein_tokens"][proteins:] = rng.integers(1, 26, junk["protein_tokens"][proteins:].shape)
    # ...while changing the real tokens does change predictions (so that these checks can fail).
    changed = {**dedup, "protein_tokens": dedup["protein_tokens"].copy()}
    real = changed["protein_tokens"] > 0
    changed["protein_tokens"][real] = changed["protein_tokens"][real] % 25 + 1
    # Tables as the workload sizes them: the distinct molecules rounded up to 8 rows.
    tight = model_batch(8, True)
    if transformer:
        # Padded keys are masked and the mean pool counts only real tokens, so more right-padding
        # of the token tables encodes each molecule to the same vector.
        tight["drug_tokens"] = np.pad(tight["drug_tokens"], ((0, 0), (0, 8)))
        tight["protein_tokens"] = np.pad(tight["protein_tokens"], ((0, 0), (0, 32)))

    preds, grads, tight_preds = _predictions_and_grads(
        config, [per_pair, dedup, junk, changed], tight
    )
    want = preds[0]
    assert np.isfinite(want).all() and want.std() > 0.05 * np.abs(want).max()  # they differ
    atol = 1e-5 * np.abs(want).max()  # fp32 rounding at the predictions' scale (measured: 0-1e-7)
    for name, got in (("dedup", preds[1]), ("junk", preds[2]), ("tight", tight_preds)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=atol, err_msg=name)
    assert np.abs(preds[3] - want).max() > 100 * atol
    # Training sees the same gradients: the scatter-add of the gather sums the shared rows' terms,
    # and the padding rows (fully masked for the transformer) contribute nothing, not even NaN.
    for leaf in jax.tree.leaves(grads):
        assert np.isfinite(leaf).all() and np.abs(leaf[0]).max() > 0
        scale = np.abs(leaf[0]).max()  # measured: differences below 5e-7 of it
        np.testing.assert_allclose(leaf[1], leaf[0], rtol=1e-4, atol=1e-5 * scale)
        np.testing.assert_allclose(leaf[2], leaf[0], rtol=1e-4, atol=1e-5 * scale)


# The recipe's CNN encoders, 8 of each molecule over 700 pairs: a batch of 64 pairs holds at most
# 8 distinct drugs and 8 distinct proteins. Shared by the FLOPs and the training
# tests, so that the dedup train step compiles once per session (the compilation cache is keyed
# on the program).
RUN = [
    "model.drug_encoder=cnn",
    "model.protein_encoder=cnn",
    "data.synthetic_drugs=8",
    "data.synthetic_proteins=8",
    "data.synthetic_pairs=700",  # 70 held out: 2 eval batches of 64, the second one padded
    "data.eval_fraction=0.1",
    "train.batch_size=64",
    "train.eval_batch_size=64",
    "train.steps=100",
    "train.log_every=10",
    "train.eval_every=25",
    "train.checkpoint_every=1000",
    "optim.base_lr=1e-2",
    "optim.lr_scaling=none",
    "data.standardize=false",  # the figures measured below are in plain units (eval_loss = MSE)
]


def test_dedup_flops_saving_shows_in_the_inspect_report(tmp_path):
    """64 pairs with <= 8 distinct drugs and proteins: dedup encodes 8 table rows of each instead
    of 64, so the compiled step does up to 8x less work (less only by the per-pair head)."""
    on, off = (
        inspect_config(dta_config(tmp_path, *RUN, f"data.deduplicate={dedup}"))
        for dedup in (True, False)
    )
    ratios = {
        key: off[key] / on[key]
        for key in ("flops_per_step", "model_flops_per_step", "xla_cost_analysis_flops_per_device")
    }
    # Measured: 7.8x for the GEMM count (convolutions as implicit GEMMs) and the FLOP model; 6.0x
    # for XLA's count, which adds the per-pair elementwise work.
    for key, ratio in ratios.items():
        assert (5.0 if key.startswith("xla") else 6.0) < ratio <= 8.0 + 1e-9, (key, ratio)
    # The workload's FLOP model and the compiled program's convolutions and dots agree.
    for report in (on, off):
        assert report["flops_per_step"] == pytest.approx(report["model_flops_per_step"], rel=0.05)
        convs = [g for g in report["gemms"] if "conv" in g["layer"]]
        # The drug's first convolution: K = kernel 4 x embedding 8, per output position.
        assert any(g["k"] == 4 * 8 and g["role"] == "forward" for g in convs), convs


def _mean_squared_error_of(config, params, indices):
    """MSE of the model with ``params`` over the pairs ``indices``, batched here, all at once."""
    pairs = dta_workload.load_pairs(config)
    batch = _pairs_batch(config, indices)
    inputs = dta_batches.to_model_batch(
        batch, drug_rows=pairs.drugs, protein_rows=pairs.proteins, block=0, dedup=True
    )
    model = hopperjax.build_model(config)
    pred = jax.jit(lambda p, x: model.apply({"params": p}, x))(
        params, {k: inputs[k] for k in MODEL_KEYS}
    )
    return float(np.mean((np.asarray(pred, np.float64) - batch["affinity"]) ** 2))


def test_short_run_learns_and_scores_every_held_out_pair_once(tmp_path):
    config = dta_config(tmp_path, *RUN)
    data = dta_workload.load_pairs(config)
    train_idx, eval_idx = dta_workload.split_pairs(data.folds, len(data.pairs), config)
    assert len(eval_idx) == 70 and len(train_idx) == 630
    affinity = np.array([data.pairs[i]["affinity"] for i in range(len(data.pairs))], np.float64)
    # Predicting the training mean: what a model that learned nothing pair-specific scores.
    baseline = float(np.mean((affinity[eval_idx] - affinity[train_idx].mean()) ** 2))

    result = hopperjax.train(config, console=False)
    evals = [r for r in result.history if "eval_mse" in r]
    assert [r["step"] for r in evals] == [25, 50, 75, 100]
    first, last = evals[0], evals[-1]
    # Measured: eval MSE 1.28 at step 25 -> 0.38 at step 100; the baseline is 1.50.
    assert last["eval_mse"] < 0.5 * baseline
    assert last["eval_mse"] < 0.75 * first["eval_mse"]
    for record in evals:
        for key in ("eval_loss", "eval_mse", "eval_ci", "eval_rm2", "eval_pearson"):
            assert math.isfinite(record[key]), (key, record)
        assert record["eval_loss"] == record["eval_mse"]
        # Every held-out pair once, although 70 pairs fill 2 batches of 64 with 58 padding pairs.
        assert record["eval_pairs"] == 70
    # Measured at step 100: CI 0.83, Pearson 0.87, rm2 0.75.
    assert last["eval_ci"] > 0.7 and last["eval_pearson"] > 0.7 and last["eval_rm2"] > 0.3
    # The logged MSE is that of the final parameters over exactly the held-out pairs.
    mse = _mean_squared_error_of(config, result.state.params, eval_idx)
    assert last["eval_mse"] == pytest.approx(mse, rel=1e-4)


def test_resume_refuses_a_changed_model_key_in_the_library_and_the_cli(tmp_path):
    """Every model.* key defines what is trained: against a DTA run directory with checkpoints,
    model.filters=8 is a config error naming the key (the CLI: exit 2, one line, no traceback),
    and the refused runs leave the checkpoints as they were."""
    run = ["train.steps=2", "train.checkpoint_every=1", "train.log_every=1"]
    hopperjax.train(dta_config(tmp_path, *run), console=False)
    checkpoints = tmp_path / "run" / "checkpoints"

    def saved():
        return sorted(p.name for p in checkpoints.iterdir() if p.name.isdigit())

    before = saved()
    assert before, "precondition: the first run wrote checkpoints"
    with pytest.raises(hopperjax.ConfigError, match=r"^model\.filters: changed from 4 to 8") as e:
        hopperjax.train(dta_config(tmp_path, *run, "model.filters=8"), console=False)
    assert e.value.key == "model.filters"

    cli = [sys.executable, "-m", "hopperjax.train", "--config", "configs/dta_davis.yaml"]
    overrides = [*TINY_DTA, f"run_dir={tmp_path / 'run'}", *run, "model.filters=8"]
    proc = subprocess.run(
        [*cli, *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ),
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("hopperjax: config error: model.filters: changed from 4 to 8")
    assert saved() == before


# A DeepDTA directory: 4 drugs x 6 proteins, 2 pairs unmeasured, so 22 pairs in row-major order,
# each with its own affinity (pKd 5.0, 5.1, ...), so that a pair is known by its affinity.
DRUGS = {"D7": "CC(=O)N", "D2": "c1ccncc1", "D9": "CN=C", "D1": "C#N"}
PROTEINS = {
    f"P{i}": seq for i, seq in enumerate(["MKVLA", "GTGSFGK", "DFGAPE", "HRDLKPW", "AC", "WY"])
}
PKD = 5.0 + 0.1 * np.arange(24).reshape(4, 6)
PKD[1, 2] = PKD[3, 0] = np.nan
TRAIN_FOLDS = [[0, 5, 10], [1, 6, 11, 15], [2, 7, 12], [3, 8, 13, 16], [4, 9, 14]]
TEST_FOLD = [17, 18, 19, 20, 21]


def _write_deepdta(root, pkd=PKD, folds=(TRAIN_FOLDS, TEST_FOLD)):
    root.mkdir(parents=True)
    (root / "ligands_can.txt").write_text(json.dumps(DRUGS))
    (root / "proteins.txt").write_text(json.dumps(PROTEINS))
    with open(root / "Y", "wb") as f:
        pickle.dump(10.0 ** (9.0 - pkd), f, protocol=2)  # Kd in nM, as Davis ships it
    if folds is not None:
        (root / "folds").mkdir()
        (root / "folds" / "train_fold_setting1.txt").write_text(json.dumps(folds[0]))
        (root / "folds" / "test_fold_setting1.txt").write_text(json.dumps(folds[1]))
    return root


def _affinities(batches, count=None):
    """Sorted affinities of the weighted pairs of ``batches`` (the first ``count`` pairs)."""
    seen = []
    for batch in batches:
        seen.extend(batch["affinity"][batch["weight"] > 0].tolist())
        if count is not None and len(seen) >= count:
            return np.sort(seen[:count])
    return np.sort(seen)


@pytest.mark.parametrize(
    ("split", "fold"), [("valid", 0), ("valid", 3), ("test", 1), ("test", None)]
)
def test_deepdta_eval_split_and_valid_fold(tmp_path, split, fold):
    """valid_fold None (null): GraphDTA's protocol, training on all five training folds."""
    root = _write_deepdta(tmp_path / "davis")
    config = dta_config(
        tmp_path,
        "data.source=deepdta",
        f"data.path={root}",
        f"data.valid_fold={'null' if fold is None else fold}",
        f"data.eval_split={split}",
        "data.shuffle=false",
        "train.batch_size=4",
        "train.eval_batch_size=4",
    )
    datasets = dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1))
    pkd = PKD[~np.isnan(PKD)]  # the pairs in the folds' (row-major) order
    held = TEST_FOLD if split == "test" else TRAIN_FOLDS[fold]
    # Training uses the other training folds: never the held-out fold, never the test fold.
    train = np.concatenate([f for i, f in enumerate(TRAIN_FOLDS) if i != fold])
    assert datasets.meta.eval_pairs == len(held)
    assert datasets.meta.train_pairs == len(train)
    np.testing.assert_allclose(_affinities(datasets.eval), np.sort(pkd[held]), rtol=1e-5)
    one_epoch = _affinities(iter(datasets.train), count=len(train))
    np.testing.assert_allclose(one_epoch, np.sort(pkd[train]), rtol=1e-5)


def test_benchmark_all_folds_run_trains_on_every_fold_and_scores_its_last_step_on_test(
    tmp_path, monkeypatch
):
    """experiments/dta_benchmark.py's GraphDTA protocol end to end on a tiny DeepDTA directory:
    the run trains on all five training folds, evaluates on (only) the test fold, and the scored
    step is the last one, its predictions the test fold's affinities. Stopped part way (as by a
    signal), the run resumes from its checkpoint, and its curve covers both processes."""
    monkeypatch.syspath_prepend(str(REPO / "experiments"))  # the script's own imports
    spec = importlib.util.spec_from_file_location(
        "dta_benchmark", REPO / "experiments" / "dta_benchmark.py"
    )
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    root = _write_deepdta(tmp_path / "davis")
    overrides = [
        *TINY_DTA,
        "data.source=deepdta",
        f"data.path={root}",
        "train.batch_size=8",
        "train.eval_batch_size=8",
        "train.steps=4",
        "train.eval_every=2",
    ]
    recipe = str(REPO / "configs" / "dta_davis.yaml")
    train = hopperjax.train
    monkeypatch.setattr(
        benchmark.hopperjax, "train",
        lambda config, console: train(config.replace(**{"train.stop_after": 2}), console=False),
    )  # fmt: skip
    with pytest.raises(benchmark.FoldStopped, match="all folds, seed 3: stopped at step 2 of 4"):
        benchmark.run_fold(recipe, overrides, benchmark.ALL, tmp_path, seed=3)
    # Another recipe on the unfinished run is refused, naming the key, before training.
    with pytest.raises(hopperjax.ConfigError, match="resuming would mix two recipes") as e:
        benchmark.run_fold(
            recipe, [*overrides, "optim.base_lr=0.01"], benchmark.ALL, tmp_path, seed=3
        )
    assert e.value.key == "optim.base_lr"
    histories = []

    def recording(config, console):
        result = train(config, console=False)
        histories.append(result.history)
        return result

    monkeypatch.setattr(benchmark.hopperjax, "train", recording)
    chosen = []
    choose = benchmark.chosen_eval
    monkeypatch.setattr(benchmark, "chosen_eval", lambda e, s: chosen.append(s) or choose(e, s))
    r = benchmark.run_fold(recipe, overrides, benchmark.ALL, tmp_path, seed=3)
    assert chosen == ["last"]  # whatever select was passed: there is nothing else to select on
    assert (r["fold"], r["seed"], r["best_step"], r["valid"]) == ("all", 3, 4, None)
    # Resumed, not restarted: this process logged only step 3's train record (log windows of
    # 2 steps), and the curve still has step 2's eval, which the first process ran.
    assert [x["step"] for x in histories[0] if "loss" in x] == [3]
    assert r["resumed_from"] == 2 and r["steps_s"] > 0
    assert [s for s, _ in r["test_curve"]] == [2, 4]
    pkd = PKD[~np.isnan(PKD)]
    np.testing.assert_allclose(np.sort(r["measured"]), np.sort(pkd[TEST_FOLD]), rtol=1e-5)
    # The last eval record is the scored checkpoint's test MSE (the same pairs, the same state).
    assert r["test"]["mse"] == pytest.approx(r["test_curve"][-1][1], rel=1e-4)
    config = hopperjax.load_config(tmp_path / "all_seed3" / "config.yaml", [])
    assert (config.seed, config.data.valid_fold, config.data.eval_split) == (3, None, "test")


def test_no_valid_fold_needs_the_test_split(tmp_path):
    """With every training fold trained on, a "valid" eval would score training pairs."""
    root = _write_deepdta(tmp_path / "davis")
    for value, message in (
        (
            "null",
            "null trains on every training fold, so only the test fold is left to evaluate on: "
            "set data.eval_split=test (and score a step fixed in advance)",
        ),
        (5, "expected a DeepDTA fold 0..4 or null, got 5"),
    ):
        with pytest.raises(hopperjax.ConfigError) as e:
            dta_config(
                tmp_path, "data.source=deepdta", f"data.path={root}", f"data.valid_fold={value}"
            )
        assert str(e.value) == f"data.valid_fold: {message}"
    # Data without folds has none to train on all of: the cause, not the test split's refusal.
    root = _write_deepdta(tmp_path / "nofolds", folds=None)
    config = dta_config(
        tmp_path,
        "data.source=deepdta",
        f"data.path={root}",
        "data.valid_fold=null",
        "data.eval_split=test",
        "train.batch_size=4",
    )
    with pytest.raises(hopperjax.ConfigError) as e:
        dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1))
    assert str(e.value) == (
        f"data.valid_fold: null trains on every DeepDTA training fold, but {root} has no folds/; "
        "leave it out (a random data.eval_fraction of the pairs is held out)"
    )


def test_nan_in_y_at_a_pair_the_folds_use_is_blamed_on_y(tmp_path):
    """The folds number Y's measured pairs, so a NaN where a fold expects a value shows up as a
    fold index past the end: the error names Y and the NaN cells, not the folds file."""
    full = 5.0 + 0.1 * np.arange(24).reshape(4, 6)  # Davis-like: every pair measured
    full_folds = ([list(range(k, 20, 5)) for k in range(5)], list(range(20, 24)))
    full[2, 3] = np.nan
    root = _write_deepdta(tmp_path / "davis", full, full_folds)
    config = dta_config(tmp_path, "data.source=deepdta", f"data.path={root}")
    with pytest.raises(hopperjax.ConfigError) as e:
        dta_workload.load_pairs(config)
    assert str(e.value) == (
        f"data.path: {root / 'Y'}: Y[2, 3] (drug 'D9', protein 'P3') is NaN, but the folds use "
        "every pair of the 4 x 6 matrix"
    )

    # KIBA-like (NaN = unmeasured, accepted): one NaN too many cannot be told from the others.
    pkd = PKD.copy()
    pkd[0, 1] = np.nan
    root = _write_deepdta(tmp_path / "kiba", pkd)
    config = dta_config(tmp_path, "data.source=deepdta", f"data.path={root}")
    with pytest.raises(hopperjax.ConfigError) as e:
        dta_workload.load_pairs(config)
    assert str(e.value) == (
        f"data.path: {root / 'Y'}: NaN at a pair the folds use (they number 22 measured pairs, "
        "Y has 21; its NaN are at Y[0, 1], Y[1, 2], Y[3, 0])"
    )


def test_an_empty_held_out_fold_is_refused_naming_the_key_and_the_folds_file(tmp_path):
    folds = ([[0, 5, 10, 1, 6, 11, 15], [], *TRAIN_FOLDS[2:]], [])
    root = _write_deepdta(tmp_path / "davis", folds=folds)
    base = ["data.source=deepdta", f"data.path={root}", "train.batch_size=4"]
    for key, value, message in (
        ("valid_fold", 1, f"fold 1 of {root / 'folds/train_fold_setting1.txt'}"),
        ("eval_split", "test", f"the test fold of {root / 'folds/test_fold_setting1.txt'}"),
    ):
        config = dta_config(tmp_path, *base, f"data.{key}={value}")
        with pytest.raises(hopperjax.ConfigError) as e:
            dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1))
        assert str(e.value) == f"data.{key}: {message} has no pairs to evaluate on"
    # An empty fold that is not held out just adds nothing to training: accepted.
    config = dta_config(tmp_path, *base, "data.valid_fold=0")
    assert dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1)).meta


def test_a_test_split_without_folds_is_refused(tmp_path):
    """Without folds the eval split is a random one: scoring it as "test" would be a lie."""
    root = _write_deepdta(tmp_path / "nofolds", folds=None)
    base = ["data.source=deepdta", f"data.path={root}", "train.batch_size=4"]
    config = dta_config(tmp_path, *base, "data.eval_split=test")
    with pytest.raises(hopperjax.ConfigError) as e:
        dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1))
    assert str(e.value) == (
        f"data.eval_split: 'test' needs DeepDTA's held-out test fold, but {root} has no folds/; "
        "use data.eval_split=valid (a random data.eval_fraction of the pairs)"
    )
    config = dta_config(tmp_path, *base, "data.eval_split=valid")
    assert dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1)).meta


def test_csv_header_with_a_byte_order_mark_and_a_directory_for_a_file(tmp_path):
    path = tmp_path / "pairs.csv"
    path.write_text("\ufeffSMILES,sequence,affinity\nCCO,MKV,5.5\nCCN,GTG,7\n", encoding="utf-8")
    table = dta_workload.load_table(
        dta_config(tmp_path, "data.source=csv", f"data.path={path}", "data.pkd=false")
    )
    assert table.drugs == ["CCO", "CCN"] and table.affinity.tolist() == [5.5, 7.0]
    with pytest.raises(hopperjax.ConfigError) as e:
        dta_config(tmp_path, "data.source=csv", f"data.path={tmp_path}")
    assert str(e.value) == f"data.path: a directory, not a CSV/TSV file: {tmp_path}"


def _write_shards(root, out, num_shards):
    """The DeepDTA directory ``root`` as shards in ``out``, at the tiny test lengths."""
    dta_shards.write_shards(
        molecules.load_deepdta(root),
        molecules.Tokenizer(molecules.SMILES_CHARSET, 24),
        molecules.Tokenizer(molecules.PROTEIN_CHARSET, 64),
        out,
        num_shards=num_shards,
    )
    return out


@pytest.mark.parametrize(
    ("source", "group_by", "mix"),
    [
        ("shards", "none", 1),
        ("deepdta", "protein", 1),
        ("deepdta", "drug", 1),
        ("deepdta", "protein", 2),
    ],
)
def test_shards_and_grouped_batches_read_the_same_pairs(tmp_path, source, group_by, mix):
    """ArrayRecord shards of a DeepDTA directory, and protein- or drug-grouped batches (mixed
    ``data.group_mix`` groups at a time, too), give the same folds and the same pairs per epoch as
    the directory read in a uniform shuffle."""
    root = _write_deepdta(tmp_path / "davis")
    path = _write_shards(root, tmp_path / "shards", 3) if source == "shards" else root
    base = [
        "data.valid_fold=2",
        "train.batch_size=6",
        "train.eval_batch_size=4",
        f"data.group_mix={mix}",
    ]
    reference, config = (
        dta_config(tmp_path, *base, f"data.source={s}", f"data.path={p}", f"data.group_by={g}")
        for s, p, g in (("deepdta", root, "none"), (source, path, group_by))
    )
    workload, reference_workload = (dta_workload.AffinityRegression(c) for c in (config, reference))
    want = reference_workload.build_datasets(ProcessShard(0, 1))
    got = workload.build_datasets(ProcessShard(0, 1))
    assert got.meta.eval_pairs == want.meta.eval_pairs == len(TRAIN_FOLDS[2])
    np.testing.assert_allclose(_affinities(got.eval), _affinities(want.eval), rtol=1e-6)
    train = want.meta.train_pairs
    np.testing.assert_allclose(
        _affinities(iter(got.train), count=train), _affinities(iter(want.train), count=train)
    )
    fields = workload.batch_fields(6, got)
    batch = next(iter(got.train))
    for key, field in fields.items():
        assert batch[key].shape == field.shape, key
    if group_by != "none":
        # Grouped batches hold few molecules of the grouped kind: smaller tables, and every
        # batch's distinct molecules fit them (dedup raises otherwise).
        kind = f"{group_by}_tokens"
        assert fields[kind].shape[0] <= reference_workload.batch_fields(6, want)[kind].shape[0]
        for _, batch in zip(range(20), got.train, strict=False):
            assert len(np.unique(batch[f"{group_by}_index"])) <= fields[kind].shape[0]


def test_shards_refuse_a_run_that_reads_their_affinities_in_other_units(tmp_path):
    """Shards remember whether their affinities are pKd: training them with the other data.pkd
    would fit numbers in the wrong units, so it is a one-line error naming data.pkd."""
    shards = _write_shards(_write_deepdta(tmp_path / "davis"), tmp_path / "shards", 1)
    assert dta_shards.read_shards(shards).pkd is True
    assert dta_shards.read_shards(shards).unknown_chars == {"drug": "error", "protein": "error"}
    base = ["data.source=shards", f"data.path={shards}", "data.group_by=none"]
    with pytest.raises(hopperjax.ConfigError, match=r"data\.pkd: .* holds pKd .*, got False"):
        dta_workload.load_pairs(dta_config(tmp_path, *base, "data.pkd=false"))
    assert dta_workload.load_pairs(dta_config(tmp_path, *base)).pairs is not None


def test_grouping_needs_the_pair_table(tmp_path):
    shards = _write_shards(_write_deepdta(tmp_path / "davis"), tmp_path / "shards", 1)
    base = ["data.source=shards", f"data.path={shards}", "train.batch_size=4"]
    with pytest.raises(hopperjax.ConfigError, match=r"data\.group_by: needs a pair table"):
        dta_config(tmp_path, *base, "data.group_by=protein")
    config = dta_config(tmp_path, *base, "data.group_by=none", "data.protein_max_len=128")
    with pytest.raises(hopperjax.ConfigError, match=r"data\.protein_max_len"):
        dta_workload.AffinityRegression(config).build_datasets(ProcessShard(0, 1))


def test_microbatches_are_refused_when_the_config_loads(tmp_path):
    """A DTA batch's pairs share its deduplicated molecule tables, so it cannot be cut into
    microbatches: refused at config load, naming the key, before anything is built."""
    with pytest.raises(hopperjax.ConfigError, match=r"^train\.microbatches: not supported") as e:
        dta_config(tmp_path, "train.microbatches=2")
    assert e.value.key == "train.microbatches"
    assert dta_config(tmp_path, "train.microbatches=1").train.microbatches == 1


@pytest.mark.parametrize("dedup", [True, False])
def test_batches_from_ids_equal_batches_from_token_rows(dedup):
    """The in-memory path (pairs as ids, tokens gathered once per distinct molecule) feeds the
    model exactly what the token-row path (shards) feeds it, up to the order of table rows."""
    rng = np.random.default_rng(0)
    drug_tokens = rng.integers(1, 30, (7, 24)).astype(np.int32)
    protein_tokens = rng.integers(1, 25, (5, 64)).astype(np.int32)
    ids = {"drug_id": rng.integers(0, 7, 40), "protein_id": rng.integers(0, 5, 40)}
    affinity = rng.normal(size=40).astype(np.float32)
    weight = np.ones(40, np.float32)
    rows = dict(drug_rows=8 if dedup else 40, protein_rows=8 if dedup else 40, block=0, dedup=dedup)
    by_id = dta_batches.to_model_batch(
        {**ids, "affinity": affinity, "weight": weight},
        tokens=(drug_tokens, protein_tokens),
        **rows,
    )
    by_row = dta_batches.to_model_batch(
        {
            "drug": drug_tokens[ids["drug_id"]],
            "protein": protein_tokens[ids["protein_id"]],
            "affinity": affinity,
            "weight": weight,
        },
        **rows,
    )
    tables = {"drug": drug_tokens, "protein": protein_tokens}
    for what in ("drug", "protein"):
        for batch in (by_id, by_row):  # each pair gathers its own molecule's tokens
            gathered = batch[f"{what}_tokens"][batch[f"{what}_index"]]
            np.testing.assert_array_equal(gathered, tables[what][ids[f"{what}_id"]])
        assert by_id[f"{what}_tokens"].shape == by_row[f"{what}_tokens"].shape
        used = len(np.unique(ids[f"{what}_id"])) if dedup else 40
        assert not by_id[f"{what}_tokens"][used:].any()  # the rest is zero padding
    np.testing.assert_array_equal(by_id["affinity"], by_row["affinity"])
    with pytest.raises(ValueError, match="distinct proteins but the table has 4 rows"):
        dta_batches.batch_from_ids(
            {**ids, "affinity": affinity}, drug_tokens, protein_tokens,
            drug_rows=8, protein_rows=4, dedup=True,
        )  # fmt: skip


def test_standardized_targets_use_the_training_split_and_predict_in_the_data_units(tmp_path):
    """data.standardize: the head learns (y - mean) / std with the training split's mean and
    std, checkpointed with the model; predictions, eval_mse and a restored model stay in the
    data's units; the loss is the standardized MSE (eval_loss = eval_mse / std^2)."""
    overrides = ["data.standardize=true", "train.steps=4", "train.eval_every=4"]
    config = dta_config(tmp_path, *overrides)
    result = hopperjax.train(config, console=False)

    data = dta_workload.load_pairs(config)
    train_idx, _ = dta_workload.split_pairs(data.folds, len(data.pairs), config)
    y = np.asarray(data.pairs.take(train_idx)["affinity"], np.float64)
    stats = result.state.model_state["target_stats"]
    np.testing.assert_allclose(float(stats["mean"]), y.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(stats["std"]), y.std(), rtol=1e-6)
    assert abs(y.mean()) > 0.5 and abs(y.std() - 1.0) > 0.1  # so unit mix-ups would show

    (last,) = [r for r in result.history if "eval_mse" in r]
    assert last["eval_loss"] == pytest.approx(last["eval_mse"] / y.var(), rel=1e-5)
    # The first train loss of a fresh head is about the standardized variance, ~1, not ~y^2.
    first = next(r["loss"] for r in result.history if "loss" in r)
    assert 0.2 < first < 5.0

    # A restored model (no data read) predicts in the data's units, as training's eval did.
    restored = hopperjax.restore_params(result.run_dir)
    assert float(restored.variables["target_stats"]["mean"]) == float(stats["mean"])
    workload = dta_workload.AffinityRegression(config)
    batch = next(iter(workload.build_datasets(ProcessShard(0, 1)).eval))
    inputs = {k: jax.numpy.asarray(batch[k]) for k in MODEL_KEYS}
    got = restored.workload.predict(restored.model, restored.variables, inputs)
    trained = {"params": result.state.params, **result.state.model_state}
    model = workload.build_model(restored.model.policy, config.remat)
    want = model.apply(trained, inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert abs(float(np.mean(got)) - y.mean()) < 3 * y.std()


def test_standardize_reads_the_same_statistics_from_shards(tmp_path):
    """Shards give the training split's affinities from the records' headers: the same mean and
    std as the DeepDTA directory they were converted from (float32 storage: 1e-6)."""
    root = _write_deepdta(tmp_path / "davis")
    shards = _write_shards(root, tmp_path / "shards", 2)
    stats = {}
    for source, path in (("deepdta", root), ("shards", shards)):
        config = dta_config(
            tmp_path,
            f"data.source={source}",
            f"data.path={path}",
            "data.group_by=none",
            "data.standardize=true",
            "train.batch_size=4",
            "train.eval_batch_size=4",
        )
        workload = dta_workload.AffinityRegression(config)
        workload.build_datasets(ProcessShard(0, 1))
        stats[source] = workload.target_stats
    assert stats["deepdta"][1] > 0.1
    np.testing.assert_allclose(stats["shards"], stats["deepdta"], rtol=1e-6)


def test_rank_loss_is_the_mean_logistic_loss_over_ordered_pairs():
    """data.rank_weight's term against a loop over every pair: ties in the target and padding
    (weight 0) take no part, weights multiply, and a batch predicted in the true order scores
    below the same predictions reversed."""
    rng = np.random.default_rng(0)
    target = np.round(rng.normal(size=12), 1).astype(np.float32)
    target[:4] = 5.0  # a block of ties, as Davis's censored pKd 5.0
    prediction = rng.normal(size=12).astype(np.float32)
    weight = np.ones(12, np.float32)
    weight[-2:] = 0.0
    weight[3] = 2.0
    total = norm = 0.0
    for i in range(12):
        for j in range(12):
            if target[i] > target[j]:
                w = float(weight[i] * weight[j])
                total += w * math.log1p(math.exp(float(prediction[j] - prediction[i])))
                norm += w
    got = dta_workload.rank_loss(prediction, target, weight)
    assert float(got) == pytest.approx(total / norm, rel=1e-5)
    ordered = dta_workload.rank_loss(target, target, weight)
    assert float(ordered) < float(dta_workload.rank_loss(-target, target, weight))


def test_rank_weight_adds_the_ranking_term_to_the_standardized_mse(tmp_path):
    """The train loss with data.rank_weight=w is the MSE loss plus w times rank_loss of the
    predictions in standard deviations; 0 leaves the MSE loss alone."""
    losses = {}
    for w in (0.0, 0.5):
        config = dta_config(tmp_path, "data.standardize=true", f"data.rank_weight={w}")
        workload = dta_workload.AffinityRegression(config)
        workload.build_datasets(ProcessShard(0, 1))
        batch = {
            "affinity": np.array([5.0, 6.0, 7.5, 5.0], np.float32),
            "weight": np.array([1.0, 1.0, 1.0, 0.0], np.float32),
        }
        outputs = np.array([5.5, 5.2, 8.0, 9.0], np.float32)
        losses[w] = float(workload.loss(outputs, batch))
    std = workload.target_stats[1]
    mse = ((0.5**2 + 0.8**2 + 0.5**2) / 3) / std**2
    assert losses[0.0] == pytest.approx(mse, rel=1e-5)
    rank = dta_workload.rank_loss(outputs / std, batch["affinity"], batch["weight"])
    assert losses[0.5] == pytest.approx(mse + 0.5 * float(rank), rel=1e-5)
    for overrides, key in (
        (["data.rank_weight=1", "data.standardize=false"], "data.rank_scale"),
        (["data.rank_scale=batch"], "data.rank_scale"),
    ):
        with pytest.raises(hopperjax.ConfigError, match=key.replace(".", r"\.")):
            dta_workload.AffinityRegression.validate_config(dta_config(tmp_path, *overrides))
    with pytest.raises(hopperjax.ConfigError, match=r"data\.rank_weight"):
        dta_workload.AffinityRegression.validate_config(dta_config(tmp_path, "data.rank_weight=-1"))


def test_rank_scale_batch_orders_without_rewarding_spread(tmp_path):
    """data.rank_scale=batch: the ranking term of the predictions standardized by their own
    (weighted) mean and std, so it is the same for every scale and offset of the predictions,
    and its gradient has no component along them: the MSE alone sets those."""
    config = dta_config(
        tmp_path, "data.standardize=true", "data.rank_weight=1.0", "data.rank_scale=batch"
    )
    workload = dta_workload.AffinityRegression(config)
    workload.build_datasets(ProcessShard(0, 1))
    std = workload.target_stats[1]
    batch = {
        "affinity": np.array([5.0, 6.0, 7.5, 5.0, 8.0], np.float32),
        "weight": np.array([1.0, 1.0, 1.0, 1.0, 0.0], np.float32),
    }
    outputs = np.array([5.5, 5.2, 8.0, 6.0, 30.0], np.float32)

    def rank_term(p):
        mse = (batch["weight"] * (p - batch["affinity"]) ** 2).sum() / 4 / std**2
        return workload.loss(p, batch) - mse

    kept = outputs[:4]
    want = dta_workload.rank_loss(
        (kept - kept.mean()) / kept.std(), batch["affinity"][:4], np.ones(4, np.float32)
    )
    assert float(rank_term(outputs)) == pytest.approx(float(want), rel=1e-4)
    scaled = np.where(batch["weight"] > 0, 3.0 * outputs - 7.0, outputs)
    assert float(rank_term(scaled)) == pytest.approx(float(want), rel=1e-4)
    grad = np.asarray(jax.grad(rank_term)(jax.numpy.asarray(outputs)))
    assert abs(float(grad @ (outputs * batch["weight"]))) < 1e-4  # no pull on the scale
    assert abs(float(grad.sum())) < 1e-4  # nor on the offset
    assert grad[-1] == 0.0  # padding takes no part
    assert np.abs(grad).max() > 1e-3


def test_an_ensemble_trains_each_member_on_its_own_loss_and_predicts_their_mean(tmp_path):
    """model.members=2: two networks, each the one-network model with its own parameters (its
    own initialization), its own predictions, and the gradient of its own loss (halved: the
    loss is the members' mean); predict (which eval, export and serving call) returns their
    mean."""
    config = dta_config(tmp_path, *RUN, "model.members=2")
    single = dta_config(tmp_path, *RUN)
    with pytest.raises(hopperjax.ConfigError, match=r"model\.members"):
        dta_workload.AffinityRegression.validate_config(dta_config(tmp_path, "model.members=0"))
    pairs = dta_workload.load_pairs(config)
    batch = _pairs_batch(config, np.arange(40))
    inputs = dta_batches.to_model_batch(
        batch, drug_rows=pairs.drugs, protein_rows=pairs.proteins, block=0, dedup=True
    )
    inputs = {k: inputs[k] for k in MODEL_KEYS}
    labels = {"affinity": batch["affinity"], "weight": batch["weight"]}
    ensemble, model = hopperjax.build_model(config), hopperjax.build_model(single)
    workload, one = (dta_workload.AffinityRegression(c) for c in (config, single))

    @jax.jit
    def run(inputs, labels):
        params = nn.meta.unbox(ensemble.init(jax.random.key(0, impl="rbg"), inputs))["params"]

        def ensemble_loss(p):
            return workload.loss(ensemble.apply({"params": p}, inputs), labels)

        def member_loss(p):
            return one.loss(model.apply({"params": p}, inputs), labels)

        members = [params[f"member{i}"] for i in range(2)]
        return (
            params,
            ensemble.apply({"params": params}, inputs),
            workload.predict(ensemble, {"params": params}, inputs),
            [model.apply({"params": p}, inputs) for p in members],
            jax.grad(ensemble_loss)(params),
            [jax.grad(member_loss)(p) for p in members],
        )

    params, outputs, mean, alone, grads, alone_grads = jax.device_get(run(inputs, labels))
    assert sorted(params) == ["member0", "member1"]
    one_shapes = jax.eval_shape(model.init, jax.random.key(0, impl="rbg"), inputs)["params"]
    for member in params.values():  # each member is the one-network model's tree
        shapes = jax.tree.map(lambda x: x.shape, member)
        assert shapes == jax.tree.map(lambda x: x.shape, nn.meta.unbox(one_shapes))
    kernel = params["member0"]["head0"]["kernel"]
    assert np.abs(kernel - params["member1"]["head0"]["kernel"]).max() > 0.1 * np.abs(kernel).max()
    assert outputs.shape == (2, 40)
    assert np.abs(outputs[0] - outputs[1]).max() > 1e-3  # two initializations, two predictions
    for i in range(2):
        np.testing.assert_allclose(outputs[i], alone[i], rtol=1e-5, atol=1e-6)
        for got, want in zip(
            jax.tree.leaves(grads[f"member{i}"]), jax.tree.leaves(alone_grads[i]), strict=True
        ):
            np.testing.assert_allclose(got, 0.5 * want, rtol=1e-4, atol=1e-6 * np.abs(want).max())
    np.testing.assert_allclose(mean, outputs.mean(axis=0), rtol=1e-6)
    assert mean.shape == (40,)


def test_an_ensemble_run_evaluates_its_mean_and_inspect_counts_each_member(tmp_path):
    """A members=2 run trains, evaluates and restores (standardized targets shared by the
    members), and quantizes to INT8 (both members' kernels) predicting close to its float self;
    inspect counts twice the one network's GEMMs, per member by name, and its FLOP model agrees
    with the compiled step's."""
    run = ["model.members=2", "data.standardize=true", "train.steps=20", "train.eval_every=20"]
    result = hopperjax.train(dta_config(tmp_path, *RUN, *run), console=False)
    (last,) = [r for r in result.history if "eval_mse" in r]
    assert math.isfinite(last["eval_mse"]) and last["eval_pairs"] == 70
    restored = hopperjax.restore_params(result.run_dir)
    assert sorted(restored.variables["params"]) == ["member0", "member1"]
    quantized = quantize_restored(restored, "weight")
    int8 = {
        path[0].key
        for path, leaf in jax.tree_util.tree_leaves_with_path(quantized.variables["params"])
        if path[-1].key == "kernel" and leaf.dtype == np.int8
    }
    assert int8 == {"member0", "member1"}
    batch = next(iter(hopperjax.build_components(restored.config).datasets.eval))
    float_out, int8_out = (predict_batch(r, batch) for r in (restored, quantized))
    assert float_out.shape == (64,)  # one prediction per pair: the members' mean
    # Within 3 % of the float predictions' spread (0.4 % when written: 0.0008 of 0.19 pKd).
    assert np.abs(int8_out - float_out).max() < 0.03 * np.ptp(float_out)

    one, two = (
        inspect_config(dta_config(tmp_path / f"i{m}", *RUN, f"model.members={m}")) for m in (1, 2)
    )
    for key in ("flops_per_step", "model_flops_per_step"):
        assert two[key] == pytest.approx(2 * one[key], rel=1e-6), key
    assert two["flops_per_step"] == pytest.approx(two["model_flops_per_step"], rel=0.05)
    paths = [g["layer"].split("/") for g in two["gemms"] if g["layer"]]
    assert {p[0] for p in paths} == {"member0", "member1"}, paths
    # Each member's layers by their parameters' names (no helper method's scope in between).
    assert {p[1] for p in paths} <= {"drug", "protein", "head0", "head1", "out"}, paths
