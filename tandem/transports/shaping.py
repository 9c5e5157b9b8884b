"""Link emulation shared by the memory and the HTTP transports: one direction of one link,
paced to a bandwidth, with a latency.

`LinkShape` is the configuration (bandwidth in bytes/s, latency in s). `LinkShaper` is the
wire of one direction: one transmission at a time (serialised across channels, as on a real
link), each occupying it for ``nbytes / bandwidth`` seconds. How the latency is paid is the
transport's choice: the memory transport makes a frame receivable ``latency`` s after its
transmission ends, the HTTP transport waits ``latency`` s before each request's first byte.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator


@dataclasses.dataclass(slots=True)
class LinkShape:
    """Shaping of one direction: ``bandwidth`` in bytes/s (None = unlimited), ``latency`` in s."""

    bandwidth: float | None = None
    latency: float = 0.0

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be > 0 bytes/s or None, got {self.bandwidth!r}")
        if not self.latency >= 0:
            raise ValueError(f"latency must be >= 0 s, got {self.latency!r}")


class LinkShaper:
    """The wire of one direction of one link, scheduled on ideal times rather than on when
    timers happen to fire:

    * ``free_at``: the ideal end of the last transmission. Bytes *offered* before then were
      waiting for the wire, as behind a socket buffer, and start exactly at ``free_at``:
      back-to-back transmissions leave no idle wire between them, however late the event loop
      gets round to them (uvloop's timers have 1 ms resolution; a loaded machine adds more).
    * ``late``: how far past ``free_at`` the last transmission's timer fired. A sender that
      awaits each transmission can offer its next bytes only after that timer, so they start
      that much earlier (credited once); over back-to-back transmissions from such a sender
      the emulated link also carries exactly ``bandwidth``. The price: a transmission after an
      idle spell may end up to one timer lateness early, once.

    ``shape`` may be replaced at any time; it applies from the next transmission on.
    """

    __slots__ = ("shape", "_wire", "late", "free_at")

    def __init__(self, shape: LinkShape | None = None) -> None:
        self.shape = shape if shape is not None else LinkShape()
        self._wire: asyncio.Lock | None = None  # made on first use, inside the running loop
        self.late = 0.0
        self.free_at = float("-inf")

    def seconds(self, nbytes: int) -> float:
        """How long ``nbytes`` occupy the wire."""
        bandwidth = self.shape.bandwidth
        return nbytes / bandwidth if bandwidth else 0.0

    @contextlib.asynccontextmanager
    async def transmit(self, nbytes: int, offered: float) -> AsyncIterator[float]:
        """Occupy the wire for ``nbytes``: wait for it (FIFO), then until the transmission's
        ideal end, and yield that end (loop time) *with the wire still held*, so that what the
        caller does inside (queue the frame, write the piece) keeps the transmissions' order.
        ``offered``: the loop time the bytes were ready to go."""
        if self._wire is None:
            self._wire = asyncio.Lock()
        loop = asyncio.get_running_loop()
        async with self._wire:
            now = loop.time()
            end = max(self.free_at, offered - self.late) + self.seconds(nbytes)
            self.late = 0.0
            self.free_at = end
            if end > now:
                await asyncio.sleep(end - now)
            self.late = max(loop.time() - end, 0.0)
            yield end
