"""Hashed buckets of a categorical column (``[data] hash_buckets``): codes without a vocabulary.

A value's code is ``1 + H(text, seed) mod buckets``, where ``text`` is the value as text (an
integer is its decimal text, as ids and vocabularies compare values) and ``H`` is
`tandem.parties.data.ids.id_hashes` (a fixed polynomial hash of the UTF-8 bytes, mixed by
SplitMix64) mixed with the seed by SplitMix64 again. It is a fixed function of the value, the
seed and the bucket count, identical on every machine, process and version of this format
(never Python's salted ``hash``), so every party maps a value to the same code and no party
needs to see another's values. Code 0 stays reserved for a missing cell; distinct values may
share a bucket (a collision), which the model cannot tell apart.

Invariant: ``1 <= code <= buckets`` for every present cell, and ``buckets <= MAX_BUCKETS``, so
codes stay exact as float32 (below 2**24).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .ids import id_hashes, splitmix64

#: The most buckets a column may have: its codes, 0 included, are exact float32 numbers.
MAX_BUCKETS = 2**24 - 2


def hash_codes(values: np.ndarray, kind: str, buckets: int, seed: int) -> np.ndarray:
    """int32 codes ``1 + H(text, seed) mod buckets`` of ``values`` (a numpy column of
    ``kind`` "int" or "string")."""
    text = values.astype(str) if kind == "int" else values
    return _codes(id_hashes(np.asarray(text, dtype=object)), buckets, seed)


def arrow_hash_codes(text: Any, buckets: int, seed: int) -> np.ndarray:
    """`hash_codes` of pyarrow text cells (nulls, i.e. missing cells, hash as empty text; the
    caller sets their code to 0)."""
    import pyarrow.compute as pc

    values = pc.fill_null(text, "").to_numpy(zero_copy_only=False)
    return _codes(id_hashes(np.asarray(values, dtype=object)), buckets, seed)


def _codes(hashes: np.ndarray, buckets: int, seed: int) -> np.ndarray:
    mixed = splitmix64(hashes ^ splitmix64(np.full(1, seed, np.uint64)))
    return (mixed % np.uint64(buckets)).astype(np.int32) + 1


__all__ = ["MAX_BUCKETS", "arrow_hash_codes", "hash_codes"]
