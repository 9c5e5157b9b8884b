"""Reading tables: CSV, Parquet and npz give the same columns; bad files get clear errors."""

import sys

import fsspec
import numpy as np
import pytest

from tandem.errors import ConfigError
from tandem.parties.data import DataError, read_table

CSV = (
    "id,age,income,city,flag\n007,31,1.5,Paris,1\n8,,2.25,Rome,0\n9,40,NaN,,1\n10, 22 ,-3,Oslo,0\n"
)


def write_csv(tmp_path, text=CSV, name="t.csv"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def write_parquet(tmp_path, name="t.parquet"):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "id": pa.array(["007", "8", "9", "10"]),
            "age": pa.array([31, None, 40, 22], pa.int32()),
            "income": pa.array([1.5, 2.25, None, -3.0]),
            "city": pa.array(["Paris", "Rome", None, "Oslo"]).dictionary_encode(),
            "flag": pa.array([True, False, True, False]),
        }
    )
    path = str(tmp_path / name)
    pq.write_table(table, path)
    return path


def as_lists(table):
    """Every column as (kind, values with None for a missing cell, missing mask)."""
    out = {}
    for name, c in table.columns.items():
        missing = np.zeros(len(c.values), bool) if c.missing is None else c.missing
        values = [None if m else v for v, m in zip(c.values.tolist(), missing, strict=True)]
        out[name] = (c.kind, values, None if c.missing is None else c.missing.tolist())
    return out


def test_csv_inference_and_missing_cells(tmp_path):
    pytest.importorskip("pyarrow")
    t = read_table(write_csv(tmp_path), text=["id"])
    assert t.num_rows == 4 and t.available == ("id", "age", "income", "city", "flag")
    assert t["id"].kind == "string" and t["id"].values.tolist() == ["007", "8", "9", "10"]
    assert t["age"].kind == "int" and t["age"].values.dtype == np.int64
    assert t["age"].values.tolist() == [31, 0, 40, 22]  # " 22 ": spaces around a number
    assert t["age"].missing.tolist() == [False, True, False, False]
    assert t["income"].kind == "float" and t["income"].missing.tolist() == [0, 0, 1, 0]
    assert t["city"].kind == "string" and t["city"].values.tolist() == ["Paris", "Rome", "", "Oslo"]
    assert t["city"].missing.tolist() == [False, False, True, False]
    assert t["flag"].kind == "int" and t["flag"].missing is None
    assert t["age"].first_missing() == 1 and t["flag"].first_missing() is None


def test_csv_parquet_and_npz_give_the_same_columns(tmp_path):
    pytest.importorskip("pyarrow")
    from_csv = read_table(write_csv(tmp_path), text=["id"])
    from_parquet = read_table(write_parquet(tmp_path), text=["id"])
    npz = str(tmp_path / "t.npz")
    np.savez(
        npz,
        id=np.array(["007", "8", "9", "10"]),
        age=np.array([31, np.nan, 40, 22]),
        income=np.array([1.5, 2.25, np.nan, -3.0]),
        city=np.array(["Paris", "Rome", "", "Oslo"]),
        flag=np.array([True, False, True, False]),
    )
    from_npz = read_table(npz, text=["id"])
    assert as_lists(from_csv) == as_lists(from_parquet)
    for name in ("id", "income", "flag"):
        assert as_lists(from_npz)[name] == as_lists(from_csv)[name]
    assert from_npz["age"].kind == "float"  # numpy has no integer with a missing value
    assert from_npz["age"].missing.tolist() == from_csv["age"].missing.tolist()


def test_only_the_asked_columns_are_read(tmp_path):
    pytest.importorskip("pyarrow")
    for path in (write_csv(tmp_path), write_parquet(tmp_path)):
        t = read_table(path, ["income", "id"], text=["id"])
        assert list(t.columns) == ["id", "income"]  # file order
        assert t.available == ("id", "age", "income", "city", "flag")


def test_integer_ids_of_parquet_and_npz_are_their_decimal_text(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": [5, 12]}), str(tmp_path / "i.parquet"))
    np.savez(tmp_path / "i.npz", id=np.array([5, 12]))
    for name in ("i.parquet", "i.npz"):
        t = read_table(str(tmp_path / name), text=["id"])
        assert t["id"].kind == "string" and t["id"].values.tolist() == ["5", "12"]


def test_fsspec_urls(tmp_path):
    pytest.importorskip("pyarrow")
    with fsspec.open("memory://data-test/t.csv", "w") as f:
        f.write(CSV)
    from_memory = read_table("memory://data-test/t.csv", text=["id"])
    from_file_url = read_table("file://" + write_csv(tmp_path), text=["id"])
    assert as_lists(from_memory) == as_lists(from_file_url)
    fsspec.filesystem("memory").rm("data-test", recursive=True)


def test_unknown_suffix_names_the_accepted_ones(tmp_path):
    with pytest.raises(DataError) as info:
        read_table(str(tmp_path / "t.xlsx"))
    msg = str(info.value)
    assert "t.xlsx" in msg and "'.csv', '.parquet', '.npz'" in msg


def test_missing_file(tmp_path):
    with pytest.raises(DataError) as info:
        read_table(str(tmp_path / "absent.npz"))
    assert "absent.npz" in str(info.value) and "data.source" in str(info.value)


def test_unknown_column_lists_the_available_ones(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_csv(tmp_path)
    with pytest.raises(DataError) as info:
        read_table(path, ["id", "salary"])
    msg = str(info.value)
    assert path in msg and "'salary'" in msg and "'income'" in msg and "data.features" in msg


def test_a_header_with_a_column_named_twice(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_csv(tmp_path, "id,a,a\n1,2,3\n")
    with pytest.raises(DataError) as info:
        read_table(path)
    assert path in str(info.value) and "['a']" in str(info.value)


def test_a_quoted_header_cell_may_hold_a_line_break(tmp_path):
    t = read_table(write_csv(tmp_path, 'id,"a\nb",c\n1,2,3\n2,3,4\n'))
    assert t.available == ("id", "a\nb", "c") and t["a\nb"].values.tolist() == [2, 3]


def test_a_csv_with_carriage_return_line_ends_reads_as_tandem_align_reads_it(tmp_path):
    from tandem.parties.alignment.cli import read_ids

    path = write_csv(tmp_path, "id,a\rx1,1\rx2,2\r")  # classic Mac line ends
    assert read_table(path, text=["id"])["id"].values.tolist() == ["x1", "x2"]
    assert read_ids(path, "id") == ["x1", "x2"]


def test_a_header_the_csv_module_cannot_parse_is_a_data_error(tmp_path):
    path = write_csv(tmp_path, "id," + "a" * 200_000 + "\n1,2\n")
    with pytest.raises(DataError, match="header row"):
        read_table(path)


def test_a_ragged_csv(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_csv(tmp_path, "id,a\n1,2\n3\n")
    with pytest.raises(DataError) as info:
        read_table(path)
    assert path in str(info.value) and "well-formed" in str(info.value)


def test_an_empty_csv(tmp_path):
    pytest.importorskip("pyarrow")
    path = write_csv(tmp_path, "")
    with pytest.raises(DataError) as info:
        read_table(path)
    assert path in str(info.value) and "header row" in str(info.value)


def test_without_pyarrow_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # `import pyarrow` raises ImportError
    path = write_csv(tmp_path)
    with pytest.raises(ConfigError) as info:
        read_table(path)
    assert path in str(info.value) and "pip install 'tandem[parquet]'" in str(info.value)


def test_npz_never_unpickles(tmp_path):
    path = tmp_path / "o.npz"
    np.savez(path, id=np.array(["a", "b"]), blob=np.array([{"x": 1}, None], dtype=object))
    with pytest.raises(DataError) as info:
        read_table(str(path))
    assert "'blob'" in str(info.value) and "never unpickled" in str(info.value)


@pytest.mark.parametrize(
    "arrays, says",
    [
        ({"a": np.zeros((3, 2))}, "1-D array per column"),
        ({"a": np.zeros(3), "b": np.zeros(4)}, "one entry per row"),
    ],
)
def test_npz_shapes(tmp_path, arrays, says):
    path = tmp_path / "s.npz"
    np.savez(path, **arrays)
    with pytest.raises(DataError) as info:
        read_table(str(path))
    assert str(path) in str(info.value) and says in str(info.value)


def test_parquet_column_of_another_type(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"when": pa.array([0, 1], pa.timestamp("s"))}), path)
    with pytest.raises(DataError) as info:
        read_table(path)
    msg = str(info.value)
    assert path in msg and "'when'" in msg and "convert it" in msg


def test_a_parquet_boolean_column_with_a_missing_cell(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "b.parquet")
    pq.write_table(pa.table({"flag": pa.array([True, None, False])}), path)
    flag = read_table(path)["flag"]
    assert flag.kind == "int" and flag.values.tolist() == [1, 0, 0]
    assert flag.missing.tolist() == [False, True, False]


def test_a_parquet_uint64_column_beyond_int64_is_refused_clearly(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "u.parquet")
    pq.write_table(pa.table({"code": pa.array([2**64 - 1, 5], pa.uint64())}), path)
    with pytest.raises(DataError) as info:
        read_table(path)["code"]
    assert path in str(info.value) and "'code'" in str(info.value) and "64-bit" in str(info.value)
