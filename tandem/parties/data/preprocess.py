"""Preprocessing: which columns are features, and how their values become model inputs.

`fit(table, cfg, train_rows)` looks at the party's own training rows only and returns a
`Preprocessing`, a frozen plain-data state; `Preprocessing.transform(table, rows)` turns any
rows of a table with the same columns (training, test, or new data at prediction) into
`Features`. Fitting never transforms anything itself: the training features are
``state.transform(table, rows)`` like every other, so prediction applies exactly what training
did. ``to_json()``/``from_json()`` carry the state in an export as JSON (never pickle).
`fit_transform` is the two in one pass over the columns, a column at a time, with the same
state, features and first error (the loader's path, for tables larger than memory).

The rules (docs/data.md states them for users):

* Features are ``cfg.features`` or, by default, every column but the id and the label, in the
  order listed (file order by default). Numeric ones come out as float32 columns of
  `Features.numeric`, categorical ones as int32 columns of `Features.categorical`, each in
  that order.
* Categorical: the vocabulary is the sorted set of values in the training rows, or the
  column's list in ``cfg.vocabularies`` sorted (`tandem.parties.data.declared`: the list's
  kind must be the column's, and at least one training value must be in it); value
  ``vocabulary[i]`` has code ``i + 1``; code 0 is reserved for a value not in the vocabulary
  and for a missing cell. Integer and string columns are accepted (and float columns whose
  values are all whole numbers).
  A column of ``cfg.hash_buckets`` has no vocabulary: a value's code is ``1 + `` its seeded
  hash mod the bucket count (`tandem.parties.data.hashed`), nothing is fitted, no value is
  unseen, and 0 is a missing cell.
* Missing numeric cells: ``"error"`` refuses, naming file, row and column; ``"mean"`` fills in
  the mean of the column's training values; ``"zero"`` fills in 0 (before scaling). Missing
  categorical cells are refused under ``"error"`` and get code 0 otherwise.
* Scaling: ``"standard"`` subtracts the mean and divides by the standard deviation of the
  (filled-in) training values; a column constant on the training rows is divided by 1.
  ``"none"`` keeps the values. Features must be finite, and within float32's range once
  scaled.

Invariant: ``len(fill) == len(mean) == len(std) == len(numeric)`` and
``len(vocabularies) == len(categorical)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import columns as col
from .columns import Vocabulary
from .config import MISSING, SCALE, DataConfig
from .declared import Declared, read_declared
from .errors import DataError
from .mapped import ColumnSpill
from .table import Column, Table

FORMAT = 1


@dataclasses.dataclass(frozen=True)
class Features:
    """Model inputs of some rows: ``numeric`` float32 (rows, len(numeric)) and ``categorical``
    int32 codes (rows, len(categorical)); both C-contiguous. When ``packed`` is set (see
    `allocate_features`), the two are instead column views of that one float32 matrix
    ``[numeric | codes]`` and ``categorical`` holds the codes as whole float32 numbers (exact:
    codes stay below 2**24). ``spill`` is set when that matrix lives in a file
    (`tandem.parties.data.mapped.ColumnSpill`, column-major): readers call
    ``spill.release()`` after each column or chunk of rows they read or write, so the
    process holds at most that much of it."""

    numeric: np.ndarray
    categorical: np.ndarray
    packed: np.ndarray | None = None
    spill: ColumnSpill | None = None

    def release(self) -> None:
        """Drop the pages of a spilled matrix read or written so far (no-op in memory)."""
        if self.spill is not None:
            self.spill.release()


@dataclasses.dataclass(frozen=True)
class Preprocessing:
    """The fitted state (see the module docstring). ``all_columns`` is True when the features
    were not listed, so a table with more columns than were fitted is refused."""

    numeric: tuple[str, ...]
    categorical: tuple[str, ...]
    missing: str
    scale: str
    fill: tuple[float, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    vocabularies: tuple[Vocabulary, ...]
    id_column: str | None = None
    label_column: str | None = None
    all_columns: bool = False

    @property
    def columns(self) -> tuple[str, ...]:
        """Every feature column a table must have, numeric ones first."""
        return self.numeric + self.categorical

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict of the whole state; `from_json` restores it exactly (floats
        round-trip through JSON unchanged)."""
        return {
            "format": FORMAT,
            "id_column": self.id_column,
            "label_column": self.label_column,
            "all_columns": self.all_columns,
            "missing": self.missing,
            "scale": self.scale,
            "numeric": [
                {"name": n, "fill": f, "mean": m, "std": s}
                for n, f, m, s in zip(self.numeric, self.fill, self.mean, self.std, strict=True)
            ],
            "categorical": [
                {"name": n, "kind": v.kind, "vocabulary": list(v.values)}
                | ({"buckets": v.buckets, "seed": v.seed} if v.buckets else {})
                for n, v in zip(self.categorical, self.vocabularies, strict=True)
            ],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Preprocessing:
        """The state `to_json` wrote; a malformed one raises `DataError` saying what is wrong."""
        try:
            if data["format"] != FORMAT:
                raise DataError(
                    f"preprocessing state has format {data['format']!r}; this Tandem reads "
                    f"format {FORMAT} (export it again with this version)"
                )
            if data["missing"] not in MISSING or data["scale"] not in SCALE:
                raise ValueError("missing or scale has an unknown value")
            numeric = list(data["numeric"])
            categorical = list(data["categorical"])
            vocabularies = []
            for c in categorical:
                if c["kind"] not in ("int", "string"):
                    raise ValueError(f"vocabulary kind {c['kind']!r}")
                convert = int if c["kind"] == "int" else str
                values = tuple(convert(v) for v in c["vocabulary"])
                if list(values) != sorted(set(values)):
                    raise ValueError(f"vocabulary of {c['name']!r} is not sorted and unique")
                buckets, seed = int(c.get("buckets", 0)), int(c.get("seed", 0))
                if buckets and (values or not 0 < buckets < 2**24 or not 0 <= seed < 2**64):
                    raise ValueError(f"hashed column {c['name']!r} has values or bad buckets")
                vocabularies.append(Vocabulary(c["kind"], values, buckets, seed))
            return cls(
                numeric=tuple(str(c["name"]) for c in numeric),
                categorical=tuple(str(c["name"]) for c in categorical),
                missing=str(data["missing"]),
                scale=str(data["scale"]),
                fill=tuple(float(c["fill"]) for c in numeric),
                mean=tuple(float(c["mean"]) for c in numeric),
                std=tuple(float(c["std"]) for c in numeric),
                vocabularies=tuple(vocabularies),
                id_column=data["id_column"],
                label_column=data["label_column"],
                all_columns=bool(data["all_columns"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, DataError):
                raise
            raise DataError(
                f"preprocessing state is malformed ({type(exc).__name__}: {exc}); it must be "
                "what Preprocessing.to_json wrote (train the model again to write a new export)"
            ) from None

    def transform(self, table: Table, rows: np.ndarray | None = None) -> Features:
        """The features of ``rows`` (data rows of ``table``, default all, in that order).

        Refuses (`DataError` naming the file, the column, the row and the fix) a table that
        lacks a fitted column, has extra columns when the features were not listed, holds
        text in a numeric column, or has a missing or non-finite value it may not fill."""
        return self.transform_counted(table, rows)[0]

    def transform_counted(
        self, table: Table, rows: np.ndarray | None = None, *, saved: bool = False
    ) -> tuple[Features, dict[str, dict[str, int]]]:
        """`transform`, and what it could not map as training did, per feature column where
        it happened: ``{"missing": cells filled in (the fill value, or code 0),
        "unseen": categorical values outside the vocabulary (code 0)}``.

        ``saved``: this state came from an export (new rows at prediction), so an error's
        fix names a change of the data, never of a ``[data]`` key the export fixed."""
        self._check_columns(table, saved)
        n = table.num_rows if rows is None else len(rows)
        features = allocate_features(n, len(self.numeric), len(self.categorical))
        counts: dict[str, dict[str, int]] = {}
        for j, name in enumerate(self.numeric):
            fitted = (self.fill[j], self.mean[j], self.std[j])
            out = features.numeric[:, j]
            filled = _transform_numeric(
                table.source, table[name], rows, fitted, self.missing, out, saved
            )
            if filled:
                counts[name] = {"missing": filled, "unseen": 0}
        for j, (name, vocabulary) in enumerate(
            zip(self.categorical, self.vocabularies, strict=True)
        ):
            out = features.categorical[:, j]
            filled, unseen = _transform_categorical(
                table.source, table[name], rows, vocabulary, self.missing, out, saved
            )
            if filled or unseen:
                counts[name] = {"missing": filled, "unseen": unseen}
        return features, counts

    def _check_columns(self, table: Table, saved: bool = False) -> None:
        absent = [c for c in self.columns if c not in table.available]
        if absent:
            raise DataError(
                f"{table.source!r} lacks the feature column(s) {absent} the model was trained "
                f"with; its columns are {list(table.available)} (give it the same columns as "
                "the training data)"
            )
        if self.all_columns:
            known = set(self.columns) | {self.id_column, self.label_column}
            extra = [c for c in table.available if c not in known]
            if extra:
                fix = "" if saved else ", or list the features in data.features"
                raise DataError(
                    f"{table.source!r} has column(s) {extra} the model was not trained with "
                    f"(trained on {list(self.columns)}); remove them from the file{fix}"
                )


def feature_columns(table: Table, cfg: DataConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(numeric, categorical)`` feature names of ``table`` under ``cfg`` (see the module
    docstring); refuses an unknown column (listing the available ones) and a text column that
    is not declared categorical (naming it and the fix)."""
    named = [c for c in (cfg.id_column, cfg.label_column) if c is not None]
    listed = list(cfg.features or ()) + list(cfg.categorical) + named
    unknown = [c for c in dict.fromkeys(listed) if c not in table.available]
    if unknown:
        raise DataError(
            f"{table.source!r} has no column(s) {unknown}; its columns are "
            f"{list(table.available)} (check data.id_column, data.label_column, data.features "
            "and data.categorical)"
        )
    if cfg.features is not None:
        features = list(cfg.features)
    else:
        features = [c for c in table.available if c not in named]
    categorical = tuple(c for c in features if c in cfg.categorical)
    numeric = tuple(c for c in features if c not in cfg.categorical)
    for name in numeric:
        if table.kind(name) == "string":
            col.require_numeric(table.source, table[name])
    return numeric, categorical


def fit(table: Table, cfg: DataConfig, train_rows: np.ndarray) -> Preprocessing:
    """Fit the preprocessing of ``cfg`` on the data rows ``train_rows`` of ``table`` only."""
    _require_training_rows(table, train_rows)
    numeric, categorical = feature_columns(table, cfg)
    stats = [_fit_numeric(table.source, table[name], train_rows, cfg) for name in numeric]
    declared = _declared(cfg, categorical)
    vocabularies = [
        _fit_categorical(table.source, table[name], train_rows, cfg, declared.get(name))
        for name in categorical
    ]
    return preprocessing_state(cfg, numeric, categorical, stats, vocabularies)


def fit_transform(
    table: Table,
    cfg: DataConfig,
    train_rows: np.ndarray,
    rows: np.ndarray,
    *,
    packed: bool = False,
    spill_dir: str | None = None,
) -> tuple[Preprocessing, Features]:
    """``(state, state.transform(table, rows))`` with ``state = fit(table, cfg, train_rows)``:
    the same state, features and first error, but each column of ``table`` is taken once
    (fitted, then transformed straight into the preallocated features) and dropped before
    the next, so a table that reads its columns on demand holds one column at a time.
    ``packed`` and ``spill_dir`` allocate the features as `allocate_features` says."""
    _require_training_rows(table, train_rows)
    numeric, categorical = feature_columns(table, cfg)
    declared = _declared(cfg, categorical)
    features = allocate_features(
        len(rows), len(numeric), len(categorical), packed=packed, spill_dir=spill_dir
    )
    # A transform error waits until every column is fitted: fit errors come first, as when
    # fit and transform run one after the other.
    deferred: DataError | None = None
    stats = []
    for j, name in enumerate(numeric):
        column = table[name]
        stats.append(_fit_numeric(table.source, column, train_rows, cfg))
        if deferred is None:
            try:
                out = features.numeric[:, j]
                _transform_numeric(table.source, column, rows, stats[-1], cfg.missing, out)
            except DataError as exc:
                deferred = exc
        del column
        features.release()
    vocabularies = []
    for j, name in enumerate(categorical):
        column = table[name]
        vocabularies.append(
            _fit_categorical(table.source, column, train_rows, cfg, declared.get(name))
        )
        if deferred is None:
            try:
                out = features.categorical[:, j]
                _transform_categorical(
                    table.source, column, rows, vocabularies[-1], cfg.missing, out
                )
            except DataError as exc:
                deferred = exc
        del column
        features.release()
    state = preprocessing_state(cfg, numeric, categorical, stats, vocabularies)
    if deferred is not None:
        state._check_columns(table)
        raise deferred
    return state, features


def allocate_features(
    n: int, numeric: int, categorical: int, *, packed: bool = False, spill_dir: str | None = None
) -> Features:
    """Uninitialised `Features` for ``n`` rows. ``packed``: both are column views of one
    float32 matrix ``[numeric | codes]`` (`Features.packed`), the codes as whole floats.
    ``spill_dir`` (with ``packed``): that matrix is a `ColumnSpill` file in that folder."""
    if not packed:
        if spill_dir is not None:
            raise ValueError("allocate_features: spill_dir needs packed=True")
        return Features(np.empty((n, numeric), np.float32), np.empty((n, categorical), np.int32))
    if spill_dir is not None:
        spill = ColumnSpill(spill_dir, n, numeric + categorical)
        m = spill.matrix
        return Features(m[:, :numeric], m[:, numeric:], m, spill)
    matrix = np.empty((n, numeric + categorical), np.float32)
    return Features(matrix[:, :numeric], matrix[:, numeric:], matrix)


def _require_training_rows(table: Table, train_rows: np.ndarray) -> None:
    if len(train_rows) == 0:
        raise DataError(
            f"no training rows in {table.source!r}; lower data.split.test and "
            "data.split.validation, or check data.aligned"
        )


def preprocessing_state(
    cfg: DataConfig,
    numeric: tuple[str, ...],
    categorical: tuple[str, ...],
    stats: list[tuple[float, float, float]],
    vocabularies: list[Vocabulary],
) -> Preprocessing:
    """The fitted `Preprocessing` of ``cfg``'s columns: ``stats`` holds each numeric column's
    (fill, mean, std), ``vocabularies`` each categorical column's codes (a party's own fit,
    or the merge of every party's summary, `tandem.parties.data.summary`)."""
    return Preprocessing(
        numeric=numeric,
        categorical=categorical,
        missing=cfg.missing,
        scale=cfg.scale,
        fill=tuple(s[0] for s in stats),
        mean=tuple(s[1] for s in stats),
        std=tuple(s[2] for s in stats),
        vocabularies=tuple(vocabularies),
        id_column=cfg.id_column,
        label_column=cfg.label_column,
        all_columns=cfg.features is None,
    )


def _fit_numeric(
    source: str, column: Column, train_rows: np.ndarray, cfg: DataConfig
) -> tuple[float, float, float]:
    """``(fill, mean, std)`` of a numeric column on the training rows."""
    name = column.name
    values = np.asarray(column.values[train_rows], np.float64)  # a fresh copy: filled below
    missing = None if column.missing is None else column.missing[train_rows]
    if cfg.missing == "error" and missing is not None and missing.any():
        col.refuse_missing(source, name, int(train_rows[np.argmax(missing)]))
    finite = np.isfinite(values) | (False if missing is None else missing)
    if not finite.all():
        row = int(train_rows[np.argmin(finite)])
        col.refuse_non_finite(source, name, row, column.values[row])
    fill = 0.0
    if cfg.missing == "mean":
        # Fitted whatever the training rows hold: other rows may miss values they do not.
        present = values if missing is None else values[~missing]
        if not present.size:
            raise DataError(
                f"{source!r}: column {name!r} has no value in any training row, "
                "so it has no mean; fill it in, or leave it out of data.features"
            )
        fill = float(present.mean())
    if missing is not None:
        values[missing] = fill
    mean, std = 0.0, 1.0
    if cfg.scale == "standard":
        mean = float(values.mean())
        spread = float(values.std())
        std = spread if spread > 0 and np.isfinite(spread) else 1.0
    return fill, mean, std


def _declared(cfg: DataConfig, categorical: tuple[str, ...]) -> dict[str, Declared]:
    """The declared vocabularies of ``cfg.vocabularies`` (none when unset)."""
    if cfg.vocabularies is None:
        return {}
    return read_declared(cfg.vocabularies, categorical, cfg.where)


def _fit_categorical(
    source: str,
    column: Column,
    train_rows: np.ndarray,
    cfg: DataConfig,
    declared: Declared | None = None,
) -> Vocabulary:
    """The vocabulary of a categorical column: its training values, or ``declared`` once
    checked against them (same kind, at least one training value in it), or its hashed
    buckets (``cfg.hash_buckets``: nothing fitted)."""
    column = col.categorical_column(source, column)
    keep = train_rows
    if column.missing is not None:
        missing = column.missing[train_rows]
        if cfg.missing == "error" and missing.any():
            col.refuse_missing(source, column.name, int(train_rows[np.argmax(missing)]))
        keep = train_rows[~missing]
    if cfg.hashed(column.name):
        if declared is not None:
            raise DataError(
                f"{cfg.where}: categorical column {column.name!r} is in data.hash_buckets and "
                "has a list in data.vocabularies; give it one of the two"
            )
        kind = "int" if column.kind == "int" else "string"
        return Vocabulary(kind, (), cfg.hashed(column.name), cfg.hash_seed)
    text = column.arrow_text
    if text is not None:
        fitted = col.arrow_vocabulary(text, keep)
    elif column.kind == "int":  # the union of each chunk's values: the same sorted set
        parts = [
            np.unique(column.values[keep[i : i + col.ROWS]]) for i in range(0, len(keep), col.ROWS)
        ]
        fitted = col.vocabulary("int", np.concatenate(parts) if parts else np.empty(0, np.int64))
    else:
        fitted = col.vocabulary(column.kind, column.values[keep])
    if declared is None:
        return fitted
    return _check_declared(source, column.name, fitted, Vocabulary(*declared))


def _check_declared(source: str, name: str, fitted: Vocabulary, declared: Vocabulary) -> Vocabulary:
    """``declared`` when it suits the column whose training values are ``fitted``: a list of
    numbers for a number column, of text for a text one (a number column's value 7 and the
    text "07" would never match, and every row would silently get code 0), holding at least
    one of the training values (none means the list is another column's)."""
    if fitted.values and declared.kind != fitted.kind:
        holds, lists = ("numbers", "text") if fitted.kind == "int" else ("text", "numbers")
        raise DataError(
            f"{source!r}: categorical column {name!r} holds {holds} but data.vocabularies "
            f"lists {lists} for it; write its values as JSON {holds} (e.g. "
            f"{fitted.values[0]!r}), exactly as the column holds them"
        )
    if fitted.values:
        known = set(declared.values)
        if not any(v in known for v in fitted.values):
            raise DataError(
                f"{source!r}: none of the {len(fitted.values)} values of categorical column "
                f"{name!r} in the training rows (e.g. {fitted.values[0]!r}) is in its list in "
                "data.vocabularies; check that the list is this column's"
            )
    return declared


def _transform_numeric(
    source: str,
    column: Column,
    rows: np.ndarray | None,
    fitted: tuple[float, float, float],
    missing_rule: str,
    out: np.ndarray,
    saved: bool = False,
) -> int:
    """Write the features of ``rows`` of a numeric column into ``out``, a chunk of rows at a
    time; returns the cells filled in. The errors are those of the whole column (a missing
    cell before a non-finite one); ``saved`` as in `Preprocessing.transform_counted`."""
    fill, mean, std = fitted
    col.require_numeric(source, column, saved)
    missing = column.missing
    filled = 0
    if missing is not None:
        selected = missing if rows is None else missing[rows]
        filled = int(np.count_nonzero(selected))
        if missing_rule == "error" and filled:
            col.refuse_missing(source, column.name, col.row(rows, selected), saved)
    for chunk in col.chunks(len(out)):
        take = chunk if rows is None else rows[chunk]
        values = column.values[take].astype(np.float64)
        if missing is not None:
            values[missing[take]] = fill
        finite = np.isfinite(values)
        if not finite.all():
            bad = chunk.start + int(np.argmin(finite))
            bad = bad if rows is None else int(rows[bad])
            col.refuse_non_finite(source, column.name, bad, column.values[bad], missing_rule, saved)
        values -= mean
        values /= std
        too_large = np.abs(values) > np.finfo(np.float32).max  # float32 would make it inf
        if too_large.any():
            bad = chunk.start + int(np.argmax(too_large))
            bad = bad if rows is None else int(rows[bad])
            col.refuse_beyond_float32(source, column.name, bad, column.values[bad], saved)
        out[chunk] = values
    return filled


def _transform_categorical(
    source: str,
    column: Column,
    rows: np.ndarray | None,
    vocabulary: Vocabulary,
    missing_rule: str,
    out: np.ndarray,
    saved: bool = False,
) -> tuple[int, int]:
    """Write the codes of ``rows`` of a categorical column into ``out``, a chunk of rows at a
    time; returns ``(missing cells, values outside the vocabulary)``, both coded 0. The
    errors are those of the whole column."""
    column = col.categorical_column(source, column, saved)
    if vocabulary.kind == "int" and column.kind == "string":
        column = col.whole_numbers_as_text(column)  # "007" is the category 7, as in training
    missing = column.missing
    filled = 0
    if missing is not None:
        selected = missing if rows is None else missing[rows]
        filled = int(np.count_nonzero(selected))
        if missing_rule == "error" and filled:
            col.refuse_missing(source, column.name, col.row(rows, selected), saved)
    text = column.arrow_text
    known = None if text is None or vocabulary.buckets else col.arrow_vocabulary_text(vocabulary)
    # pyarrow builds its lookup table on each call: text takes bigger chunks
    for chunk in col.chunks(len(out), col.ROWS if text is None else col.TEXT_ROWS):
        take = chunk if rows is None else rows[chunk]
        if vocabulary.buckets:
            codes = _hash_codes(vocabulary, column, text, take)
        elif text is not None:
            codes = col.arrow_encode(known, col.arrow_take(text, take))
        else:
            codes = col.encode(vocabulary, column.kind, column.values[take])
        if missing is not None:
            codes[missing[take]] = 0
        out[chunk] = codes
    zeros = int(np.count_nonzero(out == 0))
    return filled, zeros - filled


def _hash_codes(
    vocabulary: Vocabulary, column: Column, text: Any, take: slice | np.ndarray
) -> np.ndarray:
    from .hashed import arrow_hash_codes, hash_codes

    b, seed = vocabulary.buckets, vocabulary.seed
    if text is not None:
        return arrow_hash_codes(col.arrow_take(text, take), b, seed)
    return hash_codes(column.values[take], column.kind, b, seed)


__all__ = [
    "Features",
    "Preprocessing",
    "Vocabulary",
    "allocate_features",
    "feature_columns",
    "fit",
    "fit_transform",
]
