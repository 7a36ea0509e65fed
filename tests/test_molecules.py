"""Drug-target affinity data: DeepDTA and CSV loaders, the restricted unpickler, tokenizers,
per-batch deduplication, the synthetic set, ArrayRecord shards and tools/convert_dta.py.

Every test writes its own tiny files; none reads shared data.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import json
import os
import pickle
import struct
import sys

import grain
import numpy as np
import pytest
from conftest import REPO

from hopperjax.data import dta_batches, dta_shards, molecules
from hopperjax.data.molecules import DataError, Tokenizer

# Ids in a non-sorted order: the loader must keep the file's order, which indexes Y.
DRUGS = {"30": "CC(=O)N", "4": "c1ccccc1", "12": "CN=C"}
PROTEINS = {"KIN2": "MKVLA", "ABL1": "GTGSFGK", "AAK1": "DFGAPE", "ZAP7": "HRDLKPW"}
# Kd in nM, NaN = not measured: 10 measured pairs, row-major.
Y = np.array(
    [
        [10000.0, 1.0, 50.0, 100.0],
        [np.nan, 10.0, 1000.0, 10000.0],
        [0.1, np.nan, 5000.0, 20.0],
    ]
)
TRAIN_FOLDS = [[0, 3], [1, 7], [2, 9]]
TEST_FOLD = [4, 5, 6, 8]


def _write_deepdta(root, y=Y, *, text_matrix=False, folds=(TRAIN_FOLDS, TEST_FOLD)):
    root.mkdir(parents=True, exist_ok=True)
    (root / "ligands_can.txt").write_text(json.dumps(DRUGS))
    (root / "proteins.txt").write_text(json.dumps(PROTEINS))
    if text_matrix:
        np.savetxt(root / "Y.txt", y)
    else:
        with open(root / "Y", "wb") as f:
            pickle.dump(np.asarray(y), f, protocol=2)  # DeepDTA's format (Python 2, protocol 2)
    if folds is not None:
        (root / "folds").mkdir(exist_ok=True)
        (root / "folds" / "train_fold_setting1.txt").write_text(json.dumps(folds[0]))
        (root / "folds" / "test_fold_setting1.txt").write_text(json.dumps(folds[1]))
    return root


def test_deepdta_loads_pairs_row_major_with_pkd_and_folds(tmp_path):
    table = molecules.load_deepdta(_write_deepdta(tmp_path / "d"))

    assert table.drug_ids == ["30", "4", "12"] and table.drugs == list(DRUGS.values())
    assert table.protein_ids == ["KIN2", "ABL1", "AAK1", "ZAP7"]
    rows, cols = np.where(~np.isnan(Y))
    np.testing.assert_array_equal(table.drug_index, rows)
    np.testing.assert_array_equal(table.protein_index, cols)
    assert table.drug_index.dtype == table.protein_index.dtype == np.int32
    assert table.affinity.dtype == np.float32
    # pKd = -log10(Kd [M]): 10 µM -> 5, 1 nM -> 9, 0.1 nM -> 10.
    np.testing.assert_allclose(table.affinity[[0, 1, 7]], [5.0, 9.0, 10.0], rtol=1e-6)
    np.testing.assert_allclose(table.affinity, -np.log10(Y[rows, cols] * 1e-9), rtol=1e-6)
    assert [f.tolist() for f in table.train_folds] == TRAIN_FOLDS
    assert table.test_fold.tolist() == TEST_FOLD
    assert table.skipped == 0 and table.source == str(tmp_path / "d")

    raw = molecules.load_deepdta(tmp_path / "d", pkd=False)
    np.testing.assert_allclose(raw.affinity, Y[rows, cols].astype(np.float32))

    part = table.subset([2, 5])
    assert part.drug_index.tolist() == [0, 1] and part.train_folds is None
    assert part.drugs is table.drugs


def test_deepdta_without_folds_and_from_the_text_matrix(tmp_path):
    pickled = molecules.load_deepdta(_write_deepdta(tmp_path / "p"))
    text = molecules.load_deepdta(_write_deepdta(tmp_path / "t", text_matrix=True, folds=None))
    assert text.train_folds is None and text.test_fold is None
    np.testing.assert_array_equal(text.drug_index, pickled.drug_index)
    np.testing.assert_array_equal(text.protein_index, pickled.protein_index)
    np.testing.assert_allclose(text.affinity, pickled.affinity)


class _Evil:
    """Unpickling this calls ``func(arg)``: what a hostile ``Y`` file would do."""

    def __init__(self, func, arg):
        self.func, self.arg = func, arg

    def __reduce__(self):
        return self.func, (self.arg,)


@pytest.mark.parametrize("via", ["system", "eval"])
def test_malicious_pickle_is_refused_before_it_runs(tmp_path, via):
    marker = tmp_path / "pwned"
    root = _write_deepdta(tmp_path / "d")
    if via == "system":
        payload, glob = _Evil(os.system, f"touch {marker}"), f"{os.system.__module__}.system"
    else:
        # Protocol 2 writes the Python 2 name of the builtins module.
        payload, glob = _Evil(builtins.eval, f"open({str(marker)!r}, 'w')"), "__builtin__.eval"
    with open(root / "Y", "wb") as f:
        pickle.dump(payload, f, protocol=2)

    with pytest.raises(DataError) as error:
        molecules.load_deepdta(root)
    message = str(error.value)
    assert str(root / "Y") in message and f"'{glob}'" in message and "\n" not in message
    assert not marker.exists()


def test_restricted_pickle_loads_arrays_and_nothing_else(tmp_path):
    array = np.arange(6.0).reshape(2, 3)
    for protocol in (2, 4, 5):
        path = tmp_path / f"a{protocol}.pkl"
        path.write_bytes(pickle.dumps(array, protocol=protocol))
        np.testing.assert_array_equal(molecules.load_restricted_pickle(path), array)
    (tmp_path / "dict.pkl").write_bytes(pickle.dumps({"y": 1}, protocol=2))
    with pytest.raises(DataError, match=r"dict.pkl: holds a dict"):
        molecules.load_restricted_pickle(tmp_path / "dict.pkl")
    (tmp_path / "cut.pkl").write_bytes(pickle.dumps(array, protocol=2)[:40])
    with pytest.raises(DataError, match=r"cut.pkl: not a readable pickle"):
        molecules.load_restricted_pickle(tmp_path / "cut.pkl")
    with pytest.raises(DataError, match=r"missing.pkl: no such file"):
        molecules.load_restricted_pickle(tmp_path / "missing.pkl")


def test_deepdta_errors_name_the_file_and_record(tmp_path):
    root = _write_deepdta(tmp_path / "shape", Y[:, :3])
    with pytest.raises(DataError, match=r"shape/Y: affinity matrix is 3 x 3.*3 drugs.*4 proteins"):
        molecules.load_deepdta(root)

    root = _write_deepdta(tmp_path / "range", folds=([[0, 3], [1, 10]], TEST_FOLD))
    with pytest.raises(DataError, match=r"train_fold_setting1.txt: fold 1 index 10 is outside"):
        molecules.load_deepdta(root)

    root = _write_deepdta(tmp_path / "overlap", folds=(TRAIN_FOLDS, [4, 5, 6, 7]))
    with pytest.raises(DataError, match=r"test_fold_setting1.txt: pair 7 is also in train_fold"):
        molecules.load_deepdta(root)

    root = _write_deepdta(tmp_path / "missing")
    (root / "proteins.txt").unlink()
    with pytest.raises(DataError, match=r"missing/proteins.txt: no such file"):
        molecules.load_deepdta(root)

    root = _write_deepdta(tmp_path / "nomatrix")
    (root / "Y").unlink()
    with pytest.raises(DataError, match=r"nomatrix/Y: no such file \(nor Y.txt\)"):
        molecules.load_deepdta(root)

    root = _write_deepdta(tmp_path / "dup")
    (root / "ligands_can.txt").write_text('{"30": "CC", "4": "CO", "30": "CN"}')
    with pytest.raises(DataError, match=r"dup/ligands_can.txt: drug '30' appears twice"):
        molecules.load_deepdta(root)


def test_non_positive_kd_is_an_error_or_skipped_with_folds_remapped(tmp_path):
    y = Y.copy()
    y[1, 2] = 0.0  # pair 5: drug '4', protein 'AAK1'
    root = _write_deepdta(tmp_path / "d", y)
    with pytest.raises(DataError, match=r"d/Y: pair 5 \(drug '4', protein 'AAK1'\)"):
        molecules.load_deepdta(root)

    full = molecules.load_deepdta(root, pkd=False)  # 0 is a valid score without pKd
    table = molecules.load_deepdta(root, bad_records="skip")
    assert table.skipped == 1 and len(table.affinity) == 9

    def pairs(t, indices):
        return [(int(t.drug_index[i]), int(t.protein_index[i])) for i in indices]

    for old, new in zip(full.train_folds, table.train_folds, strict=True):
        assert pairs(table, new) == pairs(full, old)
    assert pairs(table, table.test_fold) == pairs(full, [4, 6, 8])  # pair 5 is gone


def test_csv_and_tsv_loaders(tmp_path):
    rows = [
        ["id", "SMILES", "Sequence", "Affinity"],
        ["a", "CCO", "MKV", "1000"],
        ["b", "CCN", "MKV", "10"],
        ["c", "CCO", "GTG", "1"],
    ]
    csv_path = tmp_path / "pairs.csv"
    csv_path.write_text("\n".join(",".join(r) for r in rows) + "\n\n")
    tsv_path = tmp_path / "pairs.tsv"
    tsv_path.write_text("\n".join("\t".join(r) for r in rows) + "\n")

    for path in (csv_path, tsv_path):
        table = molecules.load_dta_csv(path)
        assert table.drugs == ["CCO", "CCN"] and table.proteins == ["MKV", "GTG"]
        assert table.drug_ids == ["line 2", "line 3"] and table.protein_ids == ["line 2", "line 4"]
        assert table.drug_index.tolist() == [0, 1, 0]
        assert table.protein_index.tolist() == [0, 0, 1]
        np.testing.assert_allclose(table.affinity, [1000, 10, 1])
        assert table.train_folds is None and table.skipped == 0
    pkd = molecules.load_dta_csv(csv_path, pkd=True)
    np.testing.assert_allclose(pkd.affinity, [6.0, 8.0, 9.0], rtol=1e-6)


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ("CCN,MKV,abc", "affinity 'abc' is not a number"),
        ("CCN,MKV,nan", "affinity 'nan' is not finite"),
        ("CCN,,5", "empty sequence"),
        ("CCN,MKV", "2 fields, the header has 3"),
    ],
)
def test_csv_bad_row_names_the_line_or_is_skipped(tmp_path, row, reason):
    path = tmp_path / "bad.csv"
    path.write_text(f"smiles,sequence,affinity\nCCO,MKV,5.5\n{row}\nCCC,GTG,7\n")
    with pytest.raises(DataError) as error:
        molecules.load_dta_csv(path)
    assert str(error.value) == f"{path}: line 3: {reason}"
    table = molecules.load_dta_csv(path, bad_records="skip")
    assert table.skipped == 1 and table.affinity.tolist() == [5.5, 7.0]

    (tmp_path / "nohead.csv").write_text("smiles,seq,affinity\nCCO,MKV,5\n")
    header = r"nohead.csv: line 1: the header \(smiles, seq, affinity\) lacks column\(s\) sequence$"
    with pytest.raises(DataError, match=header):
        molecules.load_dta_csv(tmp_path / "nohead.csv")


def test_tokenizer_policies():
    tok = Tokenizer("ABC", max_len=5)
    assert tok.vocab_size == 5 and tok.unknown_id == 4
    assert tok.encode("CAB", where="x").tolist() == [3, 1, 2, 0, 0]
    assert tok.encode("ABCABCA", where="x").tolist() == [1, 2, 3, 1, 2]  # truncated
    assert tok.encode("ABCABz", where="x").dtype == np.int32  # cut characters are not checked
    with pytest.raises(DataError, match=r"^f.json: drug '7': unknown character 'z' at position 2$"):
        tok.encode("ABzC", where="f.json: drug '7'")
    with pytest.raises(DataError, match="unknown character 'é' at position 0"):
        tok.encode("éA", where="x")
    with pytest.raises(DataError, match=r"^x: empty sequence$"):
        tok.encode("", where="x")
    assert Tokenizer("ABC", 5, "skip").encode("AzB", where="x") is None
    assert Tokenizer("ABC", 5, "unk").encode("AzB", where="x").tolist() == [1, 4, 2, 0, 0]
    with pytest.raises(ValueError, match="distinct"):
        Tokenizer("AAB", 5)

    assert len(set(molecules.SMILES_CHARSET)) == len(molecules.SMILES_CHARSET)
    smiles = Tokenizer(molecules.SMILES_CHARSET, 100)
    smiles.encode("C[C@@H](N)C(=O)O.[Na+].Cl/C=C\\Br[nH]1%10#[Se]", where="isomeric")
    assert Tokenizer(molecules.PROTEIN_CHARSET, 10).vocab_size == 27


def test_tokenize_table_skips_molecules_with_unknown_characters(tmp_path):
    table = molecules.load_deepdta(_write_deepdta(tmp_path / "d"))
    table = dataclasses.replace(table, drugs=["CC(=O)N", "c1cc?cc1", "CN=C"])
    drug_tok, protein_tok = Tokenizer(molecules.SMILES_CHARSET, 8), Tokenizer("AB", 8, "unk")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'd'}: drug '4': unknown character '\?'"):
        molecules.tokenize_table(table, drug_tok, protein_tok)

    drug_tok = Tokenizer(molecules.SMILES_CHARSET, 8, "skip")
    drugs, proteins, kept = molecules.tokenize_table(table, drug_tok, protein_tok)
    assert kept.drug_ids == ["30", "12"] and drugs.shape == (2, 8) and proteins.shape == (4, 8)
    assert kept.skipped == 3 and len(kept.affinity) == 7  # drug '4' had 3 measured pairs
    assert kept.drugs == ["CC(=O)N", "CN=C"]
    for d in kept.drug_index:
        np.testing.assert_array_equal(drugs[d], drug_tok.encode(kept.drugs[d], where="x"))
    assert sorted(np.concatenate([*kept.train_folds, kept.test_fold]).tolist()) == list(range(7))


def test_dedup_batch_round_trip_and_cap():
    rng = np.random.default_rng(0)
    drug_table = rng.integers(1, 9, (3, 6)).astype(np.int32)
    protein_table = rng.integers(1, 9, (5, 10)).astype(np.int32)
    d, p = rng.integers(0, 3, 16), rng.integers(0, 5, 16)
    batch = {
        "drug": drug_table[d],
        "protein": protein_table[p],
        "affinity": rng.normal(size=16).astype(np.float32),
    }
    out = dta_batches.dedup_batch(batch, drug_rows=4, protein_rows=8)
    assert out["drug_tokens"].shape == (4, 6) and out["protein_tokens"].shape == (8, 10)
    assert out["drug_index"].dtype == out["protein_index"].dtype == np.int32
    np.testing.assert_array_equal(out["drug_tokens"][out["drug_index"]], batch["drug"])
    np.testing.assert_array_equal(out["protein_tokens"][out["protein_index"]], batch["protein"])
    np.testing.assert_array_equal(out["affinity"], batch["affinity"])
    distinct = len(np.unique(p))
    assert not out["protein_tokens"][distinct:].any()  # padding rows are zeros
    with pytest.raises(ValueError, match=rf"{distinct} distinct proteins .* 2 rows"):
        dta_batches.dedup_batch(batch, drug_rows=4, protein_rows=2)


def _r2(features, target):
    x = np.concatenate([np.ones((len(target), 1)), features], axis=1)
    coef, *_ = np.linalg.lstsq(x, target, rcond=None)
    return 1.0 - (target - x @ coef).var() / target.var()


def test_synthetic_is_deterministic_and_follows_its_motifs():
    kwargs = dict(num_drugs=200, num_proteins=60, num_pairs=20_000, protein_len=(100, 300))
    table = molecules.synthetic_dta(**kwargs, seed=3)
    again = molecules.synthetic_dta(**kwargs, seed=3)
    other = molecules.synthetic_dta(**kwargs, seed=4)
    assert table.drugs == again.drugs and table.proteins == again.proteins
    np.testing.assert_array_equal(table.affinity, again.affinity)
    np.testing.assert_array_equal(table.drug_index, again.drug_index)
    assert table.drugs != other.drugs and not np.array_equal(table.affinity, other.affinity)
    assert set("".join(table.drugs)) <= set(molecules.SMILES_CHARSET)
    assert set("".join(table.proteins)) <= set(molecules.PROTEIN_CHARSET)
    assert all(30 <= len(s) <= 80 for s in table.drugs)
    assert all(100 <= len(s) <= 300 for s in table.proteins)

    drug_counts = molecules.motif_counts(table.drugs, molecules.DRUG_MOTIFS)
    assert drug_counts[:20].tolist() == [
        [sum(s.startswith(m, i) for i in range(len(s))) for m in molecules.DRUG_MOTIFS]
        for s in table.drugs[:20]
    ]
    d = drug_counts[table.drug_index]
    p = molecules.motif_counts(table.proteins, molecules.PROTEIN_MOTIFS)[table.protein_index]
    d, p = (d - d.mean(0)) / d.std(0), (p - p.mean(0)) / p.std(0)
    features = np.concatenate([d, p, (d[:, :, None] * p[:, None, :]).reshape(len(d), -1)], 1)
    y = table.affinity.astype(np.float64)
    assert _r2(features, y) > 0.95  # the hidden structure, up to its 0.1 noise
    assert _r2(features, np.random.default_rng(0).permutation(y)) < 0.01


def _pair_source(table):
    drug_tok = Tokenizer(molecules.SMILES_CHARSET, 85)
    protein_tok = Tokenizer(molecules.PROTEIN_CHARSET, 120)
    drugs, proteins, table = molecules.tokenize_table(table, drug_tok, protein_tok)
    source = dta_batches.PairSource(
        drugs, proteins, table.drug_index, table.protein_index, table.affinity
    )
    return source, drug_tok, protein_tok


def test_array_record_shards_round_trip(tmp_path):
    table = molecules.synthetic_dta(
        num_drugs=30, num_proteins=10, num_pairs=257, protein_len=(60, 150), seed=1
    )
    source, drug_tok, protein_tok = _pair_source(table)
    shards = dta_shards.write_shards(
        table, drug_tok, protein_tok, tmp_path / "shards", num_shards=3
    )
    assert [os.path.basename(p) for p in shards.paths] == [
        f"pairs-0000{k}-of-00003.array_record" for k in range(3)
    ]
    assert sorted(os.listdir(tmp_path / "shards")) == sorted(
        [*map(os.path.basename, shards.paths), "dataset.json"]
    )
    assert (shards.pairs, shards.drugs, shards.proteins) == (257, 30, 10)
    assert (shards.drug_max_len, shards.protein_max_len, shards.splits) == (85, 120, None)
    pairs = dta_shards.ArrayRecordPairs(shards.paths)
    assert len(pairs) == len(source) == 257
    for i in range(len(source)):
        want, got = source[i], pairs[i]
        assert got["drug"].dtype == got["protein"].dtype == np.int32
        assert got["affinity"].dtype == np.float32 and got["affinity"].shape == ()
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])

    batches = grain.MapDataset.source(pairs).shuffle(seed=0).batch(16, drop_remainder=True)
    first = batches[0]
    assert first["drug"].shape == (16, 85) and first["protein"].shape == (16, 120)


def test_shards_keep_the_deepdta_folds_as_record_ranges(tmp_path):
    root = _write_deepdta(tmp_path / "d")
    table = molecules.load_deepdta(root)
    drugs, proteins, table = molecules.tokenize_table(
        table, Tokenizer(molecules.SMILES_CHARSET, 85), Tokenizer(molecules.PROTEIN_CHARSET, 120)
    )
    source = dta_batches.PairSource(
        drugs, proteins, table.drug_index, table.protein_index, table.affinity
    )
    shards = dta_shards.write_shards(
        molecules.load_deepdta(root),
        Tokenizer(molecules.SMILES_CHARSET, 85),
        Tokenizer(molecules.PROTEIN_CHARSET, 120),
        tmp_path / "s",
        num_shards=2,
    )
    pairs = dta_shards.ArrayRecordPairs(shards.paths)
    want_folds = [*table.train_folds, table.test_fold]
    got_folds = [*shards.train_folds, shards.test_fold]
    assert [len(f) for f in got_folds] == [len(f) for f in want_folds]
    for want, got in zip(want_folds, got_folds, strict=True):
        for w, g in zip(want, got, strict=True):  # the same pairs, fold by fold
            for key in ("drug", "protein", "affinity"):
                np.testing.assert_array_equal(pairs[int(g)][key], source[int(w)][key])


def test_a_directory_holds_one_complete_shard_set(tmp_path):
    table = molecules.synthetic_dta(num_drugs=5, num_proteins=3, num_pairs=10, seed=0)
    _, drug_tok, protein_tok = _pair_source(table)
    out = tmp_path / "out"
    dta_shards.write_shards(table, drug_tok, protein_tok, out, num_shards=3)
    # Converting again with another count replaces the set instead of mixing the two.
    shards = dta_shards.write_shards(table, drug_tok, protein_tok, out, num_shards=2)
    assert sorted(os.listdir(out)) == sorted([*map(os.path.basename, shards.paths), "dataset.json"])
    assert len(dta_shards.ArrayRecordPairs(dta_shards.read_shards(out).paths)) == 10

    os.remove(shards.paths[1])
    with pytest.raises(DataError, match=r"pairs-00001-of-00002.array_record: missing"):
        dta_shards.read_shards(out)
    (out / "dataset.json").write_text('{"format": "other"}')
    with pytest.raises(DataError, match=r"dataset.json: format 'other'"):
        dta_shards.read_shards(out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty: no dataset.json"):
        dta_shards.read_shards(tmp_path / "empty")


def test_a_failed_shard_write_leaves_no_dataset(tmp_path, monkeypatch):
    table = molecules.synthetic_dta(num_drugs=5, num_proteins=3, num_pairs=10, seed=0)
    _, drug_tok, protein_tok = _pair_source(table)
    out = tmp_path / "out"
    dta_shards.write_shards(table, drug_tok, protein_tok, out, num_shards=2)
    monkeypatch.setattr(dta_shards, "_MAGIC", None)  # packing the first record fails
    with pytest.raises(struct.error):
        dta_shards.write_shards(table, drug_tok, protein_tok, out, num_shards=2)
    # The earlier set is no longer complete, and the failed shard left no file behind.
    assert "dataset.json" not in os.listdir(out)
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    with pytest.raises(DataError, match="conversion did not finish"):
        dta_shards.read_shards(out)


def _load_tool():
    """tools/ is not a package: load the file as module `convert_dta`."""
    spec = importlib.util.spec_from_file_location("convert_dta", REPO / "tools" / "convert_dta.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_convert_dta_cli(tmp_path, capsys):
    tool = _load_tool()
    root = _write_deepdta(tmp_path / "d")
    out = tmp_path / "shards"
    assert tool.main(["--source", str(root), "--out", str(out), "--shards", "2"]) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.startswith("wrote 10 pairs (0 skipped; DeepDTA folds kept)")
    assert "2 shards" in summary
    assert "DeepDTA folds kept" in summary
    shards = dta_shards.read_shards(out)
    pairs = dta_shards.ArrayRecordPairs(shards.paths)
    assert len(pairs) == 10
    np.testing.assert_allclose(pairs[0]["affinity"], 5.0)  # --pkd is DeepDTA's default

    result = tool.bench(shards.paths, workers=0, batch_size=4, batches=3)
    assert result["workers"] == 0 and result["examples_per_s"] > 0

    assert tool.main(["--source", str(tmp_path / "none"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none: no such file" in err


def test_grouped_order_keeps_groups_together_and_bounds_a_batch():
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 40, 1000)  # 40 groups of ~25 pairs
    order = dta_batches.GroupedOrder(groups, seed=3)
    n = len(groups)
    assert len(order) == n * dta_batches.GroupedOrder.EPOCHS
    epoch0 = np.array([order[i] for i in range(n)])
    epoch1 = np.array([order[i] for i in range(n, 2 * n)])
    # Every epoch visits every pair once, in a new order, group by group.
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)
    runs = np.count_nonzero(np.diff(groups[epoch0])) + 1
    assert runs == len(np.unique(groups))
    # Same seed, same order (workers and resumed iterators rebuild it); another seed differs.
    again = dta_batches.GroupedOrder(groups, seed=3)
    assert [again[i] for i in range(n, n + 50)] == list(epoch1[:50])
    other = dta_batches.GroupedOrder(groups, seed=4)
    assert [other[i] for i in range(50)] != list(epoch0[:50])
    # No window of a batch, epoch boundaries included, holds more groups than the bound.
    for batch in (1, 7, 64, 256):
        bound = order.max_groups_per_batch(batch)
        stream = groups[np.r_[epoch0, epoch1]]
        worst = max(len(set(stream[i : i + batch])) for i in range(0, 2 * n - batch, 5))
        assert worst <= bound < batch or batch == 1
    sizes = np.sort(np.bincount(groups))
    assert order.max_groups_per_batch(256) == np.searchsorted(np.cumsum(sizes), 254, "right") + 2
    with pytest.raises(ValueError, match="no pairs"):
        dta_batches.GroupedOrder(np.array([], np.int64), seed=0)


def test_grouped_order_mixes_groups_and_still_bounds_a_batch():
    """mix=K: the pairs of K groups at a time are shuffled together, so a batch holds more
    groups (closer to i.i.d.) and the table bound still holds; mix=1 is the plain order."""
    rng = np.random.default_rng(1)
    groups = rng.integers(0, 12, 3000)  # few, large groups: KIBA's shape in miniature
    n = len(groups)
    plain = dta_batches.GroupedOrder(groups, seed=5)
    assert [plain[i] for i in range(n)] == [
        dta_batches.GroupedOrder(groups, seed=5, mix=1)[i] for i in range(n)
    ]
    mixed = dta_batches.GroupedOrder(groups, seed=5, mix=4)
    epoch0 = np.array([mixed[i] for i in range(n)])
    epoch1 = np.array([mixed[i] for i in range(n, 2 * n)])
    assert sorted(epoch0) == list(range(n))
    batch = 128

    def mean_groups(stream):
        return np.mean(
            [len(set(stream[i : i + batch])) for i in range(0, len(stream) - batch, batch)]
        )

    plain_stream = groups[[plain[i] for i in range(n)]]
    mixed_stream = groups[np.r_[epoch0, epoch1]]
    assert mean_groups(plain_stream) < 2.2 and mean_groups(mixed_stream) > 3.5
    # Each stretch of the order holds exactly 4 groups (the last may hold fewer).
    first_seen = []
    for g in groups[epoch0]:
        if g not in first_seen:
            first_seen.append(g)
    stretches = [set(first_seen[i : i + 4]) for i in range(0, 12, 4)]
    boundaries = np.cumsum([np.isin(groups, list(s)).sum() for s in stretches])
    for stretch, end in zip(stretches, boundaries, strict=True):
        assert set(groups[epoch0[end - np.isin(groups, list(stretch)).sum() : end]]) == stretch
    bound = mixed.max_groups_per_batch(batch)
    worst = max(len(set(mixed_stream[i : i + batch])) for i in range(0, 2 * n - batch, 3))
    assert worst <= bound <= 12
    with pytest.raises(ValueError, match="mix"):
        dta_batches.GroupedOrder(groups, seed=0, mix=0)
