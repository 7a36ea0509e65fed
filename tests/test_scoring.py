"""Affinity scores: the O(n log n) concordance index against brute force; rm2, Pearson, MSE."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hopperjax.scoring import (
    _strict_inversions,
    concordance_index,
    moses_bleu,
    moses_tokenize,
    mse,
    pearson,
    regression_scores,
    rm2,
    roc_auc,
    translation_scores,
)

RTOL = 1e-12  # every score is computed in float64 from the same inputs as its reference


def brute_force_ci(y: np.ndarray, p: np.ndarray) -> float:
    """DeepDTA's definition written out as the O(n^2) double loop it is."""
    score = 0.0
    pairs = 0
    for i in range(len(y)):
        for j in range(len(y)):
            if y[i] > y[j]:
                pairs += 1
                if p[i] > p[j]:
                    score += 1.0
                elif p[i] == p[j]:
                    score += 0.5
    return score / pairs if pairs else math.nan


def brute_force_ci_vectorized(y: np.ndarray, p: np.ndarray) -> float:
    """The same O(n^2) definition over an [n, n] pair matrix, for n in the thousands."""
    ordered = y[:, None] > y[None, :]
    diff = p[:, None] - p[None, :]
    credit = (diff > 0) + 0.5 * (diff == 0)
    return float(credit[ordered].sum() / ordered.sum())


def random_pair(rng: np.random.Generator, n: int, ties: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and correlated predictions; ``ties`` rounds y, p, or both to force equal values."""
    y = rng.normal(5.0, 1.0, size=n)
    p = y + rng.normal(0.0, 0.8, size=n)
    if ties in ("y", "both"):
        y = np.round(y, 1)
    if ties in ("p", "both"):
        p = np.round(p * 2.0) / 2.0
    return y, p


# ------------------------------------------------------------------------------------------------
# Concordance index


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 64, 65, 777])
def test_strict_inversions_match_pair_count(n):
    # The counting core on its own, with rank ranges that are and aren't powers of two.
    rng = np.random.default_rng(n)
    for high in (1, 2, 3, max(1, n // 4), 1000):
        ranks = rng.integers(0, high, size=n)
        expected = int(np.triu(ranks[:, None] > ranks[None, :], k=1).sum())
        assert _strict_inversions(ranks) == expected


@pytest.mark.parametrize("ties", ["none", "y", "p", "both"])
@pytest.mark.parametrize("n", [2, 3, 4, 7, 30, 200])
def test_ci_matches_brute_force_loop(n, ties):
    rng = np.random.default_rng(1000 * n + len(ties))
    for _ in range(10):
        y, p = random_pair(rng, n, ties)
        expected = brute_force_ci(y, p)
        got = concordance_index(y, p)
        if math.isnan(expected):  # tiny n with all labels equal
            assert math.isnan(got)
        else:
            assert got == pytest.approx(expected, rel=RTOL)


@pytest.mark.parametrize("ties", ["none", "y", "p", "both"])
@pytest.mark.parametrize("n", [1000, 3001])
def test_ci_matches_brute_force_on_thousands(n, ties):
    y, p = random_pair(np.random.default_rng(n), n, ties)
    assert concordance_index(y, p) == pytest.approx(brute_force_ci_vectorized(y, p), rel=RTOL)


def test_ci_heavy_ties_small_integers():
    # Few distinct values on both sides: most pairs are tied in y, p or both.
    rng = np.random.default_rng(7)
    for n in (5, 50, 500):
        y = rng.integers(0, 3, size=n).astype(float)
        p = rng.integers(0, 3, size=n).astype(float)
        assert concordance_index(y, p) == pytest.approx(brute_force_ci_vectorized(y, p), rel=RTOL)


def test_ci_perfect_reversed_and_constant():
    y = np.random.default_rng(0).normal(size=500)
    assert concordance_index(y, 3.0 * y + 1.0) == 1.0
    assert concordance_index(y, -y) == 0.0
    assert concordance_index(y, np.full_like(y, 7.0)) == 0.5


def test_ci_ignores_pairs_with_equal_labels():
    # Elements 0 and 1 share a label, so their wildly different predictions don't matter; of the
    # two pairs with element 2, one is ordered right (1 > 0) and one wrong (1 < 5).
    y = np.array([1.0, 1.0, 2.0])
    p = np.array([0.0, 5.0, 1.0])
    assert concordance_index(y, p) == 0.5
    assert brute_force_ci(y, p) == 0.5


def test_ci_nan_without_comparable_pairs():
    assert math.isnan(concordance_index(np.array([1.0]), np.array([2.0])))
    assert math.isnan(concordance_index(np.full(4, 3.0), np.arange(4.0)))


def test_ci_nan_input_gives_nan():
    assert math.isnan(concordance_index(np.array([1.0, 2.0, 3.0]), np.array([1.0, np.nan, 0.0])))


def test_ci_is_fast_on_many_pairs():
    # 200k elements (2e10 pairs): the brute force would take hours; O(n log n) takes well under
    # a second. No timing assertion (shared CI machines are noisy), only that it completes.
    rng = np.random.default_rng(3)
    y = np.round(rng.normal(size=200_000), 2)
    ci = concordance_index(y, y + rng.normal(size=y.size))
    assert 0.5 < ci < 1.0


# ------------------------------------------------------------------------------------------------
# MSE, Pearson, rm2


def test_mse():
    assert mse(np.array([1.0, 2.0, 3.0]), np.array([1.0, 4.0, 0.0])) == pytest.approx(13.0 / 3.0)
    y, p = random_pair(np.random.default_rng(1), 100, "none")
    assert mse(y, p) == pytest.approx(np.mean((y - p) ** 2), rel=RTOL)


def test_pearson_matches_corrcoef():
    rng = np.random.default_rng(2)
    for n in (3, 50, 2000):
        y, p = random_pair(rng, n, "none")
        assert pearson(y, p) == pytest.approx(np.corrcoef(y, p)[0, 1], rel=1e-10)


def test_pearson_nan_for_constant_input():
    assert math.isnan(pearson(np.array([1.0, 2.0, 3.0]), np.full(3, 2.0)))


def reference_rm2(y: np.ndarray, p: np.ndarray) -> float:
    """Roy's rm2 spelled out from its definition, with r2 taken from np.corrcoef."""
    r2 = np.corrcoef(y, p)[0, 1] ** 2
    k = np.dot(y, p) / np.dot(p, p)
    r02 = 1.0 - np.sum((y - k * p) ** 2) / np.sum((y - np.mean(y)) ** 2)
    return r2 * (1.0 - math.sqrt(abs(r2**2 - r02**2)))


def test_rm2_matches_definition():
    rng = np.random.default_rng(4)
    for n in (5, 100, 3000):
        y, p = random_pair(rng, n, "none")
        assert rm2(y, p) == pytest.approx(reference_rm2(y, p), rel=1e-10)


def test_rm2_perfect_prediction_is_one():
    y = np.random.default_rng(5).normal(7.0, 1.0, size=100)
    assert rm2(y, y) == pytest.approx(1.0, rel=RTOL)


def test_rm2_penalizes_offset_that_pearson_ignores():
    y = np.random.default_rng(6).normal(7.0, 1.0, size=100)
    shifted = y + 3.0
    assert pearson(y, shifted) == pytest.approx(1.0, rel=RTOL)
    assert rm2(y, shifted) < 0.9


# ------------------------------------------------------------------------------------------------
# regression_scores and input checks


def test_regression_scores_bundles_all_four():
    y, p = random_pair(np.random.default_rng(8), 300, "y")
    scores = regression_scores(y, p)
    assert set(scores) == {"mse", "ci", "rm2", "pearson"}
    assert all(isinstance(v, float) for v in scores.values())
    assert scores["mse"] == mse(y, p)
    assert scores["ci"] == concordance_index(y, p)
    assert scores["rm2"] == rm2(y, p)
    assert scores["pearson"] == pearson(y, p)


def test_inputs_are_computed_in_float64():
    y, p = random_pair(np.random.default_rng(9), 1000, "none")
    y32, p32 = y.astype(np.float32), p.astype(np.float32)
    scores = regression_scores(y32, p32)
    expected = regression_scores(y32.astype(np.float64), p32.astype(np.float64))
    assert scores == expected


def test_lists_are_accepted():
    assert mse([1.0, 2.0], [1.0, 3.0]) == 0.5
    assert concordance_index([1, 2, 3], [1, 2, 3]) == 1.0


@pytest.mark.parametrize(
    "fn", [mse, pearson, concordance_index, rm2, regression_scores], ids=lambda f: f.__name__
)
def test_bad_shapes_raise(fn):
    with pytest.raises(ValueError, match="same length"):
        fn(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="1-D"):
        fn(np.zeros(3), np.zeros((3, 1)))
    with pytest.raises(ValueError, match="1-D"):
        fn(np.zeros((2, 2)), np.zeros((2, 2)))
    with pytest.raises(ValueError, match="empty"):
        fn(np.zeros(0), np.zeros(0))


def test_translation_scores_are_sacrebleus_and_lowercasing_only_forgives_case():
    refs = ["Ein Hund läuft über die Wiese.", "Zwei Kinder spielen im Park."]
    exact = translation_scores(refs, refs)
    assert exact["bleu"] == pytest.approx(100.0) and exact["chrf"] == pytest.approx(100.0)
    shouted = [r.upper() for r in refs]
    cased = translation_scores(shouted, refs)
    assert cased["bleu"] < 10.0 and cased["bleu_lowercase"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="one hypothesis per reference"):
        translation_scores(refs[:1], refs)


def test_moses_bleu_scores_the_literatures_tokenized_lowercased_text():
    refs = ['Ein Junge im T-Shirt ruft "Hallo!" über die Wiese.', "Zwei Kinder spielen im Park."]
    assert moses_bleu(refs, refs, "de") == pytest.approx(100.0)
    # Case, and spacing around punctuation that tokenization removes, are forgiven ...
    loose = [
        'ein junge im t-shirt ruft " hallo ! " über die wiese .',
        "ZWEI KINDER spielen im Park .",
    ]
    assert moses_bleu(loose, refs, "de") == pytest.approx(100.0)
    assert translation_scores(loose, refs)["bleu"] < 60.0  # ... where detokenized BLEU is not
    # ... but a hyphenated compound stays one token (Moses without -a), so splitting it costs.
    split = ['Ein Junge im T - Shirt ruft "Hallo!" über die Wiese.', refs[1]]
    assert moses_bleu(split, refs, "de") < 90.0
    # The tokens are the Moses scripts' (escaped quotes), as in the dataset's tok/ files.
    assert moses_tokenize(refs[:1], "de") == [
        "ein junge im t-shirt ruft &quot; hallo ! &quot; über die wiese ."
    ]
    with pytest.raises(ValueError, match="one hypothesis per reference"):
        moses_bleu(refs[:1], refs, "de")


def test_roc_auc_equals_the_pairwise_count_with_ties_as_half():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300).astype(float)
    scores = np.round(rng.normal(labels * 0.7, 1.0), 1)  # rounding makes many ties
    pos, neg = scores[labels == 1], scores[labels == 0]
    diff = pos[:, None] - neg[None, :]
    brute = ((diff > 0).sum() + 0.5 * (diff == 0).sum()) / diff.size
    assert roc_auc(labels, scores) == pytest.approx(brute, rel=1e-12)
    assert roc_auc([0, 1], [0.2, 0.9]) == 1.0 and roc_auc([1, 0], [0.2, 0.9]) == 0.0
    assert math.isnan(roc_auc([1, 1], [0.2, 0.9]))
