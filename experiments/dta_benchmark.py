"""DeepDTA's protocol on a DeepDTA-format dataset (Davis by default), scored like the paper.

    python experiments/dta_benchmark.py --data data/davis
        [--config configs/dta_davis.yaml]
        [--folds 0,1,2,3,4] [--out runs/dta_benchmark] [--select valid_mse|last]
        [key=value ...]

For each of the 5 training folds held out as validation: train on the other four
(``hopperjax.train``, evaluating on the held-out fold every ``train.eval_every`` steps and keeping
a checkpoint at each evaluation), pick the step with the lowest validation MSE (``--select
last``: the last step, no choice), restore it, and score it once on the test fold. The test fold
never takes part in the choice. Folds already in
``OUT/results.json`` are kept, so an interrupted benchmark goes on where it stopped (a fold that did
not finish starts again from scratch: its wall time must be one uninterrupted run). Writes
``table.md`` (mean +- std of test MSE, CI, rm2, Pearson over the runs, next to the published
numbers of the dataset it ran on, recognized by its shape: Davis or KIBA; none for another; and
per run its wall time and step time), ``results.json`` and ``scatter.png`` (predicted vs
measured pKd of the test fold, run 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plotting

import hopperjax
from hopperjax import scoring
from hopperjax.checkpoint import Checkpointer
from hopperjax.data import DevicePrefetcher
from hopperjax.trainer import build_components

# Published test-set figures of DeepDTA's setting 1, per dataset, recognized by its shape (drugs,
# proteins, measured pairs). Davis: DeepDTA (Öztürk et al. 2018), KronRLS and SimBoost as DeepDTA
# reports them, GraphDTA (Nguyen et al. 2021) as MGraphDTA's Table 3 (Yang et al. 2022) and
# MSGNN-DTA's Table 2 (Wang et al. 2023) list them, MSGNN-DTA from its own Table 2. KIBA: DeepDTA,
# KronRLS and SimBoost as DeepDTA reports them, GraphDTA and MGraphDTA as MGraphDTA's Table 3
# lists them.
PUBLISHED = {
    "Davis": {
        "shape": (68, 442, 30_056),
        "results": {
            "DeepDTA (CNN/CNN)": {"mse": 0.261, "ci": 0.878, "rm2": 0.630},
            "KronRLS": {"mse": 0.379, "ci": 0.871, "rm2": 0.407},
            "SimBoost": {"mse": 0.282, "ci": 0.872, "rm2": 0.644},
            "GraphDTA GIN": {"mse": 0.229, "ci": 0.893, "rm2": None},
            "MSGNN-DTA (best listed)": {"mse": 0.195, "ci": 0.906, "rm2": 0.719},
        },
    },
    "KIBA": {
        "shape": (2_111, 229, 118_254),
        "results": {
            "DeepDTA (CNN/CNN)": {"mse": 0.194, "ci": 0.863, "rm2": 0.673},
            "KronRLS": {"mse": 0.411, "ci": 0.782, "rm2": 0.342},
            "SimBoost": {"mse": 0.222, "ci": 0.836, "rm2": 0.629},
            "GraphDTA GAT-GCN": {"mse": 0.139, "ci": 0.891, "rm2": None},
            "MGraphDTA": {"mse": 0.128, "ci": 0.902, "rm2": 0.801},
        },
    },
}


def published_for(shape: tuple[int, int, int]) -> tuple[str | None, dict]:
    """(dataset name, its published results) for a dataset of ``shape`` (drugs, proteins,
    pairs); (None, {}) for a dataset with no published figures here."""
    for name, entry in PUBLISHED.items():
        if tuple(shape) == entry["shape"]:
            return name, entry["results"]
    return None, {}


def dataset_shape(config_path: str, overrides: list[str]) -> tuple[int, int, int]:
    """(distinct drugs, distinct proteins, measured pairs) of the benchmark's dataset."""
    from hopperjax.workloads.dta import load_table

    table = load_table(hopperjax.load_config(config_path, overrides))
    return len(table.drugs), len(table.proteins), len(table.affinity)


def cpu_name() -> str:
    """The host CPU's model name (speed figures are quoted with it)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def predict(parts, state) -> tuple[np.ndarray, np.ndarray]:
    """(measured, predicted) affinities of every pair of ``parts``' eval split."""
    step = parts.lower_eval_step().compile()
    batches = DevicePrefetcher(iter(parts.datasets.eval), parts.batch_sharding, 2)
    outputs = [step(state, batch) for batch in batches]
    joined = {k: np.concatenate([np.asarray(o[k]) for o in jax.device_get(outputs)])
              for k in outputs[0]}  # fmt: skip
    keep = joined["weight"] > 0
    return joined["affinity"][keep], joined["prediction"][keep]


class FoldStopped(Exception):
    """A fold's training stopped before its last step (SIGTERM, Ctrl-C)."""


def chosen_eval(evals: list[dict], select: str) -> dict:
    """The eval record whose checkpoint is scored on the test fold: the lowest validation MSE
    (the first of equals), or the last one (``select == "last"``)."""
    return evals[-1] if select == "last" else min(evals, key=lambda r: r["eval_mse"])


def run_fold(
    config_path: str, overrides: list[str], fold: int, out: Path, select: str = "valid_mse"
) -> dict:
    base = hopperjax.load_config(
        config_path, [*overrides, f"data.valid_fold={fold}", f"run_dir={out / f'fold{fold}'}"]
    )
    t = base.train
    config = base.replace(
        **{
            "train.checkpoint_every": t.eval_every,
            "train.keep_checkpoints": t.steps // t.eval_every + 2,
            "data.eval_split": "valid",
        }
    )
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    train_s = time.perf_counter() - start
    end = t.stop_after or t.steps
    if int(result.state.step) < end:  # stopped by a signal: nothing to score
        raise FoldStopped(f"fold {fold}: stopped at step {int(result.state.step)} of {end}")
    step_times = [r["step_time_s"] for r in result.history if "step_time_s" in r]
    evals = [r for r in result.history if "eval_mse" in r]
    best = chosen_eval(evals, select)

    test_parts = build_components(config.replace(**{"data.eval_split": "test"}))
    checkpointer = Checkpointer(
        result.run_dir / "checkpoints", every=t.eval_every, keep=10**6, async_save=False
    )
    state, _ = checkpointer.restore(best["step"], test_parts.abstract_state)
    checkpointer.close()
    measured, predicted = predict(test_parts, state)
    return {
        "fold": fold,
        "best_step": best["step"],
        "valid": {k[5:]: best[k] for k in ("eval_mse", "eval_ci", "eval_rm2", "eval_pearson")},
        "test": scoring.regression_scores(measured, predicted),
        "train_s": train_s,
        "step_s": float(np.median(step_times)),
        "wall_s": time.perf_counter() - start,
        "valid_curve": [(r["step"], r["eval_mse"]) for r in evals],
        "measured": measured.tolist(),
        "predicted": predicted.tolist(),
    }


def write_table(
    runs: list[dict], header: str, path: Path, dataset: tuple[str | None, dict] = (None, {})
) -> str:
    """Mean +- std over the runs, the published figures of ``dataset`` (name, results) if any,
    and a row per run with its wall time (training, selection and test scoring) and step time."""

    def stat(key: str) -> str:
        values = np.array([r["test"][key] for r in runs])
        return f"{values.mean():.3f} ± {values.std():.3f}"

    name, published = dataset
    lines = [
        header,
        "",
        "| model | test MSE | test CI | test rm2 | test Pearson |",
        "|---|---:|---:|---:|---:|",
        f"| hopperjax ({len(runs)} runs) | {stat('mse')} | {stat('ci')} | {stat('rm2')} | "
        f"{stat('pearson')} |",
    ]
    for model, p in published.items():
        rm2 = "–" if p["rm2"] is None else f"{p['rm2']:.3f}"
        lines.append(
            f"| {model} (published, {name}) | {p['mse']:.3f} | {p['ci']:.3f} | {rm2} | – |"
        )
    if not published:
        lines.append("| (no published figures for a dataset of this shape) | | | | |")
    lines += [
        "",
        "| run (valid fold) | step scored | valid MSE | test MSE | test CI | test rm2 | train s | "
        "wall s | s/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "–"
        step = f"{r['step_s']:.3f}" if "step_s" in r else "–"
        lines.append(
            f"| {r['fold']} | {r['best_step']} | {r['valid']['mse']:.3f} | "
            f"{r['test']['mse']:.3f} | {r['test']['ci']:.3f} | {r['test']['rm2']:.3f} | "
            f"{r['train_s']:.0f} | {wall} | {step} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def plot(run: dict, path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    measured, predicted = np.array(run["measured"]), np.array(run["predicted"])
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.scatter(measured, predicted, s=4, alpha=0.3)
    lo, hi = min(measured.min(), predicted.min()), max(measured.max(), predicted.max())
    ax.plot([lo, hi], [lo, hi], color="black", linewidth=0.8)
    ax.set_xlabel("measured pKd")
    ax.set_ylabel("predicted pKd")
    t = run["test"]
    ax.set_title(f"test fold, run {run['fold']}: MSE {t['mse']:.3f}, CI {t['ci']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="a DeepDTA-format directory")
    parser.add_argument("--config", default="configs/dta_davis.yaml")
    parser.add_argument("--folds", default="0,1,2,3,4")
    parser.add_argument("--out", default="runs/dta_benchmark")
    parser.add_argument(
        "--select",
        choices=("valid_mse", "last"),
        default="valid_mse",
        help="the step scored on the test fold: the lowest validation MSE, or the last",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.path={args.data}", *args.overrides]
    folds = [int(f) for f in args.folds.split(",")]
    results = out / "results.json"
    done = {r["fold"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    recipe = {"config": args.config, "overrides": overrides, "select": args.select}
    for fold in folds:
        if fold in done:
            # Older records hold no recipe (kept as they are), or no selection (valid_mse then).
            kept = {"select": "valid_mse", **{k: done[fold][k] for k in recipe if k in done[fold]}}
            if "config" in kept and kept != recipe:
                ran = f"--config {kept['config']} {' '.join(kept['overrides'])} --select "
                ran += kept["select"]
                asked = f"--config {args.config} {' '.join(overrides)} --select {args.select}"
                print(f"{results}: fold {fold} ran {ran}, not {asked}; give this recipe another "
                      "--out", file=sys.stderr)  # fmt: skip
                return 2
            print(f"fold {fold}: kept from {results}", flush=True)
            continue
        if (out / f"fold{fold}").exists():
            print(f"fold {fold}: discarding an unfinished run", flush=True)
            shutil.rmtree(out / f"fold{fold}")
        try:
            r = done[fold] = {**recipe, **run_fold(args.config, overrides, fold, out, args.select)}
        except FoldStopped as e:
            print(f"{e}; the same command goes on (the finished folds are kept, this one starts "
                  "again: its wall time must be one run)", flush=True)  # fmt: skip
            return 0  # as the train command after a signal: stopped cleanly
        print(f"fold {fold}: step scored {r['best_step']}, valid MSE {r['valid']['mse']:.4f}, "
              f"test MSE {r['test']['mse']:.4f} CI {r['test']['ci']:.4f} "
              f"rm2 {r['test']['rm2']:.4f}; {r['wall_s']:.0f} s wall, {r['step_s']:.3f} s/step",
              flush=True)  # fmt: skip
        partial = results.with_suffix(".json.tmp")
        partial.write_text(json.dumps([done[f] for f in sorted(done)]))
        partial.replace(results)
    runs = [done[f] for f in folds]
    shape = dataset_shape(args.config, overrides)
    dataset = published_for(shape)
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    header = (
        f"{args.config} {' '.join(overrides)}, --select {args.select}; {len(runs)} runs on "
        f"{jax.device_count()} {jax.default_backend()} device(s), {host}; "
        f"dataset: {dataset[0] or 'unrecognized'} "
        f"({shape[0]:,} drugs, {shape[1]:,} proteins, {shape[2]:,} pairs)"
    )
    print(write_table(runs, header, out / "table.md", dataset))
    plot(runs[0], out / "scatter.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
