"""Federated simulation: N virtual clients through the real server and client round code.

`simulate(source, trainer, cfg, per_round=K)` runs `tandem.parties.fl.server.FLServer`'s
rounds (sampling, deadline, validation, aggregation, compression, secure aggregation, server
rule) over the memory transport with ``len(source)`` clients on its roster, but no client
exists between rounds: when the server is about to serve a sampled client (its `wait_ready`
hook), `ClientPool.admit` builds that client (its data from ``source.load(i)``, an
`FLClient` subclass, a fresh endpoint) and starts it; the client answers that one round's
training request with `FLClient`'s own code and is then dropped (endpoint closed, rows and
model freed). When the round ends, every client still running is cancelled.

Invariants:

* at most ``per_round`` client states are alive at once (`ClientPool.live` never exceeds
  `ClientPool.limit`; `ClientPool.peak` records the maximum);
* a client holds no state from one round to the next. A fresh client holds the initial model
  (version 0), and the server is told so (``known[c] = 0``), so its model message is planned
  from version 0 and applies exactly; client-side compression (rand-k, count sketch) keeps no
  error-feedback memory (the server's top-k residual lives on the server), so nothing needs
  keeping. Hence, for the same seed, the model equals the one long-lived in-memory clients
  reach (`tandem.parties.fl.federation.run_memory_federation`).

The server keeps per client only a version number, its link counters and its update bounds.
The ``anchor`` downlink is refused: it broadcasts to every client, which a simulation with no
idle clients has nobody to receive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from tandem.errors import ConfigError, TransportClosedError
from tandem.transports.memory import MemoryNetwork

from .. import protocol as P
from ..client import FLClient
from ..evaluation import hold_out
from ..server import FLConfig, FLServer, RoundReport
from ..train import LocalTrainer
from .sources import ClientSource


class VirtualClient(FLClient):
    """A client that lives for one round: `serve_round` answers one training request."""

    async def serve_round(self) -> None:
        """Serve model messages until this client has trained once, is told to stop, or its
        link closes."""
        while self.rounds_trained == 0:
            try:
                frame = await self.transport.recv(self.server, P.MODEL)
            except TransportClosedError:
                return
            if await self.dispatch(frame):
                return


class ClientPool:
    """Builds sampled clients on demand and drops them after their round; at most ``limit``
    alive at once (a client past the limit waits for a free place)."""

    def __init__(
        self,
        net: MemoryNetwork,
        server: str,
        names: Sequence[str],
        source: ClientSource,
        trainer: LocalTrainer,
        limit: int,
        tg: asyncio.TaskGroup,
        validation: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.net, self.server, self.source, self.trainer = net, server, source, trainer
        self.validation, self.seed = validation, seed
        self.index = {n: i for i, n in enumerate(names)}
        self.limit, self.live, self.peak, self.built = limit, 0, 0, 0
        self._places = asyncio.Semaphore(limit)
        self._tg = tg
        self._round: set[asyncio.Task[None]] = set()

    async def admit(self, name: str) -> None:
        """Build client ``name`` and start it serving (returns once it is listening)."""
        await self._places.acquire()
        self.live += 1
        self.peak = max(self.peak, self.live)
        try:
            i = self.index[name]
            x, y = await asyncio.to_thread(self.source.load, i)
            (x, y), val = hold_out(x, y, self.validation, seed=[self.seed, i])
            client = VirtualClient(
                self.net.endpoint(name), self.server, x, y, self.trainer, seed=i, validation=val
            )
        except BaseException:
            self._release()
            raise
        self.built += 1
        task = self._tg.create_task(self._serve(client))
        self._round.add(task)
        task.add_done_callback(self._round.discard)

    async def _serve(self, client: VirtualClient) -> None:
        try:
            await client.serve_round()
        finally:
            await client.transport.aclose()  # its inbound frames die with it
            self._release()

    def _release(self) -> None:
        self.live -= 1
        self._places.release()

    async def end_round(self) -> None:
        """Cancel the clients still running (the server no longer waits for them)."""
        left = list(self._round)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)


class SimServer(FLServer):
    """`FLServer` whose clients are built by ``pool`` when served (see the module)."""

    def __init__(self, *args: Any, pool: ClientPool, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool = pool

    async def wait_ready(self, client: str) -> None:
        await self.pool.admit(client)
        self.known[client] = 0  # a fresh client holds the initial model

    async def round(self, r: int) -> RoundReport:
        try:
            return await super().round(r)
        finally:
            await self.pool.end_round()


def per_round_fraction(per_round: int, clients: int) -> float:
    """The `FLConfig.fraction` that samples exactly ``per_round`` of ``clients``."""
    if not 1 <= per_round <= clients:
        raise ConfigError(
            f"--per-round must be between 1 and the number of clients ({clients}), got {per_round}"
        )
    f = per_round / clients
    while math.ceil(f * clients) > per_round:  # float rounding: step just below
        f = math.nextafter(f, 0.0)
    return f


async def simulate(
    source: ClientSource,
    trainer: LocalTrainer,
    cfg: FLConfig,
    *,
    per_round: int | None = None,
    test_set: tuple[Any, Any] | None = None,
    on_round: Callable[[RoundReport], None] | None = None,
    names: Sequence[str] | None = None,
    validation: float = 0.0,
) -> SimServer:
    """Run ``cfg.rounds`` rounds with ``len(source)`` virtual clients, ``per_round`` of them
    sampled each round (default: ``cfg.fraction`` of them); returns the finished server
    (``model``, ``reports``, ``pool.peak``). Client ``i`` is named ``names[i]`` (default
    ``c<i>``, as `tandem.parties.fl.federation.client_names`) and seeded with ``i``.
    ``validation``: the share of each client's rows held out of its training (seeded by
    ``(cfg.seed, i)``), where it evaluates the global model when ``cfg.client_eval`` asks
    (`tandem.parties.fl.evaluation`)."""
    n = len(source)
    if n < 1:
        raise ConfigError("a simulation needs at least one client; the source has none")
    if cfg.downlink == "anchor":
        raise ConfigError(
            "downlink = 'anchor' broadcasts to every client, and simulated clients exist only "
            "while sampled; use downlink 'full', 'initial' or 'version'"
        )
    if per_round is not None:
        cfg = dataclasses.replace(cfg, fraction=per_round_fraction(per_round, n))
    names = list(names) if names is not None else [f"c{i}" for i in range(n)]
    if len(names) != n or len(set(names)) != n:
        raise ConfigError(f"names must be {n} distinct client names, got {len(set(names))}")
    limit = max(1, math.ceil(cfg.fraction * n))
    net = MemoryNetwork()
    async with asyncio.TaskGroup() as tg:
        pool = ClientPool(
            net, "server", names, source, trainer, limit, tg, validation, seed=cfg.seed
        )
        server = SimServer(
            net.endpoint("server"),
            names,
            trainer,
            cfg,
            test_set=test_set,
            on_round=on_round,
            pool=pool,
        )
        await server.run()
    return server


__all__ = ["ClientPool", "SimServer", "VirtualClient", "per_round_fraction", "simulate"]
