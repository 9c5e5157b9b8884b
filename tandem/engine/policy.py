"""The scheduling policy: which ready compute op runs next. Pure; shared by the simulator and
the asyncio runtime, so a test can compare their traces.

Rules (see docs/design.md):

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
        output travels as ``factor`` chunks (`tandem.engine.plan`), so the same bytes stay in flight."""
        return (
            self if factor == 1 else Backpressure(self.threshold * factor, self.capacity * factor)
        )

    def check_plan(self, plan: Plan) -> None:
        if plan.max_fanout > self.capacity:
            op = max(plan.fanout, key=plan.fanout.get)
            raise ConfigError(
                f"outbound capacity {self.capacity} is smaller than the {plan.max_fanout} sends "
                f"that {op} on {plan.party!r} produces at once; raise capacity to at least "
                f"{plan.max_fanout}"
            )


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
    """The op to run next, or None to wait for a send to drain or a message to arrive."""
    producer = ready.best_producer()
    if producer is not None and outbound + plan.fanout[producer] > bp.capacity:
        producer = None
    local = ready.best_local()
    if outbound >= bp.threshold and local is not None:
        return local
    return producer if producer is not None else local


def fifo_choose(
    ready: ReadySet, outbound: int, plan: Plan, bp: Backpressure, order: Mapping[Op, int]
) -> Op | None:
    """Baseline without priorities: the ready op earliest in plan order (capacity still holds)."""
    cands = [
        op for op in ready if outbound + plan.fanout[op] <= bp.capacity or plan.fanout[op] == 0
    ]
    return min(cands, key=order.__getitem__) if cands else None
