"""In-memory transport with per-link, per-direction shaping.

A `MemoryNetwork` holds the parties of one process; `network.endpoint(name)` gives each party
its `Transport`. Each direction of each link can be shaped with a bandwidth (bytes/s) and a
latency (s), so a laptop can emulate a WAN:

* one frame at a time occupies a direction for ``encoded_size / bandwidth`` seconds (the wire
  is serialised across channels, as on a real link); the two directions are independent
  (full duplex); frames offered while the wire is busy follow each other with no gap
  (`tandem.transports.shaping.LinkShaper`, shared with the HTTP transport's emulation);
* a frame becomes receivable ``latency`` seconds after its transmission ends.

Every (sender, receiver, channel) inbox (`tandem.transports.inbox.Inbox`) holds at most
``capacity`` frames; a sender waits for a free slot *before* it occupies the wire, so a full
channel never blocks other channels (no head-of-line deadlock). Arrays are copied on send, as
a process boundary would, unless the network is built with ``copy=False``. Byte counters use
the codec's exact encoded size.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools

import numpy as np

from tandem.errors import TransportClosedError, UnknownPeerError

from . import codec
from .base import Frame, LinkStats
from .inbox import Inbox
from .shaping import LinkShape, LinkShaper

__all__ = ["LinkShape", "MemoryNetwork", "MemoryTransport"]


class MemoryNetwork:
    """Parties living in one process, joined by shaped in-memory links.

    Args:
      capacity: frames each (sender, receiver, channel) inbox holds before senders wait.
      copy: copy arrays on send (default True), so no party can alias another's buffers.
      default: shape for links not configured with `shape`.
    """

    def __init__(
        self, *, capacity: int = 64, copy: bool = True, default: LinkShape | None = None
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 frame, got {capacity}")
        self.capacity = capacity
        self.copy = copy
        self._default = default or LinkShape()
        self._endpoints: dict[str, MemoryTransport] = {}
        self._wires: dict[tuple[str, str], LinkShaper] = {}
        self._stats: dict[tuple[str, str], LinkStats] = {}
        # items: (loop time the frame becomes receivable, frame)
        self._inboxes: dict[tuple[str, str, str], Inbox[tuple[float, Frame]]] = {}

    def shape(
        self,
        src: str,
        dst: str,
        *,
        bandwidth: float | None = None,
        latency: float = 0.0,
        both: bool = False,
    ) -> None:
        """Shape the direction ``src -> dst`` (and ``dst -> src`` too when ``both``)."""
        pairs = [(src, dst), (dst, src)] if both else [(src, dst)]
        for pair in pairs:
            self._wire(*pair).shape = LinkShape(bandwidth, latency)

    def endpoint(self, name: str) -> MemoryTransport:
        """The transport of party ``name`` (created on first call, and again after it closed)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"party name must be a non-empty string, got {name!r}")
        old = self._endpoints.get(name)
        if old is None or old.closed:  # a closed party may come back (reconnect)
            self._endpoints[name] = MemoryTransport(self, name)
            if old is not None:
                self._reopen_endpoint(name)
        return self._endpoints[name]

    # -- internals -------------------------------------------------------------------------
    def _wire(self, src: str, dst: str) -> LinkShaper:
        wire = self._wires.get((src, dst))
        if wire is None:
            wire = self._wires[(src, dst)] = LinkShaper(dataclasses.replace(self._default))
        return wire

    def _link_stats(self, src: str, dst: str) -> LinkStats:
        return self._stats.setdefault((src, dst), LinkStats())

    def _inbox(self, src: str, dst: str, channel: str) -> Inbox[tuple[float, Frame]]:
        key = (src, dst, channel)
        box = self._inboxes.get(key)
        if box is None:
            closed = self._closed(src) or self._closed(dst)
            box = self._inboxes[key] = Inbox(self.capacity, closed=closed)
        return box

    def _closed(self, name: str) -> bool:
        ep = self._endpoints.get(name)
        return ep is not None and ep.closed

    def _close_endpoint(self, name: str) -> None:
        for (src, dst, _), box in self._inboxes.items():
            if name in (src, dst):
                box.close()  # senders waiting for a slot fail, receivers drain then fail

    def _reopen_endpoint(self, name: str) -> None:
        """A party came back under the same name (a restarted process). Its inbound frames died
        with the old endpoint; frames it sent earlier stay receivable, then its new ones follow."""
        for key, box in list(self._inboxes.items()):
            src, dst, _ = key
            if dst == name:
                del self._inboxes[key]
            elif src == name and not self._closed(dst):
                box.reopen()


class MemoryTransport:
    """One party's endpoint on a `MemoryNetwork`. Implements `tandem.transports.base.Transport`."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self._net = network
        self._name = name
        self._ids: collections.defaultdict[tuple[str, str], itertools.count[int]] = (
            collections.defaultdict(itertools.count)
        )
        self.closed = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def peers(self) -> tuple[str, ...]:
        return tuple(n for n in self._net._endpoints if n != self._name)

    def _check_peer(self, peer: str) -> None:
        if self.closed:
            raise TransportClosedError(f"transport of {self._name!r} is closed")
        if peer == self._name or peer not in self._net._endpoints:
            raise UnknownPeerError(
                f"{self._name!r} has no peer {peer!r}; known peers: {sorted(self.peers)}"
            )

    async def send(self, peer: str, channel: str, frame: Frame) -> None:
        self._check_peer(peer)
        arrays = (
            tuple(np.array(a, copy=True) for a in frame.arrays)
            if self._net.copy
            else tuple(np.asarray(a) for a in frame.arrays)
        )
        # the constructor, not dataclasses.replace: this is on every message's path
        frame = Frame(
            sender=self._name,
            channel=channel,
            msg_id=next(self._ids[(peer, channel)]),
            spec_hash=frame.spec_hash,
            meta=frame.meta,
            arrays=arrays,
        )
        size = codec.encoded_size(frame)
        box = self._net._inbox(self._name, peer, channel)
        wire = self._net._wire(self._name, peer)
        if not await box.reserve():
            raise TransportClosedError(
                f"link {self._name!r} -> {peer!r} closed while waiting for a slot"
            )
        loop = asyncio.get_running_loop()
        delivered = False
        try:
            if box.closed:
                raise TransportClosedError(f"link {self._name!r} -> {peer!r} is closed")
            async with wire.transmit(size, offered=loop.time()) as end:
                if box.closed:
                    raise TransportClosedError(f"link {self._name!r} -> {peer!r} is closed")
                stats = self._net._link_stats(self._name, peer)
                stats.frames += 1
                stats.bytes += size
                stats.busy_seconds += wire.seconds(size)
                box.deliver((end + wire.shape.latency, frame))
                delivered = True
        finally:
            if not delivered:
                box.unreserve()

    async def recv(self, peer: str, channel: str) -> Frame:
        self._check_peer(peer)
        box = self._net._inbox(peer, self._name, channel)
        loop = asyncio.get_running_loop()
        while True:
            first = await box.peek()
            if first is None:
                raise TransportClosedError(
                    f"link {peer!r} -> {self._name!r} closed with no frame pending on {channel!r}"
                )
            deliver_at, frame = first
            wait = deliver_at - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)  # the frame stays queued if we are cancelled here
                continue
            box.pop()
            return frame

    def sent_stats(self, peer: str) -> LinkStats:
        return self._net._link_stats(self._name, peer)

    def received_stats(self, peer: str) -> LinkStats:
        return self._net._link_stats(peer, self._name)

    def link_shape(self, peer: str) -> LinkShape:
        """Configured shape of local -> peer (the tuner's prior before anything is measured)."""
        return self._net._wire(self._name, peer).shape

    async def start(self) -> MemoryTransport:
        """`Transport.start`: an endpoint is usable from its creation; returns it."""
        if self.closed:
            raise TransportClosedError(f"transport of {self._name!r} is closed; make a new one")
        return self

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._net._close_endpoint(self._name)
