"""JAX kernels of elastic training: a worker's gradient and a parameter server's update.

Parameters travel as a flat list of arrays, so they map one-to-one onto frame arrays: for the
built-in ``sizes`` MLP ``[w0, b0, w1, b1, ...]`` (the order of `tandem.engine.models.mlp_init`),
for a model of the shared contract (``ModelSpec.model``) the leaves of its parameter pytree in
``jax.tree_util`` order. `Net` (one per model description, `net_for`) hides the difference. All
functions are pure; jitted functions are cached per model / optimizer so repeated calls do not
retrace.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tandem.engine.models import mlp_apply, mlp_init
from tandem.errors import ConfigError

from .spec import OPTIMIZERS, ModelSpec

if TYPE_CHECKING:
    from tandem.engine.kernels import StageModel


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


# -- any model of the shared contract ---------------------------------------------------------
def _objective(loss: str, out: jax.Array, y: jax.Array) -> jax.Array:
    if loss == "softmax":
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    if loss == "binary":
        return optax.sigmoid_binary_cross_entropy(out[:, 0], y).mean()
    return jnp.mean((out[:, 0] - y) ** 2)


class Net:
    """A model description made runnable on flat parameter leaves (module docstring).

    ``shapes``/``dtypes``: the leaves' layout; ``in_dim``/``out_dim``: feature and output
    widths; ``label_dtype``: int32 for softmax, float32 otherwise; ``stage``: the
    `StageModel` (for exports: its spec and parameter structure)."""

    def __init__(self, spec: ModelSpec) -> None:
        from tandem.parties.models import mlp, model_from_spec

        self.loss_name = spec.loss
        self.label_dtype = np.dtype(np.int32 if spec.loss == "softmax" else np.float32)
        if spec.model is None:
            sizes = tuple(spec.sizes)
            self.stage: StageModel = mlp([sizes[0]], sizes[1:-1], sizes[-1], activate_last=False)
            self._sizes: tuple[int, ...] | None = sizes
            shapes = param_shapes(sizes)
            self.shapes = [tuple(s) for s in shapes]
            self.dtypes = [np.dtype(np.float32)] * len(shapes)
            self._treedef = None
        else:
            self.stage = model_from_spec(spec.model)
            self._sizes = None
            if len(self.stage.in_dims) != 1:
                raise ConfigError(
                    f"an elastic model reads one input (the data's feature columns); this one "
                    f"reads {len(self.stage.in_dims)} (in_dims {list(self.stage.in_dims)})"
                )
            abstract = jax.eval_shape(self.stage.init, jax.random.key(0))
            leaves, self._treedef = jax.tree_util.tree_flatten(abstract)
            self.shapes = [tuple(a.shape) for a in leaves]
            self.dtypes = [np.dtype(a.dtype) for a in leaves]
        self.in_dim = int(self.stage.in_dims[0])
        self.out_dim = int(self.stage.out_dim)
        if spec.loss != "softmax" and self.out_dim != 1:
            raise ConfigError(
                f"the {spec.loss!r} loss trains one output column; the model outputs "
                f"{self.out_dim} (set out = 1 in [model])"
            )
        loss_name = spec.loss

        def objective(flat, x, y):
            return _objective(loss_name, self._apply(flat, x), y)

        self._value_and_grad = jax.jit(jax.value_and_grad(objective))
        self._objective = jax.jit(objective)
        self._forward = jax.jit(self._apply)

    def _apply(self, flat, x):
        return self.stage.apply(self.pytree(flat), x)

    def pytree(self, flat: Sequence[Any]) -> Any:
        """The parameters as the `StageModel` structures them (what an export stores)."""
        if self._treedef is None:
            return _layers(list(flat))
        return jax.tree_util.tree_unflatten(self._treedef, list(flat))

    def init_leaves(self, seed: int) -> list[np.ndarray]:
        """Initial flat parameters; identical on every data server for the same seed."""
        if self._sizes is not None:
            return init_params(self._sizes, seed)
        params = self.stage.init(jax.random.key(seed))
        return [np.array(a, copy=True) for a in jax.tree_util.tree_leaves(params)]

    def loss_and_grad(
        self, flat: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray
    ) -> tuple[float, list[np.ndarray]]:
        loss, grads = self._value_and_grad(list(flat), x, y)
        return float(loss), [np.asarray(g) for g in grads]

    def loss(self, flat: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
        return float(self._objective(list(flat), x, y))

    def accuracy(self, flat: Sequence[np.ndarray], x: np.ndarray, y: np.ndarray) -> float | None:
        """Share of rows predicted right (softmax: arg max; binary: logit > 0); None for mse."""
        if self.loss_name == "mse" or not len(y):
            return None
        out = np.asarray(self._forward(list(flat), x))
        pred = out.argmax(axis=1) if self.loss_name == "softmax" else (out[:, 0] > 0)
        return float(np.mean(pred.astype(np.float32) == y.astype(np.float32)))


@functools.cache
def _net(description: str) -> Net:
    return Net(ModelSpec.from_mapping(json.loads(description)))


def net_for(spec: ModelSpec | Mapping[str, Any]) -> Net:
    """The `Net` of a model description (cached: one per description, so no retrace)."""
    raw = spec if isinstance(spec, Mapping) else spec.to_dict()
    return _net(json.dumps(raw, sort_keys=True))
