"""Transports: how parties exchange frames. Knows nothing of training."""

from tandem.errors import (
    FrameError,
    PayloadTooLargeError,
    TandemError,
    TransportClosedError,
    TransportError,
    UnknownPeerError,
)

from .base import Frame, LinkStats, Transport
from .memory import MemoryNetwork, MemoryTransport
from .shaping import LinkShape

__all__ = [
    "Frame",
    "LinkStats",
    "Transport",
    "LinkShape",
    "MemoryNetwork",
    "MemoryTransport",
    "TandemError",
    "TransportError",
    "FrameError",
    "PayloadTooLargeError",
    "TransportClosedError",
    "UnknownPeerError",
]
