"""Party data, shared by split learning, federated learning and elastic training.

A ``[data]`` TOML table (`parse_data_config`) names a table behind an fsspec URL (CSV, Parquet,
npz) and how to turn it into model inputs. `load_party_data` reads it, splits the rows by id
and seed (the same split on every party), fits the preprocessing on the training rows only,
checks the labels against the loss and fingerprints the result; `load_new_data` applies a
saved `Preprocessing` (``to_json``/``from_json``) to new rows at prediction. docs/data.md is the
user's guide.

Modules: `config` (the keys), `table` (readers), `preprocess` (features, encoding, missing
values, scaling), `idtext` (ids as UTF-8 bytes), `ids` and `split` (the id hash and the
split), `labels`, `fingerprint`, `aligned_file` (the `tandem align --out` file) and
`canonical_ids` (ids as the PSI encodes them, and their commitment), `load` (the entry
points), `errors`.
"""

from .config import DataConfig, SplitConfig, parse_data_config
from .errors import DataError
from .fingerprint import fingerprint
from .labels import LOSSES, labels_for_loss
from .load import NewData, PartyDataset, load_new_data, load_party_data
from .preprocess import Features, Preprocessing, Vocabulary, feature_columns, fit
from .split import Split, assign_split, uniforms
from .table import Column, Table, read_table

__all__ = [
    "Column",
    "DataConfig",
    "DataError",
    "Features",
    "LOSSES",
    "NewData",
    "PartyDataset",
    "Preprocessing",
    "Split",
    "SplitConfig",
    "Table",
    "Vocabulary",
    "assign_split",
    "feature_columns",
    "fingerprint",
    "fit",
    "labels_for_loss",
    "load_new_data",
    "load_party_data",
    "parse_data_config",
    "read_table",
    "uniforms",
]
