"""`[data]`: what a party's table is and how to turn it into model inputs.

`parse_data_config(table, path=...)` checks a TOML ``[data]`` table (a dict) and returns a frozen
`DataConfig`; every error is a `DataError` naming the TOML file, the key and the fix. The keys
(docs/data.md has the full description)::

    [data]
    source = "customers.parquet"    # fsspec URL or path (relative to this file); .csv .parquet .npz
    id_column = "customer_id"       # optional; never a feature
    label_column = "churned"        # label party only
    features = ["age", "city"]      # optional; default: every column but id and label
    categorical = ["city"]          # optional; encoded to integer codes, 0 = unseen or missing
    vocabularies = "codes.json"     # optional: fixed value lists of categorical columns
    hash_buckets = { city = 64 }    # optional: categorical columns coded by a seeded hash
    hash_seed = 0                   # the seed of that hash (the same on every party)
    missing = "error"               # "error" | "mean" | "zero"
    scale = "standard"              # "standard" | "none"
    aligned = "a_aligned.csv"       # optional: the `tandem align --out` file
    in_memory = false               # split learning: false keeps the features in a file
    spill_dir = "/scratch"          # where that file goes (default: the system's temp folder)

    [data.split]
    test = 0.2                      # fraction of ids held out for testing
    validation = 0.0                # fraction of ids held out for validation
    seed = 0                        # every party must use the same seed

Columns are checked against the table when it is read (`tandem.parties.data.preprocess`); this
module checks what can be checked without it: names, types, ranges, a column listed twice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from .errors import DataError

MISSING = ("error", "mean", "zero")
SCALE = ("standard", "none")
DATA_KEYS = (
    "source",
    "id_column",
    "label_column",
    "features",
    "categorical",
    "vocabularies",
    "hash_buckets",
    "hash_seed",
    "missing",
    "scale",
    "aligned",
    "split",
    "in_memory",
    "spill_dir",
)
SPLIT_KEYS = ("test", "validation", "seed")


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Fractions of the ids held out for testing and validation, and the seed of the split.

    Invariant: ``0 <= test``, ``0 <= validation`` and ``test + validation < 1``.
    """

    test: float = 0.2
    validation: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A checked ``[data]`` table. ``source`` and ``aligned`` are resolved against the folder
    of the TOML file when they are relative local paths; ``path`` is that TOML file (for
    messages), or None when the table did not come from a file. ``vocabularies`` (resolved
    likewise) is a JSON file of declared vocabularies (`tandem.parties.data.declared`).
    ``hash_buckets`` maps a categorical column to its number of hashed buckets (its codes are
    a seeded hash of the value, `tandem.parties.data.hashed`: no vocabulary is fitted or
    exchanged), in ``categorical`` order; ``hash_seed`` is that hash's seed.
    ``in_memory`` and ``spill_dir`` say where a split-learning party keeps its packed features
    (`tandem.parties.data.mapped`); federated and elastic parties hold theirs in memory.

    Invariants: ``features`` (when given) and ``categorical`` hold no name twice, and neither
    holds ``id_column`` or ``label_column``.
    """

    source: str
    id_column: str | None = None
    label_column: str | None = None
    features: tuple[str, ...] | None = None
    categorical: tuple[str, ...] = ()
    missing: str = "error"
    scale: str = "standard"
    aligned: str | None = None
    split: SplitConfig = SplitConfig()
    path: str | None = None
    in_memory: bool = False
    spill_dir: str | None = None
    vocabularies: str | None = None
    hash_buckets: tuple[tuple[str, int], ...] = ()
    hash_seed: int = 0

    @property
    def where(self) -> str:
        """The prefix of messages about a key: the TOML file, or ``[data]``."""
        return self.path if self.path is not None else "[data]"

    def hashed(self, name: str) -> int:
        """The hashed buckets of categorical column ``name``, 0 when it is not hashed."""
        return dict(self.hash_buckets).get(name, 0)


def parse_data_config(
    table: Mapping[str, Any], *, path: str | os.PathLike[str] | None = None
) -> DataConfig:
    """Check the ``[data]`` table ``table`` read from the TOML file ``path``."""
    where = os.fspath(path) if path is not None else "[data]"
    if not isinstance(table, Mapping):
        raise DataError(f"{where}: [data] must be a table of keys, got {type(table).__name__}")
    _refuse_unknown(table, DATA_KEYS, "data", where)
    if "source" not in table:
        raise DataError(
            f'{where}: [data] needs `source` (e.g. source = "train.csv"; .csv, .parquet or .npz)'
        )
    source = _string(table, "source", where)
    id_column = _optional_string(table, "id_column", where)
    label_column = _optional_string(table, "label_column", where)
    features = _names(table, "features", where) if "features" in table else None
    categorical = _names(table, "categorical", where) if "categorical" in table else ()
    _check_column_roles(features, categorical, id_column, label_column, where)
    vocabularies = _optional_string(table, "vocabularies", where)
    if vocabularies is not None and not categorical:
        raise DataError(
            f"{where}: data.vocabularies is set but data.categorical lists no column; list "
            "the categorical columns in data.categorical, or remove data.vocabularies"
        )
    hash_buckets = _hash_buckets(table.get("hash_buckets", {}), categorical, where)
    hash_seed = table.get("hash_seed", 0)
    if isinstance(hash_seed, bool) or not isinstance(hash_seed, int) or not 0 <= hash_seed < 2**64:
        raise DataError(
            f"{where}: data.hash_seed must be an integer in [0, 2**64), got {hash_seed!r}; "
            "every party must use the same seed"
        )
    missing = _choice(table, "missing", MISSING, "error", where)
    scale = _choice(table, "scale", SCALE, "standard", where)
    aligned = _optional_string(table, "aligned", where)
    if aligned is not None and id_column is None:
        raise DataError(
            f"{where}: data.aligned needs data.id_column, the column whose ids `tandem align` "
            "matched; set data.id_column"
        )
    in_memory = table.get("in_memory", False)
    if not isinstance(in_memory, bool):
        raise DataError(
            f"{where}: data.in_memory must be true or false, got {in_memory!r} (false, the "
            "default, keeps a split party's features in a file under data.spill_dir)"
        )
    spill_dir = _optional_string(table, "spill_dir", where)
    if spill_dir is not None and in_memory:
        raise DataError(
            f"{where}: data.spill_dir is set but data.in_memory = true keeps the features in "
            "memory; remove one of the two"
        )
    base = os.path.dirname(os.path.abspath(where)) if path is not None else None
    return DataConfig(
        source=_resolve(source, base),
        id_column=id_column,
        label_column=label_column,
        features=features,
        categorical=categorical,
        missing=missing,
        scale=scale,
        aligned=None if aligned is None else _resolve(aligned, base),
        split=_split(table.get("split", {}), where),
        path=where if path is not None else None,
        in_memory=in_memory,
        spill_dir=None if spill_dir is None else _resolve(spill_dir, base),
        vocabularies=None if vocabularies is None else _resolve(vocabularies, base),
        hash_buckets=hash_buckets,
        hash_seed=hash_seed,
    )


def _check_column_roles(
    features: tuple[str, ...] | None,
    categorical: tuple[str, ...],
    id_column: str | None,
    label_column: str | None,
    where: str,
) -> None:
    """Refuse an id or label listed as a feature, and a categorical column missing from an
    explicit feature list."""
    for key, names in (("features", features or ()), ("categorical", categorical)):
        for special, role in ((id_column, "id_column"), (label_column, "label_column")):
            if special is not None and special in names:
                raise DataError(
                    f"{where}: data.{key} lists {special!r}, which is data.{role}; the id and "
                    f"the label are never features: remove {special!r} from data.{key}"
                )
    if features is not None:
        absent = [c for c in categorical if c not in features]
        if absent:
            raise DataError(
                f"{where}: data.categorical lists {absent} but data.features does not; "
                "list every feature in data.features (categorical ones too), or leave "
                "data.features out to use every column but the id and the label"
            )


def _hash_buckets(table: Any, categorical: tuple[str, ...], where: str) -> tuple:
    """``((column, buckets), ...)`` of ``[data] hash_buckets`` in ``categorical`` order."""
    from .hashed import MAX_BUCKETS

    if not isinstance(table, Mapping):
        raise DataError(
            f"{where}: data.hash_buckets must be a table of column = bucket count (e.g. "
            f"hash_buckets = {{ city = 64 }}), got {table!r}"
        )
    for name, n in table.items():
        if name not in categorical:
            raise DataError(
                f"{where}: data.hash_buckets names {name!r}, which data.categorical does not "
                "list; only a categorical column is hashed: add it to data.categorical"
            )
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_BUCKETS:
            raise DataError(
                f"{where}: data.hash_buckets.{name} must be an integer in [1, {MAX_BUCKETS}] "
                f"(the number of buckets its values hash into), got {n!r}"
            )
    return tuple((c, int(table[c])) for c in categorical if c in table)


def _split(table: Any, where: str) -> SplitConfig:
    if not isinstance(table, Mapping):
        raise DataError(f"{where}: data.split must be a table ([data.split] test = 0.2, seed = 0)")
    _refuse_unknown(table, SPLIT_KEYS, "data.split", where)
    fractions = {}
    for key, default in (("test", 0.2), ("validation", 0.0)):
        value = table.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise DataError(f"{where}: data.split.{key} must be a number in [0, 1), got {value!r}")
        if not 0 <= value < 1:
            raise DataError(f"{where}: data.split.{key} must be in [0, 1), got {value!r}")
        fractions[key] = float(value)
    if fractions["test"] + fractions["validation"] >= 1:
        raise DataError(
            f"{where}: data.split.test + data.split.validation must be below 1 (some rows must "
            f"be left to train on), got {fractions['test']} + {fractions['validation']}"
        )
    seed = table.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise DataError(
            f"{where}: data.split.seed must be an integer in [0, 2**64), got {seed!r}; every "
            "party must use the same seed"
        )
    return SplitConfig(test=fractions["test"], validation=fractions["validation"], seed=seed)


def _refuse_unknown(table: Mapping[str, Any], accepted: tuple[str, ...], name: str, where: str):
    unknown = sorted(k for k in table if k not in accepted)
    if unknown:
        raise DataError(
            f"{where}: [{name}] has unknown key(s) {unknown}; the accepted keys are "
            f"{list(accepted)} (check the spelling)"
        )


def _string(table: Mapping[str, Any], key: str, where: str) -> str:
    value = table[key]
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: data.{key} must be a non-empty string, got {value!r}")
    return value


def _optional_string(table: Mapping[str, Any], key: str, where: str) -> str | None:
    return _string(table, key, where) if key in table else None


def _names(table: Mapping[str, Any], key: str, where: str) -> tuple[str, ...]:
    value = table[key]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise DataError(
            f'{where}: data.{key} must be a list of column names (e.g. ["age", "city"]), '
            f"got {value!r}"
        )
    seen: set[str] = set()
    for name in value:
        if name in seen:
            raise DataError(
                f"{where}: data.{key} lists column {name!r} twice; list each column once"
            )
        seen.add(name)
    return tuple(value)


def _choice(
    table: Mapping[str, Any], key: str, accepted: tuple[str, ...], default: str, where: str
) -> str:
    value = table.get(key, default)
    if value not in accepted:
        raise DataError(
            f"{where}: data.{key} must be one of {list(accepted)}, got {value!r} "
            f"(the default is {default!r})"
        )
    return str(value)


def _resolve(location: str, base: str | None) -> str:
    """A relative local path is taken relative to the TOML file's folder; URLs are kept."""
    if base is None or "://" in location or os.path.isabs(location):
        return location
    return os.path.join(base, location)


__all__ = ["DataConfig", "SplitConfig", "parse_data_config", "MISSING", "SCALE"]
