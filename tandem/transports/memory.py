"""In-memory transport with per-link, per-direction shaping.

A `MemoryNetwork` holds the parties of one process; `network.endpoint(name)` gives each party
its `Transport`. Each direction of each link can be shaped with a bandwidth (bytes/s) and a
latency (s), so a laptop can emulate a WAN:

* one frame at a time occupies a direction for ``encoded_size / bandwidth`` seconds (the wire
  is serialised across channels, as on a real link); the two directions are independent
  (full duplex); frames offered while the wire is busy follow each other with no gap;
* a frame becomes receivable ``latency`` seconds after its transmission ends.

Every (sender, receiver, channel) inbox holds at most ``capacity`` frames; a sender waits for a
free slot *before* it occupies the wire, so a full channel never blocks other channels (no
head-of-line deadlock). Arrays are copied on send, as a process boundary would, unless the
network is built with ``copy=False``. Byte counters use the codec's exact encoded size.
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


class _Direction:
    """One direction of one link: the wire lock, its shape and its counters.

    Transmissions are scheduled on ideal times, not on when timers happen to fire:

    * ``free_at``: the ideal end of the last transmission. A frame *offered* (its inbox slot
      taken) before then was waiting for the wire, as behind a socket buffer, and starts
      exactly at ``free_at``: back-to-back frames leave no idle wire between them, however
      late the event loop gets round to them (uvloop's timers have 1 ms resolution; a loaded
      machine adds more).
    * ``late``: how far past ``free_at`` the last transmission's timer fired. A sender that
      awaits each send can offer its next frame only after that timer, so the next frame
      starts that much earlier (credited once); over back-to-back frames from such a sender the
      emulated link also carries exactly ``bandwidth``. The price: a frame sent after an idle
      spell may arrive up to one timer lateness early, once.
    """

    __slots__ = ("shape", "stats", "_wire", "late", "free_at")

    def __init__(self, shape: LinkShape) -> None:
        self.shape = shape
        self.stats = LinkStats()
        self._wire: asyncio.Lock | None = None
        self.late = 0.0
        self.free_at = float("-inf")

    @property
    def wire(self) -> asyncio.Lock:
        if self._wire is None:
            self._wire = asyncio.Lock()
        return self._wire


class _Inbox:
    """Frames from one sender on one channel, waiting at the receiver.

    Invariant: ``len(items) + in_transit + free == capacity`` (``free`` counts open slots).
    A closed inbox wakes every waiting sender, which then raises `TransportClosedError`.
    """

    __slots__ = ("items", "free", "freed", "arrived", "closed")

    def __init__(self, capacity: int) -> None:
        self.items: collections.deque[tuple[float, Frame]] = collections.deque()
        self.free = capacity
        self.freed = asyncio.Event()
        self.arrived = asyncio.Event()
        self.closed = False

    async def acquire(self) -> None:
        """Take a slot, waiting while none is free; raises once the inbox is closed."""
        while self.free == 0 and not self.closed:
            self.freed.clear()
            await self.freed.wait()
        if self.closed:
            raise TransportClosedError("link closed while waiting for a slot")
        self.free -= 1

    def release(self) -> None:
        self.free += 1
        self.freed.set()


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
        self._directions: dict[tuple[str, str], _Direction] = {}
        self._inboxes: dict[tuple[str, str, str], _Inbox] = {}

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
            self._direction(*pair).shape = LinkShape(bandwidth, latency)

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
    def _direction(self, src: str, dst: str) -> _Direction:
        d = self._directions.get((src, dst))
        if d is None:
            d = self._directions[(src, dst)] = _Direction(dataclasses.replace(self._default))
        return d

    def _inbox(self, src: str, dst: str, channel: str) -> _Inbox:
        key = (src, dst, channel)
        box = self._inboxes.get(key)
        if box is None:
            box = self._inboxes[key] = _Inbox(self.capacity)
            if self._closed(src) or self._closed(dst):
                box.closed = True
        return box

    def _closed(self, name: str) -> bool:
        ep = self._endpoints.get(name)
        return ep is not None and ep.closed

    def _close_endpoint(self, name: str) -> None:
        for (src, dst, _), box in self._inboxes.items():
            if name in (src, dst):
                box.closed = True
                box.arrived.set()
                box.freed.set()  # senders waiting for a slot must fail, not hang

    def _reopen_endpoint(self, name: str) -> None:
        """A party came back under the same name (a restarted process). Its inbound frames died
        with the old endpoint; frames it sent earlier stay receivable, then its new ones follow."""
        for key, box in list(self._inboxes.items()):
            src, dst, _ = key
            if dst == name:
                del self._inboxes[key]
            elif src == name and not self._closed(dst):
                box.closed = False


class MemoryTransport:
    """One party's endpoint on a `MemoryNetwork`. Implements `tandem.transports.base.Transport`."""

    def __init__(self, network: MemoryNetwork, name: str) -> None:
        self._net = network
        self._name = name
        self._ids = collections.defaultdict(itertools.count)
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
        direction = self._net._direction(self._name, peer)
        await box.acquire()
        loop = asyncio.get_running_loop()
        offered = loop.time()
        try:
            if box.closed:
                raise TransportClosedError(f"link {self._name!r} -> {peer!r} is closed")
            async with direction.wire:
                bw = direction.shape.bandwidth
                tx = size / bw if bw else 0.0
                now = loop.time()
                # see _Direction: a frame that waited for the wire starts at its ideal end
                end = max(direction.free_at, offered - direction.late) + tx
                direction.late = 0.0
                direction.free_at = end
                if end > now:
                    await asyncio.sleep(end - now)
                direction.late = max(loop.time() - end, 0.0)
                if box.closed:
                    raise TransportClosedError(f"link {self._name!r} -> {peer!r} is closed")
                direction.stats.frames += 1
                direction.stats.bytes += size
                direction.stats.busy_seconds += tx
                box.items.append((end + direction.shape.latency, frame))
                box.arrived.set()
        except BaseException:
            box.release()
            raise

    async def recv(self, peer: str, channel: str) -> Frame:
        self._check_peer(peer)
        box = self._net._inbox(peer, self._name, channel)
        loop = asyncio.get_running_loop()
        while True:
            if box.items:
                deliver_at, frame = box.items[0]
                wait = deliver_at - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)  # frame stays queued if we are cancelled here
                    continue
                box.items.popleft()
                box.release()
                if not box.items:
                    box.arrived.clear()
                return frame
            if box.closed or self.closed:
                raise TransportClosedError(
                    f"link {peer!r} -> {self._name!r} closed with no frame pending on {channel!r}"
                )
            box.arrived.clear()
            await box.arrived.wait()

    def sent_stats(self, peer: str) -> LinkStats:
        return self._net._direction(self._name, peer).stats

    def received_stats(self, peer: str) -> LinkStats:
        return self._net._direction(peer, self._name).stats

    def link_shape(self, peer: str) -> LinkShape:
        """Configured shape of local -> peer (the tuner's prior before anything is measured)."""
        return self._net._direction(self._name, peer).shape

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._net._close_endpoint(self._name)
