"""Federated evaluation: the clients measure the global model on their own validation rows.

When the server holds no labelled evaluation set (``server.evaluate = "clients"``;
`FLConfig.client_eval`), a training request of an evaluation
round (`FLConfig.eval_every`, and the last round) carries ``meta.evaluate = true``. The
client then evaluates the model that request brings (the global model at the round's start,
before the round's update) on its validation rows (``data.split.validation``: a seeded share
of its rows, never trained on) and sends three numbers with its reply, in the clear: ``[rows,
loss sum, correct count]`` (``meta.eval`` of its update, or of its masked input under secure
aggregation, where the numbers are not secret-shared). The server checks them
(`check_eval`) and reports their sums as a weighted mean (`combine`): ``rows``, ``loss``
(sum of loss sums over the sum of rows) and ``accuracy`` (likewise; None for ``mse``), over
``clients`` clients.

Contract: the aggregate is exactly what evaluating on the union of the reporting clients'
validation rows gives (sums add), up to float addition order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tandem.errors import ConfigError

from .protocol import UpdateError
from .train import LocalTrainer

EVALUATE = "evaluate"  # meta key of a training request asking for an evaluation
EVAL = "eval"  # meta key of the reply carrying it: [rows, loss sum, correct count]


def measure(
    trainer: LocalTrainer, vec: np.ndarray, rows: tuple[np.ndarray, np.ndarray] | None
) -> list[float]:
    """``[rows, loss sum, correct count]`` of ``vec`` on ``rows`` (``[0, 0, 0]`` for none)."""
    if rows is None or rows[0].shape[0] == 0:
        return [0, 0.0, 0.0]
    loss, right = trainer.sums(vec, *rows)
    return [int(rows[0].shape[0]), loss, right]


def hold_out(
    x: np.ndarray, y: np.ndarray, share: float, seed: int | list[int]
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray] | None]:
    """``((x, y) to train on, validation rows or None)``: ``round(share * n)`` rows drawn by
    a generator seeded with ``seed`` (an int or a list of ints) are held out, leaving at
    least one to train on (a simulated client's split; a deployed client has
    ``data.split.validation``)."""
    if not 0 <= share < 1:
        raise ConfigError(f"the validation share must be in [0, 1), got {share}")
    n = x.shape[0]
    k = min(int(round(share * n)), n - 1)
    if k <= 0:
        return (x, y), None
    order = np.random.default_rng(seed).permutation(n)
    val, train = np.sort(order[:k]), np.sort(order[k:])
    return (x[train], y[train]), (x[val], y[val])


def check_eval(value: Any, *, who: str, max_rows: int) -> tuple[int, float, float]:
    """A client's ``meta.eval``, checked: ``rows`` an integer in ``[0, max_rows]``, the loss
    sum finite and >= 0, the correct count in ``[0, rows]``; `UpdateError` naming the fault."""
    if not isinstance(value, list) or len(value) != 3:
        raise UpdateError(
            f"{who}: meta.eval must be [rows, loss sum, correct count], got {value!r}"
        )
    n, loss, right = value
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= max_rows:
        raise UpdateError(f"{who}: meta.eval rows must be an integer in [0, {max_rows}], got {n!r}")
    for name, v in (("loss sum", loss), ("correct count", right)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0:
            raise UpdateError(f"{who}: meta.eval {name} must be a finite number >= 0, got {v!r}")
    if right > n:
        raise UpdateError(f"{who}: meta.eval correct count {right} exceeds its rows {n}")
    return n, float(loss), float(right)


def combine(evals: Mapping[str, tuple[int, float, float]], classifies: bool) -> dict | None:
    """The round's federated evaluation from the clients' checked sums: ``{"rows", "loss",
    "accuracy", "clients"}`` (None when no client reported a row)."""
    rows = sum(n for n, _, _ in evals.values())
    if rows == 0:
        return None
    return {
        "rows": rows,
        "loss": sum(loss for _, loss, _ in evals.values()) / rows,
        "accuracy": sum(r for _, _, r in evals.values()) / rows if classifies else None,
        "clients": sum(1 for n, _, _ in evals.values() if n > 0),
    }


def round_text(ev: Mapping[str, Any] | None) -> str:
    """A round line's federated evaluation (``", val_accuracy ..."``), or "" without one."""
    if ev is None:
        return ""
    acc = "" if ev["accuracy"] is None else f"val_accuracy {100 * ev['accuracy']:.2f}%, "
    return f", {acc}val_loss {ev['loss']:.4f} ({ev['rows']} rows on {ev['clients']} clients)"


def latest(reports: Sequence[Any]) -> dict[str, Any] | None:
    """The summary's ``client_eval``: the latest round report's ``evaluation``, rounded
    (accuracy in percent), with that round's number (1-based); None when no round has one."""
    for rep in reversed(reports):
        ev = rep.evaluation
        if ev is not None:
            acc = ev["accuracy"]
            return {
                "round": rep.round + 1,
                "rows": ev["rows"],
                "clients": ev["clients"],
                "loss": round(ev["loss"], 6),
                "accuracy": None if acc is None else round(100 * acc, 2),
            }
    return None


__all__ = [
    "EVAL",
    "EVALUATE",
    "check_eval",
    "combine",
    "hold_out",
    "latest",
    "measure",
    "round_text",
]
