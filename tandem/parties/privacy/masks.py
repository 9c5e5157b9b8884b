"""Pairwise masks of the secure sum: authenticated key agreement between followers, and the
pseudo-random masks derived from the agreed seeds. Needs the ``keys`` extra (cryptography).

Key agreement: each follower makes a fresh X25519 key pair per task and publishes an `offer`,
its public key signed with its own Ed25519 identity key (``[security] private_key``) over the
task's context (spec hash) and its name. The leader relays offers but cannot alter or
substitute one: `agree` checks every offer against the roster of public keys and refuses an
offer signed by any key but its claimed sender's. A shared HMAC secret would let the relaying
leader forge offers, so a secure sum needs per-party keys.

Masks: for follower ``i`` the mask is ``sum_{j != i} s_ij * PRG(seed_ij, step, row)``, with
``s_ij = +1`` if ``i < j`` (by name) else ``-1``; the masks of all followers add to zero mod
``2^k``. The PRG is AES-128 in counter mode whose counter blocks are ``(row id, block)`` under a
key derived from the seed and the step, so a row's mask depends only on (seed, step, row id),
never on how the batch is split into micro-batches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np

from tandem._extras import needs
from tandem.errors import AuthenticationError, ConfigError

_DOMAIN = b"tandem secure sum v1\n"


def _offer_bytes(context: str, party: str, public_hex: str) -> bytes:
    return _DOMAIN + f"offer\n{context}\n{party}\n{public_hex}".encode()


class KeyShare:
    """One follower's X25519 key pair for one task (fresh per task; never written to disk)."""

    def __init__(self) -> None:
        with needs("keys", "the secure sum's key agreement"):
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        self._private = X25519PrivateKey.generate()
        self.public_hex = (
            self._private.public_key()
            .public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            .hex()
        )

    def offer(self, party: str, signer, context: str) -> dict:
        """The signed offer the leader relays: ``{"party", "public", "key_id", "signature"}``.
        ``signer`` is the party's `tandem.transports.keys.SigningKey`."""
        if signer is None:
            raise ConfigError(
                "model.aggregate = 'secure_sum' needs per-party signing keys: set [security] "
                "private_key and the roster of public keys ([security.public_keys]); with "
                "only a shared secret the relaying leader could substitute the followers' keys"
            )
        data = _offer_bytes(context, party, self.public_hex)
        return {
            "party": party,
            "public": self.public_hex,
            "key_id": signer.key_id,
            "signature": signer.sign(data),
        }

    def agree(
        self, party: str, offers: Sequence[Mapping], roster, context: str
    ) -> dict[str, bytes]:
        """The 32-byte seed shared with each other follower, from their relayed ``offers``,
        each checked against ``roster`` (`tandem.transports.keys.Roster`):
        `AuthenticationError` naming the offer that fails."""
        with needs("keys", "the secure sum's key agreement"):
            from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey
        seeds: dict[str, bytes] = {}
        for o in offers:
            peer = str(o.get("party", ""))
            if peer == party:
                continue
            try:
                data = _offer_bytes(context, peer, str(o["public"]))
                roster.check(str(o["key_id"]), str(o["signature"]), data, peer)
                public = X25519PublicKey.from_public_bytes(bytes.fromhex(str(o["public"])))
            except (KeyError, ValueError) as exc:
                raise AuthenticationError(
                    f"the secure-sum offer of {peer[:80]!r} is malformed ({exc}); the leader "
                    "relays offers unchanged"
                ) from None
            except AuthenticationError as exc:
                raise AuthenticationError(
                    f"the secure-sum offer relayed for {peer[:80]!r} fails its signature check: "
                    f"{exc}. Its key may have been substituted; check [security.public_keys]"
                ) from None
            shared = self._private.exchange(public)
            a, b = sorted((party, peer))
            seeds[peer] = hashlib.sha256(
                _DOMAIN + f"seed\n{context}\n{a}\n{b}\n".encode() + shared
            ).digest()
        return seeds


def prg(seed: bytes, step: int, rows: np.ndarray, width: int, dtype: np.dtype) -> np.ndarray:
    """``dtype[len(rows), width]`` pseudo-random words for ``rows`` (int ids) at ``step``:
    AES-128-CTR keystream with counter blocks ``(row id, block index)``."""
    with needs("keys", "the secure sum's masks"):
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    dtype = np.dtype(dtype)
    key = hashlib.sha256(_DOMAIN + b"prg\n" + seed + int(step).to_bytes(8, "little")).digest()
    per_row = -(-width * dtype.itemsize // 16)
    rows = np.asarray(rows, dtype=np.uint64).reshape(-1)
    blocks = np.empty((rows.size, per_row, 2), dtype="<u8")
    blocks[:, :, 0] = rows[:, None]
    blocks[:, :, 1] = np.arange(per_row, dtype=np.uint64)[None, :]
    enc = Cipher(algorithms.AES(key[:16]), modes.ECB()).encryptor()
    stream = enc.update(blocks.tobytes()) + enc.finalize()
    words = np.frombuffer(stream, dtype=dtype.newbyteorder("<")).reshape(rows.size, -1)
    return words[:, :width].astype(dtype)


def mask(
    party: str, seeds: Mapping[str, bytes], step: int, rows: np.ndarray, width: int, dtype
) -> np.ndarray:
    """Follower ``party``'s mask for ``rows`` at ``step``: ``+PRG`` towards every follower
    named after it, ``-PRG`` towards every one named before; all followers' masks sum to 0."""
    out = np.zeros((np.asarray(rows).size, width), dtype=dtype)
    for peer in sorted(seeds):
        words = prg(seeds[peer], step, rows, width, dtype)
        if party < peer:
            out += words
        else:
            out -= words
    return out
