"""Labels are checked against the loss; a bad label names the file, the column, the row and
the fix."""

import numpy as np
import pytest

from tandem.parties.data import Column, DataError, labels_for_loss

SOURCE = "memory://bank/labels.csv"


def check(values, loss, out=None, missing=None, rows=None):
    values = np.asarray(values)
    kind = {"i": "int", "f": "float"}.get(values.dtype.kind, "string")
    if kind == "string":
        values = values.astype(object)
    col = Column("churned", kind, values, None if missing is None else np.asarray(missing, bool))
    rows = np.arange(len(values)) if rows is None else np.asarray(rows)
    return labels_for_loss(col, rows, loss=loss, out=out, source=SOURCE)


def refused(*args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        check(*args, **kwargs)
    msg = str(info.value)
    assert SOURCE in msg and "'churned'" in msg
    return msg


def test_accepted_labels_and_their_dtypes():
    y = check([0, 1, 1], "binary")
    assert y.dtype == np.float32 and y.tolist() == [0, 1, 1]
    assert check([1.0, 0.0], "binary").tolist() == [1, 0]
    y = check([0, 2, 1], "softmax", out=3)
    assert y.dtype == np.int32 and y.tolist() == [0, 2, 1]
    y = check([0.5, -2.0], "mse")
    assert y.dtype == np.float32 and y.tolist() == [0.5, -2.0]
    assert check([5, 0, 1], "binary", rows=[2, 1]).tolist() == [1, 0]  # only these rows


def test_binary_takes_zero_and_one():
    msg = refused([0, 1, 2, 1], "binary")
    assert "row 2" in msg and "2" in msg and "positive class as 1" in msg


def test_binary_refuses_text_labels():
    msg = refused(["yes", "no"], "binary")
    assert "'yes'" in msg and "positive class as 1" in msg


def test_softmax_takes_class_indices_below_out():
    msg = refused([0, 3, 1], "softmax", out=3)
    assert "row 1" in msg and "0 to 2" in msg and "model.out" in msg
    msg = refused([0, -1], "softmax", out=3)
    assert "row 1" in msg
    msg = refused([0.0, 1.5], "softmax", out=3)
    assert "1.5" in msg and "row 1" in msg


def test_softmax_needs_the_class_count():
    msg = refused([0, 1], "softmax")
    assert "model.out" in msg


def test_mse_takes_finite_numbers():
    msg = refused([0.5, np.inf], "mse")
    assert "row 1" in msg and "finite" in msg


def test_mse_refuses_labels_beyond_float32_instead_of_infinity():
    msg = refused([0.5, 1e39], "mse")
    assert "row 1" in msg and "float32" in msg


def test_a_missing_label_is_refused_for_every_loss():
    for loss in ("binary", "softmax", "mse"):
        msg = refused([0, 0, 1], loss, out=2, missing=[False, True, False])
        assert "row 1" in msg and "needs a label" in msg


def test_an_unknown_loss():
    with pytest.raises(DataError) as info:
        check([0, 1], "hinge")
    assert "'binary', 'softmax', 'mse'" in str(info.value)
