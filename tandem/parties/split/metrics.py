"""Evaluation metrics of a split-learning model's outputs (pure numpy; no training state).

`task_metrics(outputs, labels, loss)` returns every metric of the task a loss defines:

* ``"binary"`` (one logit per row, labels 0/1): ``loss``, ``log_loss``, ``accuracy``, ``auc``,
  ``f1``, ``ks``;
* ``"softmax"`` (one logit per class, integer labels): ``loss``, ``log_loss``, ``accuracy``,
  ``macro_f1``;
* ``"mse"`` (any number of outputs per row): ``loss``, ``rmse``, ``mae``, ``r2``.

``loss`` is the training objective on these rows, averaged per row (what ``train_loss`` averages
over an epoch), so the two compare directly. The log-losses are computed from the logits in the
log domain (log-sigmoid, log-softmax): exactly what training minimises, finite for every finite
logit, with no ``log(0)`` for a probability that rounds to 0 or 1 (clipping the probability, as
scikit-learn does, caps a confidently wrong row's loss; the log domain does not have to).

Contracts: every function is vectorised (a sort at most: O(n log n), fine at millions of rows);
ties are exact (AUC and KS treat equal scores as one threshold); a metric undefined on its input
is ``None``, never an exception and never NaN: AUC and KS with one class only, F1 with no
positive label and no positive prediction, R² with constant labels, any metric of an empty set.
A non-finite output makes the metrics of the scores (AUC, KS) ``None`` too, while the losses
show it (``inf``/``nan``: a diverged model is reported, not hidden). Labels that do not fit the
loss (a class outside ``[0, classes)``, a shape that does not match the outputs) raise
`MetricError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from tandem.errors import TandemError

from ..rank import auc, rank_counts

Metric = float | None


class MetricError(TandemError, ValueError):
    """Outputs and labels that no metric of the loss can compare (shape, class range)."""


# -- binary --------------------------------------------------------------------------------------
def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    """``log(sigmoid(z))`` without overflow: ``-softplus(-z)``."""
    return -np.logaddexp(0.0, -z)


def binary_log_loss(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """Mean ``-[y log p + (1 - y) log(1 - p)]`` with ``p = sigmoid(logit)``, in the log domain
    (equal to optax's ``sigmoid_binary_cross_entropy``, the ``"binary"`` training loss)."""
    z, y = _pair(logits, labels)
    if not len(z):
        return None
    with np.errstate(invalid="ignore"):  # a NaN logit gives a NaN loss, on purpose
        return float(np.mean(-(y * _log_sigmoid(z) + (1.0 - y) * _log_sigmoid(-z))))


def binary_accuracy(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """Share of rows whose prediction ``logit > 0`` (``p > 0.5``) equals ``label > 0.5``."""
    z, y = _pair(logits, labels)
    return float(np.mean((z > 0) == (y > 0.5))) if len(z) else None


def f1(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """F1 of the positive class at ``p > 0.5``: ``2 TP / (2 TP + FP + FN)``; None when no label
    and no prediction is positive (scikit-learn reports 0.0 there, with a warning)."""
    z, y = _pair(logits, labels)
    pred, true = z > 0, y > 0.5
    tp = int(np.count_nonzero(pred & true))
    denominator = 2 * tp + int(np.count_nonzero(pred ^ true))
    return 2 * tp / denominator if denominator else None


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> Metric:
    """Area under the ROC curve: the probability that a random positive scores above a random
    negative, ties counting one half (the Mann-Whitney statistic, equal to the trapezoidal area
    under the ROC curve with one threshold per distinct score). None with one class only."""
    s, y = _pair(scores, labels)
    return auc(s, y > 0.5)


def ks(scores: np.ndarray, labels: np.ndarray) -> Metric:
    """Kolmogorov-Smirnov statistic: the largest gap between the score distributions of the
    positives and the negatives, ``max |F_pos(t) - F_neg(t)|`` over thresholds ``t`` (equal to
    ``max |TPR - FPR|``). None with one class only."""
    s, y = _pair(scores, labels)
    counts = rank_counts(s, y > 0.5)
    if counts is None:
        return None
    pos, neg = counts
    gap = np.cumsum(pos) / pos.sum() - np.cumsum(neg) / neg.sum()
    return float(np.max(np.abs(gap)))


# -- multiclass ----------------------------------------------------------------------------------
def _classes(logits: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    z = np.asarray(logits, np.float64)
    if z.ndim != 2:
        raise MetricError(f"softmax outputs must be [rows, classes], got shape {list(z.shape)}")
    y = np.asarray(labels).reshape(-1)
    if len(y) != len(z):
        raise MetricError(f"{len(z)} output rows but {len(y)} labels")
    classes = z.shape[1]
    if len(y) and (not np.all(y == np.round(y)) or y.min() < 0 or y.max() >= classes):
        raise MetricError(
            f"softmax labels must be integer classes in [0, {classes}) (the model has "
            f"{classes} outputs); got values from {y.min()} to {y.max()}"
        )
    return z, y.astype(np.int64)


def softmax_log_loss(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """Mean ``-log softmax(logits)[label]`` (log-sum-exp; the ``"softmax"`` training loss)."""
    z, y = _classes(logits, labels)
    if not len(y):
        return None
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite logits show in the loss
        top = z.max(axis=1, keepdims=True)
        log_norm = np.log(np.sum(np.exp(z - top), axis=1)) + top[:, 0]
        return float(np.mean(log_norm - z[np.arange(len(y)), y]))


def multiclass_accuracy(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """Share of rows whose largest logit is at the label's class (first of tied maxima)."""
    z, y = _classes(logits, labels)
    return float(np.mean(z.argmax(axis=1) == y)) if len(y) else None


def macro_f1(logits: np.ndarray, labels: np.ndarray) -> Metric:
    """Unweighted mean of the per-class F1 over the classes that occur among the labels or the
    predictions (a class in neither has no F1); scikit-learn's ``f1_score(average="macro")``."""
    z, y = _classes(logits, labels)
    if not len(y):
        return None
    k = z.shape[1]
    pred = z.argmax(axis=1)
    tp = np.bincount(y[pred == y], minlength=k).astype(np.float64)
    in_labels = np.bincount(y, minlength=k)
    in_preds = np.bincount(pred, minlength=k)
    denominator = in_labels + in_preds  # 2 TP + FP + FN, per class
    seen = denominator > 0
    return float(np.mean(2 * tp[seen] / denominator[seen]))


# -- regression ----------------------------------------------------------------------------------
def _columns(outputs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, np.float64)
    rows = y.shape[0] if y.ndim else 0
    p = np.asarray(outputs, np.float64).reshape(rows, -1) if rows else np.zeros((0, 1))
    y = y.reshape(rows, -1) if rows else np.zeros((0, 1))
    if p.shape != y.shape:
        raise MetricError(
            f"regression outputs {list(p.shape)} and labels {list(y.shape)} differ in shape"
        )
    return p, y


def rmse(outputs: np.ndarray, labels: np.ndarray) -> Metric:
    """Root mean squared error per output column, averaged over the columns (scikit-learn's
    ``root_mean_squared_error``, ``multioutput="uniform_average"``)."""
    p, y = _columns(outputs, labels)
    return float(np.mean(np.sqrt(np.mean((p - y) ** 2, axis=0)))) if len(y) else None


def mae(outputs: np.ndarray, labels: np.ndarray) -> Metric:
    """Mean absolute error over every row and output column."""
    p, y = _columns(outputs, labels)
    return float(np.mean(np.abs(p - y))) if len(y) else None


def r2(outputs: np.ndarray, labels: np.ndarray) -> Metric:
    """Coefficient of determination ``1 - SS_res / SS_tot`` per output column, averaged over
    the columns; None if a column's labels are constant (``SS_tot = 0``: R² is undefined)."""
    p, y = _columns(outputs, labels)
    if not len(y):
        return None
    if np.any(np.ptp(y, axis=0) == 0):  # exactly constant, whatever the mean's rounding
        return None
    ss_tot = np.sum((y - y.mean(axis=0)) ** 2, axis=0)
    ss_res = np.sum((y - p) ** 2, axis=0)
    return float(np.mean(1.0 - ss_res / ss_tot))


def mse_loss(outputs: np.ndarray, labels: np.ndarray) -> Metric:
    """The ``"mse"`` training loss: mean over rows of ``0.5 * sum((output - label)^2)``."""
    p, y = _columns(outputs, labels)
    return float(np.mean(0.5 * np.sum((p - y) ** 2, axis=1))) if len(y) else None


# -- per loss ------------------------------------------------------------------------------------
MetricFn = Callable[[np.ndarray, np.ndarray], Metric]

#: loss name -> metric name -> function(outputs, labels); the order is the report's order.
METRICS: Mapping[str, Mapping[str, MetricFn]] = {
    "binary": {
        "loss": binary_log_loss,
        "log_loss": binary_log_loss,
        "accuracy": binary_accuracy,
        "auc": roc_auc,
        "f1": f1,
        "ks": ks,
    },
    "softmax": {
        "loss": softmax_log_loss,
        "log_loss": softmax_log_loss,
        "accuracy": multiclass_accuracy,
        "macro_f1": macro_f1,
    },
    "mse": {"loss": mse_loss, "rmse": rmse, "mae": mae, "r2": r2},
}

#: Metrics that are better when smaller (every other metric is better when larger).
LOWER_IS_BETTER = frozenset({"loss", "log_loss", "rmse", "mae"})


def metric_names(loss: str) -> tuple[str, ...]:
    """The metric names `task_metrics` reports for ``loss``."""
    if loss not in METRICS:
        raise MetricError(f"no metrics for loss {loss!r}; the losses are {sorted(METRICS)}")
    return tuple(METRICS[loss])


def task_metrics(outputs: np.ndarray, labels: np.ndarray, loss: str) -> dict[str, Metric]:
    """Every metric of ``loss`` (see the module docstring) of the model ``outputs`` (logits for
    ``"binary"`` and ``"softmax"``) against ``labels``; the log-loss is computed once."""
    names = metric_names(loss)
    out: dict[str, Metric] = {}
    for name in names:
        fn = METRICS[loss][name]
        same = [k for k in out if METRICS[loss][k] is fn]
        out[name] = out[same[0]] if same else fn(outputs, labels)
    return out


#: The former name of `task_metrics` (it covers regression too).
classification_metrics = task_metrics


def _pair(scores: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One float64 score and one float64 label per row, checked to be as many."""
    y = np.asarray(labels, np.float64).reshape(-1)
    s = np.asarray(scores, np.float64).reshape(-1)
    if s.shape != y.shape:
        raise MetricError(
            f"binary outputs must be one logit per row: {s.size} outputs for {y.size} labels"
        )
    return s, y


__all__ = [
    "LOWER_IS_BETTER",
    "METRICS",
    "MetricError",
    "binary_accuracy",
    "binary_log_loss",
    "classification_metrics",
    "f1",
    "ks",
    "macro_f1",
    "mae",
    "metric_names",
    "mse_loss",
    "multiclass_accuracy",
    "r2",
    "rmse",
    "roc_auc",
    "softmax_log_loss",
    "task_metrics",
]
