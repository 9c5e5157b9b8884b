"""The key material of one secure-aggregation round: X25519 key pairs, key agreement,
authenticated encryption of shares, signatures of advertised keys, share commitments.

Every derived key binds the round's label and both names, so nothing agreed for one pair or
one round serves another. Uses the `cryptography` package (extra ``keys``), imported lazily.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from tandem._extras import needs


def _x25519() -> Any:
    with needs("keys", "secure aggregation ([secagg])"):
        from cryptography.hazmat.primitives.asymmetric import x25519
    return x25519


class KeyPair:
    """An X25519 key pair; ``public`` is its 32 raw public bytes."""

    def __init__(self, private: Any = None) -> None:
        x = _x25519()
        self.private = private if private is not None else x.X25519PrivateKey.generate()
        self.public = public_bytes(self.private.public_key())

    @classmethod
    def from_secret(cls, raw: bytes) -> KeyPair:
        return cls(_x25519().X25519PrivateKey.from_private_bytes(raw))

    def secret(self) -> bytes:
        from cryptography.hazmat.primitives import serialization as s

        return self.private.private_bytes(s.Encoding.Raw, s.PrivateFormat.Raw, s.NoEncryption())

    def agree(self, peer_public: bytes, purpose: bytes, a: str, b: str) -> bytes:
        """A 32-byte key shared with the holder of ``peer_public`` for ``purpose`` between
        parties ``a`` and ``b`` (order does not matter)."""
        shared = self.private.exchange(_x25519().X25519PublicKey.from_public_bytes(peer_public))
        lo, hi = sorted((a, b))
        return hashlib.sha256(
            b"tandem secagg agree\n" + purpose + b"\n" + f"{lo}\n{hi}\n".encode() + shared
        ).digest()


def public_bytes(public: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization as s

    return public.public_bytes(s.Encoding.Raw, s.PublicFormat.Raw)


def advert_bytes(label: bytes, name: str, c_pk: bytes, s_pk: bytes) -> bytes:
    """What a client signs when it advertises its two public keys for a round."""
    return b"tandem secagg advertise\n" + label + b"\n" + name.encode() + b"\n" + c_pk + s_pk


NONCE = 12  # bytes of a sealed box's nonce


def seal(key: bytes, plaintext: bytes, aad: bytes, nonce: bytes | None = None) -> bytes:
    """AES-256-GCM: 12-byte nonce + ciphertext + 16-byte tag. ``nonce`` must be fresh random
    bytes (a dealer draws all of its boxes' nonces in one read); None draws them here."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(NONCE) if nonce is None else nonce
    if len(nonce) != NONCE:
        raise ValueError(f"a nonce is {NONCE} bytes, got {len(nonce)}")
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, sealed: bytes, aad: bytes) -> bytes | None:
    """The plaintext of `seal`, or None when it was not sealed with ``key`` and ``aad``."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        return AESGCM(key).decrypt(sealed[:12], sealed[12:], aad)
    except (InvalidTag, ValueError):
        return None


def commit(label: bytes, dealer: str, holder: str, what: bytes, share: bytes) -> bytes:
    """The hash a dealer publishes for the share ``holder`` gets of its secret ``what``; the
    server checks every share returned to it against this (a lying holder is named)."""
    return hashlib.sha256(
        b"tandem secagg share\n" + label + b"\n" + f"{dealer}\n{holder}\n".encode() + what + share
    ).digest()


def secret_hash(label: bytes, dealer: str, secret: bytes) -> bytes:
    """The hash a dealer publishes of its self-mask seed, checked after reconstruction."""
    return hashlib.sha256(
        b"tandem secagg seed\n" + label + b"\n" + dealer.encode() + b"\n" + secret
    ).digest()
