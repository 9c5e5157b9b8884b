"""Run a whole federation (server + clients) in one process over the memory transport.

Used by ``tandem fl demo``, the benchmark and the tests. Everything runs in one TaskGroup:
when the server finishes it sends ``stop`` and the clients return; if anything fails, the
rest is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import optax

from tandem.transports.memory import MemoryNetwork

from .client import FLClient
from .data import FederatedData
from .server import FLConfig, FLServer, RoundReport
from .train import LocalTrainer


def client_names(n: int) -> list[str]:
    return [f"c{i}" for i in range(n)]


def make_trainer(
    data: FederatedData,
    hidden: Sequence[int],
    *,
    lr: float = 0.05,
    epochs: int = 2,
    batch_size: int = 16,
    init_seed: int = 0,
) -> LocalTrainer:
    sizes = [data.num_features, *hidden, data.num_classes]
    return LocalTrainer(
        sizes, optax.sgd(lr), epochs=epochs, batch_size=batch_size, init_seed=init_seed
    )


async def run_memory_federation(
    data: FederatedData,
    trainer: LocalTrainer,
    cfg: FLConfig,
    *,
    on_round: Callable[[RoundReport], None] | None = None,
    client_cls: Callable[..., FLClient] = FLClient,
    network: MemoryNetwork | None = None,
) -> FLServer:
    """Train with one server and ``len(data.clients)`` clients; returns the finished server."""
    net = network or MemoryNetwork()
    names = client_names(len(data.clients))
    server_t = net.endpoint("server")
    clients = [
        client_cls(net.endpoint(n), "server", x, y, trainer, seed=i)
        for i, (n, (x, y)) in enumerate(zip(names, data.clients, strict=True))
    ]
    server = FLServer(
        server_t, names, trainer, cfg, test_set=(data.x_test, data.y_test), on_round=on_round
    )
    async with asyncio.TaskGroup() as tg:
        for c in clients:
            tg.create_task(c.run())
        await server.run()
    return server


async def run_http_federation(
    data: FederatedData,
    trainer: LocalTrainer,
    cfg: FLConfig,
    *,
    on_round: Callable[[RoundReport], None] | None = None,
    evaluate: bool = True,
    secret: bytes | None = None,
) -> FLServer:
    """Same as `run_memory_federation`, but every party has its own `HttpTransport` on
    127.0.0.1 (one process, real sockets). Frames over the update limit are refused by the
    server's transport itself (413), so the client's send fails and it is left out."""
    from tandem.transports.base import Transport
    from tandem.transports.factory import addressing, make_transport, started

    def url(t: Transport) -> str:
        return addressing(t, "an HTTP federation").address()

    names = client_names(len(data.clients))
    async with contextlib.AsyncExitStack() as stack:
        server_t = await stack.enter_async_context(
            # the server checks NaN/Inf itself (`protocol.check_update`), so that a refused
            # update ends its client's wait in the round at once
            started(make_transport("http", name="server", secret=secret, reject_nonfinite=False))
        )
        client_ts = [
            await stack.enter_async_context(
                started(
                    make_transport("http", name=n, secret=secret, peers={"server": url(server_t)})
                )
            )
            for n in names
        ]
        for n, t in zip(names, client_ts, strict=True):
            addressing(server_t, "an HTTP federation").add_peer(n, url(t))
        clients = [
            FLClient(t, "server", x, y, trainer, seed=i)
            for i, (t, (x, y)) in enumerate(zip(client_ts, data.clients, strict=True))
        ]
        server = FLServer(
            server_t,
            names,
            trainer,
            cfg,
            test_set=(data.x_test, data.y_test) if evaluate else None,
            on_round=on_round,
        )
        async with asyncio.TaskGroup() as tg:
            for c in clients:
                tg.create_task(c.run())
            await server.run()
    return server
