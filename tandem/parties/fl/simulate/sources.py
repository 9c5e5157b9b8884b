"""Where a virtual client's data comes from: built when the client is sampled, dropped after.

A `ClientSource` names ``len(source)`` clients and builds client ``i``'s ``(x, y)`` on demand
(`load`); the simulator calls `load` only for the clients of the round under way, so at most
``per_round`` clients' rows are in memory beside what the source itself keeps:

* `TablePartition`: one table split over the clients by a seeded Dirichlet split over the
  label (`tandem.parties.fl.data.dirichlet_split`). It keeps the table once and one index
  array per client (8 bytes per row in all); `load` copies the client's rows out.
* `FilePerClient`: one file per client (a glob, sorted, so client ``i`` is the ``i``-th
  path); `load` reads the file. It keeps only the paths.

Invariant: ``load(i)`` returns the same arrays every time it is called (it is pure), which is
what makes a simulated run equal to one with real, long-lived clients.
"""

from __future__ import annotations

import glob as globlib
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from tandem.errors import ConfigError

from ..data import dirichlet_split


@runtime_checkable
class ClientSource(Protocol):
    """``len(source)`` virtual clients; ``load(i)`` builds client ``i``'s (x float32, y)."""

    def __len__(self) -> int: ...

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...


class TablePartition:
    """Rows ``x`` (n, features) and labels ``y`` (n,) split over ``clients`` clients by a
    Dirichlet(``alpha``) split of each label's rows, drawn from ``seed``; every client gets at
    least ``min_size`` rows (else `ConfigError`: raise alpha or use fewer clients).
    ``parts`` gives the split instead (one index array per client)."""

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        clients: int = 0,
        *,
        alpha: float = 0.5,
        seed: int = 0,
        min_size: int = 1,
        parts: Sequence[np.ndarray] | None = None,
    ) -> None:
        if x.ndim != 2 or y.shape != (x.shape[0],):
            raise ConfigError(
                f"a table partition needs x (rows, features) and y (rows,), got {x.shape} "
                f"and {y.shape}"
            )
        self.x, self.y = np.asarray(x, np.float32), np.asarray(y)
        if parts is None:
            parts = dirichlet_split(
                self.y, clients, alpha, np.random.default_rng(seed), min_size=min_size
            )
        self.parts = [np.asarray(p, np.int64) for p in parts]

    def __len__(self) -> int:
        return len(self.parts)

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        rows = self.parts[i]
        return self.x[rows], self.y[rows]


class FilePerClient:
    """One table file per client: the files matching ``pattern`` (sorted), each read with
    `tandem.parties.data.table.read_table`; ``label`` is the label column, every other
    numeric column except ``drop`` (e.g. the id column) is a feature, in file order."""

    def __init__(self, pattern: str, label: str, *, drop: Sequence[str] = ("id",)) -> None:
        self.paths = sorted(globlib.glob(pattern))
        if not self.paths:
            raise ConfigError(
                f"--clients-glob {pattern!r} matches no file; give a pattern such as "
                "'data/client_*.csv'"
            )
        self.label, self.drop = label, tuple(drop)

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        from tandem.parties.data.table import read_table

        table = read_table(self.paths[i])
        names = [n for n in table.available if n != self.label and n not in self.drop]
        numeric = [n for n in names if table.kind(n) in ("int", "float")]
        if len(numeric) != len(names):
            bad = sorted(set(names) - set(numeric))
            raise ConfigError(
                f"{self.paths[i]!r}: columns {bad} are not numeric; a simulated client's "
                "features must be numbers (drop them from the file)"
            )
        x = np.stack([np.asarray(table[n].values, np.float32) for n in numeric], axis=1)
        return x, np.asarray(table[self.label].values)


__all__ = ["ClientSource", "FilePerClient", "TablePartition"]
