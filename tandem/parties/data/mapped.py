"""Feature matrices kept in a file instead of the process's memory (``[data] in_memory = false``).

A party's packed float32 features (`Features.packed`) can be the largest thing it holds. With
``in_memory = false`` the loader writes them to a file in ``spill_dir`` and the party reads
them back through a read-only shared mapping of that file:

* `ColumnSpill` is the loader's output buffer: a column-major ``(columns, rows)`` mapping, so
  the preprocessing (a column at a time) writes one contiguous range per column and
  `ColumnSpill.release` drops that range from the process once it is written. `to_rows` then
  copies it, a block of rows at a time, into the row-major file the party trains from.
* `MappedRows` is the party's view of that row-major file: ``gather(idx)`` copies rows out
  (the micro-batch gather). Its pages are clean copies of the file, which the kernel takes
  back under memory pressure, so the features need not fit in memory. With a ``budget``
  (``[data] resident_mb``) the gather also drops them from the process
  (``madvise(MADV_DONTNEED)``; the page cache keeps them) whenever they grew by that much,
  which bounds the process's resident set at the price of faulting them in again.

Invariants: the process's resident pages of the loader's mapping stay below one column
(`ColumnSpill`), and with a budget those of a `MappedRows` below about twice the budget,
whatever the file's size; the bytes are exactly
those the in-memory path holds (same layout, dtype and row order), so training and the data
fingerprint do not depend on the option. The files are unlinked as soon as they are mapped
(POSIX): nothing is left in ``spill_dir`` after an exit, a crash or a kill; where a mapped file
cannot be unlinked (Windows) it is removed when its mapping is closed or collected.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import threading
import weakref
from typing import Any

import numpy as np

from .errors import DataError

#: The most one read fault of a file mapping may map into the process: a PMD-sized folio.
LARGEST_FAULT = 2 << 20
_BLOCK_ROWS = 1 << 16  # rows copied at a time by `ColumnSpill.to_rows`
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)


def default_spill_dir() -> str:
    """The folder spilled features go to when ``[data] spill_dir`` is not set: the system's
    temporary folder (``TMPDIR`` where set)."""
    return tempfile.gettempdir()


class _Mapping:
    """One file (created in ``directory``, ``size`` bytes, unlinked at once where possible),
    mapped shared; ``drop(lo, hi)`` removes its pages in ``[lo, hi)`` from this process."""

    def __init__(self, directory: str, size: int, *, writable: bool, fill=None) -> None:
        try:
            fd, path = tempfile.mkstemp(prefix="tandem-features-", suffix=".f32", dir=directory)
        except OSError as exc:
            raise DataError(
                f"data.spill_dir {directory!r}: cannot create the features file there ({exc}); "
                "set [data] spill_dir to a writable folder on a disk with room for the "
                "features, or in_memory = true"
            ) from None
        try:
            if fill is not None:
                fill(fd)
            os.ftruncate(fd, max(size, 1))  # an empty file cannot be mapped
            self.map = mmap.mmap(
                fd,
                max(size, 1),
                access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ,
            )
        except OSError as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.remove(path)
            raise DataError(
                f"data.spill_dir {directory!r}: cannot write {size} bytes of features ({exc}); "
                "free space there, point [data] spill_dir at a larger disk, or set "
                "in_memory = true"
            ) from None
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.size = size
        try:
            os.remove(path)  # the mapping keeps the data; the name goes now
        except OSError:  # Windows: a mapped file cannot be removed yet
            weakref.finalize(self, _remove_after, self.map, path)

    def drop(self, lo: int = 0, hi: int | None = None) -> None:
        """Drop this process's pages of bytes ``[lo, hi)`` (rounded out to whole pages: the
        mapping is shared, so a dropped page keeps its bytes in the file)."""
        if _DONTNEED is None or self.size == 0:
            return
        hi = self.size if hi is None else hi
        page = mmap.PAGESIZE
        start = lo - lo % page
        stop = min(-(-hi // page) * page, len(self.map))
        if stop > start:
            self.map.madvise(_DONTNEED, start, stop - start)


def _remove_after(mapping: mmap.mmap, path: str) -> None:
    with contextlib.suppress(BufferError, ValueError):
        mapping.close()
    with contextlib.suppress(OSError):
        os.remove(path)


class MappedRows:
    """A read-only float32 matrix ``(rows, columns)`` in a file mapping (see the module
    docstring). ``rows(lo, hi)`` is a part of it sharing the mapping and its budget;
    ``gather(idx)`` copies rows ``idx`` out (what `tandem.engine.data.BatchRows` calls);
    indexing (``m[...]``) and ``np.asarray(m)`` give plain views of the mapping, outside the
    budget (for inspection, not for training loops)."""

    def __init__(
        self, pager: _Pager, array: np.ndarray, first: int = 0, count: int | None = None
    ) -> None:
        self._pager = pager
        self._whole = array
        self._first = first
        self._count = len(array) - first if count is None else count
        self._view = array[first : first + self._count]

    @classmethod
    def from_array(
        cls, array: np.ndarray, directory: str, *, budget: int | None = None
    ) -> MappedRows:
        """Write ``array`` (float32, 2-d) to a new file in ``directory`` and map it."""
        data = np.ascontiguousarray(array, np.float32)
        if data.ndim != 2:
            raise ValueError(f"MappedRows holds a matrix, got shape {data.shape}")

        def fill(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data.data)

        mapping = _Mapping(directory, data.nbytes, writable=False, fill=fill)
        return cls._over(mapping, data.shape, budget)

    @classmethod
    def _over(cls, mapping: _Mapping, shape: tuple[int, ...], budget: int | None) -> MappedRows:
        array = np.frombuffer(mapping.map, np.float32, count=int(np.prod(shape)))
        return cls(_Pager(mapping, budget), array.reshape(shape))

    # -- the ndarray surface the party and the session read --------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._view.shape

    @property
    def dtype(self) -> np.dtype:
        return self._view.dtype

    @property
    def ndim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self._view.nbytes

    @property
    def budget(self) -> int | None:
        """The resident bytes of the mapping that trigger a drop (None: never dropped)."""
        return self._pager.budget

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._view[key]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return np.array(self._view, dtype=dtype)
        return self._view if dtype is None else self._view.astype(dtype, copy=False)

    def rows(self, lo: int, hi: int) -> MappedRows:
        """Rows ``[lo, hi)`` of this matrix: a `MappedRows` on the same mapping and budget."""
        lo, hi = max(0, lo), min(hi, self._count)
        return MappedRows(self._pager, self._whole, self._first + lo, max(0, hi - lo))

    def gather(self, idx: np.ndarray | slice) -> np.ndarray:
        """Rows ``idx`` (indices or a slice) as a new in-memory array; with a budget, read a
        piece at a time, the mapping's pages dropped whenever the budget is spent."""
        if isinstance(idx, slice):
            lo, hi, step = idx.indices(len(self._view))
            if step == 1:
                return self._pager.read(self._view, slice(lo, max(lo, hi)))
            idx = np.arange(lo, hi, step)
        return self._pager.read(self._view, np.asarray(idx))


class _Pager:
    """Copies rows out of one mapping; with a ``budget``, keeps the pages those copies map
    into the process below about twice that many bytes.

    Without a budget (None) nothing is dropped: the mapping's pages are clean copies of the
    file, which the kernel takes back under memory pressure (and faults in again on the next
    read), so the data never needs the party's memory to fit, but the process's resident set
    counts whatever the kernel leaves mapped.

    With a budget, rows are copied a piece at a time and the process's resident file pages
    (``RssFile``) are read after each piece; once they grew by ``budget`` since the last drop,
    the mapping's pages are dropped. How much a read fault maps is the kernel's choice (the
    faulting page and its cached neighbours, or a whole large folio of the page cache: up to
    2 MiB a row), so the pieces shrink to ``budget`` divided by the most bytes a row was seen
    to map. Invariant: at most about ``2 * budget`` bytes of the mapping are resident (one
    budget before a drop, one piece after it). Thread-safe: the compute lane and an
    evaluation may gather from the same file."""

    def __init__(self, mapping: _Mapping, budget: int | None) -> None:
        if budget is not None and budget < 1:
            raise ValueError(f"the page budget must be >= 1 byte, got {budget}")
        self.mapping, self.budget = mapping, budget
        self._per_row = LARGEST_FAULT  # bytes one row read maps, as last seen
        self._base = _rss_file()  # resident file bytes just after the last drop
        self._lock = threading.Lock()

    def read(self, matrix: np.ndarray, idx: np.ndarray | slice) -> np.ndarray:
        """``matrix[idx]`` as a new array (see the class docstring); a slice has step 1."""
        if self.budget is None:
            return np.array(matrix[idx], copy=True)
        n = idx.stop - idx.start if isinstance(idx, slice) else len(idx)
        out = np.empty((n, *matrix.shape[1:]), matrix.dtype)
        with self._lock:
            start = 0
            while start < n:
                stop = min(n, start + max(1, self.budget // self._per_row))
                before = _rss_file()
                if isinstance(idx, slice):
                    out[start:stop] = matrix[idx.start + start : idx.start + stop]
                else:
                    out[start:stop] = matrix[idx[start:stop]]
                self._account(before, stop - start, scattered=not isinstance(idx, slice))
                start = stop
        return out

    def _account(self, before: int | None, rows: int, *, scattered: bool) -> None:
        now = _rss_file()
        if now is None or before is None or self._base is None:  # no /proc: drop every piece
            self.mapping.drop()
            return
        if scattered and rows:
            # what one row mapped in this piece; halves at most per piece, so one piece of
            # rows that happened to share pages does not make the next piece overshoot
            seen = (now - before) // rows
            self._per_row = min(LARGEST_FAULT, max(seen, self._per_row // 2, mmap.PAGESIZE))
        if self.budget is not None and now - self._base >= self.budget:
            self.mapping.drop()
            self._base = _rss_file()


def _rss_file() -> int | None:
    """This process's resident file-backed bytes (``RssFile``), or None without /proc."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class ColumnSpill:
    """The loader's features for ``rows`` rows and ``columns`` columns, column-major in a file
    mapping (see the module docstring). ``matrix`` is the ``(rows, columns)`` view the
    preprocessing writes (column ``j`` is contiguous); ``release()`` drops the pages written
    or read so far; `to_rows` makes the row-major `MappedRows` the party trains from."""

    def __init__(self, directory: str, rows: int, columns: int) -> None:
        self.directory = directory
        self._mapping = _Mapping(directory, rows * columns * 4, writable=True)
        buffer = np.frombuffer(self._mapping.map, np.float32, count=rows * columns)
        self.matrix = buffer.reshape(columns, rows).T

    def release(self) -> None:
        """Drop every page of the mapping from this process (its bytes stay in the file)."""
        self._mapping.drop()

    def to_rows(self, *, budget: int | None = None) -> MappedRows:
        """The matrix as a row-major `MappedRows` in a new file of the same folder, copied a
        block of rows at a time (this mapping's pages dropped after each block)."""
        part = self.matrix
        columns = part.shape[1]

        def fill(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as f:
                for start in range(0, len(part), _BLOCK_ROWS):
                    block = np.ascontiguousarray(part[start : start + _BLOCK_ROWS])
                    f.write(block.data)
                    self.release()

        mapping = _Mapping(self.directory, part.shape[0] * columns * 4, writable=False, fill=fill)
        return MappedRows._over(mapping, part.shape, budget)


__all__ = ["ColumnSpill", "MappedRows", "default_spill_dir"]
