"""Seeded batch sampling shared by every role (pure numpy)."""

from __future__ import annotations

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
    thread before the batch can start.
    """

    __slots__ = ("data", "idx")

    def __init__(self, data: np.ndarray | RowSource, idx: np.ndarray) -> None:
        self.data, self.idx = data, np.asarray(idx)

    def __len__(self) -> int:
        return len(self.idx)

    def __getitem__(self, rows: slice) -> np.ndarray:
        if not isinstance(rows, slice):
            raise TypeError("BatchRows takes a slice of the batch's rows")
        part = self.idx[rows]
        if len(part) and part[-1] - part[0] == len(part) - 1 and np.all(np.diff(part) == 1):
            run = slice(int(part[0]), int(part[-1]) + 1)
            return self.data.gather(run) if isinstance(self.data, RowSource) else self.data[run]
        return self.data.gather(part) if isinstance(self.data, RowSource) else self.data[part]
