"""The ``update`` kernel's CPU compiler options (`tandem.engine.kernels.UPDATE_COMPILER_OPTIONS`):
applied on a CPU only, and the update they compile gives optax's result."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tandem.engine.kernels import (
    UPDATE_COMPILER_OPTIONS,
    StageKernels,
    update_compiler_options,
)
from tandem.parties.models.builtin import embedding_mlp


def test_the_options_apply_on_a_cpu_only(monkeypatch):
    assert jax.default_backend() == "cpu"
    assert update_compiler_options() == UPDATE_COMPILER_OPTIONS
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert update_compiler_options() is None


def test_a_jax_whose_jit_takes_no_options_gets_none(monkeypatch):
    import tandem.engine.kernels as kernels

    real_jit = jax.jit

    def old_jit(fun, **kwargs):
        if "compiler_options" in kwargs:
            raise TypeError("jit() got an unexpected keyword argument 'compiler_options'")
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(kernels, "_JIT_TAKES_OPTIONS", False)
    monkeypatch.setattr(jax, "jit", old_jit)
    assert update_compiler_options() is None
    model = embedding_mlp(1, [3], dim=2, hidden=(), out_dim=2)
    StageKernels(model, optax.sgd(0.1))  # builds without the keyword


def test_the_update_compiled_with_them_matches_optax_adam():
    model = embedding_mlp(2, [5, 9, 13], dim=[4, 3, 2], hidden=(8,), out_dim=4)
    params = model.init(jax.random.PRNGKey(3))
    rng = np.random.default_rng(4)
    grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
    opt = optax.adam(0.01)
    kernels = StageKernels(model, opt)
    got_p, got_s = kernels.update(
        jax.tree_util.tree_map(jnp.array, params), opt.init(params), grads
    )
    updates, want_s = opt.update(grads, opt.init(params), params)
    want_p = optax.apply_updates(params, updates)
    got_leaves = jax.tree_util.tree_leaves((got_p, got_s))
    want_leaves = jax.tree_util.tree_leaves((want_p, want_s))
    for got, want in zip(got_leaves, want_leaves, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-7)
