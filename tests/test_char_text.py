"""Character-level text (nanoGPT's Tiny Shakespeare recipe): vocabulary, split, random-window
sampler, the recipe's schedule, eval at step 0, the saved vocabulary and the sampler CLI.

Every test writes its own small text; none reads shared data.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import REPO

import hopperjax
from hopperjax import sample
from hopperjax.data import ProcessShard, text
from hopperjax.optim import build_schedule
from hopperjax.workloads.lm import LanguageModeling

RECIPE = REPO / "configs" / "shakespeare_char_cpu.yaml"
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n" * 60
# No window of 65 characters repeats in this one, so a window tells its offset.
_ALPHABET = np.array(list("\n !,.:;?abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"))
RANDOM_TEXT = "".join(np.random.default_rng(0).choice(_ALPHABET, 20_000))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "input.txt"
    path.write_text(TEXT)
    return path


def test_vocabulary_is_the_sorted_distinct_characters_and_round_trips():
    vocab = text.CharVocabulary.of(TEXT)
    assert vocab.chars == "".join(sorted(set(TEXT)))
    assert vocab.chars[0] == "\n" and len(vocab) == len(set(TEXT))
    ids = vocab.encode(TEXT)
    assert ids.dtype == np.uint16 and ids.max() == len(vocab) - 1
    assert vocab.decode(ids) == TEXT
    assert [vocab.chars[i] for i in ids[:5]] == list("First")
    with pytest.raises(ValueError, match=r"prompt: character 'Z' at 3 is not in the vocabulary"):
        vocab.encode("speZ", where="prompt")
    unicode = text.CharVocabulary.of("naïve café ☕")
    assert unicode.decode(unicode.encode("café ☕")) == "café ☕"


def _config(corpus, tmp_path, *overrides):
    return hopperjax.load_config(
        RECIPE,
        [f"data.path={corpus}", f"run_dir={tmp_path / 'run'}", "model.vocab_size=65", *overrides],
    )


def test_split_sizes_and_random_windows(tmp_path):
    corpus = tmp_path / "random.txt"
    corpus.write_text(RANDOM_TEXT)
    config = _config(corpus, tmp_path)
    n = len(RANDOM_TEXT)
    split = int(n * 0.9)  # nanoGPT: first 90 % train, last 10 % validation, no shuffling
    datasets = LanguageModeling(config).build_datasets(ProcessShard(0, 1))
    vocab = text.CharVocabulary(datasets.meta.chars)
    assert datasets.meta.vocab_size == len(vocab) == len(set(RANDOM_TEXT))
    ids = vocab.encode(RANDOM_TEXT)
    where = {ids[s : s + 65].tobytes(): s for s in range(n - 64)}  # window -> its offset

    offsets = []
    batches = iter(datasets.train)
    for _ in range(30):
        batch = next(batches)
        assert batch["inputs"].shape == batch["targets"].shape == (12, 64)
        assert batch["inputs"].dtype == np.int32
        # Targets are the inputs shifted by one.
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
        for row_in, row_target in zip(batch["inputs"], batch["targets"], strict=True):
            window = np.r_[row_in, row_target[-1]].astype(ids.dtype)
            offsets.append(where[window.tobytes()])
    # Every training window lies inside the training split; offsets spread over all of it.
    offsets = np.array(offsets)
    assert offsets.max() + 65 <= split
    assert offsets.min() < split * 0.1 and offsets.max() > split * 0.9

    sampler = text.RandomWindows(ids, 0, split, 64, seed=0)
    drawn = np.array([sampler.offset(i) for i in range(4000)])
    assert drawn.min() >= 0 and drawn.max() <= split - 65
    assert len(np.unique(drawn)) < 4000  # with replacement: repeats occur
    # A pure function of (seed, index): workers and resumed iterators draw the same windows.
    again = text.RandomWindows(ids, 0, split, 64, seed=0)
    assert [again.offset(i) for i in range(50)] == drawn[:50].tolist()

    # Evaluation: train.eval_batches random batches of the validation split, the same each time.
    evals = [list(datasets.eval), list(datasets.eval)]
    assert len(evals[0]) == 20
    for a, b in zip(*evals, strict=True):
        np.testing.assert_array_equal(a["inputs"], b["inputs"])
    for batch in evals[0]:
        for row_in, row_target in zip(batch["inputs"], batch["targets"], strict=True):
            window = np.r_[row_in, row_target[-1]].astype(ids.dtype)
            assert where[window.tobytes()] >= split


def test_random_sampling_needs_eval_batches_and_a_file(corpus, tmp_path):
    with pytest.raises(hopperjax.ConfigError, match=r"train\.eval_batches: required"):
        _config(corpus, tmp_path, "train.eval_batches=null")
    with pytest.raises(hopperjax.ConfigError, match=r"data.path: not found: .*nope.txt"):
        _config(tmp_path / "nope.txt", tmp_path)
    with pytest.raises(hopperjax.ConfigError) as e:
        _config(tmp_path, tmp_path)
    assert str(e.value) == f"data.path: a directory, not a text file: {tmp_path}"
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1") * 100)
    bad = _config(tmp_path / "latin1.txt", tmp_path)
    with pytest.raises(hopperjax.ConfigError, match=r"latin1.txt: not UTF-8 at byte 3"):
        LanguageModeling(bad).build_datasets(ProcessShard(0, 1))


def test_the_recipe_schedule():
    """lr = 1e-3 (step + 1) / 101 for 100 warmup steps, then cosine from 1e-3 to 1e-4 at 2,000."""
    config = hopperjax.load_config(RECIPE, ["data.path=null", "data.source=embedded"])
    schedule = build_schedule(config.optim, total_steps=2000, global_batch_size=12)
    for step, want in [
        (0, 1e-3 / 101),
        (99, 1e-3 * 100 / 101),
        (100, 1e-3),
        (1050, 1e-4 + 0.5 * 0.9e-3),
        (2000, 1e-4),
    ]:
        assert float(schedule(step)) == pytest.approx(want, rel=1e-5), step


def test_a_short_run_logs_step_zero_saves_the_vocabulary_and_samples(corpus, tmp_path, capsys):
    config = _config(
        corpus,
        tmp_path,
        "train.steps=20",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.log_every=5",
        "train.sync_every_step=true",
        "train.checkpoint_every=10",
        "optim.warmup_steps=2",
        "model.n_layers=1",
    )
    result = hopperjax.train(config, devices=jax.devices()[:1], console=False)  # mesh.data: 1
    evals = [(r["step"], r["eval_loss"]) for r in result.history if "eval_loss" in r]
    assert [s for s, _ in evals] == [0, 10, 20]
    # Step 0 is the untrained model: about ln(65), the uniform guess; training lowers it.
    assert evals[0][1] == pytest.approx(np.log(65), abs=0.15)
    assert evals[-1][1] < evals[0][1] - 0.3
    # Every step waited for and timed on its own: one time per step, about the window's mean.
    train = [r for r in result.history if "loss" in r]
    assert [len(r["step_times_s"]) for r in train] == [5, 5, 5, 5]
    for r in train[1:]:
        assert np.mean(r["step_times_s"]) == pytest.approx(r["step_time_s"], rel=0.5)
    saved = json.loads((result.run_dir / "vocab.json").read_text())["chars"]
    assert saved == "".join(sorted(set(TEXT)))

    assert sample.main(["--run-dir", str(result.run_dir), "--tokens", "40", "--prompt", "All"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("All") and len(out.rstrip("\n")) >= 40 + 3 - out.count("\n")
    assert set(out) <= set(TEXT) | {"\n"}  # decoded with the run's own vocabulary
    assert sample.main(["--run-dir", str(result.run_dir), "--prompt", "Zebra"]) == 2
    assert "--prompt: character 'Z' at 0" in capsys.readouterr().err
    assert sample.main(["--run-dir", str(tmp_path / "nothing")]) == 2
    assert "not a hopperjax run" in capsys.readouterr().err

    # The checkpoints' ids mean the saved vocabulary's characters: a text with another vocabulary
    # cannot resume them (the LM workload checks this when it writes vocab.json).
    other = tmp_path / "other.txt"
    other.write_text(TEXT + "Zebra\n")
    with pytest.raises(hopperjax.ConfigError, match="differs from the one") as info:
        hopperjax.train(
            config.replace(**{"data.path": str(other), "train.steps": config.train.steps + 5}),
            devices=jax.devices()[:1],
            console=False,
        )
    assert info.value.key == "data.path"
    assert json.loads((result.run_dir / "vocab.json").read_text())["chars"] == saved
