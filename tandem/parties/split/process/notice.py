"""Telling peers why a party stops before training, and noticing a secret that differs.

Two things that, without this module, leave the other parties waiting ``wait`` seconds and then
blaming the network (docs/parties.md#when-a-party-cannot-start):

* **Abort notices.** A party that fails before or during negotiation (its configuration, its
  data, an unreachable peer, its authentication) sends every peer one small frame on channel
  `NOTICE`, signed like every frame of its transport::

      {"notice": "abort", "party": "shop", "reason": "shop.csv has no column(s) ['age'] ..."}

  Best effort and bounded: all peers at once, at most `SEND_SECONDS` in all, errors dropped
  (`tell_peers`); a party whose transport never started starts one just for this
  (`tell_from_config`). A peer whose `PeerWatch` is running (`session.connect`, from the
  transport's start to the end of the negotiation) stops at once with `PeerAbortedError`
  naming the party and its reason. A notice reaches only a peer that is already listening.
* **Authentication alarms.** The HTTP transport calls `PeerWatch.auth_refused` when a request
  naming a configured peer fails its signature check: the first one from each peer logs a
  warning (on stderr, unless logging is configured otherwise) naming the peer and the likely
  cause, later ones at most every `WARN_EVERY` seconds with their count. While negotiating,
  the watch then sends that peer a signed ``{"notice": "probe"}``: if the peer refuses it too
  (401), or no longer answers, the secrets differ and this party stops with an
  `tandem.errors.AuthenticationError` naming the peer; if the peer accepts it, the refused
  request was not the peer's (a stranger using its name) and nothing else happens. A peer
  that does not answer at its address at all (not started yet) is not asked: it cannot have
  sent the request. So a stranger's forged request cannot stop a party.

A notice carries the failing party's own error message, which may name its file and columns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

from tandem.errors import (
    AdmissionError,
    AuthenticationError,
    FrameError,
    PeersUnreachableError,
    TandemError,
    TransportClosedError,
    TransportError,
)
from tandem.transports.base import Frame, PeerWaitingTransport

log = logging.getLogger(__name__)
T = TypeVar("T")

NOTICE = "notice"
SEND_SECONDS = 2.0  # the longest a failing party spends telling its peers
PROBE_SECONDS = 3.0  # the longest a probe of a peer whose request we refused may take
WARN_EVERY = 60.0  # seconds between two warnings about the same peer
MAX_REASON = 2000  # characters of a reason sent or shown


class PeerAbortedError(TandemError):
    """A peer told this party that it stopped before training, and why."""

    def __init__(self, party: str, reason: str) -> None:
        super().__init__(f"{party!r} stopped before training started: {reason}")
        self.party, self.reason = party, reason


def abort_frame(party: str, reason: str) -> Frame:
    """The abort notice of ``party``."""
    return Frame(meta={"notice": "abort", "party": party, "reason": reason[:MAX_REASON]})


def reason_of(exc: BaseException) -> str:
    """What a notice says of ``exc``: its message (a Tandem error's is written for users),
    with the type for anything else."""
    return str(exc) if isinstance(exc, TandemError) else f"{type(exc).__name__}: {exc}"


async def tell_peers(
    transport: Any, peers: Iterable[str], reason: str, *, timeout: float = SEND_SECONDS
) -> list[str]:
    """Send ``transport.name``'s abort notice to every one of ``peers`` at once, for at most
    ``timeout`` seconds in all; returns the peers that took it. Never raises (but a
    cancellation)."""
    frame = abort_frame(transport.name, reason)
    told: list[str] = []

    async def one(peer: str) -> None:
        with contextlib.suppress(TandemError, OSError):
            await transport.send(peer, NOTICE, frame)
            told.append(peer)

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            async with asyncio.TaskGroup() as tg:
                for peer in peers:
                    tg.create_task(one(peer))
    return told


#: the ``field`` of the refusal a stopping party answers every frame with, while it sends its
#: abort notice: a peer that meets it waits a moment for the notice (`PeerWatch.guard`)
STOPPING = "stopping"


def _refuse_all(sender: str, channel: str) -> None:
    raise AdmissionError("this party is stopping; it takes nothing", field=STOPPING)


async def tell_from_config(cfg: Any, reason: str, *, timeout: float = SEND_SECONDS) -> None:
    """`tell_peers` for a party whose transport never started (it failed loading its data):
    start one on its ``[listen]`` address (refusing every inbound frame), tell, close; all
    within about ``timeout`` seconds. Never raises (but a cancellation)."""
    try:
        transport = cfg.transport()
        transport.admit_stream = _refuse_all
        await transport.start()
    except (TandemError, OSError) as exc:
        log.info("%s: could not tell its peers why it stops: %s", cfg.name, exc)
        return
    try:
        await tell_peers(transport, list(cfg.peers), reason, timeout=timeout)
    finally:
        await transport.aclose()


@contextlib.asynccontextmanager
async def telling(cfg: Any) -> AsyncIterator[None]:
    """Run a party's steps before its transport starts; an exception from them is first told
    to every peer (`tell_from_config`), then raised."""
    try:
        yield
    except Exception as exc:
        await tell_from_config(cfg, reason_of(exc))
        raise


class PeerWatch:
    """Watches a starting party's peers: their abort notices, and authentication refusals.

    Install `auth_refused` as the transport's ``on_auth_refused`` hook (it keeps warning for
    the transport's life); run the negotiation under `guard`. ``gone`` holds the peers that
    told this party they stopped (no notice need go back to them).
    """

    def __init__(self, transport: Any, peers: Iterable[str]) -> None:
        self.transport = transport
        self.peers = list(peers)
        self.gone: set[str] = set()
        self._warned: dict[str, tuple[float, int]] = {}  # peer -> (last warning, refused since)
        self._probed: set[str] = set()
        # each peer is queued at most once, so the queue never holds more than the peers
        self._suspects: asyncio.Queue[str] = asyncio.Queue(maxsize=len(self.peers) + 1)

    def auth_refused(self, peer: str, reason: str) -> None:
        """The transport refused a request naming ``peer`` for authentication (``reason``)."""
        now = time.monotonic()
        last, since = self._warned.get(peer, (float("-inf"), 0))
        if now - last < WARN_EVERY:
            self._warned[peer] = (last, since + 1)
        else:
            self._warned[peer] = (now, 0)
            more = f" ({since} more since the last warning)" if since else ""
            log.warning(
                "%s: refused a request from its peer %r for authentication: %s%s. Most likely "
                "the two parties hold different secrets or keys ([security] secret / "
                "secret_env / secret_file, or private_key and [security.public_keys]), their "
                "clocks differ by more than the replay window, or another party signs in its "
                "name",
                self.transport.name,
                peer,
                reason[:MAX_REASON],
                more,
            )
        if peer not in self._probed and peer in self.peers:
            self._probed.add(peer)
            self._suspects.put_nowait(peer)

    async def guard(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` while watching; a peer's abort notice (`PeerAbortedError`) or a
        secret found to differ (`AuthenticationError`) cancels it and is raised instead."""
        try:
            async with asyncio.TaskGroup() as tg:
                main = tg.create_task(self._notice_first(work))
                watcher = tg.create_task(self._watch())
                await asyncio.wait({main})
                watcher.cancel()
        except ExceptionGroup as group:
            raise _lone(group) from None
        return main.result()

    async def _notice_first(self, work: Coroutine[Any, Any, T]) -> T:
        """``work``; when a peer refuses it because that peer is stopping, its abort notice
        (which says why) is on its way: wait up to `SEND_SECONDS` for the watcher to raise
        it, and raise the refusal only if it does not come."""
        try:
            return await work
        except AdmissionError as exc:
            if exc.field == STOPPING:
                await asyncio.sleep(SEND_SECONDS)
            raise

    async def _watch(self) -> None:
        """Runs until cancelled, or until a notice or a probe raises."""
        async with asyncio.TaskGroup() as tg:
            for peer in self.peers:
                tg.create_task(self._notices(peer))
            while True:
                tg.create_task(self._probe(await self._suspects.get()))

    async def _notices(self, peer: str) -> None:
        """Raise `PeerAbortedError` on ``peer``'s abort notice; skip its probes."""
        while True:
            try:
                frame = await self.transport.recv(peer, NOTICE)
            except TransportClosedError:
                return  # the negotiation meets the same closed link and says so
            meta = frame.meta
            if meta.get("notice") == "abort":
                self.gone.add(peer)
                raise PeerAbortedError(peer, str(meta.get("reason", "(no reason given)")))

    async def _probe(self, peer: str) -> None:
        """Does ``peer`` accept our signature? `AuthenticationError` when it refuses it or no
        longer answers, after we refused its request for authentication. A peer that does not
        answer at its address at all (not started yet) cannot have sent that request (a party
        listens before it sends): it was a stranger's, and proves nothing; the next refusal
        in the peer's name probes again."""
        me = self.transport.name
        if not await self._reachable(peer):
            self._probed.discard(peer)
            log.info(
                "%s: %r does not answer at its address yet, so the request refused in its "
                "name was most likely a stranger's; it is asked again at the next refusal",
                me,
                peer,
            )
            return
        try:
            async with asyncio.timeout(PROBE_SECONDS):
                await self.transport.send(peer, NOTICE, Frame(meta={"notice": "probe"}))
        except AuthenticationError as exc:
            raise AuthenticationError(
                f"authentication failed both ways between {me!r} and {peer!r}: {me!r} refuses "
                f"{peer!r}'s signature and {peer!r} refuses ours ({exc}). Give every party the "
                "same [security] secret"
            ) from None
        except (TimeoutError, TransportClosedError) as exc:
            raise AuthenticationError(
                f"{me!r} refused {peer!r}'s request for authentication (its signature does not "
                f"verify with this party's secret) and {peer!r} no longer answers "
                f"({str(exc) or f'no answer within {PROBE_SECONDS:g} s'}); most likely the "
                "parties hold different secrets: give every party the same [security] secret"
            ) from None
        except (FrameError, TransportError):
            pass  # it answered past authentication: the refused request was not its own
        log.info(
            "%s: %r accepts our signature; the request refused in its name was not its own",
            me,
            peer,
        )

    async def _reachable(self, peer: str) -> bool:
        """Whether ``peer`` answers at its address within `PROBE_SECONDS` (anonymously: this
        says nothing of who it is); True where the transport cannot tell."""
        if not isinstance(self.transport, PeerWaitingTransport):
            return True
        try:
            await self.transport.wait_for_peers(PROBE_SECONDS, peers=[peer])
        except (PeersUnreachableError, TransportClosedError):
            return False
        return True


def _lone(exc: Exception) -> Exception:
    """The lone exception of a (nested) task group as itself; a group of several stays."""
    while isinstance(exc, ExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


async def tell_the_others(watch: PeerWatch, told: Iterable[str], exc: BaseException) -> None:
    """After ``exc`` stopped the start: `tell_peers` every peer that neither told this party
    it stopped (``watch.gone``) nor was told by the negotiation itself (``told``)."""
    skip = set(told) | watch.gone
    peers = [p for p in watch.peers if p not in skip]
    if peers:
        await tell_peers(watch.transport, peers, reason_of(exc))


__all__ = [
    "NOTICE",
    "PeerAbortedError",
    "PeerWatch",
    "abort_frame",
    "reason_of",
    "tell_from_config",
    "tell_peers",
    "tell_the_others",
    "telling",
]
