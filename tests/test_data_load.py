"""`load_party_data` and `load_new_data` end to end: two parties, aligned rows, the split,
labels, the fingerprint, and prediction on new rows."""

import dataclasses
import json
import time

import numpy as np
import pytest

from tandem.parties.data import (
    DataConfig,
    DataError,
    Preprocessing,
    load_new_data,
    load_party_data,
    parse_data_config,
)
from tandem.parties.data.aligned_file import write_aligned

pytest.importorskip("pyarrow")


def write_csv(path, header, rows):
    lines = [",".join(header)] + [",".join(str(v) for v in row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def two_parties(tmp_path, n=200):
    """Leader (age, city, label) and follower (income), same ids in different row orders,
    each with some rows the other lacks; aligned files as `tandem align` writes them."""
    rng = np.random.default_rng(0)
    ids = [f"c{i:04d}" for i in range(n)]
    age = rng.integers(18, 90, n)
    city = rng.choice(["Paris", "Rome", "Oslo"], n)
    income = np.round(rng.normal(50, 10, n), 3)
    label = rng.integers(0, 2, n)
    leader_order = rng.permutation(n)
    follower_order = rng.permutation(n)
    write_csv(
        tmp_path / "leader.csv",
        ["customer", "age", "city", "churned"],
        [(ids[i], age[i], city[i], label[i]) for i in leader_order] + [("extra-l", 1, "Rome", 0)],
    )
    write_csv(
        tmp_path / "follower.csv",
        ["income", "customer"],
        [(income[i], ids[i]) for i in follower_order] + [(1.0, "extra-f")],
    )
    shared = sorted(ids)  # the agreed order
    pos_l = {ids[i]: r for r, i in enumerate(leader_order)}
    pos_f = {ids[i]: r for r, i in enumerate(follower_order)}
    write_aligned(tmp_path / "leader_aligned.csv", [pos_l[i] for i in shared], shared)
    write_aligned(tmp_path / "follower_aligned.csv", [pos_f[i] for i in shared], shared)
    (tmp_path / "leader.toml").write_text("")
    (tmp_path / "follower.toml").write_text("")
    split = {"test": 0.25, "validation": 0.1, "seed": 9}
    leader = parse_data_config(
        {
            "source": "leader.csv",
            "id_column": "customer",
            "label_column": "churned",
            "categorical": ["city"],
            "aligned": "leader_aligned.csv",
            "split": split,
        },
        path=tmp_path / "leader.toml",
    )
    follower = parse_data_config(
        {
            "source": "follower.csv",
            "id_column": "customer",
            "aligned": "follower_aligned.csv",
            "split": split,
        },
        path=tmp_path / "follower.toml",
    )
    return leader, follower


def test_two_parties_get_the_same_rows_in_the_same_order(tmp_path):
    leader_cfg, follower_cfg = two_parties(tmp_path)
    leader = load_party_data(leader_cfg, loss="binary")
    follower = load_party_data(follower_cfg)
    assert leader.ids.tolist() == follower.ids.tolist() == sorted(leader.ids.tolist())
    for part in ("train", "validation", "test"):
        np.testing.assert_array_equal(getattr(leader.split, part), getattr(follower.split, part))
    assert leader.split.test.sum() > 0 and leader.split.validation.sum() > 0
    assert leader.features.numeric.shape == (200, 1) and leader.features.categorical.shape == (
        200,
        1,
    )
    assert follower.features.numeric.shape == (200, 1) and follower.labels is None
    assert leader.labels.dtype == np.float32 and set(leader.labels.tolist()) <= {0.0, 1.0}
    assert leader.alignment == follower.alignment and leader.alignment["size"] == 200
    # Scaling is fitted on the training rows only.
    train = follower.split.train
    assert abs(float(follower.features.numeric[train, 0].mean())) < 1e-5
    features, labels = leader.part("test")
    assert features.numeric.shape[0] == labels.shape[0] == leader.split.test.sum()


def test_without_an_id_column_ids_are_row_numbers(tmp_path):
    path = tmp_path / "t.npz"
    np.savez(path, x=np.arange(10.0), y=np.arange(10) % 2)
    cfg = parse_data_config({"source": str(path), "label_column": "y"})
    data = load_party_data(cfg, loss="binary")
    assert data.ids.tolist() == [str(i) for i in range(10)]
    np.testing.assert_array_equal(data.rows, np.arange(10))


def test_the_fingerprint(tmp_path):
    leader_cfg, _ = two_parties(tmp_path)
    first = load_party_data(leader_cfg, loss="binary")
    assert load_party_data(leader_cfg, loss="binary").fingerprint == first.fingerprint
    assert len(first.fingerprint) == 64

    # The same rows from a Parquet file: the same fingerprint.
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    table = pacsv.read_csv(
        str(tmp_path / "leader.csv"),
        convert_options=pacsv.ConvertOptions(column_types={"customer": "string"}),
    )
    pq.write_table(table, str(tmp_path / "leader.parquet"))
    parquet = dataclasses.replace(leader_cfg, source=str(tmp_path / "leader.parquet"))
    assert load_party_data(parquet, loss="binary").fingerprint == first.fingerprint

    # One training value changes: another fingerprint.
    lines = (tmp_path / "leader.csv").read_text().splitlines()
    train_id = first.ids[first.split.train][0]
    at = next(k for k, line in enumerate(lines) if line.startswith(train_id + ","))
    row = lines[at].split(",")
    row[1] = str(int(row[1]) + 1)
    lines[at] = ",".join(row)
    (tmp_path / "leader.csv").write_text("\n".join(lines) + "\n")
    changed = load_party_data(leader_cfg, loss="binary")
    assert changed.fingerprint != first.fingerprint

    # Another preprocessing of the same data: another fingerprint.
    unscaled = dataclasses.replace(leader_cfg, scale="none")
    assert load_party_data(unscaled, loss="binary").fingerprint != changed.fingerprint


def test_load_new_data_applies_the_saved_state(tmp_path):
    leader_cfg, _ = two_parties(tmp_path)
    trained = load_party_data(leader_cfg, loss="binary")
    saved = json.loads(json.dumps(trained.preprocessing.to_json()))
    # New data: the test rows without labels, in another file.
    test_ids = set(trained.ids[trained.split.test].tolist())
    lines = (tmp_path / "leader.csv").read_text().splitlines()
    kept = [lines[0]] + [line for line in lines[1:] if line.split(",")[0] in test_ids]
    no_label = [",".join(line.split(",")[:3]) for line in kept]
    (tmp_path / "new.csv").write_text("\n".join(no_label) + "\n")
    cfg = parse_data_config({"source": str(tmp_path / "new.csv"), "id_column": "customer"})
    new = load_new_data(cfg, Preprocessing.from_json(saved))
    order = np.argsort(new.ids)
    test = trained.split.test
    np.testing.assert_array_equal(new.ids[order], trained.ids[test])
    np.testing.assert_array_equal(new.features.numeric[order], trained.features.numeric[test])
    np.testing.assert_array_equal(
        new.features.categorical[order], trained.features.categorical[test]
    )


@pytest.mark.parametrize("hashed", [False, True])
def test_a_csv_category_gets_its_training_code_whatever_the_other_cells_of_new_rows(
    tmp_path, hashed
):
    # A CSV column is read as numbers only when every cell is one: "007" is the text "007"
    # next to "A12", the number 7 otherwise. The code of a written value must not depend on
    # which other values the file holds.
    keys = {"id_column": "id", "categorical": ["code"], "split": {"test": 0.0}}
    if hashed:
        keys["hash_buckets"] = {"code": 1000}
    cases = [
        (["007", "012", "A12"], ["007", "012"]),  # text in training, numbers-only new rows
        (["007", "012", "1.0"], ["007", " 12", "1", "A12"]),  # numbers in training, text new
    ]
    for k, (trained_values, new_values) in enumerate(cases):
        write_csv(tmp_path / f"t{k}.csv", ["id", "code"], enumerate(trained_values))
        write_csv(tmp_path / f"n{k}.csv", ["id", "code"], enumerate(new_values))
        cfg = parse_data_config({"source": str(tmp_path / f"t{k}.csv"), **keys})
        trained = load_party_data(cfg)
        code = dict(zip(trained_values, trained.features.categorical[:, 0].tolist(), strict=True))
        code |= {" 12": code["012"], "1": code["1.0"]} if k else {}
        cfg = parse_data_config({"source": str(tmp_path / f"n{k}.csv"), "id_column": "id"})
        new = load_new_data(cfg, trained.preprocessing)
        expected = [code.get(v, 0) for v in new_values]
        if hashed and k:
            expected[-1] = new.features.categorical[-1, 0]  # "A12": its own bucket
        assert new.features.categorical[:, 0].tolist() == expected, (k, trained_values)


def test_labels_that_do_not_fit_the_loss(tmp_path):
    leader_cfg, _ = two_parties(tmp_path)
    with pytest.raises(DataError) as info:
        load_party_data(leader_cfg, loss="softmax", out=1)
    assert "model.out" in str(info.value)
    text = (tmp_path / "leader.csv").read_text().replace(",0\n", ",2\n", 1)
    (tmp_path / "leader.csv").write_text(text)
    with pytest.raises(DataError) as info:
        load_party_data(leader_cfg, loss="binary")
    msg = str(info.value)
    assert str(tmp_path / "leader.toml") in msg and "leader.csv" in msg
    assert "'churned'" in msg and "positive class as 1" in msg


def test_the_label_party_must_name_its_loss(tmp_path):
    leader_cfg, _ = two_parties(tmp_path)
    with pytest.raises(DataError) as info:
        load_party_data(leader_cfg)
    assert "loss=" in str(info.value)


def test_aligned_ids_must_match_the_file(tmp_path):
    _, follower_cfg = two_parties(tmp_path)
    lines = (tmp_path / "follower_aligned.csv").read_text().splitlines()
    lines[1] = lines[1].split(",")[0] + ",someone-else"
    (tmp_path / "follower_aligned.csv").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_party_data(follower_cfg)
    msg = str(info.value)
    assert "follower.csv" in msg and "'someone-else'" in msg and "'customer'" in msg
    assert "tandem align again" in msg


def test_aligned_rows_beyond_the_file(tmp_path):
    _, follower_cfg = two_parties(tmp_path)
    write_aligned(tmp_path / "follower_aligned.csv", [0, 999], ["a", "b"])
    with pytest.raises(DataError) as info:
        load_party_data(follower_cfg)
    assert "999" in str(info.value) and "follower.csv" in str(info.value)


def test_an_aligned_row_beyond_int64_is_a_malformed_line(tmp_path):
    _, follower_cfg = two_parties(tmp_path)
    (tmp_path / "follower_aligned.csv").write_text("row,id\n99999999999999999999,c0001\n")
    with pytest.raises(DataError, match="follower_aligned.csv' has a malformed line"):
        load_party_data(follower_cfg)


def test_an_aligned_file_without_an_id_column_is_refused_not_ignored(tmp_path):
    """An aligned file names rows by id: without the id column it cannot be checked, and
    using every row in file order instead would pair rows by position."""
    leader_cfg, _ = two_parties(tmp_path)
    data = load_party_data(leader_cfg, loss="binary")
    bare = DataConfig(source=leader_cfg.source, aligned=leader_cfg.aligned)
    with pytest.raises(DataError, match="data.aligned needs data.id_column"):
        load_new_data(bare, data.preprocessing)


def test_duplicate_and_missing_ids(tmp_path):
    write_csv(tmp_path / "d.csv", ["id", "x"], [("a", 1), ("b", 2), ("a", 3)])
    cfg = parse_data_config({"source": str(tmp_path / "d.csv"), "id_column": "id"})
    with pytest.raises(DataError) as info:
        load_party_data(cfg)
    msg = str(info.value)
    assert "d.csv" in msg and "'id'" in msg and "'a'" in msg and "rows 0 and 2" in msg
    write_csv(tmp_path / "d.csv", ["id", "x"], [("a", 1), ("", 2)])
    with pytest.raises(DataError) as info:
        load_party_data(cfg)
    assert "d.csv" in str(info.value) and "row 1" in str(info.value)


def test_bad_input_names_the_toml_file_the_data_file_the_column_and_the_fix(tmp_path):
    write_csv(tmp_path / "t.csv", ["id", "age", "city"], [("a", 1, "Rome"), ("b", "", "Oslo")])
    (tmp_path / "p.toml").write_text("")

    def refused(**keys):
        cfg = parse_data_config(
            {"source": "t.csv", "id_column": "id", **keys}, path=tmp_path / "p.toml"
        )
        with pytest.raises(DataError) as info:
            load_party_data(cfg)
        msg = str(info.value)
        assert msg.startswith(str(tmp_path / "p.toml")) and "t.csv" in msg
        return msg

    msg = refused(categorical=["city"])
    assert "'age'" in msg and "row 1" in msg and 'data.missing = "mean"' in msg
    msg = refused(missing="zero")
    assert "'city'" in msg and "add it to data.categorical" in msg
    msg = refused(features=["age", "height"], missing="zero")
    assert "'height'" in msg and "'city'" in msg and "data.features" in msg


@pytest.mark.slow
def test_a_million_rows_load_in_a_few_seconds(tmp_path):
    import pyarrow as pa
    import pyarrow.csv as pacsv

    n = 1_000_000
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "id": pa.array(np.char.add("customer-", np.arange(n).astype(str))),
            "a": rng.normal(size=n).round(4),
            "b": rng.normal(size=n).round(4),
            "c": rng.integers(0, 1000, n),
            "city": rng.choice(np.array(["Paris", "Rome", "Oslo", "Lima"]), n),
            "y": rng.integers(0, 2, n),
        }
    )
    pacsv.write_csv(table, str(tmp_path / "big.csv"))
    cfg = parse_data_config(
        {
            "source": str(tmp_path / "big.csv"),
            "id_column": "id",
            "label_column": "y",
            "categorical": ["city"],
        }
    )
    start = time.perf_counter()
    data = load_party_data(cfg, loss="binary")
    elapsed = time.perf_counter() - start
    assert data.features.numeric.shape == (n, 3) and data.features.categorical.shape == (n, 1)
    assert data.split.test.mean() == pytest.approx(0.2, abs=0.005)
    # A generous bound: it fails on a per-row Python loop, not on a busy machine.
    assert elapsed < 30, f"loading 1M rows took {elapsed:.1f} s"
