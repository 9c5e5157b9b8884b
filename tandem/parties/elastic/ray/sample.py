"""A small elastic job to try a Ray cluster with: two synthetic shards, the model description and
a ``job.toml`` for ``tandem elastic launch --config job.toml --ray auto`` (`write_job`), the
batch ids every epoch must commit (`all_ids`), and the final loss of the same job undisturbed
in one process (`reference_loss`), to compare a run on the cluster with.

The job is tiny on purpose (an 8-16-3 MLP, 2 x 256 rows, 4 epochs by default): it tests the
placement, scaling and recovery of a cluster, not its speed.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tandem.parties.elastic.spec import ModelSpec, make_dataset, save_shard

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)
ROWS = 256
EPOCHS = 4
INTERVAL = 0.3


def write_job(
    folder: Path,
    *,
    secret_env: str,
    slot: bool = True,
    rows: int = ROWS,
    epochs: int = EPOCHS,
    max_workers: int = 3,
    reserve_cpus: float = 0.0,
) -> Path:
    """Write two shards, the model description and ``job.toml`` into ``folder``; return the
    job's path. ``secret_env``: the environment variable holding the shared secret (set it
    where every node inherits it). ``slot``: each worker claims one ``slot`` resource (and no
    CPU), so the nodes holding slots decide where workers go; ``reserve_cpus``: `[ray]
    reserve_cpus`."""
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
reserve_cpus = {reserve_cpus}
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
