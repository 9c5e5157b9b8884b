"""Elastic training across processes over HTTP: ``kill -9`` a worker mid-training.

Six processes: two data servers, three workers, a coordinator. The coordinator's roster lists
w0 and w1; w2 is on no list and is started only after the kill: it joins by signing its
heartbeats with the shared secret (the coordinator asks for ``admit_workers``: with a roster,
admission of authenticated unknown senders is off unless asked for), which it reads from a
file (``[security] secret_file``), as ds1 reads it from the environment (``secret_env``) and
the others take it inline (``secret``).
Its process is launched at the outset but holds at a gate (its imports done) until the kill:
on a loaded 2-core machine importing JAX can take longer than the rest of the training, and a
worker that starts after its coordinator finished is never welcomed. The run must finish with
every batch of every epoch committed exactly once, the killed worker removed, and the
surviving workers never restarted (they exit 0 on stop).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ports import free_ports
from tandem.parties.elastic.spec import ModelSpec, make_dataset, save_shard

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)
EPOCHS = 5
GATED = (
    "import sys\n"
    "import jax, tandem.parties.cli, tandem.parties.elastic.cli, tandem.parties.elastic.worker, "
    "tandem.transports.http\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    "sys.exit(tandem.parties.cli.main(sys.argv[1:]))\n"
)


def _toml(path, **entries) -> str:
    lines = []
    tables = {k: v for k, v in entries.items() if isinstance(v, dict)}
    for k, v in entries.items():
        if not isinstance(v, dict):
            lines.append(f"{k} = {json.dumps(v)}")
    for k, v in tables.items():
        lines.append(f"[{k}]")
        lines += [f"{name} = {json.dumps(url)}" for name, url in v.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.mark.slow
def test_kill_dash_nine_a_worker_over_http(tmp_path):
    shards = make_dataset(2, 256, SPEC, seed=3)
    (tmp_path / "model.json").write_text(json.dumps(SPEC.to_dict()))
    for i, shard in enumerate(shards):
        save_shard(shard, str(tmp_path / f"shard{i}.npz"))
    pc, p0, p1, pw0, pw1, pw2 = free_ports(6)
    url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
    secret = "test-secret"
    common = dict(host="127.0.0.1", secret=secret, coordinator=url(pc))
    (tmp_path / "secret").write_text(secret + "\n")
    where = dict(host="127.0.0.1", coordinator=url(pc))
    by_env = dict(where, security={"secret_env": "TANDEM_TEST_ELASTIC_SECRET"})
    by_file = dict(where, security={"secret_file": "secret"})  # relative to the file
    cfg = {
        "ds0": _toml(
            tmp_path / "ds0.toml",
            name="ds0",
            port=p0,
            model=str(tmp_path / "model.json"),
            shard=str(tmp_path / "shard0.npz"),
            **common,
        ),
        "ds1": _toml(
            tmp_path / "ds1.toml",
            name="ds1",
            port=p1,
            model=f"file://{tmp_path}/model.json",
            shard=f"file://{tmp_path}/shard1.npz",
            **by_env,  # the shared [security] section: the secret from the environment
        ),
        "w0": _toml(tmp_path / "w0.toml", name="w0", port=pw0, heartbeat=0.1, **common),
        "w1": _toml(tmp_path / "w1.toml", name="w1", port=pw1, heartbeat=0.1, **common),
        "w2": _toml(tmp_path / "w2.toml", name="w2", port=pw2, heartbeat=0.1, **by_file),
    }
    roster = _toml(tmp_path / "roster.toml", w0=url(pw0), w1=url(pw1))
    cfg["coordinator"] = _toml(
        tmp_path / "coordinator.toml",
        name="coordinator",
        port=pc,
        secret=secret,
        interval=0.3,
        epochs=EPOCHS,
        min_workers=2,
        roster=roster,
        admit_workers=True,
        data_servers={"ds0": url(p0), "ds1": url(p1)},
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    env["TANDEM_TEST_ELASTIC_SECRET"] = secret
    procs: dict[str, subprocess.Popen] = {}

    def start(role: str, name: str, *extra: str) -> None:
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tandem", "elastic", role, "--config", cfg[name], *extra],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def start_gated(role: str, name: str) -> None:
        """The CLI in a process that has imported everything it needs and waits for a line
        on stdin before it runs (`open_gate`)."""
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", GATED, "elastic", role, "--config", cfg[name]],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        ready = procs[name].stdout.readline()
        assert ready == "ready\n", ready + procs[name].stdout.read()

    def open_gate(name: str) -> None:
        procs[name].stdin.write("go\n")
        procs[name].stdin.flush()  # communicate() closes it

    summary_path = tmp_path / "summary.json"
    try:
        start_gated("worker", "w2")
        start("data-server", "ds0")
        start("data-server", "ds1")
        start("worker", "w0")
        start("worker", "w1")
        start("coordinator", "coordinator", "--summary", str(summary_path))
        coord = procs["coordinator"]
        seen = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = coord.stdout.readline()
            if not line:
                break
            seen.append(line)
            if (
                line.startswith("epoch ")
                and " committed " in line
                and not line.split(" committed ")[1].startswith("0/")
            ):
                break
        assert any(" committed " in s for s in seen), "".join(seen)
        os.kill(procs["w0"].pid, signal.SIGKILL)  # kill -9, mid-training
        open_gate("w2")  # a new, unlisted worker joins
        out, _ = coord.communicate(timeout=90)
        seen.append(out)
        if os.environ.get("ELASTIC_DEBUG"):
            print("".join(seen), time.monotonic() - deadline + 60)
        assert coord.returncode == 0, "".join(seen)
        for name in ("w1", "w2", "ds0", "ds1"):  # survivors were never restarted
            rest, _ = procs[name].communicate(timeout=30)
            assert procs[name].returncode == 0, f"{name}: {rest}"
        assert procs["w0"].wait(timeout=5) == -signal.SIGKILL
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            p.stdout.close()

    summary = json.loads(summary_path.read_text())
    all_ids = sorted(
        i * (1 << 20) + b for i, s in enumerate(shards) for b in range(s.n_batches(SPEC.batch_size))
    )
    assert summary["epochs"] == EPOCHS
    for epoch in summary["history"]:
        assert sorted(epoch["committed"]) == all_ids  # exactly once, whatever happened
    removed = [w for _, kind, detail in summary["events"] if kind == "removed" for w in detail]
    assert "w0" in removed
    joined = [w for _, kind, detail in summary["events"] if kind == "joined" for w in detail]
    assert "w2" in joined, summary["events"]
    assert summary["rollbacks"] >= 1
    assert summary["history"][-1]["loss"] < 0.25 * summary["initial_loss"]
