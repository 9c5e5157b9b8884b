"""How the FL server combines the clients' updates of a round: the `Aggregator` seam.

An `Aggregator` is a pair of pure functions (optax style), plus one declaration:

* ``init(like) -> state``: the rule's state before the first round. ``like`` is a float32
  zero array of the shape ``aggregate`` will be given (see ``linear``);
* ``aggregate(state, updates, weights) -> (combined, new_state)``: combine one round's
  ``updates`` (float32 arrays of equal shape, in client-name order, at least one) with their
  ``weights`` (the clients' sample counts, > 0) into one float32 array of that shape; no
  mutation of its arguments, no hidden state (everything it keeps is in ``state``, which the
  server's checkpoint stores as tensors: a pytree of arrays);
* ``linear``: whether ``aggregate`` commutes with the uplink's decoding, i.e. is a fixed linear
  combination of its inputs. Rand-k and count sketches are linear, so the server gives a linear
  aggregator the round's *compressed* payloads (``like`` then has the payload's shape) and
  decodes the combination once; a non-linear one (a median, a trimmed mean) is given each
  client's *decoded* update (shape ``(d,)``), since a median of sketches is not a sketch of
  the median. With the dense uplink both see ``(d,)``.

What a rule needs from outside (a count of tolerated attackers, a fraction) is an argument of
its constructor. The server rule (momentum, error feedback, an optax optimizer: ``aggregate``
module) applies to the combined update afterwards; the seam only decides how updates combine.
`weighted_mean` is the default (FedAvg); `coordinate_median` and `trimmed_mean` are the
classic coordinate-wise robust rules (Yin et al., 2018).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from tandem.errors import ConfigError


class Aggregator(NamedTuple):
    """A combination rule for client updates; see the module docstring for the contract."""

    init: Callable[[np.ndarray], Any]
    aggregate: Callable[[Any, Sequence[np.ndarray], Sequence[float]], tuple[np.ndarray, Any]]
    linear: bool


def _check(updates: Sequence[np.ndarray], weights: Sequence[float]) -> None:
    """Raise `ConfigError` unless there is one weight per update and all have one shape."""
    if not updates:
        raise ConfigError("cannot aggregate zero updates")
    if len(updates) != len(weights):
        raise ConfigError(f"got {len(updates)} updates but {len(weights)} weights")
    shapes = {np.shape(u) for u in updates}
    if len(shapes) != 1:
        raise ConfigError(f"updates to aggregate have different shapes: {sorted(shapes)}")


def _stack(updates: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """The updates as one float32 ``(n, ...)`` array (checked by `_check`)."""
    _check(updates, weights)
    return np.stack([np.asarray(u, np.float32) for u in updates])


def _no_state(like: np.ndarray) -> tuple[()]:
    return ()


def weighted_mean() -> Aggregator:
    """``sum_i w_i u_i / sum_i w_i`` in float32, the clients' sample counts as weights
    (FedAvg). Linear: the server combines compressed payloads and decodes once."""

    def aggregate(state, updates, weights):
        _check(updates, weights)
        total = float(sum(weights))
        if not total > 0:
            raise ConfigError(f"aggregation weights must sum to > 0, got {list(weights)}")
        out = np.zeros_like(np.asarray(updates[0], np.float32))
        for u, w in zip(updates, weights, strict=True):
            out += np.float32(w / total) * np.asarray(u, np.float32)
        return out, state

    return Aggregator(_no_state, aggregate, linear=True)


def coordinate_median() -> Aggregator:
    """The median of each coordinate over the round's clients (unweighted: a client's weight
    is its own claim, which a robust rule does not trust). With an even count, the mean of the
    two middle values. Not linear: the server decodes each update first."""

    def aggregate(state, updates, weights):
        return np.median(_stack(updates, weights), axis=0).astype(np.float32), state

    return Aggregator(_no_state, aggregate, linear=False)


def trimmed_mean(fraction: float) -> Aggregator:
    """Per coordinate, drop the ``floor(fraction * n)`` largest and as many smallest of the
    ``n`` clients' values and average the rest (unweighted). ``fraction`` in [0, 0.5);
    0 is the plain mean. Not linear: the server decodes each update first."""
    if not 0.0 <= fraction < 0.5:
        raise ConfigError(
            f"trimmed_mean fraction must be in [0, 0.5) (the share dropped at each end), "
            f"got {fraction}"
        )

    def aggregate(state, updates, weights):
        stacked = _stack(updates, weights)
        n = stacked.shape[0]
        cut = int(fraction * n)
        kept = np.sort(stacked, axis=0)[cut : n - cut]
        return kept.mean(axis=0, dtype=np.float32), state

    return Aggregator(_no_state, aggregate, linear=False)


def check_secure(rule: Aggregator) -> None:
    """Refuse a rule that secure aggregation cannot run: the server sees only the sum, so a
    non-linear rule (median, trimmed mean, Krum) has nothing to work on. Under secure
    aggregation a linear rule's combination is the survivors' unweighted mean (a weight per
    client would need each client's update)."""
    if not rule.linear:
        raise ConfigError(
            "secure aggregation cannot run a non-linear aggregation rule: a median (or trimmed "
            "mean, Krum) needs each client's update; secure aggregation hides them. Use the "
            "weighted mean (the default) or turn secure aggregation off"
        )


__all__ = ["Aggregator", "check_secure", "coordinate_median", "trimmed_mean", "weighted_mean"]
