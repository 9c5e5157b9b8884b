"""Compression kernels: unbiasedness (statistical, hypothesis), error-feedback identity, pytrees."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tandem.engine.models import mlp_init
from tandem.errors import ConfigError
from tandem.parties.fl import compression as C

D = 40
SAMPLES = 4000
finite = st.floats(-100, 100, width=32, allow_subnormal=False)
vectors = arrays(np.float32, (D,), elements=finite)


@partial(jax.jit, static_argnums=(1, 2))
def _randk_samples(x, k: int, scaled: bool):
    def one(seed):
        out = C._randk_decompress(C._randk_compress(x, seed, k), seed, D)
        if not scaled:  # negative control: forget the d/k scale
            idx, scale = C._randk_indices(seed, D, k)
            out = out / jnp.zeros(D).at[idx].set(scale).clip(1.0)
        return out

    return jax.vmap(one)(jnp.arange(SAMPLES, dtype=jnp.uint32))


@partial(jax.jit, static_argnums=(1, 2))
def _sketch_samples(x, rows: int, cols: int):
    def one(seed):
        return C._estimate(C._sketch(x, seed, rows, cols), seed, D, False)

    return jax.vmap(one)(jnp.arange(SAMPLES, dtype=jnp.uint32))


def _randk_mean(x: np.ndarray, k: int, *, scaled: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Mean and per-coordinate variance of the decompressed estimate over SAMPLES seeds."""
    samples = np.asarray(_randk_samples(jnp.asarray(x), k, scaled), np.float64)
    return samples.mean(0), samples.var(0)


def _close(mean, var, x, n=SAMPLES) -> bool:
    return bool(np.all(np.abs(mean - x) <= 6 * np.sqrt(var / n) + 1e-4 * (1 + np.abs(x))))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(x=vectors, k=st.sampled_from([1, 7]))
def test_randk_is_unbiased(x, k):
    mean, var = _randk_mean(x, k)
    assert _close(mean, var, x.astype(np.float64))


def test_randk_without_scaling_is_detected_as_biased():
    x = np.linspace(1, 2, D).astype(np.float32)
    mean, var = _randk_mean(x, 7, scaled=False)
    assert not _close(mean, var, x.astype(np.float64))


def test_randk_indices_distinct_sorted_and_scales_sum_to_d():
    idx, scale = C.randk_indices(123, 1001, 37)
    idx = np.asarray(idx)
    assert np.all(np.diff(idx) > 0) and idx.min() >= 0 and idx.max() < 1001
    assert float(np.asarray(scale).sum()) == 1001.0
    again, _ = C.randk_indices(123, 1001, 37)
    assert np.array_equal(idx, np.asarray(again))  # regenerated from the seed alone


@settings(max_examples=10, deadline=None, derandomize=True)
@given(x=vectors, shape=st.just((3, 8)))
def test_count_sketch_mean_estimate_is_unbiased(x, shape):
    rows, cols = shape
    samples = np.asarray(_sketch_samples(jnp.asarray(x), rows, cols), np.float64)
    assert _close(samples.mean(0), samples.var(0), x.astype(np.float64))


@settings(max_examples=10, deadline=None, derandomize=True)
@given(a=vectors, b=vectors, seed=st.integers(0, 2**32 - 1))
def test_count_sketch_is_linear(a, b, seed):
    sa, sb = C.sketch_compress(a, seed, 3, 8), C.sketch_compress(b, seed, 3, 8)
    sab = C.sketch_compress(a.astype(np.float64) + b, seed, 3, 8)
    np.testing.assert_allclose(
        np.asarray(sa) + np.asarray(sb), np.asarray(sab), rtol=1e-5, atol=1e-3
    )


def test_count_sketch_recovers_heavy_hitters():
    rng = np.random.default_rng(0)
    x = rng.normal(0, 0.01, 2000).astype(np.float32)
    heavy = rng.choice(2000, 10, replace=False)
    x[heavy] = 10.0
    est = np.asarray(C.sketch_estimate(C.sketch_compress(x, 9, 5, 1000), 9, 2000))
    assert set(np.argsort(-np.abs(est))[:10]) == set(heavy)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(g=vectors, r=vectors, k=st.sampled_from([1, 9, D]))
def test_error_feedback_identity_is_exact(g, r, k):
    sel, res = (np.asarray(a) for a in C.error_feedback(g, r, k))
    acc = np.asarray(jnp.asarray(g) + jnp.asarray(r))
    assert np.array_equal(sel + res, acc)
    assert np.count_nonzero(sel) <= k
    assert not np.any((sel != 0) & (res != 0))
    kept = np.abs(acc[sel != 0])
    if kept.size and np.count_nonzero(res):
        assert kept.min() >= np.abs(res).max()


def test_flatten_roundtrip_and_errors():
    params = mlp_init(jax.random.key(0), [5, 4, 3])
    vec, spec = C.flatten(params)
    assert vec.shape == (spec.size,) == (5 * 4 + 4 + 4 * 3 + 3,)
    back = C.unflatten(vec, spec)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ConfigError, match="model needs"):
        C.unflatten(vec[:-1], spec)
    with pytest.raises(ConfigError, match="1 <= k <= d"):
        C.randk_compress(vec, 0, spec.size + 1)
    with pytest.raises(ConfigError, match="rows >= 1"):
        C.sketch_compress(vec, 0, 0, 4)
