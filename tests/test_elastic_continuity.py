"""What a new user hit in elastic training (issue 44, point 4): counters and the summary
continuous across a coordinator restart, every path of a role's TOML at that TOML's folder,
the partial last batch trained on request, the test metric of the loss in the result line,
and the shared secret from the environment or a file."""

from __future__ import annotations

import asyncio
import json
import os
import time
import tomllib

import numpy as np
import pytest

from ports import free_ports
from tandem.parties.elastic import protocol as P
from tandem.parties.elastic.cli import test_metrics as result_metrics
from tandem.parties.elastic.config import (
    CoordinatorFile,
    DataServerFile,
    WorkerFile,
    load_role,
    resolve_at,
)
from tandem.parties.elastic.coordinator import Coordinator, CoordinatorConfig
from tandem.parties.elastic.data_server import DataServer
from tandem.parties.elastic.errors import ConfigError, JournalError
from tandem.parties.elastic.journal import TALLY, Journal, replay
from tandem.parties.elastic.ledger import Ledger
from tandem.parties.elastic.local import LocalCluster
from tandem.parties.elastic.party_data import load_party_shard
from tandem.parties.elastic.spec import ModelSpec, make_dataset
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork
from test_elastic_durable import Run

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)


# -- paths ------------------------------------------------------------------------------------
def test_every_path_of_a_role_file_starts_at_its_folder(tmp_path, monkeypatch):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "coordinator.toml").write_text(
        'name = "coordinator"\nsecret = "s"\njournal = "state/journal.jsonl"\n'
        'roster = "workers.toml"\n[data_servers]\nds0 = "http://127.0.0.1:1"\n'
    )
    (folder / "ds0.toml").write_text(
        'name = "ds0"\nsecret = "s"\ncoordinator = "http://127.0.0.1:2"\n'
        'model = "model.json"\nshard = "../shards/s0.npz"\ncheckpoints = "ckpt/ds0"\n'
        'export = "out/model.safetensors"\n'
    )
    monkeypatch.chdir(tmp_path.parent)  # the working folder must not matter
    coord = load_role(CoordinatorFile, str(folder / "coordinator.toml"))
    assert coord.journal == str(folder / "state" / "journal.jsonl")
    assert coord.roster == str(folder / "workers.toml")
    ds = load_role(DataServerFile, str(folder / "ds0.toml"))
    assert ds.model == str(folder / "model.json")
    assert ds.shard == str(folder / ".." / "shards" / "s0.npz")
    assert ds.checkpoints == str(folder / "ckpt" / "ds0")
    assert ds.export == str(folder / "out" / "model.safetensors")
    # URLs and absolute paths are kept; a file read from a URL resolves at the URL's folder
    assert resolve_at("s3://b/ckpt", str(folder / "x.toml")) == "s3://b/ckpt"
    assert resolve_at("/abs/j.jsonl", str(folder / "x.toml")) == "/abs/j.jsonl"
    assert resolve_at("ckpt/ds0", "memory://jobs/a/ds0.toml") == "memory://jobs/a/ckpt/ds0"


# -- the shared secret from the environment or a file ------------------------------------------
def test_elastic_roles_take_secret_env_and_secret_file(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_SECRET", "from-the-env")
    (tmp_path / "secret.txt").write_text("from-a-file\n")
    common = 'coordinator = "http://127.0.0.1:2"\nhost = "127.0.0.1"\n'
    (tmp_path / "w_env.toml").write_text(
        f'name = "w0"\n{common}[security]\nsecret_env = "ELASTIC_SECRET"\n'
    )
    (tmp_path / "w_file.toml").write_text(
        f'name = "w1"\n{common}[security]\nsecret_file = "secret.txt"\n'
    )
    monkeypatch.chdir(tmp_path.parent)
    env = load_role(WorkerFile, str(tmp_path / "w_env.toml"))
    assert env.signed and env.transport_settings()["secret"] == b"from-the-env"
    file = load_role(WorkerFile, str(tmp_path / "w_file.toml"))
    assert file.signed and file.transport_settings()["secret"] == b"from-a-file"
    (tmp_path / "both.toml").write_text(
        f'name = "w2"\n{common}secret = "x"\n[security]\nsecret_env = "ELASTIC_SECRET"\n'
    )
    with pytest.raises(Exception, match="given twice"):
        load_role(WorkerFile, str(tmp_path / "both.toml"))


# -- the partial last batch ---------------------------------------------------------------------
@pytest.mark.parametrize("drop_last", [True, False])
def test_the_partial_last_batch_is_dropped_or_trained_as_asked(drop_last):
    spec = ModelSpec(
        sizes=SPEC.sizes, optimizer="adam", lr=0.02, batch_size=16, seed=0, drop_last=drop_last
    )
    shards = make_dataset(2, 250, spec, seed=3)  # 250 rows: 15 full batches and 10 rows
    assert [s.n_batches(16, drop_last) for s in shards] == [15 + (not drop_last)] * 2
    if not drop_last:
        x, y = shards[0].batch(spec, 0, 15, 0)
        assert len(y) == 250 - 15 * 16
    cluster = LocalCluster(spec, shards, interval=0.2, epochs=2, workers=2)
    summary = asyncio.run(cluster.run())
    per_epoch = 2 * (15 + (not drop_last))
    assert [len(h["committed"]) for h in summary["history"]] == [per_epoch] * 2
    assert summary["history"][-1]["loss"] < summary["initial_loss"]
    # the default keeps the digest older descriptions had
    assert ("drop_last" in spec.to_dict()) == (not drop_last)


def test_the_train_table_takes_drop_last_and_refuses_a_bool_elsewhere(tmp_path):
    _regression_csv(tmp_path / "t.csv", 40, seed=0)
    base = {
        "path": str(tmp_path / "ds0.toml"),
        "data": {"source": "t.csv", "id_column": "id", "label_column": "target"},
        "model": {"kind": "mlp", "hidden": [4], "out": 1},
    }
    train = {"loss": "mse", "batch_size": 16}
    party = load_party_shard({**base, "train": {**train, "drop_last": False}}, path=base["path"])
    assert party.spec.drop_last is False
    rows = len(party.train.y)
    assert rows % 16 and party.train.n_batches(16, party.spec.drop_last) == -(-rows // 16)
    with pytest.raises(ConfigError, match="train.batch_size must be int, got True"):
        load_party_shard({**base, "train": {**train, "batch_size": True}}, path=base["path"])


# -- the result line's test metric --------------------------------------------------------------
def test_the_result_line_names_the_test_metric_of_the_loss():
    regression = {
        "ds0": {"rows": 10, "loss": 0.5, "accuracy": None, "objective": "mse"},
        "ds1": {"rows": 30, "loss": 0.1, "accuracy": None, "objective": "mse"},
    }
    assert result_metrics(regression) == {"test_mse": 0.2}
    classifier = {
        "ds0": {"rows": 10, "loss": 0.4, "accuracy": 0.9, "objective": "softmax"},
        "ds1": {"rows": 10, "loss": 0.2, "accuracy": 0.7, "objective": "softmax"},
    }
    assert result_metrics(classifier) == {"test_cross_entropy": 0.3, "test_accuracy": 0.8}
    binary = {"ds0": {"rows": 4, "loss": 0.3, "accuracy": 0.5, "objective": "binary"}}
    assert result_metrics(binary) == {"test_log_loss": 0.3, "test_accuracy": 0.5}
    assert result_metrics({"ds0": {"rows": 0, "loss": None, "accuracy": None}}) == {}


# -- counters across a coordinator restart ------------------------------------------------------
def test_the_journal_keeps_the_runs_counters():
    records = [
        {"kind": "start", "seq": 0, "digests": {}, "initial_loss": 1.0},
        {"kind": "commit", "seq": 1, "generation": 1, "epoch": 0, "batches": [0], "digests": {}},
        {"kind": "rollback", "seq": 1, "generation": 2, "digests": {}, "reissued": 2},
        {"kind": "recover", "seq": 1, "generation": 3, "digests": {}, "reissued": 1},
        {"kind": "commit", "seq": 2, "generation": 4, "epoch": 0, "batches": [1], "digests": {}},
        {"kind": "recover", "seq": 2, "generation": 5, "digests": {}, "reissued": 0,
         "restart": True},
    ]  # fmt: skip
    state = replay(records)
    assert state is not None and state.generation == 5 and state.committed == [0, 1]
    assert state.counts == {
        "checkpoints": 2,
        "rollbacks": 3,
        "recoveries": 2,
        "restarts": 1,
        "reissued": 3,
    }


def test_the_journal_keeps_the_runs_tally_of_refusals_strikes_and_bans():
    tally = {"reissued": 7, "refused_reports": 2, "fenced_reports": 4,
             "strikes": {"liar": 3, "slow": 1}, "banned": ["liar"]}  # fmt: skip
    records = [
        {"kind": "start", "seq": 0, "digests": {}, "initial_loss": 1.0},
        {"kind": "rollback", "seq": 0, "generation": 1, "digests": {}, "reissued": 2,
         "tally": {**tally, "reissued": 2, "strikes": {}, "banned": []}},
        {"kind": "commit", "seq": 1, "generation": 2, "epoch": 0, "batches": [0], "digests": {},
         "tally": tally},
    ]  # fmt: skip
    state = replay(records)
    assert state is not None and state.tally == tally
    assert state.counts["reissued"] == 7  # the tally's: checkpoints and refusals re-issue too
    no_tally = replay(records[:1])
    assert no_tally is not None and no_tally.tally == {**TALLY, "strikes": {}, "banned": []}
    broken = [records[0], {**records[2], "tally": {"reissued": 1}}]
    with pytest.raises(JournalError, match="tally .* is malformed.*fenced_reports"):
        replay(broken)


def test_a_restarted_coordinator_takes_back_the_tally_and_keeps_the_bans():
    """Every count of the summary a restart would reset comes back from the journal's tally."""
    first = _coordinator()
    ledger = first.ledger = Ledger({"ds0": [0, 1, 2, 3]})
    audit = first.workers.audit
    for worker in ("liar", "honest"):
        first.membership.beat(worker, "i", 0.0)
    first.membership.detect(0.0)
    assert ledger.assign("liar") == ("ds0", 0) and ledger.assign("honest") == ("ds0", 1)
    first.workers.report("liar", {"ok": True, "batch": 0, "gen": 0})
    first.workers.report("honest", {"ok": True, "batch": 1, "gen": 0})
    first.workers.report("honest", {"ok": True, "batch": 3, "gen": 0})  # not its batch: refused
    first.workers.settle(applied=[1])  # the liar's batch 0 never reached the data server
    assert ledger.unapplied([1]) == 1
    ledger.checkpoint([1])
    assert ledger.assign("liar") == ("ds0", 0)
    first.workers.report("liar", {"ok": True, "batch": 0, "gen": 1})  # fenced: refused, banned
    assert audit.banned == {"liar"} and audit.refused == 1
    tally = first.workers.tally()
    before = first.summary()

    again = _coordinator()  # what `_resume` does with the journal's last tally
    again.ledger = Ledger({"ds0": [0, 1, 2, 3]}, generation=ledger.generation)
    again.workers.restore(replay([{"kind": "start", "seq": 0, "digests": {}}, {
        "kind": "recover", "seq": 1, "generation": 2, "digests": {}, "reissued": 0,
        "tally": tally}]).tally)  # fmt: skip
    after = again.summary()
    for key in ("reissued", "refused_reports", "false_reports", "fenced", "fenced_reports"):
        assert after[key] == before[key], key
    assert before["fenced"] == ["liar"] and before["refused_reports"] == 1
    assert before["reissued"] == 2 and before["fenced_reports"] == 1
    assert "liar" in again.membership.banned and not again.membership.beat("liar", "j", 1.0)
    assert again.workers.tally() == tally


def _coordinator() -> Coordinator:
    config = CoordinatorConfig(data_servers=("ds0",), false_reports=2)
    return Coordinator(MemoryNetwork().endpoint("coordinator"), config)


SECRET_ENV = "TANDEM_TEST_ELASTIC_CONTINUITY_SECRET"


def _regression_csv(path, rows: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=rows), rng.normal(size=rows)
    y = 2 * a - b + 0.05 * rng.normal(size=rows)
    lines = [f"r{seed}_{i},{a[i]:.5f},{b[i]:.5f},{y[i]:.5f}" for i in range(rows)]
    path.write_text("id,a,b,target\n" + "\n".join(lines) + "\n")


class NewUserJob(Run):
    """`Run`'s processes (one worker: the test is about the coordinator) set up as issue 44's
    new user had them, with every item of its point 4 in play: each role's TOML in one folder
    with every path in it relative to that folder (the data tables, ``checkpoints``,
    ``export``, ``journal``, ``secret_file``) while the processes run in another folder; the
    secret from a file (data servers) or the environment (the others); a regression (``mse``)
    on CSV tables with a test split, whose training rows leave a partial last batch that
    ``drop_last = false`` trains."""

    ROWS = 200  # per data server: 150 training rows after the split, 9 batches of 16 and 6 rows

    def __init__(self, tmp_path, epochs: int) -> None:
        self.tmp, self.epochs = tmp_path, epochs
        self.job = job = tmp_path / "job"
        (tmp_path / "elsewhere").mkdir()
        job.mkdir()
        (job / "secret.txt").write_text("s3cret\n")
        pc, p0, p1, pw0 = free_ports(4)
        url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
        head = lambda name, port: (  # noqa: E731
            f'name = "{name}"\nhost = "127.0.0.1"\nport = {port}\n'
        )
        by_env = f'[security]\nsecret_env = "{SECRET_ENV}"\n'
        self.cfg, self.batches = {}, []
        for i, port in enumerate((p0, p1)):
            _regression_csv(job / f"ds{i}.csv", self.ROWS, seed=i)
            export = 'export = "out/model.safetensors"\n' if i == 0 else ""
            text = (
                head(f"ds{i}", port) + f'coordinator = "{url(pc)}"\ncheckpoints = "ckpt/ds{i}"\n'
                + export + '[security]\nsecret_file = "secret.txt"\n'
                + f'[data]\nsource = "ds{i}.csv"\nid_column = "id"\nlabel_column = "target"\n'
                "[data.split]\ntest = 0.25\nseed = 1\n"
                '[model]\nkind = "mlp"\nhidden = [8]\nout = 1\n'
                '[train]\nloss = "mse"\nlr = 0.02\nbatch_size = 16\ndrop_last = false\n'
            )  # fmt: skip
            (job / f"ds{i}.toml").write_text(text)
            self.cfg[f"ds{i}"] = str(job / f"ds{i}.toml")
            party = load_party_shard({"path": self.cfg[f"ds{i}"], **tomllib.loads(text)},
                                     path=self.cfg[f"ds{i}"])  # fmt: skip
            rows = len(party.train.y)
            assert rows % 16, rows  # a partial last batch
            self.batches += [i * P.STRIDE + b for b in range(-(-rows // 16))]
        (job / "w0.toml").write_text(
            head("w0", pw0) + f'coordinator = "{url(pc)}"\nheartbeat = 0.1\n' + by_env
        )
        self.cfg["w0"] = str(job / "w0.toml")
        (job / "coordinator.toml").write_text(
            head("coordinator", pc) + f"interval = 0.3\nepochs = {epochs}\nmin_workers = 1\n"
            'call_timeout = 3.0\non_change = "keep"\njournal = "state/journal.jsonl"\n'
            + by_env + f'[workers]\nw0 = "{url(pw0)}"\n'
            f'[data_servers]\nds0 = "{url(p0)}"\nds1 = "{url(p1)}"\n'
        )  # fmt: skip
        self.cfg["coordinator"] = str(job / "coordinator.toml")
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
                    SECRET_ENV: "s3cret"}  # fmt: skip
        self.procs, self.out = {}, {}
        self.summary = tmp_path / "summary.json"
        self.cwd = str(tmp_path / "elsewhere")  # the working folder must not matter

    def wait_for_journal(self, until, seconds: float, what: str) -> None:
        """Poll the journal (read only: the coordinator is writing it) until ``until(kinds)``
        holds for its records' kinds; `AssertionError` naming ``what`` after ``seconds``."""
        path = self.job / "state" / "journal.jsonl"
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            raw = path.read_bytes() if path.exists() else b""
            kinds = [json.loads(ln)["kind"] for ln in raw[: raw.rfind(b"\n") + 1].splitlines()]
            if until(kinds):
                return
            time.sleep(0.05)
        raise AssertionError(f"no {what} in the journal within {seconds:g} s:\n{self.tails()}")


def _committed_after_a_recovery(kinds: list[str]) -> bool:
    return "recover" in kinds and "commit" in kinds[len(kinds) - kinds[::-1].index("recover") :]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_restarted_coordinators_summary_covers_the_whole_run(tmp_path):
    """The new user's run end to end (`NewUserJob`): a data server killed and restarted (a
    recovery the first coordinator makes and journals), then the coordinator killed and
    restarted; the restarted coordinator's summary and result line cover the whole run."""
    run = NewUserJob(tmp_path, epochs=3)
    try:
        for name in ("ds0", "ds1", "w0", "coordinator"):
            run.start(name)
        run.wait_for_progress(epochs_closed=0)
        run.kill("ds0")
        run.start("ds0")
        run.wait_for_journal(_committed_after_a_recovery, 90, "commit after a recovery")
        run.kill("coordinator")
        before = Journal(run.job / "state" / "journal.jsonl").open()  # as the kill left it
        assert before is not None and before.counts["recoveries"] >= 1, before
        assert len(before.history) < run.epochs, "the run ended before the kill"
        run.start("coordinator")
        lines = run.coordinator_lines(lambda ln: ln.startswith("{"), 120, "result line")
        run.exit_of("coordinator", 30)
        for name in ("w0", "ds0", "ds1"):  # the others rode the restart out
            run.exit_of(name, 30)
    finally:
        run.close()
    summary = json.loads(run.summary.read_text())
    assert summary["restarts"] == 1
    assert summary["recoveries"] == before.counts["recoveries"] + 1  # its own restart's, added
    assert summary["rollbacks"] >= before.counts["rollbacks"] + 1
    assert summary["checkpoints"] > before.counts["checkpoints"]
    for key in ("reissued", "refused_reports", "fenced_reports"):  # kept from the tally
        assert summary[key] >= before.tally[key], (key, summary, before.tally)
    assert summary["false_reports"] == before.tally["strikes"] == {} and summary["fenced"] == []
    assert summary["epochs"] == run.epochs and len(summary["history"]) == run.epochs
    for epoch in summary["history"]:  # every batch once, the partial last ones included
        assert sorted(epoch["committed"]) == sorted(run.batches)
    assert summary["history"][-1]["loss"] < summary["initial_loss"]
    progress = [ln for ln in lines if " committed " in ln]
    assert progress and all(" loss " in ln for ln in progress), lines
    result = json.loads(lines[-1])
    assert result["recoveries"] == summary["recoveries"] and result["restarts"] == 1
    assert "test_accuracy" not in result and 0 <= result["test_mse"] < summary["initial_loss"]
    export = run.job / "out" / "model.safetensors"
    assert result["exports"] == {"ds0": str(export)} and export.exists()
    assert (run.job / "ckpt" / "ds1").is_dir()
    assert not list((tmp_path / "elsewhere").iterdir())


async def test_a_regression_data_server_reports_its_test_mse(tmp_path):

    rng = np.random.default_rng(0)
    a, b = rng.normal(size=200), rng.normal(size=200)
    rows = [f"r{i},{a[i]:.5f},{b[i]:.5f},{2 * a[i] - b[i]:.5f}" for i in range(200)]
    (tmp_path / "reg.csv").write_text("id,a,b,target\n" + "\n".join(rows) + "\n")
    text = (
        '[data]\nsource = "reg.csv"\nid_column = "id"\nlabel_column = "target"\n'
        "[data.split]\ntest = 0.25\nseed = 1\n"
        '[model]\nkind = "mlp"\nhidden = [8]\nout = 1\n[train]\nloss = "mse"\nbatch_size = 16\n'
    )

    cfg = {"path": str(tmp_path / "ds0.toml"), **tomllib.loads(text)}
    party = load_party_shard(cfg, path=cfg["path"])
    net = MemoryNetwork()
    coord = net.endpoint("coordinator")
    ds = DataServer(
        net.endpoint("ds0"), coordinator="coordinator", spec=party.spec, shard=party.train,
        test=party.test,
    )  # fmt: skip

    async def call(op, **meta):
        await coord.send("ds0", P.CTL, Frame(meta={"op": op, "req": 1, **meta}))
        return (await coord.recv("ds0", P.REPLY)).meta

    async with asyncio.timeout(30), asyncio.TaskGroup() as tg:
        server = tg.create_task(ds.run())
        await call("hello", index=0)
        test = await call("test")
        await call("stop")
        await server
    assert (
        test["objective"] == "mse"
        and test["accuracy"] is None
        and test["rows"] == len(party.test.y) > 0
    )
    metrics = result_metrics({"ds0": test})
    assert set(metrics) == {"test_mse"} and metrics["test_mse"] == round(test["loss"], 6)


async def test_a_worker_is_welcomed_while_the_data_servers_are_still_starting():
    """Workers are welcomed before the coordinator's hello to the data servers returns (a
    hello may wait a minute for data servers that import and compile), so a worker's
    ``join_timeout`` never runs out while the coordinator is up; a done-report that reaches
    a coordinator with no ledger yet is ignored."""

    net = MemoryNetwork()
    coord = Coordinator(
        net.endpoint("coordinator"), CoordinatorConfig(data_servers=("ds0",), interval=0.1)
    )
    net.endpoint("ds0")  # a data server that has not answered yet
    worker = net.endpoint("w0")
    run = asyncio.create_task(coord.run())
    try:
        async with asyncio.timeout(20):
            await worker.send("coordinator", P.HB, Frame(meta={"incarnation": "a", "url": ""}))
            welcome = await worker.recv("coordinator", P.WELCOME)
            assert welcome.meta["data_servers"] == {"ds0": ""}
            done = {"ok": True, "batch": 0, "gen": 0}
            await worker.send("coordinator", P.DONE, Frame(meta=done))
            await asyncio.sleep(0.3)  # the report task takes it; nothing may fail
        assert coord.phase == "hello" and coord.ledger is None and not run.done()
    finally:
        run.cancel()
        with pytest.raises(asyncio.CancelledError):
            await run
