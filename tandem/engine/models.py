"""Small pure models: parameters are pytrees, functions hold no state.

``init(key, ...) -> params`` and ``apply(params, x) -> y`` in the style of optax/equinox pairs.
Used by split stages, federated clients and elastic workers alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

Params = list[dict[str, jax.Array]]


def mlp_init(key: jax.Array, sizes: Sequence[int], *, dtype=jnp.float32) -> Params:
    """He-initialised dense layers ``sizes[0] -> sizes[1] -> ... -> sizes[-1]``."""
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
        raise ValueError(f"an MLP needs at least two positive layer sizes, got {list(sizes)}")
    keys = jax.random.split(key, len(sizes) - 1)
    params = []
    for k, fan_in, fan_out in zip(keys, sizes[:-1], sizes[1:], strict=True):
        w = jax.random.normal(k, (fan_in, fan_out), dtype) * jnp.sqrt(2.0 / fan_in).astype(dtype)
        params.append({"w": w, "b": jnp.zeros((fan_out,), dtype)})
    return params


def mlp_apply(params: Params, x: jax.Array, *, activate_last: bool = False) -> jax.Array:
    """ReLU hidden layers; the last layer is linear unless ``activate_last``."""
    for i, layer in enumerate(params):
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1 or activate_last:
            x = jax.nn.relu(x)
    return x


def count_params(params) -> int:
    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
