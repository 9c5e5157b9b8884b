"""The stateless worker: it keeps no parameters between requests.

Life cycle: beat to the coordinator every ``heartbeat`` seconds; on ``WELCOME`` (the data
servers' directory) listen to every data server for ``TASK``s. A worker that is not welcomed
within ``join_timeout`` seconds of starting stops its heartbeats and raises `NotWelcomedError`
(a coordinator that already finished, or one that never admits it, would otherwise keep it
beating forever); None waits for as long as it takes. For each task: compute the
batch's loss and gradient with JAX off the event loop, push the gradient (``RESULT``), wait
for the data server's ``ACK``, report the batch id to the coordinator (``DONE``). One task at a
time. ``stop`` from the coordinator ends it.

Restarts of the static roles: a coordinator that goes away without ``stop`` (killed; it
resumes from its journal when restarted) is waited for: the worker keeps beating and stops only
once no heartbeat has been delivered for ``join_timeout``. A data server that goes away is
listened to again when it comes back at the same address.

The wait for an ``ACK`` is bounded (``ack_timeout``): a data server that rolled back while
this worker was suspected (a heartbeat gap) stops listening to it and may never answer the
result it pushed. Past the bound the batch is reported as not done (the parameter servers'
``applied`` list decides at the next checkpoint) and the worker takes its next task; a late
``ACK`` of an earlier result is skipped.

Fault injection for tests: ``chaos(point, batch)`` is called at ``"received"``, ``"computed"``,
``"pushed"`` and ``"acked"``; raising `WorkerKilled` there makes the worker die on the spot
(heartbeats stop, nothing more is sent), as a ``kill -9`` would.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

import numpy as np

from tandem.errors import TransportClosedError, TransportError
from tandem.transports.base import Frame, Transport

from . import kernels as K
from . import protocol as P
from .errors import ElasticError, NotWelcomedError, ProtocolError
from .spec import ModelSpec

log = logging.getLogger(__name__)


class WorkerKilled(Exception):
    """Raised by a test's chaos hook to simulate the worker dying at that point."""


def _compute(spec: ModelSpec, arrays: tuple[np.ndarray, ...]) -> tuple[float, list[np.ndarray]]:
    net = K.net_for(spec)
    n = len(net.shapes)
    if len(arrays) != n + 2:
        raise ProtocolError(f"task carries {len(arrays)} arrays, expected {n} parameters + x + y")
    params, x, y = list(arrays[:n]), arrays[n], arrays[n + 1]
    if (
        [tuple(p.shape) for p in params] != net.shapes
        or x.ndim != 2
        or x.shape[1] != net.in_dim
        or y.shape != (x.shape[0],)
    ):
        raise ProtocolError(
            f"task arrays do not match the model (parameter shapes {net.shapes}, "
            f"{net.in_dim} feature columns)"
        )
    return net.loss_and_grad(params, x.astype(np.float32), y.astype(net.label_dtype))


class Worker:
    def __init__(
        self,
        transport: Transport,
        *,
        coordinator: str,
        heartbeat: float,
        url: str = "",
        chaos: Callable[[str, int], None] | None = None,
        ack_timeout: float | None = None,
        join_timeout: float | None = 60.0,
    ) -> None:
        if not heartbeat > 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {heartbeat!r}")
        if join_timeout is not None and not join_timeout > 0:
            raise ValueError(
                f"join_timeout must be > 0 s or None (wait forever), got {join_timeout!r}"
            )
        self.join_timeout = join_timeout
        self.ack_timeout = ack_timeout if ack_timeout is not None else max(1.0, 10 * heartbeat)
        self.t = transport
        self.coordinator = coordinator
        self.heartbeat = heartbeat
        self.url = url
        self.incarnation = uuid.uuid4().hex[:12]
        self.chaos = chaos or (lambda point, batch: None)
        self.done = 0
        self.killed = False
        self._busy = asyncio.Lock()
        self._contact = 0.0  # loop time of the last heartbeat the coordinator took
        coord = coordinator.__eq__
        P.admit_channels(
            transport,
            {P.WELCOME: coord, P.CTL: coord, P.TASK: coordinator.__ne__, P.ACK: coordinator.__ne__},
        )

    async def run(self) -> None:
        """Work until ``stop`` (returns) or a simulated death (returns with ``killed``).

        Raises `NotWelcomedError` when no ``WELCOME`` came within ``join_timeout``; nothing of
        the worker is left running then."""
        welcomed = True
        try:
            async with asyncio.TaskGroup() as tg:
                beats = tg.create_task(self._beat())
                welcome = await self._welcome()
                if welcome is None:
                    welcomed = False
                    beats.cancel()
                else:
                    await self._work(tg, beats, welcome)
        except* WorkerKilled:
            self.killed = True
        if not welcomed:
            raise NotWelcomedError(
                f"{self.t.name}: no WELCOME from coordinator {self.coordinator!r} within "
                f"{self.join_timeout:g} s of starting: it is not running or not reachable at "
                "the configured address, it has already finished, or it does not admit this "
                "worker (a worker on no roster needs the coordinator's secret). Start or fix "
                "the coordinator, or raise join_timeout to wait longer"
            )

    async def _welcome(self) -> Frame | None:
        """The coordinator's ``WELCOME``, or None after ``join_timeout``."""
        try:  # recv is cancel-safe: a timed-out wait loses no frame
            async with asyncio.timeout(self.join_timeout):
                while True:
                    try:
                        return await self.t.recv(self.coordinator, P.WELCOME)
                    except TransportClosedError:  # a coordinator that left; wait for the next
                        if P.cancelled_meanwhile():
                            return None
                        await asyncio.sleep(self.heartbeat)
        except TimeoutError:
            return None

    async def _work(self, tg: asyncio.TaskGroup, beats: asyncio.Task, welcome: Frame) -> None:
        """Serve every data server in ``welcome`` until the coordinator says stop, or is gone
        (no heartbeat delivered) for ``join_timeout``."""
        loops = {"": beats}

        def serve(welcome: Frame) -> None:
            for ds, url in P.field(welcome, "data_servers", dict).items():
                P.learn_peer(self.t, ds, url)
                if ds not in loops:
                    loops[ds] = tg.create_task(self._serve(ds))

        serve(welcome)
        loop = asyncio.get_running_loop()
        while True:
            try:
                stop = await self.t.recv(self.coordinator, P.CTL)
                log.info("%s: %s from coordinator", self.t.name, stop.meta.get("op"))
                break
            except TransportError as exc:
                # gone, or restarted and not yet speaking on CTL: a live one takes heartbeats
                if P.cancelled_meanwhile():
                    break
                silent = loop.time() - self._contact
                if self.join_timeout is not None and silent > self.join_timeout:
                    log.warning("%s: coordinator gone (%s); stopping", self.t.name, exc)
                    break
            try:
                async with asyncio.timeout(self.heartbeat):
                    serve(await self.t.recv(self.coordinator, P.WELCOME))
            except (TimeoutError, TransportError):
                await asyncio.sleep(self.heartbeat)
        for task in loops.values():
            task.cancel()

    async def _beat(self) -> None:
        meta = {"incarnation": self.incarnation, "url": self.url}
        while True:
            try:
                await self.t.send(self.coordinator, P.HB, Frame(meta=meta))
                self._contact = asyncio.get_running_loop().time()
            except TransportError as exc:
                log.info("%s: heartbeat failed: %s", self.t.name, exc)
            await asyncio.sleep(self.heartbeat)

    async def _serve(self, ds: str) -> None:
        while True:
            try:
                task = await self.t.recv(ds, P.TASK)
                async with self._busy:
                    await self._one(ds, task)
            except TransportError as exc:
                # the data server is gone or unreachable: the coordinator re-issues the batch;
                # a restarted one speaks again at the same address
                log.info("%s: link to %s failed: %s", self.t.name, ds, exc)
                if isinstance(exc, TransportClosedError):
                    if getattr(self.t, "closed", False) or P.cancelled_meanwhile():
                        return
                    await asyncio.sleep(self.heartbeat)

    async def _one(self, ds: str, task: Frame) -> None:
        try:
            batch = P.field(task, "batch", int)
            gen = P.field(task, "gen", int)
            spec = ModelSpec.from_mapping(P.field(task, "spec", dict))
            self.chaos("received", batch)
            loss, grads = await asyncio.to_thread(_compute, spec, task.arrays)
        except ElasticError as exc:
            log.warning("%s: bad task from %s: %s", self.t.name, ds, exc)
            return
        self.chaos("computed", batch)
        if not np.isfinite(loss):
            log.warning(
                "%s: batch %d gave a non-finite loss; reporting failure", self.t.name, batch
            )
            grads = []
        P.learn_peer(self.t, ds, task.meta.get("url"))
        try:  # a data server lost on the way: the batch is reported not done all the same
            await self.t.send(
                ds,
                P.RESULT,
                Frame(meta={"batch": batch, "gen": gen, "loss": loss}, arrays=tuple(grads)),
            )
            self.chaos("pushed", batch)
            ack = await self._ack(ds, batch, gen)
        except TransportError as exc:
            log.info("%s: link to %s failed during batch %d: %s", self.t.name, ds, batch, exc)
            ack = None
        if ack is None:
            log.info(
                "%s: no ack from %s for batch %d within %.3g s; reporting it not done",
                self.t.name,
                ds,
                batch,
                self.ack_timeout,
            )
            ok = False
        else:
            self.chaos("acked", batch)
            ok = bool(ack.meta.get("ok"))
            if not ok:
                log.info(
                    "%s: batch %d refused by %s: %s", self.t.name, batch, ds, ack.meta.get("error")
                )
        self.done += ok
        await self.t.send(
            self.coordinator,
            P.DONE,
            Frame(meta={"batch": batch, "gen": gen, "ds": ds, "ok": ok, "loss": loss}),
        )

    async def _ack(self, ds: str, batch: int, gen: int) -> Frame | None:
        """The ``ACK`` of this result (late ones of earlier results are skipped), or None after
        ``ack_timeout``."""
        try:
            async with asyncio.timeout(self.ack_timeout):
                while True:
                    ack = await self.t.recv(ds, P.ACK)
                    if ack.meta.get("batch") == batch and ack.meta.get("gen") == gen:
                        return ack
        except TimeoutError:
            return None
