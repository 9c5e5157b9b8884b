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
"""

from __future__ import annotations

import asyncio

import numpy as np

from .scan import FiniteScan


class Partial:
    """A chunked message being reassembled into one preallocated buffer."""

    __slots__ = ("msg_id", "chunks", "total", "next_chunk", "filled", "buffer", "scan")

    def __init__(self, msg_id: int, chunks: int, total: int) -> None:
        self.msg_id = msg_id
        self.chunks = chunks
        self.total = total
        self.next_chunk = 0
        self.filled = 0
        # np.empty: no zero-fill pass over what is about to be overwritten; writable, so
        # decoded arrays are ordinary writable views of it.
        self.buffer: memoryview = np.empty(total, dtype=np.uint8).data
        self.scan: FiniteScan | None = None  # NaN/Inf check run over the buffer as it fills


class StreamState:
    """De-duplication state of one (sender, channel) stream; guarded by ``lock``."""

    __slots__ = ("incarnation", "next_id", "partial", "lock")

    def __init__(self) -> None:
        self.incarnation = ""
        self.next_id: int | None = None  # None: nothing seen from this incarnation yet
        self.partial: Partial | None = None
        self.lock = asyncio.Lock()
