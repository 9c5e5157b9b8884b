"""A data server's shard and model from the shared contract, and the trained model's export.

A data server's TOML may describe its shard with the same tables as every other role::

    [data]                       # docs/data.md: the shared loader (CSV, Parquet, npz; fsspec)
    source = "part0.csv"
    label_column = "label"

    [model]                      # docs/models.md: one stage table (kind = "mlp" | "embedding",
    kind = "mlp"                 # or factory = "package.module:function")
    hidden = [32]

    [train]                      # optional; these are the defaults
    loss = "softmax"             # "softmax" (then classes is required), "binary", "mse"
    classes = 4
    optimizer = "adam"
    lr = 0.01
    batch_size = 32
    seed = 0
    drop_last = true             # false: also train each epoch's partial last batch

`load_party_shard` reads the table through `tandem.parties.data.load_party_data` (the split, the
preprocessing fitted on this data server's training rows, the labels checked against the
loss), builds the model with `tandem.parties.models.model_from_toml` over the feature columns
(numeric first, then the categorical codes as floats, as `embedding_mlp` expects) and returns
the training rows as the shard and the test rows for evaluation.

`export_model` writes the trained model in the shared export format
(`tandem.parties.export`): one stage ``"model"`` owned by the data server, reading its
features, with the model's spec, output width, training id, loss and the preprocessing state,
so `tandem.parties.split.inference.load_model` rebuilds it and `load_new_data` prepares new rows.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.engine.topology import FEATURES, Stage, Topology

from .errors import ConfigError
from .spec import ModelSpec, Shard

#: The stage name of an elastic model in its export.
STAGE = "model"
TRAIN_KEYS: dict[str, tuple[type, ...]] = {
    "loss": (str,),
    "classes": (int,),
    "optimizer": (str,),
    "lr": (float, int),
    "batch_size": (int,),
    "seed": (int,),
    "drop_last": (bool,),
}


@dataclasses.dataclass(frozen=True)
class PartyShard:
    """What `load_party_shard` read: the model description all data servers must share, the
    training rows, the test rows (None when the split holds none), the preprocessing state
    (JSON) and the data's fingerprint."""

    spec: ModelSpec
    train: Shard
    test: Shard | None
    preprocessing: dict[str, Any]
    fingerprint: str


def _train_table(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: [train] must be a table, got {raw!r}")
    unknown = sorted(set(raw) - set(TRAIN_KEYS))
    if unknown:
        raise ConfigError(
            f"{where}: [train] has unknown keys {unknown}; accepted: {sorted(TRAIN_KEYS)}"
        )
    for key, kinds in TRAIN_KEYS.items():
        # a bool is an int to isinstance: only a bool key takes one
        wrong_bool = isinstance(raw.get(key), bool) and bool not in kinds
        if key in raw and (not isinstance(raw[key], kinds) or wrong_bool):
            raise ConfigError(
                f"{where}: train.{key} must be {' or '.join(k.__name__ for k in kinds)}, "
                f"got {raw[key]!r}"
            )
    return dict(raw)


def load_party_shard(config: Mapping[str, Any], *, path: str | None = None) -> PartyShard:
    """Read ``config``'s ``[data]``, ``[model]`` and ``[train]`` tables (module docstring);
    ``path`` is the TOML file (relative data paths are resolved against its folder)."""
    from tandem.parties.data import load_party_data, parse_data_config
    from tandem.parties.models import model_from_toml

    where = path or "config"
    if "data" not in config or "model" not in config:
        raise ConfigError(f"{where}: a data server needs both [data] and [model] tables")
    data_cfg = parse_data_config(config["data"], path=path)
    train = _train_table(config.get("train", {}), where)
    loss = train.get("loss", "softmax")
    classes = train.get("classes")
    if loss == "softmax" and classes is None:
        raise ConfigError(
            f"{where}: train.classes is required with the softmax loss (the number of classes; "
            "labels are 0 .. classes - 1)"
        )
    if data_cfg.label_column is None:
        raise ConfigError(f"{where}: data.label_column is required: the data server trains on it")
    out = int(classes) if loss == "softmax" and classes is not None else 1
    dataset = load_party_data(data_cfg, loss=loss, out=out if loss == "softmax" else None)
    x = np.concatenate(
        [dataset.features.numeric, dataset.features.categorical.astype(np.float32)], axis=1
    )
    vocab = [v.size for v in dataset.preprocessing.vocabularies]
    model = model_from_toml(
        config["model"],
        in_dims=[x.shape[1]],
        out_dim=out,
        loss=True,
        vocab=vocab or None,
        where=f"{where}: model",
    )
    if model.spec is None:
        raise ConfigError(
            f"{where}: the model has no spec, so workers could not rebuild it; use a built-in "
            "kind or a factory (docs/models.md)"
        )
    spec = ModelSpec(
        model=dict(model.spec),
        loss=loss,
        optimizer=train.get("optimizer", "adam"),
        lr=float(train.get("lr", 0.01)),
        batch_size=train.get("batch_size", 32),
        seed=train.get("seed", 0),
        drop_last=train.get("drop_last", True),
    )
    labels = dataset.labels
    if labels is None:  # label_column is set, so the loader returned labels
        raise ConfigError(f"{where}: no labels were read from data.label_column")

    def rows(part: str) -> Shard:
        take = dataset.split.rows(part)
        return Shard(
            x=np.ascontiguousarray(x[take], np.float32),
            y=np.ascontiguousarray(labels[take]),
        )

    shard, test = rows("train"), rows("test")
    if len(shard.y) < spec.batch_size:
        raise ConfigError(
            f"{where}: {len(shard.y)} training rows, fewer than one batch ({spec.batch_size}); "
            "lower train.batch_size or add data"
        )
    return PartyShard(
        spec=spec,
        train=shard,
        test=test if len(test.y) else None,
        preprocessing=dataset.preprocessing.to_json(),
        fingerprint=dataset.fingerprint,
    )


def export_model(
    path: str | os.PathLike[str],
    spec: ModelSpec,
    leaves: list[np.ndarray],
    *,
    party: str,
    training: str,
    preprocessing: Mapping[str, Any] | None = None,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Write the model (flat parameter ``leaves`` of ``spec``) as a one-stage export; returns
    the description written (module docstring). ``preprocessing`` and ``fingerprint`` go to
    the export's ``data`` field, as every export records them."""
    from tandem.parties.export import save_stages

    from .kernels import net_for

    net = net_for(spec)
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    os.makedirs(folder, exist_ok=True)
    topology = Topology((Stage(STAGE, party, (FEATURES,), loss=True),))
    return save_stages(
        path,
        {STAGE: net.pytree([np.asarray(a) for a in leaves])},
        topology=topology.to_dict(),
        party=party,
        models={STAGE: dict(net.stage.spec or {})},
        widths={STAGE: net.out_dim},
        training=training,
        loss=spec.loss,
        data=(
            None
            if preprocessing is None
            else {"preprocessing": dict(preprocessing), "fingerprint": fingerprint}
        ),
    )
