"""What one HTTP receiver holds: its streams' state (`streams.StreamState`), the bounded
inboxes of delivered frames, the byte budget every held message counts against, what it knows
of each peer (retired incarnations, loss), and the sweeping of partial messages left idle.

Invariant (with `streams`): every message in a stream's ``partials`` or ``ready`` holds one
slot of its inbox and its bytes of the budget; a delivered frame holds its slot (the inbox's
item) and its bytes (``held``) until `recv` takes it. Dropping a message gives both back.
"""

from __future__ import annotations

import asyncio
import collections

from ..base import Frame, LinkStats
from ..inbox import Inbox
from .budget import ByteBudget
from .config import HttpConfig
from .protocol import Refuse
from .quietlog import QuietLog
from .streams import StreamState


class InboundStore:
    """The receiving state of one `server.HttpServer`; every method runs on its event loop."""

    def __init__(self, config: HttpConfig, quiet: QuietLog) -> None:
        self.cfg = config
        self.quiet = quiet
        self.closed = False
        self.budget = ByteBudget(config.budget_bytes())
        self.inboxes: dict[tuple[str, str], Inbox[Frame]] = {}
        self.held: dict[tuple[str, str], collections.deque[int]] = {}  # sizes of queued frames
        self.streams: dict[tuple[str, str], StreamState] = {}
        self.retired: dict[str, set[str]] = {}  # sender -> incarnations that said goodbye
        self.received: dict[str, LinkStats] = {}
        self.requests: dict[str, int] = {}  # path (plain|bulk|stream) -> bodies accepted
        self.lost: dict[str, str] = {}  # peer -> why it was taken as gone (see `liveness`)
        self.down_since: dict[str, float] = {}  # peer -> loop time its probes began failing
        self.dropped_partials = 0  # partial messages dropped after partial_timeout
        self._sweeper: asyncio.TimerHandle | None = None

    def close(self) -> None:
        """Refuse further frames; receives drain what is queued, then fail."""
        self.closed = True
        for box in self.inboxes.values():
            box.close()
        for state in self.streams.values():
            state.wake()

    def stats(self, peer: str) -> LinkStats:
        stats = self.received.get(peer)
        if stats is None:
            stats = self.received[peer] = LinkStats()
        return stats

    def inbox(self, peer: str, channel: str) -> Inbox[Frame]:
        """The inbox of frames from ``peer`` on ``channel`` (made on first use). Taking a
        frame from it gives the frame's bytes back to the budget."""
        key = (peer, channel)
        box = self.inboxes.get(key)
        if box is None:
            sizes = self.held[key] = collections.deque()

            def taken(_: Frame) -> None:
                self.budget.release(sizes.popleft())

            box = self.inboxes[key] = Inbox(self.cfg.capacity, closed=self.closed, on_take=taken)
        return box

    def deliver(self, box: Inbox[Frame], key: tuple[str, str], frame: Frame, size: int) -> None:
        self.held[key].append(size)
        box.deliver(frame)

    def known_incarnation(self, peer: str) -> str | None:
        """The incarnation of ``peer`` we receive from (None: never heard from, or retired)."""
        retired = self.retired.get(peer, ())
        return next(
            (
                st.incarnation
                for (s, _), st in self.streams.items()
                if s == peer and st.incarnation and st.incarnation not in retired
            ),
            None,
        )

    async def forget_incarnation(self, sender: str, inc: str) -> None:
        """What a goodbye of ``sender``'s incarnation ``inc`` does: its late requests are
        refused, its partial messages dropped, and ``recv`` from it raises once drained."""
        self.retired.setdefault(sender, set()).add(inc)
        for (s, channel), state in list(self.streams.items()):
            if s == sender and state.incarnation == inc:
                async with state.lock:
                    self.drop_pending(s, channel, state)
        for (s, _), box in list(self.inboxes.items()):
            if s == sender:
                box.close()

    # -- the byte budget and inbox slots -------------------------------------------------------
    async def reserve(self, box: Inbox[Frame], channel: str, total: int) -> None:
        """An inbox slot and ``total`` bytes of the budget for the next message in order, each
        waited for up to ``backpressure_wait``; `Refuse` (503) when either stays unavailable
        (then messages held ahead of their turn are dropped, so the retry finds room)."""
        wait = self.cfg.backpressure_wait
        if not await box.reserve(wait):
            if self.closed:
                raise Refuse(503, "closing", "receiver is closing")
            if box.closed:  # the sender said goodbye: nobody here reads its channels any more
                raise Refuse(
                    410,
                    "retired",
                    f"channel {channel!r} of this sender was closed by its goodbye; the "
                    "receiver no longer reads it (restart the receiver's session to talk again)",
                )
            raise Refuse(503, "busy", f"receiver busy: inbox of {channel!r} is full")
        if not await self.budget.acquire(total, wait):
            box.unreserve()
            self.evict_ahead()
            raise Refuse(
                503,
                "busy",
                f"receiver busy: {self.budget.held} of its inbound_budget="
                f"{self.budget.capacity} bytes are held; a message of {total} bytes waits",
            )

    def reserve_ahead(
        self,
        box: Inbox[Frame],
        state: StreamState,
        nid: int,
        msg_id: int,
        chunks: int,
        total: int,
    ) -> None:
        """An inbox slot and ``total`` bytes for a message ahead of its turn, taken only now
        and only where they leave a slot for every missing id before it and keep messages held
        ahead to half the budget (so the next message in order always finds room); else 503
        ``ahead`` (its sender waits and retries)."""
        if chunks > 1:
            raise Refuse(
                503, "ahead", f"chunked message {msg_id} is received once {nid} is delivered"
            )
        missing = msg_id - nid - state.reserved_between(nid, msg_id)
        if not box.try_reserve(keep_free=missing):
            if box.closed:
                raise Refuse(503, "closing", "receiver is closing")
            raise Refuse(
                503, "ahead", f"inbox slots are kept for the messages before {msg_id} (from {nid})"
            )
        held_ahead = sum(st.ahead_bytes() for st in self.streams.values())
        if held_ahead + total > self.budget.capacity // 2 or not self.budget.try_acquire(total):
            box.unreserve()
            raise Refuse(
                503, "ahead", f"budget bytes are kept for the messages before {msg_id} (from {nid})"
            )

    # -- dropping what is not delivered ----------------------------------------------------------
    def evict_ahead(self) -> None:
        """Drop every message held ahead of its turn (their senders send them again)."""
        for (sender, channel), state in list(self.streams.items()):
            nid = state.next_id
            if nid is None:
                continue
            for k in [k for k in state.partials if k > nid]:
                self.drop_partial(sender, channel, state, k)
            evicted = [k for k in state.ready if k > nid]
            for k in evicted:
                held = state.ready.pop(k)
                self.inbox(sender, channel).unreserve()
                self.budget.release(held.size)
            if evicted:
                state.wake()

    def drop_partial(self, sender: str, channel: str, state: StreamState, msg_id: int) -> None:
        """Forget partial message ``msg_id`` (if any): its reader is cut off, its inbox slot
        and budget bytes are given back."""
        part = state.partials.pop(msg_id, None)
        if part is not None:
            if part.reader is not None:
                part.reader.revoke()
            self.inbox(sender, channel).unreserve()
            self.budget.release(part.total)

    def drop_pending(self, sender: str, channel: str, state: StreamState) -> None:
        """Forget every message of ``state`` not yet delivered (partial or waiting its turn)."""
        for k in list(state.partials):
            self.drop_partial(sender, channel, state, k)
        for held in state.ready.values():
            self.inbox(sender, channel).unreserve()
            self.budget.release(held.size)
        state.ready.clear()
        state.wake()

    # -- sweeping ------------------------------------------------------------------------------
    def start_sweeping(self) -> None:
        """Sweep every `_sweep_every` s from now on (inside the running loop)."""
        loop = asyncio.get_running_loop()
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep)

    def stop_sweeping(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    def _sweep_every(self) -> float:
        return max(0.05, min(self.cfg.partial_timeout / 4, 5.0))

    def _sweep(self) -> None:
        """Drop partial messages nobody has read into for ``partial_timeout`` s (runs every
        `_sweep_every` s while serving)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        for (sender, channel), state in list(self.streams.items()):
            for part in list(state.partials.values()):
                if part.reader is not None or now - part.touched < self.cfg.partial_timeout:
                    continue
                self.drop_partial(sender, channel, state, part.msg_id)
                self.dropped_partials += 1
                self.quiet.info(
                    "%s: dropped message %d from %r on %r: idle for partial_timeout=%g s with "
                    "%d of %d bytes",
                    self.cfg.name,
                    part.msg_id,
                    sender,
                    channel,
                    self.cfg.partial_timeout,
                    part.filled,
                    part.total,
                )
        self._sweeper = loop.call_later(self._sweep_every(), self._sweep)


__all__ = ["InboundStore"]
