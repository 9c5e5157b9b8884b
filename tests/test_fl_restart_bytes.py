"""Byte counters across a server restart (issue 43, point 8), in one process over the memory
transport: a deployed server killed in the middle of round 1 (every client's update read, the
round not finished) and started again from its checkpoint, while each client's transport
delivers its round-1 update a second time to the new server (as HTTP's retry does across the
restart), reports per round exactly the bytes, the clients and the model of an uninterrupted
run of the same configuration: the resent update is discarded (it names the old server's
serial) and counted once, in no round."""

from __future__ import annotations

import asyncio
import contextlib

import optax

from fl_process_helpers import CLIENTS, Federation
from tandem.errors import TransportClosedError
from tandem.parties.fl import checkpoint as ckpt
from tandem.parties.fl import protocol as P
from tandem.parties.fl.client_process import Connection, ProcessClient
from tandem.parties.fl.config import load_client_config, load_server_config
from tandem.parties.fl.server_process import DeployedServer, prepare_server
from tandem.parties.fl.task import Task
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork

ROUNDS = 3


class Hanging(DeployedServer):
    """Reads every client's round-1 update, then hangs (to be killed there)."""

    got: set[str]

    async def _next_update(self, c: str) -> Frame | str:
        frame = await super()._next_update(c)
        if self.next_round == 1:
            self.got.add(c)
            await asyncio.Event().wait()
        return frame


class Resending(Connection):
    """Delivers its last update again before saying hello to a restarted server."""

    last: Frame | None = None

    async def hello(self, version: int, deadline: float) -> None:
        stale, self.last = self.last, None
        while stale is not None:
            try:
                await self.transport.send(self.server, P.UPDATE, stale)
                break
            except TransportClosedError:
                await asyncio.sleep(0.02)  # the server is not back yet
        await super().hello(version, deadline)


async def serve(server: DeployedServer) -> None:
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(server.watch())
        await server.wait_for_clients(len(CLIENTS), 20)
        await server.run()
        watcher.cancel()


async def federation(tmp_path, kill: bool) -> tuple[list, bytes, int]:
    """Run ``ROUNDS`` rounds (``kill``: with the restart); the reports, final model, stale count."""
    fed = Federation(tmp_path, rounds=ROUNDS)
    fed.server["compression"] = {"preset": "dense", "downlink": "full"}
    fed.write()
    scfg = load_server_config(fed.path("server"))
    setup = await asyncio.to_thread(prepare_server, scfg)
    net = MemoryNetwork()
    first = (Hanging if kill else DeployedServer)(net.endpoint("server"), scfg, setup)
    first.got = set()
    clients = []
    for c in CLIENTS:
        link = Resending(net.endpoint(c), load_client_config(fed.path(c)), "http://127.0.0.1:1")
        send = link.transport.send

        async def recording(peer, channel, frame, link=link, send=send):
            await send(peer, channel, frame)
            if channel == P.UPDATE:
                link.last = frame

        link.transport.send = recording  # type: ignore[method-assign]
        await link.hello(0, deadline=float("inf"))
        task = Task.from_meta(setup.task.to_meta())
        x, y = setup.x[:60], setup.y[:60]
        seed = CLIENTS.index(c)
        clients.append(ProcessClient(link, task, x, y, task.trainer(optax.sgd(0.1)), seed=seed))
    async with asyncio.TaskGroup() as tg:
        runs = [tg.create_task(c.run()) for c in clients]
        serving = tg.create_task(serve(first))
        server = first
        if kill:
            while len(first.got) < len(CLIENTS):
                await asyncio.sleep(0.01)
            for c in clients:
                c.link.last = c.link.last if c.link.last.meta["round"] == 1 else None
            await first.transport.aclose()  # the process dies: its links with it
            serving.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await serving
            server = DeployedServer(net.endpoint("server"), scfg, setup)
            saved = await asyncio.to_thread(ckpt.load, scfg.checkpoint)
            ckpt.restore(server, saved, scfg.identity())
            assert server.next_round == 1
            await serve(server)
    assert [r.result() for r in runs] == ["stop"] * len(CLIENTS)
    return server.reports, server.model.tobytes(), server.stale


async def test_byte_counts_continue_exactly_across_a_server_restart(tmp_path):
    plain, model, stale = await federation(tmp_path / "plain", kill=False)
    restarted, model_r, stale_r = await federation(tmp_path / "restarted", kill=True)
    assert stale == 0 and stale_r == len(CLIENTS)  # each resent update discarded once

    def counts(reports):
        return [(r.round, r.accepted, r.up_bytes, r.down_bytes, r.version) for r in reports]

    assert counts(restarted) == counts(plain)
    assert all(r.up_bytes > 0 and r.down_bytes > 0 for r in plain)
    assert model_r == model
