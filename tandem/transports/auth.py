"""Request authentication bound to its receiver, with key ids and per-sender replay
protection: a shared secret (HMAC-SHA256: every party trusts every other, since any secret
holder can sign as any party) or per-party keys (Ed25519, `tandem.transports.keys`: each
party signs with a key only it holds, checked against a roster of public keys that binds the
key to the sender's name). Pure (no asyncio).

The signer covers a version tag, the key id, the HTTP method, the path, the receiver's name and
incarnation, every ``X-Tandem-*`` routing header listed in `SIGNED_HEADERS` (sender,
incarnation, channel, message id, base id, chunk, offset, total, spec hash, reply URL), a
timestamp, a random nonce and the body's digest (`body_digest`: ``"blake3:"`` and the hex
BLAKE3-256 of every body byte, a collision-resistant hash that runs several times faster than
SHA-256, so signing and verifying a bulk body keep up with the socket)::

    mac = HMAC-SHA256(key[key_id], "\\n".join([VERSION, key_id, method, path, receiver, to,
                                               *routing values, ts, nonce, body_digest]))

``receiver`` is the receiving party's name and ``to`` its incarnation (random per process), so
a request captured on its way to one process is refused by every other one: another party, a
restarted process of the same party, or a party of another job that shares the secret and the
party names. A sender learns a receiver's incarnation from the receiver's first answer
(`MisdirectedError`: HTTP 421 naming it, sent only to requests with a valid signature).

With per-party keys the same canonical string (under the version tag `VERSION_KEYS`) is
signed with the sender's Ed25519 key and ``X-Tandem-Signature`` carries that signature.

A bulk body's head may defer its digest to a signed trailer after the body: `DEFERRED` (its
BLAKE3 digest follows) or, under a shared secret, `DEFERRED_MAC` (its AES-GMAC tag follows,
keyed by the secret and the signed head: `body_mac`, `tandem.transports.bodymac`).

Keys carry an id (``X-Tandem-Key-Id``); a verifier holds several (the current one and the
previous one during a rotation; with per-party keys, every key of every roster member) and
picks the one the request names.

The verifier refuses a request, in this order, when a header is missing, the key id is unknown,
the MAC differs (constant-time compare) or the signature does not verify, the key belongs to
another roster member than the claimed sender (`IdentityError`), the request is addressed to
another receiver, its timestamp is more than ``future_skew`` seconds ahead of the verifier's
clock or more than ``window`` seconds behind it, it is bound to another incarnation
(`MisdirectedError`), or its nonce was already seen. Nonces are remembered per sender, at most
``max_nonces`` each: when a sender's memory is full its oldest nonce is forgotten and that
sender's floor rises to the forgotten timestamp (anything of that sender not newer is refused),
so a forgotten nonce can never be replayed, and a sender flooding its own memory locks out no
one but itself.

Invariant (per sender ``s``): every nonce of ``s`` with timestamp > ``floor(s)`` that was
accepted is in ``s``'s memory.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

import blake3

from tandem.errors import AuthenticationError

from .bodymac import MAC_PREFIX, BodyMac, is_tag

if TYPE_CHECKING:
    from .keys import Roster, SigningKey

VERSION = "tandem-hmac-3"
VERSION_KEYS = "tandem-ed25519-1"

#: Routing headers covered by the signature, in canonical order (missing ones sign as "").
SIGNED_HEADERS = (
    "X-Tandem-Sender",
    "X-Tandem-Incarnation",
    "X-Tandem-Channel",
    "X-Tandem-Msg-Id",
    "X-Tandem-Base",
    "X-Tandem-Chunk",
    "X-Tandem-Chunks",
    "X-Tandem-Offset",
    "X-Tandem-Total",
    "X-Tandem-Spec",
    "X-Tandem-Reply-To",
)
TIMESTAMP, NONCE, BODY_SHA, SIGNATURE = (
    "X-Tandem-Timestamp",
    "X-Tandem-Nonce",
    "X-Tandem-Body-Digest",
    "X-Tandem-Signature",
)
KEY_ID = "X-Tandem-Key-Id"
RECEIVER = "X-Tandem-Receiver"  # the receiving party's name
TO = "X-Tandem-To"  # the receiving process's incarnation
#: The body digest's algorithm, named in its value: a digest without it (such as an older
#: Tandem's bare SHA-256) is refused from the headers by `check_digest`.
DIGEST_PREFIX = "blake3:"
LEGACY_BODY_SHA = "X-Tandem-Body-SHA256"  # an older Tandem's body digest header (refused)
#: The body digest of a bulk request head whose digest follows the body, in a trailer signed
#: as method `TRAILER` with the head's routing headers (docs/transports.md, "Bulk path"): the
#: sender hashes while it sends instead of before.
DEFERRED = DIGEST_PREFIX + "trailer"
#: The same for a bulk body signed with a shared secret: the trailer carries the body's
#: AES-GMAC tag (``"gmac:"`` and 32 hex digits) under a key derived from the secret and the
#: signed head (`tandem.transports.bodymac`), not a BLAKE3 digest.
DEFERRED_MAC = MAC_PREFIX + "trailer"
TRAILER = "TRAILER"


class MisdirectedError(AuthenticationError):
    """A correctly signed request bound to another incarnation of this receiver (or to none):
    the sender should sign again for ``incarnation`` (HTTP 421)."""

    def __init__(self, message: str, incarnation: str) -> None:
        super().__init__(message)
        self.incarnation = incarnation


def key_id_of(secret: bytes) -> str:
    """The default id of a key: 16 hex digits of a hash of it (names the key, reveals nothing
    usable about it)."""
    return hashlib.sha256(b"tandem key id\n" + secret).hexdigest()[:16]


#: bodies at least this large are hashed on all cores by `body_digest` (BLAKE3 is a tree)
PARALLEL_DIGEST_BYTES = 4 << 20


BodyHasher = blake3.blake3


def body_hasher(*, parallel: bool = False) -> BodyHasher:
    """A new hasher of a body (``update`` releases the GIL, so a worker thread hashes while
    the loop receives); `digest_of` it once every byte went in. ``parallel``: each large
    ``update`` spreads over every core (the sender, which must hash before it sends)."""
    return blake3.blake3(max_threads=blake3.blake3.AUTO if parallel else 1)


def digest_of(hasher: BodyHasher | BodyMac) -> str:
    """The header value of what ``hasher`` was fed: ``"blake3:" + 64 hex digits``, or for a
    `BodyMac` ``"gmac:" + 32 hex digits``."""
    prefix = MAC_PREFIX if isinstance(hasher, BodyMac) else DIGEST_PREFIX
    return prefix + hasher.hexdigest()


def digest_matches(hasher: BodyHasher | BodyMac, digest: str) -> bool:
    """Whether what ``hasher`` was fed has the signed ``digest`` (constant-time compare)."""
    return hmac.compare_digest(digest_of(hasher).encode(), digest.encode())


def body_mac(secret: bytes, method: str, path: str, headers: Mapping[str, str]) -> BodyMac:
    """The GMAC of the body of the request whose signed ``headers`` (`DEFERRED_MAC`) were
    signed with the shared ``secret`` (`tandem.transports.bodymac`)."""
    return BodyMac(secret, _canonical(method, path, headers))


def body_digest(parts: Iterable[bytes | memoryview]) -> str:
    """The body digest (`digest_of`) of the concatenation of ``parts``; parts of at least
    `PARALLEL_DIGEST_BYTES` are hashed on all cores (the same digest as on one)."""
    parts = list(parts)
    h = body_hasher(parallel=any(len(p) >= PARALLEL_DIGEST_BYTES for p in parts))
    for p in parts:
        h.update(p)
    return digest_of(h)


def check_digest(headers: Mapping[str, str], *, trailer: bool = False) -> None:
    """Refuse (`AuthenticationError`) a request whose body digest header is present but is
    neither ``"blake3:"`` and 64 lower-case hex digits nor `DEFERRED` / `DEFERRED_MAC`, or
    that carries an older Tandem's SHA-256 header instead (its sender is told to upgrade). A
    body ``trailer`` may also carry a GMAC tag (``"gmac:"`` and 32 hex digits). A missing
    header is `Verifier`'s to refuse."""
    value = headers.get(BODY_SHA)
    if value is None:
        if LEGACY_BODY_SHA in headers:
            raise AuthenticationError(
                f"the sender signs with an older Tandem ({LEGACY_BODY_SHA}, a SHA-256 body "
                f"digest; this receiver takes {BODY_SHA}: {DIGEST_PREFIX}<hex>): run the same "
                "Tandem version on every party"
            )
        return
    if value == DEFERRED_MAC or (trailer and is_tag(value)):
        return
    hexpart = value[len(DIGEST_PREFIX) :]
    if value != DEFERRED and not (
        value.startswith(DIGEST_PREFIX)
        and len(hexpart) == 64
        and all(c in "0123456789abcdef" for c in hexpart)
    ):
        raise AuthenticationError(
            f"{BODY_SHA} {value[:80]!r} is not {DIGEST_PREFIX}<64 lower-case hex digits>"
        )


EMPTY_SHA = body_digest([])


def _canonical(method: str, path: str, headers: Mapping[str, str], version: str = VERSION) -> bytes:
    fields = [
        version,
        headers.get(KEY_ID, ""),
        method.upper(),
        path,
        headers.get(RECEIVER, ""),
        headers.get(TO, ""),
        *(headers.get(k, "") for k in SIGNED_HEADERS),
        headers.get(TIMESTAMP, ""),
        headers.get(NONCE, ""),
        headers.get(BODY_SHA, ""),
    ]
    for f in fields:
        if "\n" in f:
            raise AuthenticationError("header values must not contain newlines")
    return "\n".join(fields).encode()


def sign(
    secret: bytes | SigningKey,
    method: str,
    path: str,
    headers: dict[str, str],
    body_sha: str,
    *,
    clock: Callable[[], float] = time.time,
    key_id: str | None = None,
    receiver: str = "",
    to: str = "",
) -> dict[str, str]:
    """Add key id, receiver binding, timestamp, nonce, body digest and signature to
    ``headers`` (in place) and return it. ``receiver``/``to``: the receiving party's name and
    incarnation ("" while unknown: the receiver then answers 421 naming it). ``secret``: the
    shared secret, or this party's `keys.SigningKey` (then ``key_id`` is the key's own)."""
    if not isinstance(secret, bytes):
        key_id = secret.key_id
    elif key_id is None:
        key_id = key_id_of(secret)
    headers[KEY_ID] = key_id
    headers[RECEIVER] = receiver
    headers[TO] = to
    headers[TIMESTAMP] = f"{clock():.6f}"
    headers[NONCE] = secrets.token_hex(16)
    headers[BODY_SHA] = body_sha
    if isinstance(secret, bytes):
        headers[SIGNATURE] = hmac.new(
            secret, _canonical(method, path, headers), hashlib.sha256
        ).hexdigest()
    else:
        headers[SIGNATURE] = secret.sign(_canonical(method, path, headers, VERSION_KEYS))
    return headers


class _Memory:
    """The nonces of one sender (arrival order) and its floor."""

    __slots__ = ("seen", "floor")

    def __init__(self, floor: float) -> None:
        self.seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.floor = floor


class Verifier:
    """Checks signed requests. Raises `AuthenticationError` with the (server-side) reason.

    Args:
      keys: the secret (its id is `key_id_of` it), or ``{key_id: secret}`` (current and
        previous keys during a rotation); None with ``roster``.
      roster: per-party keys (`keys.Roster`): a request must be signed with a key the roster
        lists under the request's sender.
      name, incarnation: this receiver; a request must be addressed to both (`MisdirectedError`
        when only the incarnation differs).
      window: seconds a request may be old; future_skew: seconds it may be ahead.
      max_nonces: nonces remembered per sender; max_senders: senders remembered (the least
        recently heard is forgotten first; its highest timestamp becomes the floor of every
        sender without a memory, so nothing it sent can be replayed either).
    """

    def __init__(
        self,
        keys: bytes | Mapping[str, bytes] | None = None,
        *,
        roster: Roster | None = None,
        name: str = "",
        incarnation: str = "",
        window: float = 60.0,
        future_skew: float = 5.0,
        max_nonces: int = 65536,
        max_senders: int = 4096,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if (keys is None) == (roster is None):
            raise ValueError("give a verifier either shared keys or a roster of public keys")
        ring: dict[str, bytes] = {}
        if keys is not None:
            ring = {key_id_of(keys): keys} if isinstance(keys, bytes) else dict(keys)
        if roster is None and (
            not ring or not all(isinstance(k, bytes) and k for k in ring.values())
        ):
            raise ValueError("every secret must be non-empty bytes")
        self.roster = roster
        if not (window > 0 and future_skew >= 0 and max_nonces >= 1 and max_senders >= 1):
            raise ValueError(
                "window must be > 0 s, future_skew >= 0 s, max_nonces and max_senders >= 1; "
                f"got {window}, {future_skew}, {max_nonces}, {max_senders}"
            )
        self._keys = ring
        self.name, self.incarnation = name, incarnation
        self._window, self._skew = window, future_skew
        self._max, self._max_senders = max_nonces, max_senders
        self._clock = clock
        self._senders: collections.OrderedDict[str, _Memory] = collections.OrderedDict()
        self._forgotten_floor = float("-inf")  # floor of senders without a memory

    def verify(
        self, method: str, path: str, headers: Mapping[str, str], *, bound: bool = True
    ) -> None:
        """Authenticate the request head; on success the nonce is remembered (single use).

        ``bound``: the request must name this receiver's incarnation (all but ``/healthz``,
        whose callers may not know it yet)."""
        for k in (TIMESTAMP, NONCE, BODY_SHA, SIGNATURE):
            if not headers.get(k):
                raise AuthenticationError(f"missing header {k}")
        try:
            ts = float(headers[TIMESTAMP])
        except ValueError:
            raise AuthenticationError("timestamp is not a number") from None
        self._check_signature(method, path, headers)
        if headers.get(RECEIVER, "") != self.name:
            raise AuthenticationError(
                f"request addressed to {headers.get(RECEIVER, '')!r}, not to {self.name!r}"
            )
        now = self._clock()
        if not ts <= now + self._skew:
            raise AuthenticationError(
                f"timestamp {ts:.3f} is more than future_skew={self._skew}s ahead of local "
                f"time {now:.3f}"
            )
        if not ts >= now - self._window:
            raise AuthenticationError(
                f"timestamp {ts:.3f} is more than {self._window}s behind local time {now:.3f}"
            )
        if bound and headers.get(TO, "") != self.incarnation:
            raise MisdirectedError(
                f"request bound to incarnation {headers.get(TO, '')!r} of {self.name!r}, "
                "not to this process",
                self.incarnation,
            )
        sender = headers.get(SIGNED_HEADERS[0], "")
        memory = self._memory(sender)
        self._expire(memory, now)
        nonce = headers[NONCE]
        if nonce in memory.seen or ts <= memory.floor:
            raise AuthenticationError("replayed request (nonce already used)")
        memory.seen[nonce] = ts
        if len(memory.seen) > self._max:
            _, oldest = memory.seen.popitem(last=False)
            memory.floor = max(memory.floor, oldest)

    def body_mac(self, method: str, path: str, headers: Mapping[str, str]) -> BodyMac:
        """The GMAC of the body of a verified request whose digest is `DEFERRED_MAC`, keyed
        by the shared secret its key id names; `AuthenticationError` under per-party keys
        (no shared secret: their bulk bodies carry a BLAKE3 digest, `DEFERRED`)."""
        key = self._keys.get(headers.get(KEY_ID, ""))
        if self.roster is not None or key is None:
            raise AuthenticationError(
                f"{BODY_SHA} {DEFERRED_MAC} needs a shared secret; a party signing with its "
                f"own key sends {DEFERRED}"
            )
        return body_mac(key, method, path, headers)

    def _check_signature(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        key_id = headers.get(KEY_ID, "")
        if self.roster is not None:
            data = _canonical(method, path, headers, VERSION_KEYS)
            sender = headers.get(SIGNED_HEADERS[0], "")
            self.roster.check(key_id, headers[SIGNATURE], data, sender)
            return
        key = self._keys.get(key_id)
        if key is None:
            raise AuthenticationError(
                f"unknown key id {key_id[:40]!r} (this receiver holds {sorted(self._keys)})"
            )
        expected = hmac.new(key, _canonical(method, path, headers), hashlib.sha256).hexdigest()
        given = headers[SIGNATURE]  # raw header bytes >= 0x80 arrive as non-ASCII characters,
        # which compare_digest refuses to compare (TypeError): such a signature is just wrong
        if not (given.isascii() and hmac.compare_digest(expected, given)):
            raise AuthenticationError("bad signature (different secret, or altered request)")

    def _memory(self, sender: str) -> _Memory:
        memory = self._senders.get(sender)
        if memory is None:
            memory = self._senders[sender] = _Memory(self._forgotten_floor)
            if len(self._senders) > self._max_senders:
                _, gone = self._senders.popitem(last=False)
                highest = max(gone.seen.values(), default=gone.floor)
                self._forgotten_floor = max(self._forgotten_floor, gone.floor, highest)
        else:
            self._senders.move_to_end(sender)
        return memory

    def _expire(self, memory: _Memory, now: float) -> None:
        # Entries are in arrival order, not timestamp order, so only drop from the head while
        # expired; later expired entries go when they reach the head (bounded by max_nonces).
        seen = memory.seen
        while seen:
            nonce, ts = next(iter(seen.items()))
            if ts >= now - self._window:
                break
            del seen[nonce]
            memory.floor = max(memory.floor, ts)

    def floor(self, sender: str) -> float:
        """The timestamp at or below which nothing of ``sender`` is accepted any more."""
        memory = self._senders.get(sender)
        return self._forgotten_floor if memory is None else memory.floor

    def __len__(self) -> int:
        return sum(len(m.seen) for m in self._senders.values())
