"""DeepDTA's protocol on a DeepDTA-format dataset (Davis by default), scored like the paper.

    python experiments/dta_benchmark.py --data data/davis
        [--config configs/dta_davis.yaml]
        [--folds 0,1,2,3,4 | --folds all [--seeds 0,1,2]] [--out runs/dta_benchmark]
        [--select valid_mse|last] [key=value ...]

For each of the 5 training folds held out as validation: train on the other four
(``hopperjax.train``, evaluating on the held-out fold every ``train.eval_every`` steps and keeping
a checkpoint at each evaluation), pick the step with the lowest validation MSE (``--select
last``: the last step, no choice), restore it, and score it once on the test fold. The test fold
never takes part in the choice. ``--folds all`` is GraphDTA's split instead: one run per
seed trained on all five training folds (``data.valid_fold: null``), so nothing is left to
select on: the last step is scored (``--select last``), and the run's evaluations, on the test
fold, are reported, never used. Folds (and seeds) already in
``OUT/results.json`` are kept, so an interrupted benchmark goes on where it stopped: a fold that
did not finish resumes from its newest checkpoint (the trainer's exact resume; the same recipe
only, else one line naming the key), its evaluations, selection and step times from every
process's records; its table row says where it resumed, its train and wall seconds are the last
process's, and a line below the table gives its steps' time over all processes. Writes
``table.md`` (mean +- std of test MSE, CI, rm2, Pearson over the runs, next to the published
numbers of the dataset it ran on, recognized by its shape: Davis or KIBA; none for another; and
per run its train and wall time and median step time), ``results.json`` and ``scatter.png``
(predicted vs measured pKd of the test fold, the first run).
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
from run_records import checkpoint_steps, steps_seconds

import hopperjax
from hopperjax import scoring
from hopperjax.checkpoint import Checkpointer, CheckpointError
from hopperjax.data import DevicePrefetcher
from hopperjax.observe import read_metrics
from hopperjax.trainer import build_components
from hopperjax.trainer.resume import changed_keys

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


ALL = "all"  # --folds all: GraphDTA's split, every training fold trained on


def run_name(fold: int | str, seed: int | None = None) -> str:
    """A run's directory under --out: ``fold3``, ``all_seed1``."""
    return f"all_seed{seed}" if fold == ALL else f"fold{fold}"


def run_label(fold: int | str, seed: int | None = None) -> str:
    """A run's name in messages and tables: ``fold 3``, ``all folds, seed 1``."""
    return f"all folds, seed {seed}" if fold == ALL else f"fold {fold}"


def same_recipe(run_dir: Path, config: hopperjax.Config) -> None:
    """Raises ConfigError naming the first key where the unfinished ``run_dir`` (its
    ``config.yaml``) and ``config`` differ: resuming it would train one run on two recipes.
    Not the recipe: ``train.keep_checkpoints``, the benchmark's bookkeeping (which once had
    another value), and ``train.stop_after``, where one process stops."""
    changed = changed_keys(run_dir, config)
    for key, (old, new) in changed.items():
        if key in ("train.keep_checkpoints", "train.stop_after"):
            continue
        raise hopperjax.ConfigError(
            key,
            f"the unfinished {run_dir} ran with {old!r}, this command gives {new!r}; resuming "
            f"would mix two recipes: give this recipe another --out",
        )


def run_fold(
    config_path: str,
    overrides: list[str],
    fold: int | str,
    out: Path,
    select: str = "valid_mse",
    seed: int | None = None,
) -> dict:
    """Trains one run and scores its chosen step on the test fold: ``fold`` held out for
    validation, or ``ALL`` (GraphDTA's split: no fold held out, the given ``seed``, the last
    step scored; the run's evaluations are on the test fold and choose nothing)."""
    everything = fold == ALL
    held = ["data.valid_fold=null", "data.eval_split=test", f"seed={seed}"] if everything else [
        f"data.valid_fold={fold}", "data.eval_split=valid"
    ]  # fmt: skip
    run_dir = out / run_name(fold, seed)
    base = hopperjax.load_config(config_path, [*overrides, *held, f"run_dir={run_dir}"])
    t = base.train
    # A checkpoint at every evaluation, none ever deleted (a stop adds one of its own), so that
    # whichever step is chosen is there to score.
    config = base.replace(
        **{"train.checkpoint_every": t.eval_every, "train.keep_checkpoints": t.steps}
    )
    if everything:
        select = "last"
    if checkpoint_steps(run_dir):
        same_recipe(run_dir, config)
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    train_s = time.perf_counter() - start
    end = t.stop_after or t.steps
    if int(result.state.step) < end:  # stopped by a signal: nothing to score
        raise FoldStopped(
            f"{run_label(fold, seed)}: stopped at step {int(result.state.step)} of {end}"
        )
    # Every process's records: a resumed run's file holds each step once (the trainer drops the
    # records past the checkpoint it resumes from), its history only this process's.
    history = read_metrics(result.run_dir / "metrics.jsonl")
    logged = [r for r in history if "step_time_s" in r]
    step_times = [r["step_time_s"] for r in logged]
    resumed_from = result.start_step  # 0, or the checkpoint this process resumed
    evals = [r for r in history if "eval_mse" in r]
    best = chosen_eval(evals, select)

    test_parts = build_components(config.replace(**{"data.eval_split": "test"}))
    checkpointer = Checkpointer(
        result.run_dir / "checkpoints", every=t.eval_every, keep=10**6, async_save=False
    )
    state, _ = checkpointer.restore(best["step"], test_parts.abstract_state)
    checkpointer.close()
    measured, predicted = predict(test_parts, state)
    scores = {k[5:]: best[k] for k in ("eval_mse", "eval_ci", "eval_rm2", "eval_pearson")}
    return {
        "fold": fold,
        **({"seed": seed} if everything else {}),
        "best_step": best["step"],
        "valid": None if everything else scores,  # all folds trained on: no validation
        "test": scoring.regression_scores(measured, predicted),
        "train_s": train_s,
        "step_s": float(np.median(step_times)),
        "wall_s": time.perf_counter() - start,
        "resumed_from": resumed_from,
        "steps_s": steps_seconds(logged),
        ("test_curve" if everything else "valid_curve"): [
            (r["step"], r["eval_mse"]) for r in evals
        ],
        "measured": measured.tolist(),
        "predicted": predicted.tolist(),
    }


def write_table(
    runs: list[dict], header: str, path: Path, dataset: tuple[str | None, dict] = (None, {})
) -> str:
    """Mean +- std over the runs, the published figures of ``dataset`` (name, results) if any,
    and a row per run with its wall time (training, selection and test scoring) and step time;
    a resumed run's row says so, and a line below gives its steps' time over all processes."""

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
        f"| run{'' if runs[0]['fold'] == ALL else ' (valid fold)'} | step scored | valid MSE | "
        "test MSE | test CI | test rm2 | train s | wall s | s/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "–"
        step = f"{r['step_s']:.3f}" if "step_s" in r else "–"
        name = run_label(r["fold"], r.get("seed")).removeprefix("fold ")
        if r.get("resumed_from"):  # its seconds are the last process's only (footnote)
            name += f" (resumed at step {r['resumed_from']})"
        valid = "–" if r["valid"] is None else f"{r['valid']['mse']:.3f}"
        lines.append(
            f"| {name} | {r['best_step']} | {valid} | "
            f"{r['test']['mse']:.3f} | {r['test']['ci']:.3f} | {r['test']['rm2']:.3f} | "
            f"{r['train_s']:.0f} | {wall} | {step} |"
        )
    resumed = [r for r in runs if r.get("resumed_from")]
    if resumed:
        each = ", ".join(
            f"{run_label(r['fold'], r.get('seed'))} {r['steps_s']:.0f} s" for r in resumed
        )
        lines += [
            "",
            "A resumed run's train s and wall s are its last process's; the training steps of "
            f"all its processes took (log windows' step times x steps): {each}.",
        ]
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
    name = run_label(run["fold"], run.get("seed")) if run["fold"] == ALL else f"run {run['fold']}"
    ax.set_title(f"test fold, {name}: MSE {t['mse']:.3f}, CI {t['ci']:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="a DeepDTA-format directory")
    parser.add_argument("--config", default="configs/dta_davis.yaml")
    parser.add_argument(
        "--folds",
        default="0,1,2,3,4",
        help="validation folds, one run each; 'all': GraphDTA's split, one run per --seeds",
    )
    parser.add_argument("--seeds", help="with --folds all: the runs' seeds (default 0)")
    parser.add_argument("--out", default="runs/dta_benchmark")
    parser.add_argument(
        "--select",
        choices=("valid_mse", "last"),
        help="the step scored on the test fold: the lowest validation MSE (the default), or the "
        "last (the only choice with --folds all)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        if args.folds == ALL:
            seeds = "0" if args.seeds is None else args.seeds
            keys = [(ALL, int(s)) for s in seeds.split(",")]
        else:
            keys = [(int(f), None) for f in args.folds.split(",")]
    except ValueError:
        given = f"--seeds {args.seeds!r}" if args.folds == ALL else f"--folds {args.folds!r}"
        print(f"{given}: expected comma-separated integers"
              f"{'' if args.folds == ALL else ' (or all)'}", file=sys.stderr)  # fmt: skip
        return 2
    if len(set(keys)) != len(keys):
        print(f"--folds {args.folds} --seeds {args.seeds}: a run named twice would count twice "
              "in the mean and std", file=sys.stderr)  # fmt: skip
        return 2
    # The benchmark sets these per run; an override of them would be overridden in silence.
    owned = ("data.valid_fold=", "data.eval_split=", *(("seed=",) if args.folds == ALL else ()))
    for o in args.overrides:
        if o.startswith(owned):
            what = "--seeds" if o.startswith("seed=") else "--folds"
            print(f"{o}: the benchmark sets {o.split('=')[0]} for each run; use {what}",
                  file=sys.stderr)  # fmt: skip
            return 2
    if args.folds == ALL and args.select == "valid_mse":
        print("--select valid_mse: --folds all trains on every fold, so there is no validation "
              "fold to select on; the last step is scored", file=sys.stderr)  # fmt: skip
        return 2
    if args.folds != ALL and args.seeds is not None:
        print("--seeds: only with --folds all (a fold's seed is the config's `seed`)",
              file=sys.stderr)  # fmt: skip
        return 2
    select = args.select or ("last" if args.folds == ALL else "valid_mse")
    try:
        return benchmark(args, keys, select)
    except (hopperjax.ConfigError, CheckpointError) as e:  # a data path, fold or key the config
        print(e, file=sys.stderr)  # refuses, or an unfinished run's checkpoints that cannot resume
        return 2


def _order(key: tuple) -> tuple:
    """results.json's order: numbered folds, then all-folds runs by seed."""
    fold, seed = key
    return (fold == ALL, -1 if fold == ALL else fold, seed or 0)


def benchmark(args: argparse.Namespace, keys: list[tuple], select: str) -> int:
    """Runs (or keeps) each run of ``keys`` and writes the table; main's parsed arguments."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    overrides = [f"data.path={args.data}", *args.overrides]
    results = out / "results.json"
    done = (
        {(r["fold"], r.get("seed")): r for r in json.loads(results.read_text())}
        if results.exists()
        else {}
    )
    recipe = {"config": args.config, "overrides": overrides, "select": select}
    for key in keys:
        fold, seed = key
        name, label = run_name(fold, seed), run_label(fold, seed)
        if key in done:
            # Older records hold no recipe (kept as they are), or no selection (valid_mse then).
            kept = {"select": "valid_mse", **{k: done[key][k] for k in recipe if k in done[key]}}
            if "config" in kept and kept != recipe:
                ran = f"--config {kept['config']} {' '.join(kept['overrides'])} --select "
                ran += kept["select"]
                asked = f"--config {args.config} {' '.join(overrides)} --select {select}"
                print(f"{results}: {label} ran {ran}, not {asked}; give "
                      "this recipe another --out", file=sys.stderr)  # fmt: skip
                return 2
            print(f"{label}: kept from {results}", flush=True)
            continue
        if steps := checkpoint_steps(out / name):
            print(f"{label}: resuming an unfinished run from step {steps[-1]}", flush=True)
        elif (out / name).exists():
            print(f"{label}: discarding an unfinished run (no checkpoint)", flush=True)
            shutil.rmtree(out / name)
        try:
            r = done[key] = {
                **recipe,
                **run_fold(args.config, overrides, fold, out, select, seed),
            }
        except FoldStopped as e:
            print(f"{e}; the same command goes on (the finished runs are kept, this one "
                  "resumes from its checkpoint)", flush=True)  # fmt: skip
            return 0  # as the train command after a signal: stopped cleanly
        valid = "" if r["valid"] is None else f"valid MSE {r['valid']['mse']:.4f}, "
        print(f"{label}: step scored {r['best_step']}, {valid}"
              f"test MSE {r['test']['mse']:.4f} CI {r['test']['ci']:.4f} "
              f"rm2 {r['test']['rm2']:.4f}; {r['wall_s']:.0f} s wall, {r['step_s']:.3f} s/step",
              flush=True)  # fmt: skip
        partial = results.with_suffix(".json.tmp")
        partial.write_text(json.dumps([done[k] for k in sorted(done, key=_order)]))
        partial.replace(results)
    runs = [done[k] for k in keys]
    shape = dataset_shape(args.config, overrides)
    dataset = published_for(shape)
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    header = (
        f"{args.config} {' '.join(overrides)}, "
        f"{'--folds all (every training fold), ' if args.folds == ALL else ''}"
        f"--select {select}; {len(runs)} runs on "
        f"{jax.device_count()} {jax.default_backend()} device(s), {host}; "
        f"dataset: {dataset[0] or 'unrecognized'} "
        f"({shape[0]:,} drugs, {shape[1]:,} proteins, {shape[2]:,} pairs)"
    )
    print(write_table(runs, header, out / "table.md", dataset))
    plot(runs[0], out / "scatter.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
