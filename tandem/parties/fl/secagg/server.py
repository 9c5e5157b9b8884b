"""The server side of a secure-aggregation round (SecAgg+, Bell et al., CCS 2020, over the
stages of Bonawitz et al., CCS 2017; described in docs/federated.md, "Secure aggregation").

`SecureRound.run` drives the four stages over the clients that were sent the round's training
request: collect the signed key adverts (U1, bounded by the round's deadline: it covers the
clients' training) and fix the sharing graph over them (`graph`), relay the sealed shares to
their holders (U2), collect the masked payloads (U3), collect the unmasking shares (U4) and
rebuild each U3 client's self-mask seed and the mask key of each U2-but-not-U3 client that a
survivor masked with. Every stage needs at least ``thr`` clients and every secret ``t_share``
valid shares, else the round is aborted (the model does not move). The server learns the sum
of U3's payloads and the sets U1..U4.

Shares returned at unmasking are checked against the commitments their dealer published at
stage 1: a holder that returns a wrong share is named (``cheats``) and its share is ignored; a
dealer whose rebuilt secret does not match what it published (its shares were inconsistent)
is named and the round is aborted. Either way no client moves the sum beyond its own payload.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from tandem.errors import ConfigError, TandemError
from tandem.transports.base import Frame, Transport

from . import crypto, shamir
from . import masking as M
from .config import SecAggConfig
from .graph import Graph, graph_seed
from .messages import SEALED, SECAGG, SECRET, SHARE

log = logging.getLogger(__name__)


class Aborted(TandemError):
    """The round's secure sum was abandoned; the message says why."""


async def gather(
    t: Transport, names: Sequence[str], rnd: int, kind: str, timeout: float
) -> dict[str, Frame]:
    """Each named client's next ``kind`` message of round ``rnd`` (others skipped), for those
    that send one within ``timeout`` seconds."""
    got: dict[str, Frame] = {}

    async def one(c: str) -> None:
        try:
            while True:
                f = await t.recv(c, SECAGG)
                if f.meta.get("round") == rnd and f.meta.get("kind") == kind:
                    got[c] = f
                    return
        except TandemError:
            return  # link closed: this client dropped

    try:
        async with asyncio.timeout(timeout):
            async with asyncio.TaskGroup() as tg:
                for c in names:
                    tg.create_task(one(c))
    except TimeoutError:
        pass
    return got


class SecureRound:
    """One round's secure sum among ``clients`` (who were sent the training request).

    ``roster`` (a `tandem.transports.keys.Roster`, optional) checks the advertised keys'
    signatures; ``shape`` is the uplink payload's shape. After `run`, ``cheats`` maps named
    cheaters to what they did and ``stages`` the size of U1..U4.
    """

    def __init__(
        self,
        t: Transport,
        cfg: SecAggConfig,
        rnd: int,
        clients: Sequence[str],
        shape: tuple[int, ...],
        *,
        wait: float,
        roster: Any = None,
    ) -> None:
        self.t, self.cfg, self.rnd = t, cfg, rnd
        self.clients, self.shape, self.wait, self.roster = sorted(clients), shape, wait, roster
        self.n = len(self.clients)
        self.thr = cfg.threshold(self.n)  # clients needed at every stage
        self.t_share = self.thr  # shares needed to rebuild a secret (set with the graph)
        self.label = f"{t.name}|{rnd}".encode()
        self.cheats: dict[str, str] = {}
        self.stages: dict[str, int] = {}
        self.evals: dict[str, Any] = {}  # U3 client -> the ``eval`` beside its masked input

    def params(self) -> dict[str, Any]:
        """What the training request's ``meta.secagg`` tells each client."""
        noise = self.cfg.client_noise(self.n)
        return {
            "scale": self.cfg.scale,
            "clip": self.cfg.clip,
            "bound": self.cfg.bound(self.n),
            "noise": noise,
            "wait": self.wait + 4 * self.cfg.stage_timeout,
        }

    def _enough(self, stage: str, got: Sequence[str]) -> list[str]:
        self.stages[stage] = len(got)
        log.info(
            "round %d secure sum: %d/%d clients at stage %s", self.rnd, len(got), self.n, stage
        )
        if len(got) < self.thr:
            raise Aborted(
                f"round {self.rnd}: only {len(got)} of {self.n} clients reached secure-"
                f"aggregation stage {stage!r}, below the threshold {self.thr} (secagg."
                "max_dropout); the model does not move this round"
            )
        return sorted(got)

    async def _abort(self, names: Sequence[str]) -> None:
        async with asyncio.TaskGroup() as tg:
            for c in names:
                tg.create_task(self._send(c, {"kind": "abort"}))

    async def _send(self, c: str, meta: dict[str, Any], arrays: tuple = ()) -> None:
        try:
            async with asyncio.timeout(self.cfg.stage_timeout):
                await self.t.send(c, SECAGG, Frame(meta={**meta, "round": self.rnd}, arrays=arrays))
        except (TandemError, TimeoutError):
            pass  # a client gone now is handled as a drop-out at the next stage

    async def _broadcast(self, sends: dict[str, tuple[dict[str, Any], tuple]]) -> None:
        async with asyncio.TaskGroup() as tg:
            for c, (meta, arrays) in sends.items():
                tg.create_task(self._send(c, meta, arrays))

    async def run(self) -> tuple[list[str], np.ndarray]:
        """The sum of the surviving clients' payloads (float32, ``shape``) and their names.
        Raises `Aborted` (after telling the clients) when the round cannot complete."""
        names, words = await self.run_words()
        return names, M.decode(words, self.cfg.scale)

    async def run_words(self) -> tuple[list[str], np.ndarray]:
        """`run`'s sum as the ring's words (uint32, the sum of the encoded payloads modulo
        2**32), for callers that decode an exact integer sum themselves."""
        try:
            return await self._stages()
        except Aborted:
            await self._abort(self.clients)
            raise

    async def _stages(self) -> tuple[list[str], np.ndarray]:
        adverts = await gather(self.t, self.clients, self.rnd, "advertise", self.wait)
        u1 = self._enough("advertise", [c for c, f in adverts.items() if self._advert_ok(c, f)])
        keys: dict[str, Any] = {
            k: [adverts[c].meta[k] for c in u1] for k in ("c_pk", "s_pk", "key_id", "sig")
        }
        self._plan_graph(u1, keys)
        keys.update(kind="keys", names=u1, t=self.t_share, k=self.graph.k)
        await self._broadcast({c: (keys, ()) for c in u1})
        self.s_pk = {c: bytes.fromhex(adverts[c].meta["s_pk"]) for c in u1}
        shares = await gather(self.t, u1, self.rnd, "shares", self.cfg.stage_timeout)
        u2 = self._enough("shares", [c for c, f in shares.items() if self._shares_ok(c, f)])
        await self._broadcast({v: self._relay(v, u2, shares) for v in u2})
        self.commits = {u: shares[u].arrays[1] for u in u2}
        self.b_hash = {u: bytes.fromhex(shares[u].meta["b_hash"]) for u in u2}
        self.index = {c: i for i, c in enumerate(u1)}
        masked = await gather(self.t, u2, self.rnd, "masked", self.cfg.stage_timeout)
        u3 = self._enough("masked", [c for c, f in masked.items() if self._masked_ok(f)])
        self.evals = {c: masked[c].meta.get("eval") for c in u3}
        await self._broadcast({c: ({"kind": "survivors", "names": u3}, ()) for c in u3})
        unmask = await gather(self.t, u3, self.rnd, "unmask", self.cfg.stage_timeout)
        u4 = self._enough("unmask", [c for c, f in unmask.items() if self._unmask_ok(f, u2, u3)])
        total = np.zeros(self.shape, M.RING)
        for c in u3:
            total += masked[c].arrays[0]
        total = await asyncio.to_thread(self._unmask, total, u2, u3, {c: unmask[c] for c in u4})
        return u3, total

    @property
    def degree(self) -> int | None:
        """The round's sharing-graph degree (``n - 1``: complete); None before the key list."""
        graph = getattr(self, "graph", None)
        return None if graph is None else graph.k

    def _plan_graph(self, u1: list[str], keys: dict[str, Any]) -> None:
        """The round's sharing graph over the key list ``u1`` and its share threshold."""
        try:
            k, self.t_share = self.cfg.layout(len(u1), self.n)
        except ConfigError as exc:
            raise Aborted(f"round {self.rnd}: {exc}") from None
        self.graph = Graph(u1, k, graph_seed(self.label, u1, keys["c_pk"], keys["s_pk"]))
        self.row = {u: {h: i for i, h in enumerate(self.graph.holders(u))} for u in u1}

    # -- validation of what each client sent -------------------------------------------------
    def _advert_ok(self, c: str, f: Frame) -> bool:
        m = f.meta
        try:
            c_pk, s_pk = bytes.fromhex(m["c_pk"]), bytes.fromhex(m["s_pk"])
        except (KeyError, TypeError, ValueError):
            return False
        if len(c_pk) != 32 or len(s_pk) != 32 or f.arrays:
            return False
        if self.roster is not None:
            try:
                self.roster.check(
                    m.get("key_id"), m.get("sig"), crypto.advert_bytes(self.label, c, c_pk, s_pk), c
                )
            except (TandemError, TypeError, ValueError):
                self.cheats[c] = "its advertised keys are not signed with its identity key"
                return False
        return True

    def _shares_ok(self, c: str, f: Frame) -> bool:
        holders = self.graph.holders(c)
        others = [v for v in holders if v != c]
        ok = (
            f.meta.get("to") == others
            and len(f.arrays) == 2
            and f.arrays[0].dtype == np.uint8
            and f.arrays[0].shape == (len(others), SEALED)
            and f.arrays[1].dtype == np.uint8
            and f.arrays[1].shape == (len(holders), 2, 32)
            and isinstance(f.meta.get("b_hash"), str)
            and len(f.meta["b_hash"]) == 64
        )
        return bool(ok)

    def _relay(self, v: str, u2: list[str], shares: dict[str, Frame]) -> tuple[dict, tuple]:
        senders = [u for u in u2 if u != v and v in self.row[u]]
        rows = [shares[u].arrays[0][shares[u].meta["to"].index(v)] for u in senders]
        table = np.array(rows, np.uint8).reshape(len(senders), SEALED)
        return {"kind": "shares", "from": senders}, (table,)

    def _masked_ok(self, f: Frame) -> bool:
        return (
            len(f.arrays) == 1 and f.arrays[0].dtype == M.RING and f.arrays[0].shape == self.shape
        )

    def _unmask_ok(self, f: Frame, u2: list[str], u3: list[str]) -> bool:
        b_of, s_of = f.meta.get("b_of"), f.meta.get("s_of")
        if not isinstance(b_of, list) or not isinstance(s_of, list) or len(f.arrays) != 2:
            return False
        if set(b_of) - set(u3) or set(s_of) - (set(u2) - set(u3)):
            return False
        return all(
            a.dtype == np.uint8 and a.shape == (len(names), SHARE)
            for a, names in zip(f.arrays, (b_of, s_of), strict=True)
        )

    # -- unmasking ---------------------------------------------------------------------------
    def _index_unmask(self, unmask: dict[str, Frame]) -> dict[str, tuple[dict[str, int], ...]]:
        """Per holder, the row of each dealer's b-share and s-share in its ``unmask`` message;
        a holder that names a dealer whose shares it was not dealt is named a cheat."""
        out = {}
        for h, f in unmask.items():
            out[h] = tuple({d: i for i, d in enumerate(f.meta[key])} for key in ("b_of", "s_of"))
            for dealer in (d for rows in out[h] for d in rows if h not in self.row[d]):
                self.cheats[h] = f"returned a share of {dealer}'s secret that it was not dealt"
        return out

    def _collect(
        self,
        dealer: str,
        what: bytes,
        unmask: dict[str, Frame],
        rows: dict[str, tuple[dict[str, int], ...]],
    ) -> dict[int, bytes]:
        """The shares of ``dealer``'s secret ``what`` (b or s) that match its commitments, from
        its holders' ``unmask`` messages (``rows``: `_index_unmask`). O(holders) per dealer."""
        col = 0 if what == b"b" else 1
        out = {}
        for h, row in self.row[dealer].items():
            at = rows[h][col].get(dealer) if h in rows else None
            if at is None:
                continue
            share = unmask[h].arrays[col][at].tobytes()
            if crypto.commit(self.label, dealer, h, what, share) != (
                self.commits[dealer][row, col].tobytes()
            ):
                self.cheats[h] = f"returned a share of {dealer}'s secret that it was not dealt"
                continue
            out[self.index[h] + 1] = share
        if len(out) < self.t_share:
            raise Aborted(
                f"round {self.rnd}: only {len(out)} valid shares of {dealer}'s secret, below "
                f"the threshold {self.t_share}"
            )
        return out

    def _unmask(
        self, total: np.ndarray, u2: list[str], u3: list[str], unmask: dict[str, Frame]
    ) -> np.ndarray:
        label, rows = self.label, self._index_unmask(unmask)
        for u in u3:
            b = shamir.combine(self._collect(u, b"b", unmask, rows), SECRET, self.t_share)
            if crypto.secret_hash(label, u, b) != self.b_hash[u]:
                self.cheats[u] = "dealt inconsistent shares of its self-mask seed"
                raise Aborted(f"round {self.rnd}: {u} dealt inconsistent shares; round aborted")
            total -= M.prg(b, label + b"|self", total.size).reshape(total.shape)
        for u in sorted(set(u2) - set(u3)):
            masked_with = [v for v in u3 if v in self.row[u]]
            if not masked_with:
                continue  # no survivor masked with u: nothing of its to remove
            try:
                key = crypto.KeyPair.from_secret(
                    shamir.combine(self._collect(u, b"s", unmask, rows), SECRET, self.t_share)
                )
            except (shamir.ShareError, ValueError):
                key = None
            if key is None or key.public != self.s_pk[u]:
                self.cheats[u] = "dealt inconsistent shares of its mask key"
                raise Aborted(f"round {self.rnd}: {u} dealt inconsistent shares; round aborted")
            for v in masked_with:
                seed = key.agree(self.s_pk[v], b"mask|" + label, u, v)
                m = M.prg(seed, label + b"|pair", total.size).reshape(total.shape)
                total = total - m if M.pair_sign(v, u) > 0 else total + m
        return total
