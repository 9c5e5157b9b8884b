"""Labels, checked against the loss they will train.

`labels_for_loss(column, rows, loss=..., out=..., source=...)` returns the labels of ``rows``
in the dtype the loss takes, or refuses with a `DataError` naming the file, the column, an
offending row (0-based data row, header excluded) and the fix:

* ``"binary"``: every label is 0 or 1; float32.
* ``"softmax"``: every label is an integer class in ``[0, out)``; int32.
* ``"mse"``: every label is a finite number within float32's range; float32.

A missing label is refused for every loss: a row without a label cannot be trained on.
"""

from __future__ import annotations

import numpy as np

from .errors import DataError
from .table import Column

LOSSES = ("binary", "softmax", "mse")
FIX = {
    "binary": "the binary loss takes 0 and 1: encode the positive class as 1, the other as 0",
    "softmax": "re-encode the classes as 0, 1, ..., model.out - 1",
    "mse": "the mse loss takes finite numbers: correct or remove the row",
}


def labels_for_loss(
    column: Column, rows: np.ndarray, *, loss: str, out: int | None = None, source: str
) -> np.ndarray:
    """The labels of data rows ``rows`` of ``column``, checked against ``loss`` (see above)."""
    if loss not in LOSSES:
        raise DataError(f"unknown loss {loss!r} for the labels; choose one of {list(LOSSES)}")
    where = f"{source!r}: label column {column.name!r}"
    if column.missing is not None:
        missing = column.missing[rows]
        if missing.any():
            row = int(rows[np.argmax(missing)])
            raise DataError(
                f"{where} has no value at row {row}; every training row needs a label: fill it "
                "in or remove the row"
            )
    if column.kind == "string":
        example = f" (row {int(rows[0])}: {column.values[rows[0]]!r})" if len(rows) else ""
        raise DataError(f"{where} holds text{example}; labels are numbers: {FIX[loss]}")
    values = column.values[rows]
    if loss == "binary":
        _refuse(where, rows, values, (values != 0) & (values != 1), FIX[loss])
        return values.astype(np.float32)
    if loss == "softmax":
        if out is None or out < 2:
            raise DataError(
                f"{where}: the softmax loss needs the number of classes (model.out >= 2), "
                f"got {out!r}"
            )
        whole = np.isfinite(values) & (values == np.round(values))
        bad = ~whole | (values < 0) | (values >= out)
        fix = f"class indices 0 to {out - 1} (model.out = {out}): {FIX[loss]}, or raise model.out"
        _refuse(where, rows, values, bad, f"the softmax loss takes {fix}")
        return values.astype(np.int32)
    _refuse(where, rows, values, ~np.isfinite(values), FIX[loss])
    too_large = np.abs(values) > np.finfo(np.float32).max  # float32 would make it infinite
    _refuse(where, rows, values, too_large, f"labels are float32 (at most ±3.4e38): {FIX[loss]}")
    return values.astype(np.float32)


def _refuse(where: str, rows: np.ndarray, values: np.ndarray, bad: np.ndarray, fix: str) -> None:
    if bad.any():
        k = int(np.argmax(bad))
        raise DataError(f"{where} holds {values[k].item()!r} at row {int(rows[k])}; {fix}")


__all__ = ["LOSSES", "labels_for_loss"]
