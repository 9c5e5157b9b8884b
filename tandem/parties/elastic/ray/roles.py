"""Each elastic role's async main from a checked role table (no Ray here).

`run_role(role, table, path, watch)` is what one Ray actor runs: the same objects the
``tandem elastic coordinator|data-server|worker`` commands build from their files (`..cli`),
built from the table `job.Job` made. ``path`` is the job file (relative ``[data]`` paths start
at its folder). ``watch`` receives the role's object (`Coordinator`, `DataServer`, `Worker`)
once built, so its actor can report progress while it runs; a worker calls ``probe(point,
batch)`` at each step of each batch (`Worker`'s ``chaos`` points; it must not raise). It
returns the role's result as plain JSON-able data: the coordinator's summary, a data
server's ``{}``, a worker's ``{"batches": n}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.parties.config import validate

from ..build import coordinator_config, data_server, load_data_server, role_transport
from ..config import CoordinatorFile, DataServerFile, WorkerFile

ROLES = ("coordinator", "data-server", "worker")


async def run_role(
    role: str,
    table: dict[str, Any],
    path: str,
    watch: Callable[[Any], None] = lambda o: None,
    probe: Callable[[str, int], None] = lambda point, batch: None,
) -> dict[str, Any]:
    """Run ``role`` (one of `ROLES`) to its end; see the module docstring."""
    if role == "coordinator":
        return await _coordinator(validate(CoordinatorFile, table, path=path), watch)
    if role == "data-server":
        await _data_server(validate(DataServerFile, table, path=path), path, watch)
        return {}
    if role == "worker":
        return await _worker(validate(WorkerFile, table, path=path), watch, probe)
    raise ValueError(f"role is {role!r}; choose one of {', '.join(ROLES)}")


async def _coordinator(cfg: CoordinatorFile, watch: Callable[[Any], None]) -> dict[str, Any]:
    from ..coordinator import Coordinator

    ccfg = coordinator_config(cfg)
    async with role_transport(cfg, dict(cfg.data_servers), admit_unknown=cfg.admit) as t:
        coord = Coordinator(t, ccfg)
        watch(coord)
        summary = await coord.run()
    summary["events"] = [
        (t_, kind, detail)
        for t_, kind, detail in coord.events
        if kind in ("removed", "joined", "rollback", "epoch", "recover", "resumed", "kept")
    ]
    return summary


async def _data_server(cfg: DataServerFile, path: str, watch: Callable[[Any], None]) -> None:
    spec, shard, store, party = await load_data_server(cfg, path)
    async with role_transport(cfg, {cfg.coordinator_name: cfg.coordinator}) as t:
        ds = data_server(t, cfg, spec, shard, store, party)
        watch(ds)
        await ds.run()


async def _worker(
    cfg: WorkerFile, watch: Callable[[Any], None], probe: Callable[[str, int], None]
) -> dict[str, Any]:
    from ..worker import Worker

    async with role_transport(cfg, {cfg.coordinator_name: cfg.coordinator}) as t:
        worker = Worker(
            t,
            coordinator=cfg.coordinator_name,
            heartbeat=cfg.heartbeat,
            url=cfg.advertise_url or t.url,
            join_timeout=cfg.join_timeout,
            chaos=probe,
        )
        watch(worker)
        await worker.run()
        return {"worker": cfg.name, "batches": worker.done}
