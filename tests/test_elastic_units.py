"""Unit tests of the elastic pieces: membership (fake clock), ledger (hypothesis state
machine against a model), parameter server (fencing, rollback), spec loading (fsspec), and a
data server answering bad input without stopping."""

from __future__ import annotations

import asyncio
import json

import fsspec
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hypothesis_profiles import examples
from tandem.parties.elastic import protocol as P
from tandem.parties.elastic.data_server import DataServer
from tandem.parties.elastic.errors import (
    ConfigError,
    LedgerError,
    ProtocolError,
    StaleGenerationError,
)
from tandem.parties.elastic.ledger import Ledger
from tandem.parties.elastic.membership import Membership
from tandem.parties.elastic.param_server import ParamServer
from tandem.parties.elastic.spec import ModelSpec, load_shard, load_spec, make_dataset, save_shard
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)


# -- membership ------------------------------------------------------------------------------
def test_membership_join_is_used_from_next_detection_and_silence_removes():
    m = Membership(timeout=1.5)
    m.beat("a", "1", now=0.0)
    assert m.live == frozenset()  # not live until a detection
    d = m.detect(now=0.5)
    assert d.live == {"a"} and d.joined == {"a"} and d.changed
    m.beat("b", "1", now=0.9)
    m.beat("a", "1", now=1.0)
    assert m.detect(now=1.2).joined == {"b"}
    # a stops beating at 1.0; heartbeat interval 1/3 of T=1, timeout 1.5 T
    for t in (1.3, 1.6, 2.0, 2.4):
        m.beat("b", "1", now=t)
    assert not m.detect(now=2.4).changed  # 1.4 s of silence: still tolerated
    assert "a" in m.suspects(now=2.6)
    d = m.detect(now=2.6)
    assert d.left == {"a"} and d.live == {"b"}


def test_membership_new_incarnation_counts_as_a_change():
    m = Membership(timeout=1.0)
    m.beat("a", "x", 0.0)
    m.detect(0.1)
    assert m.beat("a", "y", 0.2) is True  # restarted: lost what it was doing
    assert m.suspects(0.2) == {"a"}
    d = m.detect(0.3)
    assert d.changed and d.left == {"a"} and d.joined == {"a"} and d.live == {"a"}


def test_membership_detection_bound_is_within_three_intervals():
    """kill -> removal <= timeout + T = 2.5 intervals with the defaults (T, 1.5 T)."""
    m = Membership(timeout=1.5)
    for killed_at in (3.0, 3.05, 3.32, 3.34, 3.99):
        m = Membership(timeout=1.5)
        beats = [k / 3 for k in range(100) if k / 3 <= killed_at]
        removed_at = None
        for detection in range(1, 20):  # detections every T = 1
            for t in [b for b in beats if detection - 1 < b <= detection]:
                m.beat("a", "1", t)
            if m.detect(float(detection)).left:
                removed_at = detection
                break
        assert removed_at is not None and removed_at - killed_at <= 3


# -- ledger ----------------------------------------------------------------------------------
def test_ledger_interleaves_and_refuses_old_generations():
    led = Ledger({"ds0": [0, 1], "ds1": [10, 11]})
    assert [led.assign("w")[1] for _ in range(2)] == [0, 10]
    assert led.report(0, generation=0, worker="w")
    assert not led.report(10, generation=7, worker="w")  # wrong generation: refused
    assert led.checkpoint(applied=[0]) == [0]
    assert led.generation == 1 and led.pending == [10, 1, 11]  # epoch order kept
    with pytest.raises(LedgerError, match="committed twice"):
        led.checkpoint(applied=[0])
    with pytest.raises(LedgerError, match="not fully committed"):
        led.new_epoch({"ds0": [0]})


class LedgerMachine(RuleBasedStateMachine):
    """The ledger against a model where every batch has one state; applied = reported plus
    batches pushed by a worker that died before reporting."""

    def __init__(self):
        super().__init__()
        self.ids = list(range(6))
        self.led = Ledger({"a": self.ids[:3], "b": self.ids[3:]})
        self.pushed: set[int] = set()  # applied on the parameter server
        self.committed_model: list[int] = []

    @rule(w=st.sampled_from(["w0", "w1", "w2"]))
    def assign(self, w):
        if w not in self.led.in_flight.values():
            self.led.assign(w)

    @precondition(lambda self: self.led.in_flight)
    @rule(data=st.data(), report=st.booleans())
    def push(self, data, report):
        b = data.draw(st.sampled_from(sorted(self.led.in_flight)))
        w = self.led.in_flight[b]
        self.pushed.add(b)
        if report:
            assert self.led.report(b, self.led.generation, w)

    @rule()
    def checkpoint(self):
        applied = sorted(self.pushed)
        self.led.checkpoint(applied)
        self.committed_model += applied
        self.pushed.clear()

    @rule()
    def rollback(self):
        self.led.rollback()
        self.pushed.clear()

    @invariant()
    def partition_and_exactly_once(self):
        self.led.check()
        assert self.led.committed == self.committed_model
        assert len(set(self.led.committed)) == len(self.led.committed)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(
    max_examples=examples(40),
    stateful_step_count=25,
    deadline=None,
    derandomize=True,
    database=None,
)


# -- parameter server ------------------------------------------------------------------------
def _grads(ps: ParamServer, scale: float = 0.1) -> list[np.ndarray]:
    return [np.full(p.shape, scale, np.float32) for p in ps.params]


def test_param_server_fences_and_rolls_back_bit_identically():
    ps = ParamServer(SPEC, n_batches=4, offset=100)
    ckpt = ps.checkpoint()
    ps.apply(100, 0, _grads(ps))
    with pytest.raises(LedgerError, match="twice"):
        ps.apply(100, 0, _grads(ps))
    assert ps.fence(1) == [100]
    with pytest.raises(StaleGenerationError, match="generation 0"):
        ps.apply(101, 0, _grads(ps))
    ps.apply(101, 1, _grads(ps))
    assert ps.digest() != ckpt
    assert ps.rollback(2) == ckpt  # params, optimizer state and counts
    ps.apply(100, 2, _grads(ps, 0.2))  # applying after rollback does not
    assert ps.rollback(3) == ckpt  # corrupt the checkpoint (no aliasing)


def test_param_server_refuses_bad_gradients_with_a_reason():
    ps = ParamServer(SPEC, n_batches=2)
    bad_shape = _grads(ps)[:-1]
    with pytest.raises(ProtocolError, match="does not match"):
        ps.apply(0, 0, bad_shape)
    nan = _grads(ps)
    nan[0][0, 0] = np.nan
    with pytest.raises(ProtocolError, match="NaN"):
        ps.apply(0, 0, nan)
    with pytest.raises(ProtocolError, match="does not belong"):
        ps.apply(99, 0, _grads(ps))
    with pytest.raises(LedgerError, match="not applied exactly once"):
        ps.new_epoch(2)


# -- spec and shards through fsspec ----------------------------------------------------------
def test_spec_and_shard_load_from_memory_and_local_urls(tmp_path):
    shard = make_dataset(1, 64, SPEC)[0]
    with fsspec.open("memory://elastic/model.json", "w") as f:
        json.dump(SPEC.to_dict(), f)
    save_shard(shard, "memory://elastic/shard0.npz")
    save_shard(shard, str(tmp_path / "shard0.npz"))
    (tmp_path / "model.toml").write_text(
        'sizes = [8, 16, 3]\noptimizer = "adam"\nlr = 0.02\nbatch_size = 16\nseed = 0\n'
    )
    assert (
        load_spec("memory://elastic/model.json") == SPEC == load_spec(str(tmp_path / "model.toml"))
    )
    for url in ("memory://elastic/shard0.npz", f"file://{tmp_path}/shard0.npz"):
        got = load_shard(url, SPEC)
        np.testing.assert_array_equal(got.x, shard.x)
        assert got.n_batches(SPEC.batch_size) == 4


def test_spec_and_shard_errors_say_what_to_fix(tmp_path):
    with pytest.raises(ConfigError, match="nothing found"):
        load_spec(str(tmp_path / "missing.json"))
    (tmp_path / "m.json").write_text('{"sizes": [8, 3], "optimiser": "adam"}')
    with pytest.raises(ConfigError, match="unknown model field.*optimiser"):
        load_spec(str(tmp_path / "m.json"))
    with pytest.raises(ConfigError, match="choose one of"):
        ModelSpec(sizes=(8, 3), optimizer="rmsprop")
    wrong = make_dataset(1, 32, ModelSpec(sizes=(5, 3)))[0]
    save_shard(wrong, str(tmp_path / "s.npz"))
    with pytest.raises(ConfigError, match=r"expected \[n, 8\]"):
        load_shard(str(tmp_path / "s.npz"), SPEC)
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object))
    (tmp_path / "obj.npz").write_bytes((tmp_path / "obj.npy").read_bytes())
    with pytest.raises(ConfigError, match="not a readable .npz"):
        load_shard(str(tmp_path / "obj.npz"), SPEC)


# -- a data server keeps serving through bad input -------------------------------------------
def data_server_and_caller(net: MemoryNetwork):
    """A data server ``ds0`` of one 64-row shard on ``net``, the coordinator's endpoint, and
    ``call(op, **meta)``: the coordinator's control request to it and the reply."""
    coord = net.endpoint("coordinator")
    ds = DataServer(
        net.endpoint("ds0"),
        coordinator="coordinator",
        spec=SPEC,
        shard=make_dataset(1, 64, SPEC)[0],
    )

    async def call(op, **meta):
        await coord.send("ds0", P.CTL, Frame(meta={"op": op, "req": 1, **meta}))
        return await coord.recv("ds0", P.REPLY)

    return ds, coord, call


async def test_data_server_refuses_bad_results_and_keeps_serving():
    net = MemoryNetwork()
    rogue, worker = net.endpoint("rogue"), net.endpoint("w0")
    ds, coord, call = data_server_and_caller(net)

    async with asyncio.TaskGroup() as tg:
        server = tg.create_task(ds.run())
        assert (await call("hello", index=0)).meta["n_batches"] == 4
        assert "unknown operation" in (await call("explode")).meta["error"]
        # a result nobody asked for, from a peer the server never heard of
        await rogue.send("ds0", P.RESULT, Frame(meta={"batch": 0, "gen": 0}))
        await coord.send(
            "ds0", P.CTL, Frame(meta={"op": "train", "batch": 1, "gen": 0, "worker": "w0"})
        )
        task = await worker.recv("ds0", P.TASK)
        assert task.meta["batch"] == 1 and len(task.arrays) == 6
        await worker.send(
            "ds0", P.RESULT, Frame(meta={"batch": 1, "gen": 0}, arrays=(np.zeros(3, np.float32),))
        )
        ack = await worker.recv("ds0", P.ACK)
        assert not ack.meta["ok"] and "does not match" in ack.meta["error"]
        assert (await call("fence", gen=1)).meta["applied"] == []
        assert (await call("stop")).meta["ok"]
        await server
    assert ds.refused == 1


async def test_data_server_listens_again_to_a_worker_restarted_under_its_name():
    """A worker process restarted under the same name (its old link closed) has its results
    read again: the listener that ended with the old link is replaced, not kept."""
    net = MemoryNetwork()
    ds, coord, call = data_server_and_caller(net)

    async def train(worker, batch):
        meta = {"op": "train", "batch": batch, "gen": 0, "worker": "w0"}
        await coord.send("ds0", P.CTL, Frame(meta=meta))
        task = await worker.recv("ds0", P.TASK)
        grads = [np.zeros_like(a) for a in task.arrays[:-2]]
        await worker.send("ds0", P.RESULT, Frame(meta={"batch": batch, "gen": 0}, arrays=grads))
        async with asyncio.timeout(5):
            return await worker.recv("ds0", P.ACK)

    async with asyncio.TaskGroup() as tg:
        server = tg.create_task(ds.run())
        await call("hello", index=0)
        assert (await train(net.endpoint("w0"), 0)).meta["ok"]
        await net.endpoint("w0").aclose()  # kill -9
        await asyncio.sleep(0.05)
        assert (await train(net.endpoint("w0"), 1)).meta["ok"]  # the restarted process
        assert (await call("fence", gen=1)).meta["applied"] == [0, 1]
        await call("stop")
        await server


def test_kernels_do_not_retrace_for_equal_shapes():
    from tandem.parties.elastic import kernels as K

    ps = ParamServer(SPEC, n_batches=2)
    x = np.zeros((16, 8), np.float32)
    y = np.zeros(16, np.int32)
    _, g = K.loss_and_grad(ps.params, x, y)
    K.apply_update(SPEC.optimizer, SPEC.lr, ps.params, ps.state, g)
    grad_traces, step_traces = K._grad()._cache_size(), K._update("adam", 0.02)._cache_size()
    for batch in (0, 1):  # new values, same shapes: no new trace
        _, g = K.loss_and_grad(ps.params, x + batch + 1, y)
        ps.apply(batch, 0, g)
    assert K._grad()._cache_size() == grad_traces
    assert K._update("adam", 0.02)._cache_size() == step_traces


# -- a worker whose result is never acknowledged moves on -------------------------------------
async def test_worker_reports_an_unacknowledged_result_and_takes_the_next_task():
    """A data server whose rollback named this worker not live (a heartbeat gap) cancels its
    listener (`DataServer._forget`), possibly after it took the worker's result: no ACK ever
    comes. The worker stays live, so it must not wait for that ACK forever (once every live
    worker waited so, the demo ran on forever with nobody to give a batch to)."""
    from tandem.parties.elastic import kernels as K
    from tandem.parties.elastic.worker import Worker

    net = MemoryNetwork()
    coord, ds = net.endpoint("coordinator"), net.endpoint("ds0")
    worker = Worker(net.endpoint("w0"), coordinator="coordinator", heartbeat=0.05)
    arrays = (*K.init_params(SPEC.sizes, 0), np.zeros((16, 8), np.float32), np.zeros(16, np.int32))

    def task(batch: int) -> Frame:
        return Frame(meta={"batch": batch, "gen": 0, "spec": SPEC.to_dict()}, arrays=arrays)

    async with asyncio.timeout(10), asyncio.TaskGroup() as tg:
        tg.create_task(worker.run())
        await coord.recv("w0", P.HB)
        await coord.send("w0", P.WELCOME, Frame(meta={"data_servers": {"ds0": ""}}))
        await ds.send("w0", P.TASK, task(1))
        assert (await ds.recv("w0", P.RESULT)).meta["batch"] == 1  # never acknowledged
        done = await coord.recv("w0", P.DONE)
        assert (done.meta["batch"], done.meta["ok"]) == (1, False)
        await ds.send("w0", P.TASK, task(2))
        assert (await ds.recv("w0", P.RESULT)).meta["batch"] == 2
        await ds.send("w0", P.ACK, Frame(meta={"batch": 1, "gen": 0, "ok": True}))  # late
        await ds.send("w0", P.ACK, Frame(meta={"batch": 2, "gen": 0, "ok": True}))
        done = await coord.recv("w0", P.DONE)
        assert (done.meta["batch"], done.meta["ok"]) == (2, True)
        await coord.send("w0", P.CTL, Frame(meta={"op": "stop"}))
    assert worker.done == 1 and not worker.killed


async def test_a_worker_nobody_welcomes_stops_beating_and_says_so():
    """A coordinator that never welcomes the worker (finished, or not admitting it) must not
    keep it beating forever: after ``join_timeout`` it raises `NotWelcomedError`, and none of
    its tasks is left running."""
    from tandem.parties.elastic.errors import NotWelcomedError
    from tandem.parties.elastic.worker import Worker

    net = MemoryNetwork()
    coord = net.endpoint("coordinator")
    worker = Worker(net.endpoint("w0"), coordinator="coordinator", heartbeat=0.02, join_timeout=0.2)
    before = asyncio.all_tasks()
    async with asyncio.timeout(10):
        run = asyncio.create_task(worker.run())
        assert (await coord.recv("w0", P.HB)).meta["incarnation"] == worker.incarnation
        with pytest.raises(
            NotWelcomedError, match="no WELCOME from coordinator 'coordinator' within 0.2 s"
        ):
            await run
    assert asyncio.all_tasks() == before
    with pytest.raises(ValueError, match="join_timeout must be > 0 s or None"):
        Worker(net.endpoint("w1"), coordinator="coordinator", heartbeat=0.1, join_timeout=0)


async def test_the_coordinator_tells_every_worker_it_heard_from_to_stop(monkeypatch):
    """At the end the coordinator says ``stop`` to every worker it ever heard from, not only
    to those its membership holds live: a worker whose heartbeats ran late on a loaded
    machine would otherwise wait out its transport's ``peer_timeout`` (30 s over HTTP). A
    worker that is gone costs a bounded wait, not a hang."""
    from tandem.parties.elastic.coordinator import Coordinator, CoordinatorConfig

    net = MemoryNetwork()
    coord = Coordinator(
        net.endpoint("coordinator"), CoordinatorConfig(data_servers=("ds0",), interval=0.1)
    )
    slow, gone = net.endpoint("slow"), net.endpoint("gone")
    await gone.aclose()

    async def no_data_servers(op, *args, **kwargs):
        return {}

    monkeypatch.setattr(coord, "_call_all", no_data_servers)
    coord._watched.update({"slow", "gone"})  # heard from once; neither is live now
    assert not coord.membership.alive("slow", coord.clock())
    async with asyncio.timeout(10):
        await coord._stop()
        assert (await slow.recv("coordinator", P.CTL)).meta["op"] == "stop"
