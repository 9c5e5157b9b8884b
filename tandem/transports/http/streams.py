"""Receiver-side de-duplication state of the HTTP transport, per *stream*: one (sender,
channel) pair.

For each stream the receiver keeps a `StreamState`: the sender's incarnation (a random token
per sender process), the next expected message id, the messages being received (`Partial`)
and the complete ones waiting for their turn. Delivered frames wait in the stream's bounded
`tandem.transports.inbox.Inbox`; a request for a new message first reserves a slot there (and
waits, then answers 503, when there is none), so inbound memory is bounded by ``capacity``
messages per stream.

Ordering rule (the sender keeps up to ``send_window`` messages of a stream in flight, see
`tandem.transports.http.client`): messages are delivered to the inbox strictly in id order.
A complete message whose id is ahead of ``next_id`` waits in the stream's reorder buffer
(``ready``) until every id before it is delivered or abandoned; at most ``send_window`` ids
ahead of ``next_id`` are accepted, anything further is refused (503 ``ahead``) and its sender
waits and retries. Each request names the sender's *base*: its lowest unsettled id, so ids
below it that never arrived were abandoned (cancelled sends): a complete message whose base is
its own id is delivered, once the ``admit_frame`` hook accepts it, skipping the missing ids
before it (a refused message never moves the stream). An id below
``next_id`` is a retry of a delivered message: acknowledged again without delivery. A refused
message leaves its id unused (its sender may send it again, judged afresh). Chunks of one
message must arrive in order (a chunked message is only sent alone, see the client); a chunk
ahead of the expected one is refused (409 with the expected index) so the sender resends in
order. A new incarnation of a sender (restarted process) starts a fresh state; the old one is
retired and its late retries are refused.

Invariants: every id in ``partials`` or ``ready`` is in ``[next_id, next_id + send_window)``
(of the receiver's config), and
each holds one inbox slot and its bytes of the receiver's budget until it is delivered (the
slot then holds the frame), refused or dropped.

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

from ..base import Frame
from .protocol import Refuse
from .scan import FiniteScan


def message_buffer(total: int) -> memoryview:
    """A buffer for a message of ``total`` bytes. np.empty: no zero-fill pass over what is
    about to be overwritten; writable, so decoded arrays are ordinary writable views of it."""
    return np.empty(total, dtype=np.uint8).data


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
        self.buffer = message_buffer(total)
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


class Held:
    """A complete, checked message waiting in the reorder buffer for its turn. ``base``: the
    highest base its requests named (when it equals the message's id, every id before it was
    settled by its sender, and the receiver may skip the missing ones to deliver it)."""

    __slots__ = ("frame", "size", "base")

    def __init__(self, frame: Frame, size: int, base: int) -> None:
        self.frame, self.size, self.base = frame, size, base


class StreamState:
    """Ordering and de-duplication state of one (sender, channel) stream; guarded by ``lock``
    (`wake` wakes the requests waiting for their turn whenever ``next_id`` moves or ``ready``
    loses an entry)."""

    __slots__ = (
        "incarnation",
        "next_id",
        "partials",
        "ready",
        "refused",
        "lock",
        "waiters",
    )

    def __init__(self) -> None:
        self.incarnation = ""
        self.next_id: int | None = None  # None: nothing seen from this incarnation yet
        self.partials: dict[int, Partial] = {}  # msg id -> message being received
        self.ready: dict[int, Held] = {}  # complete messages waiting for their turn
        self.refused: dict[int, Refuse] = {}  # admission refusals for the requests awaiting them
        self.lock = asyncio.Lock()
        self.waiters: list[asyncio.Future[None]] = []  # requests waiting for their turn

    def wake(self) -> None:
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)

    def reserved_between(self, lo: int, msg_id: int) -> int:
        """Ids in ``[lo, msg_id)`` that hold an inbox slot."""
        return sum(1 for k in (*self.partials, *self.ready) if lo <= k < msg_id)

    def ahead_bytes(self) -> int:
        """Budget bytes held by messages not next in line."""
        lo = self.next_id or 0
        held = sum(p.total for k, p in self.partials.items() if k > lo)
        return held + sum(h.size for k, h in self.ready.items() if k > lo)
