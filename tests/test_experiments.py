"""The experiment scripts' own bookkeeping (their training runs are covered elsewhere)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from conftest import EXPERIMENTS, load_script


def fake_run(fold: int, mse: float) -> dict:
    scores = {"mse": mse, "ci": 0.88, "rm2": 0.63, "pearson": 0.83}
    return {
        "fold": fold,
        "best_step": 100,
        "valid": scores,
        "test": scores,
        "train_s": 1.0,
        "step_s": 0.5,
        "wall_s": 3.0,
        "valid_curve": [[100, mse]],
        "measured": [5.0, 6.0, 7.0],
        "predicted": [5.1, 6.2, 6.9],
    }


def test_dta_benchmark_keeps_finished_folds_and_resumes_unfinished(tmp_path, monkeypatch, capsys):
    """A fold in results.json is kept; a fold directory with a checkpoint is resumed (run_fold
    finds it in place), one without is discarded."""
    benchmark = load_script("dta_benchmark")
    (tmp_path / "results.json").write_text(json.dumps([fake_run(0, 0.25)]))
    (tmp_path / "fold1" / "checkpoints").mkdir(parents=True)  # interrupted before a checkpoint
    (tmp_path / "fold1" / "checkpoints" / "stale").write_text("x")
    (tmp_path / "fold2" / "checkpoints" / "800").mkdir(parents=True)  # interrupted after one
    trained = []

    def run_fold(config_path, overrides, fold, out, select, seed=None):
        resumed = (out / f"fold{fold}" / "checkpoints" / "800").is_dir()
        assert resumed == (fold == 2), "only a fold with a checkpoint is resumed"
        assert fold == 2 or not (out / f"fold{fold}").exists()
        trained.append(fold)
        return {**fake_run(fold, 0.27), "resumed_from": 800 if resumed else 0, "steps_s": 40.0}

    monkeypatch.setattr(benchmark, "run_fold", run_fold)
    monkeypatch.setattr(benchmark, "dataset_shape", lambda config, overrides: (68, 442, 30_056))
    assert benchmark.main(["--data", "unused", "--folds", "0,1,2", "--out", str(tmp_path)]) == 0

    assert trained == [1, 2]
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [r["fold"] for r in runs] == [0, 1, 2]
    assert not (tmp_path / "results.json.tmp").exists()
    table = (tmp_path / "table.md").read_text()
    assert "hopperjax (3 runs) | 0.263 ± 0.009" in table
    assert "dataset: Davis (68 drugs, 442 proteins, 30,056 pairs)" in table
    assert "| 1 | 100 | 0.270 | 0.270 | 0.880 | 0.630 | 1 | 3 | 0.500 |" in table
    assert "| 2 (resumed at step 800) | 100 | 0.270 |" in table
    assert table.rstrip().endswith(
        "all its processes took (log windows' step times x steps): fold 2 40 s."
    )
    out = capsys.readouterr().out
    assert "fold 0: kept" in out and "fold 1: discarding an unfinished run (no checkpoint)" in out
    assert "fold 2: resuming an unfinished run from step 800" in out

    # A fold stopped by a signal (SIGTERM, Ctrl-C): one line, the finished folds kept.
    def stopped(config_path, overrides, fold, out, select, seed=None):
        raise benchmark.FoldStopped(f"fold {fold}: stopped at step 1 of 8000")

    monkeypatch.setattr(benchmark, "run_fold", stopped)
    assert benchmark.main(["--data", "unused", "--folds", "0,3", "--out", str(tmp_path)]) == 0
    assert "fold 3: stopped at step 1 of 8000; the same command goes on" in capsys.readouterr().out
    assert [r["fold"] for r in json.loads((tmp_path / "results.json").read_text())] == [0, 1, 2]

    # Fold 1 recorded its recipe (fold 0 predates the record and is kept as it is): another
    # recipe in the same --out is one line naming both, not a table mixing the two.
    assert json.loads((tmp_path / "results.json").read_text())[1]["overrides"] == [
        "data.path=unused"
    ]
    capsys.readouterr()
    argv = ["--data", "unused", "--folds", "0,1", "--out", str(tmp_path), "data.rank_weight=1"]
    assert benchmark.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "fold 1 ran --config configs/dta_davis.yaml" in err
    assert "data.rank_weight=1 --select valid_mse; give this recipe another --out" in err
    assert benchmark.main([*argv[:-1], "--select", "last"]) == 2  # so is another selection
    assert "data.path=unused --select last; give" in capsys.readouterr().err

    evals = [{"step": s, "eval_mse": m} for s, m in ((400, 0.3), (800, 0.2), (1200, 0.25))]
    assert benchmark.chosen_eval(evals, "valid_mse")["step"] == 800
    assert benchmark.chosen_eval(evals, "last")["step"] == 1200


def test_dta_benchmark_all_folds_runs_one_per_seed_and_scores_the_last_step(
    tmp_path, monkeypatch, capsys
):
    """--folds all: GraphDTA's protocol (every training fold trained on), one run per seed, the
    last step scored; no validation to select on, so --select valid_mse and --seeds without it
    are refused in one line."""
    benchmark = load_script("dta_benchmark")
    calls = []

    def run_fold(config_path, overrides, fold, out, select, seed=None):
        calls.append((fold, seed, select))
        if fold != "all":
            return fake_run(fold, 0.3)
        return {**fake_run(fold, 0.20 + 0.01 * seed), "seed": seed, "valid": None}

    monkeypatch.setattr(benchmark, "run_fold", run_fold)
    monkeypatch.setattr(benchmark, "dataset_shape", lambda config, overrides: (68, 442, 30_056))
    argv = ["--data", "unused", "--folds", "all", "--seeds", "0,1", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    assert calls == [("all", 0, "last"), ("all", 1, "last")]
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [(r["fold"], r["seed"], r["select"]) for r in runs] == [
        ("all", 0, "last"),
        ("all", 1, "last"),
    ]
    table = (tmp_path / "table.md").read_text()
    assert "--folds all (every training fold), --select last; 2 runs" in table
    assert "hopperjax (2 runs) | 0.205 ± 0.005" in table
    assert "| all folds, seed 1 | 100 | – | 0.210 |" in table
    assert "all folds, seed 1: step scored 100, test MSE 0.2100" in capsys.readouterr().out
    # Kept on the next call (a third seed runs); a numbered fold in the same --out is another
    # run, scored on validation as before.
    assert benchmark.main([*argv[:5], "0,1,2", *argv[6:]]) == 0
    assert calls[2:] == [("all", 2, "last")]
    assert "all folds, seed 0: kept" in capsys.readouterr().out
    assert benchmark.main(["--data", "unused", "--folds", "0", "--out", str(tmp_path)]) == 0
    assert calls[3:] == [(0, None, "valid_mse")]
    runs = json.loads((tmp_path / "results.json").read_text())
    assert [(r["fold"], r.get("seed")) for r in runs] == [
        (0, None),
        *[("all", s) for s in range(3)],
    ]

    for extra, message in (
        (["--select", "valid_mse"], "--select valid_mse: --folds all trains on every fold"),
        (["--folds", "0", "--seeds", "1"], "--seeds: only with --folds all"),
        (["--folds", "0,x"], "--folds '0,x': expected comma-separated integers (or all)"),
        (["--seeds", ""], "--seeds '': expected comma-separated integers"),
        (["--seeds", "0,0"], "--folds all --seeds 0,0: a run named twice would count twice"),
        (["seed=5"], "seed=5: the benchmark sets seed for each run; use --seeds"),
        (["data.valid_fold=1"], "data.valid_fold=1: the benchmark sets data.valid_fold for each"),
    ):
        base = ["--data", "unused", "--out", str(tmp_path / "refused")]
        if "--folds" not in extra:
            base += ["--folds", "all"]
        assert benchmark.main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(message), err
    # A config the data or keys refuse (here: no such directory): its one line, no traceback.
    monkeypatch.undo()
    benchmark = load_script("dta_benchmark")
    missing = tmp_path / "missing"
    argv = ["--data", str(missing), "--folds", "0", "--out", str(tmp_path / "cfg")]
    assert benchmark.main(argv) == 2
    assert capsys.readouterr().err.strip() == f"data.path: not found: {missing}"


def test_dta_benchmark_table_lists_the_published_numbers_of_its_dataset_only(tmp_path):
    benchmark = load_script("dta_benchmark")
    run = [fake_run(0, 0.25)]
    davis = benchmark.write_table(
        run, "h", tmp_path / "t.md", benchmark.published_for((68, 442, 30_056))
    )
    assert "| DeepDTA (CNN/CNN) (published, Davis) | 0.261 | 0.878 | 0.630 |" in davis
    assert "KIBA" not in davis
    kiba = benchmark.published_for((2_111, 229, 118_254))
    text = benchmark.write_table(run, "h", tmp_path / "t.md", kiba)
    assert "| DeepDTA (CNN/CNN) (published, KIBA) | 0.194 | 0.863 | 0.673 |" in text
    assert "Davis" not in text and "0.261" not in text
    other = benchmark.write_table(run, "h", tmp_path / "t.md", benchmark.published_for((8, 8, 400)))
    assert "(published" not in other and "no published figures" in other


def test_attention_bench_times_each_kernel_and_checks_it_against_xla(capsys):
    spec = importlib.util.spec_from_file_location(
        "attention_bench", EXPERIMENTS.parent / "tools" / "attention_bench.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--shape", "2,8,2,4", "--repeats", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shape"] == [2, 8, 2, 4] and report["causal"] is True
    assert report["ms"]["auto"] > 0 and report["ms"]["xla"] > 0
    assert report["rel_err_vs_xla"]["auto"] < 2e-5  # the CPU path agrees with XLA's
    # No GPU here: cudnn is reported as skipped with the config error's reason, not timed.
    assert "cudnn" not in report["ms"] and "NVIDIA GPU" in report["skipped"]["cudnn"]


def test_ratings_benchmark_runs_movielens_folds_and_keeps_finished_ones(tmp_path, capsys):
    import numpy as np

    benchmark = load_script("ratings_benchmark")
    data = tmp_path / "ml-100k"
    data.mkdir()
    rng = np.random.default_rng(0)
    for fold in (1, 2):
        for split, n in (("base", 300), ("test", 60)):
            lines = [f"{rng.integers(1, 20)}\t{rng.integers(1, 30)}\t{rng.integers(1, 6)}\t0"
                     for _ in range(n)]  # fmt: skip
            (data / f"u{fold}.{split}").write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    tiny = ["model.table_sizes=20,30", "model.embed_dim=4", "train.steps=4", "train.batch_size=32",
            "train.eval_every=4", "train.log_every=2", "train.checkpoint_every=4"]  # fmt: skip
    argv = ["--data", str(data), "--folds", "1,2", "--out", str(out), *tiny]
    assert benchmark.main(argv) == 0
    table = (out / "table.md").read_text()
    assert "| hopperjax |" in table and "| SVD (Surprise), published | 0.934 | 0.737 | 5 |" in table
    runs = json.loads((out / "results.json").read_text())
    assert [r["fold"] for r in runs] == [1, 2] and all(r["ratings"] == 60 for r in runs)
    capsys.readouterr()
    assert benchmark.main(argv) == 0
    assert capsys.readouterr().out.count("kept from") == 2
    assert benchmark.main(["--data", str(tmp_path / "nowhere"), "--out", str(out / "x")]) == 2
    assert benchmark.main([*argv, "model.embed_dim=8"]) == 2  # other settings, same --out
    assert benchmark.main([*argv[:2], "--folds", "a", "--out", str(out)]) == 2


def test_ratings_benchmark_on_generated_ratings_scales_steps_and_reports_the_floor(tmp_path):
    benchmark = load_script("ratings_benchmark")
    out = tmp_path / "out"
    tiny = ["model.table_sizes=20,30", "model.embed_dim=4", "train.steps=8", "train.batch_size=32",
            "train.log_every=2"]  # fmt: skip
    argv = ["--synthetic", "5000,10000", "--noise", "0.5", "--out", str(out), *tiny]
    assert benchmark.main(argv) == 0
    runs = json.loads((out / "results.json").read_text())
    # The recipe's 8 steps are set for 80,000 ratings: 10,000 get 1 (5,000: at least 1); a
    # quarter as many ratings are held out.
    expected = [(5000, 1, 1250), (10000, 1, 2500)]
    assert [(r["rows"], r["steps"], r["ratings"]) for r in runs] == expected
    table = (out / "table.md").read_text()
    assert "| 10,000 | 1 |" in table and "| 0.50 |" in table


def test_translation_benchmark_resumes_a_stopped_seed_from_its_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """A seed whose run stopped part way resumes from its checkpoint instead of starting again;
    its curve and step times cover both processes."""
    import numpy as np

    import hopperjax

    benchmark = load_script("translation_benchmark")
    rng = np.random.default_rng(0)
    words = ["ein", "hund", "eine", "katze", "rennt", "schlaeft", "im", "park", "haus", "rot"]
    english = ["a", "dog", "a", "cat", "runs", "sleeps", "in", "park", "house", "red"]
    data = tmp_path / "data"
    data.mkdir()
    for split, n in (("train", 300), ("val", 40), ("test_2016_flickr", 20)):
        rows = [rng.integers(0, len(words), rng.integers(3, 7)) for _ in range(n)]
        (data / f"{split}.en").write_text("\n".join(" ".join(english[i] for i in r) for r in rows))
        (data / f"{split}.de").write_text("\n".join(" ".join(words[i] for i in r) for r in rows))
    out = tmp_path / "out"
    tiny = [f"data.path={data}", "model.vocab_size=40", "model.d_model=32", "model.n_heads=2",
            "model.encoder_layers=1", "model.decoder_layers=1", "model.mlp_dim=64",
            "data.source_len=16", "data.target_len=16", "data.generate_pairs=8", "data.beams=1",
            "train.steps=4", "train.batch_size=8", "train.eval_batch_size=8",
            "train.eval_every=2", "train.log_every=1", "train.checkpoint_every=2",
            "optim.warmup_steps=1"]  # fmt: skip
    recipe = str(EXPERIMENTS.parent / "configs" / "multi30k_t5.yaml")
    argv = ["--config", recipe, "--seeds", "0", "--beams", "1", "--out", str(out), *tiny]
    # A signal part way (here: a stop after step 2) stops the benchmark cleanly, nothing scored.
    train = hopperjax.train
    monkeypatch.setattr(
        benchmark.hopperjax, "train",
        lambda config, console: train(config.replace(**{"train.stop_after": 2}), console=False),
    )  # fmt: skip
    assert benchmark.main(argv) == 0
    assert "seed 0: stopped at step 2 of 4; the same command resumes" in capsys.readouterr().out
    assert not (out / "results.json").exists()
    monkeypatch.setattr(benchmark.hopperjax, "train", train)
    assert benchmark.main(argv) == 0
    assert "resuming an unfinished run from step 2" in capsys.readouterr().out
    (run,) = json.loads((out / "results.json").read_text())
    assert run["last_step"] == 4 and run["resumed_from"] == 2
    assert [step for step, _ in run["curve"]] == [2, 4]  # step 2's BLEU from the first process
    # Scored at the checkpoint of the best validation BLEU (both kept), the earlier of equals.
    assert run["step"] == benchmark.best_step(run["curve"], [2, 4])
    assert run["val_bleu"] == dict(run["curve"])[run["step"]]
    assert benchmark.best_step([(2, 30.0), (4, 31.0), (6, 31.0)], [2, 4, 6]) == 4
    assert benchmark.best_step([(2, 30.0), (4, 31.0)], [2, 6]) == 2  # step 4 not checkpointed
    assert benchmark.best_step([], [2, 6]) == 6
    assert run["steps_s"] > 0 and "training steps s" in (out / "table.md").read_text()
    # The literature's Moses-tokenized, lowercased BLEU beside sacrebleu's; a kept seed's record
    # that predates it gets it from the hypotheses file the seed wrote.
    assert 0.0 <= run["test"]["bleu_moses"] <= 100.0
    assert "Moses-tokenized lowercased" in (out / "table.md").read_text()
    scored = run["test"].pop("bleu_moses")
    (out / "results.json").write_text(json.dumps([run]))
    assert benchmark.main(argv) == 0
    assert "seed 0: kept from" in capsys.readouterr().out
    assert run["averaged"] == [run["step"]]
    (kept,) = json.loads((out / "results.json").read_text())
    assert kept["test"]["bleu_moses"] == scored
    # --choose validation: the whole validation split's BLEU of the last checkpoint and of the
    # mean of the last two (40 pairs: after 4 steps both may well score 0, so the choice is
    # given here, and the rule is checked below on its own).
    with pytest.raises(SystemExit) as refused:  # nothing to compare the last checkpoint with
        benchmark.main([*argv, "--choose", "validation"])
    assert refused.value.code == 2 and "--choose validation" in capsys.readouterr().err
    (out / "results.json").unlink()
    real = benchmark.validation_choice
    asked = []

    def given(args, run_dir, steps, tokenizer, data):
        asked.append(real(args, run_dir, steps, tokenizer, data))  # it decodes both
        return {1: 10.0, 2: 12.0}

    monkeypatch.setattr(benchmark, "validation_choice", given)
    assert benchmark.main([*argv, "--choose", "validation", "--average", "2"]) == 0
    assert sorted(asked[0]) == [1, 2]
    (chosen,) = json.loads((out / "results.json").read_text())
    assert chosen["val_split_bleu"] == {"1": 10.0, "2": 12.0} and chosen["choose"] == "validation"
    assert chosen["step"] == 4 and chosen["averaged"] == [2, 4]
    assert "whole val BLEU: last 10.00, last 2 averaged 12.00" in (out / "table.md").read_text()
    capsys.readouterr()
    assert benchmark.main(argv) == 0  # the curve's rule asked of a record chosen otherwise
    assert "chosen by --choose validation, not curve" in capsys.readouterr().out
    assert benchmark.chosen_average({1: 30.0, 2: 31.0}) == 2
    assert benchmark.chosen_average({1: 31.0, 3: 30.0}) == 1
    assert benchmark.chosen_average({1: 30.0, 3: 30.0}) == 1  # a tie: the last one alone
    assert benchmark.chosen_average({1: 30.0}) == 1
    # Refused in one line before any training: a scored run must have finished, and --average.
    stop = [*argv[:3], "1", *argv[4:], "train.stop_after=2"]
    assert benchmark.main(stop) == 2
    assert "train.stop_after" in capsys.readouterr().err and not (out / "seed1").exists()
    with pytest.raises(SystemExit) as info:
        benchmark.main([*argv, "--average", "0"])
    assert info.value.code == 2 and "--average" in capsys.readouterr().err
    # Checkpoint averaging: the mean of the kept checkpoints up to the chosen one (BLEU only at
    # step 4 here, so that one), named in the table; asked for more than there are (3 of 2):
    # the mean of what there is.
    only_last = [*argv[:3], "2", *argv[4:], "train.generate_every=4"]
    assert benchmark.main([*only_last, "--average", "3"]) == 0
    assert json.loads((out / "results.json").read_text())[-1]["averaged"] == [2, 4]
    assert "| 2 | 4 of 4 (mean of 2, 4) |" in (out / "table.md").read_text()


def test_quantize_compare_tables_each_scheme_against_the_float_model(tmp_path):
    import hopperjax
    from hopperjax import workloads

    benchmark = load_script("quantize_compare")
    run = tmp_path / "run"
    config = hopperjax.load_config(
        None, ["workload=lm", *workloads.get("lm").smoke_overrides, "train.steps=2",
               f"run_dir={run}"],
    )  # fmt: skip
    hopperjax.train(config, console=False)
    out = tmp_path / "out"
    argv = ["--run-dir", str(run), "--calibration-batches", "2", "--latency-repeats", "2",
            "--out", str(out)]  # fmt: skip
    assert benchmark.main(argv) == 0
    (result,) = json.loads((out / "results.json").read_text())
    assert [r["scheme"] for r in result["rows"]] == ["float", "weight", "w8a8", "w8a8_static"]
    floats, *quantized = result["rows"]
    assert all(r["param_bytes"] < floats["param_bytes"] for r in quantized)
    for row in quantized:  # a 2-step model: perplexity within 1 % of the float model's
        change = row["metrics"]["eval_perplexity"] / floats["metrics"]["eval_perplexity"] - 1
        assert abs(change) < 0.01, (row["scheme"], change)
    table = (out / "table.md").read_text()
    assert "| w8a8_static |" in table and "perplexity" in table
    assert benchmark.main([*argv[:2], "--schemes", "int4", "--out", str(out)]) == 2


def test_compression_compare_tables_each_variant(tmp_path, capsys):
    compare = load_script("compression_compare")
    out = tmp_path / "cc"
    tiny = ["mesh.data=8", "train.steps=4", "train.eval_every=2", "train.eval_batches=1"]
    tiny += ["train.log_every=1", "model.n_layers=1", "model.d_model=32", "model.n_heads=2"]
    config = str(Path(__file__).parent.parent / "configs" / "quickstart.yaml")
    assert compare.main(["--config", config, *tiny, "--variants", "none,int8-noef", "--out",
                         str(out)]) == 0  # fmt: skip
    rows = (out / "table.md").read_text().splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "int8-noef"]
    assert "all-to-all s8" in rows[1] and "all-reduce f32" in rows[0]
    ratio = float(rows[1].split("|")[5])
    assert 0.15 < ratio < 0.3
    with pytest.raises(SystemExit, match="unknown variant"):
        compare.main(["--config", config, "--variants", "int4"])


def test_literature_text_is_lowercased_moses_tokens_that_score_like_the_raw_text(tmp_path, capsys):
    import gzip

    from hopperjax.scoring import moses_tokenize

    script = load_script("multi30k_literature_text")
    raw = tmp_path / "raw"
    raw.mkdir()
    de = ['Ein Mann, der "Hallo" sagt.', "Zwei Hunde spielen im Schnee & Eis.", "Der Hut."]
    (raw / "train.en").write_text(
        'A man saying "hello".\nTwo dogs play in snow & ice.\nA woman\'s hat.\n'
    )
    (raw / "train.de").write_text("\n".join(de) + "\n")
    with gzip.open(raw / "val.de.gz", "wt") as f:
        f.write("Ein Kind läuft.\n")
    (raw / "val.en").write_text("A child runs.\n")
    for stray in ("PREPARED.json", "spm.model", "train.tsv", "notes.txt", "train.de.bak"):
        (raw / stray).write_text("x\n")
    out = tmp_path / "lctok"
    assert script.main(["--from", str(raw), "--to", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [
        "train.de.gz", "train.en.gz", "val.de.gz", "val.en.gz",
    ]  # fmt: skip

    def read(name):
        return gzip.decompress((out / name).read_bytes()).decode().splitlines()

    got = read("train.de.gz")
    assert got == [
        'ein mann , der " hallo " sagt .',
        "zwei hunde spielen im schnee & eis .",
        "der hut .",
    ]
    assert read("train.en.gz") == [
        'a man saying " hello . "',  # English rules move the full stop inside the quotes
        "two dogs play in snow & ice .",
        "a woman 's hat .",
    ]  # fmt: skip
    assert moses_tokenize(got, "de") == moses_tokenize(de, "de")  # scored exactly as the raw text
    report = capsys.readouterr().out
    assert "val.de.gz: 1 line, 4 tokens;" in report
    assert "train.de.gz: 3 lines, 20 tokens; scored again: the same as the raw text's" in report
    assert "train.en.gz: 3 lines, 20 tokens; scored again: 1 line differs" in report  # "'s" again
    # User errors are one line, exit 2, and leave nothing behind.
    assert script.main(["--from", str(raw), "--to", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    (raw / "val.en").write_text("A child runs.\nExtra line.\n")
    assert script.main(["--from", str(raw), "--to", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "val" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lctok", "raw"]
