"""The federation a set of server and client TOML files describe, run in one process.

`run_local(server_cfg, client_cfgs)` builds exactly what ``tandem fl server`` and ``tandem fl
client`` build (the same task, data, trainers, client seeds and `FLConfig`) but connects the
parties through the memory transport, with no checkpoint and no export. Seeded throughout, so
it is the reference a run over HTTP is compared with (tests/test_fl_processes.py): with every
client answering every round the two give the same model.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from tandem.errors import ConfigError
from tandem.transports.memory import MemoryNetwork

from .client import FLClient
from .client_process import prepare_client
from .config import ClientConfig, ServerConfig
from .server import FLServer
from .server_process import prepare_server


async def run_local(
    server_cfg: ServerConfig, client_cfgs: Sequence[ClientConfig]
) -> dict[str, Any]:
    """Train in one process; returns ``{"accuracy" (percent or None), "loss", "model",
    "reports"}`` (accuracy and loss on the server's [data]; None when it has no labels)."""
    names = [c.name for c in client_cfgs]
    if sorted(names) != sorted(server_cfg.clients):
        raise ConfigError(
            f"run_local needs one client config per roster name {list(server_cfg.clients)}, "
            f"got {names}"
        )
    setup = await asyncio.to_thread(prepare_server, server_cfg)
    net = MemoryNetwork()
    clients = []
    for cfg in client_cfgs:
        trainer, x, y, val = await asyncio.to_thread(prepare_client, cfg, setup.task)
        seed = server_cfg.clients.index(cfg.name)
        link = net.endpoint(cfg.name)
        clients.append(FLClient(link, server_cfg.name, x, y, trainer, seed=seed, validation=val))
    server = FLServer(
        net.endpoint(server_cfg.name),
        server_cfg.clients,
        setup.trainer,
        setup.fl,
        test_set=(setup.x, setup.y)
        if setup.trainer.classifies and setup.y is not None and server_cfg.evaluate == "server"
        else None,
    )
    async with asyncio.TaskGroup() as tg:
        for c in clients:
            tg.create_task(c.run())
        await server.run()
    final = None
    if setup.y is not None:
        final = await asyncio.to_thread(server.trainer.evaluate, server.model, setup.x, setup.y)
    return {
        "accuracy": None
        if final is None or final.accuracy is None
        else round(100 * final.accuracy, 2),
        "loss": None if final is None else final.loss,
        "model": server.model,
        "reports": server.reports,
    }


__all__ = ["run_local"]
