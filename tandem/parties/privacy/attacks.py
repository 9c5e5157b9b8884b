"""The published attacks on what split learning sends, as pure numpy functions.

Label owner (its cut gradients; Li et al., "Label Leakage and Protection in Two-party Split
Learning", ICLR 2022):

* `norm_scores`: a row's score is its gradient's L2 norm. With an imbalanced binary label the
  rarer class's rows have larger gradients (the loss's gradient is ``sigmoid(z) - y``), so the
  norm alone ranks positives above negatives.
* `cosine_scores`: a row's score is the cosine similarity of its gradient to the gradient of
  one row the attacker knows to be positive (one per batch). For a binary label the gradients
  of the two classes point in opposite directions along the top's input weights.
* `attack_auc`: the AUC an attacker reaches with those scores against the true labels,
  ``max(AUC, 1 - AUC)`` (an attacker picks the better direction): 0.5 is chance, 1.0 recovers
  every label. Rank-based (`tandem.parties.rank.auc`, which the model metrics use too: a sort
  and group sums in float64), so millions of rows neither overflow nor lose precision.

Feature owner (its cut activations): `decoder_r2` fits a ridge regression from activations to
the party's own features on a share of rows (rows an attacker could hold, e.g. leaked
records) and reports the R^2 of its reconstruction on the other rows.
"""

from __future__ import annotations

import numpy as np

from tandem.errors import ConfigError

from ..rank import auc

#: Ridge penalty of `decoder_r2`, relative to the mean eigenvalue of the activations' Gram
#: matrix: at least `RIDGE`, and ``0.1 * dims / fitted rows`` when that is larger, so a fit on
#: few rows (1 % of a small sample) shrinks towards the mean instead of overfitting, while a
#: well-posed fit is left nearly alone.
RIDGE = 1e-3


def flat_rows(tensor: np.ndarray) -> np.ndarray:
    """``tensor`` as a float64 matrix of one row per sample (trailing axes flattened)."""
    t = np.asarray(tensor)
    return t.reshape(len(t), -1).astype(np.float64, copy=False)


def norm_scores(grads: np.ndarray) -> np.ndarray:
    """Each row's gradient L2 norm (the norm attack's score)."""
    return np.linalg.norm(flat_rows(grads), axis=1)


def cosine_scores(grads: np.ndarray, known: int) -> np.ndarray:
    """Each row's cosine similarity to row ``known``'s gradient (the direction attack's
    score, with row ``known`` the attacker's one known positive). A zero gradient scores 0."""
    g = flat_rows(grads)
    if not 0 <= known < len(g):
        raise ConfigError(f"known row {known} is outside the {len(g)} rows of the gradients")
    ref = g[known]
    norms = np.linalg.norm(g, axis=1) * np.linalg.norm(ref)
    dots = g @ ref
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)


def attack_auc(scores: np.ndarray, positive: np.ndarray) -> float | None:
    """``max(AUC, 1 - AUC)`` of ``scores`` against the boolean ``positive``; None when a class
    is absent or a score is not finite (no AUC is defined)."""
    found = auc(scores, positive)
    return None if found is None else max(found, 1.0 - found)


def decoder_r2(
    acts: np.ndarray, feats: np.ndarray, share: float, rng: np.random.Generator
) -> float | None:
    """R^2 on the held-out rows of a ridge decoder from ``acts`` to ``feats`` fitted on a
    ``share`` of the rows (at least 2), chosen by ``rng``.

    R^2 is averaged over the feature columns that vary on the held-out rows (1 - residual sum
    of squares / total sum of squares per column, each floored at 0: where the decoder does
    worse than the column's mean, an attacker guesses the mean): 1 means the activations reveal
    the features exactly (to a linear attacker), 0 no better than knowing their mean. None when
    fewer than 2 rows are held out or no column varies there.
    """
    if not 0 < share < 1:
        raise ConfigError(f"the decoder's share of fitted rows must be in (0, 1), got {share}")
    a, f = flat_rows(acts), flat_rows(feats)
    if len(a) != len(f):
        raise ConfigError(f"{len(a)} activation rows but {len(f)} feature rows")
    n_fit = max(2, int(round(share * len(a))))
    if len(a) - n_fit < 2:
        return None
    order = rng.permutation(len(a))
    fit, test = order[:n_fit], order[n_fit:]
    a_mean, f_mean = a[fit].mean(axis=0), f[fit].mean(axis=0)
    af, ff = a[fit] - a_mean, f[fit] - f_mean
    gram = af.T @ af
    scale = max(RIDGE, 0.1 * len(gram) / n_fit)
    lam = scale * max(float(np.trace(gram)) / max(len(gram), 1), 1e-12)
    w = np.linalg.solve(gram + lam * np.eye(len(gram)), af.T @ ff)
    pred = (a[test] - a_mean) @ w + f_mean
    truth = f[test]
    sst = ((truth - truth.mean(axis=0)) ** 2).sum(axis=0)
    sse = ((truth - pred) ** 2).sum(axis=0)
    varies = sst > 1e-12 * max(float(sst.max(initial=0.0)), 1e-300)
    if not varies.any():
        return None
    return float(np.mean(np.maximum(0.0, 1.0 - sse[varies] / sst[varies])))


__all__ = ["RIDGE", "attack_auc", "cosine_scores", "decoder_r2", "flat_rows", "norm_scores"]
