"""The pieces of a deployed federation, fast: the server's checkpoint (round trip, atomic
replacement, refusal of another configuration), the roster (an unknown client is refused by
the transport), and the deployed server refusing malformed and non-finite updates while the
round completes with the others."""

from __future__ import annotations

import asyncio
import os

import jax
import numpy as np
import optax
import pytest

from fl_helpers import UPLINK, small_setup
from fl_process_helpers import CLIENTS, Federation, to_toml
from tandem.parties import files
from tandem.parties.cli import main
from tandem.parties.fl import checkpoint as ckpt
from tandem.parties.fl import protocol as P
from tandem.parties.fl.aggregate import ServerRule
from tandem.parties.fl.client_process import Connection, ProcessClient, RefusedError
from tandem.parties.fl.config import load_client_config, load_server_config
from tandem.parties.fl.federation import run_memory_federation
from tandem.parties.fl.server import FLConfig, FLServer
from tandem.parties.fl.server_process import DeployedServer, prepare_server
from tandem.parties.fl.task import Task
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork

IDENTITY = {"model": {"kind": "mlp"}, "optimizer": {"name": "adam"}}


def adam_config(rounds: int) -> FLConfig:
    return FLConfig(
        rounds=rounds,
        fraction=1.0,
        round_timeout=20.0,
        uplink=UPLINK,
        rule=ServerRule(topk=60),
        downlink="version",
        seed=3,
        optimizer=optax.adam(0.01),
    )


@pytest.fixture(scope="module")
def trained():
    """A server after 3 rounds with FedAdam, rand-k uplink, error feedback, version deltas."""
    data, trainer = small_setup()
    server = asyncio.run(run_memory_federation(data, trainer, adam_config(3)))
    return server, trainer


def fresh_server(trainer) -> FLServer:
    return FLServer(
        MemoryNetwork().endpoint("server"), ["c0", "c1", "c2", "c3"], trainer, adam_config(3)
    )


def test_checkpoint_round_trip_is_exact(trained, tmp_path):
    server, trainer = trained
    location = str(tmp_path / "state" / "server.ckpt")
    ckpt.save(location, server, IDENTITY)
    restored = fresh_server(trainer)
    ckpt.restore(restored, ckpt.load(location), IDENTITY)
    assert restored.model.tobytes() == server.model.tobytes()
    assert (
        np.asarray(restored.state.residual).tobytes() == np.asarray(server.state.residual).tobytes()
    )
    assert np.any(np.asarray(server.state.residual))  # error feedback has something to carry
    for a, b in zip(
        jax.tree_util.tree_leaves(restored.opt_state),
        jax.tree_util.tree_leaves(server.opt_state),
        strict=True,
    ):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert restored.next_round == server.next_round == 3
    assert restored.known == server.known and restored.reports == server.reports
    assert restored.participation == server.participation == {f"c{i}": 3 for i in range(4)}
    older = ckpt.load(location)  # written before participation was kept: counted from reports
    del older.meta["participation"]
    again = fresh_server(trainer)
    ckpt.restore(again, older, IDENTITY)
    assert again.participation == server.participation
    for v in range(server.planner.version + 1):  # the downlink plans the same messages
        m1, a1 = server.planner.plan(server.model, v)
        m2, a2 = restored.planner.plan(restored.model, v)
        assert m1 == m2 and all(x.tobytes() == y.tobytes() for x, y in zip(a1, a2, strict=True))


def test_checkpoint_replacement_is_atomic(trained, tmp_path, monkeypatch):
    server, _ = trained
    location = str(tmp_path / "server.ckpt")
    ckpt.save(location, server, IDENTITY)
    before = (tmp_path / "server.ckpt").read_bytes()

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(files.os, "replace", crash)
    server.next_round += 1
    try:
        with pytest.raises(OSError, match="disk gone"):
            ckpt.save(location, server, IDENTITY)
    finally:
        server.next_round -= 1
    assert (tmp_path / "server.ckpt").read_bytes() == before  # the old checkpoint, whole
    assert os.listdir(tmp_path) == ["server.ckpt"]  # no temporary file left behind
    assert ckpt.load(location).next_round == 3
    monkeypatch.undo()
    (tmp_path / ".server.ckpt.killed.tmp").write_bytes(b"half a checkpoint")
    ckpt.save(location, server, IDENTITY)  # a writer killed mid-write left that file
    assert os.listdir(tmp_path) == ["server.ckpt"]


def test_checkpoint_through_fsspec_and_absent(trained):
    server, trainer = trained
    location = "memory://fl-test/server.ckpt"
    assert ckpt.load(location) is None
    ckpt.save(location, server, IDENTITY)
    restored = fresh_server(trainer)
    ckpt.restore(restored, ckpt.load(location), IDENTITY)
    assert restored.model.tobytes() == server.model.tobytes()


def test_a_checkpoint_of_another_configuration_is_refused(trained, tmp_path):
    server, trainer = trained
    location = str(tmp_path / "server.ckpt")
    ckpt.save(location, server, IDENTITY)
    other = {**IDENTITY, "optimizer": {"name": "yogi"}}
    with pytest.raises(ckpt.CheckpointError, match=r"differs in: \['optimizer'\].*--fresh"):
        ckpt.restore(fresh_server(trainer), ckpt.load(location), other)
    (tmp_path / "junk.ckpt").write_bytes(b"\x00" * 64)
    with pytest.raises(ckpt.CheckpointError, match="not a federated server checkpoint"):
        ckpt.load(str(tmp_path / "junk.ckpt"))


async def test_an_unknown_client_is_refused_by_the_transport(tmp_path):
    from tandem.transports.http import HttpTransport

    fed = Federation(tmp_path, rounds=1)
    fed.write()
    scfg = load_server_config(fed.path("server"))
    http = scfg.security.http_config(
        "server", port=0, admit_unknown=True, admit_names=frozenset(scfg.clients)
    )
    mallory = dict(fed.clients["bank_a"])
    mallory["client"] = {**mallory["client"], "name": "mallory", "port": 0}
    (tmp_path / "mallory.toml").write_text(to_toml(mallory))
    async with HttpTransport(http) as server_t:
        for name in ("mallory", "bank_a"):
            ccfg = load_client_config(
                tmp_path / f"{name}.toml" if name == "mallory" else fed.path(name)
            )
            peers = {"server": server_t.url}
            async with HttpTransport(ccfg.security.http_config(name, port=0, peers=peers)) as t:
                link = Connection(t, ccfg, t.url)
                if name == "mallory":
                    with pytest.raises(RefusedError, match=r"'mallory' in its server\.clients"):
                        await link.hello(0, deadline=asyncio.get_running_loop().time() + 5)
                else:
                    await link.hello(0, deadline=float("inf"))
        assert "bank_a" in server_t.peers and "mallory" not in server_t.peers


class Misbehaving(ProcessClient):
    """bank_a sends NaN and bank_b a wrongly shaped update in round 0; all behave later."""

    async def handle(self, frame):
        name = self.transport.name
        if frame.meta.get("round") != 0 or name not in ("bank_a", "bank_b"):
            return await super().handle(frame)
        self.state.apply(frame.meta, frame.arrays)
        d = self.trainer.dim
        payload = (
            np.full(d, np.nan, np.float32) if name == "bank_a" else np.zeros(d + 1, np.float32)
        )
        meta = {"round": 0, "n": 10, "version": self.state.version, "kind": "dense"}
        await self.transport.send(self.server, P.UPDATE, Frame(meta=meta, arrays=(payload,)))


async def test_the_deployed_server_refuses_bad_updates_and_completes_the_round(tmp_path):
    fed = Federation(tmp_path, rounds=2)
    fed.write()
    scfg = load_server_config(fed.path("server"))
    setup = await asyncio.to_thread(prepare_server, scfg)
    net = MemoryNetwork()
    server = DeployedServer(net.endpoint("server"), scfg, setup)
    clients = []
    for c in CLIENTS:
        ccfg = load_client_config(fed.path(c))
        link = Connection(net.endpoint(c), ccfg, "http://127.0.0.1:1")
        await link.hello(0, deadline=float("inf"))
        task = Task.from_meta(setup.task.to_meta())
        trainer = task.trainer(optax.sgd(0.1))
        x, y = setup.x[:40], setup.y[:40]
        clients.append(Misbehaving(link, task, x, y, trainer, seed=CLIENTS.index(c)))
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(server.watch())
        runs = [tg.create_task(c.run()) for c in clients]
        await server.wait_for_clients(4, 10)
        await server.run()
        watcher.cancel()
    assert all(r.result() == "stop" for r in runs)
    r0, r1 = server.reports
    assert r0.accepted == ["bank_c", "bank_d"] and r0.version == 1
    assert "NaN or Inf" in r0.rejected["bank_a"]
    assert "must be float32" in r0.rejected["bank_b"]
    assert r1.accepted == list(CLIENTS) and not r1.rejected
    saved = ckpt.load(scfg.checkpoint)  # written after every round
    assert saved is not None and saved.next_round == 2
    again = DeployedServer(MemoryNetwork().endpoint("server"), scfg, setup)
    ckpt.restore(again, saved, scfg.identity())
    assert again.model.tobytes() == server.model.tobytes()


async def test_a_version_held_from_a_server_that_started_over_is_reset(tmp_path):
    # bank_a holds version 2 of a first server's run; that server is replaced by one that
    # started over (no checkpoint) and has reached version 3: the client's version 2 is not
    # this server's version 2, so the welcome must tell it to drop its model (a delta from
    # version 2 would leave it on the old run's values wherever the new run has not moved)
    fed = Federation(tmp_path, rounds=1)
    fed.write()
    scfg = load_server_config(fed.path("server"))
    setup = await asyncio.to_thread(prepare_server, scfg)
    ccfg = load_client_config(fed.path("bank_a"))

    async def welcome_of(server, link, version):
        hello = Frame(meta=link.hello_meta(version))
        await server.welcome("bank_a", hello.meta["version"], None, P.hello_lineage(hello))
        frame = await link.transport.recv("server", P.MODEL)
        link.lineage = frame.meta.get("lineage")  # what the client keeps (`ProcessClient`)
        return frame.meta

    net = MemoryNetwork()
    first = DeployedServer(net.endpoint("server"), scfg, setup)
    link = Connection(net.endpoint("bank_a"), ccfg, "http://127.0.0.1:1")
    assert not (await welcome_of(first, link, 0))["reset"]
    for _ in range(2):
        first.planner.record(None)
    assert not (await welcome_of(first, link, 2))["reset"]  # its own version: kept

    net = MemoryNetwork()
    again = DeployedServer(net.endpoint("server"), scfg, setup)
    for _ in range(3):
        again.planner.record(None)
    link.transport = net.endpoint("bank_a")
    assert (await welcome_of(again, link, 2))["reset"]
    assert again.known["bank_a"] == 0

    net = MemoryNetwork()  # resumed from the first server's checkpoint: the same history
    resumed = DeployedServer(net.endpoint("server"), scfg, setup)
    ckpt.save(str(tmp_path / "first.ckpt"), first, scfg.identity())
    saved = ckpt.load(str(tmp_path / "first.ckpt"))
    assert saved is not None
    ckpt.restore(resumed, saved, scfg.identity())
    link.transport, link.lineage = net.endpoint("bank_a"), first.lineage
    assert not (await welcome_of(resumed, link, 2))["reset"]
    assert resumed.known["bank_a"] == 2


def test_prepare_writes_one_csv_per_party(tmp_path, capsys):
    assert main(["fl", "prepare", "--out", str(tmp_path), "--clients", "x,y"]) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["server.csv", "x.csv", "y.csv"]
    header = (tmp_path / "x.csv").read_text().splitlines()[0].split(",")
    assert header[0] == "id" and header[-1] == "digit" and len(header) == 66
    assert '"files"' in capsys.readouterr().out


def test_a_server_whose_clients_never_come_exits_2_naming_them(tmp_path, capsys):
    fed = Federation(tmp_path, rounds=1)
    fed.server["server"].update(port=0, wait=0.5, min_clients=2)
    fed.write()
    assert main(["fl", "server", "--config", str(fed.path("server"))]) == 2
    err = capsys.readouterr().err
    assert "only 0 of the 2 clients needed (server.min_clients) connected within 0.5 s" in err
    assert "'bank_a', 'bank_b', 'bank_c', 'bank_d'" in err
