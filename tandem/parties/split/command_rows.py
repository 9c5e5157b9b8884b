"""How a leader's batch command names the rows of the batch (``idx``: positions in each
party's copy of the dataset, which the parties' alignment orders identically).

A command carries its rows in the smallest of three forms (`encode_rows`), and the follower
turns any of them back into the same ``int64[rows]`` array the leader runs (`RowsDecoder`):

* **draw** (``meta["rows"] = {"draw": [n_rows, batch_size, seed, epoch, i], "digest": h}``,
  no array): batch ``i`` of ``epoch`` of the seeded shuffle `tandem.engine.data.epoch_batches`
  over ``n_rows`` rows, the order `SplitParty.fit` trains in. The follower draws the same
  permutation itself (once per epoch) and checks ``h``, an 8-byte BLAKE2b digest of the
  leader's ``idx`` as little-endian int64: a follower whose draw differs (e.g. a numpy whose
  generator draws another permutation) refuses the command instead of training on other rows.
* **range** (``meta["rows"] = {"range": [start, stop]}``, no array): the consecutive rows
  ``start .. stop - 1`` (evaluation and prediction walk the rows in order).
* **list** (no ``meta["rows"]``, one array): any other rows, as the narrowest unsigned
  integer dtype that holds the largest index (`index_dtype`: uint8 up to 255, uint16, uint32
  up to 2^32 - 1, uint64 past it). A receiver also takes int64, the widest signed form.

Invariant: ``RowsDecoder().decode(*encode_rows(idx, draw))`` equals ``idx`` as int64 (bit
for bit, order kept), whichever form was chosen; exact training is unchanged by the form.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tandem.engine.data import epoch_batches
from tandem.errors import AdmissionError

#: dtypes a list of rows may travel as (the narrow unsigned ones `index_dtype` picks, and int64)
LIST_DTYPES = frozenset({"uint8", "uint16", "uint32", "uint64", "int64"})
_UNSIGNED = (np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32), np.dtype(np.uint64))
#: epoch orders a `RowsDecoder` keeps: the running epoch's and the next one's (a leader
#: announces an epoch's first batch while the previous epoch's last one runs)
_KEPT_EPOCHS = 2


@dataclasses.dataclass(frozen=True)
class Draw:
    """Batch ``i`` of ``epoch`` of `epoch_batches` ``(n_rows, batch_size, epoch, seed)``."""

    n_rows: int
    batch_size: int
    seed: int
    epoch: int
    i: int

    def as_list(self) -> list[int]:
        return [self.n_rows, self.batch_size, self.seed, self.epoch, self.i]


def index_dtype(top: int) -> np.dtype:
    """The narrowest unsigned integer dtype that holds every index ``0 .. top``."""
    if top < 0:
        raise ValueError(f"row indices are non-negative; the largest given is {top}")
    for dt in _UNSIGNED:
        if top <= np.iinfo(dt).max:
            return dt
    raise ValueError(f"row index {top} does not fit in 64 bits")


def digest(idx: np.ndarray) -> str:
    """8-byte BLAKE2b of ``idx`` as little-endian int64, in hex."""
    data = np.ascontiguousarray(idx, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=8).hexdigest()


def _consecutive(idx: np.ndarray) -> bool:
    return bool(
        len(idx) and int(idx[-1]) - int(idx[0]) == len(idx) - 1 and np.all(np.diff(idx) == 1)
    )


def encode_rows(
    idx: np.ndarray, draw: Draw | None = None
) -> tuple[dict[str, Any], tuple[np.ndarray, ...]]:
    """``(meta, arrays)`` naming rows ``idx`` (non-negative integers) in a batch command: the
    ``"rows"`` entry to merge into the command's meta (empty for a list) and its arrays.

    ``draw``: where ``idx`` came from, when it is a batch of the seeded shuffle; the digest
    lets the receiver check that its own draw gives ``idx``."""
    idx = np.asarray(idx)
    if idx.ndim != 1 or not len(idx):
        raise ValueError(f"a batch names one or more rows, got an index array {idx.shape}")
    if draw is not None:
        return {"rows": {"draw": draw.as_list(), "digest": digest(idx)}}, ()
    if _consecutive(idx) and int(idx[0]) >= 0:
        return {"rows": {"range": [int(idx[0]), int(idx[-1]) + 1]}}, ()
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0:
        raise ValueError(f"row indices are non-negative; got {lo}")
    return {}, (np.asarray(idx, index_dtype(hi)),)


def _ints(value: Any, count: int) -> list[int] | None:
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != count:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return list(value)


def _form(meta: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> tuple[str, Any]:
    """``("list", array)``, ``("range", [start, stop])`` or ``("draw", (Draw, digest))``;
    `AdmissionError` (field ``"idx"``) for a malformed form."""
    rows = meta.get("rows")
    if rows is None:
        if len(arrays) != 1:
            raise AdmissionError(
                f"a batch command carries one row-index array, got {len(arrays)}", field="idx"
            )
        a = arrays[0]
        if a.dtype.name not in LIST_DTYPES or a.ndim != 1 or a.shape[0] < 1:
            raise AdmissionError(
                f"row indices are {a.dtype}{list(a.shape)}; expected [rows >= 1] of one of "
                f"{sorted(LIST_DTYPES)}",
                field="idx",
            )
        return "list", a
    if not isinstance(rows, Mapping):
        raise AdmissionError(f"rows {rows!r} is not a table", field="idx")
    if arrays:
        raise AdmissionError(
            f"a command naming its rows by {sorted(rows)} carries no array, got {len(arrays)}",
            field="idx",
        )
    if "range" in rows:
        span = _ints(rows["range"], 2)
        if span is None or not 0 <= span[0] < span[1]:
            raise AdmissionError(
                f"rows range {rows['range']!r}; expected [start, stop] with 0 <= start < stop",
                field="idx",
            )
        return "range", span
    if "draw" in rows:
        spec = _ints(rows["draw"], 5)
        if spec is None:
            raise AdmissionError(
                f"rows draw {rows['draw']!r}; expected [n_rows, batch_size, seed, epoch, i]",
                field="idx",
            )
        draw = Draw(*spec)
        if (
            draw.n_rows < 1
            or draw.batch_size < 1
            or draw.seed < 0
            or draw.epoch < 0
            or not 0 <= draw.i * draw.batch_size < draw.n_rows
        ):
            raise AdmissionError(
                f"rows draw {spec}: batch {draw.i} of {draw.batch_size} rows is not one of "
                f"{draw.n_rows} rows' batches (or a field is negative)",
                field="idx",
            )
        if not isinstance(rows.get("digest"), str):
            raise AdmissionError("rows draw without its digest", field="idx")
        return "draw", (draw, rows["digest"])
    raise AdmissionError(
        f"rows {sorted(rows)!r}: expected 'range' or 'draw' (or an index array)", field="idx"
    )


def row_count(meta: Mapping[str, Any], arrays: Sequence[np.ndarray]) -> int:
    """How many rows a command names, without drawing anything; `AdmissionError` (field
    ``"idx"``) for a malformed form."""
    kind, value = _form(meta, arrays)
    if kind == "list":
        return int(value.shape[0])
    if kind == "range":
        return value[1] - value[0]
    draw = value[0]
    return min(draw.batch_size, draw.n_rows - draw.i * draw.batch_size)


class RowsDecoder:
    """Turns a command's rows (`encode_rows`) back into ``int64[rows]``; keeps the orders of
    the last `_KEPT_EPOCHS` epochs it drew (each ``n_rows`` indices, as narrow as they fit).

    Raises `AdmissionError` (field ``"idx"``) for rows that cannot be right: a malformed
    form, a list of another dtype or shape, rows past ``limit``, a draw whose digest differs.
    """

    def __init__(self) -> None:
        #: (n_rows, batch_size, seed, epoch) -> (order, start of each batch in it)
        self._orders: collections.OrderedDict[
            tuple[int, int, int, int], tuple[np.ndarray, np.ndarray]
        ] = collections.OrderedDict()

    def decode(
        self, meta: Mapping[str, Any], arrays: Sequence[np.ndarray], limit: int | None = None
    ) -> np.ndarray:
        """The rows ``int64[rows]`` a command's ``meta`` and ``arrays`` name. ``limit``: the
        rows of the dataset they index, when known: a range or draw reaching past it is
        refused before anything is allocated (a list's indices are the caller's to bound)."""
        kind, value = _form(meta, arrays)
        if kind == "list":
            if value.dtype == np.uint64 and int(value.max()) > np.iinfo(np.int64).max:
                raise AdmissionError(
                    f"row index {int(value.max())} is past any dataset", field="idx"
                )
            return np.asarray(value, np.int64)
        top = value[1] if kind == "range" else value[0].n_rows
        if limit is not None and top > limit:
            raise AdmissionError(
                f"the command names rows up to {top - 1}; the dataset here has {limit} rows",
                field="idx",
            )
        if kind == "range":
            return np.arange(value[0], value[1], dtype=np.int64)
        return self._draw(*value)

    def _draw(self, draw: Draw, want: str) -> np.ndarray:
        order, starts = self._order(draw.n_rows, draw.batch_size, draw.seed, draw.epoch)
        idx = np.asarray(order[starts[draw.i] : starts[draw.i + 1]], np.int64)
        if want != digest(idx):
            raise AdmissionError(
                f"batch {draw.i} of epoch {draw.epoch} drawn here (seed {draw.seed}, "
                f"{draw.n_rows} rows, batch size {draw.batch_size}) is not the leader's "
                f"(digest {want!r}, here {digest(idx)!r}): the parties' random generators "
                "differ. Install the same numpy version on every party",
                field="idx",
            )
        return idx

    def _order(
        self, n_rows: int, batch_size: int, seed: int, epoch: int
    ) -> tuple[np.ndarray, np.ndarray]:
        key = (n_rows, batch_size, seed, epoch)
        if key in self._orders:
            self._orders.move_to_end(key)
            return self._orders[key]
        batches = epoch_batches(n_rows, batch_size, epoch, seed)
        order = np.concatenate(batches).astype(index_dtype(n_rows - 1))
        starts = np.cumsum([0, *(len(b) for b in batches)])
        self._orders[key] = (order, starts)
        while len(self._orders) > _KEPT_EPOCHS:
            self._orders.popitem(last=False)
        return order, starts


__all__ = [
    "LIST_DTYPES",
    "Draw",
    "RowsDecoder",
    "digest",
    "encode_rows",
    "index_dtype",
    "row_count",
]
