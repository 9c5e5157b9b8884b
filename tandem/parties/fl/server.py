"""The federated server party: sampling, per-round deadline, validation, aggregation, downlink.

A round ``r``:

1. sample ``ceil(fraction * N)`` clients with a generator seeded by ``(seed, r)``; draw the
   round's shared seed (rand-k indices and sketch hashes come from it);
2. in anchor mode, at an anchor version, broadcast the full model to every client;
3. for each sampled client (concurrently, in one TaskGroup under ``round_timeout``): send the
   model message planned by `DownlinkPlanner` for the version that client last confirmed,
   then wait for its update. A client that answers ``resync`` (it restarted and holds an older
   version) gets a message re-planned from the version it names, once per round. Late replies
   to past rounds, and replies naming another server process's ``serial`` (sent to it before
   a restart), are dropped; an update that fails
   `protocol.check_update` (NaN or Inf included) is refused (the reason is in the round
   report) and the round goes on; an update refused from its head (larger than the negotiated
   model's encoded size: `bounds.UpdateBounds`) or for a sample count above the client's
   declared data size ends that client's wait at once too; clients silent at the deadline,
   or whose link closed, are left out;
4. combine the accepted payloads with `FLConfig.aggregator` (a weighted mean by sample count
   unless told otherwise): a linear aggregator combines the compressed payloads and the server
   decompresses once (rand-k and sketches are linear); a non-linear one is given each client's
   decompressed update. Then apply the server rule off the event loop (`FLConfig.optimizer`,
   an optax optimizer, through `tandem.parties.fl.aggregate.optax_step`; else the `ServerRule`
   through `server_step`), record the changed indices for the downlink.

Hooks for a server in its own process (`tandem.parties.fl.server_process`): `wait_ready` runs
before a client is served in a round (wait until it has connected), `after_round` after each
round (checkpoint), ``next_round`` is where `run` starts (a resumed run), and ``inflight``
names the clients whose round is under way (with the round and its seed), so a client that
reconnects mid-round can be sent its round's message again (`send_round`).

Byte accounting reads the transport's own counters (``sent_stats``/``received_stats``), so the
numbers are what the wire carried, headers included.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from tandem.errors import ConfigError, TandemError
from tandem.transports.base import Frame, SizeAdmittingTransport, Transport

from . import compression as C
from . import protocol as P
from .aggregate import ServerState, optax_step, server_step
from .bounds import UpdateBounds
from .downlink import DownlinkPlanner
from .dp import epsilon, next_clip, noisy_sum, unamplified_epsilon
from .evaluation import EVAL, EVALUATE, check_eval, combine
from .quantize import dequantize
from .server_config import FLConfig as FLConfig
from .train import LocalTrainer
from .warmup import round_compression


@dataclasses.dataclass
class RoundReport:
    round: int
    sampled: list[str]
    accepted: list[str]
    dropped: list[str]
    rejected: dict[str, str]
    up_bytes: int
    down_bytes: int
    version: int
    seconds: float
    accuracy: float | None = None
    secure: dict | None = None  # under secure aggregation: thresholds, degree, stages, cheats
    epsilon: float | None = None  # under [dp]: epsilon at dp.delta after this round
    # under distributed DP: epsilon at dp.delta against the server (no amplification by
    # sampling: it knows who took part); None in central mode (`FLServer.epsilon_vs_server`)
    epsilon_vs_server: float | None = None
    clip: float | None = None  # under [dp]: the clip norm this round used
    evaluation: dict | None = None  # the clients' validation rows (`evaluation.combine`)


class FLServer:
    """Runs ``cfg.rounds`` rounds over ``transport`` with the named ``clients``;
    ``sizes`` (client -> rows), where given, bounds each client's sample count
    (`bounds.UpdateBounds`; else its first accepted report does)."""

    def __init__(
        self,
        transport: Transport,
        clients: Sequence[str],
        trainer: LocalTrainer,
        cfg: FLConfig,
        *,
        test_set: tuple[np.ndarray, np.ndarray] | None = None,
        on_round: Callable[[RoundReport], None] | None = None,
        sizes: Mapping[str, int] | None = None,
        roster: Any = None,
    ) -> None:
        if not clients:
            raise ConfigError("a federation needs at least one client")
        self.transport, self.clients = transport, list(clients)
        self.trainer, self.cfg = trainer, cfg
        self.d = trainer.dim
        self.base_uplink = P.check_uplink(cfg.uplink, self.d)
        # this round's uplink and top-k (`warmup.round_compression`); round 0's are the largest
        self.uplink, self.topk = round_compression(
            cfg.warmup, 0, self.base_uplink, cfg.rule.topk, self.d
        )
        self.model = np.array(trainer.init_vec, np.float32, copy=True)
        self.state = ServerState.zeros(self.d)
        combined = P.expected_shape(self.uplink, self.d) if cfg.aggregator.linear else (self.d,)
        self.agg_state = cfg.aggregator.init(np.zeros(combined, np.float32))
        self.opt_state = (
            None if cfg.optimizer is None else cfg.optimizer.init(jnp.asarray(self.model))
        )
        self.next_round = 0  # where `run` starts (a restored server sets it)
        # names this server process in its training requests; a reply naming another (sent to
        # a server that has since restarted, and delivered to this one) is stale: discarded
        self.serial = secrets.token_hex(8)  # fixed width: the requests' size never varies
        self.stale = 0  # such replies discarded
        # names the history of this server's model versions: drawn afresh by a server that
        # starts over, kept by one resumed from its checkpoint. A client's version means a
        # model only within one lineage (a hello names the lineage it holds: `protocol.py`)
        self.lineage = secrets.token_hex(8)
        # under [dp], who each round samples must stay unknown to all but this server (the
        # amplified epsilon assumes it), and `server.seed`, 0 by default, is no secret: the
        # sampling is keyed by fresh bits as well (`sample`)
        self.sampling_key: int | None = secrets.randbits(63) if cfg.dp is not None else None
        self.round_evals: dict[str, tuple[int, float, float]] = {}  # client -> its eval sums
        self.inflight: dict[str, tuple[int, int]] = {}  # client -> (round, seed) being served
        self.planner = DownlinkPlanner(
            self.d, cfg.downlink, log_size=cfg.log_size, anchor_every=cfg.anchor_every
        )
        self.known = {c: 0 for c in self.clients}  # each client's version (lowered by resync)
        # client -> rounds whose aggregate its payload went into (`epsilon_vs_server`)
        self.participation: dict[str, int] = {}
        self.resyncs = 0
        self.test_set, self.on_round = test_set, on_round
        itemsize = 1 if self.uplink["kind"] == "quant" else 4  # uint8 codes, else float32
        raw = itemsize * math.prod(P.expected_shape(self.uplink, self.d))
        self.max_update_bytes = cfg.max_update_bytes or raw + raw // 64 + 4096
        self.bounds = UpdateBounds(self.max_update_bytes, sizes)
        if isinstance(transport, SizeAdmittingTransport):
            transport.admit_size = self.bounds.admit_size
        self.reports: list[RoundReport] = []
        self.final_to: set[str] = set()  # clients that asked for the final model with stop
        self.roster = roster  # checks the clients' signed secure-aggregation keys
        self.per_round = max(1, math.ceil(cfg.fraction * len(self.clients)))
        self.dp_clip = None if cfg.dp is None else cfg.dp.clip
        self.dp_rng = np.random.default_rng()  # OS entropy: DP noise must not be replayable
        self.secagg = cfg.secagg  # with distributed DP: its noise shares set below
        if cfg.secagg is not None and cfg.dp is not None and cfg.dp.mode == "distributed":
            # shares sized for the fewest survivors the secure sum completes with
            thr = cfg.secagg.threshold(self.per_round)
            std = cfg.dp.noise_multiplier * cfg.dp.clip * math.sqrt(self.per_round / thr)
            self.secagg = dataclasses.replace(cfg.secagg, noise_std=std)
        if self.secagg is not None:
            self.secagg.check(self.per_round)  # the ring sum of a round cannot overflow
            self.bounds.secagg_slack = 256 * len(self.clients)

    # -- accounting ----------------------------------------------------------------------------
    def bytes_up(self) -> int:
        return sum(self.transport.received_stats(c).bytes for c in self.clients)

    def bytes_down(self) -> int:
        return sum(self.transport.sent_stats(c).bytes for c in self.clients)

    # -- rounds --------------------------------------------------------------------------------
    async def run(self) -> list[RoundReport]:
        """Rounds ``next_round .. cfg.rounds - 1``, `after_round` after each; then stop."""
        try:
            for r in range(self.next_round, self.cfg.rounds):
                report = await self.round(r)
                self.next_round = r + 1
                await self.after_round(report)
        finally:
            await self.stop_clients()
        return self.reports

    async def wait_ready(self, client: str) -> None:
        """Hook: wait until ``client`` can be served (it runs under the round's deadline)."""

    async def after_round(self, report: RoundReport) -> None:
        """Hook: called after each round, before the next one sends anything."""

    def evaluates(self, r: int) -> bool:
        """Whether round ``r`` evaluates (`FLConfig.eval_every`; the last round always)."""
        every = self.cfg.eval_every
        return r == self.cfg.rounds - 1 or bool(every and (r + 1) % every == 0)

    def sample(self, r: int) -> tuple[list[str], int]:
        """Round ``r``'s clients and shared seed, drawn from ``server.seed`` and ``r`` (and,
        under [dp], this process's secret `sampling_key`, so that no one who knows the seed
        can tell who took part)."""
        key = (
            [self.cfg.seed, r]
            if self.sampling_key is None
            else [self.cfg.seed, r, self.sampling_key]
        )
        rng = np.random.default_rng(key)
        m = max(1, math.ceil(self.cfg.fraction * len(self.clients)))
        picked = rng.choice(len(self.clients), size=m, replace=False)
        return [self.clients[i] for i in sorted(picked)], int(rng.integers(1, 2**31))

    async def round(self, r: int) -> RoundReport:
        t0, up0, down0 = time.perf_counter(), self.bytes_up(), self.bytes_down()
        self.round_evals = {}
        sampled, seed = self.sample(r)
        self.uplink, self.topk = round_compression(
            self.cfg.warmup, r, self.base_uplink, self.cfg.rule.topk, self.d
        )
        broadcast = self.planner.anchor_due()
        if broadcast:
            self.planner.set_anchor()
        accepted: dict[str, tuple[int, np.ndarray]] = {}
        rejected: dict[str, str] = {}
        targets = self.clients if broadcast else sampled
        secure: dict | None = None
        if self.cfg.secagg is not None:
            secure = await self._secure_round(r, seed, sampled, broadcast, accepted, rejected)
            targets = []
        try:
            async with asyncio.timeout(self.cfg.round_timeout):
                async with asyncio.TaskGroup() as tg:
                    for c in targets:
                        tg.create_task(
                            self._serve(c, r, seed, c in sampled, broadcast, accepted, rejected)
                        )
        except TimeoutError:
            pass
        clip = self.dp_clip
        if secure is not None and "sum" in secure:
            total = secure.pop("sum")
            if self.cfg.dp is not None and self.cfg.dp.mode == "central":
                std = self.cfg.dp.noise_multiplier * self.cfg.dp.clip
                total = total + self.dp_rng.normal(0.0, std, total.shape).astype(np.float32)
            mean = total / np.float32(len(accepted))
            await asyncio.to_thread(self._step, self._decode(mean, seed))
        elif accepted:
            names = sorted(accepted)
            await asyncio.to_thread(
                self._apply, [accepted[c][1] for c in names], [accepted[c][0] for c in names], seed
            )
        for c in accepted:  # every accepted payload went into this round's aggregate
            self.participation[c] = self.participation.get(c, 0) + 1
        acc = None
        if self.test_set is not None and self.evaluates(r):
            acc = await asyncio.to_thread(self.trainer.accuracy, self.model, *self.test_set)
        report = RoundReport(
            round=r,
            sampled=sampled,
            accepted=sorted(accepted),
            dropped=sorted(set(sampled) - set(accepted) - set(rejected)),
            rejected=rejected,
            up_bytes=self.bytes_up() - up0,
            down_bytes=self.bytes_down() - down0,
            version=self.planner.version,
            seconds=time.perf_counter() - t0,
            accuracy=acc,
            secure=secure,
            epsilon=await asyncio.to_thread(self.epsilon, r + 1),
            epsilon_vs_server=await asyncio.to_thread(self.epsilon_vs_server),
            clip=clip,
            evaluation=combine(self.round_evals, self.trainer.classifies)
            if self.cfg.client_eval and self.evaluates(r)
            else None,
        )
        self.reports.append(report)
        if self.on_round is not None:
            self.on_round(report)
        return report

    async def _send(self, c: str, meta: dict[str, Any], arrays: tuple) -> None:
        arrays, info = P.pack_arrays(arrays, self.cfg.lossless)
        if info is not None:
            meta["zlib"] = info
        await self.transport.send(c, P.MODEL, Frame(meta=meta, arrays=arrays))

    async def _secure_round(
        self, r: int, seed: int, sampled: list[str], broadcast: bool, accepted: dict, rejected: dict
    ) -> dict:
        """Round ``r`` under secure aggregation: deliver the training requests, run the
        secure sum (`secagg.server.SecureRound`); ``accepted`` gets the survivors, ``rejected``
        the named cheaters. Returns the report's ``secure`` entry, with ``"sum"`` (the
        survivors' payload sum) unless the round was aborted."""
        from .secagg.server import Aborted, SecureRound

        assert self.secagg is not None  # Invariant: called under secure aggregation only
        shape = P.expected_shape(self.uplink, self.d)
        sr = SecureRound(
            self.transport, self.secagg, r, sampled, shape,
            wait=self.cfg.round_timeout, roster=self.roster,
        )  # fmt: skip
        params = sr.params()

        async def deliver(c: str) -> None:
            try:
                async with asyncio.timeout(self.cfg.round_timeout):
                    await self.wait_ready(c)
                    if broadcast:
                        await self._send_anchor(c)
                    if c in sampled:
                        await self.send_round(c, r, seed, secagg=params)
            except (TandemError, TimeoutError):
                pass  # not reached: it drops out of the secure sum

        async with asyncio.TaskGroup() as tg:
            for c in self.clients if broadcast else sampled:
                tg.create_task(deliver(c))
        out: dict[str, Any] = {"threshold": sr.thr}
        try:
            survivors, total = await sr.run()
            accepted.update({c: (1, None) for c in survivors})
            for c in survivors:  # the evaluation sums travel beside the masked input
                if self.cfg.client_eval and self.evaluates(r):
                    try:
                        self.round_evals[c] = check_eval(sr.evals.get(c), who=c, max_rows=2**31)
                    except P.UpdateError as exc:
                        out.setdefault("eval_refused", {})[c] = str(exc)
            for c in survivors:  # each trained on this round's model message
                self.known[c] = max(self.known[c], self.planner.version)
            out["sum"] = total
        except Aborted as exc:
            out["aborted"] = str(exc)
        for c, why in sr.cheats.items():
            rejected[c] = f"secure aggregation: {c} {why}"
        out["stages"] = dict(sr.stages)
        out["degree"], out["share_threshold"] = sr.degree, sr.t_share
        return out

    async def _send_anchor(self, c: str) -> None:
        meta = {"kind": "full", "version": self.planner.version, "anchor": True, "train": False}
        await self._send(c, meta, (self.model,))
        self.known[c] = max(self.known[c], self.planner.version)

    async def _serve(
        self,
        c: str,
        r: int,
        seed: int,
        train: bool,
        broadcast: bool,
        accepted: dict,
        rejected: dict,
    ) -> None:
        try:
            await self.wait_ready(c)
            if broadcast:
                await self._send_anchor(c)
            if not train:
                return
            self.inflight[c] = (r, seed)
            self.bounds.open(c)
            await self.send_round(c, r, seed)
            resynced = False
            while True:
                frame = await self._next_update(c)
                if isinstance(frame, str):  # refused by the transport from its head
                    rejected[c] = frame
                    await self._tell_refused(c, r, frame)
                    return
                if frame.meta.get("kind") == P.RESYNC:
                    verdict = await self._resync(c, r, seed, frame, resynced)
                    if verdict is not None:
                        rejected[c] = verdict
                        return
                    resynced = True
                    continue
                verdict = self._judge(c, r, frame, accepted)
                if verdict == "late":
                    continue  # a late reply to a past round: discard, keep waiting
                if verdict:
                    rejected[c] = verdict
                    await self._tell_refused(c, r, verdict)
                return
        except TandemError:
            return  # link closed or peer unknown: the client is left out of this round
        finally:
            self.inflight.pop(c, None)
            self.bounds.close(c)

    async def _tell_refused(self, c: str, r: int, reason: str) -> None:
        """Tell ``c`` at once that its update of round ``r`` was refused, and why (a
        ``refused`` control message: the client reports it and stops after its own limit)."""
        meta = {"kind": P.REFUSED, "round": r, "reason": reason[:500]}
        try:
            async with asyncio.timeout(1.0):
                await self.transport.send(c, P.MODEL, Frame(meta=meta))
        except (TandemError, TimeoutError):
            pass  # best effort: the refusal is in the round report either way

    async def _next_update(self, c: str) -> Frame | str:
        """``c``'s next update-channel frame, or the reason its update was refused at the
        head (`bounds.UpdateBounds`), whichever comes first. (``recv`` is cancel-safe: the
        losing wait loses no frame.) A closed link raises its `TandemError` as itself, not
        wrapped in an exception group, so the caller leaves the client out."""
        try:
            async with asyncio.TaskGroup() as tg:
                frame = tg.create_task(self.transport.recv(c, P.UPDATE))
                refused = tg.create_task(self.bounds.wait_refusal(c))
                await asyncio.wait((frame, refused), return_when=asyncio.FIRST_COMPLETED)
                if frame.done():
                    refused.cancel()
                    return frame.result()
                frame.cancel()
        except ExceptionGroup as group:
            closed = [e for e in group.exceptions if isinstance(e, TandemError)]
            if closed:
                raise closed[0] from None
            raise
        return refused.result()

    async def _resync(self, c: str, r: int, seed: int, frame: Frame, resynced: bool) -> str | None:
        """Answer ``c``'s resync of round ``r`` (re-plan its message from the version it
        holds, once per round); returns why it is refused, or None."""
        try:
            rnd, held = P.check_resync(frame, version=self.planner.version)
        except P.UpdateError as exc:
            return f"resync from {c!r} refused: {exc}"
        if rnd < r:
            return None  # about a past round's message; this round's is on its way
        if rnd > r or resynced:
            return (
                f"{c!r} cannot apply its model message even after a "
                f"resync to version {held} (round {rnd})"
            )
        # the client restarted or lost state: plan from what it really holds
        self.known[c] = held
        self.resyncs += 1
        await self.send_round(c, r, seed)
        return None

    def _judge(self, c: str, r: int, frame: Frame, accepted: dict) -> str | None:
        """Check ``c``'s update for round ``r`` and accept it; returns why it is refused,
        ``"late"`` for a reply to a past round, or None once accepted."""
        rnd = frame.meta.get("round")
        if isinstance(rnd, int) and not isinstance(rnd, bool) and 0 <= rnd < r:
            return "late"  # discarded unread: its round's uplink may differ from this one's
        try:
            rnd, n, ver, payload = P.check_update(
                frame,
                uplink=self.uplink,
                d=self.d,
                version=self.planner.version,
                max_bytes=self.max_update_bytes,
            )
            self.bounds.check_count(c, n)
        except P.UpdateError as exc:
            return f"update from {c!r} refused: {exc}"
        if rnd < r:
            return "late"
        if frame.meta.get("serial", self.serial) != self.serial:
            self.stale += 1  # a reply to an earlier server's request: its own will follow
            return "late"
        if rnd > r:
            return f"update from {c!r} refused: round {rnd} is in the future (current round {r})"
        if self.cfg.client_eval and self.evaluates(r):
            try:
                self.round_evals[c] = check_eval(frame.meta.get(EVAL), who=c, max_rows=2**31)
            except P.UpdateError as exc:
                return f"update from {c!r} refused: {exc}"
        self.known[c] = max(self.known[c], ver)
        self.bounds.accepted(c, n)
        accepted[c] = (n, payload)
        return None

    async def send_round(self, c: str, r: int, seed: int, secagg: dict | None = None) -> None:
        """Send ``c`` round ``r``'s training request, planned from the version it holds
        (``secagg``: the secure sum's parameters, `secagg.server.SecureRound.params`)."""
        meta, arrays = self.planner.plan(self.model, self.known[c])
        meta.update(round=r, seed=seed, train=True, uplink=self.uplink, lossless=self.cfg.lossless)
        meta["serial"] = self.serial
        if self.cfg.client_eval and self.evaluates(r):
            meta[EVALUATE] = True
        if secagg is not None:
            meta["secagg"] = secagg
            if self.dp_clip is not None:  # the clients clip: the server never sees an update
                meta["dp"] = {"clip": self.dp_clip}
        await self._send(c, meta, arrays)

    def _decode(self, payload: np.ndarray, seed: int) -> np.ndarray:
        """The ``(d,)`` update a payload of this round's uplink stands for."""
        kind = self.uplink["kind"]
        if kind == "randk":
            return np.asarray(C.randk_decompress(payload, seed, self.d))
        if kind == "sketch":
            return np.asarray(
                C.sketch_estimate(payload, seed, self.d, median=self.cfg.sketch_median)
            )
        if kind == "quant":
            return dequantize(payload, self.d, int(self.uplink["bits"]), int(self.uplink["block"]))
        return payload

    def _combine(self, payloads: list[np.ndarray], weights: list[int], seed: int) -> np.ndarray:
        """The round's update by `FLConfig.aggregator`: decoded once after combining when the
        aggregator is linear and the uplink too (not ``quant``: each client's block scales are
        its own), else each payload decoded first (see `aggregator`)."""
        rule = self.cfg.aggregator
        if self.cfg.dp is not None:
            return self._decode(self._private_mean(payloads), seed)
        linear = rule.linear and self.uplink["kind"] != "quant"
        if not linear:
            payloads = [self._decode(p, seed) for p in payloads]
        combined, self.agg_state = rule.aggregate(self.agg_state, payloads, weights)
        return self._decode(combined, seed) if linear else combined

    def _private_mean(self, payloads: list[np.ndarray]) -> np.ndarray:
        """Central DP: the clipped payloads' noisy sum over their count (unweighted: a
        client's sample count would change the sensitivity); adaptive clipping moves on."""
        dp, clip = self.cfg.dp, self.dp_clip
        assert dp is not None and clip is not None  # Invariant: called under [dp] only
        std = dp.payload_multiplier() * clip
        total, within = noisy_sum(payloads, clip, std, self.dp_rng)
        self.dp_clip = next_clip(dp, clip, within, len(payloads), self.dp_rng)
        return total / np.float32(len(payloads))

    def epsilon(self, rounds: int) -> float | None:
        """Epsilon at ``dp.delta`` after ``rounds`` rounds (None without [dp])."""
        dp = self.cfg.dp
        if dp is None:
            return None
        return epsilon(
            dp.noise_multiplier,
            rounds=rounds,
            sampled=self.per_round,
            clients=len(self.clients),
            delta=dp.delta,
            sampling=dp.sampling,
        )

    def epsilon_vs_server(self) -> float | None:
        """Under distributed DP, epsilon at ``dp.delta`` against this server: it knows which
        clients each round sampled, so no amplification by sampling; each round a client took
        part in is a Gaussian of multiplier ``z`` (``z / 2`` for ``sampling = "fixed"``'s
        replace-one neighbours), composed over the most rounds any one client
        took part in (``participation``, resumed rounds included). None without [dp] and in
        central mode (the trusted server sees the updates, or their clipped sum, before its
        noise: no epsilon bounds what it learns)."""
        dp = self.cfg.dp
        if dp is None or dp.mode != "distributed":
            return None
        most = max(self.participation.values(), default=0)
        return unamplified_epsilon(
            dp.noise_multiplier, rounds=most, delta=dp.delta, sampling=dp.sampling
        )

    def _apply(self, payloads: list[np.ndarray], weights: list[int], seed: int) -> None:
        """Aggregate, run the server rule, move the model, log the changed indices."""
        self._step(self._combine(payloads, weights, seed))

    def _step(self, agg: np.ndarray) -> None:
        """Run the server rule on the round's ``(d,)`` update, move the model, log it."""
        if self.cfg.optimizer is None:
            rule = dataclasses.replace(self.cfg.rule, topk=self.topk)
            idx, values, self.state = server_step(rule, self.state, agg)
        else:
            idx, values, self.opt_state, residual = optax_step(
                self.cfg.optimizer,
                self.opt_state,
                self.model,
                agg,
                topk=self.topk,
                residual=self.state.residual,
            )
            self.state = ServerState(self.state.momentum, residual)
        model = self.model.copy()
        if idx is None:
            model += values
        else:
            model[idx] += values
        self.model = model
        self.planner.record(idx)

    async def stop_clients(self, timeout: float = 1.0) -> None:
        """Tell every client to stop (best effort: a gone client is skipped); those in
        ``final_to`` (they asked for it) get the final model with it."""
        final = Frame(meta={"kind": "stop", "version": self.planner.version}, arrays=(self.model,))

        async def stop(c: str) -> None:
            frame = final if c in self.final_to else Frame(meta={"kind": "stop"})
            try:
                async with asyncio.timeout(timeout if c not in self.final_to else 30 * timeout):
                    await self.transport.send(c, P.MODEL, frame)
            except (TandemError, TimeoutError):
                pass

        async with asyncio.TaskGroup() as tg:
            for c in self.clients:
                tg.create_task(stop(c))
