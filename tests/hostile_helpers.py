"""Scaffolding of the hostile-network tests (tests/test_hostile_*.py): two real parties
(`tandem.parties.split.process.standalone.run_party`, negotiation, training, export) over HTTP on
loopback, in this process, with an attack running beside them; and the hand-made requests an
attacker sends.

Every attack is bounded (a count or a deadline) and stops by itself; the parties must then
finish with the parameters of a run nobody attacked, bit for bit (`assert_same_params`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

if __name__ == "__main__":  # run as an attacker process: tests/ is not on the path yet
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from party_helpers import Job  # noqa: E402
from tandem.transports import auth, codec  # noqa: E402
from tandem.transports.base import Frame  # noqa: E402
from tandem.transports.http import FRAME_PATH  # noqa: E402

SECRET = b"s3cret"
ACT = "act/bottom_follower->top"  # the follower's activations, into the leader
GRAD = "grad/bottom_follower->top"  # the leader's gradients, into the follower


#: the hostile tests' job: 2 epochs of 4 batches, a checkpoint every 4
EPOCHS, EVERY = 2, 4


def make_job(folder: Path, tweak: Callable[[Job], None] | None = None) -> Job:
    """A two-party job (2 epochs of 4 batches, 2 groups); ``tweak(job)`` edits its configs."""
    job = Job(folder, epochs=EPOCHS, every=EVERY)
    for role in ("leader", "follower"):
        job.cfg[role]["wait"] = 30.0
    if tweak is not None:
        tweak(job)
    job.write()
    return job


async def run_pair(
    job: Job,
    attack: Callable[[Job, asyncio.Event], Awaitable[Any]] | None = None,
    timeout: float = 120.0,
) -> tuple[dict[str, Any], Any]:
    """Run both parties of ``job`` to the end, with ``attack(job, finished)`` beside them;
    returns ``({role: result}, attack's result)``. ``finished`` is set once both parties
    are done; the attack must stop by itself (bounded in count and time, or once
    ``finished`` is set) and is awaited. Either party failing fails the call."""
    finished = asyncio.Event()
    with compiling_afresh():
        async with asyncio.timeout(timeout):
            async with asyncio.TaskGroup() as tg:
                hit = tg.create_task(attack(job, finished)) if attack is not None else None
                results = await job.run_all()
                finished.set()
    return results, None if hit is None else hit.result()


@contextlib.contextmanager
def compiling_afresh() -> Iterator[None]:
    """Within: this process compiles every kernel, without the session's compilation cache
    (tests/conftest.py), so the short training an attack runs beside lasts as long as on a
    fresh machine. ``run_party`` itself turns no cache on: the parties' ``compile_cache`` is
    the process layer's (`tandem.parties.compile_cache`), set by the CLI only."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        compilation_cache.reset_cache()


def assert_same_params(job: Job, ref: Job) -> None:
    """Both parties exported exactly the reference run's parameters."""
    for role in ("leader", "follower"):
        got, want = job.exported(role), ref.exported(role)
        assert got.keys() == want.keys()
        for name in want:  # bit for bit: same ops on the same values in the same order
            assert np.array_equal(got[name], want[name]), f"{role} {name} differs"


def assert_done(results: Mapping[str, Any]) -> None:
    for role, out in results.items():
        assert out["status"] == "done", (role, out)


async def wait_healthy(url: str, timeout: float = 30.0) -> None:
    """Until ``url``'s ``/healthz`` answers 200 (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as s:
        while True:
            try:
                async with s.get(url + "/healthz", timeout=aiohttp.ClientTimeout(total=1)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            if loop.time() > deadline:
                raise AssertionError(f"{url} never answered /healthz")
            await asyncio.sleep(0.05)


async def incarnation(url: str, name: str, caller: str, secret: bytes = SECRET) -> str:
    """The process incarnation party ``name`` at ``url`` names to its peer ``caller``."""
    headers = {"X-Tandem-Sender": caller}
    auth.sign(secret, "GET", "/healthz", headers, auth.EMPTY_SHA, receiver=name)
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/healthz", headers=headers) as r:
            return (await r.json())["incarnation"]


def metrics_headers(name: str, caller: str, secret: bytes = SECRET) -> dict[str, str]:
    """Headers of a ``GET /metrics`` to party ``name``, signed as its peer ``caller``."""
    headers = {"X-Tandem-Sender": caller}
    return auth.sign(secret, "GET", "/metrics", headers, auth.EMPTY_SHA, receiver=name)


def frame_request(
    *,
    receiver: str,
    to: str,
    sender: str,
    sender_inc: str,
    channel: str,
    msg_id: int,
    frame: Frame,
    spec: str = "",
    secret: bytes | None = SECRET,
    clock: Callable[[], float] | None = None,
    base: int | None = None,
) -> tuple[dict[str, str], bytes]:
    """``(headers, body)`` of a one-chunk frame request as ``sender`` would send it to
    ``receiver`` (process ``to``), signed with ``secret`` (None: unsigned); ``base``: the
    sender's lowest unsettled id (None: no such header, the receiver takes ``msg_id``)."""
    body = codec.encode(
        frame.replace(sender=sender, channel=channel, msg_id=msg_id, spec_hash=spec)
    )
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
    if base is not None:
        headers["X-Tandem-Base"] = str(base)
    if secret is not None:
        kw: dict[str, Any] = {"receiver": receiver, "to": to}
        if clock is not None:
            kw["clock"] = clock
        auth.sign(secret, "POST", FRAME_PATH, headers, auth.body_digest([body]), **kw)
    return headers, body


async def post(
    session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], body: bytes
) -> tuple[int, str]:
    async with session.post(url + FRAME_PATH, data=body, headers=dict(headers)) as r:
        return r.status, await r.text()


def field_of(text: str) -> str:
    """The ``field`` a refusal's JSON body names ("" when none)."""
    try:
        return str(json.loads(text).get("field", ""))
    except (ValueError, AttributeError):
        return ""


def spec_hash(job: Job) -> str:
    """The spec hash the two parties of ``job`` will agree on."""
    from tandem.parties.split.process.party_config import load_party_config
    from tandem.parties.split.process.session import describe_data, leader_spec

    cfg = load_party_config(job.path("leader"))
    follower = load_party_config(job.path("follower"))
    described = {follower.name: describe_data(follower.load_data())}
    return leader_spec(cfg, cfg.load_data(), described).spec_hash()


def rss_mb(pid: int | str = "self") -> float:
    """Resident set size of process ``pid`` in MiB (Linux ``/proc``)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc status")
