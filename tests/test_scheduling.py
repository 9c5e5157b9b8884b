"""Property tests of plans, the policy, and the runtime's scheduling invariants."""

import asyncio
import random

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from hypothesis_profiles import examples
from tandem.engine import plan as P
from tandem.engine import simulator as S
from tandem.engine.lanes import VirtualLane
from tandem.engine.plan import LOCAL_ONLY, Kind
from tandem.engine.policy import Backpressure, ReadySet, choose
from tandem.engine.runtime import (
    SEND_DEPTH,
    LinkDepth,
    PartyRuntime,
    _Outbox,
    message,
    send_depth,
)
from tandem.engine.testing import Deadlock, run_virtual
from tandem.engine.topology import leader_follower, two_party, u_shape
from tandem.engine.trace import Trace
from tandem.errors import ConfigError, EngineError, PlanError
from tandem.transports import MemoryNetwork, codec
from tandem.transports.base import LinkStats
from tests.split_helpers import topologies

WIDTH = 8


class FakeHandler:
    """Produces a WIDTH-float tensor for each send; records what ran."""

    def __init__(self, plan):
        self.plan, self.ran = plan, []

    def compute(self, op):
        self.ran.append(op)
        return {
            (s.channel, s.mb): np.zeros((WIDTH,), np.float32)
            for s in self.plan.successors[op]
            if s.kind is Kind.SEND
        }

    def receive(self, op, array):
        assert array.shape == (WIDTH,)


def scenario(topo, n, bp, seed, chunks=1):
    rng = random.Random(seed)
    plans = P.make_plans(topo, n, seed=seed, chunks=chunks)
    costs = {(p, op): rng.uniform(1e-3, 1e-2) for p, pl in plans.items() for op in pl.compute_ops}
    links = {
        (a, b): S.Link(rng.uniform(2e4, 2e5), rng.uniform(0, 3e-3))
        for a in topo.parties
        for b in topo.parties
        if a != b
    }
    return plans, costs, links


def frame_bytes(party, op):
    frame = message(0, op, np.zeros((WIDTH,), np.float32))
    return codec.encoded_size(frame.replace(sender=party, channel=op.channel, msg_id=op.mb))


async def run_runtime(plans, costs, links, bp, policy="priority"):
    net = MemoryNetwork(capacity=4)
    for (a, b), link in links.items():
        net.shape(a, b, bandwidth=link.bandwidth, latency=link.latency)
    trace, handlers, stats = Trace(), {}, {}
    async with asyncio.TaskGroup() as tg:
        for p, pl in plans.items():
            handlers[p] = FakeHandler(pl)
            rt = PartyRuntime(
                net.endpoint(p),
                VirtualLane(lambda op, p=p: costs[(p, op)]),
                backpressure=bp,
                trace=trace,
                policy=policy,
            )
            stats[p] = tg.create_task(rt.run(pl, handlers[p], 0))
    return trace, handlers, {p: t.result() for p, t in stats.items()}


backpressures = st.integers(1, 4).flatmap(
    lambda cap: st.builds(Backpressure, st.integers(1, cap), st.just(cap))
)


@settings(max_examples=examples(40), deadline=None)
@given(
    topo=topologies(),
    n=st.integers(1, 6),
    bp=backpressures,
    seed=st.integers(0, 10**6),
    chunks=st.sampled_from([1, 1, 2, 3]),
)
def test_runtime_runs_every_op_once_respecting_deps_and_capacity(topo, n, bp, seed, chunks):
    bp = bp.scaled(chunks)  # as `SplitParty` runs a chunked batch
    plans, costs, links = scenario(topo, n, bp, seed, chunks)
    if any(pl.max_fanout > bp.capacity for pl in plans.values()):
        with pytest.raises(ConfigError, match="raise capacity"):
            bp.check_plan(next(pl for pl in plans.values() if pl.max_fanout > bp.capacity))
    assume(all(pl.max_fanout <= bp.capacity for pl in plans.values()))  # the rest needs a run
    trace, handlers, stats = run_virtual(run_runtime(plans, costs, links, bp))
    for p, pl in plans.items():
        ran = handlers[p].ran
        assert sorted(map(str, ran)) == sorted(
            map(str, pl.compute_ops)
        )  # every compute op exactly once
        assert stats[p].max_outbound <= bp.capacity  # hard capacity never exceeded
        end = {e.name: e.end for e in trace.events if e.party == p}
        start = {e.name: e.start for e in trace.events if e.party == p}
        for op in pl.ops:  # dependencies respected
            if op.kind in (Kind.RECV,):
                continue
            for d in pl.deps.get(op, ()):
                if d.kind is not Kind.RECV:
                    assert end[str(d)] <= start[str(op)] + 1e-12, (str(d), str(op))


@settings(max_examples=examples(40), deadline=None)
@given(
    topo=topologies(),
    n=st.integers(1, 6),
    bp=backpressures,
    seed=st.integers(0, 10**6),
    policy=st.sampled_from(["priority", "fifo"]),
    chunks=st.sampled_from([1, 1, 2, 3]),
)
def test_runtime_op_order_matches_the_simulation(topo, n, bp, seed, policy, chunks):
    bp = bp.scaled(chunks)
    plans, costs, links = scenario(topo, n, bp, seed, chunks)
    assume(all(pl.max_fanout <= bp.capacity for pl in plans.values()))
    sim = S.simulate(
        plans,
        cost=lambda p, op: costs[(p, op)],
        nbytes=frame_bytes,
        links=links,
        bp=bp,
        policy=policy,
    )
    trace, _, _ = run_virtual(run_runtime(plans, costs, links, bp, policy))
    for p in plans:
        assert trace.order(p) == sim.order(p)
    assert trace.span == pytest.approx(sim.makespan, rel=1e-9, abs=1e-9)


@settings(max_examples=examples(200), deadline=None)
@given(topo=topologies(), n=st.integers(1, 5), chunks=st.sampled_from([1, 2, 3]), data=st.data())
def test_choose_matches_a_brute_force_reference(topo, n, chunks, data):
    party = data.draw(st.sampled_from(topo.parties))
    plan = P.make_plan(topo, party, n, seed=data.draw(st.integers(0, 99)), chunks=chunks)
    compute = list(plan.compute_ops)
    ready_ops = data.draw(st.lists(st.sampled_from(compute), unique=True, max_size=8))
    cap = data.draw(st.integers(max(plan.max_fanout, 1), max(plan.max_fanout, 5)))
    bp = Backpressure(data.draw(st.integers(1, cap)), cap)
    outbound = data.draw(st.integers(0, cap))
    ready = ReadySet(plan.key)
    for op in ready_ops:
        ready.add(op)
    got = choose(ready, outbound, plan, bp)
    # reference: the rules of docs/design.md, written directly
    local = [op for op in ready_ops if plan.distance[op] == LOCAL_ONLY]
    prod = [
        op
        for op in ready_ops
        if plan.distance[op] != LOCAL_ONLY and outbound + plan.fanout[op] <= cap
    ]
    best_prod = min(prod, key=plan.key.__getitem__, default=None)
    all_prod = [op for op in ready_ops if plan.distance[op] != LOCAL_ONLY]
    if all_prod and min(all_prod, key=plan.key.__getitem__) not in prod:
        best_prod = None  # the best producer must wait for room; we do not skip past it
    best_local = min(local, key=plan.key.__getitem__, default=None)
    if outbound >= bp.threshold and best_local is not None:
        assert got == best_local
    else:
        assert got == (best_prod if best_prod is not None else best_local)


def test_priorities_follow_the_methods_rules():
    plans = P.make_plans(leader_follower(), 2)
    lead, fol = plans["leader"], plans["follower"]
    f = lambda pl, s: next(op for op in pl.ops if str(op) == s)  # noqa: E731
    assert fol.distance[f(fol, "F(bottom_follower,0)")] == 0  # result is sent
    assert lead.distance[f(lead, "L(top,0)")] == 0  # gradient is sent
    assert lead.distance[f(lead, "F(bottom_leader,0)")] == 1  # feeds the op that sends
    assert lead.distance[f(lead, "B(bottom_leader,0)")] == LOCAL_ONLY
    assert lead.key[f(lead, "L(top,0)")] < lead.key[f(lead, "F(bottom_leader,1)")]
    print(lead.format())


@given(topo=topologies(), n=st.integers(1, 4), chunks=st.integers(1, 3))
def test_plans_are_checked_and_messages_match(topo, n, chunks):
    plans = P.make_plans(topo, n, chunks=chunks)  # make_plans runs check_plans
    for pl in plans.values():
        pl.check()
        assert len(set(pl.ops)) == len(pl.ops)
        assert sum(op.kind is Kind.UPDATE for op in pl.ops) == len(topo.stages_of(pl.party))
        fine = chunks > 1 and pl.party == topo.label_owner
        assert pl.fine == fine and pl.compute_groups == n * (chunks if fine else 1)
        stages = len(topo.stages_of(pl.party))
        assert (
            sum(op.kind in (Kind.FORWARD, Kind.LOSS) for op in pl.ops) == stages * pl.compute_groups
        )
        for op in pl.ops:  # every message belongs to one compute group of each side
            if op.kind in (Kind.SEND, Kind.RECV):
                assert 0 <= op.mb < n * chunks


def test_a_chunked_plan_splits_the_follower_messages_and_fines_the_loss_party():
    plans = P.make_plans(two_party(), 2, chunks=3)
    a, b = plans["A"], plans["B"]
    fwd = P.Op(Kind.FORWARD, 1, stage="bottom")
    assert [str(s) for s in a.successors[fwd] if s.kind is Kind.SEND] == [
        f"S(act/bottom->top,{k})" for k in (3, 4, 5)
    ]
    assert a.fanout[fwd] == 3
    bwd = P.Op(Kind.BACKWARD, 1, stage="bottom")
    assert sorted(str(d) for d in a.deps[bwd] if d.kind is Kind.RECV) == [
        f"R(grad/bottom->top,{k})" for k in (3, 4, 5)
    ]
    assert [op.mb for op in b.compute_ops if op.kind is Kind.LOSS] == list(range(6))
    assert "chunks=3" in a.format() and "S(act/bottom->top,5)" in a.format()
    with pytest.raises(ConfigError, match="chunks"):
        P.make_plan(two_party(), "A", 2, chunks=0)


def test_a_broken_plan_is_reported():
    plan = P.make_plan(two_party(), "A", 2)
    first, second = plan.ops[0], plan.ops[1]
    bad = P.Plan("A", 2, "train", plan.ops, {**plan.deps, first: (second,)})
    with pytest.raises(PlanError, match="cycle"):
        bad.check()


def test_bad_configs_are_rejected():
    with pytest.raises(ConfigError, match="threshold <= capacity"):
        Backpressure(5, 2)
    with pytest.raises(ConfigError, match="n_groups"):
        P.make_plan(two_party(), "A", 0)
    with pytest.raises(ConfigError, match="owns no stage"):
        P.make_plan(two_party(), "Z", 1)
    with pytest.raises(ConfigError, match="mode"):
        P.make_plan(two_party(), "A", 1, mode="infer")


def test_virtual_loop_reports_a_deadlock_instead_of_hanging():
    async def stuck():
        await asyncio.Event().wait()

    with pytest.raises(Deadlock):
        run_virtual(stuck())


def test_u_shape_pipelines_faster_than_sequential_in_simulation():
    plans1, plans8 = P.make_plans(u_shape(), 1), P.make_plans(u_shape(), 8)
    link = S.Link(1e6, 1e-3)

    def run(plans, n, policy):
        return S.simulate(
            plans,
            cost=lambda p, op: 0.01 / n,
            nbytes=lambda p, op: 2e4 / n,
            links=lambda a, b: link,
            policy=policy,
        ).makespan

    assert run(plans8, 8, "priority") < 0.7 * run(plans1, 1, "fifo")


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_gradient_link_trails_the_activation_link_by_one_group(n):
    """Why `efficiency` stays below 1 on a link-bound batch even for a zero-cost engine: a
    group's gradient can only leave once its whole activation arrived, so with free compute,
    no latency and both directions carrying the same bytes, one batch takes the activation
    link's time plus one group's transfer: ``T * (1 + 1/n)`` for n even groups (the docs'
    model; `bench.pipeline` reports it as ``schedule_s``)."""
    plans = P.make_plans(two_party(), n)
    T = 1.0  # seconds per direction per batch; groups of equal bytes
    makespan = S.simulate(
        plans,
        cost=lambda p, op: 0.0,
        nbytes=lambda p, op: 1000 // n,
        links=lambda a, b: S.Link(1000 / T, 0.0),
    ).makespan
    assert makespan == pytest.approx(T * (1 + 1 / n))


@pytest.mark.parametrize("n,chunks", [(2, 2), (4, 4), (8, 4)])
def test_chunks_shorten_the_gradient_links_lag_to_one_part(n, chunks):
    """The fix for the lag above: with each group travelling in ``chunks`` parts and the loss
    party answering per part, the gradient link trails by one part, ``T / (n * chunks)``."""
    plans = P.make_plans(two_party(), n, chunks=chunks)
    T, parts = 1.0, n * chunks
    makespan = S.simulate(
        plans,
        cost=lambda p, op: 0.0,
        nbytes=lambda p, op: 1000 / parts,
        links=lambda a, b: S.Link(1000 / T, 0.0),
        bp=Backpressure().scaled(chunks),
    ).makespan
    assert makespan == pytest.approx(T * (1 + 1 / parts))


class CountingTransport:
    """A transport that records how many sends are in flight at once, and in what order the
    frames of each channel were handed over."""

    def __init__(self, inner):
        self.inner, self.in_flight, self.most, self.order = inner, 0, 0, {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def send(self, peer, channel, frame):
        self.order.setdefault(channel, []).append(frame.meta["m"])
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            await self.inner.send(peer, channel, frame)
        finally:
            self.in_flight -= 1


def test_the_send_lane_offers_the_next_frame_while_one_is_on_the_wire():
    """When frames queue for a slow link, the send lane hands the transport the next frame
    before the one on the wire is done (so the wire never waits for the loop), never more than
    ``SEND_DEPTH`` at once, and each channel's frames in queue order."""
    plans = P.make_plans(two_party("A", "B"), 6, seed=0, chunks=2)
    bp = Backpressure(threshold=4, capacity=8)

    async def main():
        net = MemoryNetwork(capacity=4)
        net.shape("A", "B", bandwidth=1e4, both=True)  # ~5 ms a frame against 0.1 ms of compute
        transports = {p: CountingTransport(net.endpoint(p)) for p in plans}
        async with asyncio.TaskGroup() as tg:
            for p, pl in plans.items():
                rt = PartyRuntime(transports[p], VirtualLane(lambda op: 1e-4), backpressure=bp)
                tg.create_task(rt.run(pl, FakeHandler(pl), 0))
        return transports

    transports = run_virtual(main())
    assert SEND_DEPTH == 2
    assert transports["A"].most == SEND_DEPTH  # A's activations queue for the link
    for t in transports.values():
        assert t.most <= SEND_DEPTH
        for channel, ms in t.order.items():
            assert ms == sorted(ms), channel


class RoundTripTransport(CountingTransport):
    """A windowed transport over a memory endpoint whose sends cross a wire of ``bandwidth``
    bytes/s one body at a time, then return a round trip ``rtt`` later (as an HTTP send returns
    with its answer); ``window`` sends of a channel in flight."""

    def __init__(self, inner, window, bandwidth, rtt):
        super().__init__(inner)
        self.window, self.bw, self.rtt = window, bandwidth, rtt
        self.wire = asyncio.Lock()
        self.stats = LinkStats()

    def send_window(self, peer):
        return self.window

    def sent_stats(self, peer):
        return self.stats

    async def send(self, peer, channel, frame):
        self.order.setdefault(channel, []).append(frame.meta["m"])
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        try:
            async with self.wire:
                await asyncio.sleep(frame.nbytes / self.bw)
                self.stats.bytes += frame.nbytes
                self.stats.busy_seconds += frame.nbytes / self.bw
            await asyncio.sleep(self.rtt)
            await self.inner.send(peer, channel, frame)
        finally:
            self.in_flight -= 1


@pytest.mark.parametrize(
    "window,rtt,expected", [(8, 0.0, 2), (8, 0.01, 4), (3, 0.01, 3), (64, 1.0, 8)]
)
def test_the_send_lane_covers_the_round_trip_up_to_window_and_capacity(window, rtt, expected):
    """Over a windowed transport the lane starts at `SEND_DEPTH`; once a send measured the
    round trip, it keeps ``1 + ceil(rtt * bandwidth / frame bytes)`` frames in flight (the
    wire stays busy during each answer's trip), at least `SEND_DEPTH`, at most the window and
    the outbound capacity; each channel's frames still go in queue order."""
    plans = P.make_plans(two_party("A", "B"), 12, seed=0)
    bp = Backpressure(threshold=4, capacity=8)
    frame_bytes = WIDTH * 4
    bandwidth = frame_bytes / 0.004  # 4 ms a frame on the wire: rtt 10 ms -> 1 + 3 frames

    async def main():
        net = MemoryNetwork(capacity=16)
        transports = {p: RoundTripTransport(net.endpoint(p), window, bandwidth, rtt) for p in plans}
        runtimes = {
            p: PartyRuntime(transports[p], VirtualLane(lambda op: 1e-4), backpressure=bp)
            for p in plans
        }
        mosts = []
        for batch in range(2):
            for t in transports.values():
                t.most, t.order = 0, {}
            async with asyncio.TaskGroup() as tg:
                for p, pl in plans.items():
                    tg.create_task(runtimes[p].run(pl, FakeHandler(pl), batch))
            mosts.append(transports["A"].most)
        return transports, mosts

    transports, mosts = run_virtual(main())
    assert mosts[1] == expected and mosts[0] <= expected
    for t in transports.values():
        assert t.most <= expected
        for channel, ms in t.order.items():
            assert ms == sorted(ms), channel


def test_send_depth_covers_the_bandwidth_delay_product_within_window_and_capacity():
    class Windowed:
        def send_window(self, peer):
            return 4

    w = Windowed()
    link = {"round_trip": 0.05, "bandwidth": 1e6}  # 50 kB in flight
    assert send_depth(w, "B", 1, 8) == SEND_DEPTH  # type: ignore[arg-type]  # not measured yet
    assert send_depth(w, "B", 1, 8, frame_bytes=25_000, **link) == 3  # type: ignore[arg-type]
    assert send_depth(w, "B", 1, 8, frame_bytes=1_000, **link) == 4  # type: ignore[arg-type]
    assert send_depth(w, "B", 3, 8, frame_bytes=1_000, **link) == 8  # type: ignore[arg-type]
    assert send_depth(w, "B", 1, 8, frame_bytes=10**9, **link) == SEND_DEPTH  # type: ignore[arg-type]
    assert send_depth(object(), "B", 3, 8, frame_bytes=1_000, **link) == SEND_DEPTH  # type: ignore[arg-type]
    assert send_depth(w, "B", 1, 1, frame_bytes=1_000, **link) == 1  # type: ignore[arg-type]


def test_link_depth_takes_the_least_round_trip_of_idle_sends():
    link = LinkDepth()
    assert link.round_trip is None
    link.sample(0.5, 1000, None)  # no bandwidth measured: no sample
    assert link.round_trip is None
    for seconds in (0.30, 0.12, 0.5):
        link.sample(seconds, 1000, 1e4)  # 0.1 s on the wire
    assert link.round_trip == pytest.approx(0.02)


def test_the_outbound_fifo_is_bounded_and_wakes_its_waiting_lane_in_order():
    """A peer's outbound FIFO hands items out in the order they were put, wakes a send lane
    waiting on it, and refuses an item beyond its capacity (the runtime's capacity invariant
    holds even if the policy broke it)."""
    ops = [P.Op(Kind.SEND, m, channel="act/x", peer="B") for m in range(3)]

    async def main():
        box = _Outbox(2)
        got = asyncio.ensure_future(box.get())
        await asyncio.sleep(0)
        assert not got.done()
        box.put((ops[0], None))
        assert (await got)[0] is ops[0]
        box.put((ops[1], None))
        box.put((ops[2], None))
        with pytest.raises(EngineError, match="capacity 2"):
            box.put((ops[0], None))
        return [(await box.get())[0] for _ in range(2)]

    assert run_virtual(main()) == ops[1:]


@pytest.mark.slow
async def test_replay_simulates_a_traced_run_at_its_measured_costs():
    """`simulator.replay` (``bench.pipeline``'s ``schedule_s``): the traced ops' durations and
    bytes of a two-party run, replayed by the simulator on its link, give a makespan no
    shorter than the link's share and no longer than every op one after the other."""
    import dataclasses

    from tandem.engine.kernels import mlp_stage
    from tandem.engine.lanes import ThreadLane
    from tandem.parties.split import SplitConfig, SplitParty

    rows, cut = 32, 8
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8), dtype=np.float32)
    y = (x @ rng.standard_normal(8, dtype=np.float32) > 0).astype(np.float32)
    topo = two_party("A", "B")
    models = {
        "bottom": mlp_stage([8], [16], cut),
        "top": mlp_stage([cut], [4], 1, activate_last=False),
    }
    cfg = SplitConfig(batch_size=rows, groups="auto", seed=0, learning_rate=1e-3, loss="binary")
    net = MemoryNetwork()
    bandwidth, latency = rows * cut * 4 / 0.02, 0.001  # 20 ms per direction per batch
    net.shape("A", "B", bandwidth=bandwidth, latency=latency, both=True)
    trace = Trace()
    leader = SplitParty("B", topo, models, net.endpoint("B"), labels={"train": y}, config=cfg)
    follower = SplitParty(
        "A", topo, models, net.endpoint("A"), datasets={"train": x}, config=dataclasses.replace(cfg)
    )
    for p in (leader, follower):
        p.config.policy, p.trace = "priority", trace

    async def drive():
        async with ThreadLane("test") as lane:
            await leader.run_batch(np.arange(rows), n=4, lane=lane)
        await follower.wait_batches(leader.batches_done)
        await leader.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follower.serve())
        tg.create_task(drive())

    def replayed(n: int) -> float:
        chunks = leader.chunks_for(rows, n)
        plans = {p.name: p.plan(n, "train", chunks) for p in (leader, follower)}
        bp = leader.config.backpressure.scaled(chunks)
        link = S.Link(bandwidth, latency)
        return S.replay(trace, plans, links=lambda src, dst: link, bp=bp).makespan

    makespan = replayed(4)
    # no shorter than one direction's link time, no longer than running every traced op and
    # send one after the other (each op ran once: its median is its one duration)
    serial = sum(e.end - e.start for e in trace.events if e.lane == "compute") + sum(
        e.nbytes / bandwidth + latency for e in trace.events if e.lane.startswith("send->")
    )
    assert 0.02 <= makespan <= serial + 1e-9
    with pytest.raises(PlanError, match="no duration"):
        replayed(8)  # ops of n = 8 never ran
