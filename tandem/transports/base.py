"""The transport contract shared by every implementation (memory, HTTP).

A transport connects one local party to named peers. Messages are `Frame`s, addressed by
``(peer, channel)``. The guarantees every implementation must give (and that
`tests/transport_conformance.py` checks against each of them):

* **FIFO per (peer, channel)**: frames sent on one channel to one peer arrive in send order,
  exactly once.
* **Bounded**: every inbound buffer has a fixed capacity; when it is full, `send` waits
  (backpressure) instead of growing memory.
* **Full duplex**: the two directions of a link are independent.
* **Close**: after `aclose()`, pending and future `send`/`recv` raise `TransportClosedError`;
  no task or connection is left running.
* **Cancellation safety**: cancelling a pending `recv` loses no frame; cancelling a pending
  `send` either delivers the frame whole or not at all.
* **No pickle**: arrays travel as raw little-endian buffers plus a JSON header (`codec`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One message: a small JSON-able header plus zero or more numpy arrays.

    Attributes:
      sender: name of the party that sent it (filled in by the transport on send).
      channel: logical stream, e.g. ``"act/bottom->top"``; FIFO holds per channel.
      msg_id: per (sender, peer, channel) sequence number, used to de-duplicate retries.
      spec_hash: hash of the negotiated task spec ("" before negotiation).
      meta: JSON-serialisable header fields (ints, floats, strings, lists, dicts).
      arrays: the tensors; any dtype numpy can describe except object dtypes.
    """

    sender: str = ""
    channel: str = ""
    msg_id: int = 0
    spec_hash: str = ""
    meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    arrays: tuple[np.ndarray, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of array payload (the header is counted by the codec)."""
        return sum(int(a.nbytes) for a in self.arrays)

    def replace(self, **changes: Any) -> Frame:
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(slots=True)
class LinkStats:
    """Counters for one direction of one link, as seen from the local party.

    ``busy_seconds`` is the time the link spent transmitting (not waiting for data), so
    ``bytes / busy_seconds`` estimates the link's bandwidth for the micro-batch tuner.
    """

    frames: int = 0
    bytes: int = 0
    busy_seconds: float = 0.0

    def bandwidth(self) -> float | None:
        """Measured bytes per second, or None before anything was transmitted."""
        if self.busy_seconds <= 0 or self.bytes == 0:
            return None
        return self.bytes / self.busy_seconds


@runtime_checkable
class Transport(Protocol):
    """What the engine needs from a transport. See the module docstring for the guarantees."""

    @property
    def name(self) -> str:
        """This party's name."""
        ...

    @property
    def peers(self) -> tuple[str, ...]:
        """Names of the peers this transport can address."""
        ...

    async def send(self, peer: str, channel: str, frame: Frame) -> None:
        """Deliver ``frame`` to ``peer`` on ``channel``; waits while the peer's buffer is full.

        Returns once the frame has been handed to the link (it may still be in flight).
        Raises `UnknownPeerError`, `TransportClosedError`, `FrameError`.
        """
        ...

    async def recv(self, peer: str, channel: str) -> Frame:
        """Wait for the next frame from ``peer`` on ``channel``."""
        ...

    def sent_stats(self, peer: str) -> LinkStats:
        """Counters of the direction local -> peer."""
        ...

    def received_stats(self, peer: str) -> LinkStats:
        """Counters of the direction peer -> local."""
        ...

    async def aclose(self) -> None:
        """Close every link; idempotent."""
        ...


@runtime_checkable
class WindowedTransport(Protocol):
    """An optional hint a transport may give beside `Transport`: how many sends of one
    (peer, channel) it keeps in flight at once (each `send` returning when its frame is
    delivered). A sender that hands it fewer at once pays a round trip per that many frames;
    handing it more only makes them wait inside the transport."""

    def send_window(self, peer: str) -> int:
        """Sends of one channel to ``peer`` the transport keeps in flight at once (>= 1)."""
        ...
