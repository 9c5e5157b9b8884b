"""Compression kernels for federated updates: pure functions, JAX-jitted, no asyncio.

Every kernel works on a flat float vector (see `flatten`/`unflatten` for parameter pytrees)
and takes its randomness as an explicit integer ``seed``, so a sender and a receiver that agree
on the seed regenerate the same indices / hashes without sending them.

* **Stratified rand-k** (`randk_indices`, `randk_compress`, `randk_decompress`): the vector is
  cut into ``k`` contiguous blocks of sizes ``floor(d/k)`` or ``ceil(d/k)``; one index per block
  is drawn uniformly from the seed. Only the ``k`` values travel. Decompression scales each value
  by its block size (``d/k`` when ``k`` divides ``d``), which makes the estimate **unbiased**:
  ``E_seed[randk_decompress(randk_compress(x))] == x``. Block bounds and indices are exact
  int32 for any ``d <= MAX_RANDK_DIM`` (2**31 - 1), and the offset inside a block comes from
  64 random bits, so every coordinate of a block is equally likely whatever its size. Drawing
  per block costs O(k) (a global draw without replacement costs a sort of ``d`` entries) and
  gives lower variance than uniform rand-k.
* **Count sketch** (`sketch_compress`, `sketch_estimate`): ``rows x cols`` table; coordinate
  ``j`` adds ``sign_r(j) * x_j`` to bucket ``h_r(j)`` of every row ``r``. Linear, so the sum of
  sketches is the sketch of the sum (the server adds client sketches). The row-mean estimate is
  unbiased over the hash seed; the robust estimate (the row median, unless a large median is
  not backed by all rows but one in four) recovers heavy hitters: its top-h holds them.
* **Top-k** (`topk_mask`) and **error feedback** (`error_feedback`): with ``acc = g + r``, the
  selected part keeps ``acc`` on the top-k magnitudes and zero elsewhere and the new residual is
  the rest, so ``selected + residual == g + r`` holds exactly (bit for bit) in floating point.

Invariants: all outputs keep the input dtype; functions of equal shapes compile once.
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tandem.errors import ConfigError


# -- pytrees <-> flat vectors -----------------------------------------------------------------
class FlatSpec(NamedTuple):
    """How to rebuild a pytree from a flat vector: tree structure, shapes, dtypes."""

    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]

    @property
    def size(self) -> int:
        return int(sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes))


def flatten(tree) -> tuple[np.ndarray, FlatSpec]:
    """Concatenate the leaves of ``tree`` into one float32 numpy vector (leaf order of JAX)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    arrays = [np.asarray(leaf) for leaf in leaves]
    spec = FlatSpec(treedef, tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays))
    if not arrays:
        return np.zeros((0,), np.float32), spec
    return np.concatenate([a.reshape(-1).astype(np.float32, copy=False) for a in arrays]), spec


def unflatten(vec, spec: FlatSpec):
    """Inverse of `flatten`: split ``vec`` back into leaves of the recorded shapes and dtypes."""
    vec = np.asarray(vec)
    if vec.shape != (spec.size,):
        raise ConfigError(f"flat vector has shape {vec.shape}, the model needs ({spec.size},)")
    leaves, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        n = int(np.prod(shape, dtype=np.int64))
        leaves.append(jnp.asarray(vec[offset : offset + n].reshape(shape), dtype=dtype))
        offset += n
    return jax.tree_util.tree_unflatten(spec.treedef, leaves)


# -- stratified rand-k ------------------------------------------------------------------------
MAX_RANDK_DIM = 2**31 - 1
"""Largest ``d`` rand-k accepts: every index and block bound is then an exact int32."""


def _check_k(d: int, k: int) -> None:
    if not 1 <= k <= d:
        raise ConfigError(f"rand-k needs 1 <= k <= d, got k={k} for d={d}; pick k in [1, {d}]")


def _check_randk(d: int, k: int) -> None:
    _check_k(d, k)
    if d > MAX_RANDK_DIM:
        raise ConfigError(
            f"rand-k supports vectors of up to {MAX_RANDK_DIM} coordinates, got d={d}; "
            "compress the model's parameters in chunks of at most that size"
        )


def _mulhi_u32(a, b):
    """The high 32 bits of the 64-bit product of two uint32 arrays, in 16-bit limbs (exact
    without x64)."""
    lo16 = jnp.uint32(0xFFFF)
    a0, a1, b0, b1 = a & lo16, a >> 16, b & lo16, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & lo16) + (p10 & lo16)
    return p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)


def _uniform_below(key, sizes):
    """One integer uniform in ``[0, size)`` per entry of ``sizes`` (uint32, each >= 1):
    ``floor(B * size / 2**64)`` for 64 random bits ``B``, so each value has probability
    ``1/size`` within a relative ``size / 2**64`` and the result is always ``< size``."""
    hi, lo = jax.random.bits(key, (2, *sizes.shape), jnp.uint32)
    # B * size = (hi * size) * 2**32 + lo * size; its top word is the answer
    low_word = hi * sizes  # uint32 multiplication wraps: the low word of hi * size
    mid = low_word + _mulhi_u32(lo, sizes)
    carry = (mid < low_word).astype(jnp.uint32)
    return _mulhi_u32(hi, sizes) + carry


@partial(jax.jit, static_argnums=(1, 2))
def _randk_indices(seed, d: int, k: int):
    # Block b covers [b*q + min(b, r), (b+1)*q + min(b+1, r)): the first r blocks hold q + 1
    # coordinates, the others q. Every bound is <= d <= 2**31 - 1, so int32 is exact; q and r
    # are computed on the host from the static d and k.
    q, r = divmod(d, k)
    blocks = jnp.arange(k, dtype=jnp.int32)
    starts = blocks * q + jnp.minimum(blocks, r)
    sizes = q + (blocks < r).astype(jnp.int32)
    offs = _uniform_below(jax.random.key(seed), sizes.astype(jnp.uint32))
    return starts + offs.astype(jnp.int32), sizes


def randk_indices(seed: int, d: int, k: int) -> tuple[jax.Array, jax.Array]:
    """The ``k`` distinct sorted indices drawn from ``seed`` and each one's scale (block size).

    Invariants, for any ``1 <= k <= d <= MAX_RANDK_DIM``: the indices are int32, strictly
    increasing, in ``[0, d)``; index ``b`` lies in block ``b`` and is uniform over it; the
    scales are the int32 block sizes ``floor(d/k)`` or ``ceil(d/k)`` (positive, summing to
    ``d``).
    """
    _check_randk(d, k)
    return _randk_indices(jnp.uint32(seed & 0xFFFFFFFF), d, k)


@partial(jax.jit, static_argnums=(2,))
def _randk_compress(x, seed, k: int):
    idx, _ = _randk_indices(seed, x.shape[0], k)
    return x[idx]


def randk_compress(x, seed: int, k: int) -> jax.Array:
    """The ``k`` values of ``x`` at the seed's indices (what travels, with the seed)."""
    _check_randk(int(x.shape[0]), k)
    return _randk_compress(jnp.asarray(x), jnp.uint32(seed & 0xFFFFFFFF), k)


@partial(jax.jit, static_argnums=(2,))
def _randk_decompress(values, seed, d: int):
    idx, scale = _randk_indices(seed, d, values.shape[0])
    return jnp.zeros((d,), values.dtype).at[idx].set(values * scale.astype(values.dtype))


def randk_decompress(values, seed: int, d: int) -> jax.Array:
    """Unbiased dense estimate: ``values`` scaled by their block size, zeros elsewhere."""
    values = jnp.asarray(values)
    _check_randk(d, int(values.shape[0]))
    return _randk_decompress(values, jnp.uint32(seed & 0xFFFFFFFF), d)


# -- count sketch -----------------------------------------------------------------------------
@partial(jax.jit, static_argnums=(1, 2, 3))
def _hashes(seed, d: int, rows: int, cols: int):
    kb, ks = jax.random.split(jax.random.key(seed))
    buckets = jax.random.randint(kb, (rows, d), 0, cols, dtype=jnp.int32)
    signs = jnp.where(jax.random.bernoulli(ks, 0.5, (rows, d)), 1.0, -1.0)
    return buckets, signs


def _check_sketch(rows: int, cols: int) -> None:
    if rows < 1 or cols < 1:
        raise ConfigError(f"a count sketch needs rows >= 1 and cols >= 1, got {rows} x {cols}")


@partial(jax.jit, static_argnums=(2, 3))
def _sketch(x, seed, rows: int, cols: int):
    buckets, signs = _hashes(seed, x.shape[0], rows, cols)
    vals = signs.astype(x.dtype) * x[None, :]
    return jax.vmap(lambda b, v: jax.ops.segment_sum(v, b, num_segments=cols))(buckets, vals)


def sketch_compress(x, seed: int, rows: int, cols: int) -> jax.Array:
    """Count sketch of ``x``: a ``(rows, cols)`` table; linear in ``x``."""
    _check_sketch(rows, cols)
    return _sketch(jnp.asarray(x), jnp.uint32(seed & 0xFFFFFFFF), rows, cols)


@partial(jax.jit, static_argnums=(2, 3))
def _estimate(table, seed, d: int, median: bool):
    rows, cols = table.shape
    buckets, signs = _hashes(seed, d, rows, cols)
    per_row = jax.vmap(lambda t, b, s: t[b] * s.astype(t.dtype))(table, buckets, signs)
    return _robust_of_rows(per_row) if median else jnp.mean(per_row, axis=0)


def _sorted_rows(a) -> list:
    """The rows of ``a`` sorted element-wise (row ``i`` holds each column's ``i``-th smallest):
    an odd-even transposition sort (``rows`` passes of element-wise min/max), which XLA runs
    far faster than a sort along axis 0 of a ``(rows, d)`` array."""
    rows = list(a)
    n = len(rows)
    for p in range(n):
        for i in range(p % 2, n - 1, 2):
            rows[i], rows[i + 1] = (
                jnp.minimum(rows[i], rows[i + 1]),
                jnp.maximum(rows[i], rows[i + 1]),
            )
    return rows


def _median_of_rows(a):
    """``jnp.median(a, axis=0)`` for a few rows (see `_sorted_rows`)."""
    rows = _sorted_rows(a)
    n = len(rows)
    if n % 2:
        return rows[n // 2]
    return (rows[n // 2 - 1] + rows[n // 2]) / 2


def agree_slack(rows: int) -> int:
    """Rows of a sketch that may disagree with a coordinate's sign in `sketch_estimate`'s
    robust estimate: ``(rows - 1) // 4`` (1 of the preset's 5 rows, none of 1 to 4 rows)."""
    return (rows - 1) // 4


def _agreed_of_rows(a):
    """Per column of the ``(rows, d)`` row estimates ``a``: the value that all rows but
    ``s = agree_slack(rows)`` reach in one sign (the ``s``-th smallest if it is positive, the
    ``s``-th largest if it is negative), else 0.

    Why not the median: of ``d`` light coordinates, about ``d * C(5,3) p**3 / 4`` (``p`` the
    share of a row's buckets holding a heavy coordinate) have three rows spoiled by heavy ones
    of one sign, and their median is then as large as a heavy value: at d = 1M with the preset's
    5 x 3,333 that is hundreds, crowding the heavy ones out of the estimate's top-h. Here such a
    coordinate needs ``rows - s`` (4 of 5) rows spoiled the same way (``C(5,4) p**4 / 8``),
    while a heavy coordinate keeps its value unless two of its rows are spoiled."""
    rows = _sorted_rows(a)
    s = agree_slack(len(rows))
    low, high = rows[s], rows[len(rows) - 1 - s]
    zero = jnp.zeros_like(low)
    return jnp.where(low > 0, low, jnp.where(high < 0, high, zero))


#: a row median larger than this many noise scales must be backed by `_agreed_of_rows`
SPOIL_SIGMAS = 4.0

#: coordinates (about) that `_robust_of_rows` reads to estimate the noise scale
NOISE_SAMPLE = 65_536


def _robust_of_rows(a):
    """The row median, except where it is large and the rows do not back it: a median above
    `SPOIL_SIGMAS` noise scales (the noise scale: the median magnitude of the medians of every
    ``d // NOISE_SAMPLE``-th coordinate, over 0.6745) whose `_agreed_of_rows` value is less
    than half of it is replaced by that value. A heavy coordinate's rows agree on it, so it
    keeps its median; a light coordinate spoiled in three rows by heavy ones of one sign
    (hundreds of them at d = 1M with the preset, each as large as a heavy one) falls back to
    what four rows agree on, about nothing; every other coordinate keeps its median, which
    training needs (zeroing every coordinate the rows do not agree on costs accuracy)."""
    med = _median_of_rows(a)
    agreed = _agreed_of_rows(a)
    stride = max(1, med.shape[0] // NOISE_SAMPLE)
    sigma = jnp.median(jnp.abs(med[::stride])) / 0.6745
    spoiled = (jnp.abs(med) > SPOIL_SIGMAS * sigma) & (jnp.abs(agreed) < jnp.abs(med) / 2)
    return jnp.where(spoiled, agreed, med)


def sketch_estimate(table, seed: int, d: int, *, median: bool = True) -> jax.Array:
    """Estimate every coordinate from a sketch. ``median`` (the default): the row median,
    except where a large median is not backed by all rows but `agree_slack` (`_robust_of_rows`);
    its top-h holds the heavy coordinates (docs/federated.md, "Count sketch").
    ``median=False``: the row mean (unbiased over the seed)."""
    table = jnp.asarray(table)
    if table.ndim != 2:
        raise ConfigError(f"a count sketch is a 2-d table, got shape {table.shape}")
    return _estimate(table, jnp.uint32(seed & 0xFFFFFFFF), d, bool(median))


def heavy_recall(x, estimate, h: int) -> float:
    """Share of the ``h`` largest-magnitude coordinates of ``x`` that are among the ``h``
    largest-magnitude coordinates of ``estimate`` (ties by index)."""
    x, estimate = np.asarray(x), np.asarray(estimate)
    if not 1 <= h <= x.shape[0] or estimate.shape != x.shape:
        raise ConfigError(f"heavy_recall needs 1 <= h <= d and equal shapes, got h={h}")
    return float(np.intersect1d(_top_h(x, h), _top_h(estimate, h)).size / h)


def _top_h(a: np.ndarray, h: int) -> np.ndarray:
    """The indices of the ``h`` largest magnitudes of ``a``, ties by index: the first ``h`` of
    ``np.argsort(-np.abs(a), kind="stable")`` as a set, in linear time (a partition, no full
    sort: at d = 10M the sort took seconds)."""
    key = -np.abs(a)
    kth = np.partition(key, h - 1)[h - 1]
    if np.isnan(kth):  # fewer than h numbers: the sort's order (NaNs last, by index)
        return np.argsort(key, kind="stable")[:h]
    above = np.flatnonzero(key < kth)
    return np.concatenate([above, np.flatnonzero(key == kth)[: h - above.size]])


# -- top-k and error feedback ------------------------------------------------------------------
@partial(jax.jit, static_argnums=(1,))
def _topk_mask(x, k: int):
    _, idx = jax.lax.top_k(jnp.abs(x), k)
    return jnp.zeros(x.shape, bool).at[idx].set(True)


def topk_mask(x, k: int) -> jax.Array:
    """Boolean mask of the ``k`` entries of largest magnitude (ties: lower index first)."""
    _check_k(int(x.shape[0]), k)
    return _topk_mask(jnp.asarray(x), k)


@partial(jax.jit, static_argnums=(2,))
def _error_feedback(g, residual, k: int):
    acc = g + residual
    mask = _topk_mask(acc, k)
    zero = jnp.zeros_like(acc)
    return jnp.where(mask, acc, zero), jnp.where(mask, zero, acc)


def error_feedback(g, residual, k: int) -> tuple[jax.Array, jax.Array]:
    """Returns ``(selected, new_residual)`` with ``acc = g + residual`` split by top-k.

    Invariant: ``selected + new_residual == g + residual`` exactly, and the supports of
    ``selected`` and ``new_residual`` are disjoint (``selected`` has at most ``k`` non-zeros).
    """
    g, residual = jnp.asarray(g), jnp.asarray(residual)
    if g.shape != residual.shape:
        raise ConfigError(f"update {g.shape} and residual {residual.shape} differ in shape")
    _check_k(int(g.shape[0]), k)
    return _error_feedback(g, residual, k)
