"""ECDH-PSI core over X25519: hash to the curve, blinding, matching. Pure.

No asyncio, no JAX. The functions that do curve work take and return *plain bytes* so a
process pool can run them on chunks without pickling any object (see `psi`).

The scheme (symmetric Diffie-Hellman PSI, as in Huberman-Franklin-Hogg / Meadows):

* every id is encoded canonically (`ids.canonical`, re-exported here) and hashed to the
  u-coordinate of a point ``H(x)`` on Curve25519 (`hash_to_u`, try-and-increment on SHA-256);
* party A sends ``a*H(x)`` for its ids (shuffled), B sends ``b*H(y)`` for its ids (shuffled);
* each side multiplies what it received by its own scalar and returns it in the order received:
  ``b*a*H(x) == a*b*H(x)`` because X25519 scalar multiplications commute;
* each side matches the doubly blinded values of its own ids (returned by the peer) against the
  doubly blinded values of the peer's ids (computed locally). Equal values mean equal ids.

Scalar multiplication is done only by `cryptography`'s X25519 (OpenSSL); this module writes no
curve arithmetic. The one piece of field arithmetic is the membership test in `hash_to_u`
(is ``u^3 + A*u^2 + u`` a square mod p, via `gmpy2.legendre`), which keeps every hashed point on
the curve rather than its twist: without it, a received value would reveal one bit of the
hash of each id (curve or twist), a fingerprint the protocol must not leak.

Invariants:
* `hash_to_u` returns a canonical (``< p``, top bit clear) u on the curve, never of small
  order; `blind` output is again such a value (X25519 clears the cofactor), so blinded values
  of equal ids are byte-equal and of different ids differ except with negligible probability.
* `blind_points` rejects (raises `ProtocolError`) any input that is not such a value, so a
  malicious peer cannot feed twist or small-order points into our scalar.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from tandem._extras import needs
from tandem.parties.data.canonical_ids import DOMAIN, SCHEME, canonical, canonicalise, commitment

from .errors import AlignmentConfigError, ProtocolError

with needs("psi", "private set intersection (tandem align)"):
    import gmpy2
    from cryptography.hazmat.primitives.asymmetric.x25519 import (
        X25519PrivateKey,
        X25519PublicKey,
    )

__all__ = [
    "POINT_BYTES",
    "SCHEME",
    "blind_points",
    "canonical",
    "canonicalise",
    "commitment",
    "hash_and_blind",
    "hash_to_u",
    "match",
]

#: Bytes of one curve point (u-coordinate, little-endian).
POINT_BYTES = 32
_P = 2**255 - 19
_PZ = gmpy2.mpz(_P)
_A = gmpy2.mpz(486662)
_MASK255 = (1 << 255) - 1
#: u-coordinates of the points of small order (RFC 7748 section 5 and libsodium's list).
_SMALL_ORDER = frozenset(
    {
        0,
        1,
        _P - 1,
        325606250916557431795983626356110631294008115727848805560023387167927233504,
        39382357235489614581723060781553021112529911719440698176882885853963445705823,
    }
)


def hash_to_u(key: bytes) -> bytes:
    """Hash a canonical id to the u-coordinate (32 bytes, little-endian) of a curve point.

    Try-and-increment: ``u = SHA-256(domain | counter | key)`` with the top bit cleared, the
    first counter for which ``u < p``, u is not of small order, and ``u^3 + A u^2 + u`` is a
    non-zero square (the point is on Curve25519, not its twist). About two tries on average.
    """
    for counter in range(256):
        digest = hashlib.sha256(DOMAIN + counter.to_bytes(1, "little") + key).digest()
        u = int.from_bytes(digest, "little") & _MASK255
        if u >= _P or u in _SMALL_ORDER:
            continue
        if _on_curve(u):
            return u.to_bytes(POINT_BYTES, "little")
    raise RuntimeError("unreachable: 256 failed tries has probability 2**-256")  # pragma: no cover


def _on_curve(u: int) -> bool:
    uz = gmpy2.mpz(u)
    return gmpy2.legendre((uz * uz * uz + _A * uz * uz + uz) % _PZ, _PZ) == 1


def hash_and_blind(secret: bytes, keys: Sequence[bytes]) -> bytes:
    """``secret * H(key)`` for each key, concatenated (``len(keys) * 32`` bytes).

    Pool worker: takes the 32-byte scalar and a list of canonical ids, returns plain bytes.
    """
    scalar = X25519PrivateKey.from_private_bytes(secret)
    load = X25519PublicKey.from_public_bytes
    return b"".join(scalar.exchange(load(hash_to_u(k))) for k in keys)


def blind_points(secret: bytes, points: bytes, keep: int = POINT_BYTES) -> bytes:
    """``secret * P`` for each 32-byte point in ``points``, each truncated to ``keep`` bytes.

    Every input point is validated first (canonical, on the curve, not of small order); a bad
    one raises `ProtocolError` naming its index in this chunk. Pool worker: bytes in, bytes out.
    """
    if len(points) % POINT_BYTES:
        raise ProtocolError(f"blinded points blob of {len(points)} bytes is not a multiple of 32")
    if not 1 <= keep <= POINT_BYTES:
        raise AlignmentConfigError(f"keep must be in [1, 32] bytes, got {keep}")
    scalar = X25519PrivateKey.from_private_bytes(secret)
    load = X25519PublicKey.from_public_bytes
    out = []
    view = memoryview(points)
    for i in range(len(points) // POINT_BYTES):
        raw = bytes(view[i * POINT_BYTES : (i + 1) * POINT_BYTES])
        u = int.from_bytes(raw, "little")
        if u >= _P or u in _SMALL_ORDER or not _on_curve(u):
            raise ProtocolError(
                f"point {i} of the chunk is not a valid blinded value (not a canonical "
                "u-coordinate of a Curve25519 point of large order); the peer is not running "
                f"the {SCHEME} scheme or its data was corrupted"
            )
        out.append(scalar.exchange(load(raw))[:keep])
    return b"".join(out)


def match(own_doubles: bytes, peer_doubles: bytes, width: int) -> list[int]:
    """Positions ``j`` of ``own_doubles`` (``width``-byte records) found in ``peer_doubles``."""
    if len(own_doubles) % width or len(peer_doubles) % width:
        raise ProtocolError(f"doubly blinded blobs must be multiples of {width} bytes")
    peer = {peer_doubles[i : i + width] for i in range(0, len(peer_doubles), width)}
    return [
        j
        for j in range(len(own_doubles) // width)
        if own_doubles[j * width : (j + 1) * width] in peer
    ]
