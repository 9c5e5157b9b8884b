"""The scheduling policy as an object: names resolve once to the built-ins, a bad name lists the
accepted ones, and the simulator and the runtime run any object with the `Policy` protocol."""

from __future__ import annotations

import asyncio

import pytest

from tandem.engine import plan as P
from tandem.engine import simulator as S
from tandem.engine.lanes import VirtualLane
from tandem.engine.policy import FIFO, POLICIES, PRIORITY, Backpressure, ReadySet, as_policy
from tandem.engine.runtime import PartyRuntime
from tandem.engine.testing import run_virtual
from tandem.engine.topology import leader_follower
from tandem.engine.trace import Trace
from tandem.errors import ConfigError
from tandem.parties.split.party import SplitConfig
from tandem.transports import MemoryNetwork
from tests.test_scheduling import FakeHandler, frame_bytes, scenario


def test_names_resolve_to_the_built_in_policies():
    assert as_policy("priority") is PRIORITY and as_policy("fifo") is FIFO
    assert sorted(POLICIES) == ["fifo", "priority"]
    assert all(p.name == name for name, p in POLICIES.items())
    assert as_policy(FIFO) is FIFO  # an object passes through unchanged


@pytest.mark.parametrize("bad", ["lifo", "Priority", ""])
def test_an_unknown_name_lists_the_accepted_ones(bad):
    with pytest.raises(ConfigError, match=r"unknown scheduling policy .*\['fifo', 'priority'\]"):
        as_policy(bad)
    with pytest.raises(ConfigError, match="unknown scheduling policy"):
        SplitConfig(policy=bad)
    with pytest.raises(ConfigError, match="unknown scheduling policy"):
        PartyRuntime(MemoryNetwork().endpoint("A"), VirtualLane(lambda op: 0.0), policy=bad)


class FarthestFirst:
    """A policy that is neither built-in: the ready op farthest from a send first, then the
    lowest micro-batch (so each stage still runs, and each channel sends, in micro-batch order);
    capacity holds."""

    name = "farthest-first"

    def __init__(self) -> None:
        self.calls = 0

    def choose(self, ready: ReadySet, outbound: int, plan: P.Plan, bp: Backpressure):
        self.calls += 1
        ok = [op for op in ready if outbound + plan.fanout[op] <= bp.capacity]
        return min(ok, key=lambda op: (-plan.distance[op], *plan.key[op][1:])) if ok else None


def test_simulator_and_runtime_run_a_custom_policy_alike():
    topo, n, bp = leader_follower(), 4, Backpressure(2, 4)
    plans, costs, links = scenario(topo, n, bp, seed=3)
    sim_policy, rt_policy = FarthestFirst(), FarthestFirst()
    sim = S.simulate(
        plans,
        cost=lambda p, op: costs[(p, op)],
        nbytes=frame_bytes,
        links=links,
        bp=bp,
        policy=sim_policy,
    )

    async def runtime() -> Trace:
        net = MemoryNetwork(capacity=4)
        for (a, b), link in links.items():
            net.shape(a, b, bandwidth=link.bandwidth, latency=link.latency)
        trace = Trace()
        async with asyncio.TaskGroup() as tg:
            for p, pl in plans.items():
                rt = PartyRuntime(
                    net.endpoint(p),
                    VirtualLane(lambda op, p=p: costs[(p, op)]),
                    backpressure=bp,
                    trace=trace,
                    policy=rt_policy,
                )
                tg.create_task(rt.run(pl, FakeHandler(pl), 0))
        return trace

    trace = run_virtual(runtime())
    assert sim_policy.calls > 0 and rt_policy.calls > 0
    for p in plans:
        assert trace.order(p) == sim.order(p)
    fifo = S.simulate(
        plans,
        cost=lambda p, op: costs[(p, op)],
        nbytes=frame_bytes,
        links=links,
        bp=bp,
        policy=FIFO,
    )
    assert any(sim.order(p) != fifo.order(p) for p in plans)  # the custom policy chose
