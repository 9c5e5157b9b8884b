"""The federated client party.

Loop: receive a model message from the server, rebuild the server's model exactly
(`downlink.ClientModel`), and, when the message asks for training, train locally off the event
loop (``asyncio.to_thread``), compress the delta as the message's ``uplink`` says, and send it
back with the local sample count and the model version it started from. Stops on a ``stop``
message (`run` returns ``"stop"``) or when the link to the server closes (``"closed"``); a
message of another kind goes to `control` (a client in its own process handles the
server's ``welcome`` there); a message it cannot apply (`protocol.DownlinkError`,
bad zlib data) is skipped and recorded in ``errors``, and the client keeps serving.

A client that was away keeps its queue: on return it works through the messages in order
(replies to past rounds are discarded by the server) and so rejoins. A client that restarted
(and so holds an older model than the server believes, e.g. the initial one) cannot apply the
delta it is sent; it answers the training request with a ``resync`` message naming the version
it does hold, and the server re-plans that client's model message from that version.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import numpy as np

from tandem.errors import FrameError, TandemError, TransportClosedError
from tandem.transports.base import Frame, Transport

from . import compression as C
from . import protocol as P
from .downlink import ClientModel
from .dp import clip_l2
from .evaluation import EVAL, EVALUATE, measure
from .train import LocalTrainer

log = logging.getLogger(__name__)


def compress_update(delta: np.ndarray, uplink: Mapping[str, Any], seed: int) -> np.ndarray:
    """The uplink payload for ``delta`` (float32): dense, rand-k values, or count sketch."""
    kind = uplink["kind"]
    if kind == "dense":
        return np.asarray(delta, np.float32)
    if kind == "randk":
        return np.asarray(C.randk_compress(delta, seed, int(uplink["k"])), np.float32)
    if kind == "sketch":
        return np.asarray(
            C.sketch_compress(delta, seed, int(uplink["rows"]), int(uplink["cols"])), np.float32
        )
    raise P.UpdateError(f"unknown uplink kind {kind!r}; expected one of {P.UPLINK_KINDS}")


class UpdateRefusedError(TandemError):
    """The server refused this client's updates ``client.max_refusals`` times."""


class FLClient:
    """One client: ``transport`` to ``server``, local data ``(x, y)``, a `LocalTrainer`.

    ``seed`` seeds the local shuffles (combined with the round's seed); ``validation``
    (rows never trained on) is where it evaluates the global model when a request asks
    (``meta.evaluate``: `tandem.parties.fl.evaluation`). Under secure
    aggregation (a training request with ``meta.secagg``), ``signer`` (this client's
    `tandem.transports.keys.SigningKey`) signs its round keys and ``roster`` (a
    `tandem.transports.keys.Roster`) checks the other clients' (see `secagg.client`).
    """

    def __init__(
        self,
        transport: Transport,
        server: str,
        x: np.ndarray,
        y: np.ndarray,
        trainer: LocalTrainer,
        *,
        seed: int = 0,
        signer: Any = None,
        roster: Any = None,
        max_refusals: int | None = None,
        validation: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> None:
        self.transport, self.server = transport, server
        self.x, self.y = x, y
        self.validation = validation
        self.trainer = trainer
        self.seed = seed
        self.signer, self.roster = signer, roster
        self.state = ClientModel(trainer.init_vec)
        self.rounds_trained = 0
        self.errors: list[str] = []
        self.refused_updates = 0  # updates the server refused
        self.max_refusals = max_refusals
        self.final_model: np.ndarray | None = None  # the server's, when sent with stop
        # a quantized uplink's error feedback: (round, uplink, residual) of the last update
        self.feedback: tuple[int, dict, np.ndarray] | None = None

    async def before_reply(self, rnd: int) -> None:
        """Hook run after training, before replying (tests use it to be late)."""

    async def secagg_stage(self, rnd: int, stage: str) -> None:
        """Hook run before each secure-aggregation send (tests raise
        `secagg.client.LeaveRound` here to drop out)."""

    async def control(self, frame: Frame) -> None:
        """Hook: a model-channel message that is neither a model nor ``stop``."""
        self.errors.append(f"unknown model message kind {frame.meta.get('kind')!r}")

    async def run(self) -> str:
        """Serve rounds until the server says stop (returns ``"stop"``) or the link closes
        (``"closed"``)."""
        while True:
            try:
                frame = await self.transport.recv(self.server, P.MODEL)
            except TransportClosedError:
                return "closed"
            if await self.dispatch(frame):
                return "stop"

    async def dispatch(self, frame: Frame) -> bool:
        """Act on one model-channel message; True when it is ``stop``."""
        kind = frame.meta.get("kind")
        if kind == "stop":
            if len(frame.arrays) == 1 and frame.arrays[0].shape == self.state.model.shape:
                self.final_model = np.asarray(frame.arrays[0], np.float32)
            return True
        if kind == P.REFUSED:
            self.refused(frame.meta)
            return False
        if kind not in P.MODEL_KINDS:
            await self.control(frame)
            return False
        try:
            await self.handle(frame)
        except (P.DownlinkError, P.UpdateError) as exc:
            # a message this client cannot use: skip it and keep serving; the reason is
            # kept for inspection. For a training request, tell the server which version
            # we hold so it can send a message we can apply (else it times us out).
            self.errors.append(str(exc))
            if isinstance(exc, P.DownlinkError) and frame.meta.get("train"):
                await self._resync(frame.meta.get("round"))
        return False

    def refused(self, meta: Mapping[str, Any]) -> None:
        """The server refused this client's update: log it at once (a warning), count it,
        and raise `UpdateRefusedError` at the ``max_refusals``-th refusal."""
        self.refused_updates += 1
        why = f"round {meta.get('round')}: the server refused this update: {meta.get('reason')}"
        self.errors.append(why)
        log.warning("%s: %s", self.transport.name, why)
        if self.max_refusals is not None and self.refused_updates >= self.max_refusals:
            raise UpdateRefusedError(
                f"the server refused {self.refused_updates} updates of "
                f"{self.transport.name!r} (the last: {why}); stopping at "
                f"client.max_refusals = {self.max_refusals}. Check this client's data (NaN or "
                "Inf values) and its learning rate"
            )

    async def _secure(
        self, rnd: int, payload: np.ndarray, params: Any, beside: dict[str, Any]
    ) -> None:
        """Send ``payload`` into round ``rnd``'s secure sum (`secagg.client.contribute`)."""
        from .secagg.client import LeaveRound, RoundAbandoned, contribute

        try:
            await contribute(
                self.transport,
                self.server,
                rnd,
                payload,
                dict(params),
                signer=self.signer,
                roster=self.roster,
                hook=self.secagg_stage,
                beside=beside,
            )
        except (RoundAbandoned, LeaveRound) as exc:
            self.errors.append(str(exc))
        except TransportClosedError:
            return

    def _quantize(self, rnd: int, delta: np.ndarray, uplink: Mapping[str, Any]) -> np.ndarray:
        """Round ``rnd``'s quantized payload with error feedback (`quantize.quantize_feedback`).

        The residual of the last update is added only when it was made under the same uplink
        and at most ``uplink["max_gap"]`` rounds ago: a client that missed more rounds drops
        it (it was owed to a model that has moved on since), as does a restarted client."""
        from .quantize import quantize_feedback

        residual = None
        if self.feedback is not None:
            last, was, res = self.feedback
            if was == dict(uplink) and 0 < rnd - last <= int(uplink.get("max_gap", 1)):
                residual = res
        payload, res = quantize_feedback(delta, residual, int(uplink["bits"]), int(uplink["block"]))
        self.feedback = (rnd, dict(uplink), res)
        return payload

    async def _resync(self, rnd: Any) -> None:
        if not isinstance(rnd, int):
            return
        try:
            await self.transport.send(
                self.server,
                P.UPDATE,
                Frame(meta={"kind": P.RESYNC, "round": rnd, "version": self.state.version}),
            )
        except TransportClosedError:
            return

    async def handle(self, frame: Frame) -> None:
        meta = frame.meta
        arrays = P.unpack_arrays(frame, max_bytes=8 * self.state.model.nbytes + 1024)
        model = self.state.apply(meta, arrays)
        if not meta.get("train"):
            return
        rnd, seed, uplink = int(meta["round"]), int(meta["seed"]), meta["uplink"]
        local_seed = (self.seed * 1_000_003 + seed) & 0xFFFFFFFF
        beside: dict[str, Any] = {}
        if meta.get(EVALUATE):  # the global model this request brings, before training
            beside[EVAL] = await asyncio.to_thread(measure, self.trainer, model, self.validation)
        delta = await asyncio.to_thread(self.trainer.train, model, self.x, self.y, local_seed)
        if uplink["kind"] == "quant":
            payload = await asyncio.to_thread(self._quantize, rnd, delta, uplink)
        else:
            payload = await asyncio.to_thread(compress_update, delta, uplink, seed)
        self.rounds_trained += 1
        await self.before_reply(rnd)
        if meta.get("secagg"):
            if isinstance(meta.get("dp"), dict):  # client-level DP: this client clips
                payload, _ = clip_l2(payload, float(meta["dp"]["clip"]))
            await self._secure(rnd, payload, meta["secagg"], beside)
            return
        arrays, info = P.pack_arrays((payload,), bool(meta.get("lossless")))
        out = {
            "round": rnd,
            "n": int(self.x.shape[0]),
            "version": self.state.version,
            "kind": uplink["kind"],
        } | beside
        if isinstance(meta.get("serial"), str):  # which server process asked (see FLServer)
            out["serial"] = meta["serial"][:32]
        if info is not None:
            out["zlib"] = info
        try:
            await self.transport.send(self.server, P.UPDATE, Frame(meta=out, arrays=arrays))
        except TransportClosedError:
            return
        except FrameError as exc:  # the server's transport refused it (NaN/Inf, size)
            self.errors.append(f"round {rnd}: the server refused this update: {exc}")
