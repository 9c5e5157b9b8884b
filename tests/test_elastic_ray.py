"""Elastic training on a real multi-node Ray cluster on this machine (``tandem[ray]``).

A `ray.cluster_utils.Cluster`: a head node (the coordinator and both data servers, through a
``data`` resource only it has) and worker nodes holding ``slot`` resources, so the test decides
which node holds workers. One run sees a node holding workers removed mid-epoch, a node added,
a worker stopped because the cluster needs its room back (``reserve_cpus``; the coordinator
removes it at once, told by the supervisor), and the coordinator's actor killed (Ray restarts
it; it resumes from the journal on the shared storage). Every batch of every epoch must be
committed exactly once, and the final loss stay within noise of an undisturbed run of the same
job (the in-process `LocalCluster`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.parties.elastic.errors import ConfigError

ray = pytest.importorskip("ray")

from tandem.parties.elastic.ray import Job, RayLaunch, RaySection, decide, read_job  # noqa: E402
from tandem.parties.elastic.ray.sample import EPOCHS, all_ids, reference_loss, write_job  # noqa: E402

pytestmark = [
    # Ray starts nodes with fork+exec; JAX (the in-process reference run) warns on any fork
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
]
SECRET_ENV = "TANDEM_RAY_TEST_SECRET"
log = logging.getLogger(__name__)
#: more than the cluster test's disturbances take, however loaded the machine (it stops the run
#: once they are done, so it never depends on how fast training goes)
DISTURBED_EPOCHS = 1000


# -- the job file and the scaling rule (no cluster) ----------------------------------------
def _ray(**kw) -> RaySection:
    return RaySection(storage="file:///tmp/x", **kw)


def test_the_scaling_rule_adds_while_there_is_room_and_gives_room_back():
    cfg = _ray(min_workers=1, max_workers=3, worker_cpus=1, reserve_cpus=1)
    assert decide({}, 0, 0, cfg) == 1  # below min_workers: ask even without room
    assert decide({"CPU": 5}, 1, 1, cfg) == 0  # one still starting: wait for its claim
    assert decide({"CPU": 2}, 1, 0, cfg) == 1  # room for one beyond the reserve
    assert decide({"CPU": 1.5}, 1, 0, cfg) == 0  # not beyond the reserve
    assert decide({"CPU": 5}, 3, 0, cfg) == 0  # at max_workers
    assert decide({"CPU": 0.5}, 2, 0, cfg) == -1  # someone needs the room back
    assert decide({"CPU": 0.5}, 1, 0, cfg) == 0  # never below min_workers
    slot = _ray(max_workers=3, worker_cpus=0, worker_resources={"slot": 1}, reserve_cpus=1)
    assert decide({"CPU": 0.5, "slot": 2}, 1, 0, slot) == 0  # short of CPUs: never add
    assert decide({"CPU": 1, "slot": 2}, 1, 0, slot) == 1
    gpu = _ray(min_workers=1, max_workers=3, worker_gpus=1)
    assert decide({"CPU": 8}, 1, 0, gpu) == 0 and decide({"CPU": 8, "GPU": 1}, 1, 0, gpu) == 1


def test_a_job_file_names_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    path = write_job(tmp_path, secret_env=SECRET_ENV)
    job = read_job(str(path))
    assert job.data_server_names == ["ds0", "ds1"]
    table = job.worker_table("w7", "http://10.0.0.1:9", "10.0.0.2")
    assert table["coordinator"] == "http://10.0.0.1:9" and "s3cret" not in str(table)
    text = path.read_text()
    with pytest.raises(ConfigError, match=r"coordinator.journal.*launch places itself"):
        Job(text.replace("[coordinator]\n", '[coordinator]\njournal = "j"\n'), str(path))
    with pytest.raises(ConfigError, match=r"min_workers.*above max_workers"):
        Job(text.replace("min_workers = 1", "min_workers = 9"), str(path))
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/env/cache")  # the environment wins
    assert job.ray.compile_cache_folder == "/env/cache"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert job.ray.compile_cache_folder == job.ray.storage_path + "/compile-cache"
    assert _ray(compile_cache=False).compile_cache_folder is None
    assert _ray(compile_cache="/cache").compile_cache_folder == "/cache"
    with pytest.raises(ConfigError, match=r"compile_cache.*is empty"):
        Job(text.replace("poll = 0.2", 'poll = 0.2\ncompile_cache = ""'), str(path))
    with pytest.raises(ConfigError, match=r"storage.*file:// URL"):
        Job(text.replace('storage = "', 'storage = "s3://b/'), str(path))
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match=SECRET_ENV):
        read_job(str(path))


# -- on a cluster ----------------------------------------------------------------------------
@pytest.fixture
def cluster(monkeypatch):
    """A head node (2 CPUs, ``data``) and one node with 2 worker slots; shut down after."""
    from ray.cluster_utils import Cluster

    monkeypatch.setenv(SECRET_ENV, "s3cret-for-the-test")  # the nodes inherit it
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"data": 2}})
    try:
        c.add_node(num_cpus=1, resources={"slot": 2})
        ray.init(address=c.address, log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()


async def _until(check, what: str, limit: float = 120.0, explain=None):
    """Poll ``check`` until it returns something true; past ``limit`` seconds fail, with what
    ``explain()`` (if given) says about the run appended to the message."""
    start = time.monotonic()
    deadline = start + limit
    while time.monotonic() < deadline:
        got = await check()
        if got:
            log.info("%s after %.1f s", what, time.monotonic() - start)  # shown on a failure
            return got
        await asyncio.sleep(0.1)
    detail = f"\n{await explain()}" if explain is not None else ""
    raise AssertionError(f"timed out waiting for {what} ({limit:g} s){detail}")


def _mark(progress: dict) -> tuple[int, int]:
    """How far a run's committed batches are: (epoch, batches committed in it). It never goes
    back (a rollback or a restart keeps what was committed), so a later mark above an earlier
    one means new commits."""
    return int(progress["epoch"]), int(progress["committed"])


@pytest.mark.slow
@pytest.mark.timeout(240)  # a cluster of 3 nodes on 2 shared cores: slow when the suite is
def test_node_loss_node_join_room_back_and_coordinator_kill_keep_every_batch_exactly_once(
    cluster, tmp_path
):
    from ray.util.placement_group import placement_group

    path = write_job(tmp_path, secret_env=SECRET_ENV, epochs=DISTURBED_EPOCHS, reserve_cpus=1.0)
    job = read_job(str(path))
    seen: dict[str, object] = {}

    async def script(run: RayLaunch) -> None:
        last: dict[str, object] = {}  # the coordinator's last status that came back

        async def status() -> dict:
            s = await run.coordinator_status()
            last.clear()
            last.update(s, received=time.monotonic())
            return s

        async def explain() -> str:
            """What a timed-out wait shows: the supervisor's events, and the coordinator's
            status now (or the last one that came back, if it does not answer in 5 s)."""
            try:
                ref = run.coordinator.status.remote()
                now = await asyncio.to_thread(ray.get, ref, timeout=5)
            except Exception as exc:  # restarting, dead or slow: say so, show the last one
                now = {"error": repr(exc)}
            t0 = run.events[0][0] if run.events else 0.0
            lines = [f"seen by the test: {seen}", "supervisor events (s from the first):"]
            lines += [f"  {t - t0:8.2f} {kind} {detail}" for t, kind, detail in run.events]
            for name, s in (("now", now), ("last that came back", last)):
                s = dict(s)
                events = s.pop("events", [])
                lines.append(f"coordinator status, {name}: {s}")
                lines += [f"  {t:10.2f} {kind} {detail}" for t, kind, detail in events[-60:]]
            return "\n".join(lines)

        async def until(check, what: str):
            return await _until(check, what, explain=explain)

        def committed_since(mark: tuple[int, int]):
            """A check: commits beyond ``mark`` (`_mark`) were made."""

            async def check() -> bool:
                p = (await status()).get("progress")
                return p is not None and _mark(p) > mark

            return check

        async def mark_now() -> tuple[int, int]:
            return _mark((await status())["progress"])

        await until(committed_since((0, 2)), "the first commits")
        first = cluster.list_all_nodes()[1]
        # the first worker may commit before the second has started: wait for both
        await until(lambda: asyncio.sleep(0, len(run.live_workers()) == 2), "both workers")
        cluster.remove_node(first)  # both workers' node, mid-epoch (Ray: in the main thread)
        seen["removed_at"] = (await status())["progress"]
        await until(lambda: asyncio.sleep(0, run.counts["worker_lost"] >= 2), "the lost workers")
        node = cluster.add_node(num_cpus=1, resources={"slot": 2})

        async def on_new_node():
            return any(n == node.node_id for n in run.live_workers().values())

        await until(on_new_node, "a worker on the added node")
        await until(committed_since(await mark_now()), "commits after the join")

        async def both_live():
            return (await status())["progress"]["live"] == 2

        await until(both_live, "both new workers training")
        # someone else needs the room back: 1 of the 1.5 free CPUs (reserve_cpus = 1)
        hog = placement_group([{"CPU": 1.0}])
        await asyncio.to_thread(ray.get, hog.ready(), timeout=60)
        await until(lambda: asyncio.sleep(0, run.counts["worker_stopped"]), "a worker stopped")
        (stopped,) = [d["name"] for _, k, d in run.events if k == "worker_stopped"]

        async def coordinator_removed():
            s = await status()
            return any(k == "removed" and stopped in names for _, k, names in s["events"])

        await until(coordinator_removed, "the coordinator removing the stopped worker")
        await until(committed_since(await mark_now()), "commits after the removal")
        seen["kill_at"] = (await status())["progress"]
        at = seen["kill_at"]["epoch"]
        await asyncio.to_thread(ray.kill, run.coordinator, no_restart=False)
        seen["killed"] = True

        async def resumed_and_past():
            try:
                s = await status()
            except ray.exceptions.RayActorError:  # still restarting
                return False
            p = s.get("progress")
            return p is not None and p["epoch"] >= max(at + 1, EPOCHS)

        await until(resumed_and_past, "epochs closed by the restarted coordinator")
        await until(run.stop, "the coordinator taking the stop")

    summary = asyncio.run(RayLaunch(job).run(script))
    assert seen.get("killed"), "training ended before every disturbance happened"
    assert EPOCHS <= summary["epochs"] < DISTURBED_EPOCHS  # stopped once all was done
    ids = all_ids(tmp_path)
    for epoch in summary["history"]:
        assert sorted(epoch["committed"]) == ids  # exactly once, whatever happened
    assert summary["resumed"] is not None  # the restarted coordinator read its journal
    assert summary["ray"]["worker_lost"] >= 2 and summary["ray"]["restarted"] >= 1
    assert summary["ray"]["worker_stopped"] == 1
    final = summary["history"][-1]["loss"]
    reference = reference_loss(tmp_path, epochs=summary["epochs"])
    assert final < 0.5 * summary["initial_loss"]
    assert abs(final - reference) < 0.5 * reference + 0.05, (final, reference)
    assert os.path.exists(job.ray.storage_path + "/journal.jsonl")


def _tandem(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem", "elastic", "launch", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_launch_refuses_a_job_without_the_shared_secret_and_says_which(tmp_path):
    path = write_job(tmp_path, secret_env="TANDEM_RAY_TEST_UNSET")
    out = _tandem("--config", str(path), env={})
    assert out.returncode == 2 and out.stdout == ""
    assert "TANDEM_RAY_TEST_UNSET" in out.stderr


@pytest.mark.slow
def test_the_launch_command_prints_one_result_line_on_stdout(cluster, tmp_path):
    path = write_job(tmp_path, secret_env=SECRET_ENV, epochs=2, max_workers=2)
    out = _tandem("--config", str(path), "--ray", cluster.address, env={})
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = out.stdout.splitlines()
    result = json.loads(line)
    assert result["epochs"] == 2 and result["final_loss"] < result["initial_loss"]
    # a two-epoch job may end before the second worker's process is up: at least one went
    # live, never more than max_workers, and the supervisor's events reach stderr
    assert 1 <= result["ray"]["worker_live"] <= 2 and "ray: worker_live" in out.stderr


def test_the_example_job_file_checks(monkeypatch):
    monkeypatch.setenv("TANDEM_SECRET", "s3cret")
    job = read_job(
        str(Path(__file__).resolve().parents[1] / "examples" / "ray" / "job.toml.example")
    )
    assert job.data_server_names == ["ds0", "ds1"] and job.ray.storage_path.startswith("/mnt")
