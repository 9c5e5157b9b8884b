"""Row-keyed randomness: the noise of one row depends only on (seed, secret, purpose, step,
row id).

Every defense draws through `row_normal` / `row_uniform`, so a row gets the same noise whatever
the micro-batch count, chunking or order of the ops that carry it. ``seed`` is the negotiated
``[privacy] seed``, which every party of the job knows; ``secret`` is the drawing party's own
key (`party_secret`), which never leaves it: without it a peer could regenerate the noise from
the seed, the step and the row ids it sees, and subtract it. Keys are JAX threefry keys folded
in that order; row ids are the training-set indices (below 2**32).
"""

from __future__ import annotations

import functools
import secrets

import jax
import jax.numpy as jnp
import numpy as np

#: purposes: one stream each, so two defenses never share noise
LABEL_DP, ALIGNMENT, GRADIENT_DP, ACTIVATION_DP = 1, 2, 3, 4


def party_secret(noise_seed: int | None) -> int:
    """The key a party folds into all the noise it draws: ``noise_seed`` (its own
    ``[privacy] noise_seed``) when given, else 64 fresh bits from the operating system."""
    return secrets.randbits(64) if noise_seed is None else int(noise_seed)


def _base(seed: int, secret: int, purpose: int, step: int, stage: int) -> jax.Array:
    key = jax.random.PRNGKey(seed)
    for part in (secret & 0xFFFFFFFF, (secret >> 32) & 0xFFFFFFFF, purpose, step, stage):
        key = jax.random.fold_in(key, part)
    return key


@functools.partial(jax.jit, static_argnames=("shape",))
def _normal(base: jax.Array, ids: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(base, i), shape))(ids)


@functools.partial(jax.jit, static_argnames=("shape",))
def _uniform(base: jax.Array, ids: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(base, i), shape))(ids)


def row_normal(
    seed: int,
    purpose: int,
    step: int,
    ids: np.ndarray,
    shape: tuple[int, ...],
    stage: int = 0,
    *,
    secret: int,
) -> np.ndarray:
    """Standard normal float32 ``[len(ids), *shape]``; row ``i`` a function of ``(seed,
    secret, purpose, step, stage, ids[i])`` alone (``secret``: a 64-bit `party_secret`)."""
    return _rows(_normal, seed, secret, purpose, step, stage, ids, shape)


def row_uniform(
    seed: int,
    purpose: int,
    step: int,
    ids: np.ndarray,
    shape: tuple[int, ...],
    stage: int = 0,
    *,
    secret: int,
) -> np.ndarray:
    """Uniform [0, 1) float32 ``[len(ids), *shape]``, keyed as `row_normal`."""
    return _rows(_uniform, seed, secret, purpose, step, stage, ids, shape)


def _rows(draw, seed, secret, purpose, step, stage, ids, shape) -> np.ndarray:
    """``draw`` (`_normal` or `_uniform`) of one row per id under the key of ``(seed, secret,
    purpose, step, stage)``, on the host."""
    ids32 = jnp.asarray(np.asarray(ids, np.int64).astype(np.uint32))
    return np.asarray(draw(_base(seed, secret, purpose, step, stage), ids32, tuple(shape)))


def stage_tag(name: str) -> int:
    """A stable 31-bit number for a stage name (the noise of two stages differs)."""
    h = 0
    for ch in name.encode():
        h = (h * 131 + ch) % (1 << 31)
    return h


__all__ = [
    "ACTIVATION_DP",
    "ALIGNMENT",
    "GRADIENT_DP",
    "LABEL_DP",
    "party_secret",
    "row_normal",
    "row_uniform",
    "stage_tag",
]
