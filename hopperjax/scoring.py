"""Scores as the literature reports them: affinity predictions (MSE, concordance index, rm2,
Pearson) as DeepDTA does, and translations (BLEU, chrF) as sacrebleu computes them and, for
comparison with the Multi30k literature, on Moses-tokenized, lowercased text.

The Davis/KIBA drug-target affinity papers (DeepDTA and its successors) all report the same four
numbers, so results here are comparable with theirs only if the definitions match theirs exactly:
the concordance index counts tied predictions as half a pair and ignores pairs with tied labels,
and rm2 is Roy's modified r^2 with the through-origin slope ``k`` fitted on the predictions.

These are host-side numpy functions for eval, computed in float64 whatever the input dtype: a test
set is one small vector, and float32 sums over tens of thousands of squared errors lose digits
that the papers report.
"""

from __future__ import annotations

import math

import numpy as np


def _as_pair(y: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Checks that ``y`` and ``p`` are equal-length, non-empty 1-D arrays; returns them as float64.

    A [n, 1] prediction against [n] labels would otherwise broadcast to [n, n] and give a
    plausible-looking but meaningless number, so shapes must match exactly.
    """
    y = np.asarray(y, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    if y.ndim != 1 or p.ndim != 1:
        raise ValueError(
            f"labels and predictions must be 1-D arrays; got shapes {y.shape} and {p.shape}"
        )
    if y.shape != p.shape:
        raise ValueError(
            f"labels and predictions must have the same length; got {y.size} and {p.size}"
        )
    if y.size == 0:
        raise ValueError("labels and predictions are empty; there is nothing to score")
    return y, p


def mse(y: np.ndarray, p: np.ndarray) -> float:
    """Mean squared error.

    Args:
      y: [n] true affinities.
      p: [n] predicted affinities.

    Returns:
      mean((y - p)^2).
    """
    y, p = _as_pair(y, p)
    return float(np.mean((y - p) ** 2))


def pearson(y: np.ndarray, p: np.ndarray) -> float:
    """Pearson correlation coefficient.

    Args:
      y: [n] true affinities.
      p: [n] predicted affinities.

    Returns:
      The correlation in [-1, 1]; nan when either side is constant (the correlation is undefined,
      and a model that predicts one value everywhere should not score 0 silently).
    """
    y, p = _as_pair(y, p)
    dy = y - y.mean()
    dp = p - p.mean()
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.sum(dy * dp) / math.sqrt(np.sum(dy * dy) * np.sum(dp * dp)))


def _pairs_within_runs(run_starts: np.ndarray) -> int:
    """Number of unordered pairs inside the same run: sum of c(c - 1) / 2 over run lengths c.

    Args:
      run_starts: [n] bool, True where a run of equal values begins in a sorted array.
    """
    counts = np.diff(np.r_[np.flatnonzero(run_starts), run_starts.size])
    return int(np.sum(counts * (counts - 1) // 2))


def _strict_inversions(ranks: np.ndarray) -> int:
    """Number of pairs i < j with ``ranks[i] > ranks[j]`` (equal ranks are not inversions).

    Counted one bit of the rank at a time, from the top, so that every step is a whole-array numpy
    operation: a Fenwick tree or a textbook merge sort runs a Python loop per element, which takes
    seconds to tens of seconds for a million elements. An inverted pair is counted at the highest
    bit where the two ranks differ: they share the prefix above it, and the earlier one has a 1
    there and the later one a 0. So before handling bit b the elements are kept stably sorted by
    their prefix above b (original order within a prefix group), and for each element with a 0 at
    b we add the number of 1s before it in its group; then a stable partition by bit b (zeros
    first, within each group) gives the order for the next bit. O(n) per bit, O(n log n) total.

    Args:
      ranks: [n] non-negative integers.

    Returns:
      The inversion count.
    """
    n = ranks.size
    if n < 2:
        return 0
    cur = ranks.astype(np.int64)
    position = np.arange(n, dtype=np.int64)
    total = 0
    for b in reversed(range(int(cur.max()).bit_length())):
        bit = (cur >> b) & 1
        prefix = cur >> (b + 1)  # non-decreasing along `cur`
        new_group = np.r_[True, prefix[1:] != prefix[:-1]]
        group = np.cumsum(new_group) - 1  # [n] group index of each element
        start = np.flatnonzero(new_group)  # [groups] first position of each group
        end = np.r_[start[1:], n]
        ones_before = np.cumsum(bit) - bit  # 1s before each position, across groups
        ones_before_in_group = ones_before - ones_before[start][group]
        is_zero = bit == 0
        total += int(np.sum(ones_before_in_group[is_zero]))

        zeros_in_group = (end - start) - (ones_before[end - 1] + bit[end - 1] - ones_before[start])
        group_start = start[group]
        zeros_before_in_group = position - group_start - ones_before_in_group
        dest = np.where(
            is_zero,
            group_start + zeros_before_in_group,
            group_start + zeros_in_group[group] + ones_before_in_group,
        )
        nxt = np.empty_like(cur)
        nxt[dest] = cur
        cur = nxt
    return total


def concordance_index(y: np.ndarray, p: np.ndarray) -> float:
    """DeepDTA's concordance index: how often the predictions order a pair as the labels do.

    Over all pairs (i, j) with y_i > y_j, the fraction with p_i > p_j, where a tie p_i == p_j
    counts 0.5. Pairs with equal labels are left out, as in DeepDTA's ``get_cindex``. Runs in
    O(n log n) (the reference loop is O(n^2), minutes on KIBA's test set):

    * sort by (y, p) and rank p; a pair with different labels is discordant exactly when it is a
      strict inversion of the p-ranks in that order (equal-label pairs are sorted by p, so they
      never invert);
    * pairs with different labels and tied predictions = pairs tied in p minus pairs tied in both;
    * the rest of the comparable pairs are concordant.

    Args:
      y: [n] true affinities.
      p: [n] predicted affinities.

    Returns:
      The index in [0, 1] (0.5 is a random or constant ranking); nan when no pair has different
      labels, and nan when any input is nan (a nan has no place in an ordering).
    """
    y, p = _as_pair(y, p)
    if np.isnan(y).any() or np.isnan(p).any():
        return math.nan
    n = y.size
    order = np.lexsort((p, y))  # by y, then by p
    y_sorted = y[order]
    p_sorted = p[order]
    new_y = np.r_[True, y_sorted[1:] != y_sorted[:-1]]
    comparable = n * (n - 1) // 2 - _pairs_within_runs(new_y)
    if comparable == 0:
        return math.nan

    _, p_ranks, p_counts = np.unique(p_sorted, return_inverse=True, return_counts=True)
    tied_p = int(np.sum(p_counts * (p_counts - 1) // 2))
    # Runs of equal (y, p) in the sorted order hold the pairs tied in both, which are not
    # comparable; the other tied-p pairs have different labels and count 0.5 each.
    tied_both = _pairs_within_runs(new_y | np.r_[True, p_sorted[1:] != p_sorted[:-1]])
    tied_p_only = tied_p - tied_both
    discordant = _strict_inversions(p_ranks.reshape(-1))
    concordant = comparable - discordant - tied_p_only
    return (concordant + 0.5 * tied_p_only) / comparable


def rm2(y: np.ndarray, p: np.ndarray) -> float:
    """Roy's modified r^2, as DeepDTA's ``get_rm2`` computes it.

    r2 is the squared Pearson correlation; r02 is the r^2 of the fit through the origin
    y ≈ k p with k = sum(y p) / sum(p^2); rm2 = r2 * (1 - sqrt(|r2^2 - r02^2|)). It penalizes
    predictions that correlate with the labels but sit off the y = k p line, which Pearson alone
    would not.

    Args:
      y: [n] true affinities.
      p: [n] predicted affinities.

    Returns:
      rm2 (at most 1); nan when either side is constant or all predictions are 0.
    """
    y, p = _as_pair(y, p)
    dy = y - y.mean()
    dp = p - p.mean()
    ss_y = np.sum(dy * dy)
    with np.errstate(divide="ignore", invalid="ignore"):
        r2 = np.sum(dy * dp) ** 2 / (ss_y * np.sum(dp * dp))
        k = np.sum(y * p) / np.sum(p * p)
        r02 = 1.0 - np.sum((y - k * p) ** 2) / ss_y
        return float(r2 * (1.0 - np.sqrt(np.abs(r2 * r2 - r02 * r02))))


def regression_scores(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    """All four scores the Davis/KIBA papers report.

    Args:
      y: [n] true affinities.
      p: [n] predicted affinities.

    Returns:
      ``{"mse", "ci", "rm2", "pearson"}`` as floats.
    """
    y, p = _as_pair(y, p)
    return {
        "mse": mse(y, p),
        "ci": concordance_index(y, p),
        "rm2": rm2(y, p),
        "pearson": pearson(y, p),
    }


def translation_scores(hypotheses: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU and chrF of detokenized ``hypotheses`` against one reference each, on a
    0-100 scale: ``bleu`` and ``chrf`` with sacrebleu's defaults (case-sensitive, its 13a
    tokenization for BLEU: the WMT convention), and ``bleu_lowercase``, the same BLEU of
    lowercased text, which is closer to the tokenized, lowercased BLEU that much of the Multi30k
    literature reports (still not equal: its references are Moses-tokenized, which
    ``moses_bleu`` reproduces). Needs sacrebleu
    (``pip install 'hopperjax[translate]'``)."""
    if len(hypotheses) != len(references) or not references:
        raise ValueError(
            f"expected one hypothesis per reference, got {len(hypotheses)} and {len(references)}"
        )
    import sacrebleu

    return {
        "bleu": sacrebleu.corpus_bleu(hypotheses, [references]).score,
        "chrf": sacrebleu.corpus_chrf(hypotheses, [references]).score,
        "bleu_lowercase": sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True).score,
    }


def moses_tokenize(lines: list[str], lang: str, *, escape: bool = True) -> list[str]:
    """``lines`` as the Multi30k literature scores them: lowercased, then punctuation normalized
    and tokenized by the Moses scripts for ``lang`` (sacremoses, their Python port, with Perl
    parity: ``&quot;`` escapes, hyphenated compounds kept whole), as the dataset's own
    ``tok/*.lc.norm.tok.*`` files were made (its ``scripts/task1-tokenize.sh``: ``lowercase.perl
    | normalize-punctuation.perl -l LANG | tokenizer.perl -l LANG``); applied to the raw German
    test_2016_flickr references it gives their 12,103 tokens. ``escape=False`` keeps ``"``, ``&``
    and the like as they are (training text; scoring then escapes both sides alike). Needs
    sacremoses."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer = MosesPunctNormalizer(lang=lang, perl_parity=True)
    tokenizer = MosesTokenizer(lang=lang)
    return [
        tokenizer.tokenize(normalizer.normalize(s.lower()), return_str=True, escape=escape)
        for s in lines
    ]


def moses_bleu(hypotheses: list[str], references: list[str], lang: str) -> float:
    """Corpus BLEU (0-100) as the Multi30k literature computes it: of both sides'
    ``moses_tokenize`` tokens (whitespace-split, as fairseq's scorer and multi-bleu.perl count
    them), which is what papers that train on the dataset's tokenized files report. Reads higher
    than detokenized, case-sensitive BLEU (``translation_scores``'s ``bleu``), so compare each
    figure with the literature's of the same kind only. Needs sacremoses and sacrebleu (``pip
    install 'hopperjax[translate]'``)."""
    if len(hypotheses) != len(references) or not references:
        raise ValueError(
            f"expected one hypothesis per reference, got {len(hypotheses)} and {len(references)}"
        )
    import sacrebleu

    hyps, refs = moses_tokenize(hypotheses, lang), moses_tokenize(references, lang)
    # force: the text is tokenized on purpose (sacrebleu would warn that it looks tokenized).
    return sacrebleu.corpus_bleu(hyps, [refs], tokenize="none", force=True).score


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The exact area under the ROC curve of ``scores`` for binary ``labels`` (> 0.5 positive):
    the probability that a random positive scores above a random negative, ties counted half
    (Mann-Whitney U from average ranks), O(n log n). NaN when a class is absent."""
    y = np.asarray(labels, np.float64) > 0.5
    s = np.asarray(scores, np.float64)
    if y.shape != s.shape or y.ndim != 1:
        raise ValueError(f"labels and scores must be 1-D of one shape, got {y.shape}, {s.shape}")
    positives = int(y.sum())
    negatives = len(y) - positives
    if not positives or not negatives:
        return math.nan
    order = np.argsort(s, kind="stable")
    ordered = s[order]
    starts = np.r_[0, np.flatnonzero(np.diff(ordered)) + 1]
    ends = np.r_[starts[1:], len(s)]
    ranks = np.empty(len(s))
    ranks[order] = np.repeat((starts + ends + 1) / 2.0, ends - starts)  # 1-based, ties averaged
    return float((ranks[y].sum() - positives * (positives + 1) / 2.0) / (positives * negatives))
