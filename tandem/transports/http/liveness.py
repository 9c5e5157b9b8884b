"""Readiness of peers at start (`wait_ready`: ``GET /healthz`` answers 200), and loss
detection on the receiving side (``HttpConfig.peer_timeout``): a `recv` waiting on an
empty inbox probes the peer's ``GET /healthz`` every ``min(1, peer_timeout / 3)`` s. A peer
that answers no probe for ``peer_timeout`` s, or answers as another process, is taken as having
said goodbye: its inboxes close and the waiting `recv` raises `TransportClosedError` once the
frames it had sent are drained. Another process is one that names another incarnation, or one
that names none: ``/healthz`` names it only to a caller it knows as a peer, and the process we
heard from knows us (it sent to us), so an anonymous answer comes from a restarted process that
has not admitted us yet (``admit_unknown``). A peer never heard from is not probed (it may not
have started yet); a live peer that is merely silent is waited for.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from tandem.errors import PeersUnreachableError

from ..base import Frame
from ..inbox import Inbox
from .client import HttpClient
from .protocol import HEALTH_PATH
from .server import HttpServer

log = logging.getLogger(__name__)

#: how long one readiness probe may take, and the pause between rounds of probes
PROBE_SECONDS = 2.0
PROBE_PAUSE = 0.1


async def wait_ready(
    name: str, session: aiohttp.ClientSession, peers: Mapping[str, str], timeout: float
) -> None:
    """Poll every peer's ``GET /healthz`` (name -> base URL) until each has answered 200 once;
    `PeersUnreachableError` naming the silent ones, their URLs and last problems, after
    ``timeout`` seconds. The probes are anonymous: readiness says nothing of identity."""
    pending = dict(peers)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last: dict[str, str] = {}
    while pending:
        for peer, url in list(pending.items()):
            try:
                async with session.get(
                    url + HEALTH_PATH, timeout=aiohttp.ClientTimeout(total=PROBE_SECONDS)
                ) as resp:
                    if resp.status == 200:
                        del pending[peer]
                        continue
                    last[peer] = f"HTTP {resp.status}"
            except (aiohttp.ClientError, OSError, TimeoutError) as exc:
                last[peer] = f"{type(exc).__name__}: {exc}"
        if not pending:
            return
        if loop.time() >= deadline:
            silent = {p: (u, last.get(p, "no answer")) for p, u in pending.items()}
            raise PeersUnreachableError(
                f"{name!r}: peers not reachable after {timeout:g} s: "
                + "; ".join(f"{p} at {u} ({why})" for p, (u, why) in silent.items()),
                silent,
            )
        await asyncio.sleep(PROBE_PAUSE)


async def next_frame(
    server: HttpServer,
    client: HttpClient,
    peer: str,
    url: str,
    box: Inbox[Frame],
    peer_timeout: float | None,
) -> Frame | None:
    """The next frame of ``box`` (from ``peer`` at ``url``); None once the box is closed and
    drained, by a goodbye, the local close, or a probe that found the peer gone."""
    if peer_timeout is None or len(box):
        return await box.get()
    if peer in server.lost:  # gone, and nothing of it left to read
        return None
    every = min(1.0, peer_timeout / 3)
    while True:
        # Inbox.wait_item takes nothing and arms no cancellation (neither asyncio.timeout's
        # nor wait_for's): a wait that runs out, or is cancelled, loses no frame
        if await box.wait_item(every):
            return box.pop() if len(box) else None
        await check_alive(server, client, peer, url, every, peer_timeout)


async def check_alive(
    server: HttpServer,
    client: HttpClient,
    peer: str,
    url: str,
    probe_timeout: float,
    peer_timeout: float,
) -> None:
    """One probe of ``peer``; when it is gone, what its goodbye would do (the reason is kept
    in ``server.lost``)."""
    known = server.known_incarnation(peer)
    if known is None or server.closed:
        return  # never heard from: not lost, perhaps not started yet
    loop = asyncio.get_running_loop()
    gone = None
    try:
        inc = await client.probe(peer, url, probe_timeout)
        server.down_since.pop(peer, None)
        if inc is None:
            gone = (
                f"peer {peer!r} restarted (a new process answers at its address and does not "
                f"know {server.cfg.name!r} yet)"
            )
        elif inc != known:
            gone = f"peer {peer!r} restarted (a new process answers at its address)"
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        since = server.down_since.setdefault(peer, loop.time())
        if loop.time() - since >= peer_timeout:
            gone = (
                f"peer {peer!r} has not answered for {loop.time() - since:.0f} s "
                f"(peer_timeout={peer_timeout:g}; last: {type(exc).__name__}): it stopped "
                "without saying goodbye (killed, or its machine or network failed)"
            )
    if gone is not None:
        log.warning("%s: %s", server.cfg.name, gone)
        server.lost[peer] = gone
        await server.forget_incarnation(peer, known)
