"""Row-keyed randomness: the noise of one row depends only on (seed, purpose, step, row id).

Every defense draws through `row_normal` / `row_uniform`, so a row gets the same noise whatever
the micro-batch count, chunking or order of the ops that carry it, and two runs with the same
``[privacy] seed`` draw the same noise. Keys are JAX threefry keys folded in that order; row ids
are the training-set indices (below 2**32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

#: purposes: one stream each, so two defenses never share noise
LABEL_DP, ALIGNMENT, GRADIENT_DP, ACTIVATION_DP = 1, 2, 3, 4


def _base(seed: int, purpose: int, step: int, stage: int) -> jax.Array:
    key = jax.random.PRNGKey(seed)
    for part in (purpose, step, stage):
        key = jax.random.fold_in(key, part)
    return key


@functools.partial(jax.jit, static_argnames=("shape",))
def _normal(base: jax.Array, ids: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(base, i), shape))(ids)


@functools.partial(jax.jit, static_argnames=("shape",))
def _uniform(base: jax.Array, ids: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(base, i), shape))(ids)


def row_normal(
    seed: int, purpose: int, step: int, ids: np.ndarray, shape: tuple[int, ...], stage: int = 0
) -> np.ndarray:
    """Standard normal float32 ``[len(ids), *shape]``; row ``i`` a function of ``(seed,
    purpose, step, stage, ids[i])`` alone."""
    ids32 = jnp.asarray(np.asarray(ids, np.int64).astype(np.uint32))
    return np.asarray(_normal(_base(seed, purpose, step, stage), ids32, tuple(shape)))


def row_uniform(
    seed: int, purpose: int, step: int, ids: np.ndarray, shape: tuple[int, ...], stage: int = 0
) -> np.ndarray:
    """Uniform [0, 1) float32 ``[len(ids), *shape]``, keyed as `row_normal`."""
    ids32 = jnp.asarray(np.asarray(ids, np.int64).astype(np.uint32))
    return np.asarray(_uniform(_base(seed, purpose, step, stage), ids32, tuple(shape)))


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
    "row_normal",
    "row_uniform",
    "stage_tag",
]
