"""Stage models whose cut tensor is not a float32 matrix: a bottom giving ``dtype[rows, *shape]``
and a top flattening it, as plain JAX pairs (`bottom`, `top`, `flat_top` reading several
inputs) and through the adapters (`equinox_bottom`, `linen_top`). Factories
(``tests.cut_models:<name>``), so an export can rebuild them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from tandem.engine.kernels import StageModel, derive_stage
from tandem.engine.models import mlp_apply, mlp_init
from tandem.parties.models import factory_spec, from_equinox, from_flax_linen


def bottom(features: int, shape: Sequence[int], dtype: str, hidden: int = 8) -> StageModel:
    """float32 MLP ``features -> hidden -> prod(shape)``, its output reshaped to
    ``[rows, *shape]`` and cast to ``dtype`` (the parameters stay float32)."""
    shape = [int(d) for d in shape]

    def init(key):
        return mlp_init(key, [features, hidden, math.prod(shape)])

    def apply(params, x):
        y = mlp_apply(params, x, activate_last=True)
        return y.reshape(x.shape[0], *shape).astype(dtype)

    kwargs = {"features": features, "shape": shape, "dtype": dtype, "hidden": hidden}
    return derive_stage(init, apply, [features], factory_spec("tests.cut_models:bottom", kwargs))


def top(shape: Sequence[int], dtype: str, hidden: int = 6, out: int = 1) -> StageModel:
    """Reads a ``dtype[rows, *shape]`` cut, flattens it to float32, MLP with linear logits."""
    shape = [int(d) for d in shape]

    def init(key):
        return mlp_init(key, [math.prod(shape), hidden, out])

    def apply(params, z):
        flat = z.reshape(z.shape[0], -1).astype(jnp.float32)
        return mlp_apply(params, flat, activate_last=False)

    kwargs = {"shape": shape, "dtype": dtype, "hidden": hidden, "out": out}
    return derive_stage(init, apply, [(shape, dtype)], factory_spec("tests.cut_models:top", kwargs))


def flat_top(inputs: Sequence[Any], hidden: int = 6, out: int = 1) -> StageModel:
    """Reads one input per ``[shape, dtype]`` of ``inputs`` (a feature matrix is ``[[d],
    "float32"]``), flattens each to float32, concatenates them, MLP with linear logits."""
    cuts = [([int(d) for d in shape], str(dtype)) for shape, dtype in inputs]
    width = sum(math.prod(shape) for shape, _ in cuts)

    def init(key):
        return mlp_init(key, [width, hidden, out])

    def apply(params, *zs):
        flat = [z.reshape(z.shape[0], -1).astype(jnp.float32) for z in zs]
        return mlp_apply(params, jnp.concatenate(flat, axis=-1), activate_last=False)

    kwargs = {"inputs": [[shape, dtype] for shape, dtype in cuts], "hidden": hidden, "out": out}
    return derive_stage(init, apply, cuts, factory_spec("tests.cut_models:flat_top", kwargs))


def equinox_bottom(
    features: int, shape: Sequence[int], dtype: str, hidden: int = 8, seed: int = 0
) -> StageModel:
    """An Equinox MLP per example, ``features -> hidden -> prod(shape)`` with a tanh, its output
    reshaped to ``shape`` and cast to ``dtype`` (`from_equinox` derives the cut from it)."""
    import equinox as eqx

    shape = [int(d) for d in shape]

    class Bottom(eqx.Module):
        mlp: eqx.nn.MLP

        def __call__(self, x):
            return self.mlp(x).reshape(shape).astype(dtype)

    mlp = eqx.nn.MLP(
        features,
        math.prod(shape),
        hidden,
        depth=1,
        final_activation=jnp.tanh,
        key=jax.random.PRNGKey(seed),
    )
    kwargs = {"features": features, "shape": shape, "dtype": dtype, "hidden": hidden, "seed": seed}
    return from_equinox(
        Bottom(mlp), [features], reference="tests.cut_models:equinox_bottom", kwargs=kwargs
    )


def linen_top(shape: Sequence[int], dtype: str, hidden: int = 6, out: int = 1) -> StageModel:
    """A Flax linen top reading a ``dtype[rows, *shape]`` cut: flattened to float32, then
    ``Dense(hidden)``, relu, ``Dense(out)`` (linear logits)."""
    import flax.linen as nn

    shape = [int(d) for d in shape]

    class Top(nn.Module):
        @nn.compact
        def __call__(self, z):
            flat = z.reshape(z.shape[0], -1).astype(jnp.float32)
            return nn.Dense(out)(nn.relu(nn.Dense(hidden)(flat)))

    kwargs = {"shape": shape, "dtype": dtype, "hidden": hidden, "out": out}
    return from_flax_linen(
        Top(), [(shape, dtype)], out, reference="tests.cut_models:linen_top", kwargs=kwargs
    )
