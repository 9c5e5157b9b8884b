"""Read a party's table through fsspec: one reader per suffix, one column model for all.

`read_table(url, columns=None) -> Table` opens ``url`` with fsspec (a local path, ``file://``,
``memory://``, ``s3://``: whatever fsspec can open) and picks the reader by suffix:

* ``.csv``: pyarrow; a header row, then one row per sample. Every cell is read as text, then a
  column is *int* if every non-missing cell parses as a 64-bit integer, else *float* if every
  one parses as a number, else *string* (spaces around a number are ignored). A cell is missing
  when it is one of `MISSING_TEXT`. The id column is always read as text, exactly as written
  (``007`` stays ``007``), as `tandem align` reads it.
* ``.parquet``: pyarrow; integer and boolean columns are *int*, floating and decimal columns
  *float*, string columns *string*; nulls are missing. Other types are refused.
* ``.npz``: numpy with ``allow_pickle=False``; one 1-D array per column, all of one length;
  integer and boolean arrays are *int*, floating ones *float*, unicode ones *string*.

In every format a NaN in a float column is missing. CSV and Parquet need pyarrow (the
``tandem[parquet]`` extra); it is imported only when such a file is read.

`open_table(url, columns=None)` is `read_table` for a loader that takes one column at a time:
a Parquet file's columns are read on demand, by record batches, so the whole file is never in
memory at once (docs/design.md, "Data larger than memory"); other formats are read whole.

Invariants of a `Column`: ``values`` has one entry per row; int columns are int64, float
columns float64, string columns an object array of str (built on first use from ``cells``
when pyarrow read the text); a missing cell holds 0, NaN or "" and is True in ``missing``
(None when no cell is missing).
"""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from tandem._extras import needs

from .errors import DataError
from .idtext import IdText, IdTextBuilder

SUFFIXES = (".csv", ".parquet", ".npz")
MISSING_TEXT = ("", "NA", "N/A", "NaN", "nan", "null", "NULL", "None")
KINDS = ("int", "float", "string")


@dataclasses.dataclass(frozen=True)
class Column:
    """One column: ``kind`` in `KINDS`, its ``cells`` and the ``missing`` mask (see the
    module). ``cells`` is the numpy array of ``values``, or for text read by pyarrow a pyarrow
    string array (missing cells as ""), so encoders can work on it without a Python object
    per cell; ``values`` builds the numpy array from it on first use."""

    name: str
    kind: str
    cells: Any
    missing: np.ndarray | None = None

    @functools.cached_property
    def values(self) -> np.ndarray:
        """The cells as numpy (int64, float64, or an object array of str)."""
        if isinstance(self.cells, np.ndarray):
            return self.cells
        return self.cells.to_numpy(zero_copy_only=False).astype(object, copy=False)

    @property
    def arrow_text(self) -> Any | None:
        """The pyarrow string array of a text column read by pyarrow, else None."""
        return None if isinstance(self.cells, np.ndarray) else self.cells

    def first_missing(self, rows: np.ndarray | None = None) -> int | None:
        """The first data row (among ``rows``, default all) whose cell is missing, or None."""
        if self.missing is None:
            return None
        mask = self.missing if rows is None else self.missing[rows]
        hit = np.flatnonzero(mask)
        if not hit.size:
            return None
        return int(hit[0] if rows is None else rows[hit[0]])


@dataclasses.dataclass(frozen=True)
class Table:
    """The columns read from ``source`` (in file order) and every column name the file has.

    A table from `open_table` may read its columns on demand: ``pieces(name)`` yields one
    column of ``kinds`` as pyarrow arrays in row order, and indexing stitches them into a
    `Column` (each access reads it again; nothing is kept), so a caller that takes one
    column at a time holds one column at a time. ``text`` names the columns read as text."""

    source: str
    columns: dict[str, Column]
    available: tuple[str, ...]
    num_rows: int
    kinds: Mapping[str, str] = dataclasses.field(default_factory=dict)
    pieces: Callable[[str], Iterator[Any]] | None = None
    text: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Column:
        if name in self.columns:
            return self.columns[name]
        if self.pieces is not None and name in self.kinds:
            _release_arrow_memory()  # what the caller dropped since the last column, first
            as_text = name in self.text
            kind = self.kinds[name]
            return _stitch(self.source, name, self.pieces(name), self.num_rows, kind, as_text)
        raise DataError(
            f"{self.source!r} has no column {name!r}; its columns are {list(self.available)}"
        )

    def id_text(self, name: str) -> tuple[IdText, int | None]:
        """Column ``name`` as text (`IdText`, missing cells as "") and its first missing row
        (or None); an on-demand column is converted a piece at a time."""
        if self.pieces is None or name not in self.kinds:
            column = self[name]
            text = column.arrow_text
            ids = IdText.from_strings(column.values) if text is None else IdText.from_arrow(text)
            return ids, column.first_missing()
        builder = IdTextBuilder(self.num_rows)
        first, start = None, 0
        for piece in self.pieces(name):
            column = _text(name, piece)
            if first is None and column.missing is not None:
                first = start + int(np.argmax(column.missing))
            builder.append(column.arrow_text)
            start += len(piece)
        _release_arrow_memory()
        return builder.build(), first

    def kind(self, name: str) -> str:
        """The kind of column ``name`` (`KINDS`), without reading it where the format says."""
        if name in self.kinds:
            return self.kinds[name]
        return self[name].kind


def read_table(
    url: str, columns: Sequence[str] | None = None, *, text: Sequence[str] = ()
) -> Table:
    """Read ``columns`` (default: all) of the table at ``url``; ``text`` names columns read as
    text whatever they hold (the id column). Raises `DataError` naming ``url`` for a missing
    file, an unknown suffix, an unknown column or an unreadable value."""
    suffix = next((s for s in SUFFIXES if url.lower().endswith(s)), None)
    if suffix is None:
        raise DataError(
            f"{url!r}: cannot tell the format from the name; use a file ending in one of "
            f"{list(SUFFIXES)}"
        )
    import fsspec

    try:
        with fsspec.open(url, "rb") as f:
            if suffix == ".csv":
                return _read_csv(url, f, columns, text)
            if suffix == ".parquet":
                return _read_parquet(url, f, columns, text)
            return _read_npz(url, f, columns, text)
    except FileNotFoundError:
        raise DataError(f"{url!r}: no such file; check data.source") from None


def open_table(
    url: str, columns: Sequence[str] | None = None, *, text: Sequence[str] = ()
) -> Table:
    """`read_table`, except that a Parquet file is not read here: its schema is, and each
    column is read when the table is indexed, by record batches into one preallocated array
    (int64 or float64; text stays pyarrow text), so the whole file is never in memory at
    once. Other formats are read whole, as `read_table` does. The columns and errors are
    those of `read_table`."""
    if not url.lower().endswith(".parquet"):
        return read_table(url, columns, text=text)
    pa = _pyarrow(url)
    import fsspec
    import pyarrow.parquet as pq

    try:
        with fsspec.open(url, "rb") as f:
            file = pq.ParquetFile(f)
            schema = file.schema_arrow
            num_rows = file.metadata.num_rows
    except FileNotFoundError:
        raise DataError(f"{url!r}: no such file; check data.source") from None
    except pa.ArrowException as exc:
        raise DataError(f"{url!r} is not a readable Parquet file: {exc}") from None
    names = _check_columns(url, schema.names, columns)
    kinds = {n: "string" if n in text else _arrow_kind(url, n, schema.field(n).type) for n in names}
    pieces = functools.partial(_parquet_pieces, url)
    return Table(url, {}, tuple(schema.names), num_rows, kinds, pieces, tuple(text))


_BATCH_ROWS = 1 << 16  # rows decoded at a time when a Parquet column is read


def _parquet_pieces(url: str, name: str) -> Iterator[Any]:
    """Column ``name`` of a Parquet file as pyarrow arrays of `_BATCH_ROWS` rows, in order."""
    pa = _pyarrow(url)
    import fsspec
    import pyarrow.parquet as pq

    try:
        with fsspec.open(url, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=_BATCH_ROWS, columns=[name]):
                yield batch.column(0)
    except FileNotFoundError:
        raise DataError(f"{url!r}: no such file; check data.source") from None
    except pa.ArrowException as exc:
        raise DataError(f"{url!r} is not a readable Parquet file: {exc}") from None


def _stitch(
    url: str, name: str, pieces: Iterable[Any], num_rows: int, kind: str, as_text: bool
) -> Column:
    """One column from its pyarrow pieces in row order: each piece is converted as
    `_arrow_column` (or `_text`) converts a whole column, into one preallocated array."""
    values: np.ndarray | None = None
    texts: list[Any] = []
    missing: np.ndarray | None = None
    start = 0
    for piece in pieces:
        column = _text(name, piece) if as_text else _arrow_column(name, piece, url)
        stop = start + len(piece)
        if column.missing is not None:
            if missing is None:
                missing = np.zeros(num_rows, bool)
            missing[start:stop] = column.missing
        if column.arrow_text is not None:
            texts.append(column.arrow_text)
        else:
            if values is None:
                values = np.empty(num_rows, column.values.dtype)
            values[start:stop] = column.values
        start = stop
    import pyarrow as pa

    if kind == "string":
        cells = pa.chunked_array(
            [c for t in texts for c in (t.chunks if isinstance(t, pa.ChunkedArray) else [t])],
            type=pa.string(),
        )
        return Column(name, kind, cells, missing)
    if values is None:
        values = np.empty(0, np.float64 if kind == "float" else np.int64)
    _release_arrow_memory()
    return Column(name, kind, values, missing)


def _release_arrow_memory() -> None:
    """Hand pyarrow's cached free memory back to the system: its pool keeps the pages of the
    decode buffers of a column read a batch at a time, which are not needed again."""
    import pyarrow as pa

    pa.default_memory_pool().release_unused()


def _arrow_kind(url: str, name: str, t: Any) -> str:
    """The `KINDS` entry of a column of pyarrow type ``t``, or the refusal `_arrow_column`
    gives."""
    import pyarrow.types as pt

    if pt.is_dictionary(t):
        t = t.value_type
    if pt.is_integer(t) or pt.is_boolean(t):
        return "int"
    if pt.is_floating(t) or pt.is_decimal(t):
        return "float"
    if pt.is_string(t) or pt.is_large_string(t):
        return "string"
    raise DataError(_unsupported_type(url, name, t))


def _pyarrow(url: str) -> Any:
    with needs("parquet", f"reading {url!r} (.csv and .parquet files)"):
        import pyarrow
    return pyarrow


def _check_columns(url: str, available: Sequence[str], wanted: Sequence[str] | None) -> list[str]:
    if len(set(available)) != len(available):
        twice = sorted({c for c in available if list(available).count(c) > 1})
        raise DataError(f"{url!r} has columns named twice: {twice}; give every column one name")
    if wanted is None:
        return list(available)
    unknown = [c for c in wanted if c not in available]
    if unknown:
        raise DataError(
            f"{url!r} has no column(s) {unknown}; its columns are {list(available)} "
            "(check data.id_column, data.label_column, data.features and data.categorical)"
        )
    return [c for c in available if c in set(wanted)]


def _read_csv(url: str, f: Any, columns: Sequence[str] | None, text: Sequence[str]) -> Table:
    pa = _pyarrow(url)
    import pyarrow.csv as pacsv

    first = f.readline()
    while first.count(b'"') % 2 and (more := f.readline()):  # a quoted cell spans lines
        first += more
    header = _csv_header(url, first)
    f.seek(0)
    names = _check_columns(url, header, columns)
    options = pacsv.ConvertOptions(
        column_types={c: pa.string() for c in names},
        include_columns=names,
        null_values=list(MISSING_TEXT),
        strings_can_be_null=True,
        quoted_strings_can_be_null=True,
    )
    try:
        arrow = pacsv.read_csv(f, convert_options=options)
    except pa.ArrowException as exc:
        raise DataError(f"{url!r} is not a well-formed CSV: {exc}") from None
    cols = {}
    for name in names:
        chunked = arrow.column(name)
        cols[name] = _from_text(name, chunked) if name not in text else _text(name, chunked)
    return Table(url, cols, tuple(header), arrow.num_rows)


def _csv_header(url: str, first: bytes) -> list[str]:
    import csv

    try:
        line = first.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise DataError(
            f"{url!r}: the header row is not UTF-8 text; save the CSV as UTF-8"
        ) from None
    try:  # newline="": a line may end in \r\n, \n or a lone \r, as in csv and pyarrow
        header = next(csv.reader(io.StringIO(line, newline="")), None)
    except csv.Error as exc:
        raise DataError(f"{url!r}: the header row is not a well-formed CSV line: {exc}") from None
    if not header:
        raise DataError(f"{url!r} is empty; a CSV needs a header row, then one row per sample")
    return header


def _from_text(name: str, chunked: Any) -> Column:
    """A text column as int, float or string, by the rule in the module docstring."""
    import pyarrow as pa
    import pyarrow.compute as pc

    trimmed = pc.utf8_trim_whitespace(chunked)
    for arrow_type in (pa.int64(), pa.float64()):
        try:
            numbers = pc.cast(trimmed, arrow_type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
        return _arrow_column(name, numbers)
    return _text(name, chunked)


def _text(name: str, chunked: Any) -> Column:
    import pyarrow as pa
    import pyarrow.compute as pc

    chunked = pc.cast(chunked, pa.string())
    missing = _null_mask(chunked)
    return Column(
        name, "string", pc.fill_null(chunked, "") if missing is not None else chunked, missing
    )


def _null_mask(chunked: Any) -> np.ndarray | None:
    if chunked.null_count == 0:
        return None
    return np.asarray(chunked.is_null().to_numpy(zero_copy_only=False), dtype=bool)


def _arrow_column(name: str, chunked: Any, url: str = "") -> Column:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.types as pt

    t = chunked.type
    if pt.is_dictionary(t):
        chunked = pc.cast(chunked, t.value_type)
        t = chunked.type
    if pt.is_integer(t) or pt.is_boolean(t):
        missing = _null_mask(chunked)
        try:
            chunked = pc.cast(chunked, pa.int64())  # first: a boolean column takes no fill of 0
        except pa.ArrowInvalid:
            raise DataError(
                f"{url!r}: column {name!r} holds integers beyond the 64-bit signed range; "
                "store them as text (a string column) if they are codes, else as floats"
            ) from None
        filled = pc.fill_null(chunked, 0) if missing is not None else chunked
        values = np.asarray(filled.to_numpy(), dtype=np.int64)
        return Column(name, "int", values, missing)
    if pt.is_floating(t) or pt.is_decimal(t):
        as_float = pc.cast(chunked, pa.float64())
        values = np.asarray(as_float.to_numpy(zero_copy_only=False), dtype=np.float64)
        return _float_column(name, values)
    if pt.is_string(t) or pt.is_large_string(t):
        return _text(name, chunked)
    raise DataError(_unsupported_type(url, name, t))


def _unsupported_type(url: str, name: str, t: Any) -> str:
    return (
        f"{url!r}: column {name!r} has type {t}, which is not a number or text; convert it "
        "to a number or a string before training (or leave it out of data.features)"
    )


def _float_column(name: str, values: np.ndarray) -> Column:
    missing = np.isnan(values)
    return Column(name, "float", values, missing if missing.any() else None)


def _read_parquet(url: str, f: Any, columns: Sequence[str] | None, text: Sequence[str]) -> Table:
    pa = _pyarrow(url)
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(f)
        available = file.schema_arrow.names
        names = _check_columns(url, available, columns)
        arrow = file.read(columns=names)
    except pa.ArrowException as exc:
        raise DataError(f"{url!r} is not a readable Parquet file: {exc}") from None
    cols = {}
    for name in names:
        chunked = arrow.column(name)
        if name in text:
            cols[name] = _text(name, chunked)
        else:
            cols[name] = _arrow_column(name, chunked, url)
    return Table(url, cols, tuple(available), arrow.num_rows)


def _read_npz(url: str, f: Any, columns: Sequence[str] | None, text: Sequence[str]) -> Table:
    try:
        z = np.load(io.BytesIO(f.read()), allow_pickle=False)
    except (ValueError, OSError) as exc:
        raise DataError(f"{url!r} is not a readable .npz file: {exc}") from None
    with z:
        available = list(z.files)
        names = _check_columns(url, available, columns)
        cols: dict[str, Column] = {}
        num_rows: int | None = None
        for name in names:
            try:
                array = z[name]
            except ValueError:
                raise DataError(
                    f"{url!r}: array {name!r} holds Python objects, which are never unpickled; "
                    "save it as numbers or as a unicode string array (dtype 'U')"
                ) from None
            if array.ndim != 1:
                raise DataError(
                    f"{url!r}: array {name!r} has shape {array.shape}; a .npz table holds one "
                    "1-D array per column (np.savez(path, age=ages, city=cities, ...))"
                )
            if num_rows is not None and array.shape[0] != num_rows:
                raise DataError(
                    f"{url!r}: array {name!r} has {array.shape[0]} rows, the others {num_rows}; "
                    "every column must have one entry per row"
                )
            num_rows = int(array.shape[0])
            cols[name] = _numpy_column(url, name, array, name in text)
    return Table(url, cols, tuple(available), num_rows or 0)


def _numpy_column(url: str, name: str, array: np.ndarray, as_text: bool) -> Column:
    if as_text:
        if array.dtype.kind not in "iuU":
            raise DataError(
                f"{url!r}: id array {name!r} has dtype {array.dtype}; ids must be integers or "
                "strings"
            )
        return Column(name, "string", array.astype(str).astype(object))
    if array.dtype.kind in "iub":
        if array.dtype.kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
            raise DataError(f"{url!r}: array {name!r} holds integers beyond 64-bit signed range")
        return Column(name, "int", array.astype(np.int64))
    if array.dtype.kind == "f":
        return _float_column(name, array.astype(np.float64))
    if array.dtype.kind == "U":
        return Column(name, "string", array.astype(object))
    raise DataError(
        f"{url!r}: array {name!r} has dtype {array.dtype}; use numbers or unicode strings"
    )


__all__ = ["Column", "Table", "open_table", "read_table", "SUFFIXES", "MISSING_TEXT", "KINDS"]
