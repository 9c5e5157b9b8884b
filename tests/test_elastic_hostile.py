"""Elastic roles against insiders and outsiders, end to end over HTTP in one process (issue 39,
point 3): a worker on no roster is never admitted, a control message from a worker to a data
server is refused and the job finishes, and a worker that reports batches done without
pushing gradients is fenced while the job commits every batch exactly once. The jobs and
attacks are `tandem.testing.hostile_roles`'."""

from __future__ import annotations

import asyncio

import pytest

from tandem.parties.elastic.audit import ReportAudit
from tandem.parties.elastic.coordinator import Coordinator, CoordinatorConfig
from tandem.parties.elastic.ledger import Ledger
from tandem.parties.elastic.membership import Membership
from tandem.parties.elastic.workforce import Workforce
from tandem.testing import hostile_roles as H
from tandem.transports.base import Frame
from tandem.transports.memory import MemoryNetwork


def test_the_audit_strikes_reports_the_data_servers_did_not_apply():
    audit = ReportAudit(limit=3)
    audit.record(1, "liar")
    audit.record(2, "honest")
    assert audit.settle(applied=[2]) == [] and audit.fenced("liar")
    assert not audit.fenced("honest")
    assert not audit.refuse("liar") and audit.refuse("liar")  # strikes 2, then 3: banned
    assert audit.banned == {"liar"} and audit.refused == 2
    audit.record(3, "honest")
    audit.forget()  # a rollback: nothing to judge
    assert audit.settle(applied=[]) == [] and not audit.fenced("honest")


def test_a_banned_worker_leaves_and_its_beats_are_ignored():
    m = Membership(timeout=1.0)
    m.beat("w", "a", 0.0)
    assert m.detect(0.1).live == {"w"}
    m.ban("w")
    assert not m.beat("w", "b", 0.2)
    det = m.detect(0.3)
    assert det.left == {"w"} and not det.live


def test_a_released_batch_goes_back_to_pending_in_epoch_order():
    ledger = Ledger({"ds0": [0, 1, 2]})
    assert ledger.assign("w") == ("ds0", 0)
    assert ledger.release(0, "w") and not ledger.release(0, "w")
    assert ledger.pending == [0, 1, 2] and ledger.reissued == 1
    ledger.check()


def test_a_fenced_workers_applied_batch_released_then_committed_once():
    """A fenced worker that did push: its report is refused and the batch released, but the
    parameter servers applied it, so the checkpoint commits it once instead of crashing."""
    ledger = Ledger({"ds0": [0, 1]})
    net = MemoryNetwork(capacity=4)
    workers = Workforce(
        net.endpoint("coordinator"),
        Membership(1.0),
        data_servers={"ds0": ""},
        ledger=lambda: ledger,
        event=lambda kind, detail: None,
        clock=lambda: 0.0,
        wake=asyncio.Event(),
        poll=0.1,
        false_reports=3,
    )
    workers.audit.strikes["w"] = 1  # fenced by an earlier false report
    assert ledger.assign("w") == ("ds0", 0)
    workers.report("w", {"batch": 0, "gen": 0, "ok": True})  # refused: back to pending
    assert ledger.pending == [0, 1]
    workers.settle([0])
    assert ledger.checkpoint([0]) == [0]  # the data server applied it: committed once
    assert ledger.pending == [1] and ledger.committed == [0]
    ledger.check()


async def test_an_honest_report_taken_while_the_commit_is_journaled_is_no_strike(tmp_path):
    """A done-report of an applied batch that arrives while the checkpoint's commit record is
    being written is judged by that checkpoint, not struck at the next one."""
    net = MemoryNetwork(capacity=4)
    cfg = CoordinatorConfig(data_servers=("ds0",), journal=str(tmp_path / "journal"))
    coordinator = Coordinator(net.endpoint("coordinator"), cfg)
    coordinator.ledger = ledger = Ledger({"ds0": [0, 1]})
    applied: list[list[int]] = [[0], []]

    async def call_all(op, per_ds=None, arrays=(), **meta):
        reply = {"applied": applied.pop(0)} if op == "fence" else {"digest": "d", "model": "m"}
        return {"ds0": Frame(meta=reply)}

    async def journal(record):
        if record["kind"] == "commit" and ledger.generation == 0:  # the worker's ack came
            coordinator.workers.report("w", {"batch": 0, "gen": 0, "ok": True})

    coordinator._call_all = call_all  # type: ignore[method-assign]
    coordinator._journal = journal  # type: ignore[method-assign]
    assert ledger.assign("w") == ("ds0", 0)
    await coordinator._checkpoint()
    await coordinator._checkpoint()
    assert ledger.committed == [0]
    assert not coordinator.workers.audit.fenced("w"), coordinator.workers.audit.strikes


@pytest.mark.slow
async def test_a_stranger_worker_with_the_secret_is_refused():
    out = await H.attack_stranger_worker(seconds=110)
    assert out["refused_ok"], out
    assert not out["welcomed"] and out["task_frames_to_stranger"] == 0
    assert out["refused_heads"].get("unknown_peer", 0) > 0  # 401 at every heartbeat
    assert out["exactly_once"] and out["epochs"] == 2


@pytest.mark.slow
async def test_a_control_message_forged_by_a_worker_is_refused_and_the_job_finishes():
    out = await H.attack_forged_control(seconds=110, tries=10)
    assert out["refused_ok"], out
    assert list(out["sends"]) and all(k.startswith("AdmissionError") for k in out["sends"])
    assert out["forged_counted"][0] == 10  # counted (and logged) by the data server
    assert out["exactly_once"] and out["epochs"] == 2


@pytest.mark.slow
async def test_a_worker_reporting_done_without_gradients_is_fenced():
    out = await H.attack_done_without_gradients(seconds=110)
    assert out["fenced"] == ["w1"] and out["false_reports"]["w1"] >= 3, out
    assert out["exactly_once"] and out["epochs"] == 2
    assert out["generation"] < 40, out  # no livelock of generations
