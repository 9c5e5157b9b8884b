"""Federated preprocessing: each party summarises its training rows, one place merges them.

`summarize(table, cfg, train_rows)` (or `summarize_source(cfg)`, which reads ``cfg``'s table
and its split first) returns a JSON-able *summary* of a party's training rows: per numeric
feature the count of present values, the count of missing cells, the sum and the sum of
squares of the present values (and ``peak``, their largest magnitude: it stays with the
party, which checks it against the bound of a secure sum, `tandem.parties.fl.secure_summary`);
per categorical feature the count of every value, except for a hashed column
(``[data] hash_buckets``), whose summary lists no value at all. No row leaves
the party, only these sums.

`merge(summaries, ...)` turns the summaries of every party into one `Preprocessing`, exactly
the state `tandem.parties.data.preprocess.fit` would fit on the union of their training rows
(up to floating-point reassociation), with one difference for categorical columns: a value
enters the vocabulary only when its count summed over the parties is at least ``min_count``
(a rare value, which could single out one party's row, then gets code 0 like an unseen one).
A hashed column's state is its buckets and seed from ``cfg``, whatever the summaries hold.

The rules for missing cells and scaling are ``cfg``'s (the merging party's ``[data]``):
``"mean"`` fills in the mean of the present values over all parties; ``"zero"`` fills in 0,
which counts toward the mean and variance of standard scaling, as in `fit`.

Invariant: a summary's ``numeric`` and ``categorical`` lists follow the feature order of
`feature_columns`; `merge` refuses (`DataError`, naming the party and the column) summaries
whose columns or categorical kinds differ from the merging party's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import columns as col
from .columns import Vocabulary
from .config import DataConfig
from .declared import read_declared
from .errors import DataError
from .preprocess import Preprocessing, feature_columns, preprocessing_state
from .table import Column, Table

FORMAT = 1
#: Values a summary may list for one categorical column (a bound on a hello's size).
MAX_VALUES = 100_000


def summarize(table: Table, cfg: DataConfig, train_rows: np.ndarray) -> dict[str, Any]:
    """The summary (module docstring) of the data rows ``train_rows`` of ``table``.

    Refuses what `fit` refuses: a missing cell under ``data.missing = "error"``, a
    non-finite value, text in a numeric column."""
    if len(train_rows) == 0:
        raise DataError(
            f"no training rows in {table.source!r}; lower data.split.test and data.split.validation"
        )
    numeric, categorical = feature_columns(table, cfg)
    return {
        "format": FORMAT,
        "rows": len(train_rows),
        "numeric": [_numeric(table.source, table[n], train_rows, cfg.missing) for n in numeric],
        "categorical": [
            _categorical(table.source, table[n], train_rows, cfg.missing, cfg.hashed(n) > 0)
            for n in categorical
        ],
    }


def summarize_source(cfg: DataConfig) -> dict[str, Any]:
    """`summarize` of the training rows of ``cfg``'s table, its split as `load_party_data`
    draws it (labels are not read)."""
    from .load import _ids_and_rows, _in, _read
    from .split import assign_split

    with _in(cfg):
        table = _read(cfg, _needed(cfg))
        ids, rows, _ = _ids_and_rows(cfg, table)
        split = assign_split(ids, cfg.split)
        return summarize(table, cfg, rows[split.train])


def _needed(cfg: DataConfig) -> list[str] | None:
    if cfg.features is None:
        return None
    named = [c for c in (cfg.id_column, cfg.label_column) if c is not None]
    return list(dict.fromkeys([*named, *cfg.features]))


def _numeric(source: str, column: Column, rows: np.ndarray, rule: str) -> dict[str, Any]:
    col.require_numeric(source, column)
    values = np.asarray(column.values[rows], np.float64)
    missing = None if column.missing is None else column.missing[rows]
    if missing is not None and missing.any():
        if rule == "error":
            col.refuse_missing(source, column.name, int(rows[np.argmax(missing)]))
        values = values[~missing]
    finite = np.isfinite(values)
    if not finite.all():
        present = rows if missing is None else rows[~missing]
        row = int(present[np.argmin(finite)])
        col.refuse_non_finite(source, column.name, row, column.values[row])
    return {
        "name": column.name,
        "present": int(values.size),
        "missing": 0 if missing is None else int(np.count_nonzero(missing)),
        "sum": float(values.sum()),
        "sumsq": float(np.dot(values, values)),
        "peak": float(np.abs(values).max()) if values.size else 0.0,
    }


def _categorical(
    source: str, column: Column, rows: np.ndarray, rule: str, hashed: bool
) -> dict[str, Any]:
    column = col.categorical_column(source, column)
    keep = rows
    if column.missing is not None:
        missing = column.missing[rows]
        if rule == "error" and missing.any():
            col.refuse_missing(source, column.name, int(rows[np.argmax(missing)]))
        keep = rows[~missing]
    kind = "int" if column.kind == "int" else "string"
    text = column.arrow_text
    values: list[Any]
    counts: list[int]
    if hashed:  # coded by a seeded hash: no value needs to leave the party
        values, counts = [], []
    elif text is not None:
        import pyarrow as pa
        import pyarrow.compute as pc

        counted = pc.value_counts(text.take(pa.array(keep, pa.int64())))
        values = counted.field("values").to_pylist()
        counts = counted.field("counts").to_pylist()
    else:
        uniq, n = np.unique(column.values[keep], return_counts=True)
        values = [int(v) if kind == "int" else str(v) for v in uniq]
        counts = [int(c) for c in n]
    if len(values) > MAX_VALUES:
        raise DataError(
            f"{source!r}: categorical column {column.name!r} has {len(values)} distinct values "
            f"in the training rows, more than a federated summary carries ({MAX_VALUES}); "
            "leave it out of data.categorical (or group its values)"
        )
    return {"name": column.name, "kind": kind, "values": values, "counts": counts}


def merge(
    summaries: Mapping[str, Mapping[str, Any]],
    cfg: DataConfig,
    table: Table,
    *,
    min_count: int = 1,
) -> Preprocessing:
    """One `Preprocessing` from the summaries of the parties named in ``summaries`` (see the
    module docstring). ``table`` (the merging party's own) fixes the feature columns under
    ``cfg``; its rows are not used. Refuses a malformed summary, naming its party."""
    if not summaries:
        raise DataError("federated preprocessing needs at least one party's summary")
    numeric, categorical = feature_columns(table, cfg)
    declared = {}
    if cfg.vocabularies is not None:
        declared = read_declared(cfg.vocabularies, categorical, cfg.where)
    nums: dict[str, list[Any]] = {n: [0, 0, 0.0, 0.0] for n in numeric}  # present, missing,
    # sum, sum of squares
    cats: dict[str, dict[Any, int]] = {c: {} for c in categorical}
    kinds: dict[str, str] = {}
    for party, summary in sorted(summaries.items()):
        _add(party, summary, nums, cats, kinds)
    stats = [_numeric_state(n, nums[n], cfg) for n in numeric]
    vocabularies = []
    for name in categorical:
        if cfg.hashed(name):
            kind = kinds.get(name, "string")
            vocabularies.append(Vocabulary(kind, (), cfg.hashed(name), cfg.hash_seed))
            continue
        if name in declared:
            vocabularies.append(Vocabulary(*declared[name]))
            continue
        kept = [v for v, c in cats[name].items() if c >= min_count]
        if not kept:
            raise DataError(
                f"categorical column {name!r}: no value occurs at least min_count = "
                f"{min_count} times over the parties' training rows; lower "
                "preprocessing.min_count"
            )
        vocabularies.append(Vocabulary(kinds[name], tuple(sorted(kept))))
    return preprocessing_state(cfg, numeric, categorical, stats, vocabularies)


def _add(
    party: str,
    summary: Mapping[str, Any],
    nums: dict[str, list[Any]],
    cats: dict[str, dict[Any, int]],
    kinds: dict[str, str],
) -> None:
    """Add one party's summary into the running totals; `DataError` names what is wrong."""
    try:
        if summary.get("format") != FORMAT:
            raise ValueError(f"format {summary.get('format')!r}, expected {FORMAT}")
        got_n = [str(c["name"]) for c in summary["numeric"]]
        got_c = [str(c["name"]) for c in summary["categorical"]]
        if got_n != list(nums) or got_c != list(cats):
            raise DataError(
                f"party {party!r} summarised the numeric columns {got_n} and categorical "
                f"columns {got_c}, but the features are {list(nums)} and {list(cats)}; give "
                "every party the same [data] features and categorical keys"
            )
        for c in summary["numeric"]:
            present, missing = int(c["present"]), int(c["missing"])
            total, sq = float(c["sum"]), float(c["sumsq"])
            if present < 0 or missing < 0 or not (math.isfinite(total) and math.isfinite(sq)):
                raise ValueError(f"column {c['name']!r} has negative counts or non-finite sums")
            t = nums[str(c["name"])]
            t[0], t[1], t[2], t[3] = t[0] + present, t[1] + missing, t[2] + total, t[3] + sq
        for c in summary["categorical"]:
            kind, name = str(c["kind"]), str(c["name"])
            if kind not in ("int", "string") or kinds.setdefault(name, kind) != kind:
                raise DataError(
                    f"party {party!r} holds {kind} values in categorical column {name!r}, "
                    f"another party {kinds[name]} values; store the column the same way "
                    "everywhere"
                )
            convert = int if kind == "int" else str
            counts = cats[name]
            for v, n in zip(c["values"], c["counts"], strict=True):
                if int(n) < 0:
                    raise ValueError(f"column {name!r} has a negative count")
                counts[convert(v)] = counts.get(convert(v), 0) + int(n)
    except DataError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataError(
            f"the preprocessing summary of party {party!r} is malformed "
            f"({type(exc).__name__}: {exc}); run the same Tandem version on every party"
        ) from None


def _numeric_state(name: str, sums: list[Any], cfg: DataConfig) -> tuple[float, float, float]:
    """``(fill, mean, std)`` of a numeric column from its summed summary ``[present, missing,
    sum, sum of squares]``, as `fit` gives."""
    present, missing, total, sq = int(sums[0]), int(sums[1]), float(sums[2]), float(sums[3])
    if present == 0 and (cfg.missing == "mean" or missing == 0):
        raise DataError(
            f"numeric column {name!r} has no value in any party's training rows, so it has no "
            "mean; fill it in, or leave it out of data.features"
        )
    fill = total / present if cfg.missing == "mean" else 0.0
    n = present + missing
    mean, std = 0.0, 1.0
    if cfg.scale == "standard":
        total_f, sq_f = total + missing * fill, sq + missing * fill * fill
        mean = total_f / n
        var = sq_f / n - mean * mean
        # below this share of the second moment, the variance is the sums' rounding error:
        # the column is constant, and `fit` divides a constant column by 1
        constant = var <= 1e-12 * (sq_f / n)
        std = 1.0 if constant or not math.isfinite(var) else math.sqrt(var)
    return fill, mean, std


__all__ = ["FORMAT", "MAX_VALUES", "merge", "summarize", "summarize_source"]
