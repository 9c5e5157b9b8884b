"""The scheduling policy: which ready compute op runs next. Pure; shared by the simulator and
the asyncio runtime, so a test can compare their traces.

A policy is an object with a ``name`` and a ``choose(ready, outbound, plan, bp)`` method (the
`Policy` protocol). Two are built in: `PRIORITY` (the method, below) and `FIFO` (plan order: the
sequential baseline). Settings name them by string; `as_policy` turns a name into the object,
once, where a setting enters the engine.

Rules of `PRIORITY` (see docs/design.md):

1. Below the outbound threshold, the ready op with the smallest key ``(distance to a send,
   micro-batch, seeded tie-break)`` runs: send-producing ops outrank local-only ones, and the op
   nearest a send outranks those feeding it.
2. At or above the threshold, a local-only op runs if one is ready (memory stays capped while
   the link drains); otherwise rule 1 applies.
3. Hard capacity: an op whose sends would push the outbound queue above ``capacity`` never
   starts; if nothing else is ready the lane waits (`choose` returns None) until a send drains.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Mapping
from typing import Protocol

from tandem.errors import ConfigError

from .plan import LOCAL_ONLY, Op, Plan


@dataclasses.dataclass(frozen=True, slots=True)
class Backpressure:
    """Outbound queue limits, counted in frames queued or in transmission.

    Invariant: ``1 <= threshold <= capacity``.
    """

    threshold: int = 4
    capacity: int = 8

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, int) and isinstance(self.capacity, int)):
            raise ConfigError("backpressure threshold and capacity must be ints")
        if not 1 <= self.threshold <= self.capacity:
            raise ConfigError(
                f"backpressure needs 1 <= threshold <= capacity, got threshold={self.threshold}, "
                f"capacity={self.capacity}"
            )

    def scaled(self, factor: int) -> Backpressure:
        """Threshold and capacity times ``factor``: what a party runs with when each group's
        output travels as ``factor`` chunks (`tandem.engine.plan`), so the same bytes stay in
        flight."""
        return (
            self if factor == 1 else Backpressure(self.threshold * factor, self.capacity * factor)
        )

    def check_plan(self, plan: Plan) -> None:
        if plan.max_fanout > self.capacity:
            op = max(plan.fanout, key=plan.fanout.__getitem__)
            raise ConfigError(
                f"outbound capacity {self.capacity} is smaller than the {plan.max_fanout} sends "
                f"that {op} on {plan.party!r} produces at once; raise capacity to at least "
                f"{plan.max_fanout}"
            )


#: What a runtime or simulation runs with unless told otherwise.
DEFAULT_BACKPRESSURE = Backpressure()


class ReadySet:
    """Ready compute ops of one plan in two heaps (send-producing, local-only) by priority key."""

    __slots__ = ("_key", "_producers", "_local", "_members")

    def __init__(self, keys: Mapping[Op, tuple[int, int, int]]) -> None:
        self._key = keys
        self._producers: list[tuple[tuple[int, int, int], Op]] = []
        self._local: list[tuple[tuple[int, int, int], Op]] = []
        self._members: set[Op] = set()

    def add(self, op: Op) -> None:
        key = self._key[op]
        heapq.heappush(self._local if key[0] == LOCAL_ONLY else self._producers, (key, op))
        self._members.add(op)

    def remove(self, op: Op) -> None:
        heap = self._local if self._key[op][0] == LOCAL_ONLY else self._producers
        if heap and heap[0][1] == op:
            heapq.heappop(heap)
        else:  # not the top: rare (only tests pick other ops); rebuild
            heap.remove((self._key[op], op))
            heapq.heapify(heap)
        self._members.discard(op)

    def best_producer(self) -> Op | None:
        return self._producers[0][1] if self._producers else None

    def best_local(self) -> Op | None:
        return self._local[0][1] if self._local else None

    def __contains__(self, op: Op) -> bool:
        return op in self._members

    def __len__(self) -> int:
        return len(self._members)

    def __iter__(self):
        return iter(sorted(self._members, key=self._key.__getitem__))


def choose(ready: ReadySet, outbound: int, plan: Plan, bp: Backpressure) -> Op | None:
    """The op `PRIORITY` runs next, or None to wait for a send to drain or a message to arrive."""
    producer = ready.best_producer()
    if producer is not None and outbound + plan.fanout[producer] > bp.capacity:
        producer = None
    local = ready.best_local()
    if outbound >= bp.threshold and local is not None:
        return local
    return producer if producer is not None else local


class Policy(Protocol):
    """Which ready compute op of ``plan`` runs next.

    Contract: ``choose`` is pure (the same arguments give the same op, so the simulator and the
    runtime agree); it returns an op of ``ready`` or None (wait for a send to drain or a message
    to arrive); it never returns an op whose sends would push ``outbound`` (frames queued or in
    transmission) above ``bp.capacity``; among ready ops of one stage it picks the lowest
    micro-batch (each channel's messages leave, and are expected, in micro-batch order).
    ``name`` is what settings and task specs call it.
    """

    @property
    def name(self) -> str: ...

    def choose(self, ready: ReadySet, outbound: int, plan: Plan, bp: Backpressure) -> Op | None: ...


class PriorityPolicy:
    """The method: send-producing ops first, nearest a send first; local-only ops while the
    outbound queue is at or above its threshold (`choose`, rules in the module docstring)."""

    name = "priority"

    def choose(self, ready: ReadySet, outbound: int, plan: Plan, bp: Backpressure) -> Op | None:
        return choose(ready, outbound, plan, bp)

    def __repr__(self) -> str:
        return "PRIORITY"


class FifoPolicy:
    """Baseline without priorities: the ready op earliest in plan order (``plan.index``) among
    those the outbound capacity admits."""

    name = "fifo"

    def choose(self, ready: ReadySet, outbound: int, plan: Plan, bp: Backpressure) -> Op | None:
        cands = [
            op for op in ready if outbound + plan.fanout[op] <= bp.capacity or plan.fanout[op] == 0
        ]
        return min(cands, key=plan.index.__getitem__) if cands else None

    def __repr__(self) -> str:
        return "FIFO"


PRIORITY: Policy = PriorityPolicy()
FIFO: Policy = FifoPolicy()
#: The built-in policies by name.
POLICIES: Mapping[str, Policy] = {p.name: p for p in (PRIORITY, FIFO)}


def as_policy(policy: Policy | str) -> Policy:
    """``policy`` itself, or the built-in policy of that name; `ConfigError` listing the
    accepted names for any other string."""
    if not isinstance(policy, str):
        return policy
    try:
        return POLICIES[policy]
    except KeyError:
        raise ConfigError(
            f"unknown scheduling policy {policy!r}; choose one of {sorted(POLICIES)}"
        ) from None
