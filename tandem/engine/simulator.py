"""Discrete-event simulator of a set of plans. Pure Python: no asyncio, no JAX.

It models exactly what the runtime does: one compute lane per party choosing ops with the
same `tandem.engine.policy.Policy` (`PRIORITY`, or the `FIFO` baseline); an outbound queue per
party whose sends, in FIFO order per peer, occupy the directed link for ``nbytes / bandwidth``
seconds (one frame at a time per direction, across channels) and arrive ``latency`` seconds
after their transmission ends. A frame leaves the outbound count when its transmission ends.

`simulate` returns the makespan and a `Trace`; with the same costs, the runtime on a virtual
clock produces the same per-party op order
(tests/test_scheduling.py::test_runtime_op_order_matches_the_simulation). `replay` simulates
plans at the costs a traced run measured: the schedule's own makespan, without the engine's
cost.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
import statistics
from collections.abc import Callable, Mapping

from tandem.errors import PlanError

from .plan import Kind, Op, Plan
from .policy import DEFAULT_BACKPRESSURE, PRIORITY, Backpressure, Policy, ReadySet, as_policy
from .trace import Trace, TraceEvent


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    bandwidth: float | None = None  # bytes/s; None = instantaneous
    latency: float = 0.0


@dataclasses.dataclass
class SimResult:
    makespan: float
    trace: Trace

    def order(self, party: str) -> list[str]:
        return self.trace.order(party)


def simulate(
    plans: Mapping[str, Plan],
    *,
    cost: Callable[[str, Op], float],
    nbytes: Callable[[str, Op], int],
    links: Callable[[str, str], Link] | Mapping[tuple[str, str], Link] | None = None,
    bp: Backpressure = DEFAULT_BACKPRESSURE,
    policy: Policy | str = PRIORITY,
) -> SimResult:
    """Simulate one batch of every party's plan. ``cost(party, op)`` gives compute seconds,
    ``nbytes(party, send_op)`` the bytes a send puts on the wire; ``policy`` is a `Policy` or
    the name of a built-in one (`as_policy`)."""
    chosen = as_policy(policy)
    if callable(links):
        link_of = links
    else:
        table = dict(links or {})
        link_of = lambda s, d: table.get((s, d), Link())  # noqa: E731
    for plan in plans.values():
        bp.check_plan(plan)
    return _Simulation(plans, cost, nbytes, link_of, bp, chosen).run()


def replay(
    trace: Trace,
    plans: Mapping[str, Plan],
    *,
    links: Callable[[str, str], Link] | Mapping[tuple[str, str], Link] | None = None,
    bp: Backpressure = DEFAULT_BACKPRESSURE,
    policy: Policy | str = PRIORITY,
) -> SimResult:
    """`simulate` one batch of ``plans`` at the costs a run traced in ``trace``: each compute
    op costs the median duration of the ``trace``'s events of its party and name on the
    ``compute`` lane, each send the bytes its ``send->PEER`` event carried.

    With the plans, policy and backpressure the run used, the makespan is what the engine's
    schedule allows with zero engine cost: a run's wall time per batch minus it is the
    engine's own cost, and it minus a lower bound (the busiest resource) is the schedule's
    (fill, drain). Raises `PlanError` naming the ops the trace has no duration or size for
    (it ran at another group count or chunks)."""
    durations: dict[tuple[str, str], list[float]] = {}
    sizes: dict[tuple[str, str], int] = {}
    for e in trace.events:
        if e.lane == "compute":
            durations.setdefault((e.party, e.name), []).append(e.end - e.start)
        elif e.lane.startswith("send->"):
            sizes[(e.party, e.name)] = e.nbytes
    missing = [
        f"{p}:{op}"
        for p, plan in plans.items()
        for op in plan.ops
        if (op.is_compute and (p, str(op)) not in durations)
        or (op.kind is Kind.SEND and (p, str(op)) not in sizes)
    ]
    if missing:
        raise PlanError(
            f"the trace has no duration or size for {len(missing)} ops of the plans, e.g. "
            f"{missing[:3]}: trace a run at the plans' group count and chunks"
        )
    cost = {key: statistics.median(ds) for key, ds in durations.items()}
    return simulate(
        plans,
        cost=lambda p, op: cost[(p, str(op))],
        nbytes=lambda p, op: sizes[(p, str(op))],
        links=links,
        bp=bp,
        policy=policy,
    )


class _Simulation:
    """One `simulate` call: a heap of timed events (a compute op done, a send off the wire,
    a message arriving) over every party's ready set, compute lane, outbound count and link
    queues. Ties in time break by insertion order (``seq``), so a run is deterministic."""

    def __init__(
        self,
        plans: Mapping[str, Plan],
        cost: Callable[[str, Op], float],
        nbytes: Callable[[str, Op], int],
        link_of: Callable[[str, str], Link],
        bp: Backpressure,
        policy: Policy,
    ) -> None:
        self.plans, self.cost, self.nbytes, self.link_of = plans, cost, nbytes, link_of
        self.bp, self.policy = bp, policy
        self.seq = itertools.count()
        self.events: list = []
        self.trace = Trace()
        self.remaining = {
            p: {op: len(pl.deps.get(op, ())) for op in pl.ops} for p, pl in plans.items()
        }
        self.ready = {p: ReadySet(pl.key) for p, pl in plans.items()}
        self.busy = {p: False for p in plans}
        self.outbound = {p: 0 for p in plans}
        self.queues: dict[tuple[str, str], collections.deque] = collections.defaultdict(
            collections.deque
        )
        self.link_busy: dict[tuple[str, str], bool] = collections.defaultdict(bool)
        self.done = {p: 0 for p in plans}

    def push(self, t: float, *ev) -> None:
        heapq.heappush(self.events, (t, next(self.seq), ev))

    def dispatch(self, p: str, t: float) -> None:
        """Start ``p``'s next compute op (the policy's choice) if its lane is free."""
        if self.busy[p]:
            return
        op = self.policy.choose(self.ready[p], self.outbound[p], self.plans[p], self.bp)
        if op is None:
            return
        self.ready[p].remove(op)
        self.busy[p] = True
        self.push(t + self.cost(p, op), "compute_done", p, op, t)

    def start_link(self, src: str, dst: str, t: float) -> None:
        """Put the next queued send of link ``src -> dst`` on the wire if the link is free."""
        key = (src, dst)
        if self.link_busy[key] or not self.queues[key]:
            return
        op = self.queues[key].popleft()
        link = self.link_of(src, dst)
        size = self.nbytes(src, op)
        dur = size / link.bandwidth if link.bandwidth else 0.0
        self.link_busy[key] = True
        self.push(t + dur, "tx_done", src, dst, op, t, size)

    def complete(self, p: str, op: Op, t: float) -> None:
        """``op`` of ``p`` is done: release its successors (sends queue on their link)."""
        self.done[p] += 1
        for s in self.plans[p].successors[op]:
            self.remaining[p][s] -= 1
            if self.remaining[p][s] == 0:
                if s.kind is Kind.SEND:
                    self.outbound[p] += 1
                    self.queues[(p, s.peer)].append(s)
                    self.start_link(p, s.peer, t)
                elif s.is_compute:
                    self.ready[p].add(s)

    def run(self) -> SimResult:
        for p, pl in self.plans.items():
            for op in pl.ops:
                if op.is_compute and self.remaining[p][op] == 0:
                    self.ready[p].add(op)
        for p in self.plans:
            self.dispatch(p, 0.0)
        now = 0.0
        while self.events:
            now, _, ev = heapq.heappop(self.events)
            self.handle(now, ev)
        for p, pl in self.plans.items():
            if self.done[p] != len(pl.ops):
                stuck = [str(op) for op in pl.ops if self.remaining[p][op] > 0][:6]
                raise PlanError(
                    f"simulation deadlocked: {p!r} finished {self.done[p]}/{len(pl.ops)} ops; "
                    f"waiting: {stuck}"
                )
        return SimResult(now, self.trace)

    def handle(self, now: float, ev: tuple) -> None:
        """Apply one event at time ``now``."""
        kind = ev[0]
        if kind == "compute_done":
            _, p, op, start = ev
            self.trace.add(TraceEvent(p, "compute", str(op), op.mb, start, now))
            self.busy[p] = False
            self.complete(p, op, now)
            self.dispatch(p, now)
        elif kind == "tx_done":
            _, src, dst, op, start, size = ev
            self.trace.add(TraceEvent(src, f"send->{dst}", str(op), op.mb, start, now, size))
            self.link_busy[(src, dst)] = False
            self.outbound[src] -= 1
            self.done[src] += 1
            self.push(
                now + self.link_of(src, dst).latency,
                "arrive",
                dst,
                Op(Kind.RECV, op.mb, channel=op.channel, peer=src),
            )
            self.start_link(src, dst, now)
            self.dispatch(src, now)
        else:  # arrive
            _, p, recv = ev
            if recv not in self.remaining[p]:
                raise PlanError(f"{p!r} received {recv}, which its plan does not expect")
            self.complete(p, recv, now)
            self.dispatch(p, now)
