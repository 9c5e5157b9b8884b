"""Sample ids: their text, a 64-bit hash of that text, and the check that none repeats.

An id is its text (UTF-8), as `tandem align` compares ids: integer ids are their decimal text,
so the int 42 and the string "42" are one id. `id_hashes` is a fixed function of that text,
identical on every machine and version of this format, computed without a Python loop per
row: ``h = sum_i (b_i + 1) * P**i  (mod 2**64)`` over the id's bytes ``b_i``, then mixed with
its byte length by the SplitMix64 finaliser.
"""

from __future__ import annotations

import numpy as np

from .idtext import IdText

_P = np.uint64(0x100000001B3)
_CHUNK = 1 << 16  # ids hashed at a time: bounds the temporary arrays to a few MB


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The SplitMix64 finaliser of a uint64 array (a bijection that scatters its input)."""
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def id_hashes(ids: np.ndarray | IdText) -> np.ndarray:
    """uint64 hash of every id (an array of str, or an `IdText`), by the rule in the module
    docstring."""
    out = np.empty(len(ids), np.uint64)
    if isinstance(ids, IdText):
        start = 0
        for lengths, text in ids.chunks(_CHUNK):
            out[start : start + len(lengths)] = _hash_utf8(np.frombuffer(text, np.uint8), lengths)
            start += len(lengths)
        return out
    for start in range(0, len(ids), _CHUNK):
        out[start : start + _CHUNK] = _hash_chunk(ids[start : start + _CHUNK])
    return out


def _hash_chunk(ids: np.ndarray) -> np.ndarray:
    text = "".join(ids)
    data = np.frombuffer(text.encode("utf-8"), np.uint8)
    lengths = np.fromiter(map(len, ids), np.int64, count=len(ids))
    if data.size != len(text):  # some id is not ASCII: count bytes, not characters
        lengths = np.fromiter(map(len, map(str.encode, ids)), np.int64, count=len(ids))
    return _hash_utf8(data, lengths)


def _hash_utf8(data: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The hashes of ids whose UTF-8 bytes ``data`` lie back to back, ``lengths`` bytes each."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    longest = int(lengths.max()) if len(lengths) else 0
    powers = np.ones(max(longest, 1), np.uint64)
    if longest > 1:
        powers[1:] = np.cumprod(np.full(longest - 1, _P, np.uint64))
    position = np.arange(data.size, dtype=np.int64) - np.repeat(offsets[:-1], lengths)
    terms = (data.astype(np.uint64) + np.uint64(1)) * powers[position]
    sums = np.zeros(data.size + 1, np.uint64)
    np.cumsum(terms, out=sums[1:])
    polynomial = sums[offsets[1:]] - sums[offsets[:-1]]
    return splitmix64(polynomial ^ splitmix64(lengths.astype(np.uint64)))


def first_duplicate(
    ids: np.ndarray | IdText, hashes: np.ndarray | None = None
) -> tuple[str, int, int] | None:
    """``(id, first row, second row)`` of an id that occurs twice, or None. ``hashes`` is
    ``id_hashes(ids)`` when the caller has it already."""
    hashes = id_hashes(ids) if hashes is None else hashes
    order = np.argsort(hashes, kind="stable")
    ordered = hashes[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    del ordered
    text = ids.item if isinstance(ids, IdText) else ids.__getitem__
    for k in same:  # hash collisions are checked on the text itself
        a, b = int(order[k]), int(order[k + 1])
        if text(a) == text(b):
            return str(text(a)), min(a, b), max(a, b)
    return None


__all__ = ["first_duplicate", "id_hashes", "splitmix64"]
