"""Parallel text (the translation workload's data): aligned files and TSV read the same pairs, bad
records are one-line errors naming file and line, a joint SentencePiece vocabulary round-trips
text, and packing keeps every example whole, alone in its segment and in order."""

import dataclasses
import gzip

import numpy as np
import pytest

from hopperjax.data import parallel_text as pt
from hopperjax.data.errors import DataError

EN = ["A man rides a horse.", "Two dogs play in the snow.", "A girl reads a book.", "Hi."]
DE = ["Ein Mann reitet ein Pferd.", "Zwei Hunde spielen im Schnee.", "Ein Mädchen liest.", "Hallo."]


def _write(path, lines, *, compress=False):
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if compress else data)


def test_aligned_files_and_tsv_read_the_same_pairs(tmp_path):
    _write(tmp_path / "train.en.gz", EN, compress=True)
    _write(tmp_path / "train.de.gz", DE, compress=True)
    _write(tmp_path / "val.tsv", [f"{e}\t{d}" for e, d in zip(EN, DE, strict=True)])
    files = pt.read_pairs(tmp_path, "train", "en", "de")
    tsv = pt.read_pairs(tmp_path, "val", "en", "de")
    assert files.sources == tsv.sources == EN and files.targets == tsv.targets == DE
    assert len(files) == 4 and files.skipped == 0


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("misaligned", r"train\.en: 4 lines, .*train\.de: 3 lines; line i of one must translate"),
        ("latin1", r"train\.de:2: not UTF-8 text"),
        ("empty_sentence", r"train\.de:3: empty sentence"),
        ("tsv_fields", r"train\.tsv:2: expected 2 tab-separated fields, got 3"),
        ("missing", r"no train\.en and train\.de \(or \.gz\), and no train\.tsv"),
        ("empty_file", r"train\.en: empty"),
        ("corrupt_gz", r"train\.de\.gz: cannot read \(Error -3 while decompressing"),
    ],
)
def test_bad_records_are_one_line_errors_naming_file_and_line(tmp_path, setup, message):
    de = list(DE)
    if setup == "tsv_fields":
        _write(tmp_path / "train.tsv", ["a\tb", "a\tb\tc"])
    elif setup == "empty_file":
        (tmp_path / "train.en").write_bytes(b"")
        _write(tmp_path / "train.de", DE)
    elif setup == "corrupt_gz":  # a damaged deflate stream (zlib.error, not an OSError)
        _write(tmp_path / "train.en", EN)
        damaged = bytearray(gzip.compress("\n".join(DE * 20).encode()))
        damaged[15:25] = b"\xff" * 10
        (tmp_path / "train.de.gz").write_bytes(bytes(damaged))
    elif setup != "missing":
        if setup == "misaligned":
            de = de[:3]
        if setup == "empty_sentence":
            de[2] = "  "
        _write(tmp_path / "train.en", EN)
        _write(tmp_path / "train.de", de)
        if setup == "latin1":
            (tmp_path / "train.de").write_bytes("a\nMädchen\n".encode("latin-1") + b"b\nc\n")
    with pytest.raises(DataError, match=message) as info:
        pt.read_pairs(tmp_path, "train", "en", "de")
    assert "\n" not in str(info.value)
    if setup == "empty_sentence":
        kept = pt.read_pairs(tmp_path, "train", "en", "de", bad_records="skip")
        assert kept.skipped == 1 and kept.sources == EN[:2] + EN[3:]


def test_joint_sentencepiece_vocabulary_round_trips_both_languages(tmp_path):
    sentences = (EN + DE) * 20
    with pytest.raises(
        DataError, match=r"SentencePiece training failed: .*Vocabulary size too high"
    ):
        pt.train_tokenizer(sentences, vocab_size=500)
    tok = pt.train_tokenizer(sentences, vocab_size=40)
    assert tok.vocab_size == 40
    assert pt.train_tokenizer(sentences, vocab_size=40).proto == tok.proto  # deterministic
    tok.save(tmp_path / "spm.model")
    again = pt.Tokenizer.load(tmp_path / "spm.model")  # what a resumed run loads
    for text in EN + DE:
        ids = again.encode([text])[0]
        assert ids[-1] == pt.EOS_ID and pt.PAD_ID not in ids[:-1]
        assert again.decode(ids) == text
        assert again.decode(np.concatenate([ids, [pt.PAD_ID, 7, 7]])) == text  # stops at eos
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(DataError, match=r"bad\.model: not a SentencePiece model"):
        pt.Tokenizer.load(tmp_path / "bad.model")


def test_packing_keeps_examples_whole_separate_and_shifted():
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 9, size=(40, 2))
    sources = [
        np.append(rng.integers(3, 50, n - 1), pt.EOS_ID).astype(np.int32) for n in lengths[:, 0]
    ]
    targets = [
        np.append(rng.integers(3, 50, n - 1), pt.EOS_ID).astype(np.int32) for n in lengths[:, 1]
    ]
    sources[5] = np.append(np.full(20, 9), pt.EOS_ID).astype(np.int32)  # longer than a row
    order = rng.permutation(40)
    packed = pt.pack(sources, targets, order, source_len=16, target_len=16)
    a = packed.arrays
    assert packed.truncated == 1 and packed.examples == 40
    assert all(v.shape == (packed.rows, 16) for v in a.values())
    seen = []
    for r in range(packed.rows):
        for segment in range(1, a["source_segments"][r].max() + 1):
            s = a["source_segments"][r] == segment
            t = a["target_segments"][r] == segment
            src, tgt = a["source"][r, s], a["target"][r, t]
            np.testing.assert_array_equal(a["source_positions"][r, s], np.arange(s.sum()))
            np.testing.assert_array_equal(a["target_positions"][r, t], np.arange(t.sum()))
            # The decoder reads the example's own targets shifted right, starting from padding.
            np.testing.assert_array_equal(a["target_inputs"][r, t], np.append(pt.PAD_ID, tgt[:-1]))
            assert src[-1] == tgt[-1] == pt.EOS_ID
            seen.append((tuple(src), tuple(tgt)))
    expected = {((*sources[i][:16][:-1], pt.EOS_ID), tuple(targets[i])) for i in range(40)}
    assert set(seen) == expected and len(seen) == 40
    # Each row is a run of whole segments then padding (never padding between examples).
    for name in ("source_segments", "target_segments"):
        used = a[name] > 0
        assert (np.diff(used.astype(int), axis=1) <= 0).all()
    naive = 1 - (np.minimum(lengths, 16).sum()) / (40 * 2 * 16)  # one example per row
    assert packed.padding < naive / 2


def test_sampled_segmentations_are_seeded_and_keep_the_text():
    pairs = pt.synthetic_pairs(300, seed=0)
    sentences = [*pairs.sources, *pairs.targets]
    tok = pt.train_tokenizer(sentences, vocab_size=56)
    first = tok.sample(sentences, alpha=0.1, nbest=16, seed=1)
    again = tok.sample(sentences, alpha=0.1, nbest=16, seed=1)
    other = tok.sample(sentences, alpha=0.1, nbest=16, seed=2)
    plain = tok.encode(sentences)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert sum(not np.array_equal(a, b) for a, b in zip(first, other, strict=True)) > 100
    assert sum(not np.array_equal(a, b) for a, b in zip(first, plain, strict=True)) > 100
    for ids, text in zip(first, sentences, strict=True):
        assert ids[-1] == pt.EOS_ID and tok.decode(ids) == text
    # A large alpha concentrates the draw on the best segmentation (what ``encode`` gives).
    sharp = tok.sample(sentences, alpha=50.0, nbest=16, seed=1)
    assert sum(np.array_equal(a, b) for a, b in zip(sharp, plain, strict=True)) > 500
    # A line that normalizes to nothing (a zero-width space) has one, empty, segmentation.
    [empty] = tok.sample(["\u200b"], alpha=0.1, nbest=16, seed=1)
    np.testing.assert_array_equal(empty, [pt.EOS_ID])
    bpe = pt.train_tokenizer(sentences, vocab_size=56, model_type="bpe")
    with pytest.raises(DataError, match=r"cannot sample segmentations .*NBestEncode"):
        bpe.sample(sentences[:2], alpha=0.1, nbest=16, seed=1)


def test_resampled_rows_change_every_epoch_keep_each_pair_and_survive_pickling(tmp_path):
    import pickle
    import subprocess
    import sys

    pairs = pt.synthetic_pairs(300, seed=0)
    tok = pt.train_tokenizer([*pairs.sources, *pairs.targets], vocab_size=56)
    source, first = pt.Resampled.build(
        tok, pairs, alpha=0.1, nbest=16, seed=4, source_len=64, target_len=64
    )
    assert len(source) == first.rows == source.rows and first.examples == 300
    views = [source.for_epoch(e) for e in (0, 1, 1)]
    for view in views:
        assert all(v.shape == (source.rows, 64) for v in view.arrays.values())
        assert view.truncated == 0
    np.testing.assert_array_equal(views[0].arrays["source"], first.arrays["source"])
    np.testing.assert_array_equal(views[1].arrays["target"], views[2].arrays["target"])

    def segmentations(view):  # each source sentence's ids in this epoch
        a = view.arrays
        out = {}
        for r in range(source.rows):
            for segment in range(1, a["source_segments"][r].max() + 1):
                ids = a["source"][r, a["source_segments"][r] == segment]
                out[tok.decode(ids)] = tuple(ids)
        return out

    # Not just repacked: most sentences are segmented otherwise in another epoch.
    before, after = segmentations(views[0]), segmentations(views[1])
    assert sum(before[t] != after[t] for t in before.keys() & after.keys()) > 150
    # Every packed example is one of the pairs, its source beside its own target.
    translation = dict(zip(pairs.sources, pairs.targets, strict=True))
    a, seen = views[1].arrays, 0
    for r in range(source.rows):
        for segment in range(1, a["source_segments"][r].max() + 1):
            text = tok.decode(a["source"][r, a["source_segments"][r] == segment])
            assert (
                tok.decode(a["target"][r, a["target_segments"][r] == segment])
                == (translation[text])
            )
            seen += 1
    assert seen == views[1].examples and seen > 250  # an epoch that packs longer drops a few
    # What grain's worker processes receive (epoch 0 left out) builds the same epochs, and so
    # does a fresh process.
    copy = pickle.loads(pickle.dumps(source))
    assert copy.first is None
    np.testing.assert_array_equal(copy.for_epoch(0).arrays["source"], first.arrays["source"])
    np.testing.assert_array_equal(copy.for_epoch(1).arrays["source"], a["source"])
    (tmp_path / "source.pkl").write_bytes(pickle.dumps(source))
    script = (
        "import pickle, sys, numpy as np\n"
        "s = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "np.save(sys.argv[2], s.for_epoch(1).arrays['target'])\n"
    )
    subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "source.pkl"), str(tmp_path / "t.npy")],
        check=True,
    )
    np.testing.assert_array_equal(np.load(tmp_path / "t.npy"), a["target"])
    assert dataclasses.replace(source, seed=5).first is None  # another seed: its own epoch 0
    cut = first.with_rows(3)
    assert cut.rows == 3 and cut.examples == int(first.arrays["source_segments"][:3].max(1).sum())
    assert first.with_rows(first.rows + 2).rows == first.rows + 2
