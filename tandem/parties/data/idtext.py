"""Sample ids held as UTF-8 bytes back to back, without a Python object per id.

An `IdText` of ``n`` ids is two numpy arrays: ``data`` (uint8), the UTF-8 bytes of every id in
row order, and ``offsets`` (int64, ``n + 1`` entries, ``offsets[0] == 0``), where id ``i`` is
``data[offsets[i]:offsets[i + 1]]``. Millions of ids cost their bytes plus 8 bytes each, where
an object array of str costs about 60 bytes more per id. Every operation the loader needs
(hashing, reordering, comparing, sorting in canonical byte order) works on the two arrays a
chunk of rows at a time; `to_objects` builds the str objects only when asked.

Invariants: ``offsets`` is non-decreasing, starts at 0 and ends at ``len(data)``; every id is
valid UTF-8 (it came from str or from Arrow text).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

_CHUNK = 1 << 16  # rows gathered at a time: bounds the index temporaries to a few MB


class IdText:
    """``n`` ids as ``offsets`` and ``data`` (see the module docstring)."""

    __slots__ = ("data", "offsets")

    def __init__(self, offsets: np.ndarray, data: np.ndarray) -> None:
        self.offsets = np.asarray(offsets, np.int64)
        self.data = np.asarray(data, np.uint8)

    @classmethod
    def from_strings(cls, ids: Iterable[str]) -> IdText:
        """The ids of an iterable (or object array) of str."""
        encoded = [s.encode("utf-8") for s in ids]
        offsets = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(np.fromiter(map(len, encoded), np.int64, count=len(encoded)), out=offsets[1:])
        return cls(offsets, np.frombuffer(b"".join(encoded), np.uint8))

    @classmethod
    def from_arrow(cls, text: Any) -> IdText:
        """The ids of a pyarrow string array or chunked array without nulls."""
        chunks = text.chunks if hasattr(text, "chunks") else [text]
        return cls.concatenate([cls._from_arrow_array(chunk) for chunk in chunks])

    @classmethod
    def _from_arrow_array(cls, array: Any) -> IdText:
        offsets, data = arrow_views(array)
        return cls(offsets - offsets[0], data.copy())

    @classmethod
    def concatenate(cls, parts: list[IdText]) -> IdText:
        """The ids of ``parts`` one after the other."""
        if len(parts) == 1:
            return parts[0]
        offsets = np.zeros(sum(len(p) for p in parts) + 1, np.int64)
        data = np.empty(sum(len(p.data) for p in parts), np.uint8)
        row = 0
        for part in parts:
            base = offsets[row]
            offsets[row + 1 : row + len(part) + 1] = part.offsets[1:] + base
            data[base : base + len(part.data)] = part.data
            row += len(part)
        return cls(offsets, data)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        """The UTF-8 byte length of every id (int64)."""
        return np.diff(self.offsets)

    def item(self, i: int) -> str:
        """Id ``i`` as str."""
        return self.data[self.offsets[i] : self.offsets[i + 1]].tobytes().decode("utf-8")

    def take(self, rows: np.ndarray) -> IdText:
        """The ids at positions ``rows`` (int array, or a boolean mask), in that order."""
        rows = np.asarray(rows)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        lengths = self.offsets[rows + 1] - self.offsets[rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        data = np.empty(int(offsets[-1]), np.uint8)
        for start in range(0, len(rows), _CHUNK):
            stop = min(start + _CHUNK, len(rows))
            begin, end = int(offsets[start]), int(offsets[stop])
            shift = self.offsets[rows[start:stop]] - offsets[start:stop]
            data[begin:end] = self.data[
                np.repeat(shift, lengths[start:stop]) + np.arange(begin, end, dtype=np.int64)
            ]
        return IdText(offsets, data)

    def to_objects(self) -> np.ndarray:
        """The ids as an object array of str."""
        text = self.data.tobytes()
        out = np.empty(len(self), object)
        bounds = self.offsets.tolist()
        for i in range(len(self)):
            out[i] = text[bounds[i] : bounds[i + 1]].decode("utf-8")
        return out

    def first_difference(self, other: IdText) -> int | None:
        """The first position where ``other`` (of the same length) holds another id, or None."""
        if len(other) != len(self):
            raise ValueError(f"comparing {len(self)} ids with {len(other)}")
        differ = self.lengths() != other.lengths()
        first = int(np.argmax(differ)) if differ.any() else len(self)
        end = int(self.offsets[first])  # the bytes before ``first`` line up in both arrays
        unequal = np.flatnonzero(self.data[:end] != other.data[:end])
        if unequal.size:
            first = int(np.searchsorted(self.offsets, unequal[0], side="right")) - 1
        return None if first == len(self) else first

    def sort_order(self) -> np.ndarray:
        """The stable order (int64 positions) that sorts the ids by their UTF-8 bytes, the
        canonical order `tandem align` uses."""
        try:
            import pyarrow as pa
            import pyarrow.compute as pc
        except ImportError:
            keys = np.array([s.encode("utf-8") for s in self.to_objects()], dtype=object)
            return np.argsort(keys, kind="stable").astype(np.int64)
        buffers = [None, pa.py_buffer(self.offsets), pa.py_buffer(self.data)]
        array = pa.Array.from_buffers(pa.large_binary(), len(self), buffers)
        return np.asarray(pc.sort_indices(array).to_numpy(), np.int64)

    def chunks(self, size: int = _CHUNK) -> Iterable[tuple[np.ndarray, bytes]]:
        """``(lengths, bytes)`` of ``size`` consecutive ids at a time, in row order."""
        for start in range(0, len(self), size):
            stop = min(start + size, len(self))
            begin, end = int(self.offsets[start]), int(self.offsets[stop])
            yield np.diff(self.offsets[start : stop + 1]), self.data[begin:end].tobytes()


def arrow_views(array: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(offsets, data)`` of a pyarrow string array without nulls, as numpy views of its
    buffers (no copy): id ``i`` is ``data[offsets[i] - offsets[0]:offsets[i + 1] - offsets[0]]``;
    ``offsets`` is int32 or int64, as the array's type says."""
    _, offset_buffer, data_buffer = array.buffers()
    wide = str(array.type) == "large_string"
    offsets = np.frombuffer(offset_buffer, np.int64 if wide else np.int32)
    offsets = offsets[array.offset : array.offset + len(array) + 1]
    start, stop = int(offsets[0]), int(offsets[-1])
    if stop == start:
        return offsets, np.empty(0, np.uint8)
    return offsets, np.frombuffer(data_buffer, np.uint8)[start:stop]


class IdTextBuilder:
    """Builds an `IdText` of a known number of ids from pyarrow string arrays appended in
    order, writing straight into preallocated offsets and a byte buffer grown as needed (the
    result may view a buffer up to an eighth larger than its bytes)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._offsets = np.zeros(n + 1, np.int64)
        self._data = np.empty(0, np.uint8)
        self._rows = 0

    def append(self, array: Any) -> None:
        """Append the ids of a pyarrow string array (or chunked array) without nulls."""
        for chunk in array.chunks if hasattr(array, "chunks") else [array]:
            offsets, data = arrow_views(chunk)
            used = int(self._offsets[self._rows])
            need = used + len(data)
            if need > len(self._data):
                rows = self._rows + len(chunk)
                guess = need * self._n // max(rows, 1) + need // 8
                grown = np.empty(max(need, guess, len(self._data) * 3 // 2), np.uint8)
                grown[:used] = self._data[:used]
                self._data = grown
            self._data[used:need] = data
            end = self._rows + len(chunk)
            self._offsets[self._rows + 1 : end + 1] = offsets[1:]
            self._offsets[self._rows + 1 : end + 1] += used - int(offsets[0])
            self._rows = end

    def build(self) -> IdText:
        """The ids appended so far (there must be ``n``)."""
        if self._rows != self._n:
            raise ValueError(f"{self._rows} ids appended, {self._n} expected")
        return IdText(self._offsets, self._data[: int(self._offsets[self._n])])


__all__ = ["IdText", "IdTextBuilder", "arrow_views"]
