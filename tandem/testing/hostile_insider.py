"""The insider attacks of `bench.hostile` (and their tools, shared with
tests/test_hostile_insider.py), against a job whose parties sign with per-party keys
(`use_keys`: Ed25519 key pairs for the leader, the follower and a third roster member, the
"auditor", which takes no part in this job).

* ``stalled_partial``: the auditor's key signs, as the leader, the first chunk of a message
  on the gradient channel (leader -> follower) at each of the next message ids, declaring a
  wrong size, and stalls after a few bytes. With a shared secret this made the follower refuse
  the real frame (400, "chunk headers disagree") and the leader exit with an error; with
  per-party keys each is refused from its head (403: the key is not the leader's);
* ``forged_control``: the follower's key signs, as the leader, ``{"cmd": "stop"}`` on the
  follower's control channel (expect 403, the job trains on);
* ``metrics_stranger``: ``GET /metrics`` of both parties without credentials, with a wrong
  bearer token and with a peer's name but no signature (expect 401 with an empty body: no
  name, step or count leaks).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

GRAD = "grad/bottom_follower->top"
CTL = "ctl"
ROSTER = ("leader", "follower", "auditor")
STALLED_IDS = 64  # message ids of the gradient channel covered by each round
DECLARED = 1 << 20  # the wrong size each stalled partial declares


def use_keys(cfg: dict[str, dict[str, Any]], folder: Path) -> None:
    """Give the parties of a two-party job per-party keys: key pairs for `ROSTER` in
    ``folder`` (the auditor's stays with the attacker), each party's ``[security]`` naming its
    own private key and the roster of public keys instead of the shared secret."""
    from tandem.transports.keys import generate

    for name in ROSTER:
        if not (folder / f"{name}.key").exists():
            generate(name, folder)
    for role in ("leader", "follower"):
        sec = cfg[role]["security"]
        sec.pop("secret", None)
        sec["private_key"] = f"{role}.key"
        sec["public_keys"] = {name: f"{name}.pub" for name in ROSTER}


def signing_key(folder: Path, name: str):
    from tandem.transports.keys import SigningKey

    return SigningKey.from_file(folder / f"{name}.key")


def forged(
    key: Any,
    *,
    receiver: str,
    sender: str,
    channel: str,
    msg_id: int,
    meta: dict[str, Any],
    declared: int | None = None,
) -> tuple[dict[str, str], bytes]:
    """``(headers, body)`` of a frame request claiming ``sender``, signed with ``key`` (another
    party's); ``declared``: the total size its head announces (default: the body's)."""
    from tandem.transports import auth, codec
    from tandem.transports.base import Frame

    body = codec.encode(Frame(sender=sender, channel=channel, msg_id=msg_id, meta=meta))
    size = len(body) if declared is None else declared
    headers = {
        "X-Tandem-Sender": sender,
        "X-Tandem-Incarnation": "forged",
        "X-Tandem-Channel": channel,
        "X-Tandem-Msg-Id": str(msg_id),
        "X-Tandem-Chunk": "0",
        "X-Tandem-Chunks": "1",
        "X-Tandem-Offset": "0",
        "X-Tandem-Total": str(size),
        "X-Tandem-Spec": "",
    }
    # the receiver's incarnation is named only to a caller it authenticates: unknown here
    auth.sign(key, "POST", "/tandem/v1/frame", headers, auth.body_digest([body]), receiver=receiver)
    return headers, body


async def send_stalled(url: str, headers: dict[str, str], prefix: bytes, declared: int) -> int:
    """Send a request head announcing ``declared`` body bytes, then only ``prefix``, and keep
    the connection open; returns the status the receiver answers (0: closed without one)."""
    host, port = url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        head = ["POST /tandem/v1/frame HTTP/1.1", f"Host: {host}:{port}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        head.append(f"Content-Length: {declared}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + prefix)
        await writer.drain()
        async with asyncio.timeout(10):
            line = await reader.readline()
        parts = line.split()
        return int(parts[1]) if len(parts) > 1 else 0
    finally:
        writer.transport.abort()


async def stalled_partial_round(folder: Path, url: str, first_id: int = 0) -> list[int]:
    """One round: a stalled partial at each of `STALLED_IDS` gradient ids, each signed by
    the auditor as the leader; the statuses."""
    key = signing_key(folder, "auditor")
    out = []
    for msg_id in range(first_id, first_id + STALLED_IDS):
        headers, body = forged(
            key,
            receiver="follower",
            sender="leader",
            channel=GRAD,
            msg_id=msg_id,
            meta={},
            declared=DECLARED,
        )
        out.append(await send_stalled(url, headers, body[:10], DECLARED))
    return out


async def forged_control_round(folder: Path, url: str, first_id: int = 0) -> list[int]:
    """One round: ``stop`` on the follower's control channel, signed with the follower's key
    as the leader, at a few message ids; the statuses."""
    import aiohttp

    key = signing_key(folder, "follower")
    out = []
    async with aiohttp.ClientSession() as s:
        for msg_id in range(first_id, first_id + 8):
            headers, body = forged(
                key,
                receiver="follower",
                sender="leader",
                channel=CTL,
                msg_id=msg_id,
                meta={"cmd": "stop", "reason": "forged"},
            )
            async with s.post(url + "/tandem/v1/frame", data=body, headers=headers) as r:
                out.append(r.status)
    return out


async def metrics_stranger_round(urls: list[str]) -> tuple[list[int], int]:
    """``GET /metrics`` of each party as three kinds of stranger; ``(statuses, bytes of
    answer bodies)``."""
    import aiohttp

    statuses, leaked = [], 0
    tries: list[dict[str, str]] = [
        {},
        {"Authorization": "Bearer guessed"},
        {"X-Tandem-Sender": "leader"},
        {"X-Tandem-Sender": "follower"},
    ]
    async with aiohttp.ClientSession() as s:
        for url in urls:
            for headers in tries:
                async with s.get(url + "/metrics", headers=headers) as r:
                    statuses.append(r.status)
                    leaked += len(await r.read())
    return statuses, leaked


Refused = Callable[[list[int], set[int]], dict[str, Any]]


async def _rounds(ctx: Any, one: Callable[[int], Any], pause: float) -> list[int]:
    statuses: list[int] = []
    rounds = 0
    while ctx.going() and rounds < 40:
        try:
            statuses += await one(rounds)
        except (OSError, TimeoutError, aiohttp.ClientConnectionError):
            if not rounds and not ctx.finished.is_set():  # not listening yet: still starting
                await asyncio.sleep(0.05)
                continue
            # a party closed: its run ended (the job's result, not this loop, says whether it
            # ended well: done and same_params are part of the verdict)
            break
        rounds += 1
        await asyncio.sleep(pause)
    return statuses


async def attack_stalled_partial(ctx: Any, refused: Refused) -> dict[str, Any]:
    job = ctx.job
    url = job.url("follower")
    statuses = await _rounds(
        ctx, lambda r: stalled_partial_round(job.folder, url, (r * STALLED_IDS) % 256), 0.2
    )
    return {**refused(statuses, {403}), "requests": len(statuses)}


async def attack_forged_control(ctx: Any, refused: Refused) -> dict[str, Any]:
    job = ctx.job
    url = job.url("follower")
    statuses = await _rounds(ctx, lambda r: forged_control_round(job.folder, url, r * 8), 0.1)
    return {**refused(statuses, {403}), "requests": len(statuses)}


async def attack_metrics_stranger(ctx: Any, refused: Refused) -> dict[str, Any]:
    urls = [ctx.job.url("leader"), ctx.job.url("follower")]
    leaked_total = 0

    async def one(_: int) -> list[int]:
        nonlocal leaked_total
        statuses, leaked = await metrics_stranger_round(urls)
        leaked_total += leaked
        return statuses

    statuses = await _rounds(ctx, one, 0.1)
    verdict = refused(statuses, {401})
    verdict["refused_ok"] = verdict["refused_ok"] and leaked_total == 0
    return {**verdict, "requests": len(statuses), "bytes_leaked": leaked_total}


ATTACKS = ("stalled_partial", "forged_control", "metrics_stranger")
#: the attacks whose job signs with per-party keys (`use_keys`)
KEYED = frozenset({"stalled_partial", "forged_control"})


__all__ = [
    "ATTACKS",
    "KEYED",
    "attack_forged_control",
    "attack_metrics_stranger",
    "attack_stalled_partial",
    "forged",
    "forged_control_round",
    "metrics_stranger_round",
    "send_stalled",
    "stalled_partial_round",
    "use_keys",
]
