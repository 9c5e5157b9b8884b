"""The keyed tag of a bulk body signed with a shared secret: AES-128-GMAC under a key that
only the secret's holders can derive, one key per request.

A signed bulk body needs every byte authenticated, at close to socket speed. Under a shared
secret (HMAC-SHA256 signatures, `tandem.transports.auth`) the body need not be hashed with a
collision-resistant hash: a MAC keyed by a secret the attacker does not hold is enough. The
sender signs the request head with the body digest `auth.DEFERRED_MAC`; both ends derive

    key || iv = HMAC-SHA256(secret[key_id], "tandem-body-gmac-1\\n" || canonical head)

(the head's signed canonical string: its random nonce makes the key single-use), feed every
body byte to GHASH as associated data of an AES-128-GCM encryption of nothing, and the tag
travels in the head's signed trailer as ``"gmac:" + 32 hex digits``. GHASH runs at tens of
GB/s on one core (carry-less multiply in OpenSSL), several times BLAKE3's speed, so the MAC is
computed on the loop as the bytes go out or come in, while still in cache.

Per-party keys (Ed25519) have no shared secret: their bulk bodies keep the BLAKE3 digest.
GMAC needs the ``cryptography`` package (the ``keys`` extra); a sender without it signs with
BLAKE3 (`available`), a receiver without it refuses a GMAC body (400) naming the extra.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import importlib.util

from tandem._extras import needs

MAC_PREFIX = "gmac:"
TAG_HEX = 32  # hex digits of a tag (16 bytes)
_LABEL = b"tandem-body-gmac-1\n"


@functools.cache
def available() -> bool:
    """Whether this process can compute GMAC tags (``cryptography`` is installed)."""
    return importlib.util.find_spec("cryptography") is not None


class BodyMac:
    """AES-128-GMAC of a body fed in pieces (`update`); `hexdigest` once every byte went in.

    ``update`` takes any buffer without copying it and keeps up with memory bandwidth, so
    callers run it on the loop, right after the bytes were written or received."""

    def __init__(self, secret: bytes, canonical_head: bytes) -> None:
        okm = hmac.new(secret, _LABEL + canonical_head, hashlib.sha256).digest()
        with needs("keys", "the GMAC tag of bulk bodies signed with a shared secret"):
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        self._ctx = Cipher(algorithms.AES(okm[:16]), modes.GCM(okm[16:28])).encryptor()
        self._hex: str | None = None

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._hex is not None:
            raise RuntimeError("BodyMac.update after hexdigest")
        self._ctx.authenticate_additional_data(data)

    def hexdigest(self) -> str:
        """The tag (32 hex digits); the MAC takes no more bytes afterwards."""
        if self._hex is None:
            self._ctx.finalize()
            self._hex = self._ctx.tag.hex()
        return self._hex


def is_tag(value: str) -> bool:
    """Whether ``value`` is ``"gmac:"`` and 32 lower-case hex digits."""
    hexpart = value[len(MAC_PREFIX) :]
    return (
        value.startswith(MAC_PREFIX)
        and len(hexpart) == TAG_HEX
        and all(c in "0123456789abcdef" for c in hexpart)
    )
