"""Classification metrics from logits (numpy; no training state)."""

from __future__ import annotations

import numpy as np


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve (rank statistic, ties averaged); NaN if one class is absent."""
    from scipy.stats import rankdata

    labels = labels.astype(bool)
    pos, neg = labels.sum(), (~labels).sum()
    if pos == 0 or neg == 0:
        return float("nan")
    ranks = rankdata(scores)
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def classification_metrics(logits: np.ndarray, labels: np.ndarray, loss: str) -> dict:
    logits = np.asarray(logits, np.float64)
    labels = np.asarray(labels)
    if loss == "binary":
        z = logits.reshape(labels.shape)
        p = _sigmoid(z)
        eps = 1e-12
        bce = -np.mean(labels * np.log(p + eps) + (1 - labels) * np.log(1 - p + eps))
        return {
            "loss": float(bce),
            "accuracy": float(np.mean((z > 0) == (labels > 0.5))),
            "auc": auc(z, labels),
        }
    if loss == "softmax":
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return {
            "loss": float(-np.mean(logp[np.arange(len(labels)), labels.astype(int)])),
            "accuracy": float(np.mean(logits.argmax(axis=1) == labels)),
        }
    return {
        "loss": float(
            0.5
            * np.mean(
                np.sum(
                    (logits.reshape(len(labels), -1) - labels.reshape(len(labels), -1)) ** 2, axis=1
                )
            )
        )
    }
