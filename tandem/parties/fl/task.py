"""What a federated server and its clients agree on, and how each side gets its rows.

A `Task` is what the server tells every client in its ``welcome``: the model spec (rebuilt
with `tandem.engine.kernels.model_from_spec`, so any model kind that function knows works),
the loss, the seed of the initial parameters (every party builds the same version-0 model from
it; no bytes needed) and the flat parameter count (a check). ``identity`` names the server's
configuration: a client that reconnects to a server now running another configuration stops
instead of mixing two trainings. ``preprocessing`` is the federated preprocessing state
(`tandem.parties.fl.preprocessing`; JSON of `tandem.parties.data.Preprocessing`), or None when
each client fits its own (``[preprocessing] mode = "per_client"``).

`load_rows` reads a party's ``[data]`` through the shared loader (`tandem.parties.data`) and
returns the float32 features (``[numeric | categorical codes]``) and the labels of its rows,
under a given preprocessing state or, without one, the party's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

from tandem.engine.kernels import LOSSES, StageModel, model_from_spec
from tandem.errors import ConfigError
from tandem.parties.data import DataConfig, PartyDataset, Preprocessing, load_party_data

from .preprocessing import apply_state, feature_matrix
from .train import LocalTrainer


@dataclasses.dataclass(frozen=True)
class Task:
    """The model spec (JSON data), the loss, the init seed, the flat size, the identity and
    the federated preprocessing state (or None)."""

    model: Mapping[str, Any]
    loss: str
    init_seed: int
    dim: int
    identity: str
    preprocessing: Mapping[str, Any] | None = None

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

    def state(self) -> Preprocessing | None:
        """The federated preprocessing state, or None (`tandem.errors.ConfigError` when the
        welcome's is malformed)."""
        if self.preprocessing is None:
            return None
        from tandem.parties.data import DataError

        try:
            return Preprocessing.from_json(self.preprocessing)
        except DataError as exc:
            raise ConfigError(f"welcome meta.task.preprocessing: {exc}") from None

    def to_meta(self) -> dict[str, Any]:
        meta = dataclasses.asdict(self) | {"model": dict(self.model)}
        if self.preprocessing is None:
            del meta["preprocessing"]
        return meta

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
                preprocessing=_mapping(meta.get("preprocessing")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"welcome meta.task is malformed: {exc!r}") from None
        if task.loss not in LOSSES:
            raise ConfigError(f"welcome names loss {task.loss!r}, not one of {sorted(LOSSES)}")
        return task


def _mapping(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"preprocessing must be an object, got {type(value).__name__}")
    return dict(value)


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
    cfg: DataConfig, *, loss: str, out: int | None, state: Preprocessing | None = None
) -> tuple[PartyDataset, np.ndarray, np.ndarray]:
    """``(dataset, features, labels)`` of every row of ``cfg``'s table: float32 features
    ``[numeric | categorical codes]`` under ``state``, or under the party's own fit when
    ``state`` is None (``dataset.preprocessing`` is that own fit either way)."""
    data, x = load_features(cfg, loss=loss, out=out, state=state)
    if data.labels is None:
        raise ConfigError(f"{cfg.where}: data.label_column is required for federated parties")
    return data, x, data.labels


def load_features(
    cfg: DataConfig, *, loss: str, out: int | None, state: Preprocessing | None = None
) -> tuple[PartyDataset, np.ndarray]:
    """As `load_rows`, for a table that may have no labels (``dataset.labels`` is None
    then): a server that leaves evaluation to its clients."""
    data = load_party_data(cfg, loss=loss, out=out)
    if state is None:
        return data, feature_matrix(data.features)
    own = data.preprocessing
    if (own.numeric, own.categorical) != (state.numeric, state.categorical):
        raise ConfigError(
            f"{cfg.where}: the features are {list(own.numeric)} (numeric) and "
            f"{list(own.categorical)} (categorical) here, but the server's preprocessing has "
            f"{list(state.numeric)} and {list(state.categorical)}; give every party the same "
            "data.features and data.categorical"
        )
    return data, apply_state(cfg, data, state)


def input_width(model: Mapping[str, Any]) -> int | None:
    """The feature columns ``model`` (a task's spec) reads, when its spec says so."""
    if model.get("kind") == "embedding" and "n_dense" in model and "vocab" in model:
        return int(model["n_dense"]) + len(model["vocab"])
    dims = model.get("in_dims")
    return int(dims[0]) if isinstance(dims, list) and len(dims) == 1 else None


def part(
    data: PartyDataset, x: np.ndarray, y: np.ndarray, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """The rows of split part ``name`` ("train", "validation", "test")."""
    take = data.split.rows(name)
    return x[take], y[take]


def with_inputs(
    model: Mapping[str, Any], features: int, where: str, state: Preprocessing | None = None
) -> dict[str, Any]:
    """``model`` with ``in_dims = [features]`` (the spec's own ``in_dims`` must agree); an
    ``embedding`` model gets ``n_dense`` and ``vocab`` from ``state`` instead, where absent."""
    spec = dict(model)
    if spec.get("kind") == "embedding":
        if state is None:
            return spec
        spec.setdefault("n_dense", len(state.numeric))
        spec.setdefault("vocab", [v.size for v in state.vocabularies])
        return spec
    given = spec.setdefault("in_dims", [features])
    if list(given) != [features]:
        raise ConfigError(
            f"{where}: model.in_dims = {given} but the data has {features} feature columns; "
            "leave model.in_dims out (it follows the data) or fix it"
        )
    return spec


__all__ = ["Task", "input_width", "load_rows", "out_width", "part", "with_inputs"]
