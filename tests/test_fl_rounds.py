"""Federated rounds end to end over the memory transport: accounting, exact downlink,
dropouts, late clients that rejoin, malformed and oversized updates."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest

from fl_helpers import UPLINK, small_setup
from fl_helpers import compressed as _compressed
from tandem.errors import ConfigError
from tandem.parties.fl import protocol as P
from tandem.parties.fl.client import FLClient
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.server import FLConfig
from tandem.transports import codec
from tandem.transports.base import Frame

TIMEOUT = 1.2  # s; the late client below misses rounds by design; the others reply in ms
GENEROUS = 20.0  # s; where every client must make every round, even on a loaded CI machine


@pytest.fixture(scope="module")
def setup():
    return small_setup()  # compiled before any timed round


def compressed(rounds: int, timeout: float = GENEROUS, **kw) -> FLConfig:
    return _compressed(rounds, timeout, **kw)


class Recording(FLClient):
    """Adds up the encoded size of every frame it receives, stop message included."""

    down = 0

    async def run(self):
        while True:
            frame = await self.transport.recv(self.server, P.MODEL)
            self.down += codec.encoded_size(frame)
            if frame.meta.get("kind") == "stop":
                return
            await self.handle(frame)


async def test_byte_accounting_matches_encoded_frames_and_training_helps(setup):
    data, trainer = setup
    clients: list[Recording] = []

    def make(*a, **kw):
        clients.append(Recording(*a, **kw))
        return clients[-1]

    server = await run_memory_federation(
        data, trainer, compressed(4, lossless=True), client_cls=make
    )
    reps = server.reports
    assert [r.accepted for r in reps] == [["c0", "c1", "c2", "c3"]] * 4
    assert sum(r.up_bytes for r in reps) == server.bytes_up()
    # what the clients received, frame by frame, is exactly what the server counted
    assert sum(c.down for c in clients) == server.bytes_down()
    assert sum(r.down_bytes for r in reps) < server.bytes_down()  # + the stop messages
    dense_up = 4 * trainer.dim * 4 * 4
    assert server.bytes_up() < dense_up / 5
    assert reps[-1].accuracy is not None and reps[-1].accuracy > 0.15


async def test_downlink_is_exact_with_dropouts_and_late_clients(setup):
    data, trainer = setup
    snapshots: dict[int, bytes] = {0: trainer.init_vec.tobytes()}
    clients: dict[str, FLClient] = {}

    class Flaky(FLClient):
        async def before_reply(self, rnd):
            if self.transport.name == "c1" and rnd in (1, 2):
                await asyncio.sleep(TIMEOUT * 2)  # late: misses rounds 1 and 2

    def make(transport, *a, **kw):
        clients[transport.name] = Flaky(transport, *a, **kw)
        return clients[transport.name]

    cfg = compressed(6, TIMEOUT)

    async def run():
        from tandem.parties.fl import server as S

        orig = S.FLServer._apply

        def apply_and_snapshot(self, *a):
            orig(self, *a)
            snapshots[self.planner.version] = self.model.tobytes()

        S.FLServer._apply = apply_and_snapshot
        try:
            return await run_memory_federation(data, trainer, cfg, client_cls=make)
        finally:
            S.FLServer._apply = orig

    server = await run()
    reps = server.reports
    assert "c1" in reps[1].dropped and "c1" not in reps[1].accepted
    assert "c1" in reps[2].dropped
    assert any("c1" in r.accepted for r in reps[3:])  # it came back and rejoined
    assert all(len(r.accepted) >= 3 for r in reps)  # every round completed
    for name, c in clients.items():  # bit-for-bit reconstruction
        assert c.state.model.tobytes() == snapshots[c.state.version], name
    assert clients["c0"].state.version == server.planner.version - 1  # got the last round


class Malicious(FLClient):
    """c0..c3 misbehave in round 0 in four ways; all behave afterwards."""

    async def handle(self, frame):
        meta = frame.meta
        if meta.get("round") != 0 or self.transport.name == "c3":
            return await super().handle(frame)
        self.state.apply(meta, frame.arrays)
        k = UPLINK["k"]
        bad = {
            "c0": (
                {"round": 0, "n": 5, "version": 0, "kind": "randk"},
                np.full(k, np.nan, np.float32),
            ),
            "c1": (
                {"round": 0, "n": 5, "version": 0, "kind": "randk"},
                np.zeros(10 * trainer_dim(self), np.float32),
            ),  # oversized
            "c2": (
                {"round": 0, "n": "many", "version": 0, "kind": "randk"},
                np.zeros(k, np.float32),
            ),
        }[self.transport.name]
        await self.transport.send(self.server, P.UPDATE, Frame(meta=bad[0], arrays=(bad[1],)))


def trainer_dim(client: FLClient) -> int:
    return client.trainer.dim


async def test_malformed_and_oversized_updates_are_refused_and_round_completes(setup):
    data, trainer = setup
    server = await run_memory_federation(data, trainer, compressed(2), client_cls=Malicious)
    r0, r1 = server.reports
    assert r0.accepted == ["c3"] and r0.version == 1
    assert "NaN" in r0.rejected["c0"]
    assert "exceeds the limit" in r0.rejected["c1"]
    assert "meta.n must be an integer" in r0.rejected["c2"]
    assert r1.accepted == ["c0", "c1", "c2", "c3"] and not r1.rejected


def test_check_update_names_the_problem():
    ok = dict(round=0, n=3, version=0, kind="randk")
    arr = np.zeros(4, np.float32)
    kw = dict(uplink={"kind": "randk", "k": 4}, d=100, version=2, max_bytes=64)
    assert P.check_update(Frame(meta=ok, arrays=(arr,)), **kw)[1] == 3
    cases = [
        (dict(ok, kind="dense"), (arr,), "differs from the round's uplink"),
        (dict(ok, version=7), (arr,), r"meta.version=7 is outside \[0, 2\]"),
        (ok, (arr.astype(np.float64),), "must be float32"),
        (ok, (arr, arr), "exactly one array"),
        (dict(ok, zlib=[["<f4", [1000]]]), (np.zeros(3, np.uint8),), "inflate to 4000 bytes"),
        (dict(ok, zlib=[["<f4", [4]]]), (np.zeros(3, np.uint8),), "not valid zlib"),
    ]
    for meta, arrays, msg in cases:
        with pytest.raises(P.UpdateError, match=msg):
            P.check_update(Frame(meta=meta, arrays=arrays), **kw)


@pytest.mark.parametrize(
    "info",
    [
        [["<f4", [-1]]],
        [["<f4", [-2, -2]]],
        [["<f4", [[4]]]],
        [["<f4", [2**32, 2**32]]],
        [["<f4"]],
        [5],
        [["O", [4]]],
    ],
)
def test_a_malformed_zlib_descriptor_is_refused_not_raised(info):
    buf = np.frombuffer(zlib.compress(np.zeros(4, np.float32).tobytes()), np.uint8)
    meta = dict(round=0, n=3, version=0, kind="randk", zlib=info)
    kw = dict(uplink={"kind": "randk", "k": 4}, d=100, version=2, max_bytes=4096)
    with pytest.raises(P.UpdateError, match="meta.zlib|would inflate"):
        P.check_update(Frame(meta=meta, arrays=(buf,)), **kw)


def test_lossless_roundtrip_and_config_errors():
    a = np.arange(10, dtype=np.float32)
    packed, info = P.pack_arrays((a,), True)
    f = Frame(meta={"zlib": info}, arrays=packed)
    assert np.array_equal(P.unpack_arrays(f, max_bytes=1000)[0], a)
    with pytest.raises(ConfigError, match="fraction"):
        FLConfig(fraction=0)
    with pytest.raises(ConfigError, match="uplink kind"):
        P.check_uplink({"kind": "gzip"}, 10)


def test_local_trainer_compiles_once_for_any_dataset_size(setup):
    data, trainer = setup
    before = trainer.traces
    for x, y in data.clients:
        trainer.train(trainer.init_vec, x, y, 1)
    assert trainer.traces == before == 1


async def test_a_restarted_client_resyncs_and_rejoins_exactly(setup):
    """c2 loses its state before round 3 (a process restart: back to the initial model,
    version 0); the server's delta no longer applies, the client says which version it holds,
    and the server re-plans from it in the same round."""
    data, trainer = setup
    snapshots: dict[int, bytes] = {0: trainer.init_vec.tobytes()}
    clients: dict[str, FLClient] = {}

    class Restarting(FLClient):
        async def handle(self, frame):
            if (
                self.transport.name == "c2"
                and frame.meta.get("round") == 3
                and self.state.version > 0
            ):
                from tandem.parties.fl.downlink import ClientModel

                self.state = ClientModel(trainer.init_vec)  # state lost
            return await super().handle(frame)

    def make(transport, *a, **kw):
        clients[transport.name] = Restarting(transport, *a, **kw)
        return clients[transport.name]

    from tandem.parties.fl import server as S

    orig = S.FLServer._apply

    def apply_and_snapshot(self, *a):
        orig(self, *a)
        snapshots[self.planner.version] = self.model.tobytes()

    S.FLServer._apply = apply_and_snapshot
    try:
        server = await run_memory_federation(data, trainer, compressed(6), client_cls=make)
    finally:
        S.FLServer._apply = orig
    assert server.resyncs == 1
    assert clients["c2"].errors and "cannot apply" in clients["c2"].errors[0]
    assert all("c2" in r.accepted for r in server.reports), [r.accepted for r in server.reports]
    for name, c in clients.items():
        assert c.state.model.tobytes() == snapshots[c.state.version], name


async def test_a_refused_update_is_rejected_not_dropped_and_its_client_is_told(setup):
    data, trainer = setup
    seen: list[FLClient] = []

    class Told(Malicious):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            seen.append(self)

    server = await run_memory_federation(data, trainer, compressed(2), client_cls=Told)
    r0 = server.reports[0]
    assert sorted(r0.rejected) == ["c0", "c1", "c2"] and not r0.dropped
    told = {c.transport.name: c for c in seen}
    for name, why in (("c0", "NaN"), ("c1", "exceeds the limit"), ("c2", "meta.n")):
        assert told[name].refused_updates == 1, name
        assert "round 0: the server refused this update" in told[name].errors[0]
        assert why in told[name].errors[0], told[name].errors
    assert told["c3"].refused_updates == 0


def test_a_client_stops_at_its_max_refusals(setup):
    from tandem.parties.fl.client import UpdateRefusedError
    from tandem.transports.memory import MemoryNetwork

    data, trainer = setup
    x, y = data.clients[0]
    client = FLClient(MemoryNetwork().endpoint("c0"), "server", x, y, trainer, max_refusals=2)
    client.refused({"round": 0, "reason": "update refused: NaN"})
    with pytest.raises(UpdateRefusedError, match=r"refused 2 updates.*client.max_refusals = 2"):
        client.refused({"round": 1, "reason": "update refused: NaN"})
