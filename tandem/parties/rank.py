"""Rank statistics of scores against a binary label, shared by the metrics of a model
(`tandem.parties.split.metrics`) and the attacks of the leakage audit
(`tandem.parties.privacy.attacks`).

Contracts: vectorised (one sort: O(n log n), fine at millions of rows), counts summed in
float64 (no integer overflow), ties exact (equal scores form one threshold); undefined results
are None, never NaN.
"""

from __future__ import annotations

import numpy as np


def rank_counts(scores: np.ndarray, positive: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Positives and negatives at each distinct score, in ascending score order (ties form one
    group); None if a score is not finite or a class is absent."""
    if not len(scores) or not np.all(np.isfinite(scores)):
        return None
    order = np.argsort(scores)
    ranked = scores[order]
    starts = np.concatenate(([0], np.flatnonzero(ranked[1:] != ranked[:-1]) + 1))
    pos = np.add.reduceat(positive[order].astype(np.float64), starts)
    neg = np.diff(np.append(starts, len(ranked))) - pos
    if pos.sum() == 0 or neg.sum() == 0:
        return None
    return pos, neg


def auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """The probability that a random positive scores above a random negative, ties counting
    one half (the Mann-Whitney statistic: the area under the ROC curve with one threshold per
    distinct score); None with one class only or a score that is not finite."""
    counts = rank_counts(np.asarray(scores, np.float64), np.asarray(positive, bool))
    if counts is None:
        return None
    pos, neg = counts
    below = np.cumsum(neg) - neg  # negatives strictly below each score group
    wins = np.sum(pos * (below + 0.5 * neg))
    return float(wins / (pos.sum() * neg.sum()))


__all__ = ["auc", "rank_counts"]
