"""Shared-secret request authentication: HMAC-SHA256 with replay protection. Pure (no asyncio).

The signer covers the HTTP method, the path, and every ``X-Tandem-*`` routing header listed in
`SIGNED_HEADERS` (sender, incarnation, channel, message id, chunk, offset, total, spec hash),
plus a timestamp, a random nonce and the SHA-256 of the body::

    mac = HMAC-SHA256(secret, "\\n".join([method, path, *routing values, ts, nonce, body_sha]))

The verifier refuses a request when a header is missing, the MAC differs (constant-time
compare), the timestamp is outside ``+-window`` seconds of its clock, or the nonce was already
seen. Remembered nonces are bounded (``max_nonces``): when the memory is full the oldest nonce is
forgotten and the verifier raises its floor to that nonce's timestamp, refusing anything not
newer — so a forgotten nonce can never be replayed.

Invariant: every nonce with timestamp > ``floor`` that was accepted is in ``_seen``.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable, Mapping

from tandem.errors import AuthenticationError

#: Routing headers covered by the signature, in canonical order (missing ones sign as "").
SIGNED_HEADERS = (
    "X-Tandem-Sender",
    "X-Tandem-Incarnation",
    "X-Tandem-Channel",
    "X-Tandem-Msg-Id",
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
    "X-Tandem-Body-SHA256",
    "X-Tandem-Signature",
)
EMPTY_SHA = hashlib.sha256(b"").hexdigest()


def body_digest(parts) -> str:
    """Hex SHA-256 over the concatenation of ``parts`` (releases the GIL on large buffers)."""
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
    return h.hexdigest()


def _canonical(method: str, path: str, headers: Mapping[str, str]) -> bytes:
    fields = [
        method.upper(),
        path,
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
    secret: bytes,
    method: str,
    path: str,
    headers: dict[str, str],
    body_sha: str,
    *,
    clock: Callable[[], float] = time.time,
) -> dict[str, str]:
    """Add timestamp, nonce, body digest and signature to ``headers`` (in place) and return it."""
    headers[TIMESTAMP] = f"{clock():.6f}"
    headers[NONCE] = secrets.token_hex(16)
    headers[BODY_SHA] = body_sha
    headers[SIGNATURE] = hmac.new(
        secret, _canonical(method, path, headers), hashlib.sha256
    ).hexdigest()
    return headers


class Verifier:
    """Checks signed requests. Raises `AuthenticationError` with the (server-side) reason."""

    def __init__(
        self,
        secret: bytes,
        *,
        window: float = 60.0,
        max_nonces: int = 65536,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not secret:
            raise ValueError("secret must be non-empty bytes")
        if window <= 0 or max_nonces < 1:
            raise ValueError(
                f"window must be > 0 s and max_nonces >= 1, got {window}, {max_nonces}"
            )
        self._secret = secret
        self._window = window
        self._max = max_nonces
        self._clock = clock
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.floor = float("-inf")

    def verify(self, method: str, path: str, headers: Mapping[str, str]) -> None:
        """Authenticate the request head; on success the nonce is remembered (single use)."""
        for k in (TIMESTAMP, NONCE, BODY_SHA, SIGNATURE):
            if not headers.get(k):
                raise AuthenticationError(f"missing header {k}")
        try:
            ts = float(headers[TIMESTAMP])
        except ValueError:
            raise AuthenticationError("timestamp is not a number") from None
        expected = hmac.new(
            self._secret, _canonical(method, path, headers), hashlib.sha256
        ).hexdigest()
        if not hmac.compare_digest(expected, headers[SIGNATURE]):
            raise AuthenticationError("bad signature (different secret, or altered request)")
        now = self._clock()
        if not abs(now - ts) <= self._window:
            raise AuthenticationError(
                f"timestamp {ts:.3f} is outside +-{self._window}s of local time {now:.3f}"
            )
        self._expire(now)
        nonce = headers[NONCE]
        if nonce in self._seen or ts <= self.floor:
            raise AuthenticationError("replayed request (nonce already used)")
        self._seen[nonce] = ts
        if len(self._seen) > self._max:
            _, oldest = self._seen.popitem(last=False)
            self.floor = max(self.floor, oldest)

    def _expire(self, now: float) -> None:
        # Entries are in arrival order, not timestamp order, so only drop from the head while
        # expired; later expired entries go when they reach the head (bounded by max_nonces).
        while self._seen:
            nonce, ts = next(iter(self._seen.items()))
            if ts >= now - self._window:
                break
            del self._seen[nonce]
            self.floor = max(self.floor, ts)

    def __len__(self) -> int:
        return len(self._seen)
