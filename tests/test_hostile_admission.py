"""Hostile requests against live parties: frames the plan cannot take, shapes that overflow,
floods of malformed requests. Each is refused with a 4xx naming its problem, and the parties
still train to the parameters of an unattacked run, bit for bit."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import numpy as np
import orjson
import pytest

from hostile_helpers import (
    ACT,
    GRAD,
    assert_done,
    assert_same_params,
    field_of,
    frame_request,
    incarnation,
    make_job,
    metrics_headers,
    post,
    run_pair,
    spec_hash,
    wait_healthy,
)
from tandem.transports.base import Frame

pytestmark = pytest.mark.slow


async def test_frames_outside_the_plan_are_refused_naming_the_field(tmp_path, hostile_reference):
    """A peer (holding the secret and its process's identity) sends frames of the right
    dtype and width with a batch id or micro-batch index out of range, one row instead of a
    group's, or commands a follower cannot run: each gets a 4xx naming the field, before it
    is accepted, and training is unaffected."""
    job = make_job(tmp_path)
    spec = spec_hash(job)

    async def attack(job, finished):
        lead, fol = job.url("leader"), job.url("follower")
        await wait_healthy(lead)
        await wait_healthy(fol)
        answers: list[tuple[str, int, str]] = []
        async with aiohttp.ClientSession() as s:
            # wait for the spec to be agreed (frames before that are refused by spec hash)
            for _ in range(400):
                async with s.get(
                    lead + "/metrics", headers=metrics_headers("leader", "follower")
                ) as r:
                    if "tandem_party_step" in await r.text():
                        break
                await asyncio.sleep(0.05)
            lead_inc = await incarnation(lead, "leader", "follower")
            fol_inc = await incarnation(fol, "follower", "leader")
            as_follower = dict(receiver="leader", to=lead_inc, sender="follower")
            as_leader = dict(receiver="follower", to=fol_inc, sender="leader")
            one = np.zeros((1, 4), np.float32)
            group = np.zeros((8, 4), np.float32)
            idx = np.arange(16, dtype=np.int64)
            probes = [
                ("act b", lead, as_follower, fol_inc, ACT, {"b": 10**6, "m": 0}, (group,)),
                ("act m", lead, as_follower, fol_inc, ACT, {"b": 0, "m": 10**3}, (group,)),
                ("act 1 row", lead, as_follower, fol_inc, ACT, {"b": 0, "m": 0}, (one,)),
                ("grad b", fol, as_leader, lead_inc, GRAD, {"b": -1, "m": 0}, (group,)),
                (
                    "batch b",
                    fol,
                    as_leader,
                    lead_inc,
                    "ctl",
                    {"cmd": "batch", "b": 10**6, "n": 2, "c": 1, "mode": "train", "data": "train"},
                    (idx,),
                ),
                ("cmd", fol, as_leader, lead_inc, "ctl", {"cmd": "explode"}, ()),
            ]
            for k, (name, url, who, inc, channel, meta, arrays) in enumerate(probes):
                headers, body = frame_request(
                    **who,
                    sender_inc=inc,
                    channel=channel,
                    msg_id=10**6 + k,
                    frame=Frame(meta=meta, arrays=arrays),
                    spec=spec,
                )
                status, text = await post(s, url, headers, body)
                answers.append((name, status, text))
        return answers

    results, answers = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    by_name = {name: (status, field_of(text), text) for name, status, text in answers}
    assert by_name["act b"][:2] == (422, "b"), by_name["act b"]
    assert by_name["grad b"][:2] == (422, "b"), by_name["grad b"]
    assert by_name["batch b"][:2] == (422, "b"), by_name["batch b"]
    assert by_name["cmd"][:2] == (422, "cmd"), by_name["cmd"]
    # batch 0 may be over by the time they arrive: then the batch id is what is wrong
    assert by_name["act m"][0] == 422 and by_name["act m"][1] in ("b", "m"), by_name["act m"]
    assert by_name["act 1 row"][0] == 422 and by_name["act 1 row"][1] in ("b", "rows")


async def test_commands_the_negotiation_cannot_take_are_refused_from_the_start(
    tmp_path, hostile_reference
):
    """From the moment the follower serves (before and during negotiation, and while it
    prepares its model), commands its negotiation cannot take — a batch of a batch id far
    ahead, an unknown command — are refused with 422 naming the field; the job trains on."""
    job = make_job(tmp_path)

    async def attack(job, finished):
        fol = job.url("follower")
        await wait_healthy(fol)
        fol_inc = await incarnation(fol, "follower", "leader")
        answers = []
        async with aiohttp.ClientSession() as s:
            lead_inc = ""
            for k in range(300):
                if finished.is_set():
                    break
                if not lead_inc:
                    try:
                        lead_inc = await incarnation(job.url("leader"), "leader", "follower")
                    except (aiohttp.ClientError, OSError, KeyError):
                        lead_inc = "not-yet"
                meta = (
                    {"cmd": "batch", "b": 10**6, "n": 2, "c": 1, "mode": "train", "data": "train"}
                    if k % 2 == 0
                    else {"cmd": "explode"}
                )
                headers, body = frame_request(
                    receiver="follower",
                    to=fol_inc,
                    sender="leader",
                    sender_inc=lead_inc,
                    channel="ctl",
                    msg_id=10**6 + k,
                    frame=Frame(
                        meta=meta, arrays=(np.arange(16, dtype=np.int64),) if k % 2 == 0 else ()
                    ),
                )
                try:
                    status, text = await post(s, fol, headers, body)
                except (aiohttp.ClientError, OSError):
                    break
                answers.append((status, field_of(text)))
                await asyncio.sleep(0.01)
        return answers

    results, answers = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert answers
    # refused as not a command of this moment, or (a spec agreed since) by its spec hash
    assert {status for status, _ in answers} <= {409, 422, 503}, answers
    assert {f for status, f in answers if status == 422} <= {"cmd", "b"}


async def test_overflowing_shape_gets_400_and_training_goes_on(tmp_path, hostile_reference):
    """A signed frame whose array shape multiplies past 64 bits: 400 (not a 500 and a
    traceback), and the party trains on."""
    job = make_job(tmp_path)
    spec = spec_hash(job)

    async def attack(job, finished):
        lead = job.url("leader")
        await wait_healthy(lead)
        await wait_healthy(job.url("follower"))
        lead_inc = await incarnation(lead, "leader", "follower")
        fol_inc = await incarnation(job.url("follower"), "follower", "leader")
        statuses = []
        async with aiohttp.ClientSession() as s:
            for k, shape in enumerate(([2**40, 2**40], [0, 2**62, 2**62], [1] * 40)):
                header = orjson.dumps(
                    {
                        "sender": "follower",
                        "channel": "ctl",
                        "id": 10**6 + k,
                        "spec": "",
                        "meta": {},
                        "arrays": [{"dtype": "<f4", "shape": shape, "nbytes": 0}],
                    }
                )
                raw = b"TDM1" + len(header).to_bytes(4, "little") + header
                headers, _ = frame_request(
                    receiver="leader",
                    to=lead_inc,
                    sender="follower",
                    sender_inc=fol_inc,
                    channel="ctl",
                    msg_id=10**6 + k,
                    frame=Frame(),
                )
                from tandem.transports import auth

                headers["X-Tandem-Total"] = str(len(raw))
                headers["X-Tandem-Spec"] = spec  # (the spec header is checked before the body)
                auth.sign(
                    b"s3cret",
                    "POST",
                    "/tandem/v1/frame",
                    headers,
                    auth.body_digest([raw]),
                    receiver="leader",
                    to=lead_inc,
                )
                statuses.append(await post(s, lead, headers, raw))
        return statuses

    results, statuses = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    for status, text in statuses:
        # 400 (the codec), or 409 before the spec is agreed (an empty spec hash is expected)
        assert status in (400, 409) and "Traceback" not in text, (status, text)
    assert any(status == 400 and "overflows 64-bit" in text for status, text in statuses) or all(
        s == 409 for s, _ in statuses
    )


def _garbage_requests(port: int, count: int) -> list[bytes]:
    """Send ``count`` malformed HTTP requests on fresh connections; the first bytes of each
    answer."""
    heads = [
        b"GARBAGE\r\n\r\n",
        b"POST /tandem/v1/frame HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
        b"POST /tandem/v1/frame HTTP/1.1\r\nHost: x\r\nX-Tandem-Sender: leader\r\n"
        b"Content-Length: 4\r\n\r\nabcd",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /tandem/v1/frame HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    ]
    answers = []
    for i in range(count):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(heads[i % len(heads)])
            c.shutdown(socket.SHUT_WR)
            try:
                answers.append(c.recv(4096))
            except OSError:
                answers.append(b"")
    return answers


async def test_malformed_flood_logs_few_short_lines_and_no_banner(
    tmp_path, hostile_reference, caplog
):
    """Hundreds of malformed unauthenticated requests: each answered 4xx without a version
    banner; the parties log a few one-line records (rate-limited), never a traceback; an
    unauthenticated ``/healthz`` learns liveness only."""
    job = make_job(tmp_path)
    caplog.set_level(logging.INFO)

    async def attack(job, finished):
        await wait_healthy(job.url("follower"))
        answers = await asyncio.to_thread(_garbage_requests, job.ports["follower"], 300)
        async with aiohttp.ClientSession() as s:
            async with s.get(job.url("follower") + "/healthz") as r:
                health = (r.headers.get("Server"), await r.json())
        return answers, health

    results, (answers, health) = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert health == ("tandem", {"status": "ok"})
    for raw in answers:
        if raw:  # (a connection closed without an answer is fine too)
            head = raw.split(b"\r\n\r\n")[0].decode("latin-1")
            assert head.startswith(("HTTP/1.1 4", "HTTP/1.0 4")), head
            assert "aiohttp" not in head and "Python" not in head, head
    wire = [
        r
        for r in caplog.records
        if r.name.startswith(("tandem.transports", "aiohttp.server", "aiohttp.web"))
    ]
    assert all(r.exc_info is None and "Traceback" not in r.getMessage() for r in wire)
    assert all(len(r.getMessage()) <= 300 for r in wire)
    assert len(wire) <= 40, [r.getMessage() for r in wire][:50]  # 300 bad requests
