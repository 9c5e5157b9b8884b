"""The pure ECDH-PSI core: canonical ids, hash to curve, commuting blinding, validation."""

import hashlib

import gmpy2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.parties.alignment import ecdh
from tandem.parties.alignment.errors import IdError, ProtocolError

P = 2**255 - 19


def on_curve(u: bytes) -> bool:
    x = gmpy2.mpz(int.from_bytes(u, "little"))
    return gmpy2.legendre((x**3 + 486662 * x**2 + x) % P, P) == 1


def test_canonical_encoding():
    assert ecdh.canonical("abc") == b"abc"
    assert ecdh.canonical("é") == "é".encode()
    assert ecdh.canonical(42) == ecdh.canonical("42") == ecdh.canonical(np.int64(42)) == b"42"
    assert ecdh.canonical(-7) == b"-7"
    for bad in (True, 1.0, b"x", None, ("a",)):
        with pytest.raises(IdError, match="must be str or int"):
            ecdh.canonical(bad, index=3)


def test_canonicalise_drops_duplicates_keeping_first_row():
    keys, rows, dups = ecdh.canonicalise(["b", 1, "a", "1", "b", 2])
    assert keys == [b"b", b"1", b"a", b"2"]
    assert rows == [0, 1, 2, 5]
    assert dups == 2


def test_canonicalise_names_the_bad_position():
    with pytest.raises(IdError, match="position 2"):
        ecdh.canonicalise(["a", 1, 2.5])


@settings(max_examples=examples(50), deadline=None)
@given(st.binary(max_size=40))
def test_hash_to_u_is_a_canonical_curve_point(key):
    u = ecdh.hash_to_u(key)
    assert len(u) == 32 and u[31] < 128
    assert int.from_bytes(u, "little") < P
    assert on_curve(u)
    assert ecdh.hash_to_u(key) == u


def test_blinding_commutes_and_distinguishes():
    a, b = bytes(range(32)), bytes(range(1, 33))
    keys = [b"alice", b"bob", b"carol"]
    ha = ecdh.hash_and_blind(a, keys)
    hb = ecdh.hash_and_blind(b, keys)
    assert ha != hb and len(ha) == 96
    for blob in (ha, hb):  # blinded values stay on the curve
        assert all(on_curve(blob[i : i + 32]) for i in range(0, 96, 32))
    assert ecdh.blind_points(b, ha) == ecdh.blind_points(a, hb)
    assert (
        ecdh.blind_points(b, ha, keep=16)
        == ecdh.blind_points(a, hb)[:16]
        + ecdh.blind_points(a, hb)[32:48]
        + ecdh.blind_points(a, hb)[64:80]
    )
    dbl = ecdh.blind_points(b, ha)
    assert len({dbl[i : i + 32] for i in range(0, 96, 32)}) == 3


def twist_point() -> bytes:
    for i in range(100):
        u = int.from_bytes(hashlib.sha256(bytes([i])).digest(), "little") & ((1 << 255) - 1)
        if u < P and not on_curve(u.to_bytes(32, "little")):
            return u.to_bytes(32, "little")
    raise RuntimeError("no twist point found")


@pytest.mark.parametrize(
    "bad",
    [
        (P + 1).to_bytes(32, "little"),  # non-canonical
        (0).to_bytes(32, "little"),  # small order
        (1).to_bytes(32, "little"),  # small order
        twist_point(),  # on the twist, not the curve
    ],
)
def test_blind_points_rejects_invalid_points(bad):
    good = ecdh.hash_and_blind(bytes(32), [b"x"])
    with pytest.raises(ProtocolError, match="point 1 of the chunk"):
        ecdh.blind_points(bytes(range(32)), good + bad)


def test_blind_points_rejects_ragged_blob():
    with pytest.raises(ProtocolError, match="multiple of 32"):
        ecdh.blind_points(bytes(32), b"\x01" * 33)


def test_match_and_commitment():
    own = b"aa" + b"bb" + b"cc"
    peer = b"cc" + b"zz" + b"aa"
    assert ecdh.match(own, peer, 2) == [0, 2]
    assert ecdh.match(b"", peer, 2) == []
    assert ecdh.commitment([b"a", b"bc"]) != ecdh.commitment([b"ab", b"c"])
    assert ecdh.commitment([b"a", b"b"]) != ecdh.commitment([b"b", b"a"])
    assert ecdh.commitment([]) == ecdh.commitment(iter([]))
