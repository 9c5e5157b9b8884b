"""Seeded batch sampling shared by every role (pure numpy)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np

from tandem.errors import ConfigError


def epoch_batches(
    n_rows: int,
    batch_size: int,
    epoch: int,
    seed: int,
    *,
    shuffle: bool = True,
    drop_last: bool = False,
) -> list[np.ndarray]:
    """Row indices of each batch of ``epoch``: a permutation seeded by ``(seed, epoch)``."""
    if n_rows < 1:
        raise ConfigError("the training set is empty")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    order = (
        np.random.default_rng([seed, epoch]).permutation(n_rows) if shuffle else np.arange(n_rows)
    )
    stops = range(batch_size, n_rows + (0 if drop_last else batch_size), batch_size)
    return [order[i - batch_size : min(i, n_rows)] for i in stops if i - batch_size < n_rows]


@runtime_checkable
class RowSource(Protocol):
    """A matrix that is not an array in memory (e.g. one in a file mapping): it has a length
    and a shape and hands out copies of rows by index. ``gather(idx)`` equals
    ``np.asarray(source)[idx]`` for an index array or a slice."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __len__(self) -> int: ...

    def gather(self, idx: np.ndarray | slice) -> np.ndarray: ...


class BatchRows:
    """Rows ``idx`` of ``data``, gathered one slice at a time: ``rows[lo:hi]`` is
    ``data[idx[lo:hi]]`` (a view of an array when those indices are consecutive; always a
    copy from a `RowSource`, through its ``gather``).

    A party binds a batch's features this way so the gather happens per micro-batch, in the op
    that reads it (on the compute lane), instead of copying the whole batch on the event loop's
    thread before the batch can start. What a slice costs is settled once, when the batch is
    bound: the kind of ``data`` (a `RowSource` check is a runtime Protocol check, microseconds
    each) and the runs of consecutive indices (``_breaks[i]`` counts the breaks among
    ``idx[:i + 1]``, so ``idx[lo:hi]`` is one run iff ``_breaks[hi - 1] == _breaks[lo]``).
    """

    __slots__ = ("data", "idx", "_take", "_breaks")

    def __init__(self, data: np.ndarray | RowSource, idx: np.ndarray) -> None:
        self.data, self.idx = data, np.asarray(idx)
        self._take: Callable[[np.ndarray | slice], np.ndarray] = (
            data.gather if isinstance(data, RowSource) else data.__getitem__
        )
        steps = np.diff(self.idx) != 1 if len(self.idx) else np.zeros(0, bool)
        self._breaks = np.concatenate(([0], np.cumsum(steps)))

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice):
            raise TypeError("BatchRows takes a slice of the batch's rows")
        lo, hi, step = rows.indices(len(self.idx))
        if step == 1 and hi > lo and self._breaks[hi - 1] == self._breaks[lo]:
            first = int(self.idx[lo])
            return self._take(slice(first, first + hi - lo))
        return self._take(self.idx[rows])
