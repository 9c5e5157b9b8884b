"""Who may speak for whom, against live parties: a certificate of the same CA issued to
another name; a signed request captured for another process; a flood of requests stamped in
the future. Each is refused, and the parties still train to the parameters of an unattacked
run, bit for bit."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
import time

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from hostile_helpers import (
    assert_done,
    assert_same_params,
    frame_request,
    make_job,
    post,
    run_pair,
    wait_healthy,
)
from tandem.transports.base import Frame

pytestmark = pytest.mark.slow


# -- a certificate authority and its certificates -------------------------------------------------
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _write(folder, name, cert, key) -> tuple[str, str]:
    cert_path, key_path = folder / f"{name}.pem", folder / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return str(cert_path), str(key_path)


def make_ca(folder):
    """A CA and a function issuing it certificates for names (CN and DNS SAN = the name, IP SAN
    127.0.0.1); returns ``(ca_path, issue)`` with ``issue(name) -> (cert_path, key_path)``."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tandem test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    ca_path, _ = _write(folder, "ca", ca, ca_key)

    def issue(name: str) -> tuple[str, str]:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName(name), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        return _write(folder, name, cert, key)

    return ca_path, issue


async def test_a_certificate_of_another_name_cannot_speak_for_the_leader(
    tmp_path, hostile_reference
):
    """Mutual TLS, no shared secret. A certificate from the same CA issued to "mallory"
    sends the follower a ``stop`` claiming to come from the leader: 403, and the job trains
    on to the end."""
    ca, issue = make_ca(tmp_path)

    def tls(job):
        for role in ("leader", "follower"):
            cert, key = issue(role)
            sec = job.cfg[role]["security"]
            sec.pop("secret")
            sec.update({"tls_cert": cert, "tls_key": key, "tls_ca": ca})
            other = "follower" if role == "leader" else "leader"
            job.cfg[role]["peers"] = {other: job.url(other).replace("http:", "https:")}

    job = make_job(tmp_path / "job", tls)
    cert, key = issue("mallory")

    async def attack(job, finished):
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        url = job.url("follower").replace("http:", "https:")
        answers = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as s:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while loop.time() < deadline:  # until the follower serves
                try:
                    async with s.get(url + "/healthz") as r:
                        if r.status == 200:
                            break
                except (aiohttp.ClientError, OSError):
                    await asyncio.sleep(0.05)
            for i in range(5):
                if finished.is_set() and answers:  # the follower is gone: nothing to forge to
                    break
                headers, body = frame_request(
                    receiver="follower",
                    to="",
                    sender="leader",
                    sender_inc=f"mallory{i}",
                    channel="ctl",
                    msg_id=i,
                    frame=Frame(meta={"cmd": "stop", "reason": "forged"}),
                    secret=None,
                )
                try:
                    status, text = await post(s, url, headers, body)
                except (aiohttp.ClientError, OSError):
                    if answers:  # the job ended between two forgeries
                        break
                    raise
                if status == 503 and "closing" in text and answers:  # the job ended
                    break
                answers.append((status, text))
                await asyncio.sleep(0.2)
        return answers

    results, answers = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert answers and all(status == 403 for status, _ in answers), answers
    assert all("mallory" in text and "leader" in text for _, text in answers)


async def test_a_request_captured_for_another_process_is_refused(tmp_path, hostile_reference):
    """A signed ``stop`` captured on its way to another job's follower (same secret, same
    party names) and replayed to this job's follower: 421 (signed for another process),
    never delivered; the job trains on."""
    job = make_job(tmp_path)

    async def attack(job, finished):
        url = job.url("follower")
        await wait_healthy(url)
        answers = []
        async with aiohttp.ClientSession() as s:
            for i in range(10):
                if finished.is_set() and answers:  # the follower is gone: nothing to replay to
                    break
                # exactly what the other job's leader sent its follower: bound to that
                # follower's process, from the other leader's process
                headers, body = frame_request(
                    receiver="follower",
                    to="0123456789abcdef",
                    sender="leader",
                    sender_inc="fedcba9876543210",
                    channel="ctl",
                    msg_id=i,
                    frame=Frame(meta={"cmd": "stop", "reason": "replayed"}),
                )
                status, text = await post(s, url, headers, body)
                if status == 503 and "closing" in text:  # the job ended: it stops serving
                    break
                answers.append((status, text))
                await asyncio.sleep(0.2)
        return answers

    results, answers = await run_pair(job, attack)
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert answers and all(status == 421 for status, _ in answers), answers


async def test_a_flood_stamped_in_the_future_locks_out_no_other_sender(tmp_path, hostile_reference):
    """A party holding the secret ("observer", a peer of the leader) sends thousands of signed
    requests stamped 59 s in the future (refused: beyond max_clock_skew) and as many stamped
    within the skew, overflowing its own nonce memory: only its own replay floor rises; the
    follower's requests keep being accepted and the job trains on."""
    observer = {}

    async def serve_observer():
        from aiohttp import web

        app = web.Application()

        async def ok(request):
            return web.json_response({"status": "ok"})

        app.router.add_get("/healthz", ok)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        observer["runner"] = runner
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    url = await serve_observer()

    def tweak(job):
        job.cfg["leader"]["peers"]["observer"] = url
        job.cfg["leader"]["http"] = {"max_nonces": 300}

    job = make_job(tmp_path, tweak)

    async def attack(job, finished):
        lead = job.url("leader")
        await wait_healthy(lead)
        statuses: dict[str, list[int]] = {"future": [], "within": []}
        bound = {"to": ""}  # the leader's process, from its first 421

        async def one(i: int) -> None:
            kind = "future" if i % 2 == 0 else "within"
            ahead = 59.0 if kind == "future" else 4.0
            headers, body = frame_request(
                receiver="leader",
                to=bound["to"],
                sender="observer",
                sender_inc="obs",
                channel="ctl",
                msg_id=i,
                frame=Frame(),
                clock=lambda: time.time() + ahead,
            )
            status, text = await post(s, lead, headers, body)
            if status == 421:
                bound["to"] = json.loads(text)["incarnation"]
            if status == 503 and "closing" in text:  # the job ended under this round of 50
                return
            statuses[kind].append(status)

        async with aiohttp.ClientSession() as s:
            for start in range(0, 3000, 50):  # 50 at a time, while the job runs
                if finished.is_set():
                    break
                await asyncio.gather(*(one(i) for i in range(start, start + 50)))
        return statuses

    try:
        results, statuses = await run_pair(job, attack)
    finally:
        await observer["runner"].cleanup()
    assert_done(results)
    assert_same_params(job, hostile_reference)
    assert len(statuses["future"]) >= 500 and set(statuses["future"]) == {401}
    # within the skew the signature is good: 421 names the leader's process, then the
    # observer's requests get past authentication (filling its own nonce memory) and are
    # refused by the negotiated channels (403); its own replay floor may refuse some (401)
    assert 403 in statuses["within"] and set(statuses["within"]) <= {401, 403, 421}
