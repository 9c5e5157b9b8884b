"""The data-summary exchange before round one (federated preprocessing), both sides.

1. Each client says ``hello`` (`tandem.parties.fl.protocol`); the server reads hellos until
   ``server.min_clients`` roster clients have said one (`gather_summaries`).
2. The server asks each of them on ``fl/model``: ``{kind: "summarize", secure, reveal,
   max_abs}``. ``secure`` is None without ``[secagg]``, else the secure sum's parameters
   (`secagg.server.SecureRound.params`); ``reveal`` is ``preprocessing.reveal_categories``;
   ``max_abs`` is ``preprocessing.max_abs``.
3. Each client answers on ``fl/hello`` with ``{kind: "summary", summary}`` (`answer`):
   without secure aggregation, its whole summary (`tandem.parties.data.summary`, less the
   local ``peak``); with it, only the public part (`secure_summary.public_part`: column names
   and kinds, and categorical value counts when ``reveal``), then it takes part in a secure
   sum (round `SUMMARY_ROUND` of `tandem.parties.fl.secagg`, the same four stages as a
   training round) of its numeric sums encoded by `secure_summary.encode`, so the server
   learns their totals over the surviving clients and not any client's.
4. The server merges (`tandem.parties.fl.preprocessing.global_state`) and welcomes every
   client with the state in its task.

A client never sends its numeric sums before it knows which of the two the server runs. What
the server learns either way is in docs/security.md's table.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

from tandem.errors import ConfigError, TandemError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from . import secure_summary as S
from .config import ServerConfig

log = logging.getLogger(__name__)

SUMMARIZE = "summarize"  # kind of a MODEL-channel message: send your data summary
SUMMARY = "summary"  # kind of a HELLO-channel message: a client's answer
SUMMARY_ROUND = -1  # the secure sum's round number (training rounds count from 0)
#: The secure sum of the summaries encodes limbs as themselves: fixed-point scale 1, and
#: a limb is below 2**16 (the clip leaves it unchanged).
LIMB_CLIP = float(2**S.LIMB_BITS - 1)


def check_summary_config(cfg: ServerConfig) -> None:
    """Refuse, before any client is waited for, what the secure summary cannot do: a
    ``max_abs`` that could overflow, or a categorical column whose vocabulary would need
    per-client counts in the clear without ``preprocessing.reveal_categories``."""
    if cfg.secagg is None or cfg.preprocessing.mode != "global":
        return
    S.check_bound(cfg.preprocessing.max_abs, len(cfg.clients))
    declared: dict[str, Any] = {}
    if cfg.data.vocabularies is not None:
        from tandem.parties.data.declared import read_declared

        declared = read_declared(cfg.data.vocabularies, cfg.data.categorical, cfg.data.where)
    counted = [c for c in cfg.data.categorical if not cfg.data.hashed(c) and c not in declared]
    if counted and not cfg.preprocessing.reveal_categories:
        raise ConfigError(
            f"{cfg.path}: under secure aggregation the categorical column(s) {counted} would "
            "need each client's value counts in the clear (a vocabulary names values, and "
            "the counts say how many of a client's rows hold each); hash them instead "
            "(data.hash_buckets, on every party), declare their values (data.vocabularies), "
            "or accept that disclosure with preprocessing.reveal_categories = true"
        )


def _request(cfg: ServerConfig, secure: dict[str, Any] | None) -> Frame:
    return Frame(
        meta={
            "kind": SUMMARIZE,
            "secure": secure,
            "reveal": cfg.preprocessing.reveal_categories,
            "max_abs": cfg.preprocessing.max_abs,
        }
    )


def _summary_round(transport: Transport, cfg: ServerConfig, clients: list[str], columns: int):
    """The `SecureRound` of the summaries' numeric sums among ``clients``."""
    from .secagg.server import SecureRound

    assert cfg.secagg is not None  # Invariant: called under secure aggregation only
    sec = dataclasses.replace(cfg.secagg.build(), scale=1.0, clip=LIMB_CLIP, noise_std=0.0)
    sec.check(len(clients))
    return SecureRound(
        transport,
        sec,
        SUMMARY_ROUND,
        clients,
        (S.words_needed(columns),),
        wait=sec.stage_timeout,
        roster=cfg.secagg.roster(),
    )


class _Reader:
    """Reads every roster client's ``fl/hello`` channel: hellos and summary answers."""

    def __init__(self, transport: Transport, cfg: ServerConfig) -> None:
        self.transport, self.cfg = transport, cfg
        self.said: list[str] = []  # clients that said hello, in order
        self.hellos: list[tuple[str, int, str | None, bool, str | None]] = []
        self.answers: dict[str, dict[str, Any]] = {}
        self.asked: set[str] = set()

    async def read(self, c: str) -> None:
        while True:
            try:
                frame = await self.transport.recv(c, P.HELLO)
            except TandemError:  # its link closed: it says hello again when it is back
                return
            if frame.meta.get("kind") == SUMMARY:
                if c in self.asked and isinstance(frame.meta.get("summary"), dict):
                    self.answers.setdefault(c, dict(frame.meta["summary"]))
                continue
            try:
                version, url = P.check_hello(frame)
            except P.UpdateError as exc:
                log.warning("%s: hello from %r refused: %s", self.transport.name, c, exc)
                continue
            final = frame.meta.get("final") is True
            self.hellos.append((c, version, url, final, P.hello_lineage(frame)))
            if c not in self.said:
                self.said.append(c)

    async def until(self, done: Any, deadline: float) -> None:
        while not done() and time.monotonic() <= deadline:
            await asyncio.sleep(0.05)


async def gather_summaries(
    transport: Transport, cfg: ServerConfig
) -> tuple[dict[str, dict[str, Any]], list[tuple[str, int, str | None, bool, str | None]]]:
    """Run the exchange (module docstring) with the first ``cfg.min_clients`` roster clients
    to say hello (`ConfigError` after ``cfg.wait`` seconds, naming the missing clients).
    Returns the summaries for `tandem.parties.data.summary.merge` and every hello read,
    ``(client, version, url, wants the final model, lineage)``, for the server to answer."""
    reader = _Reader(transport, cfg)
    deadline = time.monotonic() + cfg.wait
    failure: TandemError | None = None
    summaries: dict[str, dict[str, Any]] = {}
    async with asyncio.TaskGroup() as tg:
        readers: dict[str, asyncio.Task[None]] = {}

        async def watch() -> None:
            while True:
                for c in cfg.clients:
                    if c not in readers and c in transport.peers:
                        readers[c] = tg.create_task(reader.read(c))
                await asyncio.sleep(0.05)

        watcher = tg.create_task(watch())
        try:
            await reader.until(lambda: len(reader.said) >= cfg.min_clients, deadline)
            if len(reader.said) < cfg.min_clients:
                _refuse_missing(cfg, reader.said)
            summaries = await _exchange(transport, cfg, reader, deadline)
        except TandemError as exc:  # raised below, not wrapped in an exception group
            failure = exc
        finally:
            watcher.cancel()
            for task in readers.values():
                task.cancel()
    if failure is not None:
        raise failure
    return summaries, reader.hellos


async def _exchange(
    transport: Transport, cfg: ServerConfig, reader: _Reader, deadline: float
) -> dict[str, dict[str, Any]]:
    """Ask the clients that said hello for their summaries; returns them as `merge` takes
    them (under secure aggregation: the public parts and the secure totals)."""
    asked = sorted(reader.said)
    reader.asked.update(asked)
    secure = None
    if cfg.secagg is not None:
        secure = _summary_round(transport, cfg, asked, 0).params()
    for c in asked:
        try:
            await transport.send(c, P.MODEL, _request(cfg, secure))
        except TandemError as exc:
            log.info("%s: cannot ask %r for its summary: %s", transport.name, c, exc)
    await reader.until(lambda: set(asked) <= set(reader.answers), deadline)
    answered = {c: reader.answers[c] for c in asked if c in reader.answers}
    if len(answered) < cfg.min_clients:
        _refuse_missing(cfg, list(answered), asked)
    if cfg.secagg is None:
        return answered
    columns = _columns(answered)
    from .secagg.server import Aborted

    try:
        survivors, words = await _summary_round(
            transport, cfg, sorted(answered), len(columns)
        ).run_words()
    except Aborted as exc:
        raise ConfigError(
            f"{cfg.path}: the secure sum of the clients' data summaries was abandoned ({exc}); "
            "start the clients again (or raise secagg.stage_timeout)"
        ) from None
    totals = S.decode(words, columns)
    log.info("%s: data summaries of %d clients summed securely", transport.name, len(survivors))
    return S.for_merge({c: answered[c] for c in survivors}, totals)


def _columns(answered: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The numeric columns every answer names (the same for all, else `ConfigError`)."""
    first, names = None, None
    for c, s in sorted(answered.items()):
        try:
            got = [str(n["name"]) for n in s["numeric"]]
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"the summary of client {c!r} is malformed ({exc!r})") from None
        if names is None:
            first, names = c, got
        elif got != names:
            raise ConfigError(
                f"client {c!r} summarised the numeric columns {got}, client {first!r} "
                f"{names}; give every party the same [data] features and categorical keys"
            )
    return names or []


def _refuse_missing(cfg: ServerConfig, present: list[str], asked: list[str] | None = None) -> None:
    missing = [c for c in cfg.clients if c not in present]
    what = "connected" if asked is None else f"of the {len(asked)} asked answered"
    raise ConfigError(
        f"{cfg.path}: only {len(present)} of the {cfg.min_clients} clients needed "
        f"(server.min_clients) {what} within {cfg.wait:g} s with the summary of their "
        f"data (federated preprocessing); missing: {missing}. Start them (tandem fl client "
        "--config ...), or lower server.min_clients, or raise server.wait"
    )


async def answer(
    transport: Transport,
    server: str,
    request: Mapping[str, Any],
    summary: Mapping[str, Any],
    *,
    where: str,
    signer: Any = None,
    roster: Any = None,
) -> None:
    """A client's answer to the server's ``summarize`` ``request`` (module docstring, step
    3). Raises `tandem.parties.data.DataError` (naming ``where``, the column and the key)
    before sending anything when a value is beyond the secure sum's ``max_abs``."""
    from .secagg.client import RoundAbandoned, contribute

    secure = request.get("secure")
    if secure is None:
        meta = {"kind": SUMMARY, "summary": S.clear_part(summary)}
        await transport.send(server, P.HELLO, Frame(meta=meta))
        return
    if not isinstance(secure, dict):
        raise TandemError(f"the server's summary request has secure = {secure!r}")
    words = S.encode(summary, S.max_abs_ok(request.get("max_abs")), where)
    public = S.public_part(summary, request.get("reveal") is True)
    await transport.send(server, P.HELLO, Frame(meta={"kind": SUMMARY, "summary": public}))
    try:
        await contribute(
            transport, server, SUMMARY_ROUND, words, secure, signer=signer, roster=roster
        )
    except RoundAbandoned as exc:
        log.warning("%s: the secure sum of the data summaries: %s", transport.name, exc)


__all__ = [
    "SUMMARIZE",
    "SUMMARY",
    "SUMMARY_ROUND",
    "answer",
    "check_summary_config",
    "gather_summaries",
]
