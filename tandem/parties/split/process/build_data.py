"""Reading one split party's data as its configuration describes it (`load_data`).

A table source goes through `tandem.parties.split.process.party_data` (the shared data loader); a
pre-split source (the built-in breast-cancer data, an .npz of x_train/y_train/x_test/y_test,
a numeric .csv) is read here. Errors are `PartyConfigError` naming the key and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tandem.engine.data import RowSource

from .config import PartyConfigError


@dataclasses.dataclass(frozen=True)
class PartyData:
    """One party's (aligned) data. ``alignment`` is ``{"size", "commitment"}`` or None.

    From a table source (`tandem.parties.split.process.party_data`) also: ``validation`` rows,
    ``fingerprint`` (training rows and preprocessing; a pre-split source's arrays are hashed
    instead), ``preprocessing`` (the JSON state the export keeps), ``vocab`` (code counts of
    the categorical columns, the last columns of the features) and ``split`` (its
    ``{"test", "validation", "seed"}``). Its feature matrices are arrays, or with
    ``[data] in_memory = false`` `tandem.parties.data.mapped.MappedRows` of a file.
    """

    train: np.ndarray | RowSource | None
    test: np.ndarray | RowSource | None = None
    y_train: np.ndarray | None = None
    y_test: np.ndarray | None = None
    alignment: dict[str, Any] | None = None
    validation: np.ndarray | RowSource | None = None
    y_validation: np.ndarray | None = None
    fingerprint: str | None = None
    preprocessing: dict[str, Any] | None = None
    vocab: tuple[int, ...] = ()
    split: dict[str, Any] | None = None

    @property
    def features(self) -> int | None:
        return None if self.train is None else int(self.train.shape[1])

    @property
    def samples(self) -> int | None:
        if self.train is not None:
            return int(self.train.shape[0])
        return None if self.y_train is None else int(self.y_train.shape[0])

    def datasets(self) -> dict[str, np.ndarray | RowSource]:
        parts = (("train", self.train), ("test", self.test), ("validation", self.validation))
        return {k: v for k, v in parts if v is not None}

    def labels(self) -> dict[str, np.ndarray]:
        parts = (("train", self.y_train), ("test", self.y_test), ("validation", self.y_validation))
        return {k: v for k, v in parts if v is not None}


def load_data(cfg: Any) -> PartyData:
    """Read the data of the party ``cfg`` (a `tandem.parties.split.process.build.PartySetup`; labels
    too when it owns the loss stage), aligned if
    ``data.aligned`` is set. Raises `PartyConfigError` naming the file and the fix."""
    return _load_data(cfg)


def _load_data(cfg: Any) -> PartyData:
    d = cfg.data
    topo = cfg.topology()
    owner = topo.label_owner == cfg.name
    if d.table is not None:  # a table source: the shared [data]
        from .party_data import load_table_data

        loss = cfg.config.train.loss if owner else None
        return PartyData(**load_table_data(d.table, labels=owner, loss=loss, out=cfg.model.out))
    if d.source == "breast_cancer":
        from .demo import load_breast_cancer_split

        if d.part not in ("leader", "follower"):
            raise PartyConfigError(
                f"{cfg.path}: data.part must be 'leader' or 'follower' with the built-in "
                f"breast_cancer source, got {d.part!r}"
            )
        split = load_breast_cancer_split(d.seed)
        part = getattr(split, str(d.part))  # "leader" or "follower": checked at load
        data = PartyData(
            part["train"],
            part["test"],
            split.labels["train"] if owner else None,
            split.labels["test"] if owner else None,
        )
    elif d.source.endswith(".npz"):
        with np.load(d.source, allow_pickle=False) as z:
            if "x_train" not in z:
                raise PartyConfigError(
                    f"{cfg.path}: data.source {d.source!r} has no array "
                    f"'x_train' (it holds {sorted(z.files)})"
                )
            if owner and "y_train" not in z:
                raise PartyConfigError(
                    f"{cfg.path}: {cfg.name!r} owns the loss stage but "
                    f"{d.source!r} has no 'y_train' labels"
                )
            get = lambda k: np.asarray(z[k]) if k in z else None  # noqa: E731
            data = PartyData(
                get("x_train"),
                get("x_test"),
                get("y_train") if owner else None,
                get("y_test") if owner else None,
            )
    elif d.source.endswith(".csv"):
        x, y = _read_csv(d.source, d.label_column if owner else None, cfg.path)
        xt = yt = None
        if d.test:
            xt, yt = _read_csv(d.test, d.label_column if owner else None, cfg.path)
        data = PartyData(x, xt, y, yt)
    else:
        raise PartyConfigError(
            f"{cfg.path}: data.source {d.source!r} must be 'breast_cancer', a .npz or a .csv file"
        )
    data = dataclasses.replace(
        data,
        train=None if data.train is None else np.asarray(data.train, np.float32),
        test=None if data.test is None else np.asarray(data.test, np.float32),
        y_train=None if data.y_train is None else np.asarray(data.y_train, np.float32),
        y_test=None if data.y_test is None else np.asarray(data.y_test, np.float32),
    )
    if d.aligned:
        data = _align(data, d.aligned, cfg.path)
    from .party_data import arrays_fingerprint

    x = None if data.train is None else np.asarray(data.train)  # a pre-split source: arrays
    digest = arrays_fingerprint({"x": x, "y": data.y_train})
    return dataclasses.replace(data, fingerprint=digest)


def _read_csv(path: str, label: str | None, cfg_path: str):
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None:
            raise PartyConfigError(f"{cfg_path}: {path!r} is empty; expected a header row")
        rows = list(reader)
    if label is not None and label not in header:
        raise PartyConfigError(
            f"{cfg_path}: data.label_column {label!r} is not a column of "
            f"{path!r} (columns: {header})"
        )
    li = header.index(label) if label is not None else None
    try:
        table = np.asarray(rows, dtype=np.float64)
    except ValueError as exc:
        raise PartyConfigError(
            f"{cfg_path}: {path!r} has a non-numeric value ({exc}); feature CSVs hold numbers only"
        ) from None
    if table.ndim != 2 or table.shape[1] != len(header):
        raise PartyConfigError(f"{cfg_path}: {path!r} rows do not all have {len(header)} columns")
    if li is None:
        return table, None
    return np.delete(table, li, axis=1), table[:, li]


def _align(data: PartyData, aligned: str, cfg_path: str) -> PartyData:
    from tandem.parties.data.aligned_file import read_aligned
    from tandem.parties.data.errors import AlignedFileError

    try:
        file = read_aligned(aligned)
    except AlignedFileError as exc:
        raise PartyConfigError(f"{cfg_path}: data.aligned: {exc}") from None
    rows = file.rows
    n = data.samples or 0
    if len(rows) and (rows.min() < 0 or rows.max() >= n):
        raise PartyConfigError(
            f"{cfg_path}: data.aligned {aligned!r} refers to row "
            f"{int(rows.max())} but the training data has {n} rows"
        )
    take = lambda a: None if a is None else a[rows]  # noqa: E731
    return dataclasses.replace(
        data, train=take(data.train), y_train=take(data.y_train), alignment=file.spec_fields()
    )


__all__ = ["PartyData", "load_data"]
