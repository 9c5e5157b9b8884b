"""Client training of a simulation as Ray tasks (``tandem fl simulate --ray ADDRESS``).

`RayTrainer` stands in for a client's `LocalTrainer`: everything else of the round (the model
message, compression, the reply, secure aggregation) stays in `FLClient`'s own code on the
driver, and only ``train`` runs on the cluster, as one Ray task per client round. What crosses
Ray is plain data: the trainer's description (a JSON-able dict, `TrainerSpec`) and raw
little-endian array bytes with their dtype and shape, never a pickled Tandem object; a task
rebuilds the trainer once per Ray worker process (cached by description) and returns the
delta's bytes. The driver still loads each sampled client's rows (at most ``per_round`` at
once) and sends them with the task.

Needs the ``ray`` extra (`tandem._extras`).
"""

from __future__ import annotations

import functools
import json
from typing import Any, TypedDict

import numpy as np

from tandem._extras import needs

from ..train import LocalTrainer


class TrainerSpec(TypedDict):
    """A `LocalTrainer` as plain data: MLP layer ``sizes``, client SGD ``lr``, ``epochs``,
    ``batch_size``, ``init_seed`` and ``loss``."""

    sizes: list[int]
    lr: float
    epochs: int
    batch_size: int
    init_seed: int
    loss: str


def build_trainer(spec: TrainerSpec) -> LocalTrainer:
    """The `LocalTrainer` ``spec`` describes (optax SGD)."""
    args, kwargs = _trainer_arguments(spec)
    return LocalTrainer(*args, **kwargs)


def _trainer_arguments(spec: TrainerSpec) -> tuple[tuple, dict[str, Any]]:
    """`LocalTrainer`'s arguments for ``spec``: the model's sizes, optax SGD, the rest."""
    import optax

    kwargs = dict(
        loss=spec["loss"],
        epochs=spec["epochs"],
        batch_size=spec["batch_size"],
        init_seed=spec["init_seed"],
    )
    return (spec["sizes"], optax.sgd(spec["lr"])), kwargs


@functools.cache
def _cached(description: str) -> LocalTrainer:
    return build_trainer(json.loads(description))


def _array(raw: bytes, dtype: str, shape: list[int]) -> np.ndarray:
    return np.frombuffer(raw, np.dtype(dtype).newbyteorder("<")).reshape(shape)


def _bytes(a: np.ndarray) -> tuple[bytes, str, list[int]]:
    a = np.ascontiguousarray(a, a.dtype.newbyteorder("<"))
    return a.tobytes(), a.dtype.str.lstrip("<>|="), list(a.shape)


def train_task(description: str, vec: tuple, x: tuple, y: tuple, seed: int) -> bytes:
    """The body of one Ray task: rebuild (or reuse) the trainer, train, return the delta."""
    trainer = _cached(description)
    delta = trainer.train(_array(*vec), _array(*x), _array(*y), seed)
    return np.asarray(delta, "<f4").tobytes()


class RayTrainer(LocalTrainer):
    """A `LocalTrainer` (built from ``spec``, for the model's shape and evaluation on the
    driver) whose ``train`` runs as a Ray task on the cluster ``ray.init`` joined."""

    def __init__(self, spec: TrainerSpec) -> None:
        args, kwargs = _trainer_arguments(spec)
        super().__init__(*args, **kwargs)
        self.description = json.dumps(spec, sort_keys=True)
        with needs("ray", "client rounds as Ray tasks (tandem fl simulate --ray)"):
            import ray
        self._ray = ray
        self._task: Any = ray.remote(train_task)

    def train(self, vec: np.ndarray, x: np.ndarray, y: np.ndarray, seed: int) -> np.ndarray:
        ref = self._task.remote(self.description, _bytes(vec), _bytes(x), _bytes(y), int(seed))
        return np.frombuffer(self._ray.get(ref), "<f4").copy()


def connect(address: str) -> None:
    """Join the Ray cluster at ``address`` ("auto", "ray://host:10001", or "local" for a
    one-machine cluster started here)."""
    with needs("ray", "client rounds as Ray tasks (tandem fl simulate --ray)"):
        import ray
    if not ray.is_initialized():
        if address == "local":
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, include_dashboard=False, log_to_driver=False)


__all__ = ["RayTrainer", "TrainerSpec", "build_trainer", "connect", "train_task"]
