"""Local training and evaluation of a model on flat parameter vectors.

`LocalTrainer` is what a federated client runs between two rounds: start from the server's
model (a flat float32 vector), run ``epochs`` passes of an optax optimizer over the local data
in seeded shuffled mini-batches, and return the parameter delta. It is synchronous and
thread-safe (parties call it through ``asyncio.to_thread`` so the event loop keeps serving).

The model is any `tandem.engine.kernels.StageModel` with one input (a list of MLP layer sizes
builds the MLP `mlp_stage` describes, last layer linear); the loss is one of
`tandem.engine.kernels.LOSSES` ("softmax", "binary", "mse") on the model's output.

Jit boundary: one step function per trainer, compiled once for the batch shape; the last short
batch of an epoch is padded and masked, so datasets of any size reuse the same compilation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tandem.engine.kernels import LOSSES, StageModel, mlp_stage
from tandem.engine.models import mlp_init
from tandem.errors import ConfigError, ShapeError

from .compression import FlatSpec, flatten, unflatten


def _correct(loss: str, out: jax.Array, y: jax.Array) -> jax.Array:
    """Per-sample 1.0 where the prediction is right (classification losses only)."""
    if loss == "binary":
        return ((out.reshape(y.shape) > 0) == (y > 0.5)).astype(jnp.float32)
    return (jnp.argmax(out, -1) == y).astype(jnp.float32)


def _initial(model: StageModel, seed: int) -> tuple[np.ndarray, FlatSpec]:
    """The model's initial flat parameters from ``seed``, computed by one compiled function
    (found in the persistent compilation cache after the first process) rather than an
    eager compile per layer's random draw (with the cache warm, an FL client of the 1.1M
    MLP built its trainer in 0.11 CPU s and 22 MB instead of 0.24 s and 57 MB). The function
    is local, so its trace and lowering are freed with it."""
    init_fn = model.init
    key = jax.random.key(seed)
    leaves, treedef = jax.tree_util.tree_flatten(jax.eval_shape(init_fn, key))
    spec = FlatSpec(treedef, tuple(a.shape for a in leaves), tuple(a.dtype for a in leaves))

    def init(key):  # flat inside the function: the vector is built once, not leaf by leaf
        return _flat_f32(init_fn(key))

    # a read-only view of the compiled function's output, not a copy: whoever keeps a model
    # from it copies it (the client's `ClientModel`, the server)
    return np.asarray(jax.jit(init)(key)), spec


def _flat_f32(params):
    """The leaves of ``params`` as one float32 vector (leaf order of JAX, as `flatten`)."""
    flat = [a.reshape(-1).astype(jnp.float32) for a in jax.tree_util.tree_leaves(params)]
    return jnp.concatenate(flat) if flat else jnp.zeros((0,), jnp.float32)


def _unshared(state, params):
    """``state`` with a copy of each leaf that is one of ``params``' (an optimizer that keeps
    the parameters in its state must not share the buffers the step donates)."""
    held = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
    return jax.tree_util.tree_map(lambda a: jnp.copy(a) if id(a) in held else a, state)


class Evaluation(NamedTuple):
    """Mean loss, and accuracy in [0, 1] (None for a loss that does not classify)."""

    loss: float
    accuracy: float | None


class LocalTrainer:
    """Trains ``model`` (a `StageModel`, or MLP layer sizes) on ``loss`` with ``optimizer``
    for ``epochs`` epochs; the initial parameters come from ``init_seed``.

    Invariants: the returned delta has the model's flat size and dtype float32; the same
    ``(params, data, seed)`` gives the same delta.
    """

    def __init__(
        self,
        model: Sequence[int] | StageModel,
        optimizer: optax.GradientTransformation,
        *,
        loss: str = "softmax",
        epochs: int = 1,
        batch_size: int = 16,
        init_seed: int = 0,
    ) -> None:
        if epochs < 1 or batch_size < 1:
            raise ConfigError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
        if loss not in LOSSES:
            raise ConfigError(f"loss {loss!r} is not one of {sorted(LOSSES)}")
        if not isinstance(model, StageModel):
            sizes = [int(s) for s in model]
            # checks the sizes (names them in the error) by tracing only: nothing is computed
            jax.eval_shape(lambda: mlp_init(jax.random.key(0), sizes))
            model = mlp_stage([sizes[0]], sizes[1:-1], sizes[-1], activate_last=False)
        if len(model.in_dims) != 1:
            raise ConfigError(
                f"a federated model takes one input (the features), this one takes "
                f"{len(model.in_dims)}: {list(model.in_dims)}"
            )
        self.model, self.loss = model, loss
        self.features = int(model.in_dims[0])
        self.optimizer = optimizer
        self.epochs = epochs
        self.batch_size = batch_size
        self.init_vec, self.spec = _initial(model, init_seed)
        self.traces = 0  # number of compilations of the step (tests check it stays at 1)
        per_sample = LOSSES[loss]
        apply = model.apply

        def masked_loss(params, x, y, mask):
            losses = per_sample(apply(params, x), y)
            return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)

        def step(params, opt_state, x, y, mask):
            self.traces += 1
            grads = jax.grad(masked_loss)(params, x, y, mask)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        def sums(params, x, y):
            out = apply(params, x)
            right = jnp.sum(_correct(loss, out, y)) if loss != "mse" else jnp.float32(0)
            return jnp.sum(per_sample(out, y)), right

        # the parameters are fresh buffers per `train` call (never the optimizer state's:
        # see `train`), so each step writes the new ones over the old
        self._step = jax.jit(step, donate_argnums=0)
        self._sums = jax.jit(sums)

    @property
    def dim(self) -> int:
        return self.spec.size

    @property
    def classifies(self) -> bool:
        """Whether accuracy means anything for this loss (not for "mse")."""
        return self.loss != "mse"

    def _check(self, x: np.ndarray, y: np.ndarray) -> None:
        if x.ndim != 2 or x.shape[1] != self.features or y.shape != (x.shape[0],):
            raise ShapeError(
                f"local data must be x: (n, {self.features}) and y: (n,), got {x.shape} and "
                f"{y.shape}"
            )

    def warm_up(self, x: np.ndarray, y: np.ndarray) -> None:
        """Compile (or load from the cache) the training step by running it once on the first
        batch of ``(x, y)`` with every row masked out; the result is dropped. A process calls
        it while it prepares, so the trace's and the lowering's temporaries are freed before
        training (`tandem.parties.memory.release_free_memory`), not on top of its buffers."""
        self._check(x, y)
        if x.shape[0] == 0:
            return
        params = unflatten(self.init_vec, self.spec)
        opt_state = _unshared(self.optimizer.init(params), params)
        pad = np.resize(np.arange(min(x.shape[0], self.batch_size)), self.batch_size)
        mask = np.zeros(self.batch_size, np.float32)
        jax.block_until_ready(self._step(params, opt_state, x[pad], y[pad], mask))

    def train(self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        """Train from flat parameters ``vec``; returns ``new - vec`` (float32, flat)."""
        self._check(x, y)
        params = unflatten(vec, self.spec)
        opt_state = _unshared(self.optimizer.init(params), params)
        rng = np.random.default_rng(seed)
        n, b = x.shape[0], self.batch_size
        for _ in range(self.epochs):
            order = rng.permutation(n)
            for start in range(0, n, b):
                sel = order[start : start + b]
                mask = np.zeros(b, np.float32)
                mask[: sel.size] = 1.0
                pad = np.resize(sel, b)  # repeats indices; masked out of the loss
                params, opt_state = self._step(params, opt_state, x[pad], y[pad], mask)
        new, _ = flatten(params)
        del params
        new -= np.asarray(vec, np.float32)  # in place: `flatten` made a new vector
        return new

    def evaluate(
        self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, *, batch_size: int = 1024
    ) -> Evaluation:
        """The mean loss and the accuracy (None for "mse") of flat parameters ``vec`` on
        ``(x, y)``, in batches of ``batch_size`` rows."""
        if x.shape[0] == 0:
            raise ShapeError("cannot evaluate on zero rows; give the evaluation set some rows")
        loss, right = self.sums(vec, x, y, batch_size=batch_size)
        n = x.shape[0]
        return Evaluation(loss / n, right / n if self.classifies else None)

    def sums(
        self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, *, batch_size: int = 1024
    ) -> tuple[float, float]:
        """``(loss sum, correct count)`` of flat parameters ``vec`` over the rows of
        ``(x, y)`` (the count is 0 for "mse"; both 0 for no rows): sums, so that parties can
        add theirs up (federated evaluation, `tandem.parties.fl.evaluation`)."""
        self._check(x, y)
        params = unflatten(vec, self.spec)
        loss = right = 0.0
        for start in range(0, x.shape[0], batch_size):
            part_loss, part_right = self._sums(
                params, x[start : start + batch_size], y[start : start + batch_size]
            )
            loss, right = loss + float(part_loss), right + float(part_right)
        return loss, right

    def accuracy(self, vec: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Top-1 accuracy (0..1) of flat parameters ``vec`` on ``(x, y)``."""
        acc = self.evaluate(vec, x, y).accuracy
        if acc is None:
            raise ConfigError(
                f"accuracy needs a classification loss, this trainer's is {self.loss}"
            )
        return acc


def flat_spec_for(sizes: Sequence[int], init_seed: int = 0) -> tuple[np.ndarray, FlatSpec]:
    """The initial flat parameters and spec of an MLP (shared seed: no bytes needed)."""
    return flatten(mlp_init(jax.random.key(init_seed), tuple(sizes)))
