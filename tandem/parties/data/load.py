"""The one entry point every system reads party data through.

`load_party_data(cfg, loss=..., out=...)` (training): read ``cfg.source``, keep the aligned
rows in the agreed order (``cfg.aligned``) or every row, split them by id and seed, fit the
preprocessing on the training rows only, transform every kept row, check the labels against
the loss, and fingerprint the training rows with the preprocessing.

`load_new_data(cfg, preprocessing)` (prediction): read ``cfg.source`` (aligned if
``cfg.aligned``) and apply a saved preprocessing state exactly; ``cfg.features``,
``categorical``, ``missing`` and ``scale`` are not consulted there, the state decides. In a
CSV file, a categorical column fitted on text is read as text, so a written value gets its
training code whatever other values the new file holds.

Every error is a `DataError` that names the TOML file (when there is one), the data file, the
column or key, and the fix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np

from .aligned_file import read_aligned
from .config import DataConfig
from .errors import AlignedFileError, DataError
from .fingerprint import fingerprint
from .ids import first_duplicate, id_hashes
from .idtext import IdText
from .labels import labels_for_loss
from .preprocess import Features, Preprocessing, fit_transform
from .split import Split, assign_split
from .table import Table, open_table


@dataclasses.dataclass(frozen=True)
class PartyDataset:
    """One party's training data, every array in the same row order (the aligned order when
    ``data.aligned`` is set, else the file's, unless `load_party_data` was asked to reorder).

    ``id_text`` (the ids' UTF-8 bytes, `IdText`; ``ids`` builds str objects from it on first
    use) and ``rows`` (int64 data rows of the source) identify the rows; ``features`` holds
    float32 numeric features and int32 categorical codes (0 = unseen or missing);
    ``labels`` (label party only) are float32 for "binary"/"mse", int32 for "softmax";
    ``split`` masks the rows; ``fingerprint`` covers the training rows and the
    preprocessing; ``alignment`` is ``{"size", "commitment"}`` of the aligned file, or None.
    """

    id_text: IdText
    rows: np.ndarray
    features: Features
    labels: np.ndarray | None
    split: Split
    preprocessing: Preprocessing
    fingerprint: str
    alignment: dict[str, Any] | None = None

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """The ids as an object array of str."""
        return self.id_text.to_objects()

    def part(self, name: str) -> tuple[Features, np.ndarray | None]:
        """``(features, labels)`` of the rows in ``name`` ("train", "validation", "test")."""
        take = self.split.rows(name)
        features = Features(self.features.numeric[take], self.features.categorical[take])
        return features, None if self.labels is None else self.labels[take]


@dataclasses.dataclass(frozen=True)
class NewData:
    """Rows to predict on: ``ids``, their data ``rows`` in the source, and their features;
    ``counts``: per feature column where it happened, the cells filled in (``missing``) and
    the categories outside the training's vocabulary (``unseen``)
    (`Preprocessing.transform_counted`)."""

    ids: np.ndarray
    rows: np.ndarray
    features: Features
    alignment: dict[str, Any] | None = None
    counts: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)


def load_party_data(
    cfg: DataConfig,
    *,
    loss: str | None = None,
    out: int | None = None,
    sort_by_id: bool = False,
    group_by_part: bool = False,
    packed: bool = False,
    spill_dir: str | None = None,
) -> PartyDataset:
    """Load one party's training data as described in the module docstring.

    ``loss`` ("binary", "softmax", "mse") and ``out`` (the class count, for "softmax") are
    required when ``cfg.label_column`` is set: the labels are checked against them.

    The rows come in the aligned (or file) order, or, with ``sort_by_id`` and no
    ``cfg.aligned``, sorted by the UTF-8 bytes of their ids (`tandem align`'s order); with
    ``group_by_part``, the training rows first, then validation, then test, each in that
    order, so every part is a contiguous slice. Neither changes the preprocessing (fitted on
    the training rows in source order) nor the fingerprint of a given training-row order.
    ``packed`` returns `Features` packed as `allocate_features` says; with ``spill_dir``
    too, the packed matrix is a file in that folder (`Features.spill`), written and read a
    column or a chunk of rows at a time.

    A Parquet source is read one column at a time (`open_table`): what is held at once is
    the ids (`IdText`), the row bookkeeping, the preallocated features and one column."""
    if cfg.label_column is not None and loss is None:
        raise DataError(
            f"{cfg.where}: data.label_column is set, so load_party_data needs the loss the "
            "labels train (loss='binary', 'softmax' or 'mse')"
        )
    with _in(cfg):
        columns = None
        if cfg.features is not None:
            named = [c for c in (cfg.id_column, cfg.label_column) if c is not None]
            columns = list(dict.fromkeys([*named, *cfg.features]))
        table = _read(cfg, columns)
        ids, rows, alignment = _ids_and_rows(cfg, table)
        hashes = id_hashes(ids)
        duplicate = None if cfg.id_column is None else first_duplicate(ids, hashes)
        if duplicate is not None:
            _refuse_duplicate(cfg, rows, *duplicate)
        split = assign_split(ids, cfg.split, hashes=hashes)
        del hashes
        train_rows = rows[split.train]
        order = _order(ids, split, by_id=sort_by_id and cfg.aligned is None, by_part=group_by_part)
        if order is not None:
            ids, rows = ids.take(order), rows[order]
            split = Split(split.train[order], split.validation[order], split.test[order])
        del order
        preprocessing, features = fit_transform(
            table, cfg, train_rows, rows, packed=packed, spill_dir=spill_dir
        )
        labels = None
        if cfg.label_column is not None and loss is not None:
            labels = labels_for_loss(
                table[cfg.label_column], rows, loss=loss, out=out, source=cfg.source
            )
        del table
        train = split.rows("train")
        digest = fingerprint(ids, features, labels, preprocessing, train)
    return PartyDataset(ids, rows, features, labels, split, preprocessing, digest, alignment)


def _order(ids: IdText, split: Split, *, by_id: bool, by_part: bool) -> np.ndarray | None:
    """The positions that put the rows in the order `load_party_data` documents, or None to
    keep them."""
    if not (by_id or by_part):
        return None
    order = ids.sort_order() if by_id else np.arange(len(ids), dtype=np.int64)
    if by_part:
        part = np.full(len(order), 2, np.int8)
        part[split.train[order]] = 0
        part[split.validation[order]] = 1
        order = order[np.argsort(part, kind="stable")]
    return order


def load_new_data(cfg: DataConfig, preprocessing: Preprocessing) -> NewData:
    """Features of the rows of ``cfg.source`` (aligned if ``cfg.aligned``) under a saved
    ``preprocessing`` state (see the module docstring)."""
    with _in(cfg):
        columns = None
        if not preprocessing.all_columns:
            named = [c for c in (cfg.id_column,) if c is not None]
            columns = list(dict.fromkeys([*named, *preprocessing.columns]))
        # A CSV column is text only when some cell is not a number: a column fitted on text
        # is read as text, so "007" stays the category "007" in a file of numbers only.
        text: tuple[str, ...] = ()
        if cfg.source.lower().endswith(".csv"):
            fitted = zip(preprocessing.categorical, preprocessing.vocabularies, strict=True)
            text = tuple(name for name, v in fitted if v.kind == "string")
        table = _read(cfg, columns, text)
        ids, rows, alignment = _ids_and_rows(cfg, table)
        duplicate = None if cfg.id_column is None else first_duplicate(ids)
        if duplicate is not None:
            _refuse_duplicate(cfg, rows, *duplicate)
        features, counts = preprocessing.transform_counted(table, rows, saved=True)
    return NewData(ids.to_objects(), rows, features, alignment, counts)


def _read(cfg: DataConfig, columns: list[str] | None, text: tuple[str, ...] = ()) -> Table:
    """The table of ``cfg``, the id column and ``text`` read as text."""
    ids = (cfg.id_column,) if cfg.id_column is not None else ()
    return open_table(cfg.source, columns, text=ids + text)


def _ids_and_rows(cfg: DataConfig, table: Table) -> tuple[IdText, np.ndarray, Any]:
    """The ids and data rows to use, in order, and the aligned file's spec fields (or None).
    An aligned file needs the id column its rows are checked against (`parse_data_config`
    refuses the pair; a `DataConfig` built in code is refused here, never read by position)."""
    if cfg.id_column is None and cfg.aligned is not None:
        raise DataError(
            f"data.aligned needs data.id_column, the column whose ids `tandem align` matched "
            f"in {cfg.source!r}; set data.id_column (tandem predict: --id-column)"
        )
    if cfg.id_column is None:
        rows = np.arange(table.num_rows, dtype=np.int64)
        return IdText.from_strings(rows.astype(str).tolist()), rows, None
    ids, missing = table.id_text(cfg.id_column)
    if missing is not None:
        raise DataError(
            f"{cfg.source!r}: id column {cfg.id_column!r} has no value at row {missing}; "
            "every row needs an id: fill it in or remove the row"
        )
    alignment = None
    rows = np.arange(table.num_rows, dtype=np.int64)
    if cfg.aligned is not None:
        rows, ids, alignment = _aligned(cfg, cfg.aligned, ids)
    return ids, rows, alignment


def _refuse_duplicate(cfg: DataConfig, rows: np.ndarray, value: str, a: int, b: int) -> NoReturn:
    raise DataError(
        f"{cfg.source!r}: id column {cfg.id_column!r} holds {value!r} twice (rows "
        f"{int(rows[a])} and {int(rows[b])}); ids must be unique: remove or renumber the "
        "duplicate"
    )


def _aligned(cfg: DataConfig, path: str, ids: IdText) -> tuple[np.ndarray, IdText, Any]:
    try:
        aligned = read_aligned(path)
    except AlignedFileError as exc:
        raise DataError(f"data.aligned: {exc}") from None
    rows = aligned.rows
    if len(rows) and rows.max() >= len(ids):
        raise DataError(
            f"data.aligned {path!r} refers to row {int(rows.max())} but {cfg.source!r} "
            f"has {len(ids)} rows; align the same file you train on (tandem align --ids)"
        )
    kept = ids.take(rows)
    k = kept.first_difference(IdText.from_strings(str(i) for i in aligned.ids))
    if k is not None:
        raise DataError(
            f"data.aligned {path!r} says row {int(rows[k])} of {cfg.source!r} has id "
            f"{aligned.ids[k]!r}, but column {cfg.id_column!r} holds {kept.item(k)!r} there; "
            "run tandem align again on this file"
        )
    return rows, kept, aligned.spec_fields()


@contextlib.contextmanager
def _in(cfg: DataConfig) -> Iterator[None]:
    """Prefix the TOML file to the data errors raised inside, so they name both files."""
    try:
        yield
    except DataError as exc:
        if cfg.path is None or str(exc).startswith(cfg.path):
            raise
        raise DataError(f"{cfg.path}: {exc}") from None


__all__ = ["NewData", "PartyDataset", "load_new_data", "load_party_data"]
