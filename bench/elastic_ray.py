"""Elastic training on a local multi-node Ray cluster: ``python -m bench.elastic_ray --json``
prints ONE JSON line.

A `ray.cluster_utils.Cluster` on this machine: a head node holding the coordinator and the
data servers (a ``data`` resource only it has) and worker nodes with ``slot`` resources (one
worker each), launched by `tandem.parties.elastic.ray.RayLaunch` from a job file written here.

Reported:

* ``throughput_1`` / ``throughput_4``: committed batches per second, from the first commit to
  the end of the run, with ``max_workers`` 1 and 4 (4 slots on 2 nodes);
  ``speedup_4_vs_1`` is their ratio (2 shared cores cap it well below 4 on a small machine).
* a disturbed run (2 worker slots on one node, then that node removed mid-epoch, then a node
  with 2 slots added; stopped once ``--disturbed-epochs`` and two epochs after the new worker's
  first batch have closed, so it never ends before its disturbances): ``epochs`` closed,
  ``lost_batches`` / ``duplicated_batches`` over every closed epoch's committed record (both
  must be 0); ``scale_up_s``: from ``add_node`` returning to the first batch a
  worker placed on the new node reports done (its batch count leaves 0; target <= 10 s);
  ``scale_up_breakdown_s``: seconds from ``add_node`` returning to each step of that worker's
  start, in order: ``scheduled`` (the supervisor asked Ray for it; negative when it was
  already queued for want of a node), ``process`` (its actor process built), ``placed`` (the
  supervisor learnt its node), ``run`` / ``built`` (its role asked for / imported and
  listening), ``joined`` (the coordinator's detection took it in), ``batch_received``,
  ``batch_computed`` (the kernels compiled or loaded from the compile cache), ``batch_acked``,
  ``seen_done`` (the benchmark saw it);
  ``node_loss_recover_heartbeats``: from ``remove_node`` returning to the coordinator's
  ``removed`` event for the lost workers, in detection intervals T (``interval_s``; target
  <= 3); ``node_loss_ray_notified_s``: from ``remove_node`` returning to the supervisor seeing
  the first worker actor dead; ``final_loss`` beside ``reference_loss`` (the same job
  undisturbed, in one process).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tandem.parties.elastic.ray.sample import (  # noqa: E402
    INTERVAL,
    SPEC,
    all_ids,
    reference_loss,
    write_job,
)

SECRET_ENV = "TANDEM_BENCH_RAY_SECRET"


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Cluster:
    """A local multi-node Ray cluster: the head holds ``data`` (coordinator, data servers);
    each `add` is a node with worker ``slot`` s. Shut down (and Ray with it) on exit."""

    def __enter__(self) -> _Cluster:
        import ray
        from ray.cluster_utils import Cluster

        self.ray = ray
        self.c = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"data": 2}}
        )
        ray.init(address=self.c.address, log_to_driver=False)
        return self

    def add(self, slots: int) -> Any:
        return self.c.add_node(num_cpus=1, resources={"slot": slots})

    def __exit__(self, *exc: object) -> None:
        self.ray.shutdown()
        self.c.shutdown()


async def _watch(run: Any, seen: dict[str, Any]) -> None:
    """Poll the coordinator: the first time anything is committed, and every event."""
    since = 0
    while True:
        try:
            s = await run.coordinator_status(since)
        except Exception:  # restarting or gone; the run itself reports real failures
            await asyncio.sleep(0.1)
            continue
        p = s.get("progress")
        if p is not None:
            seen["events"].extend(s["events"])
            since = s["events_end"]
            seen["progress"] = p
            if "t0" not in seen and (p["epoch"] > 0 or p["committed"] > 0):
                seen["t0"], seen["at_t0"] = time.monotonic(), p
        await asyncio.sleep(0.1)


def _throughput(folder: Path, workers: int, rows: int, epochs: int) -> float:
    from tandem.parties.elastic.ray import RayLaunch, read_job

    job = read_job(
        str(write_job(folder, secret_env=SECRET_ENV, rows=rows, epochs=epochs, max_workers=workers))
    )
    seen: dict[str, Any] = {"events": []}
    with _Cluster() as cl:
        for _ in range(2):
            cl.add(2)
        summary = asyncio.run(RayLaunch(job).run(lambda r: _watch(r, seen)))
    t1 = time.monotonic()
    per = 2 * (rows // SPEC.batch_size)
    at = seen["at_t0"]
    done = per * summary["epochs"] - (at["epoch"] * per + at["committed"])
    return done / (t1 - seen["t0"])


async def _disturb(run: Any, cl: _Cluster, first: Any, seen: dict[str, Any]) -> None:
    watcher = asyncio.create_task(_watch(run, seen))
    try:
        while "t0" not in seen or len(run.live_workers()) < 2:
            await asyncio.sleep(0.1)
        cl.c.remove_node(first)
        seen["removed"] = time.monotonic()
        lost = set(run.live_workers())
        while run.counts["worker_lost"] < len(lost):
            await asyncio.sleep(0.1)
        seen["lost_names"] = lost
        seen["added_before"] = run.counts["worker_added"]
        node = cl.add(2)
        seen["added"] = time.monotonic()
        while "scaled" not in seen:
            for name, where in run.live_workers().items():
                status = await run.worker_status(name)
                if where == node.node_id and status.get("batches"):
                    seen["scaled"], seen["new_worker"] = time.monotonic(), (name, status)
            await asyncio.sleep(0.1)
        # a few more epochs, then stop: the run never ends before the disturbances are done
        start = seen["progress"]["epoch"]
        while seen["progress"]["epoch"] < max(seen["epochs"], start + 2):
            await asyncio.sleep(0.1)
        while not await run.stop():
            await asyncio.sleep(0.1)
        await asyncio.Event().wait()  # until training ends (cancelled then)
    finally:
        watcher.cancel()


def _breakdown(run: Any, seen: dict[str, Any]) -> dict[str, float] | None:
    """Where ``scale_up_s`` went: seconds from the node's addition to each step of its first
    worker's start (one machine: every node's `time.monotonic` is the same clock)."""
    if "new_worker" not in seen:
        return None
    name, status = seen["new_worker"]
    at: dict[str, float] = {}
    for t, kind, detail in run.events:
        if detail.get("name") == name and kind in ("worker_added", "worker_live"):
            at.setdefault({"worker_added": "scheduled", "worker_live": "placed"}[kind], t)
    stamps = status["stamps"]
    at |= {k: stamps[k] for k in ("process", "run", "built") if k in stamps}
    joined = [t for t, kind, names in seen["events"] if kind == "joined" and name in names]
    if joined:
        at["joined"] = joined[0]
    at |= {f"batch_{k}": stamps[k] for k in ("received", "computed", "acked") if k in stamps}
    at["seen_done"] = seen["scaled"]
    return {k: round(t - seen["added"], 2) for k, t in sorted(at.items(), key=lambda kv: kv[1])}


def _disturbed(folder: Path, epochs: int) -> dict[str, Any]:
    from tandem.parties.elastic.ray import RayLaunch, read_job

    job = read_job(str(write_job(folder, secret_env=SECRET_ENV, epochs=1000, max_workers=2)))
    seen: dict[str, Any] = {"events": [], "epochs": epochs}
    with _Cluster() as cl:
        first = cl.add(2)
        run = RayLaunch(job)
        summary = asyncio.run(run.run(lambda r: _disturb(r, cl, first, seen)))
    ids = all_ids(folder)
    lost = dup = 0
    for epoch in summary["history"]:
        got = epoch["committed"]
        lost += len(set(ids) - set(got))
        dup += len(got) - len(set(got))
    removed = [
        t
        for t, kind, names in seen["events"]
        if kind == "removed" and set(names) & seen.get("lost_names", set())
    ]
    recover = (removed[0] - seen["removed"]) / INTERVAL if removed and "removed" in seen else None
    ray_saw = [t for t, kind, d in run.events if kind == "worker_lost"]
    return {
        "epochs": summary["epochs"],
        "lost_batches": lost,
        "duplicated_batches": dup,
        "scale_up_s": round(seen["scaled"] - seen["added"], 2) if "scaled" in seen else None,
        "scale_up_breakdown_s": _breakdown(run, seen),
        "node_loss_recover_heartbeats": round(recover, 2) if recover is not None else None,
        "node_loss_ray_notified_s": round(ray_saw[0] - seen["removed"], 2) if ray_saw else None,
        "final_loss": round(summary["history"][-1]["loss"], 4),
        "workers": summary["ray"],
    }


def cli() -> int:
    import tempfile

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--rows", type=int, default=1024, help="rows per shard (throughput runs)")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the throughput runs")
    p.add_argument(
        "--disturbed-epochs", type=int, default=8, help="epochs at least (stopped after)"
    )
    args = p.parse_args()
    os.environ.setdefault(SECRET_ENV, os.urandom(16).hex())  # the nodes inherit it
    result: dict[str, Any] = {"interval_s": INTERVAL}
    with tempfile.TemporaryDirectory() as tmp:
        _say("disturbed run: node removed, node added")
        result.update(_disturbed(Path(tmp) / "disturbed", args.disturbed_epochs))
        result["reference_loss"] = round(
            reference_loss(Path(tmp) / "disturbed", epochs=result["epochs"]), 4
        )
        for n in (1, 4):
            _say(f"throughput with {n} worker(s)")
            result[f"throughput_{n}"] = round(
                _throughput(Path(tmp) / f"t{n}", n, args.rows, args.epochs), 2
            )
    result["speedup_4_vs_1"] = round(result["throughput_4"] / result["throughput_1"], 2)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
