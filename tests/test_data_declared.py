"""Declared vocabularies (``[data] vocabularies``): a categorical column's codes come from the
user's list, not from the training rows, and a list that cannot be the column's is refused."""

import fsspec
import numpy as np
import orjson
import pytest

from tandem.parties.data import DataError, fit, parse_data_config
from tandem.parties.data.preprocess import fit_transform
from tests.test_data_preprocess import SOURCE, column, customers, table

VOCAB = "memory://bank/codes.json"


def declare(content, url=VOCAB):
    with fsspec.open(url, "wb") as f:
        f.write(content if isinstance(content, bytes) else orjson.dumps(content))


def fitted_with(declared, **keys):
    declare(declared)
    keys = {
        "id_column": "id",
        "label_column": "y",
        "categorical": ["city", "branch"],
        "missing": "mean",
        **keys,
    }
    cfg = parse_data_config({"source": SOURCE, "vocabularies": VOCAB, **keys})
    return fit(customers(), cfg, np.arange(4))


def test_declared_list_fixes_the_codes_and_the_table_length():
    # Training rows 0..3 hold branches 3, 1, 3, 2; the catalog also has 7 and 9 (test rows).
    state = fitted_with({"branch": [9, 3, 7, 2, 1, 5]})
    city, branch = state.vocabularies
    assert branch.kind == "int" and branch.values == (1, 2, 3, 5, 7, 9) and branch.size == 7
    assert city.values == ("Oslo", "Paris", "Rome")  # not declared: fitted as before
    codes = state.transform(customers()).categorical
    np.testing.assert_array_equal(codes[:, 1], [3, 1, 3, 2, 6, 5])  # 9 and 7 have codes
    np.testing.assert_array_equal(codes[:, 0], [2, 3, 2, 1, 0, 3])


def test_declared_text_list_and_values_outside_it():
    state = fitted_with({"city": ["Rome", "Paris", "Lima", "Kyiv"]})
    city = state.vocabularies[0]
    assert city.kind == "string" and city.values == ("Kyiv", "Lima", "Paris", "Rome")
    codes = state.transform(customers()).categorical[:, 0]
    # Oslo (a training value) is outside the list: the reserved code 0, as an unseen value.
    np.testing.assert_array_equal(codes, [3, 4, 3, 0, 2, 4])


def test_the_loader_path_gives_the_same_state_and_codes():
    declare({"branch": [9, 3, 7, 2, 1, 5], "city": ["Rome", "Paris", "Oslo", "Lima"]})
    cfg = parse_data_config(
        {
            "source": SOURCE,
            "vocabularies": VOCAB,
            "id_column": "id",
            "label_column": "y",
            "categorical": ["city", "branch"],
            "missing": "mean",
        }
    )
    rows = np.arange(6)
    state, features = fit_transform(customers(), cfg, np.arange(4), rows)
    assert state == fit(customers(), cfg, np.arange(4))
    np.testing.assert_array_equal(features.categorical, state.transform(customers()).categorical)
    assert state.to_json()["categorical"][1]["vocabulary"] == [1, 2, 3, 5, 7, 9]


def test_path_is_taken_relative_to_the_toml_file(tmp_path):
    cfg = parse_data_config(
        {"source": "t.csv", "categorical": ["c"], "vocabularies": "codes.json"},
        path=tmp_path / "party.toml",
    )
    assert cfg.vocabularies == str(tmp_path / "codes.json")


def test_vocabularies_without_categorical_columns_is_refused():
    with pytest.raises(DataError, match="data.categorical lists no column"):
        parse_data_config({"source": SOURCE, "vocabularies": VOCAB})


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"town": ["Paris"]}, r"lists \['town'\], which data.categorical does not"),
        ({"city": []}, "non-empty list"),
        ({"city": "Paris"}, "non-empty list"),
        ({"city": ["Paris", 3]}, "mixes numbers and text"),
        ({"branch": [1, True]}, "holds True .from JSON true."),
        ({"branch": [1, 2.5]}, "holds 2.5"),
        ({"branch": [1, None]}, "holds None .from JSON null."),
        ({"branch": [1, 2, 1]}, "lists 1 twice"),
        (["Paris"], "holds a list; it must be one object of lists"),
        (b"{not json", "is not valid JSON"),
    ],
)
def test_a_malformed_file_is_refused_naming_column_and_fix(content, message):
    with pytest.raises(DataError, match=message):
        fitted_with(content)


def test_a_missing_file_is_refused():
    cfg = parse_data_config(
        {
            "source": SOURCE,
            "id_column": "id",
            "label_column": "y",
            "categorical": ["city"],
            "vocabularies": "memory://none/x.json",
        }
    )
    with pytest.raises(DataError, match="no such file"):
        fit(customers(), cfg, np.arange(4))


def test_a_list_of_the_wrong_kind_is_refused():
    # Text "3" never equals the number 3: every row would get code 0 without a word.
    with pytest.raises(DataError, match=r"'branch' holds numbers but .* lists text"):
        fitted_with({"branch": ["1", "2", "3"]})
    with pytest.raises(DataError, match=r"'city' holds text but .* lists numbers"):
        fitted_with({"city": [1, 2]})


def test_a_list_sharing_no_training_value_is_refused():
    with pytest.raises(DataError, match="none of the 3 values of categorical column 'branch'"):
        fitted_with({"branch": [100, 200]})


def test_whole_float_columns_take_a_list_of_numbers():
    t = table(id=["a", "b", "c"], code=column("code", [4.0, 8.0, 4.0]))
    declare({"code": [8, 4, 15]})
    cfg = parse_data_config(
        {"source": SOURCE, "id_column": "id", "categorical": ["code"], "vocabularies": VOCAB}
    )
    state = fit(t, cfg, np.arange(2))
    np.testing.assert_array_equal(state.transform(t).categorical[:, 0], [1, 2, 1])
    assert state.vocabularies[0].size == 4
