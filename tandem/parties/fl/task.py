"""What a federated server and its clients agree on, and how each side gets its rows.

A `Task` is what the server tells every client in its ``welcome``: the model spec (rebuilt
with `tandem.engine.kernels.model_from_spec`, so any model kind that function knows works),
the loss, the seed of the initial parameters (every party builds the same version-0 model from
it; no bytes needed) and the flat parameter count (a check). ``identity`` names the server's
configuration: a client that reconnects to a server now running another configuration stops
instead of mixing two trainings.

`load_rows` reads a party's ``[data]`` through the shared loader (`tandem.parties.data`) and
returns the float32 features and the labels of the rows asked for.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

from tandem.engine.kernels import LOSSES, StageModel, model_from_spec
from tandem.errors import ConfigError
from tandem.parties.data import DataConfig, PartyDataset, load_party_data

from .train import LocalTrainer


@dataclasses.dataclass(frozen=True)
class Task:
    """The model spec (JSON data), the loss, the init seed, the flat size and the identity."""

    model: Mapping[str, Any]
    loss: str
    init_seed: int
    dim: int
    identity: str

    def stage_model(self) -> StageModel:
        return model_from_spec(self.model)

    def trainer(
        self, optimizer: optax.GradientTransformation, *, epochs: int = 1, batch_size: int = 16
    ) -> LocalTrainer:
        """A `LocalTrainer` for this task; raises `ConfigError` if its size is not ``dim``."""
        trainer = LocalTrainer(
            self.stage_model(),
            optimizer,
            loss=self.loss,
            epochs=epochs,
            batch_size=batch_size,
            init_seed=self.init_seed,
        )
        if trainer.dim != self.dim:
            raise ConfigError(
                f"the model {dict(self.model)} has {trainer.dim} parameters here but "
                f"{self.dim} on the server; run the same Tandem version on both"
            )
        return trainer

    def to_meta(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"model": dict(self.model)}

    @classmethod
    def from_meta(cls, meta: Any) -> Task:
        """The task in a welcome's ``meta.task``; raises `ConfigError` naming a bad field."""
        if not isinstance(meta, Mapping):
            raise ConfigError(f"welcome meta.task must be an object, got {meta!r}")
        try:
            task = cls(
                model=dict(meta["model"]),
                loss=str(meta["loss"]),
                init_seed=int(meta["init_seed"]),
                dim=int(meta["dim"]),
                identity=str(meta["identity"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"welcome meta.task is malformed: {exc!r}") from None
        if task.loss not in LOSSES:
            raise ConfigError(f"welcome names loss {task.loss!r}, not one of {sorted(LOSSES)}")
        return task


def out_width(model: Mapping[str, Any], loss: str, where: str) -> int | None:
    """The class count the labels are checked against (``softmax``: the model's ``out_dim``)."""
    if loss != "softmax":
        return None
    out = model.get("out_dim")
    if isinstance(out, bool) or not isinstance(out, int) or out < 2:
        raise ConfigError(
            f"{where}: the softmax loss needs model.out_dim, the number of classes (>= 2), got "
            f"{out!r}"
        )
    return out


def load_rows(
    cfg: DataConfig, *, loss: str, out: int | None
) -> tuple[PartyDataset, np.ndarray, np.ndarray]:
    """``(dataset, features, labels)`` of every row of ``cfg``'s table (float32 features)."""
    data = load_party_data(cfg, loss=loss, out=out)
    if data.features.categorical.shape[1]:
        raise ConfigError(
            f"{cfg.where}: data.categorical is set, but a federated model takes numeric "
            "features only; remove data.categorical (or encode those columns as numbers)"
        )
    if data.labels is None:
        raise ConfigError(f"{cfg.where}: data.label_column is required for federated parties")
    return data, np.asarray(data.features.numeric, np.float32), data.labels


def part(
    data: PartyDataset, x: np.ndarray, y: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of split part ``name`` ("train", "validation", "test")."""
    take = data.split.rows(name)
    return x[take], y[take]


def with_inputs(model: Mapping[str, Any], features: int, where: str) -> dict[str, Any]:
    """``model`` with ``in_dims = [features]`` (the spec's own ``in_dims`` must agree)."""
    spec = dict(model)
    given = spec.setdefault("in_dims", [features])
    if list(given) != [features]:
        raise ConfigError(
            f"{where}: model.in_dims = {given} but the data has {features} feature columns; "
            "leave model.in_dims out (it follows the data) or fix it"
        )
    return spec


__all__ = ["Task", "load_rows", "out_width", "part", "with_inputs"]
