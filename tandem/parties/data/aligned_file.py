"""The aligned-rows file: what `tandem align --out` writes and what training and prediction read.

Format: a UTF-8 CSV with the header ``row,id``, then one line per id of the intersection in
the agreed order; ``row`` is the 0-based data row of that id in the party's own id file
(header excluded). Both parties' files list the same ids in the same order, so row ``i`` of one
party's aligned data and row ``i`` of the other's are the same sample.

`AlignedRows.spec_fields` gives the ``{"size", "commitment"}`` a task spec records; the
commitment is computed from the ids exactly as the PSI computes it, so a file edited by hand no
longer matches its peer's.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .canonical_ids import canonical, commitment
from .errors import AlignedFileError

HEADER = ["row", "id"]


@dataclasses.dataclass(frozen=True)
class AlignedRows:
    """The rows (int64, in the agreed order) and ids of an aligned-rows file."""

    rows: np.ndarray
    ids: list[str]

    def spec_fields(self) -> dict[str, Any]:
        return {"size": len(self.ids), "commitment": commitment(canonical(i) for i in self.ids)}


def write_aligned(path: str | os.PathLike, rows: Sequence[int], ids: Sequence[object]) -> None:
    """Write ``rows``/``ids`` (same length, agreed order) in the format above."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(HEADER)
        for row, value in zip(list(rows), ids, strict=True):
            w.writerow([int(row), value])


def read_aligned(path: str | os.PathLike) -> AlignedRows:
    """Read an aligned-rows file; raises `AlignedFileError` naming the file and the problem
    (missing, wrong header, malformed line, negative row)."""
    if not os.path.isfile(path):
        raise AlignedFileError(
            f"{os.fspath(path)!r}: no such file (write it with `tandem align --out`)"
        )
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header != HEADER:
            raise AlignedFileError(
                f"{os.fspath(path)!r} must be the `tandem align --out` CSV "
                f"(header row,id), got header {header}"
            )
        pairs = list(reader)
    try:
        rows = np.asarray([int(r[0]) for r in pairs], np.int64)
        ids = [r[1] for r in pairs]
    except (ValueError, IndexError, OverflowError):  # OverflowError: beyond int64
        raise AlignedFileError(
            f"{os.fspath(path)!r} has a malformed line (expected row,id with an integer row)"
        ) from None
    if len(rows) and rows.min() < 0:
        raise AlignedFileError(f"{os.fspath(path)!r} has a negative row index")
    return AlignedRows(rows, ids)


__all__ = ["AlignedRows", "read_aligned", "write_aligned"]
