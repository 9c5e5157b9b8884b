"""A star of one leader and three followers, configured in TOML with free party names: each
party aligns (`tandem align`, through the leader) and trains (`tandem party`) as its own OS
process over HTTP; each follower has only the leader as peer."""

from __future__ import annotations

import os

import pytest

from ports import free_port
from table_helpers import TableJob

pytestmark = pytest.mark.slow
PARTIES = ["bank", "shop", "telco", "media"]
MISSING = {"shop": list(range(0, 50)), "telco": list(range(500, 600)), "media": [50, 51, 52]}
ROWS = 600


def test_three_followers_align_and_train_as_separate_processes(tmp_path):
    topology = {"kind": "star", "leader": "bank", "followers": PARTIES[1:]}
    job = TableJob(tmp_path, PARTIES, epochs=6, topology=topology, drop=MISSING, n=ROWS)
    os.environ.setdefault("TANDEM_SECRET", "align-secret")
    ports = {p: free_port() for p in PARTIES}
    procs = {}
    for p in PARTIES:
        peers = PARTIES[1:] if p == "bank" else ["bank"]
        argv = ["align", "--name", p, "--role", "leader" if p == "bank" else "follower"]
        argv += ["--port", str(ports[p]), "--ids", str(tmp_path / f"{p}.csv")]
        argv += ["--column", "cid", "--out", str(tmp_path / f"{p}_aligned.csv")]
        for q in peers:
            argv += ["--peer", f"{q}=http://127.0.0.1:{ports[q]}"]
        procs[p] = job.launch(argv, f"align_{p}")
    summaries = {}
    for p, proc in procs.items():
        rc, summary, err = proc.finish(60)
        assert rc == 0, (p, err[-2000:])
        summaries[p] = summary
    shared = ROWS - len(MISSING["shop"]) - len(MISSING["telco"]) - len(MISSING["media"])
    assert {s["intersection_size"] for s in summaries.values()} == {shared}
    assert len({s["intersection_commitment"] for s in summaries.values()}) == 1
    assert summaries["bank"]["pairwise"] == {"shop": 550, "telco": 500, "media": 597}

    for p in PARTIES:
        job.cfg[p]["data"]["aligned"] = f"{p}_aligned.csv"
    parties = {p: job.start(p) for p in reversed(PARTIES)}
    results = {p: proc.finish(110) for p, proc in parties.items()}
    for p, (rc, out, err) in results.items():
        assert rc == 0 and out["status"] == "done", (p, err[-3000:])
    lead = results["bank"][1]
    assert {r[1]["spec_hash"] for r in results.values()} == {lead["spec_hash"]}
    assert lead["alignment"]["size"] == shared
    assert lead["alignment"]["commitment"] == summaries["bank"]["intersection_commitment"]
    assert set(lead["bytes_sent"]) == {"shop", "telco", "media"}
    for p in PARTIES[1:]:
        assert set(results[p][1]["bytes_sent"]) == {"bank"}  # followers talk to the leader only
    assert lead["test_accuracy"] > 0.7
