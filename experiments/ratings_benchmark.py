"""MovieLens-100k's 5-fold protocol: RMSE and MAE over u1..u5, beside Surprise's benchmark.

    python experiments/ratings_benchmark.py --data DIR [--config configs/ratings_mf.yaml]
        [--folds 1,2,3,4,5] [--out runs/ratings_benchmark] [key=value ...]

DIR holds MovieLens-100k's ``u1.base`` / ``u1.test`` .. ``u5.base`` / ``u5.test``. Per fold: one
``hopperjax.train`` on ``uK.base`` evaluated on ``uK.test`` (``data.fold=K``); the final
evaluation's RMSE and MAE (predictions clipped to the training ratings' range, as Surprise does)
are the fold's scores. Folds already in ``OUT/results.json`` are kept (the benchmark resumes; an
unfinished fold starts again). Writes ``table.md``: mean +- std over the folds next to Surprise's
published ml-100k figures (its README; 5-fold cross-validation with its own random folds, so
comparable but not the same splits), and per fold its wall and step time.
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
    result = hopperjax.train(config, console=False)
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
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", required=True, help="MovieLens-100k's directory (u1..u5)")
    parser.add_argument("--config", default="configs/ratings_mf.yaml")
    parser.add_argument("--folds", default="1,2,3,4,5")
    parser.add_argument("--out", default="runs/ratings_benchmark")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    try:
        folds = [int(f) for f in args.folds.split(",")]
    except ValueError:
        print(f"ratings_benchmark: --folds: expected integers like 1,2,3, got {args.folds!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.json"
    settings = {"config": args.config, "data": args.data, "overrides": args.overrides}
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
            if (out / f"fold{fold}").exists():
                print(f"fold {fold}: discarding an unfinished run", flush=True)
                shutil.rmtree(out / f"fold{fold}")
            r = done[fold] = {**run_fold(args, fold, out), "settings": settings}
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
    header = (
        f"{args.config} {' '.join(args.overrides)}; {len(runs)} folds on {jax.device_count()} "
        f"{jax.default_backend()} device(s), {host}; RMSE and MAE of the final evaluation"
    )
    print(write_table(runs, header, out / "table.md"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
