"""The lane-driven compute loop (`ThreadLane`, real threads): the scheduling invariants of
`tests/test_scheduling.py` hold when the lane's thread picks its own ops, and cancelling a
batch whose lane waits for a message leaves no task and no busy thread."""

import asyncio
import contextlib
import threading

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.engine import plan as P
from tandem.engine.lanes import ThreadLane
from tandem.engine.plan import Kind
from tandem.engine.policy import Backpressure
from tandem.engine.runtime import PartyRuntime
from tandem.engine.topology import two_party
from tandem.engine.trace import Trace
from tandem.transports import MemoryNetwork
from tests.split_helpers import topologies


class CheckingHandler:
    """Checks, as each op starts (on the lane thread), that its compute dependencies ran."""

    def __init__(self, plan):
        self.plan, self.ran, self.errors = plan, [], []
        self.threads = set()

    def compute(self, op):
        self.threads.add(threading.current_thread().name)
        done = set(self.ran)
        for d in self.plan.deps.get(op, ()):
            if d.kind is not Kind.RECV and d not in done:
                self.errors.append(f"{op} started before its dependency {d}")
        self.ran.append(op)
        return {
            (s.channel, s.mb): np.zeros((2,), np.float32)
            for s in self.plan.successors[op]
            if s.kind is Kind.SEND
        }

    def receive(self, op, array):
        assert array.shape == (2,)


backpressures = st.integers(1, 4).flatmap(
    lambda cap: st.builds(Backpressure, st.integers(1, cap), st.just(cap))
)


@settings(max_examples=examples(25), deadline=None)
@given(
    topo=topologies(),
    n=st.integers(1, 6),
    bp=backpressures,
    seed=st.integers(0, 10**6),
    policy=st.sampled_from(["priority", "fifo"]),
    chunks=st.sampled_from([1, 1, 2, 3]),
)
def test_lane_driven_runs_every_op_once_after_its_deps_within_capacity(
    topo, n, bp, seed, policy, chunks
):
    bp = bp.scaled(chunks)
    plans = P.make_plans(topo, n, seed=seed, chunks=chunks)
    assume(all(pl.max_fanout <= bp.capacity for pl in plans.values()))

    async def main():
        net = MemoryNetwork(capacity=2)
        endpoints = {p: net.endpoint(p) for p in plans}
        handlers, stats = {}, {}
        async with contextlib.AsyncExitStack() as stack:
            lanes = {p: await stack.enter_async_context(ThreadLane(f"lane-{p}")) for p in plans}
            async with asyncio.timeout(20), asyncio.TaskGroup() as tg:  # a hang fails here
                for p, pl in plans.items():
                    handlers[p] = CheckingHandler(pl)
                    stats[p] = tg.create_task(
                        PartyRuntime(
                            endpoints[p], lanes[p], backpressure=bp, policy=policy, trace=Trace()
                        ).run(pl, handlers[p], 0)
                    )
        return handlers, {p: t.result() for p, t in stats.items()}

    handlers, stats = asyncio.run(main())
    for p, pl in plans.items():
        h = handlers[p]
        assert h.errors == []
        assert sorted(map(str, h.ran)) == sorted(map(str, pl.compute_ops))
        assert stats[p].max_outbound <= bp.capacity
        assert h.threads == {f"lane-{p}"}  # compute ran on the lane's thread, off the loop


def test_cancelling_a_lane_driven_batch_that_waits_for_a_message_leaves_nothing_busy():
    plans = P.make_plans(two_party("A", "B"), 4)

    async def main():
        net = MemoryNetwork()
        before = set(asyncio.all_tasks())
        async with ThreadLane("tandem-cancel") as lane:
            # only B runs: its first op needs A's activation, which never comes
            task = asyncio.create_task(
                PartyRuntime(net.endpoint("B"), lane).run(
                    plans["B"], CheckingHandler(plans["B"]), 0
                )
            )
            net.endpoint("A")
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert set(asyncio.all_tasks()) - before == set()

    asyncio.run(main())
    assert not [t for t in threading.enumerate() if t.name == "tandem-cancel"]
