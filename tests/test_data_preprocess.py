"""Preprocessing: feature selection, categorical codes, missing values, scaling; the state
round-trips through JSON and applies to new rows exactly as to the training rows."""

import json

import numpy as np
import pytest

from tandem.parties.data import (
    Column,
    DataError,
    Preprocessing,
    Table,
    feature_columns,
    fit,
    parse_data_config,
)

SOURCE = "memory://bank/customers.csv"


def column(name, values, missing=None):
    values = np.asarray(values)
    if values.dtype.kind in "US":
        kind, values = "string", values.astype(object)
    elif values.dtype.kind == "f":
        kind = "float"
        missing = np.isnan(values) if np.isnan(values).any() else None
    else:
        kind, values = "int", values.astype(np.int64)
    mask = None if missing is None else np.asarray(missing, bool)
    return Column(name, kind, values, mask)


def table(source=SOURCE, **columns):
    cols = {n: c if isinstance(c, Column) else column(n, c) for n, c in columns.items()}
    rows = len(next(iter(cols.values())).values)
    return Table(source, cols, tuple(cols), rows)


def config(**keys):
    return parse_data_config({"source": SOURCE, **keys})


def customers():
    return table(
        id=["a", "b", "c", "d", "e", "f"],
        age=[30, 40, 50, 60, 70, 80],
        income=[1.0, 2.0, 2.0, 4.0, 5.0, np.nan],
        city=["Paris", "Rome", "Paris", "Oslo", "Lima", "Rome"],
        branch=[3, 1, 3, 2, 9, 7],
        y=[0, 1, 0, 1, 1, 0],
    )


def fitted(**keys):
    keys = {"id_column": "id", "label_column": "y", "categorical": ["city", "branch"], **keys}
    return fit(customers(), config(**keys), np.arange(4))


def test_default_features_are_every_column_but_id_and_label():
    numeric, categorical = feature_columns(
        customers(), config(id_column="id", label_column="y", categorical=["city"])
    )
    assert numeric == ("age", "income", "branch") and categorical == ("city",)


def test_listed_features_keep_their_order():
    cfg = config(features=["city", "income"], categorical=["city"])
    assert feature_columns(customers(), cfg) == (("income",), ("city",))


def test_standard_scaling_is_fitted_on_the_training_rows_only():
    state = fitted(missing="mean")
    train_age = np.array([30, 40, 50, 60], float)
    assert state.mean[0] == train_age.mean() and state.std[0] == train_age.std()
    f = state.transform(customers())
    expected = (np.array([30, 40, 50, 60, 70, 80]) - train_age.mean()) / train_age.std()
    np.testing.assert_allclose(f.numeric[:, 0], expected, rtol=1e-6)
    assert f.numeric.dtype == np.float32 and f.numeric.flags.c_contiguous
    assert f.categorical.dtype == np.int32 and f.categorical.shape == (6, 2)


def test_scale_none_keeps_the_values():
    state = fitted(scale="none", missing="zero")
    f = state.transform(customers())
    np.testing.assert_array_equal(f.numeric[:, 0], [30, 40, 50, 60, 70, 80])
    np.testing.assert_array_equal(f.numeric[:, 1], [1, 2, 2, 4, 5, 0])


def test_a_constant_column_is_divided_by_one():
    t = table(id=["a", "b", "c"], k=[5.0, 5.0, 5.0])
    state = fit(t, config(id_column="id"), np.arange(3))
    assert state.std == (1.0,)
    np.testing.assert_array_equal(state.transform(t).numeric[:, 0], [0, 0, 0])


def test_categorical_codes_come_from_the_training_rows():
    state = fitted(missing="mean")
    city, branch = state.vocabularies
    assert city.kind == "string" and city.values == ("Oslo", "Paris", "Rome")
    assert branch.kind == "int" and branch.values == (1, 2, 3) and branch.size == 4
    codes = state.transform(customers()).categorical
    # Lima (row 4) and branches 9, 7 (rows 4, 5) were not in the training rows: code 0.
    np.testing.assert_array_equal(codes[:, 0], [2, 3, 2, 1, 0, 3])
    np.testing.assert_array_equal(codes[:, 1], [3, 1, 3, 2, 0, 0])


def test_unseen_and_missing_categories_get_the_reserved_code():
    train = table(id=["a", "b"], city=column("city", ["x", "y"]))
    state = fit(train, config(id_column="id", categorical=["city"], missing="zero"), np.arange(2))
    new = table(id=["c", "d", "e"], city=column("city", ["y", "never", ""], [0, 0, 1]))
    np.testing.assert_array_equal(state.transform(new).categorical[:, 0], [2, 0, 0])


def test_integer_and_text_categories_meet_as_text():
    state = fit(
        table(id=["a", "b"], code=[10, 20]),
        config(id_column="id", categorical=["code"]),
        np.arange(2),
    )
    as_text = table(id=["c", "d", "e"], code=["20", "10", "x"])
    np.testing.assert_array_equal(state.transform(as_text).categorical[:, 0], [2, 1, 0])


def test_whole_floats_may_be_categorical_fractions_may_not():
    t = table(id=["a", "b", "c"], code=[1.0, 2.0, np.nan])
    state = fit(t, config(id_column="id", categorical=["code"], missing="zero"), np.arange(3))
    np.testing.assert_array_equal(state.transform(t).categorical[:, 0], [1, 2, 0])
    frac = table(id=["a", "b"], code=[1.0, 2.5])
    with pytest.raises(DataError) as info:
        fit(frac, config(id_column="id", categorical=["code"]), np.arange(2))
    msg = str(info.value)
    assert SOURCE in msg and "'code'" in msg and "remove it from data.categorical" in msg


def test_categories_too_large_for_an_exact_float_are_refused_not_merged():
    # A CSV integer beyond 64 bits is read as a float: 2**64 + 1 and 2**64 + 2 are one float.
    t = table(id=["a", "b", "c"], code=[float(2**64 + 1), float(2**64 + 2), 5.0])
    with pytest.raises(DataError) as info:
        fit(t, config(id_column="id", categorical=["code"]), np.arange(3))
    msg = str(info.value)
    assert SOURCE in msg and "'code'" in msg and "row 0" in msg and "text" in msg


def test_missing_mean_fills_the_training_mean_before_scaling():
    state = fitted(missing="mean", scale="none")
    assert state.fill[1] == np.mean([1.0, 2.0, 2.0, 4.0])
    np.testing.assert_allclose(state.transform(customers()).numeric[5, 1], 2.25)


def test_missing_zero_fills_zero_before_scaling():
    t = table(id=["a", "b", "c"], v=[2.0, np.nan, 4.0])
    state = fit(t, config(id_column="id", missing="zero"), np.arange(3))
    assert state.fill == (0.0,) and state.mean == (2.0,)
    np.testing.assert_allclose(
        state.transform(t).numeric[:, 0] * state.std[0], [0, -2, 2], rtol=1e-6
    )


def test_missing_error_names_the_file_the_row_and_the_column():
    with pytest.raises(DataError) as info:
        fit(customers(), config(id_column="id", categorical=["city"]), np.arange(6))
    msg = str(info.value)
    assert SOURCE in msg and "'income'" in msg and "row 5" in msg
    assert 'data.missing = "mean"' in msg


def test_missing_error_at_transform_names_the_data_row():
    state = fitted()  # the training rows 0..3 have no missing value
    with pytest.raises(DataError) as info:
        state.transform(customers(), np.array([1, 5, 2]))
    assert SOURCE in str(info.value) and "'income'" in str(info.value)
    assert "row 5" in str(info.value)


def test_missing_error_for_a_categorical_cell():
    t = table(id=["a", "b"], city=column("city", ["x", ""], [0, 1]))
    with pytest.raises(DataError) as info:
        fit(t, config(id_column="id", categorical=["city"]), np.arange(2))
    msg = str(info.value)
    assert SOURCE in msg and "'city'" in msg and "row 1" in msg and "data.missing" in msg


def test_a_column_without_any_training_value_has_no_mean():
    t = table(id=["a", "b", "c"], v=[np.nan, np.nan, 1.0])
    with pytest.raises(DataError) as info:
        fit(t, config(id_column="id", missing="mean"), np.arange(2))
    msg = str(info.value)
    assert SOURCE in msg and "'v'" in msg and "leave it out of data.features" in msg


def test_text_not_declared_categorical_is_refused_naming_the_fix():
    t = table(id=["a", "b", "c"], amount=["1.5", "2", "n/a "])
    with pytest.raises(DataError) as info:
        fit(t, config(id_column="id"), np.arange(3))
    msg = str(info.value)
    assert SOURCE in msg and "'amount'" in msg and "row 2: 'n/a '" in msg
    assert "add it to data.categorical" in msg


def test_non_finite_features_are_refused():
    t = table(id=["a", "b"], v=[1.0, np.inf])
    state = fit(t, config(id_column="id"), np.arange(1))
    with pytest.raises(DataError) as info:
        state.transform(t)
    msg = str(info.value)
    assert SOURCE in msg and "'v'" in msg and "row 1" in msg and "finite" in msg
    with pytest.raises(DataError) as info:  # in a training row, before any statistics
        fit(t, config(id_column="id", missing="mean"), np.arange(2))
    assert SOURCE in str(info.value) and "row 1" in str(info.value)


def test_values_beyond_float32_are_refused_not_turned_into_infinity():
    t = table(id=["a", "b"], v=[1.0, 1e39])
    with pytest.raises(DataError) as info:  # scale = "none": 1e39 itself is the feature
        fit(t, config(id_column="id", scale="none"), np.arange(2)).transform(t)
    msg = str(info.value)
    assert SOURCE in msg and "'v'" in msg and "row 1" in msg and "float32" in msg
    state = fit(table(id=["a", "b"], v=[1.0, 2.0]), config(id_column="id"), np.arange(2))
    with pytest.raises(DataError) as info:  # a new row far outside the training range
        state.transform(t)
    assert "row 1" in str(info.value) and "float32" in str(info.value)


def test_unknown_columns_list_the_available_ones():
    cfg = config(id_column="id", features=["age", "salary"])
    with pytest.raises(DataError) as info:
        fit(customers(), cfg, np.arange(4))
    msg = str(info.value)
    assert SOURCE in msg and "'salary'" in msg and "'income'" in msg and "data.features" in msg


def test_an_unknown_id_column():
    with pytest.raises(DataError) as info:
        feature_columns(customers(), config(id_column="customer_id"))
    assert "'customer_id'" in str(info.value) and "data.id_column" in str(info.value)


def test_no_training_rows():
    with pytest.raises(DataError) as info:
        fit(customers(), config(id_column="id", label_column="y"), np.arange(0))
    assert SOURCE in str(info.value) and "data.split.test" in str(info.value)


def test_state_round_trips_through_json():
    state = fitted(missing="mean")
    text = json.dumps(state.to_json())
    again = Preprocessing.from_json(json.loads(text))
    assert again == state
    a, b = state.transform(customers()), again.transform(customers())
    np.testing.assert_array_equal(a.numeric, b.numeric)
    np.testing.assert_array_equal(a.categorical, b.categorical)


def test_transform_of_new_rows_equals_the_fitted_transform():
    state = fitted(missing="mean")
    whole = state.transform(customers())
    rows = np.array([5, 0, 3])
    part = state.transform(customers(), rows)
    np.testing.assert_array_equal(part.numeric, whole.numeric[rows])
    np.testing.assert_array_equal(part.categorical, whole.categorical[rows])
    # New data: the same rows in another file, another order, without id and label.
    t = customers()
    new = table(
        source="memory://bank/new.csv", **{n: t[n] for n in ("branch", "city", "income", "age")}
    )
    again = Preprocessing.from_json(json.loads(json.dumps(state.to_json())))
    f = again.transform(new)
    np.testing.assert_array_equal(f.numeric, whole.numeric)
    np.testing.assert_array_equal(f.categorical, whole.categorical)


def test_transform_refuses_a_table_without_a_fitted_column():
    state = fitted(missing="mean")
    t = customers()
    new = table(source="memory://bank/new.csv", **{n: t[n] for n in ("id", "age", "city")})
    with pytest.raises(DataError) as info:
        state.transform(new)
    msg = str(info.value)
    assert "new.csv" in msg and "'income'" in msg and "same columns" in msg


def test_transform_refuses_extra_columns_when_the_features_were_not_listed():
    state = fitted(missing="mean")
    new = table(source="memory://bank/new.csv", **customers().columns, extra=[0] * 6)
    with pytest.raises(DataError) as info:
        state.transform(new)
    msg = str(info.value)
    assert "new.csv" in msg and "'extra'" in msg and "data.features" in msg
    listed = fitted(missing="mean", features=["age", "income", "city", "branch"])
    assert listed.transform(new).numeric.shape == (6, 2)


def test_transform_refuses_text_in_a_numeric_column():
    state = fitted(missing="mean")
    t = customers()
    cols = dict(t.columns, age=column("age", ["30", "forty", "50", "60", "70", "80"]))
    with pytest.raises(DataError) as info:
        state.transform(table(source="memory://bank/new.csv", **cols))
    msg = str(info.value)
    assert "new.csv" in msg and "'age'" in msg and "'forty'" in msg


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(format=2),
        lambda d: d.update(missing="drop"),
        lambda d: d["categorical"][0].update(vocabulary=["b", "a"]),
        lambda d: d["numeric"][0].pop("mean"),
    ],
)
def test_a_malformed_state_is_refused(edit):
    data = fitted(missing="mean").to_json()
    edit(data)
    with pytest.raises(DataError) as info:
        Preprocessing.from_json(data)
    assert "preprocessing state" in str(info.value)


def test_transform_counts_filled_cells_and_unseen_categories_per_column():
    """Rows 4-5 (not fitted on): Lima is unseen in city, branch 9 and 7 in branch; income's
    NaN at row 5 is filled in. Columns with nothing to count are left out."""
    state = fitted(missing="mean")
    features, counts = state.transform_counted(customers())
    assert counts == {
        "income": {"missing": 1, "unseen": 0},
        "city": {"missing": 0, "unseen": 1},
        "branch": {"missing": 0, "unseen": 2},
    }
    np.testing.assert_array_equal(features.numeric, state.transform(customers()).numeric)
    _, none = state.transform_counted(customers(), np.arange(4))
    assert none == {}


def test_errors_on_new_rows_advise_a_change_of_the_data_not_of_the_saved_state():
    """Under a saved state (prediction) ``data.missing`` is the export's: the advice is to
    fix the rows; while fitting, changing the key is the advice."""
    state = fitted(missing="error", features=["age", "income", "city", "branch"])
    gap = customers()
    with pytest.raises(DataError, match='set data.missing = "mean"'):
        state.transform_counted(gap, np.arange(6))
    with pytest.raises(DataError, match="fill the value in or remove the row") as info:
        state.transform_counted(gap, np.arange(6), saved=True)
    assert "set data.missing" not in str(info.value)
    text = table(age=["x", "40"], income=[1.0, 2.0], city=["Rome", "Oslo"], branch=[1, 2])
    with pytest.raises(DataError, match="correct the value") as info:
        state.transform_counted(text, saved=True)
    assert "data.categorical" not in str(info.value)
