"""Receiver-side state of the HTTP transport: bounded inboxes and per-stream de-duplication.

A *stream* is one (sender, channel) pair. For each stream the receiver keeps:

* an `Inbox`: delivered frames waiting for ``recv``, plus slots *reserved* by messages being
  received. Invariant: ``len(items) + reserved <= capacity``; a request that finds no free slot
  waits (then answers 503 so the sender backs off) — the buffer never grows past capacity.
* a `StreamState`: the sender's incarnation (a random token per sender process), the next
  expected message id, and the partially received chunked message, if any.

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
import collections
from typing import Any

import numpy as np

from .base import Frame


class Inbox:
    """Frames from one sender on one channel. See the module invariant."""

    __slots__ = ("items", "reserved", "capacity", "closed", "cond")

    def __init__(self, capacity: int) -> None:
        self.items: collections.deque[Frame] = collections.deque()
        self.reserved = 0
        self.capacity = capacity
        self.closed = False  # the sender said goodbye, or the local transport closed
        self.cond = asyncio.Condition()

    def has_slot(self) -> bool:
        return len(self.items) + self.reserved < self.capacity

    async def reserve(self, timeout: float) -> bool:
        """Reserve one slot, waiting up to ``timeout`` s. False on timeout or close."""
        async with self.cond:
            try:
                async with asyncio.timeout(timeout):
                    await self.cond.wait_for(lambda: self.has_slot() or self.closed)
            except TimeoutError:
                return False
            if self.closed and not self.has_slot():
                return False
            self.reserved += 1
            return True

    async def unreserve(self) -> None:
        async with self.cond:
            self.reserved -= 1
            self.cond.notify_all()

    async def deliver(self, frame: Frame) -> None:
        """Turn a reserved slot into a queued frame."""
        async with self.cond:
            self.reserved -= 1
            self.items.append(frame)
            self.cond.notify_all()

    async def get(self) -> Frame | None:
        """Next frame; None when the inbox is closed and empty. Cancelling loses nothing."""
        async with self.cond:
            await self.cond.wait_for(lambda: self.items or self.closed)
            if not self.items:
                return None
            frame = self.items.popleft()
            self.cond.notify_all()
            return frame

    async def set_closed(self, closed: bool) -> None:
        async with self.cond:
            self.closed = closed
            self.cond.notify_all()


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
        self.buffer = memoryview(np.empty(total, dtype=np.uint8))
        self.scan: Any = None  # checks run over the buffer as it fills (tandem.transports.http)


class StreamState:
    """De-duplication state of one (sender, channel) stream; guarded by ``lock``."""

    __slots__ = ("incarnation", "next_id", "partial", "lock")

    def __init__(self) -> None:
        self.incarnation = ""
        self.next_id: int | None = None  # None: nothing seen from this incarnation yet
        self.partial: Partial | None = None
        self.lock = asyncio.Lock()
