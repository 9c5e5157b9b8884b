"""Built-in stage models (`tandem.parties.models.mlp`, `embedding_mlp`): shapes, code handling,
gradients, training through `StageKernels`, no retrace, and spec round trips."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem.engine.models import count_params, mlp_apply
from tandem.errors import ConfigError
from tandem.parties.models import embedding_mlp, mlp, model_from_spec
from tests.models_fixture import toy_problem, train, train_bottom

KEY = jax.random.PRNGKey(3)


def test_mlp_shapes_and_spec_round_trip():
    model = mlp([3, 2], [8, 4], 5)
    params = model.init(KEY)
    assert [layer["w"].shape for layer in params] == [(5, 8), (8, 4), (4, 5)]
    x1, x2 = jnp.ones((7, 3)), jnp.ones((7, 2))
    out = model.apply(params, x1, x2)
    assert out.shape == (7, 5) and model.in_dims == (3, 2) and model.out_dim == 5
    again = model_from_spec(model.spec)
    np.testing.assert_array_equal(again.apply(params, x1, x2), out)
    assert jnp.all(out >= 0)  # activate_last by default: a bottom's cut layer
    top = mlp([4], [], 1, activate_last=False)
    assert top.spec["activate_last"] is False


@pytest.mark.parametrize(
    "args, match",
    [
        (([0], [4], 2), r"in_dims\[0\] must be a positive int"),
        (([3], [4, -1], 2), r"hidden\[1\]"),
        (([3], [4], 0), "out_dim must be a positive int"),
        (([], [4], 2), "in_dims must list at least one"),
        (([3], "44", 2), "hidden must be a list"),
    ],
)
def test_mlp_refuses_bad_widths(args, match):
    with pytest.raises(ConfigError, match=match):
        mlp(*args)


def test_embedding_matches_a_hand_written_lookup():
    model = embedding_mlp(2, [4, 3], dim=[2, 5], hidden=[6], out_dim=3, activate_last=False)
    params = model.init(KEY)
    assert model.in_dims == (4,) and model.out_dim == 3
    assert [t.shape for t in params["embed"]] == [(4, 2), (3, 5)]
    assert [layer["w"].shape for layer in params["mlp"]] == [(2 + 2 + 5, 6), (6, 3)]
    # codes: known, out of range (too large, negative), NaN, fractional (truncated)
    codes = np.array([[1, 2], [3, 0], [4, 7], [-1, 1], [np.nan, 2], [2.9, 1.5]], np.float32)
    dense = np.arange(12, dtype=np.float32).reshape(6, 2) / 10
    x = np.concatenate([dense, codes], axis=1)
    looked_up = np.array([[1, 2], [3, 0], [0, 0], [0, 1], [0, 2], [2, 1]])
    t0, t1 = (np.asarray(t) for t in params["embed"])
    h = np.concatenate([dense, t0[looked_up[:, 0]], t1[looked_up[:, 1]]], axis=1)
    want = mlp_apply(params["mlp"], jnp.asarray(h), activate_last=False)
    np.testing.assert_allclose(model.apply(params, jnp.asarray(x)), want, rtol=1e-6)
    np.testing.assert_array_equal(
        model_from_spec(model.spec).apply(params, jnp.asarray(x)), model.apply(params, x)
    )


def test_embedding_gradients_reach_tables_not_codes():
    model = embedding_mlp(1, [5, 3], dim=4, hidden=[8], out_dim=2)
    params = model.init(KEY)
    x = jnp.array([[0.5, 1, 2], [-0.3, 3, 2]], jnp.float32)

    def loss(params, x):
        return jnp.sum(model.apply(params, x) ** 2)

    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, x)
    rows0 = np.abs(np.asarray(g_params["embed"][0])).sum(axis=1)
    rows1 = np.abs(np.asarray(g_params["embed"][1])).sum(axis=1)
    assert np.all(rows0[[1, 3]] > 0) and np.all(rows0[[0, 2, 4]] == 0)  # only the used rows
    assert rows1[2] > 0 and np.all(rows1[[0, 1]] == 0)
    assert np.all(np.asarray(g_x)[:, 1:] == 0)  # codes are indices: no gradient
    assert np.any(np.asarray(g_x)[:, 0] != 0)  # dense columns keep theirs


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(n_dense=1, vocab=[2**24 + 1]), "exceed 2\\*\\*24"),
        (dict(n_dense=1, vocab=[4, 4], dim=[3]), "one width per categorical column"),
        (dict(n_dense=-1, vocab=[4]), "n_dense must be an int >= 0"),
        (dict(n_dense=1, vocab=[]), "vocab must list at least one"),
    ],
)
def test_embedding_refuses_bad_configuration(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        embedding_mlp(**kwargs)


def test_embedding_refuses_an_input_of_another_width():
    model = embedding_mlp(2, [4], dim=3, hidden=[], out_dim=2)
    with pytest.raises(ConfigError, match="takes 3 columns .2 dense \\+ 1 categorical"):
        model.apply(model.init(KEY), jnp.ones((2, 4)))


def test_embedding_init_of_10m_parameters_is_one_op_per_table():
    """A 10M-parameter configuration initialises with a fixed number of ops, whatever the
    vocabulary sizes (no per-row work), and really initialises."""
    small = embedding_mlp(4, [10, 10, 10], dim=16, hidden=[64], out_dim=16)
    big = embedding_mlp(4, [500_000, 100_000, 25_000], dim=16, hidden=[64], out_dim=16)
    eqns = [len(jax.make_jaxpr(m.init)(KEY).eqns) for m in (small, big)]
    assert eqns[0] == eqns[1]
    params = jax.block_until_ready(big.init(KEY))
    assert count_params(params) == 625_000 * 16 + (4 + 48) * 64 + 64 + 64 * 16 + 16
    assert count_params(params) > 10_000_000
    table = np.asarray(params["embed"][0][:1000])
    assert np.all(np.isfinite(table)) and 0.9 < table.std() < 1.1


@pytest.mark.parametrize(
    "build, vocab",
    [
        (lambda: mlp([3], [16], 1, activate_last=False), ()),
        (lambda: embedding_mlp(3, [5], dim=4, hidden=[16], out_dim=1, activate_last=False), (5,)),
    ],
    ids=["mlp", "embedding"],
)
def test_loss_stage_trains_without_retracing(build, vocab):
    x, y = toy_problem(0, 64, 3, vocab)
    kernels, params, losses = train(build(), x, y, steps=60)
    assert losses[-1] < 0.6 * losses[0]
    assert kernels.traces["loss_step"] == 1 and kernels.traces["update"] == 1


@pytest.mark.parametrize(
    "build, vocab",
    [
        (lambda: mlp([3], [16], 4), ()),
        (lambda: embedding_mlp(3, [5], dim=4, hidden=[16], out_dim=4), (5,)),
    ],
    ids=["mlp", "embedding"],
)
def test_bottom_stage_trains_without_retracing(build, vocab):
    x, y = toy_problem(1, 64, 3, vocab)
    kernels, params, losses = train_bottom(build(), x, y, steps=60)
    assert losses[-1] < 0.7 * losses[0]
    assert kernels.traces["forward"] == 1 and kernels.traces["backward"] == 1
