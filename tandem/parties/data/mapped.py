"""Feature matrices kept in a file instead of the process's memory (``[data] in_memory = false``).

A party's packed float32 features (`Features.packed`) can be the largest thing it holds. With
``in_memory = false`` the loader writes them to a file in ``spill_dir`` and the party reads
them back through a read-only shared mapping of that file:

* `ColumnSpill` is the loader's output buffer: a column-major ``(columns, rows)`` mapping, so
  the preprocessing (a column at a time) writes one contiguous range per column and
  `ColumnSpill.release` drops that range from the process once it is written. `to_rows` then
  copies it, a block of rows at a time, into the row-major file the party trains from.
* `MappedRows` is the party's view of that row-major file: ``gather(idx)`` copies rows out
  (the micro-batch gather) through the mapping, one window of the file at a time
  (`GATHER_WINDOW` bytes, in file order), and drops each window's pages from the process as
  soon as its rows are copied. A page fault maps whatever the kernel maps around the row (its
  fault-around block, or a whole large folio of the page cache), so a random batch gathered in
  one go would map most of the file; one window at a time, the file's pages the process holds
  never exceed about one window, whatever the file's size, and a file larger than the memory
  is read back from the disk as needed. The mapping keeps the kernel's default advice, not
  ``MADV_RANDOM``: under that advice the kernel does not count a dropped page's accesses
  (its recency), so the features the party reads all the time look cold to the page cache's
  reclaim and are the first pages it evicts, to be read back from the disk at the next
  gather; and the default advice stops reading around a fault by itself once most faults
  miss (random reads of a file larger than memory). Copying through the mapping costs a
  page fault per row (well under a microsecond when the file is in the page cache), against
  a system call plus the interpreter's dispatch per row for positioned reads. `to_rows`
  writes the file in whole 2 MiB pieces, so a file system with large folios (ext4 and XFS on
  recent Linux) caches it in 2 MiB folios, and one fault maps a whole 2 MiB block (one
  page-table entry) instead of a page per row plus its fault-around: a 2048-row gather from
  a 360 MB file faults about 200 times, not 2048, and costs about half as much.

Invariants: the process's resident pages of the loader's mapping stay below one column
(`ColumnSpill`), and the gather holds at most about one window of the row-major file's pages
at a time and none once it returns, whatever the file's size; the bytes are exactly those the
in-memory path holds (same layout, dtype and row order), so training and the data fingerprint
do not depend on the option. The files are unlinked as
soon as they are created and mapped (POSIX): nothing is left in ``spill_dir`` after an exit, a
crash or a kill; where a mapped file cannot be unlinked (Windows) it is removed when its
mapping is closed or collected.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import tempfile
import weakref
from typing import Any

import numpy as np

from .errors import DataError

_BLOCK_ROWS = 1 << 16  # rows copied at a time by `ColumnSpill.to_rows`
_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
#: bytes of the row-major file `MappedRows.gather` maps at a time (module docstring); a
#: multiple of 2 MiB, the largest block a fault maps on x86-64
GATHER_WINDOW = 8 << 20
_HUGE = 2 << 20


def default_spill_dir() -> str:
    """The folder spilled features go to when ``[data] spill_dir`` is not set: the system's
    temporary folder (``TMPDIR`` where set)."""
    return tempfile.gettempdir()


class _Mapping:
    """One file (created in ``directory``, ``size`` bytes, unlinked at once where possible),
    mapped shared (its descriptor closed once mapped); ``drop(lo, hi)`` removes its pages in
    ``[lo, hi)`` from this process. The advice stays the kernel's default (module
    docstring)."""

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
    """A read-only float32 matrix ``(rows, columns)`` in a file (see the module docstring).
    ``rows(lo, hi)`` is a part of it on the same file; ``gather(idx)`` copies rows ``idx``
    out a window of the file at a time (what `tandem.engine.data.BatchRows` calls); indexing
    (``m[...]``) and ``np.asarray(m)`` give plain views of the file's mapping (for
    inspection, not for training loops: the pages they touch stay mapped)."""

    def __init__(
        self, mapping: _Mapping, array: np.ndarray, first: int = 0, count: int | None = None
    ) -> None:
        self._mapping = mapping
        self._whole = array
        self._first = first
        self._count = len(array) - first if count is None else count
        self._view = array[first : first + self._count]

    @classmethod
    def from_array(cls, array: np.ndarray, directory: str) -> MappedRows:
        """Write ``array`` (float32, 2-d) to a new file in ``directory`` and map it."""
        data = np.ascontiguousarray(array, np.float32)
        if data.ndim != 2:
            raise ValueError(f"MappedRows holds a matrix, got shape {data.shape}")

        def fill(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as f:
                f.write(data.data)

        mapping = _Mapping(directory, data.nbytes, writable=False, fill=fill)
        return cls._over(mapping, data.shape)

    @classmethod
    def _over(cls, mapping: _Mapping, shape: tuple[int, ...]) -> MappedRows:
        array = np.frombuffer(mapping.map, np.float32, count=int(np.prod(shape)))
        return cls(mapping, array.reshape(shape))

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

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, key: Any) -> np.ndarray:
        return self._view[key]

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if copy:
            return np.array(self._view, dtype=dtype)
        return self._view if dtype is None else self._view.astype(dtype, copy=False)

    def rows(self, lo: int, hi: int) -> MappedRows:
        """Rows ``[lo, hi)`` of this matrix: a `MappedRows` on the same file."""
        lo, hi = max(0, lo), min(hi, self._count)
        return MappedRows(self._mapping, self._whole, self._first + lo, max(0, hi - lo))

    def gather(self, idx: np.ndarray | slice) -> np.ndarray:
        """Rows ``idx`` (indices in ``[0, len(self))`` or a slice) as a new in-memory array,
        copied through the mapping one `GATHER_WINDOW` of the file at a time, each window's
        pages dropped once its rows are copied (module docstring). Raises IndexError for a
        row out of range, as indexing does. Thread-safe (a window another thread drops is
        faulted in again from the page cache)."""
        if isinstance(idx, slice):
            lo, hi, step = idx.indices(self._count)
            rows = np.arange(lo, hi, step)
        else:
            rows = np.asarray(idx)
            if rows.ndim != 1:
                return self._view[rows].copy()  # not a batch gather: plain indexing
            if len(rows) and (rows.min() < -self._count or rows.max() >= self._count):
                raise IndexError(f"row index out of range for {self._count} rows")
            rows = np.where(rows < 0, rows + self._count, rows)
        out = np.empty((len(rows), *self._view.shape[1:]), np.float32)
        if len(rows):
            _copy_windows(self._mapping, self._whole, self._first + rows, out)
        return out


def _copy_windows(mapping: _Mapping, whole: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
    """``out[k] = whole[rows[k]]`` for every k, in file order one `GATHER_WINDOW` at a time,
    dropping each window's pages (rounded out to 2 MiB, all a fault may have mapped) after
    its rows are copied."""
    row_bytes = whole.strides[0]
    order = np.argsort(rows, kind="stable")
    ordered = rows[order].astype(np.int64, copy=False)
    window = ordered * row_bytes // GATHER_WINDOW
    cuts = np.flatnonzero(window[1:] != window[:-1]) + 1
    for a, b in zip([0, *cuts.tolist()], [*cuts.tolist(), len(rows)], strict=True):
        part = ordered[a:b]
        out[order[a:b]] = whole[part]
        lo = int(part[0]) * row_bytes
        hi = (int(part[-1]) + 1) * row_bytes
        mapping.drop(lo - lo % _HUGE, -(-hi // _HUGE) * _HUGE)


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

    def to_rows(self) -> MappedRows:
        """The matrix as a row-major `MappedRows` in a new file of the same folder, copied a
        block of rows at a time (this mapping's pages dropped after each block) and written
        in whole 2 MiB pieces from the file's start (the last piece excepted), so the page
        cache can hold the file in 2 MiB folios, which a gather's fault maps whole (module
        docstring)."""
        part = self.matrix
        columns = part.shape[1]

        def fill(fd: int) -> None:
            with os.fdopen(os.dup(fd), "wb") as f:
                pending = bytearray()  # bytes after the last 2 MiB boundary written
                for start in range(0, len(part), _BLOCK_ROWS):
                    block = np.ascontiguousarray(part[start : start + _BLOCK_ROWS])
                    self.release()
                    view = block.data.cast("B")
                    if pending:
                        take = _HUGE - len(pending)
                        pending += view[:take]
                        view = view[take:]
                        if len(pending) < _HUGE:
                            continue
                        f.write(pending)
                        pending.clear()
                    whole = len(view) - len(view) % _HUGE
                    f.write(view[:whole])
                    pending += view[whole:]
                f.write(pending)

        mapping = _Mapping(self.directory, part.shape[0] * columns * 4, writable=False, fill=fill)
        return MappedRows._over(mapping, part.shape)


__all__ = ["ColumnSpill", "MappedRows", "default_spill_dir"]
