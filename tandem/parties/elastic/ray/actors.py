"""The one Ray actor class every role runs in: `RoleActor`, made remote by `launch`.

An actor is one process on one node. `place` reports the node's IP and a free port there (the
static roles keep that port across restarts of their actor, so their peers find them again at
the same address); `run` runs the role's async main (`roles.run_role`) on the loop Ray gives
the actor, listening on the node's IP, and returns its plain result; `status` reports progress
(the coordinator: its `Progress` and events; a worker: its batch count) and the moments the
actor's start went through (``stamps``, `time.monotonic` of this node: ``process`` when the
actor was built, ``run`` when its role was asked for, ``built`` once its modules were imported
and it listened, and for a worker the first batch's ``received``, ``computed``, ``pushed`` and
``acked``). `gone` tells the coordinator that workers died (Ray saw their actors die), so it
removes them at its next detection instead of waiting for their heartbeats' silence. Only
plain data (the role's table, the job file's path) crosses Ray; Tandem's own protocol carries
no pickle.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any

from .roles import run_role

#: coordinator events `status` reports (the others are internal detail).
EVENTS = ("live", "commit", "removed", "joined", "rollback", "kept", "epoch", "recover", "resumed")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (bound and released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RoleActor:
    """One elastic role in a Ray actor process. ``role``: ``coordinator``, ``data-server`` or
    ``worker``. Invariant: `run` is called at most once per actor incarnation."""

    def __init__(self, role: str, compile_cache: str | None = None) -> None:
        self.stamps: dict[str, float] = {"process": time.monotonic()}
        self.role = role
        self._obj: Any = None
        if compile_cache is not None and role == "worker":
            from tandem.parties.compile_cache import enable_compile_cache

            enable_compile_cache(compile_cache)  # before the worker's first compilation

    def place(self) -> tuple[str, int, str]:
        """(the node's IP, a free port on it, the Ray node id)."""
        import ray

        ip = ray.util.get_node_ip_address()
        return ip, free_port(ip), ray.get_runtime_context().get_node_id()

    async def run(self, table: dict[str, Any], path: str) -> dict[str, Any]:
        """Run the role from ``table`` (its ``host`` replaced by this node's IP) to its end."""
        import ray

        self.stamps["run"] = time.monotonic()
        table = {**table, "host": ray.util.get_node_ip_address()}
        return await run_role(self.role, table, path, watch=self._watch, probe=self._probe)

    def _watch(self, obj: Any) -> None:
        self.stamps["built"] = time.monotonic()
        self._obj = obj

    def _probe(self, point: str, batch: int) -> None:
        self.stamps.setdefault(point, time.monotonic())

    def stop(self) -> bool:
        """The coordinator's side: finish after its next detection, even mid-epoch (its summary
        covers the epochs closed so far). False when it is not running yet."""
        if self.role != "coordinator" or self._obj is None:
            return False
        self._obj.request_stop()
        return True

    def gone(self, workers: list[str]) -> bool:
        """The coordinator's side: ``workers`` died for good (their actors are dead and never
        restart); they leave at the next detection, whatever their last heartbeat. False when
        the coordinator is not running yet (then silence removes them as usual)."""
        if self.role != "coordinator" or self._obj is None:
            return False
        for name in workers:
            self._obj.membership.ban(name)
        return True

    def status(self, since: int = 0) -> dict[str, Any]:
        """Progress so far: ``{"started": bool}`` plus, for the coordinator, ``progress`` and
        the `EVENTS` from index ``since`` on (``events_end``: the index to ask from next), and
        for a worker, ``batches``."""
        obj = self._obj
        out: dict[str, Any] = {"started": obj is not None, "stamps": dict(self.stamps)}
        if obj is None:
            return out
        if self.role == "coordinator":
            events = list(obj.events)
            out["progress"] = dataclasses.asdict(obj.progress)
            out["events"] = [e for e in events[since:] if e[1] in EVENTS]
            out["events_end"] = len(events)
        elif self.role == "worker":
            out["batches"] = obj.done
        return out
