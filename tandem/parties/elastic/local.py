"""Every elastic role in one process on the memory transport (demo, tests, benchmark).

`LocalCluster.run(script)` starts the data servers, the coordinator and the initial workers
in one `asyncio.TaskGroup`, runs ``script(cluster)`` beside them (it may `spawn` and `kill`
workers at any moment), and returns the coordinator's summary once training ends. Nothing is
left running afterwards.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

from tandem.transports.memory import MemoryNetwork

from .coordinator import Coordinator, CoordinatorConfig, Progress
from .data_server import DataServer
from .errors import ElasticError
from .spec import ModelSpec, Shard
from .worker import Worker


class LocalCluster:
    def __init__(
        self,
        spec: ModelSpec,
        shards: list[Shard],
        *,
        interval: float,
        timeout: float | None = None,
        drain: float | None = None,
        epochs: int = 1,
        workers: int = 2,
        min_workers: int = 1,
        heartbeat: float | None = None,
        on_change: str = "rollback",
        on_phase: Callable[[str], None] | None = None,
        on_progress: Callable[[Progress], None] | None = None,
    ) -> None:
        self.net = MemoryNetwork(capacity=16)
        self.spec = spec
        self.ds_names = tuple(f"ds{i}" for i in range(len(shards)))
        self.data_servers = [
            DataServer(self.net.endpoint(name), coordinator="coordinator", spec=spec, shard=shard)
            for name, shard in zip(self.ds_names, shards, strict=True)
        ]
        self.coordinator = Coordinator(
            self.net.endpoint("coordinator"),
            CoordinatorConfig(
                data_servers=self.ds_names,
                interval=interval,
                timeout=timeout,
                drain=drain,
                epochs=epochs,
                min_workers=min_workers,
                on_change=on_change,
            ),
            on_phase=on_phase,
            on_progress=on_progress,
        )
        self.heartbeat = heartbeat or interval / 3
        self.initial = workers
        self.workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self.killed: list[str] = []

    def spawn(self, chaos: Callable[[str, int], None] | None = None) -> str:
        """Start a new worker (joins at the next detection); returns its name. Only while
        `run` is running (from its script or a callback): the worker is one of its tasks."""
        if self._tg is None:
            raise ElasticError(
                "LocalCluster.spawn starts a task of the running cluster; call it from the "
                "script given to run(), not before run() has started"
            )
        name = f"w{next(self._ids)}"
        worker = Worker(
            self.net.endpoint(name),
            coordinator="coordinator",
            heartbeat=self.heartbeat,
            chaos=chaos,
        )
        self.workers[name] = worker
        self._tasks[name] = self._tg.create_task(self._life(name, worker))
        return name

    async def _life(self, name: str, worker: Worker) -> None:
        try:
            await worker.run()
        finally:
            await self.net.endpoint(name).aclose()
            if worker.killed:
                self.killed.append(name)

    def kill(self, name: str) -> None:
        """Kill a worker at once, wherever it is (like ``kill -9``)."""
        task = self._tasks.get(name)
        if task is not None and not task.done():
            task.cancel()
            self.killed.append(name)

    def alive(self) -> list[str]:
        return [n for n, t in self._tasks.items() if not t.done()]

    async def run(
        self, script: Callable[[LocalCluster], Coroutine[Any, Any, None]] | None = None
    ) -> dict:
        async with asyncio.TaskGroup() as tg:
            self._tg = tg
            servers = [tg.create_task(ds.run()) for ds in self.data_servers]
            for _ in range(self.initial):
                self.spawn()
            side: asyncio.Task[None] | None = tg.create_task(script(self)) if script else None
            try:
                summary = await self.coordinator.run()
            finally:
                if side is not None:
                    side.cancel()
                for task in self._tasks.values():
                    task.cancel()
                for task in servers:
                    if not task.done():
                        task.cancel()
        return summary
