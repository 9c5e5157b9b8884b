"""The benchmark's HTTP cluster: the coordinator and the data servers in this process, each on
its own `tandem.transports.http.HttpTransport` on 127.0.0.1, and every worker a separate
``tandem elastic worker`` process (HMAC-signed heartbeats, admitted by the shared secret).

Worker processes are started ahead, in a pool: each imports JAX and the CLI, then holds at a
gate (a line on stdin) until `HttpCluster.spawn` opens it, so a fresh worker joins in about a
heartbeat instead of an interpreter start-up. `HttpCluster.kill` sends ``SIGKILL``. The
interface (``alive``, ``kill``, ``spawn``, ``coordinator``) is the one `bench.elastic_windows`
drives, shared with the in-process `LocalCluster`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Coroutine
from typing import Any

from tandem.parties.elastic.coordinator import Coordinator, CoordinatorConfig
from tandem.parties.elastic.data_server import DataServer
from tandem.parties.elastic.spec import ModelSpec, Shard
from tandem.transports.http import HttpConfig, HttpTransport
from tandem.transports.ports import free_port

SECRET = b"bench-elastic"
GATED = (
    "import sys\n"
    "import jax, tandem.parties.cli, tandem.parties.elastic.cli, tandem.parties.elastic.worker, "
    "tandem.transports.http\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "sys.exit(tandem.parties.cli.main(sys.argv[1:]))\n"
)


class HttpCluster:
    def __init__(
        self,
        spec: ModelSpec,
        shards: list[Shard],
        *,
        interval: float,
        workers: int,
        spares: int,
        on_change: str,
    ) -> None:
        self.spec, self.shards = spec, shards
        self.interval, self.initial, self.spares = interval, workers, spares
        self.on_change = on_change
        self.coordinator: Coordinator
        self._pool: list[tuple[str, subprocess.Popen]] = []
        self._running: dict[str, subprocess.Popen] = {}
        self._ids = 0
        self._dir = tempfile.mkdtemp(prefix="bench-elastic-")
        self.killed: list[str] = []

    # -- the worker pool ---------------------------------------------------------------------
    def _launch(self, coordinator_url: str) -> None:
        name = f"w{self._ids}"
        self._ids += 1
        path = os.path.join(self._dir, f"{name}.toml")
        entries = {
            "name": name,
            "host": "127.0.0.1",
            "port": free_port(),
            "secret": SECRET.decode(),
            "coordinator": coordinator_url,
            "heartbeat": self.interval / 3,
        }
        with open(path, "w") as f:
            f.write("\n".join(f"{k} = {json.dumps(v)}" for k, v in entries.items()) + "\n")
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
        }
        proc = subprocess.Popen(
            [sys.executable, "-c", GATED, "elastic", "worker", "--config", path],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self._pool.append((name, proc))

    async def _ready(self) -> None:
        for name, proc in self._pool:
            assert proc.stdout is not None
            line = await asyncio.to_thread(proc.stdout.readline)
            if line != "ready\n":
                raise RuntimeError(f"worker process {name} did not start: {line!r}")

    def spawn(self) -> str:
        name, proc = self._pool.pop(0)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        self._running[name] = proc
        return name

    def kill(self, name: str) -> None:
        proc = self._running.pop(name)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        _close(proc)
        self.killed.append(name)

    def alive(self) -> list[str]:
        return [n for n, p in self._running.items() if p.poll() is None]

    # -- the run -----------------------------------------------------------------------------
    async def run(self, script: Callable[[HttpCluster], Coroutine[Any, Any, Any]]) -> dict:
        names = [f"ds{i}" for i in range(len(self.shards))]
        async with contextlib.AsyncExitStack() as stack:
            coord_t = await stack.enter_async_context(
                HttpTransport(HttpConfig(name="coordinator", secret=SECRET, admit_unknown=True))
            )
            ds_t = [
                await stack.enter_async_context(
                    HttpTransport(
                        HttpConfig(name=n, secret=SECRET, peers={"coordinator": coord_t.url})
                    )
                )
                for n in names
            ]
            for n, t in zip(names, ds_t, strict=True):
                coord_t.add_peer(n, t.url)
            servers = [
                DataServer(t, coordinator="coordinator", spec=self.spec, shard=s, url=t.url)
                for t, s in zip(ds_t, self.shards, strict=True)
            ]
            self.coordinator = Coordinator(
                coord_t,
                CoordinatorConfig(
                    data_servers=tuple(names),
                    data_server_urls=tuple((n, t.url) for n, t in zip(names, ds_t, strict=True)),
                    interval=self.interval,
                    epochs=10_000,
                    min_workers=self.initial,
                    on_change=self.on_change,
                ),
            )
            for _ in range(self.initial + self.spares):
                self._launch(coord_t.url)
            try:
                await self._ready()
                for _ in range(self.initial):
                    self.spawn()
                async with asyncio.TaskGroup() as tg:
                    for ds in servers:
                        tg.create_task(ds.run())
                    side = tg.create_task(script(self))
                    try:
                        summary = await self.coordinator.run()
                    finally:
                        side.cancel()
            finally:
                for _, proc in self._pool + list(self._running.items()):
                    if proc.poll() is None:
                        proc.kill()
                    await asyncio.to_thread(proc.wait)
                    _close(proc)
                shutil.rmtree(self._dir, ignore_errors=True)
        return summary


def _close(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()
