"""Durable elastic state: parameter-server checkpoints behind fsspec URLs, the coordinator's
write-ahead journal, and (slow) ``kill -9`` of the coordinator and of a data server over HTTP,
each restarted and resuming with every batch of every epoch committed exactly once."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from ports import free_ports
from tandem.parties.elastic.errors import CheckpointError, JournalError
from tandem.parties.elastic.journal import Journal
from tandem.parties.elastic.ledger import Ledger
from tandem.parties.elastic.param_server import ParamServer
from tandem.parties.elastic.spec import ModelSpec, make_dataset, save_shard
from tandem.parties.elastic.store import CheckpointStore
from test_elastic_http import _toml

SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)


def _grads(ps: ParamServer, scale: float = 0.1) -> list[np.ndarray]:
    return [np.full(p.shape, scale, np.float32) for p in ps.params]


# -- checkpoints -----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_restarted_parameter_server_restores_the_named_checkpoint_bit_for_bit(tmp_path, where):
    url = str(tmp_path / "ckpt") if where == "local" else f"memory://elastic-{os.getpid()}/ds0"
    ps = ParamServer(SPEC, n_batches=4, offset=0, store=CheckpointStore(url))
    ps.apply(0, 0, _grads(ps))
    ps.fence(1)
    committed = ps.checkpoint(seq=1)
    ps.apply(1, 1, _grads(ps, 0.3))
    ps.fence(2)
    ps.checkpoint(seq=2)  # prepared, never journaled
    ps.apply(2, 2, _grads(ps))
    # a fresh process: nothing in memory but the store
    again = ParamServer(SPEC, n_batches=4, offset=0, store=CheckpointStore(url))
    assert again.restore(1, generation=5) == committed
    assert again.generation == 5 and list(again.counts) == [1, 0, 0, 0]
    assert CheckpointStore(url).latest() == 2
    if where == "local":
        leftovers = [n for n in os.listdir(tmp_path / "ckpt") if n.endswith(".tmp")]
        assert leftovers == []
    ps.checkpoint(seq=3)  # keeps 2 and 3: the journal names one of them
    assert CheckpointStore(url).sequences() == [2, 3]
    with pytest.raises(CheckpointError, match="checkpoint 1 is not in"):
        again.store.load(1)


def test_a_checkpoint_of_another_shard_or_a_damaged_one_is_refused(tmp_path):
    url = str(tmp_path / "ckpt")
    ParamServer(SPEC, n_batches=4, offset=0, store=CheckpointStore(url)).checkpoint(seq=0)
    other = ParamServer(SPEC, n_batches=4, offset=1 << 20, store=CheckpointStore(url))
    with pytest.raises(CheckpointError, match="another model or shard"):
        other.restore(0, generation=1)
    (tmp_path / "ckpt" / CheckpointStore.filename(0)).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="not a readable elastic checkpoint"):
        ParamServer(SPEC, 4, store=CheckpointStore(url)).restore(0, generation=1)
    with pytest.raises(CheckpointError, match="no durable store"):
        ParamServer(SPEC, 4).restore(7, generation=1)


# -- the journal -----------------------------------------------------------------------------
def test_the_journal_replays_commits_and_epochs_and_drops_a_torn_tail(tmp_path):
    path = tmp_path / "coord" / "journal.jsonl"
    j = Journal(path)
    assert j.open() is None
    digests = {"ds0": "a"}
    j.append({"kind": "start", "seq": 0, "digests": digests, "initial_loss": 1.0})
    j.append(
        {"kind": "commit", "seq": 1, "generation": 1, "epoch": 0, "batches": [0, 2], "digests": {}}
    )
    j.append(
        {"kind": "commit", "seq": 2, "generation": 3, "epoch": 0, "batches": [1], "digests": {}}
    )
    j.append({"kind": "epoch", "seq": 3, "epoch": 0, "loss": 0.5, "generation": 3, "digests": {}})
    j.append(
        {"kind": "commit", "seq": 4, "generation": 4, "epoch": 1, "batches": [2], "digests": {}}
    )
    with open(path, "ab") as f:  # kill -9 in the middle of the next record
        f.write(b'{"kind": "commit", "seq": 5, "gen')
    state = Journal(path).open()
    assert state is not None
    assert (state.seq, state.generation, state.epoch, state.committed) == (4, 4, 1, [2])
    assert state.history == [{"epoch": 0, "committed": [0, 2, 1], "loss": 0.5, "generation": 3}]
    assert path.read_bytes().endswith(b"}\n")  # torn tail truncated: appends stay well formed
    path.write_bytes(path.read_bytes().replace(b'"kind":"epoch"', b'"kind":"epoch" oops'))
    with pytest.raises(JournalError, match="line 4, is damaged"):
        Journal(path).open()
    with pytest.raises(JournalError, match="must be a local file"):
        Journal("s3://bucket/journal.jsonl")


def test_a_ledger_restored_from_the_journal_issues_only_the_rest():
    led = Ledger({"ds0": [0, 1], "ds1": [10, 11]}, generation=7, epoch=2)
    led.restore([10, 0])
    assert led.pending == [1, 11] and led.committed == [10, 0] and led.generation == 7
    led.check()
    assert led.checkpoint(applied=[]) == []


# -- kill -9 over HTTP -----------------------------------------------------------------------
EPOCHS = 4


class Output:
    """A child's merged stdout and stderr, read line by line by a thread: every wait on it has
    a deadline, and a child never blocks on a full pipe while the test waits on another."""

    def __init__(self, name: str, proc: subprocess.Popen) -> None:
        self.name = name
        self.lines: list[str] = []
        self._new: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(
            target=self._read, args=(proc.stdout,), name=f"output of {name}", daemon=True
        )
        self._thread.start()

    def _read(self, stream) -> None:
        try:
            for line in stream:
                self.lines.append(line)
                self._new.put(line)
        except (OSError, ValueError):  # the stream was closed under us: the end
            pass
        finally:
            self._new.put(None)

    def next_line(self, deadline: float) -> str | None:
        """The next line (None once the child closed its output); `TimeoutError` naming the
        child when nothing came by ``deadline`` (`time.monotonic`)."""
        try:
            line = self._new.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"no output from {self.name} in time") from None
        if line is None:
            self._new.put(None)  # the end stays the end
        return line

    def join(self, timeout: float = 10.0) -> str:
        """Everything the child wrote (after it exited)."""
        self._thread.join(timeout)
        return "".join(self.lines)


class Run:
    """Two data servers (durable checkpoints), two workers and a coordinator (a journal) as
    separate processes over HTTP on 127.0.0.1. Every wait on them is bounded; a failed wait
    names what it waited for and shows the tail of every process's output."""

    def __init__(self, tmp_path, on_change: str = "rollback") -> None:
        self.tmp = tmp_path
        self.shards = make_dataset(2, 256, SPEC, seed=3)
        (tmp_path / "model.json").write_text(json.dumps(SPEC.to_dict()))
        for i, shard in enumerate(self.shards):
            save_shard(shard, str(tmp_path / f"shard{i}.npz"))
        pc, p0, p1, pw0, pw1 = free_ports(5)
        url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
        common = dict(host="127.0.0.1", secret="s3cret", coordinator=url(pc))
        self.cfg = {
            f"ds{i}": _toml(
                tmp_path / f"ds{i}.toml",
                name=f"ds{i}",
                port=port,
                model=str(tmp_path / "model.json"),
                shard=str(tmp_path / f"shard{i}.npz"),
                checkpoints=str(tmp_path / "ckpt" / f"ds{i}"),
                **common,
            )
            for i, port in enumerate((p0, p1))
        }
        for name, port in (("w0", pw0), ("w1", pw1)):
            self.cfg[name] = _toml(
                tmp_path / f"{name}.toml", name=name, port=port, heartbeat=0.1, **common
            )
        self.cfg["coordinator"] = _toml(
            tmp_path / "coordinator.toml",
            name="coordinator",
            port=pc,
            secret="s3cret",
            interval=0.3,
            epochs=EPOCHS,
            min_workers=2,
            call_timeout=3.0,
            on_change=on_change,
            journal=str(tmp_path / "journal.jsonl"),
            workers={"w0": url(pw0), "w1": url(pw1)},
            data_servers={"ds0": url(p0), "ds1": url(p1)},
        )
        self.env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.procs: dict[str, subprocess.Popen] = {}
        self.out: dict[str, Output] = {}
        self.summary = tmp_path / "summary.json"
        self.cwd: str | None = None  # the children's working folder (None: the test's)

    def start(self, name: str) -> subprocess.Popen:
        role = (
            "coordinator" if name == "coordinator" else "data-server" if "ds" in name else "worker"
        )
        extra = ["--summary", str(self.summary)] if role == "coordinator" else []
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "tandem", "elastic", role, "--config", self.cfg[name], *extra],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=self.cwd,
        )
        self.out[name] = Output(name, self.procs[name])
        return self.procs[name]

    def tails(self, lines: int = 15) -> str:
        """The last ``lines`` lines of every process's output, for a failure message."""
        return "".join(
            f"--- {name} (exit {self.procs[name].poll()}) ---\n" + "".join(out.lines[-lines:])
            for name, out in self.out.items()
        )

    def coordinator_lines(self, until, seconds: float, what: str) -> list[str]:
        """The coordinator's next lines, up to the first for which ``until(line)`` holds (or
        its end of output); `AssertionError` naming ``what`` after ``seconds``."""
        seen: list[str] = []
        deadline = time.monotonic() + seconds
        try:
            while (line := self.out["coordinator"].next_line(deadline)) is not None:
                seen.append(line)
                if until(line):
                    return seen
        except TimeoutError:
            pass
        raise AssertionError(f"no {what} within {seconds:g} s:\n{self.tails()}")

    def wait_for_progress(self, epochs_closed: int, seconds: float = 90) -> list[str]:
        """Read the coordinator's status lines until ``epochs_closed`` epochs are closed and
        the current one has commits."""
        head = f"epoch {epochs_closed} committed "
        return self.coordinator_lines(
            lambda ln: ln.startswith(head) and not ln[len(head) :].startswith("0/"),
            seconds,
            f"commit in epoch {epochs_closed}",
        )

    def kill(self, name: str) -> None:
        os.kill(self.procs[name].pid, signal.SIGKILL)
        assert self.procs[name].wait(timeout=10) == -signal.SIGKILL
        self.out[name].join()
        self.procs[name].stdout.close()

    def exit_of(self, name: str, seconds: float) -> str:
        """Wait up to ``seconds`` for ``name`` to exit 0; its whole output."""
        try:
            code = self.procs[name].wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {seconds:g} s:\n{self.tails()}"
            ) from None
        out = self.out[name].join()
        assert code == 0, f"{name} exited {code}:\n{out[-4000:]}\n{self.tails()}"
        return out

    def finish(self) -> dict:
        # within the tests' timeout (300 s) with `wait_for_progress`: a hang fails here, with
        # every process's last lines, not in pytest-timeout's stack dump
        self.exit_of("coordinator", 150)
        for name in ("w0", "w1", "ds0", "ds1"):  # the others rode the restart out
            self.exit_of(name, 30)
        summary = json.loads(self.summary.read_text())
        all_ids = sorted(
            i * (1 << 20) + b
            for i, s in enumerate(self.shards)
            for b in range(s.n_batches(SPEC.batch_size))
        )
        assert summary["epochs"] == EPOCHS
        for epoch in summary["history"]:
            assert sorted(epoch["committed"]) == all_ids  # exactly once, whatever happened
        assert summary["history"][-1]["loss"] < 0.25 * summary["initial_loss"]
        return summary

    def close(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
            self.out[name].join()
            if p.stdout and not p.stdout.closed:
                p.stdout.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_dash_nine_the_coordinator_and_restart_it(tmp_path):
    run = Run(tmp_path)
    try:
        for name in ("ds0", "ds1", "w0", "w1", "coordinator"):
            run.start(name)
        run.wait_for_progress(epochs_closed=1)
        run.kill("coordinator")
        run.start("coordinator")
        summary = run.finish()
    finally:
        run.close()
    resumed = summary["resumed"]
    assert resumed is not None and resumed["epochs_done"] >= 1, summary  # progress was kept
    assert summary["recoveries"] >= 1
    kinds = [kind for _, kind, _ in summary["events"]]
    assert "resumed" in kinds


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kill_dash_nine_a_data_server_and_restart_it(tmp_path):
    run = Run(tmp_path, on_change="keep")
    try:
        for name in ("ds0", "ds1", "w0", "w1", "coordinator"):
            run.start(name)
        run.wait_for_progress(epochs_closed=1)
        run.kill("ds0")
        run.start("ds0")
        summary = run.finish()
    finally:
        run.close()
    assert summary["recoveries"] >= 1, summary
    assert summary["resumed"] is None
