"""Model factories for the tests, named by import path (``"tests.models_fixture:<name>"``).

Each returns a `StageModel` from plain JSON kwargs, as a user's ``mypkg.models`` module would.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tandem.parties.models import (
    embedding_mlp,
    from_equinox,
    from_flax_linen,
    from_flax_nnx,
    from_functions,
)


def functions_bottom(in_dim: int, out: int, scale: float = 1.0):
    """One dense layer with a tanh, as a plain JAX pair over a dict of arrays."""

    def init(key):
        return {"w": scale * jax.random.normal(key, (in_dim, out)), "b": jnp.zeros((out,))}

    def apply(params, x):
        return jnp.tanh(x @ params["w"] + params["b"])

    return from_functions(init, apply, [in_dim], out)


def linen_bottom(in_dim: int, hidden: int, out: int, relu_out: bool = True):
    import flax.linen as nn

    class Bottom(nn.Module):
        @nn.compact
        def __call__(self, x):
            y = nn.Dense(out)(nn.relu(nn.Dense(hidden)(x)))
            return nn.relu(y) if relu_out else y

    return from_flax_linen(Bottom(), [in_dim], out)


def nnx_bottom(in_dim: int, hidden: int, out: int, seed: int = 0, relu_out: bool = True):
    from flax import nnx

    class Bottom(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List([nnx.Linear(in_dim, hidden, rngs=rngs)])
            self.head = nnx.Linear(hidden, out, rngs=rngs)

        def __call__(self, x):
            y = self.head(jax.nn.relu(self.layers[0](x)))
            return jax.nn.relu(y) if relu_out else y

    return from_flax_nnx(Bottom(nnx.Rngs(seed)), [in_dim], out)


def equinox_bottom(in_dim: int, hidden: int, out: int, seed: int = 0, relu_out: bool = True):
    import equinox as eqx

    mlp = eqx.nn.MLP(
        in_dim,
        out,
        hidden,
        depth=1,
        final_activation=jax.nn.relu if relu_out else (lambda x: x),
        key=jax.random.PRNGKey(seed),
    )
    return from_equinox(mlp, [in_dim], out)


def embedding_bottom(n_dense: int, vocab: list[int], dim: int, out: int):
    return embedding_mlp(n_dense, vocab, dim, [8], out)


def not_a_model(**_):
    return {"init": None}


def raises(width: int):
    raise RuntimeError(f"cannot build width {width}")
