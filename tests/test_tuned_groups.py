"""`tandem.parties.split.process.tuned`: the leader's remembered micro-batch count per job
(the end-to-end rerun: tests/test_party_cli.py)."""

from __future__ import annotations

import dataclasses
import json

from spec_helpers import open_security, small_hyper
from tandem.parties.split.process import tuned
from tandem.parties.split.spec import TaskSpec


def _spec(**changes) -> TaskSpec:
    spec = TaskSpec(
        topology={"kind": "leader_follower"},
        datasets={"leader": {"columns": 4}},
        samples=64,
        stages={"top": {"kind": "mlp"}},
        edges=[],
        hyper=small_hyper(groups="auto"),
        security=open_security(),
    )
    return dataclasses.replace(spec, **changes)


PEERS = {"follower": "http://127.0.0.1:9001"}


def test_the_job_key_ignores_the_data_and_ports_and_follows_the_model_hyper_and_hosts():
    key = tuned.job_key(_spec(), PEERS)
    other_data = _spec(
        datasets={"leader": {"columns": 4, "rows": 9}}, samples=640, alignment={"size": 640}
    )
    assert tuned.job_key(other_data, PEERS) == key
    assert tuned.job_key(_spec(hyper=small_hyper(groups="auto", batch_size=16)), PEERS) != key
    assert tuned.job_key(_spec(stages={"top": {"kind": "mlp", "hidden": [8]}}), PEERS) != key
    assert tuned.job_key(_spec(), {"follower": "http://10.0.0.2:9001"}) != key
    assert tuned.job_key(_spec(), {"follower": "http://127.0.0.1:9002/"}) == key  # a new port


S = tuned.Settled


def test_remember_then_recall_and_a_bad_file_or_entry_reads_as_nothing(tmp_path):
    folder = str(tmp_path / "cache")
    assert tuned.recall(folder, "a", batch=64) is None  # no folder yet
    assert tuned.recall(None, "a", batch=64) is None
    assert not tuned.remember(None, "a", S(3))  # no cache: nothing to write
    assert tuned.remember(folder, "a", S(3, 200, 0.042))
    tuned.remember(folder, "b", S(5))
    assert tuned.recall(folder, "a", batch=64) == S(3, 200, 0.042)
    assert tuned.recall(folder, "b", 64) == S(5, 0, None)
    assert tuned.recall(folder, "b", batch=4) is None  # not a count this batch allows
    path = tmp_path / "cache" / tuned.FILE
    bad = {"a": True, "b": 0, "c": "2", "d": {"n": 2.0}, "e": [2], "f": {"interval": 9}}
    good = {"g": 2, "h": {"n": 4, "interval": "x", "wall": -1.0}, "i": {"n": 4, "wall": True}}
    path.write_text(json.dumps({**bad, **good}))
    assert [tuned.recall(folder, k, 64) for k in bad] == [None] * len(bad)
    # a bare count (earlier versions' entries) and malformed extras: the count still holds
    assert [tuned.recall(folder, k, 64) for k in good] == [S(2), S(4), S(4)]
    path.write_text("{not json")
    assert tuned.recall(folder, "g", 64) is None
    tuned.remember(folder, "e", S(7, 50, 0.5))  # a corrupt file is replaced
    assert json.loads(path.read_text()) == {"e": {"n": 7, "interval": 50, "wall": 0.5}}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [tuned.FILE]  # no temp left


def test_the_file_keeps_the_most_recently_written_jobs(tmp_path):
    folder = str(tmp_path)
    for i in range(tuned.KEEP + 5):
        tuned.remember(folder, f"job{i}", S(1 + i % 7))
    tuned.remember(folder, "job10", S(2))  # rewritten: now the newest
    kept = json.loads((tmp_path / tuned.FILE).read_text())
    assert len(kept) == tuned.KEEP and list(kept)[0] == "job10" and kept["job10"]["n"] == 2
    assert "job0" not in kept and f"job{tuned.KEEP + 4}" in kept


def test_a_folder_that_cannot_be_written_is_a_warning_not_a_failure(tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert not tuned.remember(str(blocker / "cache"), "a", S(3))
    assert "could not remember the tuned micro-batch count" in caplog.text


def test_a_checkpoints_fields_parse_as_the_files_entries():
    """`tuned.parse` reads a checkpoint's ``tuned_*`` fields too (tandem.parties.split.process
    .resume): a checkpoint without them (a fixed count, no settle yet) gives None."""
    assert tuned.parse({"n": 3, "interval": 100, "wall": 0.05}, 64) == S(3, 100, 0.05)
    assert tuned.parse({"n": None, "interval": None, "wall": None}, 64) is None
    assert tuned.parse({"n": 3, "interval": None, "wall": float("nan")}, 64) == S(3)
    assert tuned.parse({"n": 65}, 64) is None  # not a count this batch allows


def test_the_job_key_ignores_the_data_the_hyper_parameters_record():
    """A rerun on new data records other fingerprints and split sizes in ``hyper``; it is
    still the same job, so it finds the count the earlier run settled on."""
    old_data = small_hyper(groups="auto", fingerprints={"leader": "a"})
    key = tuned.job_key(_spec(hyper=old_data), PEERS)
    new_data = small_hyper(
        groups="auto", fingerprints={"leader": "b"}, test_samples=90, validation_samples=30
    )
    assert tuned.job_key(_spec(hyper=new_data), PEERS) == key
