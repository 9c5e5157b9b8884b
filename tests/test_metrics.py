"""`tandem.parties.split.metrics`: every metric equals scikit-learn's (or scipy's) on data with
many ties, degenerate inputs give None instead of a crash or NaN, and bad labels are refused."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hypothesis_profiles import examples
from tandem.parties.split import metrics as M

sk = pytest.importorskip("sklearn.metrics")


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


# scores on a coarse grid, so that most of them tie with others
tied_scores = hnp.arrays(
    np.float64, st.integers(2, 60), elements=st.integers(-6, 6).map(lambda k: k / 2)
)


@settings(max_examples=examples(60))
@given(tied_scores, st.randoms(use_true_random=False))
def test_auc_and_ks_equal_sklearn_and_scipy_with_ties(scores, rnd):
    from scipy.stats import ks_2samp

    labels = np.array([rnd.random() < 0.4 for _ in scores], np.float32)
    labels[0], labels[1] = 0.0, 1.0  # both classes present
    assert M.roc_auc(scores, labels) == pytest.approx(sk.roc_auc_score(labels, scores), abs=1e-12)
    want = ks_2samp(scores[labels == 1], scores[labels == 0]).statistic
    assert M.ks(scores, labels) == pytest.approx(want, abs=1e-12)
    fpr, tpr, _ = sk.roc_curve(labels, scores)
    assert M.ks(scores, labels) == pytest.approx(np.max(np.abs(tpr - fpr)), abs=1e-12)


@settings(max_examples=examples(40))
@given(
    hnp.arrays(np.float64, st.integers(1, 50), elements=st.floats(-8, 8)),
    st.randoms(use_true_random=False),
)
def test_binary_log_loss_accuracy_f1_equal_sklearn(logits, rnd):
    labels = np.array([rnd.random() < 0.5 for _ in logits], np.float64)
    got = M.task_metrics(logits.reshape(-1, 1), labels, "binary")
    assert got["loss"] == got["log_loss"]
    p = _sigmoid(logits)
    assert got["log_loss"] == pytest.approx(sk.log_loss(labels, p, labels=[0, 1]), rel=1e-9)
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, logits > 0))
    if labels.any() or (logits > 0).any():
        assert got["f1"] == pytest.approx(sk.f1_score(labels, logits > 0))
    else:
        assert got["f1"] is None


def test_binary_log_loss_equals_the_training_loss_and_stays_finite_far_out():
    import jax.numpy as jnp

    from tandem.engine.kernels import binary_logistic

    z = np.array([-300.0, -40.0, -1.0, 0.0, 2.5, 40.0, 300.0])
    y = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    train = float(jnp.mean(binary_logistic(jnp.asarray(z), jnp.asarray(y))))
    assert M.binary_log_loss(z, y) == pytest.approx(train, rel=1e-6)
    # a probability of exactly 0 or 1 in float64 (|z| > 37) would give log(0) without the
    # log domain: here the loss is the logit itself
    assert M.binary_log_loss(np.array([300.0]), np.array([0.0])) == pytest.approx(300.0)


@settings(max_examples=examples(40))
@given(
    st.integers(2, 5).flatmap(
        lambda k: hnp.arrays(
            np.float64, st.tuples(st.integers(1, 40), st.just(k)), elements=st.floats(-5, 5)
        )
    ),
    st.randoms(use_true_random=False),
)
def test_multiclass_metrics_equal_sklearn(logits, rnd):
    k = logits.shape[1]
    labels = np.array([rnd.randrange(k) for _ in range(len(logits))])
    got = M.task_metrics(logits, labels, "softmax")
    pred = logits.argmax(axis=1)
    z = logits - logits.max(axis=1, keepdims=True)
    proba = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    assert got["loss"] == got["log_loss"]
    assert got["log_loss"] == pytest.approx(
        sk.log_loss(labels, proba, labels=list(range(k))), rel=1e-7, abs=1e-12
    )
    assert got["accuracy"] == pytest.approx(sk.accuracy_score(labels, pred))
    assert got["macro_f1"] == pytest.approx(sk.f1_score(labels, pred, average="macro"))


@settings(max_examples=examples(40))
@given(
    st.integers(1, 3).flatmap(
        lambda k: hnp.arrays(
            np.float64, st.tuples(st.integers(2, 40), st.just(2 * k)), elements=st.floats(-9, 9)
        )
    )
)
def test_regression_metrics_equal_sklearn(both):
    k = both.shape[1] // 2
    pred, y = both[:, :k], both[:, k:]
    got = M.task_metrics(pred, y, "mse")
    assert got["rmse"] == pytest.approx(sk.root_mean_squared_error(y, pred), abs=1e-9)
    assert got["mae"] == pytest.approx(sk.mean_absolute_error(y, pred), abs=1e-9)
    assert got["loss"] == pytest.approx(0.5 * np.mean(np.sum((pred - y) ** 2, axis=1)))
    if np.all(np.ptp(y, axis=0) > 0):
        assert got["r2"] == pytest.approx(sk.r2_score(y, pred), abs=1e-9)
    else:
        assert got["r2"] is None


def test_degenerate_inputs_are_none_not_a_crash():
    one_class = M.task_metrics(np.array([0.3, -1.0, 2.0]), np.ones(3), "binary")
    assert one_class["auc"] is None and one_class["ks"] is None
    assert one_class["accuracy"] == pytest.approx(2 / 3)
    assert one_class["f1"] == pytest.approx(0.8)  # defined: there are positive labels
    nothing_positive = M.task_metrics(np.array([-1.0, -2.0]), np.zeros(2), "binary")
    assert nothing_positive["f1"] is None and nothing_positive["accuracy"] == 1.0
    empty = M.task_metrics(np.zeros((0, 1)), np.zeros(0), "binary")
    assert empty == {name: None for name in M.metric_names("binary")}
    assert M.task_metrics(np.zeros((0, 3)), np.zeros(0), "softmax")["macro_f1"] is None
    assert M.r2(np.array([1.0, 2.0]), np.array([5.0, 5.0])) is None
    assert M.task_metrics(np.zeros((0, 1)), np.zeros(0), "mse")["rmse"] is None
    # a diverged model: the loss shows it, the score ranks are undefined
    diverged = M.task_metrics(np.array([np.nan, 1.0]), np.array([0.0, 1.0]), "binary")
    assert np.isnan(diverged["loss"]) and diverged["auc"] is None and diverged["ks"] is None


def test_labels_that_do_not_fit_are_refused():
    with pytest.raises(M.MetricError, match=r"integer classes in \[0, 3\)"):
        M.task_metrics(np.zeros((2, 3)), np.array([0, 3]), "softmax")
    with pytest.raises(M.MetricError, match="one logit per row"):
        M.task_metrics(np.zeros((4, 2)), np.zeros(4), "binary")
    with pytest.raises(M.MetricError, match="differ in shape"):
        M.task_metrics(np.zeros((4, 2)), np.zeros(4), "mse")
    with pytest.raises(M.MetricError, match="the losses are"):
        M.metric_names("hinge")


def test_auc_and_ks_are_exact_at_a_million_rows():
    rng = np.random.default_rng(0)
    n = 1_000_000
    scores = np.round(rng.normal(size=n), 2)  # about 800 distinct values: heavy ties
    labels = rng.random(n) < _sigmoid(scores)
    assert M.roc_auc(scores, labels) == pytest.approx(sk.roc_auc_score(labels, scores), abs=1e-12)
    fpr, tpr, _ = sk.roc_curve(labels, scores)
    assert M.ks(scores, labels) == pytest.approx(np.max(tpr - fpr), abs=1e-12)
