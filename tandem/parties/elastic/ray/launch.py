"""`RayLaunch`: an elastic run placed, scaled and restarted by a Ray cluster.

What Ray decides: where each actor runs (the coordinator on the launching driver's node, data
servers spread over nodes by a placement group, workers spread with ``SPREAD``), restarting
the static roles' actors (``max_restarts``), and what resources each claims. What Tandem
decides, unchanged: membership (heartbeats), fencing, the exactly-once ledger, checkpoints and
the journal (on ``[ray] storage``). A restarted coordinator or data server listens again at the
address it had (same node, same port) and resumes from the journal / its checkpoints; workers
are stateless, so a lost one is replaced by a new actor with a new name that joins through the
normal protocol.

Ray's calls block, so each goes to a thread (`asyncio.to_thread`); the loop is the caller's.
The supervisor's bookkeeping (`_step`) runs in that thread; the loop only sleeps between steps.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Coroutine
from typing import Any

from tandem._extras import needs

from ..errors import ElasticError
from .actors import RoleActor
from .job import Job
from .supervisor import decide

PURPOSE = "tandem elastic launch (elastic training on a Ray cluster)"
#: seconds a restarted static role's actor has to come back, and the placement group to form.
COME_BACK_S = 120.0
# after a stop, Ray's available resources show the freed claim only some time later; until
# then (or this many seconds) no further step is decided, or one "short" would stop several
SETTLE_S = 10.0


@dataclasses.dataclass
class LaunchedWorker:
    """One worker actor. ``state``: ``starting`` (asked for, not yet placed) or ``live``.
    Its role is asked for with the actor (``run`` queued behind ``place``), so a new worker
    starts the moment its process is up, not a supervision step later."""

    name: str
    actor: Any
    ref: Any  # place() while starting, run() while live
    run: Any = None
    state: str = "starting"
    node: str = ""


class RayLaunch:
    """One launched run. ``await run(script)`` starts every role, supervises until the
    coordinator's summary, runs ``script(self)`` beside it (tests, the benchmark; cancelled when
    training ends) and tears every actor down, also on failure.

    ``events``: (``time.monotonic()``, kind, detail) of what the supervisor did: ``placed``,
    ``worker_added``, ``worker_live``, ``worker_lost``, ``worker_done``, ``worker_failed``,
    ``worker_stopped``, ``restarted``."""

    def __init__(
        self,
        job: Job,
        *,
        address: str | None = None,
        on_event: Callable[[tuple[float, str, dict[str, Any]]], None] | None = None,
    ) -> None:
        self.job = job
        self.address = address if address is not None else job.ray.address
        self.on_event = on_event or (lambda e: None)
        self.events: collections.deque[tuple[float, str, dict[str, Any]]] = collections.deque(
            maxlen=10_000
        )
        self.coordinator: Any = None
        self.coordinator_url = ""
        self.data_servers: dict[str, Any] = {}
        self.workers: dict[str, LaunchedWorker] = {}
        self.counts = collections.Counter[str]()
        self._static: dict[str, tuple[Any, str, dict[str, Any], Any]] = {}
        self._pg: Any = None
        self._remote: Any = None  # ray.remote(RoleActor); Ray's stubs type actors loosely
        self._env: dict[str, Any] | None = None
        self._owns_ray = False
        self._next = 0
        self._settling: tuple[float, float] | None = None  # (CPUs seen at a stop, deadline)

    # -- the caller's side ---------------------------------------------------------------
    async def run(
        self, script: Callable[[RayLaunch], Coroutine[Any, Any, None]] | None = None
    ) -> dict[str, Any]:
        """Train; returns the coordinator's summary plus ``ray`` (the supervisor's counts)."""
        try:
            await asyncio.to_thread(self._start)
            async with asyncio.TaskGroup() as tg:
                side = tg.create_task(script(self)) if script is not None else None
                try:
                    summary = await self._supervise()
                finally:
                    if side is not None:
                        side.cancel()
        finally:
            await asyncio.to_thread(self._teardown)
        summary["ray"] = dict(self.counts)
        return summary

    async def coordinator_status(self, since: int = 0) -> dict[str, Any]:
        """The coordinator actor's `RoleActor.status`."""
        import ray

        return await asyncio.to_thread(ray.get, self.coordinator.status.remote(since), timeout=30)

    async def stop(self) -> bool:
        """Ask the coordinator to finish after its next detection, even mid-epoch (`run` then
        returns its summary of the epochs closed so far); False when it is not running."""
        import ray

        return bool(await asyncio.to_thread(ray.get, self.coordinator.stop.remote(), timeout=30))

    async def worker_status(self, name: str) -> dict[str, Any]:
        """A worker actor's `RoleActor.status`."""
        import ray

        actor = self.workers[name].actor
        return await asyncio.to_thread(ray.get, actor.status.remote(), timeout=30)

    def live_workers(self) -> dict[str, str]:
        """name -> Ray node id of every placed worker."""
        return {n: w.node for n, w in self.workers.items() if w.state == "live"}

    async def _supervise(self) -> dict[str, Any]:
        while True:
            summary = await asyncio.to_thread(self._step)
            if summary is not None:
                return summary
            await asyncio.sleep(self.job.ray.poll)

    def _event(self, kind: str, **detail: Any) -> None:
        event = (time.monotonic(), kind, detail)
        self.events.append(event)
        self.counts[kind] += 1
        self.on_event(event)

    # -- start and stop (in a thread) ------------------------------------------------------
    def _start(self) -> None:
        with needs("ray", PURPOSE):
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import (
                NodeAffinitySchedulingStrategy,
                PlacementGroupSchedulingStrategy,
            )
        cfg = self.job.ray
        if not ray.is_initialized():
            ray.init(address=self.address)
            self._owns_ray = True
        self._remote = ray.remote(RoleActor)
        env: dict[str, Any] | None = {"env_vars": dict(cfg.worker_env)} if cfg.worker_env else None
        self._env = env
        here = ray.get_runtime_context().get_node_id()
        self.coordinator = self._remote.options(
            num_cpus=cfg.coordinator_cpus,
            max_restarts=cfg.restarts,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
            runtime_env=env,
        ).remote("coordinator")
        names = self.job.data_server_names
        bundle = {"CPU": max(cfg.data_server_cpus, 0.01), **cfg.data_server_resources}
        if cfg.data_server_memory is not None:
            bundle["memory"] = cfg.data_server_memory
        self._pg = placement_group([dict(bundle) for _ in names], strategy=cfg.spread.upper())
        ready, _ = ray.wait([self._pg.ready()], timeout=COME_BACK_S)
        if not ready:
            raise ElasticError(
                f"the cluster cannot place {len(names)} data servers {cfg.spread} with "
                f"{bundle} each within {COME_BACK_S:g} s; add nodes or lower "
                "[ray] data_server_cpus / data_server_memory (strict_spread needs one node each)"
            )
        for i, name in enumerate(names):
            self.data_servers[name] = self._remote.options(
                num_cpus=max(cfg.data_server_cpus, 0.01),
                memory=cfg.data_server_memory,
                resources=cfg.data_server_resources or None,
                max_restarts=cfg.restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pg, placement_group_bundle_index=i
                ),
                runtime_env=env,
            ).remote("data-server")
        scheme = "https" if self.job.file.security.tls_cert else "http"
        cip, cport, cnode = ray.get(self.coordinator.place.remote(), timeout=COME_BACK_S)
        self.coordinator_url = f"{scheme}://{cip}:{cport}"
        self._event("placed", role="coordinator", url=self.coordinator_url, node=cnode)
        urls = {}
        for name, actor in self.data_servers.items():
            ip, port, node = ray.get(actor.place.remote(), timeout=COME_BACK_S)
            urls[name] = f"{scheme}://{ip}:{port}"
            table = self.job.data_server_table(name, self.coordinator_url, ip, port)
            self._static[name] = (
                actor,
                "data-server",
                table,
                actor.run.remote(table, self.job.path),
            )
            self._event("placed", role="data-server", name=name, url=urls[name], node=node)
        table = self.job.coordinator_table(urls, cip, cport)
        run = self.coordinator.run.remote(table, self.job.path)
        self._static["coordinator"] = (self.coordinator, "coordinator", table, run)

    def _teardown(self) -> None:
        try:
            import ray
            from ray.util.placement_group import remove_placement_group
        except ImportError:  # _start refused already
            return
        if not ray.is_initialized():
            return
        actors = [w.actor for w in self.workers.values()]
        actors += [a for a, _, _, _ in self._static.values()]
        for actor in actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone: nothing to stop
                pass
        if self._pg is not None:
            remove_placement_group(self._pg)
        if self._owns_ray:
            ray.shutdown()

    # -- one supervision step (in a thread) --------------------------------------------------
    def _step(self) -> dict[str, Any] | None:
        """Watch the static roles (the coordinator's summary ends the run), then the workers,
        then apply `decide` once."""
        import ray

        for name, (actor, role, table, ref) in list(self._static.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                result = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._come_back(name, actor, role, table, exc)
                continue
            except ray.exceptions.RayTaskError as exc:
                raise ElasticError(f"{name} failed: {exc.cause!r}") from exc.cause
            if role == "coordinator":
                return result
            self._static[name] = (actor, role, table, ray.put(None))  # ended: nothing to watch
        self._watch_workers()
        live = sum(w.state == "live" for w in self.workers.values())
        available = ray.available_resources()
        if self._settling is not None:
            cpus, deadline = self._settling
            if available.get("CPU", 0.0) <= cpus and time.monotonic() < deadline:
                return None  # the stopped worker's claim is not visible yet
            self._settling = None
        step = decide(available, live, len(self.workers) - live, self.job.ray)
        if step > 0:
            self._add_worker()
        elif step < 0:
            self._stop_worker()
            self._settling = (available.get("CPU", 0.0), time.monotonic() + SETTLE_S)
        return None

    def _come_back(self, name: str, actor: Any, role: str, table: dict, exc: Exception) -> None:
        """Wait for Ray to restart a static role's actor, then run the role in it again at the
        address it had."""
        import ray

        deadline = time.monotonic() + COME_BACK_S
        while True:  # calls fail fast (ActorUnavailableError) while Ray restarts the actor
            try:
                ray.get(actor.place.remote(), timeout=max(0.1, deadline - time.monotonic()))
                break
            except ray.exceptions.ActorUnavailableError as again:
                if time.monotonic() > deadline:
                    raise self._not_back(name, role, exc, again) from again
                time.sleep(0.2)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as again:
                raise self._not_back(name, role, exc, again) from again
        self._static[name] = (actor, role, table, actor.run.remote(table, self.job.path))
        self._event("restarted", role=role, name=name)

    @staticmethod
    def _not_back(name: str, role: str, exc: Exception, again: Exception) -> ElasticError:
        return ElasticError(
            f"the {role} {name!r} died ({exc.__class__.__name__}) and Ray did not restart it "
            f"within {COME_BACK_S:g} s ({again.__class__.__name__}); raise [ray] restarts or "
            "check the node it was placed on"
        )

    def _watch_workers(self) -> None:
        import ray

        for name, w in list(self.workers.items()):
            if not ray.wait([w.ref], timeout=0)[0]:
                continue
            try:
                result = ray.get(w.ref)
            except ray.exceptions.RayActorError as exc:
                del self.workers[name]
                if isinstance(exc, ray.exceptions.ActorDiedError):
                    self._gone(name)  # max_restarts=0: dead for good, never a false positive
                self._event("worker_lost", name=name, node=w.node)
                continue
            except ray.exceptions.RayTaskError as exc:
                del self.workers[name]
                ray.kill(w.actor, no_restart=True)
                self._event("worker_failed", name=name, error=repr(exc.cause))
                if self.counts["worker_failed"] > 2 * self.job.ray.max_workers:
                    raise ElasticError(
                        f"{self.counts['worker_failed']} workers failed, the last {name!r} with "
                        f"{exc.cause!r}; fix the [worker] table or the coordinator's address"
                    ) from exc.cause
                continue
            if w.state == "starting":
                _, _, w.node = result
                w.state, w.ref = "live", w.run
                self._event("worker_live", name=name, node=w.node)
            else:
                del self.workers[name]
                ray.kill(w.actor, no_restart=True)
                self._event("worker_done", name=name, batches=result.get("batches", 0))

    def _add_worker(self) -> None:
        cfg = self.job.ray
        name = f"w{self._next}"
        self._next += 1
        actor = self._remote.options(
            num_cpus=cfg.worker_cpus,
            num_gpus=cfg.worker_gpus,
            memory=cfg.worker_memory,
            resources=cfg.worker_resources or None,
            max_restarts=0,
            scheduling_strategy="SPREAD",
            runtime_env=self._env,
        ).remote("worker", cfg.compile_cache_folder)
        table = self.job.worker_table(name, self.coordinator_url, "127.0.0.1")  # run: its IP
        place = actor.place.remote()
        self.workers[name] = LaunchedWorker(
            name, actor, place, actor.run.remote(table, self.job.path)
        )
        self._event("worker_added", name=name)

    def _stop_worker(self) -> None:
        import ray

        name = max((w for w in self.workers.values() if w.state == "live"), key=_order).name
        w = self.workers.pop(name)
        ray.kill(w.actor, no_restart=True)
        self._gone(name)
        self._event("worker_stopped", name=name, node=w.node)

    def _gone(self, name: str) -> None:
        """Tell the coordinator that worker ``name`` is dead for good: it leaves at the next
        detection instead of after ``timeout`` of silence. Fire and forget: a coordinator that
        is restarting misses it and silence removes the worker as before."""
        self.coordinator.gone.remote([name])


def _order(w: LaunchedWorker) -> int:
    return int(w.name[1:])


async def launch(
    config: str | Job,
    *,
    address: str | None = None,
    on_event: Callable[[tuple[float, str, dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """Run the job file ``config`` (a path, fsspec URL or `Job`) on the Ray cluster at
    ``address`` (default: ``[ray] address``; None: the one ``ray.init`` finds, or a local
    one); returns the coordinator's summary with the supervisor's counts under ``ray``.
    Must be awaited in the caller's loop; Ray's blocking calls run in threads."""
    from .job import read_job

    job = config if isinstance(config, Job) else await asyncio.to_thread(read_job, config)
    return await RayLaunch(job, address=address, on_event=on_event).run()
