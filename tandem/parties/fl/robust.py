"""Robust aggregation rules beyond the coordinate-wise ones (`aggregator`): Krum, Multi-Krum
and norm bounding, each an `Aggregator` (the seam's contract holds: pure, state passed in and
out, float32 in and out).

None of them is linear, so under a compressed uplink the server hands them each client's
*decoded* update (a rand-k update is sparse: distances and norms are those of the decoded
vectors), and secure aggregation refuses them (`aggregator.check_secure`): the server sees only
the sum.

`build_rule` turns the server TOML's ``[aggregation]`` keys into a rule.
"""

from __future__ import annotations

import numpy as np

from tandem.errors import ConfigError

from .aggregator import (
    Aggregator,
    _no_state,
    _stack,
    coordinate_median,
    trimmed_mean,
    weighted_mean,
)

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "norm_bound")


def krum_scores(stacked: np.ndarray, f: int) -> np.ndarray:
    """Each update's Krum score: the sum of squared L2 distances to its ``n - f - 2`` nearest
    other updates (Blanchard et al., NeurIPS 2017)."""
    x = stacked.reshape(stacked.shape[0], -1).astype(np.float64)
    sq = (x * x).sum(axis=1)
    dist = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (x @ x.T), 0.0)
    n = x.shape[0]
    k = max(1, n - f - 2)
    np.fill_diagonal(dist, np.inf)
    return np.sort(dist, axis=1)[:, :k].sum(axis=1)


def multi_krum(f: int, m: int | None = None) -> Aggregator:
    """Multi-Krum: the unweighted mean of the ``m`` updates with the lowest Krum scores, ``f``
    being the number of Byzantine clients tolerated; ``m = 1`` is Krum, ``m = None`` means
    ``n - f``. A round needs ``n > 2 f + 2`` updates for Krum's guarantee; with fewer the rule
    still picks by score, with the neighbourhood cut to at least one."""
    if f < 0:
        raise ConfigError(f"aggregation.byzantine must be >= 0, got {f}")
    if m is not None and m < 1:
        raise ConfigError(f"aggregation.multi must be >= 1, got {m}")

    def aggregate(state, updates, weights):
        stacked = _stack(updates, weights)
        n = stacked.shape[0]
        keep = min(n, m if m is not None else max(1, n - f))
        order = np.argsort(krum_scores(stacked, f), kind="stable")[:keep]
        return stacked[order].mean(axis=0, dtype=np.float32), state

    return Aggregator(_no_state, aggregate, linear=False)


def krum(f: int) -> Aggregator:
    """Krum: the single update with the lowest score (`multi_krum` with ``m = 1``)."""
    return multi_krum(f, 1)


def norm_bound(norm: float) -> Aggregator:
    """Norm bounding (Sun et al., 2019, "Can You Really Backdoor Federated Learning?"): each
    update scaled to L2 norm at most ``norm``, then the mean weighted by sample count."""
    if not norm > 0:
        raise ConfigError(f"aggregation.norm must be > 0, got {norm}")
    mean = weighted_mean()

    def aggregate(state, updates, weights):
        stacked = _stack(updates, weights)
        norms = np.linalg.norm(stacked.reshape(stacked.shape[0], -1), axis=1)
        scale = np.minimum(1.0, norm / np.maximum(norms, 1e-30)).astype(np.float32)
        bounded = [u * s for u, s in zip(stacked, scale, strict=True)]
        return mean.aggregate(state, bounded, weights)

    return Aggregator(_no_state, aggregate, linear=False)


def build_rule(
    rule: str,
    *,
    byzantine: int = 0,
    multi: int | None = None,
    trim: float = 0.1,
    norm: float = 1.0,
) -> Aggregator:
    """The `Aggregator` named ``rule`` (one of `RULES`) with its knobs."""
    if rule == "mean":
        return weighted_mean()
    if rule == "median":
        return coordinate_median()
    if rule == "trimmed_mean":
        return trimmed_mean(trim)
    if rule == "krum":
        return krum(byzantine)
    if rule == "multi_krum":
        return multi_krum(byzantine, multi)
    if rule == "norm_bound":
        return norm_bound(norm)
    raise ConfigError(f"aggregation.rule must be one of {list(RULES)}, got {rule!r}")


__all__ = ["RULES", "build_rule", "krum", "krum_scores", "multi_krum", "norm_bound"]
