"""Adapters (`tandem.parties.models.adapters`): a plain JAX pair, Flax linen, Flax nnx and
Equinox as `StageModel`s. Each is built by a factory of `tests.models_fixture` (so its spec
names the factory), trained through `StageKernels` without retracing, and rebuilt from its
spec with the same outputs."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tandem.engine.kernels import StageModel
from tandem.errors import ConfigError
from tandem.parties.models import (
    from_equinox,
    from_flax_linen,
    from_flax_nnx,
    from_functions,
    load_factory,
    model_from_spec,
)
from tests.models_fixture import toy_problem, train, train_bottom

FACTORIES = ["functions_bottom", "linen_bottom", "nnx_bottom", "equinox_bottom"]
IN, HIDDEN, OUT = 3, 16, 4


def build(name: str, *, out: int = OUT, relu_out: bool = True) -> StageModel:
    kwargs = {"in_dim": IN, "out": out}
    if name != "functions_bottom":
        kwargs.update(hidden=HIDDEN, relu_out=relu_out)
    return load_factory(f"tests.models_fixture:{name}", kwargs)


@pytest.mark.parametrize("name", FACTORIES)
def test_shapes_spec_and_round_trip(name):
    model = build(name)
    assert model.in_dims == (IN,) and model.out_dim == OUT
    assert model.spec["kind"] == "factory"
    assert model.spec["factory"] == f"tests.models_fixture:{name}"
    params = model.init(jax.random.PRNGKey(1))
    leaves = jax.tree_util.tree_leaves(params)
    assert leaves and all(isinstance(a, jax.Array) for a in leaves)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, IN)), jnp.float32)
    out = jax.jit(model.apply)(params, x)
    assert out.shape == (5, OUT)
    # the spec rebuilds a model that computes the same function of the same params
    again = model_from_spec(model.spec)
    assert again.in_dims == model.in_dims and again.out_dim == model.out_dim
    np.testing.assert_array_equal(again.apply(params, x), out)
    shapes = jax.tree_util.tree_map(jnp.shape, again.init(jax.random.PRNGKey(2)))
    assert shapes == jax.tree_util.tree_map(jnp.shape, params)


@pytest.mark.parametrize("name", FACTORIES)
def test_params_are_str_keyed_dicts_an_export_can_store(name):
    params = build(name).init(jax.random.PRNGKey(0))

    def check(node):
        if isinstance(node, dict):
            assert all(isinstance(k, str) and k and "/" not in k for k in node)
            for v in node.values():
                check(v)
        else:
            assert isinstance(node, jax.Array)

    check(params)


@pytest.mark.parametrize("name", FACTORIES)
def test_init_returns_arrays_the_engine_may_donate(name):
    """`StageKernels.update` deletes the params it is given: a second init must not share
    them (the nnx and Equinox adapters hand out copies of the module's arrays)."""
    from tests.models_fixture import train_bottom as run

    model = build(name)
    x, y = toy_problem(0, 16, IN)
    run(model, x, y, steps=2)
    again = model.init(jax.random.PRNGKey(0))
    assert all(np.all(np.isfinite(np.asarray(a))) for a in jax.tree_util.tree_leaves(again))


@pytest.mark.parametrize("name", FACTORIES)
def test_bottom_trains_without_retracing(name):
    x, y = toy_problem(2, 64, IN)
    kernels, _, losses = train_bottom(build(name), x, y, steps=60)
    assert losses[-1] < 0.7 * losses[0]
    assert kernels.traces["forward"] == 1 and kernels.traces["backward"] == 1
    assert kernels.traces["update"] == 1 and kernels.traces["zeros"] == 1


@pytest.mark.parametrize("name", [n for n in FACTORIES if n != "functions_bottom"])
def test_loss_stage_trains_without_retracing(name):
    x, y = toy_problem(3, 64, IN)
    kernels, _, losses = train(build(name, out=1, relu_out=False), x, y, steps=60)
    assert losses[-1] < 0.6 * losses[0]
    assert kernels.traces["loss_step"] == 1 and kernels.traces["update"] == 1


def test_out_dim_is_inferred_and_checked():
    def init(key):
        return {"w": jax.random.normal(key, (3, 2))}

    def apply(params, x):
        return x @ params["w"]

    assert from_functions(init, apply, [3]).out_dim == 2
    with pytest.raises(ConfigError, match="out_dim is 5 but apply returns 2 columns"):
        from_functions(init, apply, [3], 5)
    with pytest.raises(ConfigError, match=r"fails on inputs of widths \[4\]"):
        from_functions(init, apply, [4])
    with pytest.raises(ConfigError, match=r"one \[batch, out_dim\] array"):
        from_functions(init, lambda p, x: (x, x), [3])
    with pytest.raises(ConfigError, match="give reference= as well"):
        from_functions(init, apply, [3], kwargs={"a": 1})
    with pytest.raises(ConfigError, match="not an import reference"):
        from_functions(init, apply, [3], reference="no colon")


def test_integer_parameters_are_refused_before_training():
    """The engine differentiates and updates every leaf of params: an integer leaf (an index
    table, a count) would fail in the first backward pass with JAX's float0 error."""
    from flax import nnx

    def init(key):
        return {"w": jax.random.normal(key, (3, 2)), "idx": jnp.array([1, 0])}

    with pytest.raises(ConfigError, match=r"parameter \['idx'\] is int32.*out of params"):
        from_functions(init, lambda p, x: (x @ p["w"])[:, p["idx"]], [3])

    class Scaled(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.k = nnx.Param(jnp.array(2, jnp.int32))

        def __call__(self, x):
            return self.lin(x) * self.k[...]

    with pytest.raises(ConfigError, match=r"flax nnx Scaled: parameter \['k'\] is int32"):
        from_flax_nnx(Scaled(nnx.Rngs(0)), [3])


def test_reference_gives_a_factory_spec_without_importing_it():
    def init(key):
        return {"w": jnp.ones((3, 2))}

    model = from_functions(
        init, lambda p, x: x @ p["w"], [3], reference="not_installed.mod:fn", kwargs={"k": (1, 2)}
    )
    assert model.spec == {
        "kind": "factory",
        "factory": "not_installed.mod:fn",
        "kwargs": {"k": [1, 2]},
    }


def test_adapters_refuse_other_module_types():
    with pytest.raises(ConfigError, match="from_flax_linen takes a flax.linen.Module"):
        from_flax_linen(object(), [3])
    with pytest.raises(ConfigError, match="from_flax_nnx takes a flax.nnx.Module"):
        from_flax_nnx(object(), [3])
    with pytest.raises(ConfigError, match="from_equinox takes an equinox.Module"):
        from_equinox(object(), [3])


def test_equinox_module_that_takes_the_batch():
    import equinox as eqx

    class Batched(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            assert x.ndim == 2
            return x @ self.w

    module = Batched(jnp.arange(6.0).reshape(3, 2))
    model = from_equinox(module, [3], per_example=False)
    assert model.out_dim == 2
    x = jnp.ones((4, 3))
    np.testing.assert_array_equal(model.apply(model.init(None), x), x @ module.w)


def test_nnx_other_state_is_held_fixed():
    """nnx state other than Param (here a BatchNorm's running statistics) is not a parameter;
    apply uses it as it was when adapted."""
    from flax import nnx

    class Normed(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.norm = nnx.BatchNorm(2, use_running_average=True, rngs=rngs)

        def __call__(self, x):
            return self.norm(self.lin(x))

    module = Normed(nnx.Rngs(0))
    model = from_flax_nnx(module, [3])
    params = model.init(None)
    assert set(params) == {"lin", "norm"}
    assert set(params["norm"]) == {"scale", "bias"}  # mean/var are not parameters
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(jax.jit(model.apply)(params, x), module(x), rtol=1e-6)


def test_linen_collections_other_than_params_are_held_fixed():
    """A linen BatchNorm's running statistics (collection ``batch_stats``) are not parameters:
    they would get real gradients (the output depends on them) and be trained. apply uses them
    as module.init made them."""
    import flax.linen as nn
    import optax

    from tandem.engine.kernels import StageKernels

    class Normed(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=True)(nn.Dense(2)(x))

    module = Normed()
    model = from_flax_linen(module, [3])
    params = model.init(jax.random.PRNGKey(0))
    assert set(params) == {"params"}
    kernels = StageKernels(model, optax.sgd(0.5), differentiable=[False])
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
    out, vjp = kernels.forward(params, x)
    acc, _ = kernels.backward(vjp, jnp.ones_like(out), kernels.zeros(params))
    trained, _ = kernels.update(params, kernels.init_opt(params), acc)
    variables = module.init(jax.random.PRNGKey(0), x[:1])
    want = module.apply({**variables, "params": trained["params"]}, x)
    np.testing.assert_allclose(model.apply(trained, x), want, rtol=1e-6)


def test_nnx_module_that_mutates_its_state_is_refused_with_the_fix():
    """Active dropout advances its RNG counter, and BatchNorm in training mode its statistics:
    state held fixed cannot change, so the refusal says which module to make deterministic."""
    from flax import nnx

    class Dropped(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    with pytest.raises(ConfigError, match=r"mutates its state.*deterministic=True"):
        from_flax_nnx(Dropped(nnx.Rngs(0)), [3])


@pytest.mark.parametrize(
    "missing, call, extra",
    [
        ("flax.linen", lambda: from_flax_linen(object(), [3]), "tandem[flax]"),
        ("flax.nnx", lambda: from_flax_nnx(object(), [3]), "tandem[flax]"),
        ("equinox", lambda: from_equinox(object(), [3]), "tandem[equinox]"),
    ],
)
def test_missing_extra_names_the_install(monkeypatch, missing, call, extra):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ConfigError, match=re.escape(f"pip install '{extra}'")):
        call()


def test_tandem_never_imports_flax_or_equinox_by_itself():
    code = (
        "import sys, tandem, tandem.parties.models, tandem.parties.split.inference\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flax', 'equinox')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"
