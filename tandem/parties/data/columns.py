"""The column kernels of preprocessing (`tandem.parties.data.preprocess`): a categorical
column's `Vocabulary` and its int32 codes (numpy, or pyarrow for text columns), transforming in
bounded chunks of rows, and the refusals that name the file, column, row and fix.

Codes: ``vocabulary.values[i]`` has code ``i + 1``; 0 is a value not in the vocabulary or a
missing cell. Text and integers compare as text across kinds, so new data of either kind finds
the codes of a vocabulary fitted on the other.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, NoReturn

import numpy as np

from .errors import DataError
from .table import Column


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The sorted training values of a categorical column (``kind`` "int" or "string");
    ``values[i]`` has code ``i + 1``, 0 is unseen or missing. A *hashed* column
    (``buckets > 0``, `tandem.parties.data.hashed`) has no values: a value's code is its
    seeded hash's bucket plus 1, and 0 is missing.

    Invariant: ``buckets == 0 or values == ()``."""

    kind: str
    values: tuple[int | str, ...]
    buckets: int = 0
    seed: int = 0

    @property
    def size(self) -> int:
        """The number of codes, the reserved 0 included (an embedding table's row count)."""
        return self.buckets + 1 if self.buckets else len(self.values) + 1


ROWS = 1 << 16  # rows transformed at a time: bounds each column's temporaries to a few MB
TEXT_ROWS = 1 << 18  # the same for text, looked up by pyarrow


def chunks(n: int, size: int = 0) -> Iterator[slice]:
    size = size or ROWS
    for start in range(0, n, size):
        yield slice(start, min(start + size, n))


def arrow_vocabulary(text: Any, rows: np.ndarray) -> Vocabulary:
    """The vocabulary of the cells ``rows`` of a pyarrow text column: sorted by code point
    (pyarrow sorts UTF-8 by bytes, the same order), as `vocabulary` sorts str."""
    import pyarrow as pa
    import pyarrow.compute as pc

    parts = []
    for start in range(0, len(rows), ROWS):
        part = pc.unique(text.take(pa.array(rows[start : start + ROWS], pa.int64())))
        parts.append(part.combine_chunks() if isinstance(part, pa.ChunkedArray) else part)
    unique = pc.unique(pa.concat_arrays(parts)) if parts else pa.array([], pa.string())
    return Vocabulary("string", tuple(unique.take(pc.sort_indices(unique)).to_pylist()))


def arrow_vocabulary_text(vocabulary: Vocabulary) -> Any:
    """The vocabulary's values as pyarrow text (values compared as text, as `encode` does)."""
    import pyarrow as pa

    return pa.array([str(v) for v in vocabulary.values], pa.string())


def arrow_take(text: Any, take: slice | np.ndarray) -> Any:
    import pyarrow as pa

    if isinstance(take, slice):
        return text.slice(take.start, take.stop - take.start)
    return text.take(pa.array(take, pa.int64()))


def arrow_encode(known: Any, text: Any) -> np.ndarray:
    """int32 codes of pyarrow text cells against ``known`` (`arrow_vocabulary_text`): ``i + 1``
    for ``known[i]``, 0 for anything else, as `encode` gives them."""
    import pyarrow.compute as pc

    at = pc.fill_null(pc.index_in(text, value_set=known), -1)
    return np.add(at.to_numpy(), 1, dtype=np.int32)


def vocabulary(kind: str, values: np.ndarray) -> Vocabulary:
    if kind == "int":
        return Vocabulary("int", tuple(int(v) for v in np.unique(values)))
    return Vocabulary("string", tuple(sorted(set(values))))


def encode(vocabulary: Vocabulary, kind: str, values: np.ndarray) -> np.ndarray:
    """int32 codes of ``values`` (a column of ``kind``): ``i + 1`` for ``vocabulary.values[i]``,
    0 for anything else."""
    if vocabulary.kind == "int" and kind == "int":
        known = np.asarray(vocabulary.values, np.int64)
        if not known.size:
            return np.zeros(len(values), np.int32)
        at = np.searchsorted(known, values)
        hit = known[np.minimum(at, known.size - 1)] == values
        return np.where(hit, at + 1, 0).astype(np.int32)
    # Text on either side: compare as text, so an integer column of new data still finds
    # the codes of a vocabulary fitted on text, and the other way round.
    lookup = {str(v): i + 1 for i, v in enumerate(vocabulary.values)}
    text = values if kind == "string" else values.astype(str)
    return np.fromiter(
        map(lookup.get, text, itertools.repeat(0)), dtype=np.int32, count=len(values)
    )


def categorical_column(source: str, column: Column, saved: bool = False) -> Column:
    """``column`` as an int or string column; a float column only when its values are whole."""
    if column.kind != "float":
        return column
    present = column.values if column.missing is None else column.values[~column.missing]
    whole = np.isfinite(present) & (present == np.round(present))
    if not whole.all():
        value = present[np.argmin(whole)]
        fix = (
            "correct the value: the model was trained on a category there"
            if saved
            else "remove it from data.categorical to use it as a number"
        )
        raise DataError(
            f"{source!r}: categorical column {column.name!r} holds the fraction {value!r}; a "
            f"categorical column holds integers or text: {fix}"
        )
    # Beyond 2**53 a float no longer holds every integer: distinct categories (a CSV column
    # of integers wider than 64 bits, read as floats) would share one value, one code.
    inexact = np.abs(np.where(np.isnan(column.values), 0, column.values)) > 2**53
    if inexact.any():
        at = int(np.argmax(inexact))
        raise DataError(
            f"{source!r}: categorical column {column.name!r} holds {column.values[at].item()!r} "
            f"at row {at}, an integer too large to be read exactly as a number (beyond 2**53; "
            "a CSV integer wider than 64 bits is read as a float), so distinct values would "
            "share one code; write the column as text (a Parquet string column, or a CSV "
            "value with a non-digit prefix such as 'c18446744073709551617')"
        )
    values = np.where(np.isnan(column.values), 0, column.values).astype(np.int64)
    return Column(column.name, "int", values, column.missing)


#: cells the CSV reader reads as a 64-bit integer (decimal or hexadecimal), spaces trimmed
_INTEGER_TEXT = r"^-?([0-9]{1,19}|0[xX][0-9a-fA-F]{1,16})$"
#: cells it reads as a floating-point number
_NUMBER_TEXT = r"^[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?$"


def whole_numbers_as_text(column: Column) -> Column:
    """A text column of new rows, for a vocabulary fitted on integers: each cell that the CSV
    reader would read as a whole number (spaces trimmed, then a 64-bit integer, or a number
    that is whole: ``007``, `` 12``, ``1.0``, ``1e3``) becomes its decimal text (``7``,
    ``12``, ``1``, ``1000``), as training read it when every cell of the column was a number;
    other cells are kept. A CSV column is read as text as soon as one cell is not a number,
    so without this, the cell ``007`` of a file also holding ``A12`` would not find the code
    of the category 7. Each distinct cell is converted once, in bulk."""
    import pyarrow as pa
    import pyarrow.compute as pc

    text = column.arrow_text
    if text is None:
        text = pa.array(column.values, pa.string())
    unique = pc.unique(text)
    trimmed = pc.utf8_trim_whitespace(unique)
    canonical = np.asarray(unique.to_numpy(zero_copy_only=False), dtype=object)
    todo = np.ones(len(unique), dtype=bool)
    for pattern, arrow_type in ((_INTEGER_TEXT, pa.int64()), (_NUMBER_TEXT, pa.float64())):
        matched = np.asarray(pc.match_substring_regex(trimmed, pattern).to_numpy(False))
        at = np.flatnonzero(matched & todo)
        wholes = _whole_numbers(trimmed.take(pa.array(at)), arrow_type)
        for k, whole in zip(at, wholes, strict=True):
            if whole is not None:
                canonical[k], todo[k] = whole, False
    cells = pc.take(pa.array(canonical, pa.string()), pc.index_in(text, value_set=unique))
    return Column(column.name, "string", cells, column.missing)


def _whole_numbers(cells: Any, arrow_type: Any) -> list[str | None]:
    """The decimal text of each cell of the pyarrow text array ``cells`` read as
    ``arrow_type`` (int64 or float64) when it is a whole number (a float at most 2**53),
    else None; cast in one call, or cell by cell when one cell does not cast (an integer
    beyond 64 bits)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        values = pc.cast(cells, arrow_type).to_pylist()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        if len(cells) == 1:
            return [None]
        return [w for k in range(len(cells)) for w in _whole_numbers(cells.slice(k, 1), arrow_type)]
    out: list[str | None] = []
    for value in values:
        if isinstance(value, float):
            whole = np.isfinite(value) and value == round(value) and abs(value) <= 2**53
            value = int(value) if whole else None
        out.append(None if value is None else str(value))
    return out


def require_numeric(source: str, column: Column, saved: bool = False) -> None:
    if column.kind != "string":
        return
    present = np.flatnonzero(~column.missing) if column.missing is not None else None
    candidates = range(len(column.values)) if present is None else present
    # Only reached on the way to an error: find the first cell that is not a number to show.
    example = ""
    for row in candidates:
        try:
            float(column.values[row])
        except ValueError:
            example = f" (row {int(row)}: {column.values[row]!r})"
            break
    fix = (
        "correct the value (or remove the row): the model was trained on numbers there"
        if saved
        else "add it to data.categorical to encode it as integer codes, or leave it out of "
        "data.features"
    )
    raise DataError(f"{source!r}: column {column.name!r} holds text{example}, not numbers; {fix}")


def row(rows: np.ndarray | None, mask: np.ndarray) -> int:
    """The data row of the first True in ``mask`` (a mask over ``rows``, or over all rows)."""
    first = int(np.argmax(mask))
    return first if rows is None else int(rows[first])


def refuse_non_finite(
    source: str, name: str, row: int, value: Any, rule: str = "error", saved: bool = False
) -> NoReturn:
    if not saved:
        fix = "correct the value, or leave the cell empty (missing) and set data.missing"
    elif rule == "error":
        fix = (
            "correct the value or remove the row (the model, trained with data.missing = "
            '"error", takes no empty cell either)'
        )
    else:
        fix = (
            "correct the value, or leave the cell empty: it is filled in as in training "
            f"(data.missing = {rule!r})"
        )
    raise DataError(
        f"{source!r}: column {name!r} holds {value!r} at row {row}; features must be finite "
        f"numbers: {fix}"
    )


def refuse_beyond_float32(
    source: str, name: str, row: int, value: Any, saved: bool = False
) -> NoReturn:
    fix = (
        "correct the value (or remove the row): the model takes float32 features"
        if saved
        else 'correct the value, or express the column in larger units (or data.scale = "standard")'
    )
    value = value.item() if isinstance(value, np.generic) else value
    raise DataError(
        f"{source!r}: column {name!r} holds {value!r} at row {row}, which is beyond float32's "
        f"range (at most ±3.4e38) once scaled; features are float32: {fix}"
    )


def refuse_missing(source: str, name: str, row: int, saved: bool = False) -> NoReturn:
    fix = (
        'fill the value in or remove the row: the model was trained with data.missing = "error", '
        "so it takes no empty cell (to predict on rows with gaps, train a model with "
        'data.missing = "mean" or "zero")'
        if saved
        else 'fill the value in, or set data.missing = "mean" or "zero"'
    )
    raise DataError(
        f"{source!r}: column {name!r} has no value at row {row} (0-based data row, header "
        f'excluded) and data.missing = "error"; {fix}'
    )


__all__ = [
    "ROWS",
    "TEXT_ROWS",
    "Vocabulary",
    "arrow_encode",
    "arrow_take",
    "arrow_vocabulary",
    "arrow_vocabulary_text",
    "categorical_column",
    "chunks",
    "encode",
    "refuse_beyond_float32",
    "refuse_missing",
    "refuse_non_finite",
    "require_numeric",
    "row",
    "vocabulary",
    "whole_numbers_as_text",
]
