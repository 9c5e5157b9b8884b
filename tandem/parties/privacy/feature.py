"""A feature owner's defenses: what the activations it sends reveal about its features.

* `defend_activation`: per-row clipping of each training batch's outgoing activation to L2
  norm ``clip`` plus Gaussian noise of std ``noise_multiplier * clip`` (the Gaussian mechanism,
  accounted by `tandem.parties.privacy.accounting`). The backward pass is straight-through: the
  gradient that comes back for the released activation is applied at the clean one.
* `nopeek_grads`: the gradient of ``weight * dcor(x, f(params, x))`` over a whole training
  batch, the distance correlation between the raw features and the bottom model's activations
  (NoPeek, Vepakomma et al., "NoPeek: Information leakage reduction to share activations in
  distributed deep learning", ICDMW 2020). Computed once per batch, at the update, over the
  batch's rows, so it does not depend on the micro-batching.

Evaluation and prediction batches send clean activations: the defenses protect training rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import noise
from .config import ActivationDP
from .rows import clip_rows


def defend_activation(
    y: np.ndarray,
    config: ActivationDP,
    *,
    seed: int,
    secret: int,
    step: int,
    ids: np.ndarray,
    stage: int = 0,
) -> np.ndarray:
    """The activation ``y`` (rows ``ids``) as its owner sends it: clipped, then noised with
    noise keyed by ``secret`` (the owner's `tandem.parties.privacy.noise.party_secret`, which
    the receiver must not know); the dtype of ``y`` kept."""
    z = noise.row_normal(seed, noise.ACTIVATION_DP, step, ids, y.shape[1:], stage, secret=secret)
    out = clip_rows(y, config.clip) + np.float32(config.noise_multiplier * config.clip) * z
    return out.astype(np.asarray(y).dtype)


def _centred_distances(x: jax.Array) -> jax.Array:
    # pairwise differences, not |a|^2 + |b|^2 - 2ab: the diagonal is then exactly zero, and so
    # is its gradient (the expansion's rounding there is amplified by the square root's slope)
    flat = x.reshape(x.shape[0], -1).astype(jnp.float32)
    diff = flat[:, None, :] - flat[None, :, :]
    d = jnp.sqrt(jnp.sum(diff * diff, axis=-1) + 1e-12)
    return d - d.mean(0, keepdims=True) - d.mean(1, keepdims=True) + d.mean()


def distance_correlation(x: jax.Array, z: jax.Array) -> jax.Array:
    """Sample distance correlation of the rows of ``x`` and ``z`` (Szekely et al., 2007), in
    [0, 1]: 0 for independent samples (in the limit), 1 for a similarity transform."""
    a, b = _centred_distances(x), _centred_distances(z)
    dcov = jnp.mean(a * b)
    return jnp.sqrt(jnp.maximum(dcov, 0.0) / (jnp.sqrt(jnp.mean(a * a) * jnp.mean(b * b)) + 1e-12))


def nopeek_grads(apply: Callable[..., jax.Array]) -> Callable[[Any, Any, Any], Any]:
    """A jitted ``(params, x, weight) -> gradient of weight * dcor(x, apply(params, x))`` for
    a bottom model ``apply`` (one jit per model; retraces only for a new batch size)."""

    def loss(params, x, weight):
        return weight * distance_correlation(x, apply(params, x))

    return jax.jit(jax.grad(loss))


__all__ = ["defend_activation", "distance_correlation", "nopeek_grads"]
