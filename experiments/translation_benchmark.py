"""Translation scored like the literature: train, decode with beam search, sacrebleu BLEU and chrF.

    python experiments/translation_benchmark.py [--config configs/multi30k_t5.yaml]
        [--seeds 0] [--test-split test_2016_flickr] [--beams 4] [--length-penalty 0.6]
        [--average N] [--choose curve|validation] [--out runs/translation_benchmark]
        [key=value ...]

Per seed: one ``hopperjax.train`` of the recipe, which scores BLEU on the first
``data.generate_pairs`` validation pairs at every evaluation (``train.generate_every`` is set to
``train.eval_every`` unless given on the command line: the BLEU-against-steps curve), then the
detokenized, case-sensitive sacrebleu BLEU (default 13a tokenization) and chrF on the whole test
split, decoded by beam search, of the checkpoint with the best validation BLEU (every checkpoint
is kept for that: ``train.keep_checkpoints`` is raised to hold them all unless the command line
gives it; the test split never takes part in the choice, as in the DTA benchmark's protocol),
and beside it the BLEU of Moses-tokenized, lowercased text that the Multi30k literature reports
(``hopperjax.scoring.moses_bleu``; added to a kept seed's record from its hypotheses file).
``--average N`` scores the mean parameters of the N kept checkpoints up to the chosen one
(checkpoint averaging, ``hopperjax.restore_params(..., average=N)``; fewer when fewer precede
it, and the table's step cell names them). ``--choose validation`` replaces the curve's choice:
the last checkpoint alone and the mean of the last N are each decoded on the whole validation
split (``data.eval_split``), and the one with the higher sacrebleu BLEU is scored on the test
split (the last alone on a tie); the record keeps both candidates' BLEU. ``train.stop_after``
is refused: a seed is scored once, when its run has finished; stop one with a signal and the
same command resumes it.
Seeds already in ``OUT/results.json`` are kept, and a seed whose run stopped part way resumes
from its newest checkpoint (the trainer's exact resume; its curve and step times come from the
run's ``metrics.jsonl``, every process's).
Writes ``table.md`` (mean +- std over seeds, per seed its training steps' time) and
``bleu.png``. Needs ``pip install 'hopperjax[translate]'`` (SentencePiece, sacrebleu,
sacremoses)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import plotting
from dta_benchmark import cpu_name
from run_records import checkpoint_steps, steps_seconds

import hopperjax
from hopperjax.data import parallel_text as pt
from hopperjax.data.errors import DataError
from hopperjax.infer import restore_params
from hopperjax.scoring import moses_bleu, translation_scores


class SeedStopped(Exception):
    """A seed's training stopped before its last step (SIGTERM, Ctrl-C)."""


def run_seed(args: argparse.Namespace, overrides: list[str], seed: int, out: Path) -> dict:
    run_dir = out / f"seed{seed}"
    # BLEU at every evaluation (the curve) unless the command line says otherwise.
    if not any(o.startswith("train.generate_every=") for o in overrides):
        overrides = [*overrides, "train.generate_every=null"]
    config = hopperjax.load_config(args.config, [*overrides, f"seed={seed}", f"run_dir={run_dir}"])
    if config.train.generate_every is None:
        config = config.replace(**{"train.generate_every": config.train.eval_every})
    if config.train.stop_after is not None:  # it would score a run that has not finished
        raise hopperjax.ConfigError(
            "train.stop_after",
            "the benchmark scores finished runs; stop one with Ctrl-C or SIGTERM instead (the "
            "same command resumes it)",
        )
    if not any(o.startswith("train.keep_checkpoints=") for o in overrides):
        t = config.train  # keep every checkpoint, so that the best-BLEU one is there to score
        config = config.replace(**{"train.keep_checkpoints": t.steps // t.checkpoint_every + 1})
    start = time.perf_counter()
    result = hopperjax.train(config, console="bar")
    reached, resumed_from = int(result.state.step), result.start_step
    del result  # the state is let go before decoding
    train_s = time.perf_counter() - start
    if reached < config.train.steps:  # stopped by a signal: nothing to score yet
        raise SeedStopped(f"seed {seed}: stopped at step {reached} of {config.train.steps}")
    history = _history(run_dir / "metrics.jsonl")
    d = config.data
    tokenizer = pt.Tokenizer.load(run_dir / "spm.model")
    test = pt.read_pairs(
        d.path, args.test_split, d.source_lang, d.target_lang, bad_records=d.bad_records
    )
    curve = [(r["step"], r["eval_bleu"]) for r in history if "eval_bleu" in r]
    steps = checkpoint_steps(run_dir)
    choice = {}
    if args.choose == "validation":
        choice = validation_choice(args, run_dir, steps, tokenizer, d)
        best, average = steps[-1], chosen_average(choice)
    else:
        best = best_step(curve, steps)
        # Averages what there is when fewer than --average checkpoints precede the chosen one
        # (the record's "averaged" says which): a finished run is not thrown away for want of one.
        average = min(args.average, len([s for s in steps if s <= best]))
    restored = restore_params(run_dir, best, average=average)
    decode_start = time.perf_counter()
    hyps = _translate(restored, tokenizer, test.sources, args)
    decode_s = time.perf_counter() - decode_start
    (out / f"seed{seed}.{args.test_split}.hyp").write_text("\n".join(hyps) + "\n")
    evals = [r for r in history if "eval_loss" in r]
    logged = [r for r in history if "step_time_s" in r]
    return {
        "seed": seed,
        "step": best,
        "averaged": list(restored.averaged),
        "choose": args.choose,
        "last_step": steps[-1],
        "val_bleu": dict(curve).get(best),
        # --choose validation: the whole validation split's BLEU per number of checkpoints
        # averaged (1: the last alone); absent for the curve's choice.
        **({"val_split_bleu": {str(n): b for n, b in choice.items()}} if choice else {}),
        "test": {
            **translation_scores(hyps, test.targets),
            "bleu_moses": moses_bleu(hyps, test.targets, d.target_lang),
        },
        "val_loss": evals[-1]["eval_loss"],
        "val_accuracy": evals[-1]["eval_accuracy"],
        "curve": curve,
        "train_s": train_s,
        "resumed_from": resumed_from,
        "steps_s": steps_seconds(logged),
        "decode_s": decode_s,
        "wall_s": time.perf_counter() - start,
        "step_s": float(np.median([r["step_time_s"] for r in logged])),
    }  # fmt: skip


def _save(done: dict[int, dict], results: Path) -> None:
    partial = results.with_suffix(".json.tmp")
    partial.write_text(json.dumps(list(done.values())))
    partial.replace(results)


def _add_moses_bleu(record: dict, args: argparse.Namespace, out: Path) -> bool:
    """Adds the Moses-tokenized, lowercased BLEU to a kept seed's record that predates it,
    scored from the hypotheses the seed wrote; when it cannot (no hypotheses file, or one that
    does not match the test split, or the data gone), says why in one line and adds nothing."""
    hyp = out / f"seed{record.get('seed')}.{args.test_split}.hyp"
    if "test" not in record or "bleu_moses" in record["test"] or not hyp.is_file():
        return False
    try:
        d = hopperjax.load_config(args.config, args.overrides).data
        test = pt.read_pairs(d.path, args.test_split, d.source_lang, d.target_lang)
    except (hopperjax.ConfigError, DataError, OSError) as e:
        print(f"seed {record['seed']}: Moses-tokenized BLEU not added: {e}", file=sys.stderr)
        return False
    text = hyp.read_text(encoding="utf-8")
    hyps = text.removesuffix("\n").split("\n")
    if len(hyps) != len(test.targets):
        print(f"seed {record['seed']}: Moses-tokenized BLEU not added: {hyp} has {len(hyps)} "
              f"lines, {args.test_split} {len(test.targets)} pairs", file=sys.stderr)  # fmt: skip
        return False
    record["test"]["bleu_moses"] = moses_bleu(hyps, test.targets, d.target_lang)
    return True


def _translate(
    restored: Any, tokenizer: pt.Tokenizer, sources: list[str], args: argparse.Namespace
) -> list[str]:
    return restored.workload.translate(
        restored.model, restored.variables, tokenizer, sources, beams=args.beams,
        length_penalty=args.length_penalty,
    )  # fmt: skip


def validation_choice(
    args: argparse.Namespace, run_dir: Path, steps: list[int], tokenizer: pt.Tokenizer, data: Any
) -> dict[int, float]:
    """``--choose validation``: sacrebleu BLEU on the whole validation split of the last
    checkpoint alone (key 1) and of the mean of the last ``--average`` kept ones (fewer when
    fewer are kept; a signal's off-cadence checkpoint counts among them, and the record's
    ``averaged`` lists the steps), decoded as the test split is."""
    val = pt.read_pairs(
        data.path, data.eval_split, data.source_lang, data.target_lang,
        bad_records=data.bad_records,
    )  # fmt: skip
    scores = {}
    for n in sorted({1, min(args.average, len(steps))}):
        restored = restore_params(run_dir, steps[-1], average=n)
        hyps = _translate(restored, tokenizer, val.sources, args)
        scores[n] = translation_scores(hyps, val.targets)["bleu"]
        del restored  # one candidate's parameters at a time
    return scores


def chosen_average(scores: dict[int, float]) -> int:
    """How many checkpoints to average, from ``validation_choice``'s BLEU per count: the highest
    BLEU, the fewest checkpoints among equals (the last one alone on a tie)."""
    return max(scores, key=lambda n: (scores[n], -n))


def best_step(curve: list[tuple[int, float]], checkpoints: list[int]) -> int:
    """The checkpointed step with the highest validation BLEU (the earliest of equals); the
    newest checkpoint when no BLEU step has one."""
    scored = [(bleu, -step) for step, bleu in curve if step in checkpoints]
    return -max(scored)[1] if scored else checkpoints[-1]


def _history(path: Path) -> list[dict]:
    """A run's records over all its processes, in step order: a step logged twice (before a
    stop and again after the resume) keeps its last record."""
    records: dict[tuple[int, bool], dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = json.loads(line)
            records[r["step"], "eval_loss" in r] = r
    return [records[k] for k in sorted(records)]


def write_table(runs: list[dict], header: str, path: Path) -> str:
    bleu = np.array([r["test"]["bleu"] for r in runs])
    chrf = np.array([r["test"]["chrf"] for r in runs])
    lower = np.array([r["test"].get("bleu_lowercase", np.nan) for r in runs])
    moses = np.array([r["test"].get("bleu_moses", np.nan) for r in runs])
    lines = [
        header, "",
        "| model | test BLEU | test chrF | test BLEU, lowercased | test BLEU, Moses-tokenized "
        "lowercased | runs |",
        "|---|---:|---:|---:|---:|---:|",
        f"| hopperjax | {bleu.mean():.2f} ± {bleu.std():.2f} | {chrf.mean():.2f} ± "
        f"{chrf.std():.2f} | {lower.mean():.2f} ± {lower.std():.2f} | {moses.mean():.2f} ± "
        f"{moses.std():.2f} | {len(runs)} |",
        "| Transformer-tiny, text only (Wu et al. 2021, ACL; fairseq BLEU of Moses-tokenized, "
        "lowercased text) | – | – | – | 41.02 | – |",
        "", "| seed | step (chosen) | val BLEU | test BLEU | test chrF | final val loss "
        "| final val token acc | training steps s | decode s | s/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in runs:
        steps_s = r.get("steps_s", r["train_s"])  # results of earlier versions: train_s
        lines.append(
            f"| {r['seed']} | {r['step']} of {r.get('last_step', r['step'])}{_mean_of(r)} | "
            f"{float('nan') if r.get('val_bleu') is None else r['val_bleu']:.2f} | "
            f"{r['test']['bleu']:.2f} | "
            f"{r['test']['chrf']:.2f} | "
            f"{r['val_loss']:.3f} | {r['val_accuracy']:.3f} | {steps_s:.0f} | "
            f"{r['decode_s']:.0f} | {r['step_s']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def _mean_of(record: dict) -> str:
    """The step cell's note when the scored parameters were a mean of checkpoints, and the
    whole validation split's BLEU of each candidate when it chose."""
    averaged = record.get("averaged") or [record["step"]]
    note = f" (mean of {', '.join(map(str, averaged))})" if len(averaged) > 1 else ""
    if choice := record.get("val_split_bleu"):
        cells = ", ".join(
            f"{'last' if n == '1' else f'last {n} averaged'} {b:.2f}" for n, b in choice.items()
        )
        note += f"; whole val BLEU: {cells}"
    return note


def plot(runs: list[dict], path: Path) -> None:
    plt = plotting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        steps, bleu = zip(*r["curve"], strict=True)
        ax.plot(steps, bleu, marker=".", label=f"seed {r['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation BLEU (data.generate_pairs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="configs/multi30k_t5.yaml")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--test-split", default="test_2016_flickr")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--length-penalty", type=float, default=0.6)
    parser.add_argument(
        "--average", type=int, default=1, metavar="N",
        help="score the mean parameters of the N kept checkpoints up to the chosen one "
        "(checkpoint averaging; 1: the chosen checkpoint's own)",
    )  # fmt: skip
    parser.add_argument(
        "--choose", choices=("curve", "validation"), default="curve",
        help="curve: the checkpoint of the best validation BLEU on data.generate_pairs pairs; "
        "validation: the last checkpoint or the mean of the last --average, by BLEU on the "
        "whole validation split",
    )  # fmt: skip
    parser.add_argument("--out", default="runs/translation_benchmark")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_intermixed_args(argv)
    if args.average < 1:
        parser.error(f"--average: expected a positive number of checkpoints, got {args.average}")
    if args.choose == "validation" and args.average < 2:
        parser.error("--choose validation: compares the last checkpoint with the mean of the last "
                     "--average N; give N >= 2")  # fmt: skip
    if importlib.util.find_spec("sacremoses") is None:  # before hours of training, not after
        print("translation_benchmark: scoring needs sacremoses (pip install "
              "'hopperjax[translate]')", file=sys.stderr)  # fmt: skip
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    results = out / "results.json"
    done = {r["seed"]: r for r in json.loads(results.read_text())} if results.exists() else {}
    for seed in seeds:
        if seed in done:
            print(f"seed {seed}: kept from {results}", flush=True)
            rule = done[seed].get("choose", "curve")  # records before the option: the curve's
            if rule != args.choose:
                print(f"seed {seed}: its record was chosen by --choose {rule}, not "
                      f"{args.choose}; delete it from {results} to score it again",
                      flush=True)  # fmt: skip
            if _add_moses_bleu(done[seed], args, out):
                _save(done, results)
            continue
        if steps := checkpoint_steps(out / f"seed{seed}"):
            print(f"seed {seed}: resuming an unfinished run from step {steps[-1]}", flush=True)
        elif (out / f"seed{seed}").exists():
            print(f"seed {seed}: discarding an unfinished run (no checkpoint)", flush=True)
            shutil.rmtree(out / f"seed{seed}")
        try:
            r = done[seed] = run_seed(args, args.overrides, seed, out)
        except hopperjax.ConfigError as e:
            print(f"translation_benchmark: {e}", file=sys.stderr)
            return 2
        except SeedStopped as e:
            print(f"{e}; the same command resumes it from its checkpoint", flush=True)
            return 0  # as the train command after a signal: stopped cleanly
        test = r["test"]
        print(f"seed {seed}: test BLEU {test['bleu']:.2f} chrF {test['chrf']:.2f}; "
              f"{r['train_s']:.0f} s training, {r['decode_s']:.0f} s decoding",
              flush=True)  # fmt: skip
        _save(done, results)
    runs = [done[s] for s in seeds]
    host = cpu_name() if jax.default_backend() == "cpu" else jax.devices()[0].device_kind
    header = (
        f"{args.config} {' '.join(args.overrides)}; {len(runs)} runs on {jax.device_count()} "
        f"{jax.default_backend()} device(s), {host}; {args.test_split}, beams {args.beams}, "
        f"length penalty {args.length_penalty}; sacrebleu detokenized, case-sensitive (13a)"
    )
    print(write_table(runs, header, out / "table.md"))
    plot(runs, out / "bleu.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
