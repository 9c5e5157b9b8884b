"""Shamir t-of-n secret sharing of byte strings over the prime field GF(2**256 + 297).

`PRIME` is the smallest prime above ``2**256``, so a 32-byte secret (a seed, an X25519 key) is
one field element. A longer secret is cut into chunks of `CHUNK` (32) bytes; each chunk gets
its own random
polynomial of degree ``t - 1`` with the chunk as constant term, and share ``x`` (an integer in
``[1, n]``) holds the polynomials' values at ``x``. Any ``t`` distinct shares rebuild the
secret by Lagrange interpolation at 0; fewer reveal nothing about it (information-theoretic,
within the random coefficients' statistical distance from uniform, below ``2**-78``: `DRAW`).

A share travels as `ELEMENT` (33) little-endian bytes per chunk. Pure Python integers: a
32-byte secret split among 100 clients with t = 80 takes a few milliseconds.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, Sequence

from tandem.errors import TandemError

PRIME = 2**256 + 297  # the smallest prime above 2**256 (tests check it)
CHUNK = 32  # bytes of secret per field element
ELEMENT = 33  # bytes of a field element on the wire


class ShareError(TandemError, ValueError):
    """Shares that cannot rebuild a secret (too few, duplicated, or malformed)."""


def _chunks(secret: bytes) -> list[int]:
    return [int.from_bytes(secret[i : i + CHUNK], "little") for i in range(0, len(secret), CHUNK)]


#: bytes drawn per random coefficient: 79 bits beyond the field's 257, so the draw reduced mod
#: `PRIME` is uniform within ``2**-78`` (the "extra random bits" method of FIPS 186-5, A.2.1)
DRAW = 42


def _random_elements(k: int) -> list[int]:
    """``k`` uniform elements of GF(PRIME) from one read of the system's CSPRNG (a read per
    element, with `secrets.randbelow`'s rejection, cost more than the arithmetic)."""
    pool = os.urandom(DRAW * k)
    return [int.from_bytes(pool[i : i + DRAW], "little") % PRIME for i in range(0, DRAW * k, DRAW)]


def split(secret: bytes, xs: Sequence[int], t: int) -> dict[int, bytes]:
    """Shares of ``secret`` at the points ``xs`` (distinct integers in ``[1, PRIME)``), any
    ``t`` of which rebuild it; returns ``{x: share bytes}``."""
    if not 1 <= t <= len(xs):
        raise ShareError(f"threshold t={t} must be in [1, {len(xs)}] (the number of shares)")
    if len(set(xs)) != len(xs) or not all(0 < x < PRIME for x in xs):
        raise ShareError(f"share points must be distinct and in [1, PRIME), got {list(xs)}")
    out: dict[int, list[int]] = {x: [] for x in xs}
    for c in _chunks(secret):
        coeffs = [c, *_random_elements(t - 1)]
        for x in xs:
            acc = 0
            for a in reversed(coeffs):  # Horner
                acc = (acc * x + a) % PRIME
            out[x].append(acc)
    return {x: b"".join(v.to_bytes(ELEMENT, "little") for v in ys) for x, ys in out.items()}


def lagrange_at_zero(xs: Sequence[int]) -> list[int]:
    """The coefficients ``l_i`` with ``f(0) = sum_i l_i f(x_i)`` for any polynomial of degree
    ``< len(xs)`` (cached: a round rebuilds every secret from the same points)."""
    return list(_lagrange(tuple(xs)))


@functools.lru_cache(maxsize=64)
def _lagrange(xs: tuple[int, ...]) -> tuple[int, ...]:
    if len(set(xs)) != len(xs):
        raise ShareError(f"share points must be distinct, got {list(xs)}")
    coeffs = []
    for i, xi in enumerate(xs):
        num = den = 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        coeffs.append(num * pow(den, -1, PRIME) % PRIME)  # extended Euclid: 25x Fermat's
    return tuple(coeffs)


def combine(shares: Mapping[int, bytes], length: int, t: int) -> bytes:
    """The ``length``-byte secret from at least ``t`` shares ``{x: share bytes}`` (the first
    ``t`` by point are used). Wrong shares give a wrong secret, not an error: callers check the
    result against a commitment."""
    if len(shares) < t:
        raise ShareError(f"{len(shares)} shares cannot rebuild a secret shared {t}-of-n")
    xs = sorted(shares)[:t]
    n_chunks = -(-length // CHUNK)
    for x in xs:
        if len(shares[x]) != n_chunks * ELEMENT:
            raise ShareError(f"share {x} has {len(shares[x])} bytes, expected {n_chunks * ELEMENT}")
    lam = lagrange_at_zero(xs)
    out = bytearray()
    for k in range(n_chunks):
        acc = 0
        for x, coef in zip(xs, lam, strict=True):
            y = int.from_bytes(shares[x][k * ELEMENT : (k + 1) * ELEMENT], "little")
            acc = (acc + coef * y) % PRIME
        size = min(CHUNK, length - k * CHUNK)
        if acc >= 1 << (8 * size):
            raise ShareError("the shares are inconsistent: the rebuilt chunk is out of range")
        out += acc.to_bytes(size, "little")
    return bytes(out)


def share_size(length: int) -> int:
    """Bytes of one share of a ``length``-byte secret."""
    return -(-length // CHUNK) * ELEMENT
