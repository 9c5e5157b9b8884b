"""The fingerprint of a party's training data and preprocessing.

``fingerprint(ids, features, labels, preprocessing)`` is the hex SHA-256 of, in order:

1. the line ``tandem-data-fingerprint/1``;
2. a canonical JSON header (sorted keys, no spaces): the row count, the shapes and dtypes of
   the arrays, and the preprocessing state (`Preprocessing.to_json`);
3. the ids: their UTF-8 byte lengths (little-endian int64), then their bytes, in row order;
4. the numeric features (little-endian float32, C order), the categorical codes
   (little-endian int32, C order) and the labels (little-endian, their dtype), if any.

Contract: two calls give the same fingerprint if and only if (up to SHA-256 collisions) they
get the same ids in the same order, the same feature and label bytes, and the same
preprocessing state. It is independent of the machine, the file format and the path the data
came from; it changes when one value, one id, the row order or one preprocessing number does.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np

from .idtext import IdText
from .preprocess import Features, Preprocessing

VERSION = b"tandem-data-fingerprint/1\n"
_CHUNK = 1 << 16  # rows hashed at a time


def fingerprint(
    ids: np.ndarray | IdText,
    features: Features,
    labels: np.ndarray | None,
    preprocessing: Preprocessing,
    rows: np.ndarray | None = None,
) -> str:
    """The hex SHA-256 described in the module docstring, of the positions ``rows`` (default
    all) of ``ids`` (an array of str or an `IdText`: the same digest), ``features`` and
    ``labels``: the same as hashing ``ids[rows]`` and so on, without holding a copy of the
    selected rows (they are hashed a chunk at a time)."""
    selected = np.arange(len(ids)) if rows is None else np.asarray(rows, np.int64)
    arrays = {"numeric": (features.numeric, "<f4"), "categorical": (features.categorical, "<i4")}
    if labels is not None:
        arrays["labels"] = (labels, labels.dtype.newbyteorder("<").str)
    header: dict[str, Any] = {
        "rows": len(selected),
        "arrays": {
            k: {"shape": [len(selected), *a.shape[1:]], "dtype": np.dtype(t).str}
            for k, (a, t) in arrays.items()
        },
        "preprocessing": preprocessing.to_json(),
    }
    digest = hashlib.sha256(VERSION)
    digest.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8"))
    chunks = [selected[i : i + _CHUNK] for i in range(0, len(selected), _CHUNK)]
    if isinstance(ids, IdText):
        lengths = ids.lengths()
        for chunk in chunks:
            digest.update(np.ascontiguousarray(lengths[chunk], "<i8").data)
        for chunk in chunks:
            digest.update(ids.take(chunk).data.data)
    else:
        for chunk in chunks:
            part = ids[chunk]
            lengths = np.fromiter(map(len, map(str.encode, part)), np.int64, count=len(part))
            digest.update(np.ascontiguousarray(lengths, "<i8").data)
        for chunk in chunks:
            digest.update("".join(ids[chunk]).encode("utf-8"))
    for array, dtype in arrays.values():
        for chunk in chunks:
            digest.update(np.ascontiguousarray(array[chunk], np.dtype(dtype)).data)
            features.release()  # a spilled matrix holds one chunk at a time
    return digest.hexdigest()


__all__ = ["fingerprint"]
