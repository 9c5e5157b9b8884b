"""A user-like federated task, seeded and synthetic, to try FL's features on (compression and
its warm-up, quantized uplinks, ...) without data of one's own: a non-IID tabular task.

`make_task`: ``clients`` tables ("branches") of 20 numeric columns and one string categorical
column (``segment``, 8 values, `SEGMENTS`); the label (binary) depends non-linearly on both
(products and squares of numeric columns, a categorical offset and a categorical-times-numeric
interaction), plus label noise. Non-IID two ways: each client's numeric means are shifted by
its own draw (covariate shift, which also skews its labels), and its categorical mix is a
Dirichlet(``alpha``) draw. The held-out test set mixes every client's distribution. The
categorical column is one-hot encoded over the global vocabulary (what the federated
preprocessing gives every client), so a model sees 28 inputs. Everything is drawn from
``seed``: one seed, one task.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .data import FederatedData

NUMERIC = 20
SEGMENTS = tuple(f"seg_{c}" for c in "abcdefgh")


@dataclasses.dataclass(frozen=True)
class Table:
    """Rows of the user-like table: ``numeric`` (n, 20) float32, ``segment`` (n,) strings,
    ``label`` (n,) int32."""

    numeric: np.ndarray
    segment: np.ndarray
    label: np.ndarray

    def features(self) -> np.ndarray:
        """float32 ``[numeric | one-hot(segment)]`` over the global vocabulary `SEGMENTS`."""
        codes = np.searchsorted(np.asarray(SEGMENTS), self.segment)
        onehot = np.eye(len(SEGMENTS), dtype=np.float32)[codes]
        return np.concatenate([self.numeric, onehot], axis=1)


def _label(numeric: np.ndarray, codes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The shared concept: a fixed non-linear score of both column kinds, thresholded."""
    w = np.random.default_rng(12345).normal(size=NUMERIC) / np.sqrt(NUMERIC)
    offset = np.linspace(-1.0, 1.0, len(SEGMENTS))
    slope = np.cos(np.arange(len(SEGMENTS)))
    x = numeric
    score = (
        x @ w
        + 0.8 * x[:, 0] * x[:, 1]
        - 0.5 * (x[:, 2] ** 2 - 1.0)
        + np.tanh(2.0 * x[:, 3])
        + offset[codes]
        + slope[codes] * x[:, 4]
    )
    score += rng.normal(scale=0.45, size=score.shape)
    return (score > 0.3).astype(np.int32)


def make_client_table(
    rows: int, client: int, *, alpha: float, shift: float, seed: int, draw: int = 0
) -> Table:
    """Client ``client``'s rows: its own numeric mean shift and categorical mix (drawn from
    ``seed`` and the client's index, so a client's distribution is fixed by the seed); the
    rows themselves from ``draw`` too (0: training rows, 1: test rows)."""
    dist = np.random.default_rng([seed, client, 0])
    mean = dist.normal(scale=shift, size=NUMERIC)
    mix = dist.dirichlet(np.full(len(SEGMENTS), alpha))
    rng = np.random.default_rng([seed, client, 1 + draw])
    numeric = (rng.normal(size=(rows, NUMERIC)) + mean).astype(np.float32)
    codes = rng.choice(len(SEGMENTS), size=rows, p=mix)
    return Table(numeric, np.asarray(SEGMENTS)[codes], _label(numeric, codes, rng))


def make_task(
    *,
    clients: int = 6,
    rows: int = 4000,
    test_rows: int = 3000,
    alpha: float = 0.5,
    shift: float = 0.6,
    seed: int = 0,
) -> FederatedData:
    """The user-like task: ``clients`` tables of ``rows`` rows (see the module) and a test set
    of ``test_rows`` rows drawn evenly from every client's distribution."""
    parts = []
    for c in range(clients):
        t = make_client_table(rows, c, alpha=alpha, shift=shift, seed=seed)
        parts.append((t.features(), t.label))
    per = max(1, test_rows // clients)
    tests = [
        make_client_table(per, c, alpha=alpha, shift=shift, seed=seed, draw=1)
        for c in range(clients)
    ]
    x_test = np.concatenate([t.features() for t in tests])
    y_test = np.concatenate([t.label for t in tests])
    return FederatedData(tuple(parts), x_test, y_test, num_classes=2)
