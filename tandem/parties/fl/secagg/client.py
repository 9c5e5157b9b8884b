"""The client side of a secure-aggregation round (SecAgg+, Bell et al., CCS 2020, over the
stages of Bonawitz et al., CCS 2017; described in docs/federated.md, "Secure aggregation").

`contribute` runs after local training, in place of sending the update in the clear:
advertise two fresh X25519 public keys (signed with the client's identity key when it has
one), share its self-mask seed and mask key t-of-k with its neighbours in the round's sharing
graph (`graph`; sealed pairwise, relayed by the server), send its payload masked with those
neighbours, then answer the server's
unmasking request with the shares it holds. Each stage's wait is bounded by ``wait``; a
round the server aborts or that runs out of time is abandoned (nothing is revealed).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from tandem.errors import TandemError
from tandem.transports.base import Frame, Transport

from . import crypto, shamir
from . import masking as M
from .graph import Graph, check_degree, graph_seed
from .messages import SEALED, SECAGG, SHARE

log = logging.getLogger(__name__)


class LeaveRound(TandemError):
    """Raised by a stage hook to leave the round there (tests simulate drop-outs with it)."""


class RoundAbandoned(TandemError):
    """The round ended for this client without its contribution being unmasked."""


Hook = Callable[[int, str], Awaitable[None]]


async def _recv(t: Transport, server: str, rnd: int, kind: str, wait: float) -> Frame:
    try:
        async with asyncio.timeout(wait):
            while True:
                frame = await t.recv(server, SECAGG)
                if frame.meta.get("round") != rnd:
                    continue  # a past round's message
                if frame.meta.get("kind") == "abort":
                    raise RoundAbandoned(f"round {rnd}: the server aborted the secure sum")
                if frame.meta.get("kind") == kind:
                    return frame
    except TimeoutError:
        raise RoundAbandoned(f"round {rnd}: no {kind!r} message within {wait} s") from None


def _check_keys(meta: dict[str, Any], me: str, label: bytes, roster: Any) -> tuple[int, Graph]:
    """Validate the server's key list; returns the threshold and the round's sharing graph.
    Raises `RoundAbandoned`."""
    names, t = meta.get("names"), meta.get("t")
    if not isinstance(names, list) or me not in names or len(set(names)) != len(names):
        raise RoundAbandoned(f"the key list must name this client once, got {names!r}")
    for key in ("c_pk", "s_pk", "key_id", "sig"):
        if not isinstance(meta.get(key), list) or len(meta[key]) != len(names):
            raise RoundAbandoned(f"the key list's {key} must have one entry per client")
    try:
        k = check_degree(meta.get("k"), len(names))
    except ValueError as exc:
        raise RoundAbandoned(f"the key list's sharing graph: {exc}") from None
    graph = Graph(names, k, graph_seed(label, names, meta["c_pk"], meta["s_pk"]))
    held = len(graph.holders(me))
    if not isinstance(t, int) or not held // 2 < t <= held:
        raise RoundAbandoned(f"threshold t={t!r} must exceed half of the {held} share holders")
    if roster is not None:
        for i, name in enumerate(names):
            data = crypto.advert_bytes(
                label, name, bytes.fromhex(meta["c_pk"][i]), bytes.fromhex(meta["s_pk"][i])
            )
            try:
                roster.check(meta["key_id"][i], meta["sig"][i], data, name)
            except TandemError as exc:
                why = f"{name}'s advertised keys are not signed by it: {exc}"
                raise RoundAbandoned(why) from None
    return t, graph


class _ClientRound:
    """One client's state in one round: fresh keys and seed, and the stages in order."""

    graph: Graph  # set by `deal`
    own: tuple[bytes, bytes] | None  # this client's shares of its own secrets (complete graph)

    def __init__(self, t: Transport, server: str, rnd: int, params: dict[str, Any]) -> None:
        self.t, self.server, self.rnd, self.params = t, server, rnd, params
        self.me, self.wait = t.name, float(params["wait"])
        self.label = f"{server}|{rnd}".encode()
        self.c_key, self.s_key, self.b_seed = crypto.KeyPair(), crypto.KeyPair(), os.urandom(32)

    async def send(self, meta: dict[str, Any], arrays: tuple = ()) -> None:
        await self.t.send(
            self.server, SECAGG, Frame(meta={**meta, "round": self.rnd}, arrays=arrays)
        )

    async def recv(self, kind: str) -> Frame:
        return await _recv(self.t, self.server, self.rnd, kind, self.wait)

    def advert(self, signer: Any) -> dict[str, Any]:
        c_pk, s_pk = self.c_key.public, self.s_key.public
        sig = signer.sign(crypto.advert_bytes(self.label, self.me, c_pk, s_pk)) if signer else ""
        key_id = signer.key_id if signer else ""
        return {
            "kind": "advertise",
            "c_pk": c_pk.hex(),
            "s_pk": s_pk.hex(),
            "key_id": key_id,
            "sig": sig,
        }

    def deal(self, keys: dict[str, Any], thr: int, graph: Graph) -> tuple[dict[str, Any], tuple]:
        """The ``shares`` message: sealed shares for the other holders of this client's
        secrets, and commitments to every holder's shares."""
        me, label = self.me, self.label
        names = list(keys["names"])
        self.graph = graph
        idx = {n: i + 1 for i, n in enumerate(names)}
        self.c_pk = {n: bytes.fromhex(h) for n, h in zip(names, keys["c_pk"], strict=True)}
        self.s_pk = {n: bytes.fromhex(h) for n, h in zip(names, keys["s_pk"], strict=True)}
        holders = graph.holders(me)
        xs = [idx[h] for h in holders]
        b_sh = shamir.split(self.b_seed, xs, thr)
        s_sh = shamir.split(self.s_key.secret(), xs, thr)
        self.own = (b_sh[idx[me]], s_sh[idx[me]]) if graph.complete else None
        others = [n for n in holders if n != me]
        sealed = np.zeros((len(others), SEALED), np.uint8)
        # one key per pair, both directions (the AAD says which way a box goes)
        self.enc = {
            v: self.c_key.agree(self.c_pk[v], b"enc|" + label, me, v) for v in graph.neighbours(me)
        }
        nonces = os.urandom(crypto.NONCE * len(others))  # one read for every box
        for row, v in enumerate(others):
            box = crypto.seal(
                self.enc[v],
                b_sh[idx[v]] + s_sh[idx[v]],
                label + f"|{me}|{v}".encode(),
                nonces[crypto.NONCE * row : crypto.NONCE * (row + 1)],
            )
            sealed[row] = np.frombuffer(box, np.uint8)
        commits = np.zeros((len(holders), 2, 32), np.uint8)
        for row, v in enumerate(holders):
            for col, (what, sh) in enumerate(((b"b", b_sh), (b"s", s_sh))):
                commits[row, col] = np.frombuffer(
                    crypto.commit(label, me, v, what, sh[idx[v]]), np.uint8
                )
        meta = {
            "kind": "shares",
            "to": others,
            "b_hash": crypto.secret_hash(label, me, self.b_seed).hex(),
        }
        return meta, (sealed, commits)

    def open_shares(self, got: Frame) -> dict[str, tuple[bytes, bytes]]:
        """The (b, s) shares this client holds of each dealer (itself included)."""
        senders = got.meta.get("from")
        if (
            not isinstance(senders, list)
            or len(got.arrays) != 1
            or got.arrays[0].shape != (len(senders), SEALED)
        ):
            raise RoundAbandoned(f"round {self.rnd}: malformed relayed shares {dict(got.meta)!r}")
        held = {} if self.own is None else {self.me: self.own}
        near = set(self.graph.neighbours(self.me))
        for u, row in zip(senders, got.arrays[0], strict=True):
            if u not in near or u in held:
                raise RoundAbandoned(
                    f"round {self.rnd}: relayed shares from {u!r}, not a neighbour in the key list"
                )
            key = self.enc[u]
            plain = crypto.open_sealed(
                key, row.astype(np.uint8).tobytes(), self.label + f"|{u}|{self.me}".encode()
            )
            if plain is None or len(plain) != 2 * SHARE:
                raise RoundAbandoned(f"round {self.rnd}: the shares from {u!r} do not open")
            held[u] = (plain[:SHARE], plain[SHARE:])
        return held

    def masked(
        self, payload: np.ndarray, shared: list[str], rng: np.random.Generator | None
    ) -> np.ndarray:
        """Clip, add this client's noise share (if any), encode, and mask."""
        p = self.params
        x = np.clip(np.asarray(payload, np.float64), -float(p["clip"]), float(p["clip"]))
        if float(p.get("noise", 0.0)) > 0:
            x = x + (rng or np.random.default_rng()).normal(0.0, float(p["noise"]), x.shape)
        words = M.encode(x, float(p["bound"]), float(p["scale"]))
        pair = {
            v: self.s_key.agree(self.s_pk[v], b"mask|" + self.label, self.me, v)
            for v in shared
            if v != self.me
        }
        return M.mask(words, self.b_seed, pair, self.me, self.label)

    def unmask(
        self, surv: Any, held: dict[str, tuple[bytes, bytes]], thr: int
    ) -> tuple[dict, tuple]:
        """The ``unmask`` message: b-shares of the survivors, s-shares of the others."""
        shared = sorted(held)
        g = self.graph
        if (
            not isinstance(surv, list)
            or self.me not in surv
            or not set(surv) <= set(g.names)
            or not set(surv) & set(g.neighbours(self.me)) <= set(shared)
            or len(set(surv) & set(g.holders(self.me))) < thr
        ):
            raise RoundAbandoned(f"round {self.rnd}: the survivor list {surv!r} is not acceptable")
        b_of = [u for u in shared if u in surv]
        s_of = [u for u in shared if u not in surv]
        rows = [np.zeros((len(names), SHARE), np.uint8) for names in (b_of, s_of)]
        for i, u in enumerate(b_of):
            rows[0][i] = np.frombuffer(held[u][0], np.uint8)
        for i, u in enumerate(s_of):
            rows[1][i] = np.frombuffer(held[u][1], np.uint8)
        return {"kind": "unmask", "b_of": b_of, "s_of": s_of}, tuple(rows)


async def contribute(
    t: Transport,
    server: str,
    rnd: int,
    payload: np.ndarray,
    params: dict[str, Any],
    *,
    signer: Any = None,
    roster: Any = None,
    hook: Hook | None = None,
    rng: np.random.Generator | None = None,
    beside: dict[str, Any] | None = None,
) -> None:
    """Take part in round ``rnd``'s secure sum with ``payload`` (float32). ``params`` is the
    training request's ``meta.secagg``: ``scale``, ``clip``, ``bound``, ``noise``, ``wait``.
    ``beside`` (plain JSON) travels in the clear in the masked input's meta (the federated
    evaluation's sums: `tandem.parties.fl.evaluation`).
    ``hook(rnd, stage)`` runs before each send (stages ``advertise``, ``shares``,
    ``masked``, ``unmask``). Raises `RoundAbandoned` when the round ends without this client
    (the caller goes on)."""
    run = _ClientRound(t, server, rnd, params)
    step = hook or (lambda r, s: asyncio.sleep(0))
    await step(rnd, "advertise")
    await run.send(run.advert(signer))
    keys = dict((await run.recv("keys")).meta)
    thr, graph = _check_keys(keys, run.me, run.label, roster)
    meta, arrays = await asyncio.to_thread(run.deal, keys, thr, graph)
    await step(rnd, "shares")
    await run.send(meta, arrays)
    held = await asyncio.to_thread(run.open_shares, await run.recv("shares"))
    masked = await asyncio.to_thread(run.masked, payload, sorted(held), rng)
    await step(rnd, "masked")
    await run.send({**(beside or {}), "kind": "masked"}, (masked,))
    log.info("%s: round %d: masked input sent", run.me, rnd)
    surv = (await run.recv("survivors")).meta.get("names")
    meta, arrays = run.unmask(surv, held, thr)
    await step(rnd, "unmask")
    await run.send(meta, arrays)
