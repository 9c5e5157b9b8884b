"""Transports: how parties exchange frames. Knows nothing of training.

`Transport` is the contract; the optional capabilities (`WindowedTransport`,
`AdmittingTransport`, `SizeAdmittingTransport`, `PeerWaitingTransport`, `AddressingTransport`,
`MetricsTransport`, `AuthWatchingTransport`) are Protocols beside it in `base`;
`make_transport` builds one by URL scheme (`factory`)."""

from tandem.errors import (
    FrameError,
    PayloadTooLargeError,
    PeersUnreachableError,
    TandemError,
    TransportClosedError,
    TransportError,
    UnknownPeerError,
    UnknownTransportError,
)

from .base import (
    AddressingTransport,
    AdmittingTransport,
    AuthWatchingTransport,
    Frame,
    LinkStats,
    MetricsTransport,
    PeerWaitingTransport,
    SizeAdmittingTransport,
    Transport,
    WindowedTransport,
)
from .factory import (
    TransportBuilder,
    TransportRequest,
    make_transport,
    register_transport,
    registered_schemes,
    unregister_transport,
)
from .memory import MemoryNetwork, MemoryTransport
from .shaping import LinkShape

__all__ = [
    "Frame",
    "LinkStats",
    "Transport",
    "AddressingTransport",
    "AdmittingTransport",
    "AuthWatchingTransport",
    "MetricsTransport",
    "PeerWaitingTransport",
    "SizeAdmittingTransport",
    "WindowedTransport",
    "TransportBuilder",
    "TransportRequest",
    "make_transport",
    "register_transport",
    "registered_schemes",
    "unregister_transport",
    "LinkShape",
    "MemoryNetwork",
    "MemoryTransport",
    "TandemError",
    "TransportError",
    "FrameError",
    "PayloadTooLargeError",
    "TransportClosedError",
    "UnknownPeerError",
    "PeersUnreachableError",
    "UnknownTransportError",
]
