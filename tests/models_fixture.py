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


WIDTH = 3  # not a factory


def not_a_model(**_):
    return {"init": None}


def raises(width: int):
    raise RuntimeError(f"cannot build width {width}")


# -- helpers for the tests -----------------------------------------------------------------------
def toy_problem(seed: int, rows: int, dense: int, vocab: tuple[int, ...] = ()):
    """(x, y): ``dense`` normal columns then one code column per ``vocab`` entry (codes
    1..v-1 as floats); the label depends on a dense column and on the first code's parity."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, dense)).astype(np.float32)
    codes = [rng.integers(1, v, size=(rows, 1)).astype(np.float32) for v in vocab]
    x = np.concatenate([x, *codes], axis=1) if codes else x
    score = x[:, 0] + (2.0 * (codes[0][:, 0] % 2) - 1.0 if codes else 0.0)
    return x, (score > 0).astype(np.float32)


def train(model, x, y, *, steps: int, learning_rate: float = 0.05):
    """Train ``model`` (a loss stage: its first output column is the logit) with
    `StageKernels.loss_step` and ``update``; returns (kernels, params, losses per step)."""
    import optax

    from tandem.engine.kernels import StageKernels, get_loss

    kernels = StageKernels(
        model, optax.adam(learning_rate), get_loss("binary"), differentiable=[False]
    )
    params = model.init(jax.random.PRNGKey(0))
    opt_state = kernels.init_opt(params)
    xs, ys, scale = jnp.asarray(x), jnp.asarray(y), jnp.float32(1.0 / len(y))
    losses = []
    for _ in range(steps):
        acc = kernels.zeros(params)
        acc, loss, _, grads = kernels.loss_step(params, acc, jnp.float32(0), ys, scale, xs)
        assert grads == (None,)  # raw features get no gradient
        params, opt_state = kernels.update(params, opt_state, acc)
        losses.append(float(loss))
    return kernels, params, losses


def train_bottom(model, x, y, *, steps: int, learning_rate: float = 0.05):
    """Train ``model`` as a bottom stage with `StageKernels.forward`/``backward``: the loss
    (binary, on the sum of its outputs minus 1) is computed outside, as a top would; returns
    (kernels, params, losses per step)."""
    import optax

    from tandem.engine.kernels import StageKernels, binary_logistic

    kernels = StageKernels(model, optax.adam(learning_rate), differentiable=[False])
    params = model.init(jax.random.PRNGKey(0))
    opt_state = kernels.init_opt(params)
    xs, ys = jnp.asarray(x), jnp.asarray(y)

    def top(out):
        return jnp.mean(binary_logistic(jnp.sum(out, axis=-1) - 1.0, ys))

    losses = []
    for _ in range(steps):
        out, vjp = kernels.forward(params, xs)
        loss, cot = jax.value_and_grad(top)(out)
        acc, grads = kernels.backward(vjp, cot, kernels.zeros(params))
        assert grads == (None,)
        params, opt_state = kernels.update(params, opt_state, acc)
        losses.append(float(loss))
    return kernels, params, losses
