"""Parquet read a column at a time by record batches: the same ids, arrays, fingerprint and
errors as the same data in one row group or as CSV; ids held as UTF-8 bytes (`IdText`); the
split party's layout (sorted by id, grouped by part, one packed matrix) equals the one built
from the dataset by hand."""

import numpy as np
import pytest

from tandem.parties.data import (
    DataError,
    fingerprint,
    load_new_data,
    load_party_data,
    parse_data_config,
)
from tandem.parties.data import columns as columns_module
from tandem.parties.data import table as table_module
from tandem.parties.data.canonical_ids import canonical, commitment
from tandem.parties.data.ids import id_hashes
from tandem.parties.data.idtext import IdText, IdTextBuilder
from tandem.parties.split.process.party_data import id_commitment, load_table_data

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pacsv = pytest.importorskip("pyarrow.csv")

CATEGORICAL = ["c_int", "c_str"]


def sample_table(n=1000, seed=0, nulls=None):
    """An id column (some ids not ASCII), a label, a float, an int, an int and a text
    categorical column; ``nulls`` maps a column to the rows left empty."""
    rng = np.random.default_rng(seed)
    ids = [f"r{i:05d}" if i % 7 else f"ré-{i}" for i in rng.permutation(n)]
    columns = {
        "id": ids,
        "label": rng.integers(0, 2, n).tolist(),
        "d_float": (rng.standard_normal(n) * 3 + 1).tolist(),
        "d_int": rng.integers(-50, 50, n).tolist(),
        "c_int": (rng.zipf(1.5, n) % 40).tolist(),
        "c_str": [f"v{k}" for k in rng.zipf(1.5, n) % 30],
    }
    for name, rows in (nulls or {}).items():
        for row in rows:
            columns[name][row] = None
    return pa.table(columns)


def write(tmp_path, table, name, *, row_group=None):
    """``table`` as ``name.parquet`` (row groups of ``row_group`` rows) or ``name.csv``."""
    if row_group is None:
        path = tmp_path / f"{name}.csv"
        pacsv.write_csv(table, path)
    else:
        path = tmp_path / f"{name}.parquet"
        pq.write_table(table, path, row_group_size=row_group)
    return str(path)


def config(source, **keys):
    data = {
        "source": source,
        "id_column": "id",
        "label_column": "label",
        "categorical": CATEGORICAL,
        "split": {"test": 0.2, "validation": 0.1, "seed": 3},
        **keys,
    }
    return parse_data_config(data)


def assert_same_dataset(a, b):
    np.testing.assert_array_equal(a.ids, b.ids)
    np.testing.assert_array_equal(a.rows, b.rows)
    for field in ("numeric", "categorical"):
        x, y = getattr(a.features, field), getattr(b.features, field)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(a.labels, b.labels)
    for part in ("train", "validation", "test"):
        np.testing.assert_array_equal(getattr(a.split, part), getattr(b.split, part))
    assert a.preprocessing == b.preprocessing
    assert a.fingerprint == b.fingerprint


@pytest.fixture
def small_chunks(monkeypatch):
    """Record batches and transform chunks far smaller than the row groups and not aligned
    with them, so every boundary case is crossed."""
    monkeypatch.setattr(table_module, "_BATCH_ROWS", 100)
    monkeypatch.setattr(columns_module, "ROWS", 77)
    monkeypatch.setattr(columns_module, "TEXT_ROWS", 91)


@pytest.mark.parametrize("chunks", ["default", "small"])
@pytest.mark.parametrize("missing", ["mean", "zero"])
def test_row_groups_give_what_one_group_and_csv_give(tmp_path, request, chunks, missing):
    if chunks == "small":
        request.getfixturevalue("small_chunks")
    nulls = {"d_float": [3, 255, 256, 700], "c_str": [0, 511, 512], "c_int": [999]}
    table = sample_table(nulls=nulls)
    keys = {"missing": missing, "scale": "standard"}
    many = load_party_data(
        config(write(tmp_path, table, "many", row_group=64), **keys), loss="binary"
    )
    one = load_party_data(
        config(write(tmp_path, table, "one", row_group=1000), **keys), loss="binary"
    )
    csv = load_party_data(config(write(tmp_path, table, "text"), **keys), loss="binary")
    assert_same_dataset(many, one)
    assert_same_dataset(many, csv)
    assert many.features.categorical[np.flatnonzero(many.rows == 512)[0], 1] == 0


def test_a_missing_value_is_named_by_its_row_across_row_groups(tmp_path, small_chunks):
    table = sample_table(nulls={"d_float": [700]})
    messages = []
    for name, group in (("many", 256), ("text", None)):
        with pytest.raises(DataError) as info:
            load_party_data(config(write(tmp_path, table, name, row_group=group)), loss="binary")
        messages.append(str(info.value).replace(f"{name}.csv", "").replace(f"{name}.parquet", ""))
    assert "'d_float' has no value at row 700" in messages[0]
    assert messages[0] == messages[1]


def test_a_missing_id_is_named_by_its_row_across_row_groups(tmp_path, small_chunks):
    table = sample_table(nulls={"id": [513]})
    with pytest.raises(DataError, match="id column 'id' has no value at row 513"):
        load_party_data(config(write(tmp_path, table, "ids", row_group=256)), loss="binary")


def test_the_first_error_is_the_one_fit_then_transform_gives(tmp_path):
    """A missing cell in a test row of the first column and in a training row of a later one:
    the training row's (fit) error comes first, as when fit runs before transform."""
    table = sample_table()
    ds = load_party_data(config(write(tmp_path, table, "clean", row_group=64)), loss="binary")
    test_row = int(ds.rows[ds.split.test][0])
    train_row = int(ds.rows[ds.split.train][0])
    table = sample_table(nulls={"d_float": [test_row], "c_str": [train_row]})
    with pytest.raises(DataError, match=f"'c_str' has no value at row {train_row} "):
        load_party_data(config(write(tmp_path, table, "both", row_group=64)), loss="binary")


def test_unseen_categories_get_the_reserved_code(tmp_path, small_chunks):
    trained = load_party_data(
        config(write(tmp_path, sample_table(), "train", row_group=64)), loss="binary"
    )
    new = sample_table(n=600, seed=5)
    unseen = {
        "c_int": pa.array(
            [1000 + i if i % 3 == 0 else v for i, v in enumerate(new["c_int"].to_pylist())]
        ),
        "c_str": pa.array(
            [f"new{i}" if i % 4 == 0 else v for i, v in enumerate(new["c_str"].to_pylist())]
        ),
    }
    for name, column in unseen.items():
        new = new.set_column(new.schema.get_field_index(name), name, column)
    state = trained.preprocessing
    got = load_new_data(config(write(tmp_path, new, "new", row_group=50)), state)
    same = load_new_data(config(write(tmp_path, new, "new_text")), state)
    np.testing.assert_array_equal(got.features.categorical, same.features.categorical)
    np.testing.assert_array_equal(got.features.numeric, same.features.numeric)
    codes = got.features.categorical
    assert (codes[::3, 0] == 0).all() and (codes[::4, 1] == 0).all()
    vocabulary = state.vocabularies[1].values
    seen = [i for i in range(600) if i % 4]
    expected = [vocabulary.index(new["c_str"][i].as_py()) + 1 for i in seen]
    np.testing.assert_array_equal(codes[seen, 1], expected)


def test_split_party_layout_is_the_dataset_sorted_by_id_and_grouped(tmp_path, small_chunks):
    """`load_table_data` against the layout built by hand from the plain dataset: rows sorted
    by canonical id, train/validation/test rows in that order, [numeric | codes]."""
    cfg = config(write(tmp_path, sample_table(), "party", row_group=64), missing="zero")
    fields = load_table_data(cfg, labels=True, loss="binary", out=1)
    ds = load_party_data(cfg, loss="binary")
    keys = np.array([canonical(i) for i in ds.ids], dtype=object)
    order = np.argsort(keys, kind="stable")
    x = np.concatenate([ds.features.numeric, ds.features.categorical.astype(np.float32)], axis=1)
    for part in ("train", "validation", "test"):
        take = order[getattr(ds.split, part)[order]]
        np.testing.assert_array_equal(fields[part], x[take])
        np.testing.assert_array_equal(fields[f"y_{part}"], ds.labels[take])
    train = order[ds.split.train[order]]
    expected = fingerprint(ds.ids, ds.features, ds.labels, ds.preprocessing, train)
    assert fields["fingerprint"] == expected
    assert fields["alignment"] == {"size": len(keys), "commitment": commitment(keys[order])}


def test_id_text_round_trips_and_matches_str_ids(small_chunks):
    ids = ["b", "", "ré", "a", "b", "日本", "ab", "a\x00b", "zz"] * 20
    arrow = pa.array(ids).slice(3)  # a slice: the offsets do not start at 0
    text = IdText.from_arrow(pa.chunked_array([arrow.slice(0, 50), arrow.slice(50)]))
    assert text.to_objects().tolist() == ids[3:]
    assert IdText.from_strings(ids).to_objects().tolist() == ids
    objects = np.array(ids, dtype=object)
    packed = IdText.from_strings(ids)
    np.testing.assert_array_equal(id_hashes(packed), id_hashes(objects))
    rows = np.array([5, 0, 5, 7, 1])
    assert packed.take(rows).to_objects().tolist() == [ids[r] for r in rows]
    order = packed.sort_order()
    assert order.tolist() == sorted(range(len(ids)), key=lambda i: (ids[i].encode(), i))
    changed = list(ids)
    changed[40] = "b2"
    assert packed.first_difference(IdText.from_strings(changed)) == 40
    assert packed.first_difference(IdText.from_strings(ids)) is None
    keys = [canonical(i) for i in sorted(ids, key=str.encode)]
    assert id_commitment(packed) == commitment(keys)


def test_fingerprint_of_id_text_equals_that_of_str_ids(tmp_path):
    ds = load_party_data(config(write(tmp_path, sample_table(), "fp", row_group=64)), loss="binary")
    train = ds.split.rows("train")
    args = (ds.features, ds.labels, ds.preprocessing, train)
    assert fingerprint(ds.id_text, *args) == fingerprint(ds.ids, *args) == ds.fingerprint


def test_id_text_builder_grows_its_buffer_as_ids_get_longer():
    ids = [
        f"{i}" * (1 + i // 50) for i in range(400)
    ]  # later ids are longer: the guess falls short
    builder = IdTextBuilder(len(ids))
    array = pa.array(ids)
    for start in range(0, len(ids), 37):
        builder.append(array.slice(start, 37))
    built = builder.build()
    assert built.to_objects().tolist() == ids
    assert built.offsets[-1] == len(built.data) == sum(len(i) for i in ids)
    with pytest.raises(ValueError, match="399 ids appended, 400 expected"):
        short = IdTextBuilder(400)
        short.append(array.slice(0, 399))
        short.build()
