"""Hostile-network benchmark: two split-learning parties train over HTTP on loopback while each
attack class of issue 30 runs against them, one class per run.

    python -m bench.hostile --json        # one JSON line

Each run is a real job (`tandem.parties.split.process.standalone.run_party` for the leader and
the follower: negotiation, training, evaluation, export) in a process of its own (so that every
run's memory is measured from the same start), with ``[http] inbound_budget`` set
(``--budget-mib``); its attack runs beside it in the same process for at most ``--seconds``
(and stops when the parties finish). The attackers whose own client work is heavy (the
slow-loris, ``memory``, ``drained`` and ``future_flood``) run in one more process
(`bench.hostile_apart`), so that their work does not stall the loop whose ``/healthz`` latency
is measured; that process runs at niceness ``--attacker-nice`` (19 by default, 0 for the
parties' own priority). A real attacker sits on another machine: on a small one (2 cores for
two parties and the attacker) its sending would otherwise show in the party's latency as time
the party's loop waits in the run queue for a core, not as anything the party does. A
reference run without attack comes first. After each attack the parties must
finish ``done`` with exactly the reference run's exported parameters, and every hostile request
must have been refused (no 2xx, no 5xx; a party that finished meanwhile may answer 503 or 410);
otherwise the attack's name lands in ``failed``.

Attack classes (the rows of issue 30's table):

* ``identity``: mutual TLS, no secret; a certificate of the same CA issued to "mallory" sends
  ``stop`` claiming to be the leader (expect 403);
* ``replay``: a signed ``stop`` captured for another process (another job with the same
  secret and names) replayed to the follower (expect 421);
* ``memory``: 50 concurrent signed uploads declaring 64 MiB, sending 48 MiB on channels the
  task does not use, then closing (expect 403 at the head);
* ``slowloris``: 1000 connections (a process of their own) whose request heads never end,
  reopened as soon as they are closed;
* ``slow_body``: on every stream the parties use, requests with the peer's identity whose
  body stops after 10 bytes while the connection stays open;
* ``future_flood``: a peer holding the secret sends requests stamped 59 s ahead (expect 401)
  and within the skew, overflowing its own nonce memory;
* ``plan``: frames of the right dtype and width with a batch id or micro-batch index out of
  range or one row, and commands a follower cannot run (expect 422);
* ``overflow``: a frame whose shape overflows 64 bits (expect 400; 409 before the spec is set);
* ``malformed``: hundreds of malformed unauthenticated requests (expect 4xx; log lines are
  counted: at most a few, none with a traceback);
* ``bomb`` and ``drained``: an outsider's compressed bodies to every route (expect 415) and
  64 connections of unsigned 48 MiB bodies (expect 401, none of them read beyond a small
  bound): `tandem.testing.hostile_bodies`;
* ``stalled_partial``, ``forged_control`` and ``metrics_stranger``: with per-party keys, a
  roster member's stalled partial signed as the leader on the gradient channel and the
  follower's key signing ``stop`` as the leader (expect 403), and strangers reading
  ``/metrics`` (expect 401, nothing in it): `tandem.testing.hostile_insider`;
* ``stranger_worker``, ``elastic_forged_control``, ``done_without_gradients`` (elastic) and
  ``oversized_update``, ``inflated_count``, ``inflated_count_after_report``,
  ``nonfinite_wait`` (federated): insiders and outsiders against the other roles, each against
  a job of its own (`tandem.testing.hostile_roles`: no split export to compare; the attack's own
  verdict decides; with only these chosen, no reference run).

Reported: ``attacks`` (count), ``failed`` (names), ``max_rss_mb`` (the highest RSS of an
attacked split run's process: both parties and the attackers that share their process) and
``rss_budget_mb`` (the reference run's highest RSS plus ``inbound_budget`` plus a stated 64 MiB
for the attackers' own buffers and transient copies), ``healthz_p99_ms_under_attack`` (the
follower's ``/healthz``, polled every 50 ms on fresh connections while it runs, over every
attack; ``healthz_failed`` per attack counts the polls that failed while the follower served;
``healthz_p99_ms`` per attack, ``healthz_p99_ms_reference`` without attack), ``per_attack``
details and ``load`` (``os.getloadavg()``). Per run, ``loop_lag`` says why the parties' loop
was late (`bench.hostile_lag`: late wake-ups, split into time on a CPU, i.e. the party's own
work, time in the run queue and time blocked, e.g. on the GIL; ``TANDEM_HOSTILE_STACKS=1``
adds where the loop thread was when it stalled) and ``cpu_s`` the CPU seconds of the parties'
process and of the attacker process. Targets: ``failed`` empty, ``max_rss_mb <=
rss_budget_mb``, ``healthz_p99_ms_under_attack <= 50``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import ipaddress
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from tandem.testing import hostile_bodies, hostile_insider, hostile_roles
from tandem.transports.ports import free_port

from . import hostile_apart, hostile_lag

MiB = 1 << 20
SECRET = b"s3cret"
ACT, GRAD = "act/bottom_follower->top", "grad/bottom_follower->top"
FRAME = "/tandem/v1/frame"
ROWS, TEST_ROWS, F_LEADER, F_FOLLOWER = 64, 24, 4, 3
#: niceness of the attacker processes of their own (see the module docstring)
ATTACKER_NICE = 19
NICE_ENV = "TANDEM_HOSTILE_ATTACKER_NICE"
CONSTANT_MB = 64  # the attackers' own buffers (a 48 MiB payload) and transient copies
ATTACKS = (
    "identity",
    "replay",
    "memory",
    "slowloris",
    "slow_body",
    "future_flood",
    "plan",
    "overflow",
    "malformed",
    "bomb",
    "drained",
    *hostile_insider.ATTACKS,
    *hostile_roles.ATTACKS,
)


# -- a job on disk -------------------------------------------------------------------------------
def _toml(table: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):  # an inline table
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return repr(v)

    top = [f"{k} = {value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    subs = [
        f"\n[{k}]\n" + "\n".join(f"{sk} = {value(sv)}" for sk, sv in v.items())
        for k, v in table.items()
        if isinstance(v, dict)
    ]
    return "\n".join(top) + "\n" + "\n".join(subs) + "\n"


class Job:
    """Two party configs in ``folder`` (data generated from ``seed``), with fresh ports."""

    def __init__(self, folder: Path, *, epochs: int, budget: int, seed: int = 0) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(seed)
        n = ROWS + TEST_ROWS
        xl = rng.normal(size=(n, F_LEADER)).astype("f4")
        xf = rng.normal(size=(n, F_FOLLOWER)).astype("f4")
        y = (xl[:, 0] + xf[:, 0] > 0).astype("f4")
        np.savez(
            folder / "leader.npz",
            x_train=xl[:ROWS],
            y_train=y[:ROWS],
            x_test=xl[ROWS:],
            y_test=y[ROWS:],
        )
        np.savez(folder / "follower.npz", x_train=xf[:ROWS], x_test=xf[ROWS:])
        self.ports = {"leader": free_port(), "follower": free_port()}
        self.scheme = "http"

        def common(role: str) -> dict[str, Any]:
            return {
                "role": role,
                "name": role,
                "export_dir": f"out/{role}",
                "progress": False,
                "wait": 30.0,
                "listen": {"host": "127.0.0.1", "port": self.ports[role]},
                "security": {
                    "secret": SECRET.decode(),
                    "retry_timeout": 10.0,
                    "max_frame_bytes": 64 * MiB,
                },
                "http": {"inbound_budget": budget},
                "model": {"topology": "leader_follower", "cut": 4, "hidden": [8], "out": 1},
                "data": {"source": f"{role}.npz"},
            }

        self.cfg = {
            "leader": {
                **common("leader"),
                "peers": {"follower": self.url("follower")},
                "schema": {"follower": F_FOLLOWER},
                "train": {"batch_size": 16, "epochs": epochs, "groups": 2, "seed": 3},
            },
            "follower": {**common("follower"), "peers": {"leader": self.url("leader")}},
        }

    def url(self, role: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.ports[role]}"

    def use_tls(self, ca: str, certs: dict[str, tuple[str, str]]) -> None:
        self.scheme = "https"
        for role in ("leader", "follower"):
            sec = self.cfg[role]["security"]
            sec.pop("secret")
            sec.update({"tls_cert": certs[role][0], "tls_key": certs[role][1], "tls_ca": ca})
            other = "follower" if role == "leader" else "leader"
            self.cfg[role]["peers"] = {other: self.url(other)}

    def write(self) -> dict[str, Path]:
        paths = {}
        for role, table in self.cfg.items():
            paths[role] = self.folder / f"{role}.toml"
            paths[role].write_text(_toml(table))
        return paths

    @staticmethod
    def exported_from(folder: Path) -> dict[str, np.ndarray]:
        """The parameters both parties of the job in ``folder`` exported, by name."""
        from tandem.parties.export import load_stages

        out: dict[str, np.ndarray] = {}
        for role in ("leader", "follower"):
            loaded = load_stages(folder / "out" / role / f"{role}.safetensors")
            _flatten(loaded.stages, role, out)
        return out


def _flatten(node: Any, prefix: str, out: dict[str, np.ndarray]) -> None:
    if isinstance(node, dict):
        for k, v in node.items():
            _flatten(v, f"{prefix}/{k}", out)
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            _flatten(v, f"{prefix}/{i}", out)
    else:
        out[prefix] = np.asarray(node)


# -- what attackers send --------------------------------------------------------------------------
def frame_request(
    *,
    receiver: str,
    to: str,
    sender: str,
    sender_inc: str,
    channel: str,
    msg_id: int,
    meta: dict[str, Any] | None = None,
    arrays: tuple[np.ndarray, ...] = (),
    spec: str = "",
    secret: bytes | None = SECRET,
    ahead: float = 0.0,
    raw_body: bytes | None = None,
) -> tuple[dict[str, str], bytes]:
    from tandem.transports import auth, codec
    from tandem.transports.base import Frame

    body = raw_body
    if body is None:
        frame = Frame(sender=sender, channel=channel, msg_id=msg_id, spec_hash=spec)
        body = codec.encode(frame.replace(meta=meta or {}, arrays=arrays))
    headers = {
        "X-Tandem-Sender": sender,
        "X-Tandem-Incarnation": sender_inc,
        "X-Tandem-Channel": channel,
        "X-Tandem-Msg-Id": str(msg_id),
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(len(body)),
        "X-Tandem-Spec": spec,
    }
    if secret is not None:
        auth.sign(
            secret,
            "POST",
            FRAME,
            headers,
            auth.body_digest([body]),
            receiver=receiver,
            to=to,
            clock=lambda: time.time() + ahead,
        )
    return headers, body


async def _post(
    s: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes
) -> tuple[int, str] | None:
    """``(status, text)``; None when the party is gone (it finished its run meanwhile)."""
    try:
        async with s.post(url + FRAME, data=body, headers=headers) as r:
            return r.status, await r.text()
    except (aiohttp.ClientError, OSError):
        return None


async def incarnation(url: str, name: str, caller: str) -> str:
    from tandem.transports import auth

    headers = {"X-Tandem-Sender": caller}
    auth.sign(SECRET, "GET", "/healthz", headers, auth.EMPTY_SHA, receiver=name)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/healthz", headers=headers) as r:
            return str((await r.json())["incarnation"])


async def wait_healthy(url: str, ctx: ssl.SSLContext | None = None, timeout: float = 30) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx or True)) as s:
        while loop.time() < deadline:
            try:
                async with s.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} never answered /healthz")


class Ctx:
    """What an attack gets: the job, when to stop, and the spec hash the parties agree on."""

    def __init__(self, job: Job, finished: asyncio.Event, seconds: float, spec: str) -> None:
        self.job, self.finished, self.spec = job, finished, spec
        self.deadline = asyncio.get_running_loop().time() + seconds

    def going(self) -> bool:
        return not self.finished.is_set() and asyncio.get_running_loop().time() < self.deadline


def _refused(statuses: list[int], allowed: set[int]) -> dict[str, Any]:
    """Counts by status; ``refused_ok``: every request got an expected refusal (or, from a
    party that finished its run meanwhile, 503 closing or 410 for the incarnation it
    impersonates, which said goodbye)."""
    counts: dict[int, int] = {}
    for st in statuses:
        counts[st] = counts.get(st, 0) + 1
    return {
        "statuses": counts,
        "refused_ok": bool(statuses) and set(counts) <= allowed | {410, 503},
    }


# -- the attacks ----------------------------------------------------------------------------------
async def attack_identity(ctx: Ctx, mallory: tuple[str, str], ca: str) -> dict[str, Any]:
    tls = ssl.create_default_context(cafile=ca)
    tls.load_cert_chain(*mallory)
    url = ctx.job.url("follower")
    await wait_healthy(url, tls)
    statuses = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=tls)) as s:
        i = 0
        while ctx.going() and i < 200:
            headers, body = frame_request(
                receiver="follower",
                to="",
                sender="leader",
                sender_inc=f"mallory{i}",
                channel="ctl",
                msg_id=i,
                meta={"cmd": "stop", "reason": "forged"},
                secret=None,
            )
            answer = await _post(s, url, headers, body)
            if answer is None:
                break
            statuses.append(answer[0])
            i += 1
            await asyncio.sleep(0.02)
    return _refused(statuses, {403})


async def attack_replay(ctx: Ctx) -> dict[str, Any]:
    url = ctx.job.url("follower")
    await wait_healthy(url)
    statuses = []
    async with aiohttp.ClientSession() as s:
        i = 0
        while ctx.going() and i < 500:
            headers, body = frame_request(
                receiver="follower",
                to="0123456789abcdef",  # the follower process of another job
                sender="leader",
                sender_inc="fedcba9876543210",
                channel="ctl",
                msg_id=i,
                meta={"cmd": "stop", "reason": "replayed"},
            )
            answer = await _post(s, url, headers, body)
            if answer is None:
                break
            statuses.append(answer[0])
            i += 1
            await asyncio.sleep(0.01)
    return _refused(statuses, {421})


async def _partial_upload(url: str, headers: dict[str, str], payload: memoryview, declared: int):
    host, port = url.split("//")[1].split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:  # the party finished meanwhile
        return None
    answer: asyncio.Future[bytes] | None = None
    try:
        head = [f"POST {FRAME} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {declared}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
        answer = asyncio.ensure_future(reader.readline())
        for pos in range(0, len(payload), MiB):
            if answer.done():
                break
            writer.write(payload[pos : pos + MiB])
            await writer.drain()
        if not answer.done():
            await asyncio.sleep(0.05)
        return _status_of(answer)
    except OSError:  # reset once the receiver closed: its answer may have come before
        return _status_of(answer)
    finally:
        if answer is not None:
            answer.cancel()
            if answer.done() and not answer.cancelled():
                answer.exception()  # retrieved: the connection's end is expected here
        writer.transport.abort()


def _status_of(answer: asyncio.Future[bytes] | None) -> int | None:
    """The status of the answer's first line, when one came (None otherwise)."""
    if answer is None or not answer.done() or answer.cancelled() or answer.exception():
        return None
    line = answer.result().decode("latin-1")
    return int(line.split()[1]) if line.startswith("HTTP/") else None


async def attack_memory(ctx: Ctx) -> dict[str, Any]:
    from tandem.transports import auth

    lead, fol = ctx.job.url("leader"), ctx.job.url("follower")
    await wait_healthy(lead)
    await wait_healthy(fol)
    to = await incarnation(lead, "leader", "follower")
    inc = await incarnation(fol, "follower", "leader")
    payload = memoryview(np.ones(48 * MiB, np.uint8))
    statuses: list[int] = []
    round_ = 0
    while ctx.going() and round_ < 20:
        heads = []
        for i in range(50):
            h = {
                "X-Tandem-Sender": "follower",
                "X-Tandem-Incarnation": inc,
                "X-Tandem-Channel": f"junk{i}",
                "X-Tandem-Msg-Id": str(10**6 + round_),
                "X-Tandem-Chunk": "0",
                "X-Tandem-Chunks": "1",
                "X-Tandem-Offset": "0",
                "X-Tandem-Total": str(64 * MiB),
                "X-Tandem-Spec": "",
            }
            auth.sign(
                SECRET, "POST", FRAME, h, auth.DIGEST_PREFIX + "0" * 64, receiver="leader", to=to
            )
            heads.append(h)
        got = await asyncio.gather(*(_partial_upload(lead, h, payload, 64 * MiB) for h in heads))
        statuses += [g for g in got if g is not None]  # None: no answer (the party finished)
        round_ += 1
    return _refused(statuses, {403})


async def attack_slowloris(ctx: Ctx) -> dict[str, Any]:
    url = ctx.job.url("follower")
    await wait_healthy(url)
    left = max(1.0, ctx.deadline - asyncio.get_running_loop().time())
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.hostile", "--loris", url, "1000", f"{left:.1f}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        while ctx.going() and proc.returncode is None:
            await asyncio.sleep(0.1)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        out, _ = await proc.communicate()
    opened = int(out.split()[-1]) if out.strip() else 0
    return {"connections_opened": opened, "refused_ok": opened >= 1000}


async def _stall(url: str, headers: dict[str, str], until: asyncio.Event) -> None:
    host, port = url.split("//")[1].split(":")
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
    except OSError:  # the party finished meanwhile
        return
    try:
        head = [f"POST {FRAME} HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + b"0123456789")
        reading = asyncio.ensure_future(reader.read())
        waiting = asyncio.ensure_future(until.wait())
        await asyncio.wait({reading, waiting}, return_when=asyncio.FIRST_COMPLETED)
        reading.cancel()
        waiting.cancel()
    finally:
        writer.transport.abort()


async def attack_slow_body(ctx: Ctx) -> dict[str, Any]:
    lead, fol = ctx.job.url("leader"), ctx.job.url("follower")
    await wait_healthy(lead)
    await wait_healthy(fol)
    lead_inc = await incarnation(lead, "leader", "follower")
    fol_inc = await incarnation(fol, "follower", "leader")
    streams = [
        (lead, "leader", lead_inc, "follower", fol_inc, "ctl"),
        (lead, "leader", lead_inc, "follower", fol_inc, ACT),
        (fol, "follower", fol_inc, "leader", lead_inc, "ctl"),
        (fol, "follower", fol_inc, "leader", lead_inc, GRAD),
    ]
    rounds = 0
    while ctx.going() and rounds < 200:
        rounds += 1
        stalls = []
        for url, receiver, to, sender, inc, channel in streams:
            headers, _ = frame_request(
                receiver=receiver, to=to, sender=sender, sender_inc=inc, channel=channel,
                msg_id=10**6 + rounds, arrays=(np.zeros((8, 4), np.float32),),
            )  # fmt: skip
            headers["X-Tandem-Total"] = headers["Content-Length"] = "4096"
            stalls.append(_stall(url, headers, ctx.finished))
        try:
            async with asyncio.timeout(0.5):
                await asyncio.gather(*stalls)
        except (TimeoutError, OSError):
            pass
    return {"rounds": rounds, "refused_ok": rounds > 0}


async def attack_future_flood(ctx: Ctx) -> dict[str, Any]:
    lead = ctx.job.url("leader")
    await wait_healthy(lead)
    statuses: dict[str, list[int]] = {"future": [], "within": []}
    bound = {"to": ""}
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            kind = "future" if i % 2 == 0 else "within"
            headers, body = frame_request(
                receiver="leader", to=bound["to"], sender="observer", sender_inc="obs",
                channel="ctl", msg_id=i, ahead=59.0 if kind == "future" else 4.0,
            )  # fmt: skip
            answer = await _post(s, lead, headers, body)
            if answer is None:
                return
            status, text = answer
            if status == 421:
                bound["to"] = orjson.loads(text)["incarnation"]
            statuses[kind].append(status)

        i = 0
        while ctx.going() and i < 70_000:
            await asyncio.gather(*(one(k) for k in range(i, i + 50)))
            i += 50
    future = _refused(statuses["future"], {401})
    within = _refused(statuses["within"], {401, 403, 421})
    return {
        "future": future["statuses"],
        "within": within["statuses"],
        "refused_ok": future["refused_ok"] and within["refused_ok"],
    }


async def attack_plan(ctx: Ctx) -> dict[str, Any]:
    lead, fol = ctx.job.url("leader"), ctx.job.url("follower")
    await wait_healthy(lead)
    await wait_healthy(fol)
    lead_inc = await incarnation(lead, "leader", "follower")
    fol_inc = await incarnation(fol, "follower", "leader")
    group, one = np.zeros((8, 4), np.float32), np.zeros((1, 4), np.float32)
    idx = np.arange(16, dtype=np.int64)
    probes: list[tuple[str, str, str, str, str, dict[str, Any], tuple[np.ndarray, ...]]] = [
        (lead, "leader", lead_inc, "follower", ACT, {"b": 10**6, "m": 0}, (group,)),
        (lead, "leader", lead_inc, "follower", ACT, {"b": 0, "m": 10**3}, (group,)),
        (lead, "leader", lead_inc, "follower", ACT, {"b": 1, "m": 0}, (one,)),
        (fol, "follower", fol_inc, "leader", GRAD, {"b": -1, "m": 0}, (group,)),
        (fol, "follower", fol_inc, "leader", "ctl", {"cmd": "batch", "b": 10**6, "n": 2,
                                                     "c": 1, "mode": "train", "data": "train"},
         (idx,)),
        (fol, "follower", fol_inc, "leader", "ctl", {"cmd": "explode"}, ()),
    ]  # fmt: skip
    statuses = []
    async with aiohttp.ClientSession() as s:
        k = 0
        while ctx.going() and k < 600:
            url, receiver, to, sender, channel, meta, arrays = probes[k % len(probes)]
            inc = fol_inc if sender == "follower" else lead_inc
            headers, body = frame_request(
                receiver=receiver, to=to, sender=sender, sender_inc=inc, channel=channel,
                msg_id=10**6 + k, meta=meta, arrays=arrays, spec=ctx.spec,
            )  # fmt: skip
            answer = await _post(s, url, headers, body)
            if answer is None:
                break
            statuses.append(answer[0])
            k += 1
            await asyncio.sleep(0.01)
    # until the spec is agreed: 403 for a stream the negotiation does not use (the stream
    # admission comes first), else 409 (the spec hash); then 422 (the plan's checks)
    return _refused(statuses, {403, 409, 422})


async def attack_overflow(ctx: Ctx) -> dict[str, Any]:
    lead = ctx.job.url("leader")
    await wait_healthy(lead)
    lead_inc = await incarnation(lead, "leader", "follower")
    fol_inc = await incarnation(ctx.job.url("follower"), "follower", "leader")
    statuses = []
    async with aiohttp.ClientSession() as s:
        k = 0
        while ctx.going() and k < 300:
            shape = ([2**40, 2**40], [0, 2**62, 2**62], [1] * 40)[k % 3]
            header = orjson.dumps(
                {"sender": "follower", "channel": "ctl", "id": 10**6 + k, "spec": "",
                 "meta": {}, "arrays": [{"dtype": "<f4", "shape": shape, "nbytes": 0}]}
            )  # fmt: skip
            raw = b"TDM1" + len(header).to_bytes(4, "little") + header
            headers, body = frame_request(
                receiver="leader", to=lead_inc, sender="follower", sender_inc=fol_inc,
                channel="ctl", msg_id=10**6 + k, raw_body=raw, spec=ctx.spec,
            )  # fmt: skip
            answer = await _post(s, lead, headers, body)
            if answer is None:
                break
            statuses.append(answer[0])
            k += 1
            await asyncio.sleep(0.01)
    return _refused(statuses, {400, 409})


class _LogCount(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines = self.tracebacks = self.longest = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("tandem.transports", "aiohttp.server", "aiohttp.web")):
            self.lines += 1
            text = record.getMessage()
            self.longest = max(self.longest, len(text))
            self.tracebacks += bool(record.exc_info) or "Traceback" in text


async def attack_malformed(ctx: Ctx) -> dict[str, Any]:
    url = ctx.job.url("follower")
    await wait_healthy(url)
    host, port = url.split("//")[1].split(":")
    heads = [
        b"GARBAGE\r\n\r\n",
        b"POST /tandem/v1/frame HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
        b"POST /tandem/v1/frame HTTP/1.1\r\nHost: x\r\nX-Tandem-Sender: leader\r\n"
        b"Content-Length: 4\r\n\r\nabcd",
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    ]
    counter = _LogCount()
    logging.getLogger().addHandler(counter)
    statuses = []
    try:
        k = 0
        while ctx.going() and k < 3000:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                break
            try:
                writer.write(heads[k % len(heads)])
                line = await asyncio.wait_for(reader.readline(), 5)
                if line.startswith(b"HTTP/"):
                    statuses.append(int(line.split()[1]))
            except (OSError, TimeoutError):
                pass
            finally:
                writer.transport.abort()
            k += 1
    finally:
        logging.getLogger().removeHandler(counter)
    out = _refused(statuses, set(range(400, 500)))
    out.update(log_lines=counter.lines, log_tracebacks=counter.tracebacks)
    out["refused_ok"] = out["refused_ok"] and counter.tracebacks == 0 and counter.longest <= 300
    return out


# -- running ------------------------------------------------------------------------------
def make_certs(folder: Path) -> tuple[str, dict[str, tuple[str, str]]]:
    """A CA and certificates issued by it to the parties and to "mallory"."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def write(name: str, cert: Any, key: Any) -> tuple[str, str]:
        c, k = folder / f"{name}.pem", folder / f"{name}.key"
        c.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        k.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return str(c), str(k)

    def build(subject: Any, issuer: Any, key: Any, sign_key: Any, ca: bool, name: str = ""):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        if ca:
            b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        return b.sign(sign_key, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    ca_path, _ = write("ca", build(ca_name, ca_name, ca_key, ca_key, True), ca_key)
    certs = {}
    for name in ("leader", "follower", "mallory"):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        certs[name] = write(name, build(subject, ca_name, key, ca_key, False, name), key)
    return ca_path, certs


class Sampler:
    """RSS of this process (every 10 ms, on a thread) and the follower's /healthz latency."""

    def __init__(self) -> None:
        self.rss_mb = 0.0
        self.polls: list[float | None] = []  # ms per /healthz poll, None: failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.01):
            self.rss_mb = max(self.rss_mb, _rss_mb())

    def __enter__(self) -> Sampler:
        self.rss_mb = _rss_mb()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    async def poll(self, url: str, tls: ssl.SSLContext | None, until: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        while not until.is_set():
            t0 = loop.time()
            took: float | None = None
            try:
                conn = aiohttp.TCPConnector(ssl=tls or True)
                async with aiohttp.ClientSession(connector=conn) as s:
                    async with s.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            took = (loop.time() - t0) * 1e3
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            self.polls.append(took)
            await asyncio.sleep(0.05)

    @property
    def healthz_ms(self) -> list[float]:
        return [t for t in self.polls if t is not None]

    @property
    def healthz_failed(self) -> int:
        """Failed polls between the first and the last answered one (before: the follower
        was not serving yet; after: it had closed its transport at the end of its run)."""
        answered = [i for i, t in enumerate(self.polls) if t is not None]
        if not answered:
            return len(self.polls)
        return sum(t is None for t in self.polls[answered[0] : answered[-1]])


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def run_job(
    job: Job,
    attack: Callable[[Ctx], Awaitable[dict[str, Any]]] | None,
    seconds: float,
    sampler: Sampler | None,
    tls: ssl.SSLContext | None = None,
    lag: hostile_lag.LoopLag | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.process.session import leader_spec
    from tandem.parties.split.process.standalone import run_party

    paths = job.write()
    cfgs = {r: load_party_config(paths[r]) for r in ("leader", "follower")}
    spec = await asyncio.to_thread(
        lambda: leader_spec(cfgs["leader"], cfgs["leader"].load_data()).spec_hash()
    )
    finished = asyncio.Event()
    async with asyncio.TaskGroup() as tg:
        parties = {r: tg.create_task(run_party(cfgs[r])) for r in ("follower", "leader")}
        hit = tg.create_task(attack(Ctx(job, finished, seconds, spec))) if attack else None
        serving = asyncio.Event()  # set once the follower's run is over: polls stop there
        parties["follower"].add_done_callback(lambda _: serving.set())
        if sampler is not None:
            tg.create_task(sampler.poll(job.url("follower"), tls, serving))
        if lag is not None:
            tg.create_task(lag.run(serving))
        await asyncio.wait(parties.values())
        finished.set()
    return {r: t.result() for r, t in parties.items()}, (hit.result() if hit else {})


async def one_run(args: argparse.Namespace) -> dict[str, Any]:
    """This process runs one job, attacked by ``args.one`` (or by nothing: ``reference``), in
    ``args.workdir``; returns what the parent needs (its exports stay in the folder)."""
    name, root = args.one, Path(args.workdir)
    if name in hostile_roles.ATTACKS:
        return await hostile_roles.one_run(name, args.seconds)
    job = Job(root / name, epochs=args.epochs, budget=args.budget_mib * MiB)
    tls = None
    attack: Callable[[Ctx], Awaitable[dict[str, Any]]] | None = ATTACK_FUNCS.get(name)
    if name == "identity":
        ca, certs = make_certs(root / name)
        job.use_tls(ca, {r: certs[r] for r in ("leader", "follower")})
        tls = ssl.create_default_context(cafile=ca)
        tls.load_cert_chain(*certs["leader"])

        async def attack(c: Ctx) -> dict[str, Any]:
            return await attack_identity(c, certs["mallory"], ca)

    if name in hostile_insider.KEYED:  # parties that sign with keys only they hold
        hostile_insider.use_keys(job.cfg, job.folder)
    observer = None
    if name == "future_flood":  # a third peer of the leader, holding the secret
        observer = await _observer()
        job.cfg["leader"]["peers"]["observer"] = observer[1]
        job.cfg["leader"]["http"]["max_nonces"] = 500
    sampler = Sampler()
    lag = hostile_lag.LoopLag(stacks=bool(os.environ.get("TANDEM_HOSTILE_STACKS")))
    t0, cpu0 = time.monotonic(), os.times()
    try:
        with sampler:
            results, detail = await run_job(job, attack, args.seconds, sampler, tls, lag)
        done = all(r["status"] == "done" for r in results.values())
    except Exception as exc:  # an attack that breaks the job is a finding, not a crash
        detail, done = {"error": _describe(exc)}, False
    finally:
        if observer is not None:
            await observer[0].cleanup()
    return {
        "name": name,
        "detail": detail,
        "done": done,
        "seconds": round(time.monotonic() - t0, 2),
        "rss_mb": round(sampler.rss_mb, 1),
        "healthz_ms": [round(t, 3) for t in sampler.healthz_ms],
        "healthz_failed": sampler.healthz_failed,
        "loop_lag": lag.summary(),
        "cpu_s": _cpu_since(cpu0),
        "folder": str(job.folder),
    }


def _cpu_since(t0: os.times_result) -> dict[str, float]:
    """CPU seconds since ``t0``: this process's (the parties, the light attackers) and its
    waited-for children's (an attacker process of its own)."""
    t1 = os.times()
    return {
        "party_process": round(t1.user + t1.system - t0.user - t0.system, 2),
        "attacker_process": round(
            t1.children_user + t1.children_system - t0.children_user - t0.children_system, 2
        ),
    }


def _describe(exc: BaseException) -> str:
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {exc}"


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """The reference run, then each attack, each in a process of its own (so that every RSS
    is measured from the same start); compares their exports with the reference's."""
    names = [a for a in args.attacks.split(",") if a] if args.attacks else list(ATTACKS)
    unknown = sorted(set(names) - set(ATTACKS))
    if unknown:
        raise SystemExit(f"unknown attacks {unknown}; choose from {list(ATTACKS)}")
    load0 = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tandem-hostile-") as tmp:

        def run(name: str) -> dict[str, Any]:
            cmd = [sys.executable, "-m", "bench.hostile", "--one", name, "--workdir", tmp]
            cmd += ["--seconds", str(args.seconds), "--epochs", str(args.epochs)]
            cmd += ["--budget-mib", str(args.budget_mib)]
            done = subprocess.run(cmd, stdout=subprocess.PIPE, timeout=args.seconds + 600)
            lines = [ln for ln in done.stdout.decode().splitlines() if ln.startswith("{")]
            if done.returncode != 0 or not lines:
                return {"name": name, "detail": {"error": f"exit {done.returncode}"}, "done": False}
            return json.loads(lines[-1])

        split = any(name not in hostile_roles.ATTACKS for name in names)
        ref = run("reference") if split else {"done": True}  # only split runs compare with it
        reference = Job.exported_from(Path(ref["folder"])) if split and ref["done"] else {}
        failed = [] if ref["done"] else ["reference"]
        per_attack, max_rss, healthz = {}, 0.0, []
        for name in names:
            out = run(name)
            if name in hostile_roles.ATTACKS:  # a job of its own: its verdict decides
                same = bool(out["done"])
            else:
                same = out["done"] and _same(Job.exported_from(Path(out["folder"])), reference)
            detail = out["detail"]
            ok = same and bool(detail.get("refused_ok"))
            if not ok:
                failed.append(name)
            if name not in hostile_roles.ATTACKS:  # those run no split party: not its budget
                max_rss = max(max_rss, out.get("rss_mb", 0.0))
            healthz += out.get("healthz_ms", [])
            per_attack[name] = {
                "healthz_p99_ms": _p99(out.get("healthz_ms", [])),
                **detail,
                "same_params": same,
                "done": out["done"],
                "seconds": out.get("seconds"),
                "rss_mb": out.get("rss_mb"),
                "healthz_polls": len(out.get("healthz_ms", [])),
                "healthz_failed": out.get("healthz_failed"),
                "loop_lag": out.get("loop_lag"),
                "cpu_s": out.get("cpu_s"),
            }
            print(f"{name}: {'ok' if ok else 'FAILED'} {per_attack[name]}", file=sys.stderr)
    p99 = _p99(healthz)
    return {
        "bench": "hostile",
        "attacks": len(names),
        "failed": failed,
        "max_rss_mb": round(max_rss, 1),
        "rss_budget_mb": round(ref.get("rss_mb", 0.0) + args.budget_mib + CONSTANT_MB, 1),
        "healthz_p99_ms_under_attack": p99,
        "healthz_p99_ms_reference": _p99(ref.get("healthz_ms", [])),
        "reference_rss_mb": ref.get("rss_mb"),
        "loop_lag_reference": ref.get("loop_lag"),
        "inbound_budget_mib": args.budget_mib,
        "seconds_per_attack": args.seconds,
        "attacker_nice": args.attacker_nice,
        "epochs": args.epochs,
        "per_attack": per_attack,
        "load": {"cpus": os.cpu_count(), "loadavg_start": load0, "loadavg_end": os.getloadavg()},
    }


def _p99(ms: list[float]) -> float | None:
    """The 99th percentile of ``ms`` (nearest rank), rounded; None when empty."""
    if not ms:
        return None
    ms = sorted(ms)
    return round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2)


ATTACK_FUNCS: dict[str, Callable[[Ctx], Awaitable[dict[str, Any]]]] = {
    "replay": attack_replay,
    "memory": lambda ctx: hostile_apart.run_apart(ctx, "memory"),
    "slowloris": attack_slowloris,
    "slow_body": attack_slow_body,
    "future_flood": lambda ctx: hostile_apart.run_apart(ctx, "future_flood"),
    "plan": attack_plan,
    "overflow": attack_overflow,
    "malformed": attack_malformed,
    "bomb": lambda ctx: hostile_bodies.attack_bomb(ctx, _refused),
    "drained": lambda ctx: hostile_apart.run_apart(ctx, "drained"),
    "stalled_partial": lambda ctx: hostile_insider.attack_stalled_partial(ctx, _refused),
    "forged_control": lambda ctx: hostile_insider.attack_forged_control(ctx, _refused),
    "metrics_stranger": lambda ctx: hostile_insider.attack_metrics_stranger(ctx, _refused),
}

#: the attacks `bench.hostile_apart` runs in a process of their own (heavy client work)
APART: dict[str, Callable[[Any], Awaitable[dict[str, Any]]]] = {
    "memory": attack_memory,
    "drained": lambda ctx: hostile_bodies.attack_drained(ctx, _refused),
    "future_flood": attack_future_flood,
}


async def _observer() -> tuple[Any, str]:
    from aiohttp import web

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/healthz", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> bool:
    return got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


async def hold_heads(url: str, count: int, seconds: float) -> int:
    """The slow-loris process: ``count`` connections sending request heads that never end,
    reopened when closed, for ``seconds`` or until SIGTERM; returns connections opened."""
    host, port = url.split("//")[1].split(":")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    deadline = loop.time() + seconds
    opened = 0

    async def one() -> None:
        nonlocal opened
        while not stop.is_set() and loop.time() < deadline:
            try:
                reader, writer = await asyncio.open_connection(host, int(port))
            except OSError:
                await asyncio.sleep(0.05)
                continue
            opened += 1
            try:
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
                while not stop.is_set() and loop.time() < deadline:
                    try:
                        if await asyncio.wait_for(reader.read(1), 0.5) == b"":
                            break
                    except TimeoutError:
                        if writer.is_closing():  # closed by the peer as the wait timed out
                            break
                        writer.write(b"a")
            except OSError:
                pass
            finally:
                writer.transport.abort()

    await asyncio.gather(*(one() for _ in range(count)))
    return opened


def _lower_priority() -> None:
    """An attacker process of its own runs at the niceness the parent bench was given
    (``--attacker-nice``, through `NICE_ENV`)."""
    nice = int(os.environ.get(NICE_ENV, "0"))
    if nice > 0:
        os.nice(nice)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.hostile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--attacks", default="", help=f"comma-separated subset of {list(ATTACKS)}")
    p.add_argument("--seconds", type=float, default=20.0, help="bound of each attack (s)")
    p.add_argument("--epochs", type=int, default=10, help="training epochs of each job")
    p.add_argument("--budget-mib", type=int, default=256, help="[http] inbound_budget (MiB)")
    p.add_argument(
        "--attacker-nice",
        type=int,
        default=ATTACKER_NICE,
        help="niceness of the attacker processes of their own (0: the parties' priority)",
    )
    p.add_argument("--loris", nargs=3, metavar=("URL", "COUNT", "SECONDS"), help=argparse.SUPPRESS)
    p.add_argument("--apart", nargs=3, metavar=("NAME", "URLS", "SECONDS"), help=argparse.SUPPRESS)
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child: one run (an attack, or none)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from tandem.parties.cli import run_async

    if args.loris or args.apart:
        _lower_priority()
    if args.loris:
        url, count, seconds = args.loris
        print("opened", run_async(lambda: hold_heads(url, int(count), float(seconds))), flush=True)
        return 0
    if args.apart:
        name, urls, seconds = args.apart
        verdict = run_async(lambda: hostile_apart.child(APART[name], urls, float(seconds)))
        print(json.dumps(verdict), flush=True)
        return 0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.one:
        out: dict[str, Any] = {}

        async def child() -> int:
            out.update(await one_run(args))
            return 0

        run_async(child)
        print(json.dumps(out), flush=True)
        return 0
    os.environ[NICE_ENV] = str(args.attacker_nice)  # the children's attacker processes read it
    result = bench(args)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
