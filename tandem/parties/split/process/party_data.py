"""One split-learning party's `[data]` table, read through `tandem.parties.data`, as `PartyData`.

`load_table_data(table, ...)` runs `tandem.parties.data.load_party_data` (the shared loader:
readers, split by id and seed, preprocessing fitted on the training rows, label checks,
fingerprint) and lays the result out as the split party holds it:

* the feature matrix is float32 ``[rows, numeric + categorical]``: the numeric features, then
  the categorical codes as whole floats (the layout `tandem.parties.models.embedding_mlp`
  reads: its last ``len(vocab)`` columns are codes);
* ``train``, ``validation`` and ``test`` are the rows of each part, in the aligned order,
  as slices of the one matrix the loader wrote (``group_by_part``, ``packed``): no copies;
* with ``[data] in_memory = false`` (the default) those rows are `MappedRows` of one
  row-major file under ``spill_dir`` instead of arrays in memory
  (`tandem.parties.data.mapped`): the party gathers each micro-batch's rows from it and
  holds a bounded share of its pages; the labels stay in memory;
* rows are paired across parties by id, never by position. With ``aligned`` the order is the
  `tandem align` file's; with only ``id_column`` the rows are sorted by canonical id (the
  order `tandem align` uses) and the alignment recorded in the task spec is the size and
  commitment of all ids, so parties holding different ids are refused at negotiation. With
  neither, the party is refused: its rows would be paired by file position.

Contract: blocking (file I/O); every refusal is a `tandem.parties.data.DataError` (a
`ConfigError`) naming the TOML file, the column and the fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

import numpy as np

from tandem.parties.data import DataConfig, DataError, PartyDataset, load_party_data
from tandem.parties.data.canonical_ids import DOMAIN
from tandem.parties.data.idtext import IdText
from tandem.parties.data.mapped import MappedRows, default_spill_dir

#: Column names that usually hold sample ids; named in the refusal of a table without ids.
_ID_LIKE = re.compile(r"(^|[_\s-])(id|ids|key|uuid)$|^id_|(?<=[a-z])Id$", re.IGNORECASE)


def load_table_data(
    table: DataConfig, *, labels: bool, loss: str | None, out: int | None
) -> dict[str, Any]:
    """The fields of a `tandem.parties.split.process.build_data.PartyData` for ``table``.

    ``labels``: this party owns the loss stage (its table must name ``label_column``);
    ``loss``/``out``: the loss and output width the labels are checked against.
    """
    where = table.where
    if labels and table.label_column is None:
        raise DataError(
            f"{where}: this party owns the loss stage, so its [data] needs label_column = "
            '"<the column of labels>"'
        )
    if not labels and table.label_column is not None:
        raise DataError(
            f"{where}: data.label_column = {table.label_column!r}, but only the party owning "
            "the loss stage (the leader) holds labels; remove it here"
        )
    if table.id_column is None:
        raise DataError(_no_ids_message(table))
    by_id = table.aligned is None
    ds = load_party_data(
        table,
        loss=loss if labels else None,
        out=out,
        sort_by_id=by_id,
        group_by_part=True,
        packed=True,
        spill_dir=None if table.in_memory else (table.spill_dir or default_spill_dir()),
    )
    alignment = ds.alignment
    if by_id:
        alignment = {"size": len(ds.id_text), "commitment": id_commitment(ds.id_text)}
    x: np.ndarray | MappedRows | None = ds.features.packed
    if x is None:
        raise TypeError("load_party_data(packed=True) returned unpacked features")
    if ds.features.spill is not None:
        x = ds.features.spill.to_rows()
    parts = _part_slices(ds)
    fields: dict[str, Any] = {
        "train": _rows(x, parts["train"]),
        "test": _rows(x, parts["test"]),
        "validation": _rows(x, parts["validation"]),
        "alignment": alignment,
        "fingerprint": ds.fingerprint,
        "preprocessing": ds.preprocessing.to_json(),
        "vocab": tuple(v.size for v in ds.preprocessing.vocabularies),
        "split": dataclasses.asdict(table.split),
    }
    if ds.labels is not None:
        fields.update(
            y_train=ds.labels[parts["train"]],
            y_test=ds.labels[parts["test"]],
            y_validation=ds.labels[parts["validation"]],
        )
    return fields


def _rows(x: np.ndarray | MappedRows, part: slice) -> np.ndarray | MappedRows:
    """Rows ``part`` of the packed features: a view, in memory or in the mapped file."""
    if isinstance(x, MappedRows):
        return x.rows(part.start, part.stop)
    return x[part]


def _part_slices(ds: PartyDataset) -> dict[str, slice]:
    """The rows of each part of a dataset loaded with ``group_by_part``: contiguous slices, so
    each part's arrays are views of the one feature matrix, not copies."""
    n_train, n_validation = int(ds.split.train.sum()), int(ds.split.validation.sum())
    return {
        "train": slice(0, n_train),
        "validation": slice(n_train, n_train + n_validation),
        "test": slice(n_train + n_validation, len(ds.rows)),
    }


def id_commitment(ids: IdText) -> str:
    """``commitment`` of every id in canonical order (the commitment `tandem align` would give
    if every party held exactly these ids), a chunk of ids at a time."""
    order = ids.sort_order()
    digest = hashlib.sha256(DOMAIN + b"commitment/")
    for start in range(0, len(order), _CHUNK):
        part = ids.take(order[start : start + _CHUNK])
        lengths = part.lengths()
        record = 4 + lengths  # u32 little-endian length, then the bytes (as `commitment`)
        begins = np.zeros(len(part), np.int64)
        np.cumsum(record[:-1], out=begins[1:])
        out = np.empty(int(record.sum()), np.uint8)
        out[(begins[:, None] + np.arange(4)).ravel()] = (
            lengths.astype("<u4").view(np.uint8).reshape(-1, 4).ravel()
        )
        owner = np.repeat(np.arange(len(part), dtype=np.int64), lengths)
        out[np.arange(len(part.data), dtype=np.int64) + 4 * (owner + 1)] = part.data
        digest.update(out.data)
    return digest.hexdigest()


_CHUNK = 1 << 16  # ids hashed at a time by `id_commitment`


def arrays_fingerprint(arrays: dict[str, np.ndarray | None]) -> str:
    """SHA-256 (hex) of named arrays (name, dtype, shape, bytes, in name order): the
    fingerprint of a pre-split source, which has no preprocessing state."""
    digest = hashlib.sha256(b"tandem-arrays-fingerprint/1\n")
    for name in sorted(arrays):
        a = arrays[name]
        if a is None:
            continue
        a = np.ascontiguousarray(a)
        digest.update(f"{name}:{a.dtype.str}:{list(a.shape)}\n".encode())
        digest.update(a.data)
    return digest.hexdigest()


def _no_ids_message(table: DataConfig) -> str:
    hint = ""
    named = table.features or ()
    guesses = [c for c in named if _ID_LIKE.search(c)]
    if not named:
        guesses = _id_like_columns(table)
    if guesses:
        hint = (
            f" Column {guesses[0]!r} looks like the ids: set data.id_column = "
            f"{guesses[0]!r} (it is then never a feature)."
        )
    return (
        f"{table.where}: [data] sets no id_column, so this party's rows would be paired with "
        f"the other parties' by file position and every column of {table.source!r} but the "
        "label would be a feature.{hint} Set data.id_column to the column of sample ids and "
        "align the parties with `tandem align` (then data.aligned)."
    ).replace("{hint}", hint)


def _id_like_columns(table: DataConfig) -> list[str]:
    """The header names of ``table.source`` that look like id columns (reads the schema only
    where the format allows; an unreadable source gives no guess, the loader reports it)."""
    from tandem.parties.data import read_table

    try:
        names = list(read_table(table.source, [], text=()).available)
    except (DataError, OSError, ValueError):
        return []
    return [c for c in names if _ID_LIKE.search(c)]


__all__ = ["arrays_fingerprint", "id_commitment", "load_table_data"]
