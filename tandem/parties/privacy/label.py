"""The label owner's defenses: what the cut gradients it sends, and the labels it trains on,
reveal about its labels.

* `defend_gradient`: on each training batch's outgoing cut gradient, norm alignment plus noise
  (Li et al., "Label Leakage and Protection in Two-party Split Learning", ICLR 2022: the
  norm-alignment baseline of that paper, with isotropic Gaussian noise) and/or per-row clipping
  plus Gaussian noise. Both act on each row's gradient of its own loss (the cut gradient times
  the batch rows, as the loss stage scales each row by ``1/rows``), so their parameters do not
  depend on the batch size.
* `randomize_labels`: label differential privacy by randomized response with prior
  (RR-with-prior, Algorithm 2 of Ghazi et al., "Deep Learning with Label Differential Privacy",
  NeurIPS 2021), applied once to the training labels before training.

Randomness is row-keyed (`tandem.parties.privacy.noise`): same row, same noise, whatever the
micro-batching.
"""

from __future__ import annotations

import math

import numpy as np

from tandem.errors import ConfigError

from . import noise
from .config import GradientAlignment, GradientDP, LabelDP
from .rows import align_rows, clip_rows


def defend_gradient(
    g: np.ndarray,
    *,
    alignment: GradientAlignment | None,
    dp: GradientDP | None,
    seed: int,
    secret: int,
    step: int,
    ids: np.ndarray,
    rows: int,
    stage: int = 0,
) -> np.ndarray:
    """The cut gradient ``g`` (rows ``ids`` of a batch of ``rows`` rows) as the label owner
    sends it: aligned then noised (``alignment``), then clipped and noised (``dp``), the noise
    keyed by ``secret`` (the label owner's `tandem.parties.privacy.noise.party_secret`, which
    the receivers must not know); the ``dtype`` of ``g`` kept."""
    per_row = np.asarray(g, np.float32) * np.float32(rows)
    shape = per_row.shape[1:]
    if alignment is not None:
        per_row = align_rows(per_row, alignment.norm)
        if alignment.noise > 0:
            z = noise.row_normal(seed, noise.ALIGNMENT, step, ids, shape, stage, secret=secret)
            per_row = per_row + np.float32(alignment.noise * alignment.norm) * z
    if dp is not None:
        per_row = clip_rows(per_row, dp.clip)
        if dp.noise_multiplier > 0:
            z = noise.row_normal(seed, noise.GRADIENT_DP, step, ids, shape, stage, secret=secret)
            per_row = per_row + np.float32(dp.noise_multiplier * dp.clip) * z
    return (per_row / np.float32(rows)).astype(np.asarray(g).dtype)


def classes_of(labels: np.ndarray, loss: str) -> int:
    """The number of classes label DP randomizes over: 2 for ``"binary"``, ``max + 1`` for
    ``"softmax"``; `ConfigError` for a regression loss or labels that are not classes."""
    y = np.asarray(labels)
    if loss not in ("binary", "softmax"):
        raise ConfigError(
            f"privacy.label_dp randomizes class labels, but [train] loss is {loss!r}; use it "
            'with loss = "binary" or "softmax", or remove [privacy.label_dp]'
        )
    flat = y.reshape(-1)
    if flat.size and (np.any(flat != np.round(flat)) or flat.min() < 0):
        raise ConfigError(
            "privacy.label_dp needs class labels 0..K-1, but the training labels hold other "
            "values; encode the label column as classes or remove [privacy.label_dp]"
        )
    k = 2 if loss == "binary" else int(flat.max()) + 1 if flat.size else 1
    if loss == "binary" and flat.size and flat.max() > 1:
        raise ConfigError(
            'privacy.label_dp: loss = "binary" needs labels 0 and 1, got a label '
            f'{flat.max()!r}; use loss = "softmax" for more classes'
        )
    return max(k, 1)


def rr_top_k(prior: np.ndarray, epsilon: float) -> np.ndarray:
    """RR-with-prior's candidate set: the ``k`` most likely classes under ``prior`` for the
    ``k`` that maximises ``mass(top k) * e^eps / (e^eps + k - 1)`` (classes, most likely
    first)."""
    order = np.argsort(-np.asarray(prior, np.float64), kind="stable")
    mass = np.cumsum(np.asarray(prior, np.float64)[order])
    e = math.exp(epsilon)
    k = np.arange(1, len(order) + 1)
    best = int(np.argmax(mass * e / (e + k - 1))) + 1
    return order[:best]


def randomize_labels(
    labels: np.ndarray,
    config: LabelDP,
    *,
    loss: str,
    seed: int,
    secret: int,
    ids: np.ndarray | None = None,
) -> np.ndarray:
    """RR-with-prior of ``labels`` (one per row; row ``i`` keyed by ``ids[i]``, default its
    index, and by the label owner's ``secret``, which no other party may know: with it, the
    row's coin says whether its label was kept): a row whose label is in the candidate set
    `rr_top_k` keeps it with probability ``e^eps / (e^eps + k - 1)``, else takes one of the
    other ``k - 1`` candidates uniformly; a label outside the set becomes a uniform candidate.
    epsilon-label-DP per row for the given prior. The prior ``"labels"`` is the class
    frequencies of ``labels`` (a global prior; the frequencies themselves are not protected),
    ``"uniform"`` gives plain K-ary randomized response (flip probability
    ``(K - 1) / (e^eps + K - 1)``)."""
    y = np.asarray(labels)
    k_all = classes_of(y, loss)
    cls = np.round(y.reshape(len(y), -1)[:, 0]).astype(np.int64)
    ids = np.arange(len(y)) if ids is None else np.asarray(ids)
    if config.prior == "labels":
        prior = np.bincount(cls, minlength=k_all) / max(len(cls), 1)
    else:
        prior = np.full(k_all, 1.0 / k_all)
    cand = rr_top_k(prior, config.epsilon)
    k = len(cand)
    u = noise.row_uniform(seed, noise.LABEL_DP, 0, ids, (2,), secret=secret).astype(np.float64)
    keep = u[:, 0] < math.exp(config.epsilon) / (math.exp(config.epsilon) + k - 1)
    pos = np.full(len(cls), -1)
    for rank, c in enumerate(cand):
        pos[cls == c] = rank
    inside = pos >= 0
    # another candidate than the own one: index in 0..k-2, shifted past the own position
    other = np.minimum((u[:, 1] * max(k - 1, 1)).astype(np.int64), max(k - 2, 0))
    other = other + (other >= pos)
    anywhere = np.minimum((u[:, 1] * k).astype(np.int64), k - 1)
    j = np.where(inside, np.where(keep | (k == 1), pos, other), anywhere)
    out = cand[np.clip(j, 0, k - 1)]
    return out.astype(y.dtype).reshape(y.shape) if y.ndim == 1 else _like(y, out)


def _like(y: np.ndarray, cls: np.ndarray) -> np.ndarray:
    out = np.array(y, copy=True)
    out.reshape(len(y), -1)[:, 0] = cls
    return out


__all__ = ["classes_of", "defend_gradient", "randomize_labels", "rr_top_k"]
