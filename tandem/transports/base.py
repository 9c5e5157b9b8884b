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
from collections.abc import Callable, Iterable, Mapping
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

    async def start(self) -> Transport:
        """Begin serving (inside the running loop); returns the transport. A transport is
        built unstarted (`tandem.transports.make_transport`) and started once; one that is
        usable from its creation returns at once. `TransportClosedError` after `aclose`."""
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


# -- optional capabilities ------------------------------------------------------------------
# A transport implements `Transport` and any of the Protocols below. A caller that uses a
# capability checks for it with ``isinstance(transport, <Protocol>)`` (each is
# runtime_checkable) and does without it otherwise; nothing probes a transport with
# ``hasattr``. docs/transports.md lists which transport implements which.


@runtime_checkable
class WindowedTransport(Protocol):
    """Send window: how many sends of one (peer, channel) the transport keeps in flight at
    once (each `send` returning when its frame is delivered). A sender that hands it fewer at
    once pays a round trip per that many frames; handing it more only makes them wait inside
    the transport. Implemented by `HttpTransport`; the memory transport delivers at once."""

    def send_window(self, peer: str) -> int:
        """Sends of one channel to ``peer`` the transport keeps in flight at once (>= 1)."""
        ...


@runtime_checkable
class AdmittingTransport(Protocol):
    """Admission hooks: the checks a transport applies to inbound frames before delivering
    them, refusing the others to their sender (who then sees why) instead of handing them to
    `recv`. Each attribute may be replaced at any time (e.g. once a task spec is agreed):

    * ``spec_hash``: stamped on outgoing frames when non-empty; an inbound frame of another
      hash is refused.
    * ``validator(frame)``: called with each decoded inbound frame; raising `FrameError`
      refuses it (in a worker thread unless it is an `InlineValidator`).
    * ``admit_stream(sender, channel)``: called on each inbound message's routing, before its
      body is read or memory reserved; raising `AdmissionError` (or `FrameError`) refuses it.
    * ``admit_frame(frame)``: called on the event loop with each complete inbound frame that
      passed every other check, just before delivery, with nothing awaited in between;
      raising `AdmissionError` naming the field (or `FrameError`) refuses it.

    None disables a hook. Implemented by `HttpTransport` (refusals 409, 422, 403 and 422);
    the memory transport, within one process, checks nothing."""

    spec_hash: str
    validator: Callable[[Frame], None] | None
    admit_stream: Callable[[str, str], None] | None
    admit_frame: Callable[[Frame], None] | None


@runtime_checkable
class InlineValidator(Protocol):
    """A ``validator`` (`AdmittingTransport`) that declares itself cheap enough for the event
    loop: ``inline`` true states that judging a frame costs at most one pass over its arrays
    (as a NaN/Inf scan does), never I/O or a wait. A transport then runs it where it runs its
    own checks of a small frame, on the loop, instead of handing each frame to a worker thread
    (a thread hand-off per frame that, on a party confined to one CPU, only adds a context
    switch). Any other validator runs in a worker thread."""

    inline: bool

    def __call__(self, frame: Frame) -> None: ...


@runtime_checkable
class SizeAdmittingTransport(Protocol):
    """Size admission: the receiver's plan bounds a stream's frames below the transport's
    ``max_frame_bytes`` (an FL update is at most the negotiated model's encoded size).

    * ``admit_size(sender, channel, total)``: called on the event loop with each inbound
      message's declared size in bytes (the whole frame, over all its chunks), from its
      head, before its body is read or memory reserved; raising `AdmissionError` (or
      `FrameError`) refuses it as too large (413 over HTTP).

    None disables it. Implemented by `HttpTransport`; the memory transport checks nothing."""

    admit_size: Callable[[str, str, int], None] | None


@runtime_checkable
class PeerWaitingTransport(Protocol):
    """Peer readiness: a started transport can wait until its peers answer, so that a party
    starting before the others waits for them instead of failing its first send."""

    async def wait_for_peers(self, timeout: float, peers: Iterable[str] | None = None) -> None:
        """Return once every peer of ``peers`` (default: all of `Transport.peers`) is ready
        to receive; `PeersUnreachableError` naming each silent peer and its last problem
        after ``timeout`` seconds. Call it on a started transport."""
        ...


@runtime_checkable
class AddressingTransport(Protocol):
    """Addresses: the transport serves at an `address` its peers can reach, and learns
    peers' addresses at run time (a peer that tells where it lives, as an FL client's hello
    or an elastic worker's registration does, becomes addressable). The memory transport
    needs none: every party of its network is addressable.

    (Members are methods only: ``isinstance`` then checks the class, never calling into an
    unstarted instance.)"""

    def address(self) -> str:
        """Where peers reach this started transport, e.g. ``http://10.0.0.1:8712``."""
        ...

    def add_peer(self, name: str, url: str) -> None:
        """Address ``name`` at ``url`` (replacing an older address); `ValueError` naming the
        problem when ``url`` cannot be this transport's."""
        ...


@runtime_checkable
class MetricsTransport(Protocol):
    """Metrics source: the transport serves metrics (``GET /metrics`` over HTTP) and appends
    the application's own lines to them."""

    def add_metrics_source(self, source: Callable[[], str]) -> None:
        """Append ``source()`` (Prometheus text lines) to every metrics answer."""
        ...


@runtime_checkable
class AuthWatchingTransport(Protocol):
    """Authentication watch: the transport tells the application, on the event loop, each
    time a request naming one of its configured peers fails authentication (before refusing
    it), so the party can tell its user at once (different secrets, most likely) instead of
    waiting out a timeout. The hook must not raise or block."""

    on_auth_refused: Callable[[str, str], None] | None  # (peer, reason)
