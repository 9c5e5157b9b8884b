"""Per-party signing keys: Ed25519 key pairs, their files, and the roster of public keys that
binds each party's name to the keys it signs with. Pure (no asyncio).

A party holds one private key, which nobody else holds; every party holds the roster, the
public key(s) of every party by name. A request signed with a key is accepted only as coming
from the party the roster names for that key, so a party can sign as itself and as no one
else (`Roster.check`). Key ids are derived from the public key (`public_key_id`), so a
signature names the key it was made with and a receiver picks it without trying them all.

Rotation: a party generates a new pair, every roster lists both public keys under its name
(``name = ["old.pub", "new.pub"]``), the party switches its private key, then the old public
key leaves the rosters.

Files (``tandem keys generate NAME``): ``NAME.key``, the private key in PKCS#8 PEM, written
with mode 0600; ``NAME.pub``, the public key in SubjectPublicKeyInfo PEM.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from tandem.errors import AuthenticationError, ConfigError, IdentityError

SCHEME = "ed25519"


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def public_key_id(public: Ed25519PublicKey) -> str:
    """The id of a public key: 16 hex digits of a hash of its raw bytes."""
    return hashlib.sha256(b"tandem ed25519 key id\n" + _raw(public)).hexdigest()[:16]


class SigningKey:
    """One party's private key; ``key_id`` is its public key's id."""

    scheme = SCHEME

    def __init__(self, private: Ed25519PrivateKey) -> None:
        self._private = private
        self.public = private.public_key()
        self.key_id = public_key_id(self.public)

    def sign(self, data: bytes) -> str:
        """The hex Ed25519 signature of ``data``."""
        return self._private.sign(data).hex()

    @classmethod
    def from_pem(cls, pem: bytes, where: str = "the private key") -> SigningKey:
        """Load a PKCS#8 PEM Ed25519 private key; `ConfigError` naming ``where`` otherwise."""
        try:
            key = serialization.load_pem_private_key(pem.strip() + b"\n", password=None)
        except (ValueError, TypeError) as exc:
            raise ConfigError(
                f"{where} is not a PEM private key ({exc}); make one with `tandem keys "
                "generate NAME`"
            ) from None
        if not isinstance(key, Ed25519PrivateKey):
            raise ConfigError(
                f"{where} is not an Ed25519 key; make one with `tandem keys generate`"
            )
        return cls(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SigningKey:
        with open(path, "rb") as f:
            return cls.from_pem(f.read(), where=str(path))


def load_public_key(pem: bytes, where: str = "the public key") -> Ed25519PublicKey:
    """A SubjectPublicKeyInfo PEM Ed25519 public key; `ConfigError` naming ``where``."""
    try:
        key = serialization.load_pem_public_key(pem.strip() + b"\n")
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{where} is not a PEM public key ({exc}); use the NAME.pub file of "
            "`tandem keys generate NAME`"
        ) from None
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"{where} is not an Ed25519 public key")
    return key


class Roster:
    """Party name -> the public keys it may sign with (several during a rotation).

    Invariant: a key id belongs to exactly one name."""

    def __init__(self, keys: Mapping[str, Iterable[Ed25519PublicKey]]) -> None:
        self._by_id: dict[str, tuple[str, Ed25519PublicKey]] = {}
        for name, publics in keys.items():
            for public in publics:
                kid = public_key_id(public)
                owner = self._by_id.get(kid, (name, public))[0]
                if owner != name:
                    raise ConfigError(
                        f"the same public key is listed for {owner!r} and {name!r}; each "
                        "party needs its own key pair (`tandem keys generate NAME`)"
                    )
                self._by_id[kid] = (name, public)
        if not self._by_id:
            raise ConfigError("the roster of public keys is empty; list each party's NAME.pub")

    @classmethod
    def from_files(cls, files: Mapping[str, Iterable[str | os.PathLike[str]]]) -> Roster:
        keys = {}
        for name, paths in files.items():
            loaded = []
            for p in paths:
                with open(p, "rb") as f:
                    loaded.append(load_public_key(f.read(), where=f"{p} (public key of {name!r})"))
            keys[name] = loaded
        return cls(keys)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(name for name, _ in self._by_id.values())

    def key_ids(self, name: str) -> list[str]:
        return sorted(kid for kid, (owner, _) in self._by_id.items() if owner == name)

    def check(self, key_id: str, signature: str, data: bytes, sender: str) -> None:
        """Accept ``signature`` over ``data`` only from the roster member owning ``key_id``,
        and only if that member is ``sender``: `AuthenticationError` for an unknown key or a
        bad signature, `IdentityError` for a good signature of another member."""
        entry = self._by_id.get(key_id)
        if entry is None:
            raise AuthenticationError(
                f"unknown key id {key_id[:40]!r}: not in this receiver's roster of public keys"
            )
        owner, public = entry
        try:
            public.verify(bytes.fromhex(signature), data)
        except (InvalidSignature, ValueError):
            raise AuthenticationError(
                f"bad signature for key {key_id} of {owner!r} (altered request)"
            ) from None
        if owner != sender:
            raise IdentityError(
                f"signed with the key of {owner!r} but claims to come from {sender[:80]!r}: "
                "a party may sign only as itself"
            )


def generate(name: str, folder: str | os.PathLike[str] = ".") -> tuple[Path, Path]:
    """Write a new key pair ``NAME.key`` (0600, created exclusively: never overwritten) and
    ``NAME.pub`` into ``folder``; returns their paths."""
    if not name or any(c in name for c in "/\\\n") or name.startswith("."):
        raise ConfigError(f"key name must be a plain file name, got {name!r}")
    out = Path(folder)
    key_path, pub_path = out / f"{name}.key", out / f"{name}.pub"
    for p in (key_path, pub_path):
        if p.exists():
            raise ConfigError(
                f"{p} exists; remove it or choose another name (keys are never overwritten)"
            )
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(
        private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return key_path, pub_path


__all__ = [
    "Roster",
    "SigningKey",
    "generate",
    "load_public_key",
    "public_key_id",
]
