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
  with 2 slots added): ``lost_batches`` / ``duplicated_batches`` over every epoch's committed
  record (both must be 0); ``scale_up_s``: from ``add_node`` returning to the first batch a
  worker placed on the new node reports done (its batch count leaves 0; target <= 10 s);
  ``node_loss_recover_heartbeats``: from ``remove_node`` returning to the coordinator's
  ``removed`` event for the lost workers, in detection intervals T (``interval_s``; target
  <= 3); ``final_loss`` beside ``reference_loss`` (the same job undisturbed, in one process).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from tandem.parties.elastic.spec import ModelSpec, make_dataset, save_shard  # noqa: E402

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)
ROWS = 256
EPOCHS = 4
INTERVAL = 0.3
SECRET_ENV = "TANDEM_BENCH_RAY_SECRET"


def write_job(
    folder: Path,
    *,
    secret_env: str = SECRET_ENV,
    slot: bool = True,
    rows: int = ROWS,
    epochs: int = EPOCHS,
    max_workers: int = 3,
) -> Path:
    """Write two shards, the model description and ``job.toml`` into ``folder``; return the
    job's path. ``slot``: each worker claims one ``slot`` resource (and no CPU), so the nodes
    holding slots decide where workers go."""
    folder = Path(folder)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    (folder / "data" / "model.json").write_text(json.dumps(SPEC.to_dict()))
    for i, shard in enumerate(make_dataset(2, rows, SPEC, seed=1)):
        save_shard(shard, str(folder / "data" / f"shard{i}.npz"))
    worker = "worker_cpus = 0.0\nworker_resources = { slot = 1.0 }" if slot else "worker_cpus = 1.0"
    servers = "\n".join(
        f'[data_servers.ds{i}]\nmodel = "{folder}/data/model.json"\n'
        f'shard = "{folder}/data/shard{i}.npz"\ncoordinator_wait = 120.0\n'
        for i in range(2)
    )
    text = f"""# tandem elastic launch --config job.toml --ray auto
[ray]
min_workers = 1
max_workers = {max_workers}
{worker}
data_server_cpus = 0.5
data_server_resources = {{ data = 1.0 }}
coordinator_cpus = 0.5
poll = 0.2
storage = "file://{folder}/storage"

[security]
secret_env = "{secret_env}"

[coordinator]
interval = {INTERVAL}
epochs = {epochs}
on_change = "rollback"
recover_timeout = 120.0

[worker]
heartbeat = 0.1
join_timeout = 120.0

{servers}"""
    path = folder / "job.toml"
    path.write_text(text)
    return path


def all_ids(folder: Path, rows: int = ROWS) -> list[int]:
    """Every batch id of one epoch of `write_job`'s shards (data server i's batch b: i<<20 | b)."""
    per = rows // SPEC.batch_size
    return sorted(i * (1 << 20) + b for i in range(2) for b in range(per))


def reference_loss(folder: Path, rows: int = ROWS, epochs: int = EPOCHS) -> float:
    """The final loss of the same job undisturbed, in one process (`LocalCluster`)."""
    from tandem.parties.elastic.local import LocalCluster

    cluster = LocalCluster(
        SPEC, make_dataset(2, rows, SPEC, seed=1), interval=INTERVAL, epochs=epochs, workers=2
    )
    summary = asyncio.run(cluster.run())
    return float(summary["history"][-1]["loss"])


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
