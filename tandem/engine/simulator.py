"""Discrete-event simulator of a set of plans. Pure Python: no asyncio, no JAX.

It models exactly what the runtime does: one compute lane per party choosing ops with the
same `tandem.engine.policy.Policy` (`PRIORITY`, or the `FIFO` baseline); an outbound queue per
party whose sends, in FIFO order per peer, occupy the directed link for ``nbytes / bandwidth``
seconds (one frame at a time per direction, across channels) and arrive ``latency`` seconds
after their transmission ends. A frame leaves the outbound count when its transmission ends.

`simulate` returns the makespan and a `Trace`; with the same costs, the runtime on a virtual
clock produces the same per-party op order
(tests/test_scheduling.py::test_runtime_op_order_matches_the_simulation).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
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
    policy = as_policy(policy)
    if callable(links):
        link_of = links
    else:
        table = dict(links or {})
        link_of = lambda s, d: table.get((s, d), Link())  # noqa: E731
    for plan in plans.values():
        bp.check_plan(plan)
    seq = itertools.count()
    events: list = []
    trace = Trace()
    remaining = {p: {op: len(pl.deps.get(op, ())) for op in pl.ops} for p, pl in plans.items()}
    ready = {p: ReadySet(pl.key) for p, pl in plans.items()}
    busy = {p: False for p in plans}
    outbound = {p: 0 for p in plans}
    queues: dict[tuple[str, str], collections.deque] = collections.defaultdict(collections.deque)
    link_busy: dict[tuple[str, str], bool] = collections.defaultdict(bool)
    done = {p: 0 for p in plans}

    def push(t: float, *ev) -> None:
        heapq.heappush(events, (t, next(seq), ev))

    def dispatch(p: str, t: float) -> None:
        if busy[p]:
            return
        op = policy.choose(ready[p], outbound[p], plans[p], bp)
        if op is None:
            return
        ready[p].remove(op)
        busy[p] = True
        push(t + cost(p, op), "compute_done", p, op, t)

    def start_link(src: str, dst: str, t: float) -> None:
        key = (src, dst)
        if link_busy[key] or not queues[key]:
            return
        op = queues[key].popleft()
        link = link_of(src, dst)
        size = nbytes(src, op)
        dur = size / link.bandwidth if link.bandwidth else 0.0
        link_busy[key] = True
        push(t + dur, "tx_done", src, dst, op, t, size)

    def complete(p: str, op: Op, t: float) -> None:
        done[p] += 1
        for s in plans[p].successors[op]:
            remaining[p][s] -= 1
            if remaining[p][s] == 0:
                if s.kind is Kind.SEND:
                    outbound[p] += 1
                    queues[(p, s.peer)].append(s)
                    start_link(p, s.peer, t)
                elif s.is_compute:
                    ready[p].add(s)

    for p, pl in plans.items():
        for op in pl.ops:
            if op.is_compute and remaining[p][op] == 0:
                ready[p].add(op)
    for p in plans:
        dispatch(p, 0.0)
    now = 0.0
    while events:
        now, _, ev = heapq.heappop(events)
        kind = ev[0]
        if kind == "compute_done":
            _, p, op, start = ev
            trace.add(TraceEvent(p, "compute", str(op), op.mb, start, now))
            busy[p] = False
            complete(p, op, now)
            dispatch(p, now)
        elif kind == "tx_done":
            _, src, dst, op, start, size = ev
            trace.add(TraceEvent(src, f"send->{dst}", str(op), op.mb, start, now, size))
            link_busy[(src, dst)] = False
            outbound[src] -= 1
            done[src] += 1
            push(
                now + link_of(src, dst).latency,
                "arrive",
                dst,
                Op(Kind.RECV, op.mb, channel=op.channel, peer=src),
            )
            start_link(src, dst, now)
            dispatch(src, now)
        else:  # arrive
            _, p, recv = ev
            if recv not in remaining[p]:
                raise PlanError(f"{p!r} received {recv}, which its plan does not expect")
            complete(p, recv, now)
            dispatch(p, now)
    for p, pl in plans.items():
        if done[p] != len(pl.ops):
            stuck = [str(op) for op in pl.ops if remaining[p][op] > 0][:6]
            raise PlanError(
                f"simulation deadlocked: {p!r} finished {done[p]}/{len(pl.ops)} ops; "
                f"waiting: {stuck}"
            )
    return SimResult(now, trace)
