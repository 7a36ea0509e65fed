"""MovieLens-100k's 5-fold protocol: RMSE and MAE over u1..u5, beside Surprise's benchmark.

    python experiments/ratings_benchmark.py --data DIR [--config configs/ratings_mf.yaml]
        [--folds 1,2,3,4,5] [--out runs/ratings_benchmark] [key=value ...]
    python experiments/ratings_benchmark.py --synthetic 80000,320000,1280000 [--noise 0.9] ...

DIR holds MovieLens-100k's ``u1.base`` / ``u1.test`` .. ``u5.base`` / ``u5.test``. Per fold: one
``hopperjax.train`` on ``uK.base`` evaluated on ``uK.test`` (``data.fold=K``); the final
evaluation's RMSE and MAE (predictions clipped to the training ratings' range, as Surprise does)
are the fold's scores. Folds already in ``OUT/results.json`` are kept (the benchmark resumes; an
unfinished fold starts again). Writes ``table.md``: mean +- std over the folds next to Surprise's
published ml-100k figures (its README; 5-fold cross-validation with its own random folds, so
comparable but not the same splits), and per fold its wall and step time.

``--synthetic N1,N2,..``: the same recipe on generated ratings of ml-100k's shape (its 944 x
1,683 tables; a hidden rank-4-plus-bias structure and Gaussian noise of std ``--noise``, the
lowest RMSE any model can reach), N training ratings each (a quarter as many held out), trained
for the recipe's number of epochs on its 80,000 ratings. The table gives each size's held-out
RMSE beside the noise floor: whether the model recovers the structure, and how many ratings it
needs to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dta_benchmark import cpu_name

import hopperjax

# Surprise's README, "Benchmarks", MovieLens-100k, 5-fold cross-validation: (RMSE, MAE).
PUBLISHED = {"SVD (Surprise)": (0.934, 0.737), "SVD++ (Surprise)": (0.920, 0.722)}


def run_fold(args: argparse.Namespace, fold: int, out: Path) -> dict:
    run_dir = out / f"fold{fold}"
    overrides = [*args.overrides, f"data.path={args.data}", f"data.fold={fold}",
                 f"run_dir={run_dir}"]  # fmt: skip
    config = hopperjax.load_config(args.config, overrides)
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    wall = time.perf_counter() - start
    final = [r for r in result.history if "eval_rmse" in r][-1]
    steps = [r["step_time_s"] for r in result.history if "step_time_s" in r]
    return {
        "fold": fold,
        "rmse": final["eval_rmse"],
        "mae": final["eval_mae"],
        "ratings": final["eval_rows"],
        "wall_s": wall,
        "step_s": float(np.median(steps)) if steps else float("nan"),
    }


RECIPE_RATINGS = 80_000  # a fold's training ratings, for which the recipe's steps are set


def run_synthetic(args: argparse.Namespace, rows: int, out: Path) -> dict:
    data = ["data.source=synthetic", "data.path=null", "data.fold=null",
            f"data.synthetic_rows={rows}", f"data.synthetic_noise={args.noise}"]  # fmt: skip
    recipe = hopperjax.load_config(args.config, [*args.overrides, *data])
    steps = max(1, round(recipe.train.steps * rows / RECIPE_RATINGS))
    overrides = [*args.overrides, *data, f"train.steps={steps}", f"train.eval_every={steps}",
                 f"train.checkpoint_every={steps}", f"run_dir={out}/synthetic{rows}"]  # fmt: skip
    config = hopperjax.load_config(args.config, overrides)
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    wall = time.perf_counter() - start
    final = [r for r in result.history if "eval_rmse" in r][-1]
    return {"fold": f"synthetic {rows}", "rows": rows, "steps": steps, "noise": args.noise,
            "rmse": final["eval_rmse"], "mae": final["eval_mae"], "ratings": final["eval_rows"],
            "wall_s": wall}  # fmt: skip


def write_synthetic_table(runs: list[dict], header: str, path: Path) -> str:
    lines = [
        header, "",
        "| training ratings | steps | held-out RMSE | noise floor | above the floor | wall s |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['rows']:,} | {r['steps']:,} | {r['rmse']:.4f} | {r['noise']:.2f} | "
          f"{100 * (r['rmse'] / r['noise'] - 1):.1f} % | {r['wall_s']:.0f} |" for r in runs],
    ]  # fmt: skip
    return _write(lines, path)


def _write(lines: list[str], path: Path) -> str:
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def write_table(runs: list[dict], header: str, path: Path) -> str:
    rmse = np.array([r["rmse"] for r in runs])
    mae = np.array([r["mae"] for r in runs])
    lines = [
        header, "",
        "| model | RMSE | MAE | folds |", "|---|---:|---:|---:|",
        f"| hopperjax | {rmse.mean():.4f} ± {rmse.std():.4f} | {mae.mean():.4f} ± "
        f"{mae.std():.4f} | {len(runs)} |",
        *[f"| {name}, published | {r:.3f} | {m:.3f} | 5 |" for name, (r, m) in PUBLISHED.items()],
        "", "| fold | RMSE | MAE | test ratings | wall s | s/step |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {r['fold']} | {r['rmse']:.4f} | {r['mae']:.4f} | {r['ratings']:.0f} | "
          f"{r['wall_s']:.0f} | {r['step_s']:.4f} |" for r in runs],
    ]  # fmt: skip
    return _write(lines, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="MovieLens-100k's directory (u1..u5)")
    source.add_argument("--synthetic", help="training ratings of each generated set: N1,N2,..")
    parser.add_argument("--noise", type=float, default=0.9, help="--synthetic's noise std")
    parser.add_argument("--config", default="configs/ratings_mf.yaml")
    parser.add_argument("--folds", default="1,2,3,4,5")
    parser.add_argument("--out", default="runs/ratings_benchmark")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    flag, text = ("--synthetic", args.synthetic) if args.synthetic else ("--folds", args.folds)
    try:
        folds = [int(f) for f in text.split(",")]
    except ValueError:
        print(f"ratings_benchmark: {flag}: expected integers like 1,2,3, got {text!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.synthetic:
        folds = [f"synthetic {rows}" for rows in folds]
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    settings = {"config": args.config, "data": args.data or f"synthetic, noise {args.noise}",
                "overrides": args.overrides}  # fmt: skip
    done = {}
    if results.exists():
        try:
            done = {r["fold"]: r for r in json.loads(results.read_text())}
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            print(f"ratings_benchmark: {results}: unreadable ({e}); remove it", file=sys.stderr)
            return 2
        if any(r.get("settings") != settings for r in done.values()):
            print(f"ratings_benchmark: {results} holds folds of other settings (config, data or "
                  f"overrides); use another --out", file=sys.stderr)  # fmt: skip
            return 2
    try:
        for fold in folds:
            if fold in done:
                print(f"fold {fold}: kept from {results}", flush=True)
                continue
            run_dir = out / str(fold).replace(" ", "") if args.synthetic else out / f"fold{fold}"
            if run_dir.exists():
                print(f"fold {fold}: discarding an unfinished run", flush=True)
                shutil.rmtree(run_dir)
            if args.synthetic:
                r = run_synthetic(args, int(str(fold).split()[1]), out)
            else:
                r = run_fold(args, fold, out)
            r = done[fold] = {**r, "settings": settings}
            print(f"fold {fold}: RMSE {r['rmse']:.4f} MAE {r['mae']:.4f}; {r['wall_s']:.0f} s",
                  flush=True)  # fmt: skip
            partial = results.with_suffix(".json.tmp")
            partial.write_text(json.dumps(list(done.values())))
            partial.replace(results)
    except hopperjax.ConfigError as e:
        print(f"ratings_benchmark: {e}", file=sys.stderr)
        return 2
    runs = [done[f] for f in folds]
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    what = (
        f"{len(runs)} generated sets of ml-100k's shape" if args.synthetic else f"{len(runs)} folds"
    )
    header = (
        f"{args.config} {' '.join(args.overrides)}; {what} on {jax.device_count()} "
        f"{jax.default_backend()} device(s), {host}; RMSE and MAE of the final evaluation"
    )
    write = write_synthetic_table if args.synthetic else write_table
    print(write(runs, header, out / "table.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
