"""Sample ids as the PSI sees them: the canonical byte encoding of one id, duplicates
dropped, and the commitment to an agreed list. Pure: hashlib only.

Data, not alignment: the PSI (`tandem.parties.alignment`) hashes these encodings, and the
aligned-rows file (`aligned_file`) and a party's keyed rows
(`tandem.parties.split.process.party_data`) commit to its ids with the same `commitment`,
without the ``psi`` extra's crypto.
"""

from __future__ import annotations

import hashlib
import numbers
from collections.abc import Iterable

from .errors import IdError

#: Identifier of the scheme, exchanged in the hello frame; both sides must agree.
SCHEME = "x25519-sha256-tai-v1"
#: Prefix of every hash the scheme computes (ids to points, the commitment).
DOMAIN = b"tandem/psi/" + SCHEME.encode() + b"/"


def canonical(value: object, *, index: int | None = None) -> bytes:
    """The canonical byte encoding of one id.

    Strings encode as UTF-8 (exactly as given: no case folding or Unicode normalisation).
    Integers (Python or numpy) encode as their decimal text, so the int ``42`` and the string
    ``"42"`` are the same id (a CSV read as text aligns with integer keys). Anything else
    (bool, float, bytes, None, ...) is refused with `IdError`: floats would make ``1.0`` vs
    ``1`` ambiguous; convert such ids to str or int first.
    """
    where = f" at position {index}" if index is not None else ""
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise IdError(f"id{where} is not valid Unicode text: {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise IdError(
            f"id{where} has type {type(value).__name__} ({value!r}); ids must be str or int "
            "(convert floats/bytes/other keys to str or int before aligning)"
        )
    return str(int(value)).encode("ascii")


def canonicalise(ids: Iterable[object]) -> tuple[list[bytes], list[int], int]:
    """Canonical ids without duplicates, in first-occurrence order.

    Returns ``(keys, rows, duplicates)``: ``keys[i]`` first occurs at row ``rows[i]`` of
    ``ids``; ``duplicates`` counts the rows dropped because their id occurred earlier.
    """
    seen: dict[bytes, int] = {}
    n = 0
    for i, value in enumerate(ids):
        key = canonical(value, index=i)
        if key not in seen:
            seen[key] = i
        n += 1
    return list(seen.keys()), list(seen.values()), n - len(seen)


def commitment(keys: Iterable[bytes]) -> str:
    """Hex SHA-256 over the canonical ids in the given (agreed, sorted) order.

    Each id is length-prefixed (u32 little-endian), so the list is encoded unambiguously.
    """
    h = hashlib.sha256(DOMAIN + b"commitment/")
    for k in keys:
        h.update(len(k).to_bytes(4, "little"))
        h.update(k)
    return h.hexdigest()
