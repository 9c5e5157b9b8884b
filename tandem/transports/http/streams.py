"""Receiver-side de-duplication state of the HTTP transport, per *stream*: one (sender,
channel) pair.

For each stream the receiver keeps a `StreamState`: the sender's incarnation (a random token
per sender process), the next expected message id, and the partially received chunked message
(`Partial`), if any. Delivered frames wait in the stream's bounded `tandem.transports.inbox.Inbox`;
a request for a new message first reserves a slot there (and waits, then answers 503, when
there is none), so inbound memory is bounded by ``capacity`` messages per stream.

De-duplication rule (the sender sends one message at a time per stream and moves on only after
an acknowledgement or a cancellation): an id below ``next_id`` is a retry of a delivered message
and is acknowledged without delivery; an id at or above ``next_id`` is the next message (a gap
means the sender abandoned a cancelled send). Chunks of one message must arrive in order; a chunk
ahead of the expected one is refused (409 with the expected index) so the sender resends in order.
A new incarnation of a sender (restarted process) starts a fresh state; the old one is retired
and its late retries are refused.

Reading a chunk's body holds no lock: the request *claims* the partial message (`Claim`) and
reads into it. A newer request for the same chunk (the sender's retry after a stalled or
broken attempt) revokes the older claim, whose connection is closed at once, so a stalled
request never blocks its stream. Invariant: at most one live claim per partial message, and
only the holder of the live claim writes into its buffer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from .scan import FiniteScan


class Claim:
    """The right of one request to write the next chunk into a partial message; `revoke`
    closes that request's connection (``abort``) so nothing more of it arrives."""

    __slots__ = ("live", "_abort")

    def __init__(self, abort: Callable[[], None]) -> None:
        self.live = True
        self._abort = abort

    def revoke(self) -> None:
        if self.live:
            self.live = False
            self._abort()


class Partial:
    """A chunked message being reassembled into one preallocated buffer. ``reader``: the live
    claim of the request reading into it (None: idle since ``touched``, loop time)."""

    __slots__ = (
        "msg_id",
        "chunks",
        "total",
        "next_chunk",
        "filled",
        "buffer",
        "scan",
        "reader",
        "touched",
    )

    def __init__(self, msg_id: int, chunks: int, total: int, now: float = 0.0) -> None:
        self.msg_id = msg_id
        self.chunks = chunks
        self.total = total
        self.next_chunk = 0
        self.filled = 0
        # np.empty: no zero-fill pass over what is about to be overwritten; writable, so
        # decoded arrays are ordinary writable views of it.
        self.buffer: memoryview = np.empty(total, dtype=np.uint8).data
        self.scan: FiniteScan | None = None  # NaN/Inf check run over the buffer as it fills
        self.reader: Claim | None = None
        self.touched = now

    def claim(self, abort: Callable[[], None], now: float) -> Claim:
        """A new claim for the next chunk; an older live one is revoked first."""
        if self.reader is not None:
            self.reader.revoke()
        self.reader = Claim(abort)
        self.touched = now
        return self.reader

    def unclaim(self, claim: Claim, now: float) -> None:
        """``claim``'s request is done with the buffer (read or failed): idle from ``now``."""
        if self.reader is claim:
            self.reader = None
            self.touched = now


class StreamState:
    """De-duplication state of one (sender, channel) stream; guarded by ``lock``."""

    __slots__ = ("incarnation", "next_id", "partial", "lock")

    def __init__(self) -> None:
        self.incarnation = ""
        self.next_id: int | None = None  # None: nothing seen from this incarnation yet
        self.partial: Partial | None = None
        self.lock = asyncio.Lock()
