"""A party that cannot start tells its peers why, and they stop within seconds naming it
(`tandem.parties.split.process.notice`); a secret that differs is found by both parties at once.
Every party runs as its own OS process (`tandem party`), the peer that must be told started
first (a notice reaches only a peer already listening)."""

from __future__ import annotations

import json
import time

import pytest

from party_helpers import Job, healthy, wait_until
from table_helpers import TableJob

pytestmark = pytest.mark.slow
FAST = 15.0  # seconds within which the told party must stop (its `wait` is 60)


def _error_line(err: str) -> dict:
    """The ``{"status": "error", ...}`` JSON line a failed party writes on stderr."""
    lines = [json.loads(x) for x in err.splitlines() if x.startswith('{"status": "error"')]
    assert lines, err[-3000:]
    return lines[-1]


def _told(job: TableJob, failing: str, told: str, column: str) -> None:
    job.cfg[failing]["data"]["features"] = [f"{failing}_a", column] + (
        ["city"] if failing == "shop" else []
    )
    job.write()
    waiting = job.start(told)
    wait_until(lambda: healthy(job.url(told)), 60, f"{told} to listen")
    failing_proc = job.start(failing)
    rc, out, err = failing_proc.finish(60)
    assert rc == 2 and out is None, err[-3000:]
    stopped = time.monotonic()
    assert f"has no column(s) [{column!r}]" in err
    rc, out, err = waiting.finish(60)
    assert time.monotonic() - stopped < FAST, "the told party waited for its timeout"
    assert rc == 1 and out is None, err[-3000:]
    line = _error_line(err)
    assert line["party"] == told
    assert f"{failing!r} stopped before training started" in line["reason"], line
    assert f"has no column(s) [{column!r}]" in line["reason"], line
    assert "not reachable" not in err and "no agreement" not in err


def test_a_follower_missing_a_column_stops_its_leader_naming_it(tmp_path):
    _told(TableJob(tmp_path, ["bank", "shop"]), "shop", "bank", "age")


def test_a_leader_missing_a_column_stops_its_follower_naming_it(tmp_path):
    _told(TableJob(tmp_path, ["bank", "shop"]), "bank", "shop", "income")


def test_a_follower_told_by_the_leader_tells_nothing_back_and_the_others_hear(tmp_path):
    """A star: one follower fails; the leader stops naming it and tells the other follower,
    which stops naming the leader (and, through its reason, the follower)."""
    job = TableJob(tmp_path, ["bank", "shop", "telco"], topology=_star())
    job.cfg["telco"]["data"]["features"] = ["telco_a", "rent"]
    job.write()
    waiting = {p: job.start(p) for p in ("bank", "shop")}
    for p in waiting:
        wait_until(lambda p=p: healthy(job.url(p)), 60, f"{p} to listen")
    rc, _, err = job.start("telco").finish(60)
    assert rc == 2, err[-3000:]
    stopped = time.monotonic()
    results = {p: proc.finish(60) for p, proc in waiting.items()}
    assert time.monotonic() - stopped < FAST
    bank, shop = (_error_line(results[p][2])["reason"] for p in ("bank", "shop"))
    assert bank.startswith("'telco' stopped before training started") and "'rent'" in bank
    assert shop.startswith("'bank' stopped before training started: 'telco' stopped"), shop


def _star() -> dict:
    return {"kind": "star", "leader": "bank", "followers": ["shop", "telco"]}


def test_different_secrets_both_parties_say_so_at_once(tmp_path):
    job = Job(tmp_path)
    job.cfg["follower"]["security"]["secret"] = "another-secret"
    follower = job.start("follower")
    wait_until(lambda: healthy(job.url("follower")), 60, "the follower to listen")
    leader = job.start("leader")
    results = {"leader": leader.finish(60), "follower": follower.finish(FAST + 30)}
    for me, other in (("leader", "follower"), ("follower", "leader")):
        rc, out, err = results[me]
        assert rc == 1 and out is None, (me, err[-3000:])
        reason = _error_line(err)["reason"]
        assert "secret" in reason and repr(other) in reason, (me, reason)
        assert "authentication" in reason, (me, reason)
    # the follower refused the leader's frames: one clear warning naming it, then its error
    err = results["follower"][2]
    warnings = [x for x in err.splitlines() if "refused a request from its peer 'leader'" in x]
    assert len(warnings) == 1, err[-3000:]
    assert "different secrets" in warnings[0]


# -- the watch itself, on two live transports in this process ----------------------------------
async def _pair(secret_b: bytes):
    from http_helpers import open_pair

    return await open_pair(a_kw={"secret": b"s3cret"}, b_kw={"secret": secret_b})


async def test_a_forged_request_in_a_peers_name_stops_nothing(caplog):
    """The peer accepts the probe (same secret): the refused request was a stranger's, and the
    guarded work finishes; one warning names the peer, a second refusal is counted silently."""
    import asyncio

    from tandem.parties.split.process.notice import PeerWatch

    a, b = await _pair(b"s3cret")
    try:
        watch = PeerWatch(a, ["b"])
        a.on_auth_refused = watch.auth_refused

        async def work() -> str:
            watch.auth_refused("b", "bad signature (different secret, or altered request)")
            watch.auth_refused("b", "bad signature (different secret, or altered request)")
            await asyncio.wait_for(b.recv("a", "notice"), 10)  # the probe arrived, and passed
            return "finished"

        with caplog.at_level("WARNING", logger="tandem.parties.split.process.notice"):
            assert await watch.guard(work()) == "finished"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 1 and "its peer 'b'" in warnings[0], warnings
    finally:
        await a.aclose()
        await b.aclose()


async def test_a_forged_request_for_a_peer_not_started_yet_stops_nothing(monkeypatch):
    """A stranger's unsigned request in the name of a peer that is not listening yet (the
    party waits for it) cannot stop the party: that peer cannot have sent it, so its silence
    says nothing of the secrets; the party asks again at the next refusal."""
    import asyncio

    import aiohttp

    from http_helpers import open_pair
    from ports import free_port
    from tandem.parties.split.process import notice
    from tandem.transports.http import FRAME_PATH

    monkeypatch.setattr(notice, "PROBE_SECONDS", 0.5)
    a, b = await open_pair(a_kw={"secret": b"s3cret"}, b_kw={"secret": b"s3cret"})
    await b.aclose()  # b's address: nothing listens there (yet)
    a.add_peer("b", f"http://127.0.0.1:{free_port()}")
    try:
        watch = notice.PeerWatch(a, ["b"])
        a.on_auth_refused = watch.auth_refused

        async def work() -> str:
            async with aiohttp.ClientSession() as s:  # no secret: just the peer's name
                async with s.post(a.url + FRAME_PATH, headers={"X-Tandem-Sender": "b"}) as r:
                    assert r.status == 401
            await asyncio.sleep(2.0)  # the probe's time, and more
            return "finished"

        assert await watch.guard(work()) == "finished"
        assert "b" not in watch._probed  # a later refusal in b's name is probed again
    finally:
        await a.aclose()


async def test_a_peer_refusing_the_probe_is_a_secret_that_differs():
    import asyncio

    from tandem.errors import AuthenticationError
    from tandem.parties.split.process.notice import PeerWatch

    a, b = await _pair(b"other")
    try:
        watch = PeerWatch(a, ["b"])
        watch.auth_refused("b", "bad signature")
        with pytest.raises(AuthenticationError, match="between 'a' and 'b'|'b' no longer answers"):
            await watch.guard(asyncio.Event().wait())
    finally:
        await a.aclose()
        await b.aclose()


async def test_an_abort_notice_stops_the_guarded_work_naming_the_party():
    import asyncio

    from tandem.parties.split.process.notice import PeerAbortedError, PeerWatch, tell_peers

    a, b = await _pair(b"s3cret")
    try:
        watch = PeerWatch(a, ["b"])
        assert await tell_peers(b, ["a"], "its table has no column 'age'") == ["a"]
        with pytest.raises(PeerAbortedError, match="^'b' stopped before training started: its"):
            await watch.guard(asyncio.Event().wait())
        assert watch.gone == {"b"}
    finally:
        await a.aclose()
        await b.aclose()


async def test_the_transport_reports_each_refused_signature_of_a_configured_peer():
    from tandem.errors import AuthenticationError
    from tandem.transports.base import Frame

    a, b = await _pair(b"other")
    try:
        heard: list[tuple[str, str]] = []
        a.on_auth_refused = lambda peer, reason: heard.append((peer, reason))
        with pytest.raises(AuthenticationError, match="authentication failed"):
            await b.send("a", "ctl", Frame(meta={"cmd": "hello"}))
        assert heard and heard[0][0] == "b" and "key id" in heard[0][1], heard
    finally:
        await a.aclose()
        await b.aclose()
