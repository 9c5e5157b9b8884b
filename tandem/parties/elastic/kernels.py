"""JAX kernels of elastic training: a worker's gradient and a parameter server's update.

Parameters travel as a flat list of arrays ``[w0, b0, w1, b1, ...]`` (the order of
`tandem.engine.models.mlp_init`), so they map one-to-one onto frame arrays. All functions are pure;
jitted functions are cached per model shape / optimizer so repeated calls do not retrace.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tandem.engine.models import mlp_apply, mlp_init
from tandem.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam")


def _layers(flat: Sequence[jax.Array]) -> list[dict[str, jax.Array]]:
    return [{"w": flat[i], "b": flat[i + 1]} for i in range(0, len(flat), 2)]


def init_params(sizes: Sequence[int], seed: int) -> list[np.ndarray]:
    """Initial flat parameters; identical on every data server for the same seed."""
    layers = mlp_init(jax.random.key(seed), tuple(sizes))
    return [np.asarray(a) for layer in layers for a in (layer["w"], layer["b"])]


def param_shapes(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:], strict=True):
        out += [(fan_in, fan_out), (fan_out,)]
    return out


def _loss(flat, x, y):
    logits = mlp_apply(_layers(flat), x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@functools.cache
def _grad() -> Callable[..., Any]:
    return jax.jit(jax.value_and_grad(_loss))


@functools.cache
def _eval() -> Callable[..., Any]:
    return jax.jit(_loss)


def loss_and_grad(
    params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
) -> tuple[float, list[np.ndarray]]:
    """Mean softmax cross-entropy of the batch and its gradient (host arrays)."""
    loss, grads = _grad()(list(params), x, y)
    return float(loss), [np.asarray(g) for g in grads]


def loss(params: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(_eval()(list(params), x, y))


@functools.cache
def optimizer(name: str, lr: float) -> optax.GradientTransformation:
    if name == "sgd":
        return optax.sgd(lr)
    if name == "momentum":
        return optax.sgd(lr, momentum=0.9)
    if name == "adam":
        return optax.adam(lr)
    raise ConfigError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


@functools.cache
def _update(name: str, lr: float) -> Callable[..., Any]:
    opt = optimizer(name, lr)

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(step)


def init_state(name: str, lr: float, params: Sequence[np.ndarray]):
    """Optimizer state as a pytree of host arrays."""
    state = optimizer(name, lr).init([jnp.asarray(p) for p in params])
    return jax.tree_util.tree_map(np.asarray, state)


def apply_update(name: str, lr: float, params, state, grads):
    """One optax step; returns new ``(params, state)`` as host arrays (inputs untouched)."""
    new_p, new_s = _update(name, lr)(list(params), state, list(grads))
    return [np.asarray(p) for p in new_p], jax.tree_util.tree_map(np.asarray, new_s)
