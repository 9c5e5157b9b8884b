"""Reassembly: each chunk of an authenticated sender's message, however it came (a POST, a
bulk body, a frame stream's record), admitted into its stream, read into its message's buffer
without holding a lock, and the complete message checked and delivered in id order
(`streams` states the ordering rule and its invariants).

Admission steps, in order: the head's sizes, chunk consistency, spec and retired incarnation
(`message_state`); a new incarnation adopted, a duplicate answered (`open_turn`); the send
window; an inbox slot and the bytes of the budget (`store.InboundStore.reserve`, waiting up
to ``backpressure_wait``); the chunk's order. Then the body is read (its digest checked, 401),
the frame checked (`checks.FrameChecks`) and held until its turn (`advance`).
"""

from __future__ import annotations

import asyncio
import time

from .. import auth
from ..base import Frame
from ..bodymac import BodyMac
from ..inbox import Inbox
from .body import Body, PlainBody, read_into
from .bulk import BulkBody
from .checks import FrameChecks
from .config import HttpConfig
from .protocol import H_BASE, INLINE_BYTES, MessageHead, Refuse, Reply, spec_text
from .scan import FiniteScan
from .store import InboundStore
from .streams import Claim, Held, Partial, StreamState
from .streamserve import RecordBody

MAX_STREAMS = 1024  # (sender, channel) streams a receiver keeps state for


class Reassembler:
    """Receives messages into ``store`` for one `server.HttpServer`, judging each frame with
    ``checks``."""

    def __init__(self, config: HttpConfig, store: InboundStore, checks: FrameChecks) -> None:
        self.cfg = config
        self.store = store
        self.checks = checks

    # -- a message's head --------------------------------------------------------------------
    def message_state(
        self, head: MessageHead, length: int, spec: str | None
    ) -> tuple[tuple[str, str], StreamState]:
        """The checks of a message chunk's head, before any lock or memory is taken (sizes,
        chunk consistency, spec, retired incarnation, base), and its stream's state."""
        sender, channel, inc, msg_id, chunk, chunks, offset, total, base = head
        if total > self.cfg.max_frame_bytes:
            raise Refuse(
                413,
                "too_large",
                f"frame of {total} bytes exceeds max_frame_bytes="
                f"{self.cfg.max_frame_bytes} of {self.cfg.name!r}; raise it on the "
                "receiver or send smaller tensors",
            )
        self.checks.check_size(sender, channel, total)
        if not (
            chunks >= 1
            and 0 <= chunk < chunks
            and offset + length <= total
            and (chunks > 1 or length == total)
        ):
            raise Refuse(
                400,
                "malformed",
                f"inconsistent chunk headers: chunk {chunk} of {chunks}, offset "
                f"{offset} + length {length} > total {total}",
            )
        spec_hash = self.checks.hooks.spec_hash
        if spec is not None and spec_hash and spec != spec_hash:
            raise Refuse(409, "spec_mismatch", spec_text(spec, spec_hash))
        if inc in self.store.retired.get(sender, ()):
            raise Refuse(410, "retired", f"incarnation {inc} of {sender!r} has closed")
        key = (sender, channel)
        streams = self.store.streams
        state = streams.get(key)
        if state is None:
            if len(streams) >= MAX_STREAMS:
                raise Refuse(503, "busy", f"receiver keeps {MAX_STREAMS} streams at most")
            state = streams[key] = StreamState()
        if base > msg_id:
            raise Refuse(
                400, "malformed", f"header {H_BASE} ({base}) is above the message id ({msg_id})"
            )
        return key, state

    def adopt_incarnation(self, sender: str, channel: str, state: StreamState, inc: str) -> None:
        """A (re)started sender: fresh ordering state for its new incarnation ``inc`` (the
        former one is retired). Call with ``state.lock`` held, or with nothing awaited."""
        store = self.store
        store.lost.pop(sender, None)
        store.down_since.pop(sender, None)
        if state.incarnation:
            store.retired.setdefault(sender, set()).add(state.incarnation)
        store.drop_pending(sender, channel, state)
        state.incarnation, state.next_id = inc, None
        state.refused.clear()
        box = store.inbox(sender, channel)
        if box.closed and not store.closed:
            box.reopen()

    def open_turn(
        self, sender: str, channel: str, state: StreamState, inc: str, msg_id: int, base: int
    ) -> Reply | int:
        """The first admission steps of message ``msg_id`` (both paths take them, in this
        order): adopt the sender's incarnation ``inc`` if it is new, answer a message below
        the stream's next id as a duplicate, forget an earlier refusal of it (sent again: it
        is judged afresh); then the id the stream expects next, once the ids the sender
        settled (below ``base``) are skipped. Call with ``state.lock`` held, or with nothing
        awaited."""
        if state.incarnation != inc:
            self.adopt_incarnation(sender, channel, state, inc)
        if state.next_id is not None and msg_id < state.next_id:
            return Reply(200, "duplicate")
        state.refused.pop(msg_id, None)
        return max(base, state.next_id if state.next_id is not None else base)

    # -- one chunk, start to end -------------------------------------------------------------
    async def receive_message(
        self, head: MessageHead, length: int, spec: str | None, body: Body, digest: str | None
    ) -> Reply:
        """Admission, reading and delivery of one chunk of an authenticated sender's message,
        whichever way it came (a POST, a bulk body, or a frame stream's record). ``spec``: the
        spec hash the request names (None: only the decoded frame's is checked); ``digest``:
        the body's expected SHA-256 (None: the body is authenticated otherwise, or not at
        all without a secret)."""
        key, state = self.message_state(head, length, spec)
        async with state.lock:  # admission: bounded by backpressure_wait, never a body read
            admitted = await self._admit(key, state, head, length, body)
        if isinstance(admitted, Reply):
            return admitted
        part, claim, waited = admitted
        if part is None:  # a retry of a message waiting in the reorder buffer: no body to read
            return await self.await_turn(state, head.incarnation, head.msg_id, waited)
        assert claim is not None  # with its partial message
        t_read = await self._read(head, length, body, digest, part, claim)
        reply = await self._settle(key, state, head, length, part, claim, (waited, t_read))
        if reply is not None:
            return reply
        return await self.await_turn(state, head.incarnation, head.msg_id, waited)

    async def _admit(
        self,
        key: tuple[str, str],
        state: StreamState,
        head: MessageHead,
        length: int,
        body: Body,
    ) -> Reply | tuple[Partial | None, Claim | None, float]:
        """The admission of a chunk, ``state.lock`` held: a `Reply` when it is answered at
        once (a duplicate); else its partial message and the claim to write into it (None,
        None: the message is complete, waiting in ``ready``) and the seconds it waited."""
        sender, channel, inc, msg_id, chunk, chunks, offset, total, base = head
        store, loop, waited = self.store, asyncio.get_running_loop(), 0.0
        turn = self.open_turn(sender, channel, state, inc, msg_id, base)
        if isinstance(turn, Reply):
            return turn
        next_id = turn
        box = store.inbox(sender, channel)
        held = state.ready.get(msg_id)
        if held is not None:
            held.base = max(held.base, base)
            self.advance(key, state)
            return None, None, waited
        if msg_id - next_id >= self.cfg.send_window:
            raise Refuse(
                503,
                "ahead",
                f"message {msg_id} on {channel!r} is send_window="
                f"{self.cfg.send_window} or more ahead of message {next_id}, the next "
                "in order; it is accepted once the messages before it are delivered",
            )
        part = state.partials.get(msg_id)
        if part is not None and chunk < part.next_chunk:
            return Reply(200, "duplicate")
        if chunk == 0 and part is None:
            t0 = time.monotonic()
            if msg_id > next_id:
                store.reserve_ahead(box, state, next_id, msg_id, chunks, total)
            else:
                await store.reserve(box, channel, total)
            waited = time.monotonic() - t0
            part = state.partials[msg_id] = Partial(msg_id, chunks, total, loop.time())
            if self.cfg.reject_nonfinite and total >= INLINE_BYTES:
                part.scan = FiniteScan(part.buffer)
        elif part is None or chunk != part.next_chunk:
            expect = part.next_chunk if part is not None else 0
            raise Refuse(
                409,
                "out_of_order",
                f"chunk {chunk} of message {msg_id} is out of order; expected chunk {expect}",
                expect_chunk=expect,
            )
        if part.chunks != chunks or part.total != total or offset != part.filled:
            store.drop_partial(sender, channel, state, msg_id)
            raise Refuse(
                400,
                "malformed",
                "chunk headers disagree with the message's "
                f"first chunk (chunks {chunks}, total {total}, offset {offset})",
            )
        claim = part.claim(body.abort, loop.time())  # revokes a stalled older reader
        if part.scan is not None:
            part.scan.rewind(offset)  # a chunk received again: forget its earlier bytes
        return part, claim, waited

    async def _read(
        self,
        head: MessageHead,
        length: int,
        body: Body,
        digest: str | None,
        part: Partial,
        claim: Claim,
    ) -> float:
        """Read the chunk's body into ``part``'s buffer without the lock (a retry of this
        chunk may take it over meanwhile), checking its digest (401); returns when the read
        began (`time.monotonic`)."""
        loop = asyncio.get_running_loop()
        offset = head.offset
        t_read = time.monotonic()
        try:
            hasher: auth.BodyHasher | BodyMac | None = None
            if isinstance(body, BulkBody) and body.mac is not None:
                hasher = body.mac  # a shared secret's GMAC (`auth.DEFERRED_MAC`)
            elif digest is not None:
                hasher = auth.body_hasher()
            if isinstance(body, PlainBody):
                body.claim = claim
            path = await body.begin(part.buffer, offset, length, part.scan)  # bulk: 101 here
            self.store.requests[path] = self.store.requests.get(path, 0) + 1
            await read_into(
                body,
                part.buffer,
                offset,
                length,
                # the bulk sink feeds a GMAC as the bytes land (`bulk.BulkSink`)
                None if isinstance(body, BulkBody) and body.mac is not None else hasher,
                part.scan,
                # a stream record's body is already in memory: nothing can stall
                idle=None if isinstance(body, RecordBody) else self.cfg.body_idle_timeout,
                claim=claim,
            )
            if hasher is not None:
                if digest in (auth.DEFERRED, auth.DEFERRED_MAC) and isinstance(body, BulkBody):
                    digest = await body.trailer_digest(self.cfg.body_idle_timeout)
                if digest is None or not auth.digest_matches(hasher, digest):
                    raise Refuse(401, "unauthenticated", "body digest does not match")
        except BaseException:
            part.unclaim(claim, loop.time())
            raise
        return t_read

    async def _settle(
        self,
        key: tuple[str, str],
        state: StreamState,
        head: MessageHead,
        length: int,
        part: Partial,
        claim: Claim,
        times: tuple[float, float],
    ) -> Reply | None:
        """After the read, ``state.lock`` taken: count the chunk; 200 ``chunk`` when more
        follow; else check the complete frame and hold it for its turn (None). ``times``:
        the seconds admission waited, and when the read began."""
        sender, channel, inc, msg_id, chunk, *_ = head
        waited, t_read = times
        store, loop = self.store, asyncio.get_running_loop()
        async with state.lock:
            part.unclaim(claim, loop.time())
            if state.partials.get(msg_id) is not part or not claim.live:
                raise Refuse(
                    409,
                    "superseded",
                    f"chunk {chunk} of message {msg_id} was taken over by a newer request",
                )
            stats = store.stats(sender)
            stats.bytes += length
            stats.busy_seconds += time.monotonic() - t_read
            part.filled += length
            part.next_chunk += 1
            if part.next_chunk < part.chunks:
                return Reply(200, "chunk", waited)
            del state.partials[msg_id]
            box = store.inbox(sender, channel)
            try:
                frame = await self.checks.check_frame(
                    sender, channel, msg_id, part.buffer, part.scan
                )
            except BaseException:
                box.unreserve()
                store.budget.release(part.total)
                raise
            if state.incarnation != inc or (state.next_id is not None and msg_id < state.next_id):
                box.unreserve()  # the stream moved on while the frame was checked
                store.budget.release(part.total)
                raise Refuse(409, "superseded", f"message {msg_id} was settled meanwhile")
            state.ready[msg_id] = Held(frame, part.total, head.base)
            self.advance(key, state)
        return None

    # -- judged on the spot, and delivery in order --------------------------------------------
    def receive_now(self, head: MessageHead, body: memoryview) -> Reply | None:
        """`receive_message` for a single-chunk message whose body is already in memory and
        authenticated (a frame stream's record), judged on the spot when nothing must be
        awaited: the same checks in the same order, the same verdicts and counters. None, with
        nothing taken, when it would have to wait: its stream's lock is held, it is not the
        next message in order, no inbox slot or budget is free at once, or its checks run in a
        worker thread (large payload, a ``validator`` that is not inline); the caller then runs
        `receive_message`, which picks up where this left off."""
        sender, channel, inc, msg_id, _, _, _, total, base = head
        store, length = self.store, len(body)
        key, state = self.message_state(head, length, None)
        if state.lock.locked() or total >= INLINE_BYTES or not self.checks.validator_inline():
            return None
        # nothing below awaits: the stream's lock would be taken and released untouched
        turn = self.open_turn(sender, channel, state, inc, msg_id, base)
        if isinstance(turn, Reply):
            return turn
        next_id = turn
        if msg_id != next_id or msg_id in state.ready or msg_id in state.partials:
            return None  # ahead of its turn, or a retry of a message held: it may wait
        box = store.inbox(sender, channel)
        if not box.try_reserve():
            return None
        if not store.budget.try_acquire(total):
            box.unreserve()
            return None
        t_read = time.monotonic()
        # the record's bytes, copied at once into a writable buffer the frame's arrays view
        # (a bytearray: malloc's alignment suffices, the codec aligns arrays within it)
        buffer = memoryview(bytearray(body))
        store.requests["stream"] = store.requests.get("stream", 0) + 1
        stats = store.stats(sender)
        stats.bytes += length
        stats.busy_seconds += time.monotonic() - t_read
        try:
            frame = self.checks.decode_checked(sender, channel, msg_id, buffer)
            if self.cfg.reject_nonfinite or self.checks.hooks.validator is not None:
                # small arrays, an inline validator if any: on the loop
                self.checks.validate(frame)
        except BaseException:
            box.unreserve()
            store.budget.release(total)
            raise
        if state.ready or state.partials:
            state.ready[msg_id] = Held(frame, total, base)
            self.advance(key, state)
            return self.turn_settled(state, inc, msg_id, 0.0)
        return self.deliver_next(key, state, box, frame, total)

    def deliver_next(
        self,
        key: tuple[str, str],
        state: StreamState,
        box: Inbox[Frame],
        frame: Frame,
        size: int,
    ) -> Reply:
        """`advance` and `turn_settled` for the message the stream expects next (``box`` slot
        reserved, ``size`` bytes of the budget taken) when nothing else is held: the frame
        passes the ``admit_frame`` hook and is delivered (200), or its refusal is raised with
        its id left unused, as they would do."""
        store = self.store
        try:
            self.checks.check_admission(frame)
        except Refuse:
            box.unreserve()
            store.budget.release(size)
            state.wake()
            raise
        store.deliver(box, key, frame, size)
        store.stats(key[0]).frames += 1
        nid = state.next_id = frame.msg_id + 1
        if state.refused:
            for k in [k for k in state.refused if k < nid]:
                del state.refused[k]
        if state.waiters:
            state.wake()
        return Reply(200, "ok", 0.0)

    def advance(self, key: tuple[str, str], state: StreamState) -> None:
        """Deliver from ``ready`` in id order, each frame after the ``admit_frame`` hook; when
        ``next_id`` is missing, the lowest held message whose base is its own id (its sender
        settled every id before it) is delivered instead, skipping the missing ids (their
        partial messages are dropped). A frame the hook refuses leaves its id unused (as any
        refusal does: its sender may send that id again) and its refusal in ``refused`` for
        the request waiting on it. Wakes the waiting requests. Call with ``state.lock`` held."""
        store = self.store
        nid, woke = state.next_id, False
        while state.ready:
            if nid is not None and nid in state.ready:
                k = nid
            else:
                settled = [k for k, h in state.ready.items() if h.base == k]
                k = min(settled, default=-1)
                if k < 0 or (nid is not None and k < nid):
                    break
            held = state.ready.pop(k)
            box = store.inbox(*key)
            woke = True
            try:
                self.checks.check_admission(held.frame)
            except Refuse as r:
                box.unreserve()
                store.budget.release(held.size)
                state.refused[k] = r
                continue
            if state.partials:
                for gone in [j for j in state.partials if j < k]:
                    store.drop_partial(key[0], key[1], state, gone)
            store.deliver(box, key, held.frame, held.size)
            store.stats(key[0]).frames += 1
            nid = k + 1
        if nid != state.next_id:
            state.next_id = nid
            if nid is not None and state.refused:
                for k in [k for k in state.refused if k < nid]:
                    del state.refused[k]
        if woke:
            state.wake()

    async def await_turn(self, state: StreamState, inc: str, msg_id: int, waited: float) -> Reply:
        """Wait (up to ``backpressure_wait``) until complete message ``msg_id`` is delivered or
        refused in order; 503 ``ahead`` when the messages before it are still missing (the
        sender retries, with no body to read again), 503 ``evicted`` when it was dropped to
        make room (the sender sends it again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.backpressure_wait
        while True:
            reply = self.turn_settled(state, inc, msg_id, waited)
            if reply is not None:
                return reply
            nid = state.next_id
            if self.store.closed:
                raise Refuse(503, "closing", "receiver is closing")
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise Refuse(
                    503, "ahead", f"message {msg_id} waits for message {nid}, the next in order"
                )
            fut: asyncio.Future[None] = loop.create_future()
            state.waiters.append(fut)
            try:
                async with asyncio.timeout(remaining):
                    await fut
            except TimeoutError:
                pass
            finally:
                state.waiters.remove(fut)

    def turn_settled(
        self, state: StreamState, inc: str, msg_id: int, waited: float
    ) -> Reply | None:
        """Complete message ``msg_id``'s verdict once it is delivered (200) or refused (its
        refusal, raised; 410 when its incarnation was replaced, 503 ``evicted`` when it was
        dropped from the reorder buffer); None while it waits in ``ready`` for its turn."""
        if state.incarnation != inc:
            raise Refuse(410, "retired", f"incarnation {inc} was replaced meanwhile")
        refusal = state.refused.pop(msg_id, None)
        if refusal is not None:
            raise refusal
        nid = state.next_id
        if nid is not None and msg_id < nid:
            return Reply(200, "ok", waited)
        if msg_id not in state.ready:
            raise Refuse(
                503,
                "evicted",
                f"message {msg_id} was dropped from the reorder buffer to make room for "
                f"message {nid} before it; send it again",
            )
        return None


__all__ = ["MAX_STREAMS", "Reassembler"]
