"""The asyncio runtime: interprets one party's `Plan` for one batch.

Per batch, inside one `asyncio.TaskGroup`:

* one **compute lane** loop picks ready compute ops with the runtime's `Policy` (the same
  object the simulator uses) and runs them on the party's lane (a worker thread), so sends and
  receives progress during compute. With a `ThreadLane` (``lane.drives_batches``) that loop
  itself runs on the lane's thread: after an op it takes the batch's lock, records the op's
  completion and asks the policy again, so consecutive ops cost no thread hand-off; it blocks
  (on a plain lock, `_BatchState.wait`) only when nothing is ready, and arrivals and drained
  sends (loop thread, same batch lock) wake it.
  With a `VirtualLane` the loop is a coroutine that awaits each op (the simulator-vs-runtime
  tests run it on a virtual clock);
* one **send lane** per peer drains that peer's outbound FIFO through the transport, keeping
  up to `send_depth` frames handed over at once: the transport's send window where it has one
  (so a link carries a window of frames per round trip, not one), else the next frame waiting
  behind the one on the wire (``SEND_DEPTH``);
* one **receiver** per inbound (peer, channel) turns arriving frames into completed ``R`` ops.

Invariants: the batch's bookkeeping (`_BatchState`: readiness, the ready set, the outbound
count) is read and written only under ``_BatchState.lock``, never across a kernel call or an
``await``; an op starts only when all its dependencies completed; the outbound count (frames
queued or in transmission) never exceeds ``Backpressure.capacity``; every op of the plan runs
exactly once per batch. Any failure cancels the siblings and surfaces as an exception group;
on return (normal or not) no task of the batch is left running.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import numpy as np

from tandem.errors import EngineError, ShapeError
from tandem.transports.base import Frame, Transport, WindowedTransport

from .plan import Kind, Op, Plan
from .policy import DEFAULT_BACKPRESSURE, PRIORITY, Backpressure, Policy, ReadySet, as_policy
from .trace import Trace, TraceEvent

#: what one message carries: an array, or a tuple of arrays sent in one frame
Payload = np.ndarray | tuple[np.ndarray, ...]


class OpHandler(Protocol):
    """What the runtime calls to execute a plan's ops (e.g.
    `tandem.parties.split.stages.StageHandler`)."""

    def compute(self, op: Op) -> Mapping[tuple[str, int], Payload]:
        """Run compute op ``op`` (on the lane thread); return ``{(channel, mb): payload}`` for
        each of its sends (``plan.successors[op]`` of kind ``S``): an array, or a tuple of
        arrays that travel in one frame (e.g. a compressed tensor and its scales)."""
        ...

    def receive(self, op: Op, array: Payload) -> None:
        """Store the payload of arrived message ``op`` (on the loop thread): its array when
        the frame carries one, else the tuple of its arrays; raise `ShapeError` if it is not
        what the plan expects."""
        ...


@dataclasses.dataclass
class BatchStats:
    wall: float = 0.0
    compute: float = 0.0
    ops: int = 0
    sent_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    max_outbound: int = 0


def message(batch: int, op: Op, payload: Payload) -> Frame:
    """The frame carrying the payload of send ``op`` of batch ``batch``."""
    arrays = payload if isinstance(payload, tuple) else (payload,)
    return Frame(meta={"b": batch, "m": op.mb}, arrays=arrays)


def payload_nbytes(payload: Payload) -> int:
    """Bytes of the arrays of ``payload``."""
    if isinstance(payload, tuple):
        return sum(int(a.nbytes) for a in payload)
    return int(payload.nbytes)


#: sends a party's runtime keeps in flight per peer over a transport that gives no send window
SEND_DEPTH = 2


#: round-trip samples a runtime keeps per peer; `LinkDepth` uses their minimum
ROUND_TRIP_SAMPLES = 8


def send_depth(
    transport: Transport,
    peer: str,
    channels: int,
    capacity: int,
    *,
    round_trip: float | None = None,
    bandwidth: float | None = None,
    frame_bytes: int = 0,
) -> int:
    """Frames a send lane hands ``transport`` at once for ``peer``, over ``channels`` channels.

    A `WindowedTransport` keeps ``send_window(peer)`` sends of each channel in flight and a send
    returns only once its frame is delivered, so a lane that offers ``d`` frames at once leaves
    the wire idle unless ``d - 1`` frames cover a round trip: the depth is
    ``1 + ceil(round_trip * bandwidth / frame_bytes)`` (the link's bandwidth-delay product in
    frames of this size), at least `SEND_DEPTH` and at most the window. No deeper: every frame
    in flight holds a request of its own, and more of them than the round trip needs only
    burst the wire. Until the round trip and bandwidth are measured, and over other
    transports, `SEND_DEPTH` (the next frame waits behind the one on the wire). Never more than
    ``capacity``: frames in flight count in the outbound queue, whose capacity bounds memory
    (`Backpressure`), so the depth adds no buffer of its own."""
    window = (
        transport.send_window(peer) * channels if isinstance(transport, WindowedTransport) else None
    )
    return _depth(window, capacity, round_trip, bandwidth, frame_bytes)


def _depth(
    window: int | None,
    capacity: int,
    round_trip: float | None,
    bandwidth: float | None,
    frame_bytes: int,
) -> int:
    """`send_depth` once the transport's window (None: it has none) is known."""
    depth = SEND_DEPTH
    if window is not None:
        if round_trip is not None and bandwidth and frame_bytes > 0:
            cover = 1 + math.ceil(max(round_trip, 0.0) * bandwidth / frame_bytes)
            depth = min(max(cover, SEND_DEPTH), window)
        else:
            depth = min(depth, window)
    return max(1, min(depth, capacity))


class LinkDepth:
    """What a runtime learns of one peer's link across batches, for `send_depth`: the round
    trip of a send, sampled from sends offered while none to that peer was in flight (their
    time minus their bytes' time on the wire at the transport's measured bandwidth), estimated
    by the minimum of the last `ROUND_TRIP_SAMPLES` (queueing and load only add time)."""

    def __init__(self) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=ROUND_TRIP_SAMPLES)

    def sample(self, seconds: float, nbytes: int, bandwidth: float | None) -> None:
        """Record an idle-lane send of ``nbytes`` that took ``seconds``."""
        if bandwidth:
            self.samples.append(max(seconds - nbytes / bandwidth, 0.0))

    @property
    def round_trip(self) -> float | None:
        return min(self.samples) if self.samples else None


class _SendLaneState:
    """One send lane's frames handed to the transport and not yet returned (``in_flight``),
    and the end of the latest completed send (a trace's wire start). Touched on the loop
    thread only; ``waiter`` is the lane's wait for a frame to come back, set while it waits."""

    __slots__ = ("in_flight", "sent", "waiter")

    def __init__(self) -> None:
        self.in_flight = 0
        self.sent = float("-inf")
        self.waiter: asyncio.Future[None] | None = None

    async def below(self, depth: int) -> None:
        """Return once fewer than ``depth`` frames are in flight."""
        while self.in_flight >= depth:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def returned(self) -> None:
        """A frame came back from the transport (sent or failed)."""
        self.in_flight -= 1
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class _Outbox:
    """One peer's outbound FIFO of ``(send op, payload)``, filled on the loop thread and drained
    by that peer's send lane. Bounded: more than ``capacity`` items is an `EngineError` (the
    policy never starts an op whose sends would exceed it). A deque and one waiter future: an
    `asyncio.Queue` costs several Python calls per item on the per-frame path."""

    __slots__ = ("items", "capacity", "waiter")

    def __init__(self, capacity: int) -> None:
        self.items: collections.deque[tuple[Op, Payload]] = collections.deque()
        self.capacity = capacity
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: tuple[Op, Payload]) -> None:
        if len(self.items) >= self.capacity:
            raise EngineError(f"outbound queue exceeded its capacity {self.capacity}")
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> tuple[Op, Payload]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


class _BatchState:
    """Mutable bookkeeping of one batch of one plan, guarded by ``lock`` (held for
    microseconds: never across a kernel or an ``await``). A lane-driven compute loop waiting
    for a ready op sets ``waiting`` (under ``lock``) and blocks on ``wakeup``; whoever makes an
    op ready or stops the batch clears ``waiting`` and releases ``wakeup`` once (`notify`), so
    the wait is one C-level lock acquire instead of a `threading.Condition`'s Python code.
    ``wake`` does that for the coroutine compute loop.

    Invariant: ``wakeup`` is released at most once per ``waiting = True`` (it is held while
    nobody waits or a wait is about to begin)."""

    def __init__(self, plan: Plan, policy: Policy, lane_driven: bool = False) -> None:
        self.lock = threading.Lock()
        self.wakeup = threading.Lock()
        self.wakeup.acquire()
        self.lane_driven = lane_driven
        self.stop = False  # set (under lock) when the batch is cancelled
        self.waiting = False  # a lane-driven compute loop waits on ``wakeup``
        self.clock: Callable[[], float] = time.monotonic  # the trace's clock (set by run)
        self.plan = plan
        self.policy = policy  # fixed for the batch
        self.remaining = dict(plan.indegree)  # a copy: the plan is shared by every batch
        self.ready = ReadySet(plan.key)
        self.outbound = 0
        self.max_outbound = 0
        self.queues: dict[str, _Outbox] = {}
        #: frames a lane-driven compute loop queued for the send lanes, not yet moved to
        #: ``queues`` on the loop; ``handover_due``: a move is scheduled on the loop
        self.handover: list[tuple[_Outbox, tuple[Op, Payload]]] = []
        self.handover_due = False
        self.wake = asyncio.Event()
        self.compute_left = len(plan.key)  # plan.key holds exactly the compute ops
        #: the plan's compute ops whose results are sent, and how many of them have not run;
        #: ``produced`` is set (on the loop) once none is left: every frame of the batch is
        #: then queued or sent
        self.producers = plan.producers
        self.producers_left = len(self.producers)
        self.produced = asyncio.Event()
        if not self.producers:
            self.produced.set()
        for op, k in plan.indegree.items():
            if k == 0 and op.kind is not Kind.SEND and op.kind is not Kind.RECV:
                self.ready.add(op)

    def notify(self) -> None:
        """An op became ready or a send drained (caller holds ``lock``, on the loop thread):
        wake the compute loop if it waits."""
        if self.lane_driven:
            if self.waiting:
                self.waiting = False
                self.wakeup.release()
        else:
            self.wake.set()

    def wait(self) -> None:
        """Block the lane-driven compute loop until `notify` (caller holds ``lock``; it is
        released while blocked and held again on return)."""
        self.waiting = True
        self.lock.release()
        try:
            self.wakeup.acquire()
        finally:
            self.lock.acquire()


class PartyRuntime:
    """Runs plans of one party over a transport. Holds no training state (see `OpHandler`).

    Args:
      transport: the party's transport.
      lane: a `ThreadLane` or `VirtualLane` (entered by the caller).
      backpressure: outbound threshold and hard capacity, in frames.
      policy: a `Policy` or the name of a built-in one (`as_policy`): ``"priority"`` (the
        method) or ``"fifo"`` (plan order; the sequential baseline). A batch runs with the
        policy set when it starts.
      trace: where to record op and transfer intervals (optional).
    """

    def __init__(
        self,
        transport: Transport,
        lane,
        *,
        backpressure: Backpressure = DEFAULT_BACKPRESSURE,
        policy: Policy | str = PRIORITY,
        trace: Trace | None = None,
    ) -> None:
        self.transport = transport
        self.lane = lane
        self.bp = backpressure
        self.policy: Policy = as_policy(policy)
        self.trace = trace
        self.counters: collections.Counter[str] = collections.Counter()
        self.op_seconds: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.links: dict[str, LinkDepth] = {}  # per peer, kept across batches
        # a runtime-checkable Protocol's isinstance costs microseconds: checked once, not per frame
        self._windowed = isinstance(transport, WindowedTransport)

    async def run(
        self,
        plan: Plan,
        handler: OpHandler,
        batch: int,
        *,
        computed: Callable[[BatchStats], Awaitable[None]] | None = None,
        produced: Callable[[BatchStats], Awaitable[None]] | None = None,
    ) -> BatchStats:
        """Execute every op of ``plan`` once; returns when all sends have been handed over.

        ``computed(stats)`` is awaited on the loop once every compute op has run
        (``stats.compute`` is final), while the batch's last sends may still be on the wire:
        a leader announces its next batch there, so that the command travels beside the last
        gradients instead of a round trip after them. The batch returns once the hook and the
        sends are done; an exception from the hook fails the batch like any other.

        ``produced(stats)`` is awaited on the loop, the same way, once every compute op whose
        result is sent has run (its frames are queued): the ops left are local-only (a
        backward whose input gradients stay here, an update), and ``stats.compute`` counts
        only the ops run so far. It comes before ``computed``, or with it when the last op
        sends. A leader whose next command depends on nothing this batch still computes
        announces it there: its followers then find it waiting when their update is done,
        whatever the leader's own local-only ops still take."""
        self.bp.check_plan(plan)
        loop = asyncio.get_running_loop()
        lane_driven = getattr(self.lane, "drives_batches", False)
        st = _BatchState(plan, self.policy, lane_driven)
        # trace clock: the loop's (virtual in tests) unless the lane's thread drives the batch;
        # then time.monotonic for every event, which asyncio's loop.time() also reads (uvloop's
        # reads the same clock, but cached once per loop iteration, in whole milliseconds)
        st.clock = time.monotonic if lane_driven else loop.time
        stats = BatchStats()
        t0 = st.clock()
        sends_per_peer = collections.Counter(op.peer for op in plan.sends)
        recv_channels = collections.Counter((op.peer, op.channel) for op in plan.recvs)
        for peer in sends_per_peer:
            st.queues[peer] = _Outbox(self.bp.capacity)
        async with asyncio.TaskGroup() as tg:
            for peer, count in sends_per_peer.items():
                tg.create_task(self._send_lane(st, peer, count, batch, stats))
            for (peer, channel), count in recv_channels.items():
                tg.create_task(self._receiver(st, handler, peer, channel, count, batch))
            tg.create_task(self._compute_lane(st, handler, batch, stats, computed))
            if produced is not None:
                tg.create_task(self._when_produced(st, stats, produced))
        stats.wall = st.clock() - t0
        stats.ops = len(plan.ops)
        stats.max_outbound = st.max_outbound
        return stats

    # -- the three kinds of lanes --------------------------------------------------------------
    def _pick(self, st: _BatchState) -> Op | None:
        """The policy's choice (caller holds ``st.lock``); removes it from the ready set."""
        op = st.policy.choose(st.ready, st.outbound, st.plan, self.bp)
        if op is not None:
            st.ready.remove(op)
        return op

    def _ran(self, st: _BatchState, op: Op, start: float, end: float, stats: BatchStats) -> None:
        stats.compute += end - start
        kind = op.kind._value_
        self.counters[kind] += 1
        self.op_seconds[kind] += end - start
        if self.trace is not None:
            self.trace.add(TraceEvent(st.plan.party, "compute", str(op), op.mb, start, end))

    async def _compute_lane(
        self,
        st: _BatchState,
        handler: OpHandler,
        batch: int,
        stats: BatchStats,
        computed: Callable[[BatchStats], Awaitable[None]] | None,
    ) -> None:
        await self._compute_ops(st, handler, batch, stats)
        if computed is not None:
            await computed(stats)

    async def _when_produced(
        self,
        st: _BatchState,
        stats: BatchStats,
        produced: Callable[[BatchStats], Awaitable[None]],
    ) -> None:
        await st.produced.wait()
        await produced(stats)

    def _ran_producer(self, st: _BatchState, op: Op) -> bool:
        """Count compute op ``op`` as run (caller holds ``st.lock``); true when it was the
        batch's last op whose result is sent."""
        if op not in st.producers:
            return False
        st.producers_left -= 1
        return st.producers_left == 0

    async def _compute_ops(
        self, st: _BatchState, handler: OpHandler, batch: int, stats: BatchStats
    ) -> None:
        if st.lane_driven:
            loop = asyncio.get_running_loop()

            def hand_over() -> None:  # on the loop: every frame the lane thread queued
                with st.lock:
                    items, st.handover = st.handover, []
                    st.handover_due = False
                for q, item in items:
                    q.put(item)

            def enqueue(q: _Outbox, item) -> None:  # from the lane thread, st.lock held
                # one loop wake-up for every frame queued until the loop takes them: a loop
                # slow to get the CPU (a loaded machine) then wakes once for several frames
                st.handover.append((q, item))
                if not st.handover_due:
                    st.handover_due = True
                    loop.call_soon_threadsafe(hand_over)

            def stop() -> None:
                with st.lock:
                    st.stop = True
                    st.notify()

            def all_produced() -> None:  # from the lane thread, after the op's sends' enqueue
                loop.call_soon_threadsafe(st.produced.set)

            await self.lane.run(
                None,
                lambda: self._drive(st, handler, stats, enqueue, all_produced),
                on_cancel=stop,
            )
            return
        loop = asyncio.get_running_loop()
        while st.compute_left:
            with st.lock:
                op = self._pick(st)
            if op is None:
                st.wake.clear()
                await st.wake.wait()
                continue
            start = st.clock()
            outputs = await self.lane.run(op, lambda op=op: handler.compute(op))
            end = st.clock()
            self._ran(st, op, start, end, stats)
            with st.lock:
                st.compute_left -= 1
                self._complete(st, op, outputs)
                if self._ran_producer(st, op):
                    st.produced.set()

    def _drive(
        self,
        st: _BatchState,
        handler: OpHandler,
        stats: BatchStats,
        enqueue: Callable,
        all_produced: Callable[[], None],
    ) -> None:
        """The compute loop of one batch, on the lane's thread (``lane.drives_batches``).
        Returns when every compute op ran, or early once ``st.stop`` is set (cancellation)."""
        clock = st.clock
        while True:
            with st.lock:
                while True:
                    if st.stop or not st.compute_left:
                        return
                    op = self._pick(st)
                    if op is not None:
                        break
                    st.wait()  # an arrival, a drained send or `stop` notifies
            start = clock()
            outputs = handler.compute(op)
            end = clock()
            self._ran(st, op, start, end, stats)
            with st.lock:
                st.compute_left -= 1
                self._complete(st, op, outputs, enqueue)
                if self._ran_producer(st, op):
                    all_produced()

    async def _send_lane(
        self, st: _BatchState, peer: str, count: int, batch: int, stats: BatchStats
    ) -> None:
        """Hand ``peer``'s outbound frames to the transport in FIFO order, up to `send_depth`
        at once: the next frame is already waiting when the wire frees, so queued
        frames leave no idle wire between them (as in `tandem.engine.simulator`) however late the
        loop gets round to them. Each send is a task of its own, started in queue order, so a
        transport that serialises a channel's sends (both do) keeps their order."""
        queue = st.queues[peer]
        capacity = self.bp.capacity
        window = None  # per frame only over a windowed transport: the depth then varies
        if self._windowed:
            channels = len({op.channel for op in st.plan.sends if op.peer == peer})
            window = self.transport.send_window(peer) * channels  # type: ignore[attr-defined]
        link = self.links.setdefault(peer, LinkDepth())
        lane = _SendLaneState()
        depth = _depth(None, capacity, None, None, 0)
        async with asyncio.TaskGroup() as tg:
            for _ in range(count):
                op, array = await queue.get()
                if window is not None:
                    depth = _depth(
                        window,
                        capacity,
                        link.round_trip,
                        self._bandwidth(peer),
                        payload_nbytes(array),
                    )
                if lane.in_flight >= depth:
                    await lane.below(depth)
                lane.in_flight += 1
                # an idle lane's send samples the round trip, which only a window's depth uses
                idle = window is not None and lane.in_flight == 1
                tg.create_task(self._send_one(st, peer, op, array, batch, stats, lane, idle))

    def _bandwidth(self, peer: str) -> float | None:
        try:
            return self.transport.sent_stats(peer).bandwidth()
        except (AttributeError, KeyError):  # a transport that keeps no counters for the peer
            return None

    async def _send_one(
        self,
        st: _BatchState,
        peer: str,
        op: Op,
        array: Payload,
        batch: int,
        stats: BatchStats,
        lane: _SendLaneState,
        idle: bool,
    ) -> None:
        offered = st.clock()
        try:
            await self.transport.send(peer, op.channel, message(batch, op, array))
        finally:
            lane.returned()
        end = st.clock()
        nbytes = payload_nbytes(array)
        if idle:
            self.links[peer].sample(end - offered, nbytes, self._bandwidth(peer))
        stats.sent_bytes[peer] = stats.sent_bytes.get(peer, 0) + nbytes
        if self.trace is not None:  # on the wire from when the frame before it left
            self.trace.add(
                TraceEvent(
                    st.plan.party,
                    f"send->{peer}",
                    str(op),
                    op.mb,
                    max(offered, min(lane.sent, end)),
                    end,
                    nbytes,
                )
            )
        lane.sent = max(lane.sent, end)
        with st.lock:
            st.outbound -= 1
            self._complete(st, op, None)
            st.notify()

    async def _receiver(
        self, st: _BatchState, handler: OpHandler, peer: str, channel: str, count: int, batch: int
    ) -> None:
        for m in range(count):
            frame = await self.transport.recv(peer, channel)
            got_b, got_m = frame.meta.get("b"), frame.meta.get("m")
            if got_b != batch or got_m != m or not frame.arrays:
                raise ShapeError(
                    f"{st.plan.party!r} expected micro-batch {m} of batch {batch} on {channel!r} "
                    f"from {peer!r} with a tensor, got batch={got_b} mb={got_m} with "
                    f"{len(frame.arrays)} tensors; the parties' plans disagree (same topology "
                    "and n_groups on both sides?)"
                )
            op = st.plan.recv_op[(peer, channel, m)]
            arrays = frame.arrays
            handler.receive(op, arrays[0] if len(arrays) == 1 else tuple(arrays))
            with st.lock:
                self._complete(st, op, None)
                st.notify()

    # -- bookkeeping -------------------------------------------------------------------------
    def _complete(
        self,
        st: _BatchState,
        op: Op,
        outputs: Mapping[tuple[str, int], Payload] | None,
        enqueue: Callable[[_Outbox, tuple[Op, Payload]], None] | None = None,
    ) -> None:
        """Record ``op``'s completion (caller holds ``st.lock``): successors whose dependencies
        are all done become ready; sends go to their peer's outbound queue (through
        ``enqueue`` when called off the loop thread)."""
        remaining = st.remaining
        for s in st.plan.successors[op]:
            left = remaining[s] - 1
            remaining[s] = left
            if left:
                continue
            kind = s.kind
            if kind is Kind.SEND:
                try:
                    array = outputs[(s.channel, s.mb)]  # type: ignore[index]
                except (KeyError, TypeError):
                    raise EngineError(
                        f"{op} produced no tensor for {s}; the handler must return "
                        f"one keyed (channel, micro-batch) for every send of the "
                        f"op"
                    ) from None
                st.outbound += 1
                st.max_outbound = max(st.max_outbound, st.outbound)
                if st.outbound > self.bp.capacity:  # invariant guarded by policy.choose
                    raise EngineError(f"outbound queue exceeded its capacity {self.bp.capacity}")
                if enqueue is None:
                    st.queues[s.peer].put((s, array))
                else:
                    enqueue(st.queues[s.peer], (s, array))
            elif kind is not Kind.RECV:
                st.ready.add(s)
