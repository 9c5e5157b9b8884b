"""`[data]` parsing: every key, its default, and a clear error for each bad value."""

import os

import pytest

from tandem.errors import ConfigError
from tandem.parties.data import DataConfig, DataError, SplitConfig, parse_data_config

TOML = "/projects/churn/party.toml"


def parse(**keys):
    return parse_data_config(keys, path=TOML)


def refused(**keys) -> str:
    with pytest.raises(DataError) as info:
        parse(**keys)
    assert isinstance(info.value, ConfigError)
    return str(info.value)


def test_defaults():
    cfg = parse(source="train.csv")
    assert cfg == DataConfig(source="/projects/churn/train.csv", path=TOML)
    assert (cfg.missing, cfg.scale, cfg.features, cfg.categorical) == (
        "error",
        "standard",
        None,
        (),
    )
    assert cfg.split == SplitConfig(test=0.2, validation=0.0, seed=0)


def test_every_key():
    cfg = parse(
        source="memory://bucket/train.parquet",
        id_column="customer_id",
        label_column="churned",
        features=["age", "city"],
        categorical=["city"],
        missing="mean",
        scale="none",
        aligned="aligned.csv",
        split={"test": 0.25, "validation": 0.1, "seed": 42},
    )
    assert cfg.source == "memory://bucket/train.parquet"  # URLs are kept as they are
    assert cfg.aligned == os.path.join("/projects/churn", "aligned.csv")
    assert cfg.features == ("age", "city") and cfg.categorical == ("city",)
    assert (cfg.missing, cfg.scale) == ("mean", "none")
    assert cfg.split == SplitConfig(test=0.25, validation=0.1, seed=42)


def test_paths_without_a_toml_file_are_kept():
    cfg = parse_data_config({"source": "train.csv"})
    assert cfg.source == "train.csv" and cfg.path is None and cfg.where == "[data]"


def test_unknown_key_lists_the_accepted_ones():
    msg = refused(source="a.csv", label="y")
    assert TOML in msg and "'label'" in msg and "label_column" in msg and "spelling" in msg


def test_unknown_split_key():
    msg = refused(source="a.csv", split={"tests": 0.2})
    assert TOML in msg and "'tests'" in msg and "'test'" in msg and "data.split" in msg


def test_source_is_required():
    msg = refused(id_column="id")
    assert TOML in msg and "source" in msg and ".parquet" in msg


@pytest.mark.parametrize(
    "keys, named",
    [
        ({"source": 3}, "data.source"),
        ({"source": "a.csv", "id_column": ""}, "data.id_column"),
        ({"source": "a.csv", "features": "age"}, "data.features"),
        ({"source": "a.csv", "categorical": [1]}, "data.categorical"),
        ({"source": "a.csv", "missing": "drop"}, "data.missing"),
        ({"source": "a.csv", "scale": "minmax"}, "data.scale"),
        ({"source": "a.csv", "split": {"test": "0.2"}}, "data.split.test"),
        ({"source": "a.csv", "split": {"test": True}}, "data.split.test"),
        ({"source": "a.csv", "split": {"validation": 1.0}}, "data.split.validation"),
        ({"source": "a.csv", "split": {"seed": -1}}, "data.split.seed"),
        ({"source": "a.csv", "split": {"seed": 1.5}}, "data.split.seed"),
        ({"source": "a.csv", "split": 0.2}, "data.split"),
    ],
)
def test_wrong_types_and_values(keys, named):
    msg = refused(**keys)
    assert TOML in msg and named in msg


def test_choice_errors_list_the_accepted_values():
    msg = refused(source="a.csv", missing="drop")
    assert "'error', 'mean', 'zero'" in msg
    msg = refused(source="a.csv", scale="minmax")
    assert "'standard', 'none'" in msg


def test_test_and_validation_leave_rows_to_train_on():
    msg = refused(source="a.csv", split={"test": 0.5, "validation": 0.5})
    assert TOML in msg and "below 1" in msg


@pytest.mark.parametrize("key", ["features", "categorical"])
def test_a_column_listed_twice(key):
    keys = {"features": ["age", "city", "age"]} if key == "features" else {}
    keys["categorical"] = ["city", "city"] if key == "categorical" else ["city"]
    msg = refused(source="a.csv", **keys)
    assert TOML in msg and f"data.{key}" in msg and "twice" in msg and "once" in msg


@pytest.mark.parametrize("key", ["features", "categorical"])
@pytest.mark.parametrize("role", ["id_column", "label_column"])
def test_the_id_and_the_label_are_never_features(key, role):
    msg = refused(source="a.csv", **{role: "cid", key: ["cid"]})
    assert TOML in msg and "'cid'" in msg and f"data.{role}" in msg
    assert f"remove 'cid' from data.{key}" in msg


def test_categorical_columns_must_be_listed_features():
    msg = refused(source="a.csv", features=["age"], categorical=["city"])
    assert TOML in msg and "'city'" in msg and "data.features" in msg


def test_aligned_needs_the_id_column():
    msg = refused(source="a.csv", aligned="a_aligned.csv")
    assert TOML in msg and "data.aligned" in msg and "set data.id_column" in msg
