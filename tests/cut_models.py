"""Stage models whose cut tensor is not a float32 matrix: a bottom giving ``dtype[rows, *shape]``
and a top flattening it. Factories (``tests.cut_models:bottom`` / ``:top``), so an export can
rebuild them."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax.numpy as jnp

from tandem.engine.kernels import StageModel, derive_stage
from tandem.engine.models import mlp_apply, mlp_init
from tandem.parties.models import factory_spec


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
