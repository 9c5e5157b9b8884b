"""Local training and evaluation of an MLP classifier on flat parameter vectors.

`LocalTrainer` is what a federated client runs between two rounds: start from the server's
model (a flat float32 vector), run ``epochs`` passes of an optax optimizer over the local data
in seeded shuffled mini-batches, and return the parameter delta. It is synchronous and
thread-safe (parties call it through ``asyncio.to_thread`` so the event loop keeps serving).

Jit boundary: one step function per trainer, compiled once for the batch shape; the last short
batch of an epoch is padded and masked, so datasets of any size reuse the same compilation.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from tandem.engine.models import mlp_apply, mlp_init
from tandem.errors import ConfigError, ShapeError

from .compression import FlatSpec, flatten, unflatten


def _loss(params, x, y, mask):
    logits = mlp_apply(params, x)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, y)
    return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0)


class LocalTrainer:
    """Trains an MLP ``sizes`` classifier with ``optimizer`` for ``epochs`` epochs.

    Invariants: the returned delta has the model's flat size and dtype float32; the same
    ``(params, data, seed)`` gives the same delta.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        optimizer: optax.GradientTransformation,
        *,
        epochs: int = 1,
        batch_size: int = 16,
        init_seed: int = 0,
    ) -> None:
        if epochs < 1 or batch_size < 1:
            raise ConfigError(f"epochs and batch_size must be >= 1, got {epochs}, {batch_size}")
        self.sizes = tuple(int(s) for s in sizes)
        self.optimizer = optimizer
        self.epochs = epochs
        self.batch_size = batch_size
        params = mlp_init(jax.random.key(init_seed), self.sizes)
        self.init_vec, self.spec = flatten(params)
        self.traces = 0  # number of compilations of the step (tests check it stays at 1)

        def step(params, opt_state, x, y, mask):
            self.traces += 1
            grads = jax.grad(_loss)(params, x, y, mask)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        self._step = jax.jit(step)
        self._accuracy = jax.jit(lambda p, x, y: jnp.mean(jnp.argmax(mlp_apply(p, x), -1) == y))

    @property
    def dim(self) -> int:
        return self.spec.size

    def _check(self, x: np.ndarray, y: np.ndarray) -> None:
        if x.ndim != 2 or x.shape[1] != self.sizes[0] or y.shape != (x.shape[0],):
            raise ShapeError(
                f"local data must be x: (n, {self.sizes[0]}) and y: (n,), got {x.shape} and "
                f"{y.shape}"
            )

    def train(self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        """Train from flat parameters ``vec``; returns ``new - vec`` (float32, flat)."""
        self._check(x, y)
        params = unflatten(vec, self.spec)
        opt_state = self.optimizer.init(params)
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
        return new - np.asarray(vec, np.float32)

    def accuracy(self, vec: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
        """Top-1 accuracy (0..1) of flat parameters ``vec`` on ``(x, y)``."""
        self._check(x, y)
        return float(self._accuracy(unflatten(vec, self.spec), x, y))


def flat_spec_for(sizes: Sequence[int], init_seed: int = 0) -> tuple[np.ndarray, FlatSpec]:
    """The initial flat parameters and spec of an MLP (shared seed: no bytes needed)."""
    return flatten(mlp_init(jax.random.key(init_seed), tuple(sizes)))
