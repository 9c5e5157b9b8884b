"""The data server: holds one shard, hosts a parameter server, sends batches to the workers
the coordinator names and applies the gradients they return.

Contract:

* It acts only on the coordinator's requests (``CTL``), answered on ``REPLY`` in order: a
  ``CTL`` frame from any other sender (a worker claiming the coordinator's authority) is
  refused at its head (403 over HTTP), logged and counted in ``forged``; so is any channel but
  ``CTL`` and ``RESULT`` (`protocol.admit_channels`). The sender is the authenticated name.
* A result is applied only if it answers the task this server sent to that worker for that
  batch in the current generation; anything else is refused with an ``ACK`` saying why, and
  the server keeps serving.
* A worker whose link closed (its process died) and that is named again in a ``train``
  request (restarted under the same name) is listened to again.
* Parameter-server operations (apply, fence, checkpoint, rollback, restore, merge) are
  serialised by one lock and run off the event loop (``asyncio.to_thread``).
* With a `CheckpointStore`, each ``checkpoint`` and ``epoch`` request's ``seq`` is written
  durably before the reply; ``restore`` returns to checkpoint ``seq`` (a process restarted
  after ``kill -9`` is told its shard index there too, so it needs no ``hello``).
* A request it cannot serve before ``hello``/``restore`` is answered ``hosted: false``: the
  coordinator takes that as a restarted data server and recovers.
* If the coordinator goes away (killed, restarting), the data server waits up to
  ``coordinator_wait`` seconds for a coordinator to speak again at the same address, then
  stops with `ElasticError`.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from tandem.errors import TransportClosedError, TransportError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .errors import ElasticError, ProtocolError
from .param_server import ParamServer
from .party_data import export_model
from .spec import ModelSpec, Shard
from .store import CheckpointStore

log = logging.getLogger(__name__)


class DataServer:
    def __init__(
        self,
        transport: Transport,
        *,
        coordinator: str,
        spec: ModelSpec,
        shard: Shard,
        url: str = "",
        store: CheckpointStore | None = None,
        coordinator_wait: float = 60.0,
        test: Shard | None = None,
        export: str | None = None,
        preprocessing: dict | None = None,
        fingerprint: str | None = None,
    ) -> None:
        self.t = transport
        self.test = test
        self.export = export
        self.preprocessing = preprocessing
        self.fingerprint = fingerprint
        self.store = store
        self.coordinator_wait = coordinator_wait
        self.coordinator = coordinator
        self.spec = spec
        self.shard = shard
        self.url = url
        self.n_batches = shard.n_batches(spec.batch_size, spec.drop_last)
        self.index: int | None = None
        self.ps: ParamServer | None = None
        self._lock = asyncio.Lock()
        self._assigned: dict[int, tuple[str, int]] = {}  # batch -> (worker, generation)
        self._listening: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0
        self.forged = 0  # control frames refused from senders other than the coordinator
        P.admit_channels(
            transport,
            {P.CTL: coordinator.__eq__, P.RESULT: coordinator.__ne__},
            on_refused=self._refused_stream,
        )

    def _refused_stream(self, sender: str, channel: str) -> None:
        if channel == P.CTL:
            self.forged += 1

    async def run(self) -> None:
        """Serve until the coordinator says ``stop``; leaves no task running."""
        async with asyncio.TaskGroup() as tg:
            try:
                await self._serve(tg)
            finally:
                for task in self._listening.values():
                    task.cancel()
                for task in list(self._tasks):
                    task.cancel()

    def _spawn(self, tg: asyncio.TaskGroup, coro) -> None:
        task = tg.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _hosted(self, op: str) -> tuple[ParamServer, int]:
        """The parameter server and shard index that ``hello`` set; `ProtocolError` before."""
        if self.ps is None or self.index is None:
            raise ProtocolError(f"operation {op!r} before 'hello'")
        return self.ps, self.index

    async def _serve(self, tg: asyncio.TaskGroup) -> None:
        """Answer the coordinator's requests; worker tasks and listeners run in ``tg``."""
        while True:
            req = await self._next_request()
            op = req.meta.get("op")
            try:
                reply, arrays = await self._handle(op, req, tg)
            except ElasticError as exc:
                reply, arrays = {"ok": False, "error": str(exc)}, ()
            if reply is None:
                continue
            meta = {"req": req.meta.get("req", -1), "ok": True, "hosted": self.ps is not None}
            try:
                await self.t.send(
                    self.coordinator, P.REPLY, Frame(meta={**meta, **reply}, arrays=tuple(arrays))
                )
            except TransportError as exc:  # the coordinator died meanwhile; it will ask again
                log.info("%s: cannot reply %r: %s", self.t.name, op, exc)
            if op == "stop":
                return

    async def _next_request(self) -> Frame:
        """The coordinator's next request; waits out a coordinator restart (module docstring)."""
        lost_since: float | None = None
        loop = asyncio.get_running_loop()
        while True:
            try:
                req = await self.t.recv(self.coordinator, P.CTL)
            except TransportClosedError as exc:
                if getattr(self.t, "closed", False) or P.cancelled_meanwhile():
                    raise
                now = loop.time()
                if lost_since is None:
                    lost_since = now
                    log.warning("%s: coordinator gone (%s); waiting for it", self.t.name, exc)
                if now - lost_since > self.coordinator_wait:
                    raise ElasticError(
                        f"{self.t.name}: the coordinator has been gone for more than "
                        f"{self.coordinator_wait:g} s; restart it (it resumes from its journal) "
                        "or raise coordinator_wait"
                    ) from None
                await asyncio.sleep(min(0.2, self.coordinator_wait / 10))
                continue
            if req.sender in ("", self.coordinator):
                return req
            self.forged += 1  # a transport that delivered another sender's frame here
            log.warning("%s: control from %r refused: not the coordinator", self.t.name, req.sender)

    async def _handle(self, op, req: Frame, tg: asyncio.TaskGroup):
        if op in ("hello", "restore"):
            await self._host(P.field(req, "index", int))
        if op == "hello":
            ps, _ = self._hosted(op)
            return {
                "n_batches": self.n_batches,
                "spec": self.spec.digest,
                "generation": ps.generation,
            }, ()
        ps, index = self._hosted(op)
        if op == "train":
            self._train(req, ps, index, tg)
            return None, ()
        async with self._lock:
            return await self._locked(op, req, ps)

    async def _locked(self, op, req: Frame, ps: ParamServer):
        """The parameter-server operations, run under the lock."""
        if op == "fence":
            gen = P.field(req, "gen", int)
            applied = ps.fence(gen)
            self._assigned.clear()
            if "live" in req.meta:
                self._forget(req.meta["live"])
            arrays = ps.leaves() if req.meta.get("export") else ()
            return {"applied": applied}, arrays
        if op == "checkpoint":
            if req.arrays:
                await asyncio.to_thread(ps.load, list(req.arrays))
            digest = await asyncio.to_thread(ps.checkpoint, _seq(req))
            return {"digest": digest, "model": ps.model_digest()}, ()
        if op == "restore":
            seq, gen = P.field(req, "seq", int), P.field(req, "gen", int)
            self._assigned.clear()
            digest = await asyncio.to_thread(ps.restore, seq, gen)
            self._forget(req.meta.get("live", []))
            return {
                "digest": digest,
                "model": ps.model_digest(),
                "n_batches": self.n_batches,
                "spec": self.spec.digest,
            }, ()
        if op == "rollback":
            gen = P.field(req, "gen", int)
            self._assigned.clear()
            digest = await asyncio.to_thread(ps.rollback, gen)
            self._forget(req.meta.get("live", []))
            return {"digest": digest, "model": ps.model_digest()}, ()
        if op == "epoch":
            await asyncio.to_thread(ps.new_epoch, self.n_batches, _seq(req))
            return {
                "epoch": ps.epoch,
                "digest": ps.digest(),
                "model": ps.model_digest(),
            }, ()
        if op == "eval":
            loss = await asyncio.to_thread(ps.loss, self.shard.x, self.shard.y)
            return {"loss": loss}, ()
        if op == "test":
            if self.test is None:
                return {"rows": 0, "loss": None, "accuracy": None}, ()
            x, y = self.test.x, self.test.y
            loss = await asyncio.to_thread(ps.loss, x, y)
            accuracy = await asyncio.to_thread(ps.accuracy, x, y)
            return {
                "rows": len(y),
                "loss": loss,
                "accuracy": accuracy,
                "objective": self.spec.loss,
            }, ()
        if op == "export":
            if self.export is None:
                return {"path": None}, ()
            desc = await asyncio.to_thread(
                export_model,
                self.export,
                self.spec,
                list(ps.params),
                party=self.t.name,
                training=P.field(req, "training", str),
                preprocessing=self.preprocessing,
                fingerprint=self.fingerprint,
            )
            return {"path": self.export, "digest": desc["digest"]}, ()
        if op == "stop":
            return {}, ()
        raise ProtocolError(
            f"unknown operation {op!r}; expected hello, train, fence, "
            "checkpoint, rollback, restore, epoch, eval, test, export or stop"
        )

    async def _host(self, index: int) -> None:
        """Host the parameter server of shard ``index`` (kept if it already is)."""
        if self.ps is not None and self.index == index:
            return
        self.index = index
        self.ps = await asyncio.to_thread(
            functools.partial(
                ParamServer,
                self.spec,
                self.n_batches,
                offset=index * P.STRIDE,
                store=self.store,
                fingerprint=self.fingerprint,
            )
        )

    def _forget(self, live) -> None:
        """Stop listening to workers that are no longer live (bounded tasks under churn)."""
        for w in [w for w in self._listening if w not in set(live)]:
            self._listening.pop(w).cancel()

    def _train(self, req: Frame, ps: ParamServer, index: int, tg: asyncio.TaskGroup) -> None:
        batch = P.field(req, "batch", int)
        gen = P.field(req, "gen", int)
        worker = P.field(req, "worker", str)
        if gen != ps.generation:
            log.info(
                "%s: train request of generation %d ignored (at %d)",
                self.t.name,
                gen,
                ps.generation,
            )
            return
        P.learn_peer(self.t, worker, req.meta.get("url"))
        self._assigned[batch] = (worker, gen)
        listener = self._listening.get(worker)
        if listener is None or listener.done():  # ended with the link of an earlier process
            self._listening[worker] = tg.create_task(self._results(worker))
        self._spawn(tg, self._send_task(worker, batch, gen, ps, index))

    async def _send_task(
        self, worker: str, batch: int, gen: int, ps: ParamServer, index: int
    ) -> None:
        x, y = self.shard.batch(self.spec, ps.epoch, batch - ps.offset, index)
        params = list(ps.params)  # the list is replaced, never mutated: a snapshot
        frame = Frame(
            meta={"batch": batch, "gen": gen, "spec": self.spec.to_dict(), "url": self.url},
            arrays=(*params, x, y),
        )
        try:
            await self.t.send(worker, P.TASK, frame)
        except TransportError as exc:  # the worker died; the coordinator will notice
            log.info("%s: cannot send batch %d to %s: %s", self.t.name, batch, worker, exc)

    async def _results(self, worker: str) -> None:
        while True:
            try:
                res = await self.t.recv(worker, P.RESULT)
            except TransportError:
                return
            reply = await self._apply(worker, res)
            try:
                await self.t.send(worker, P.ACK, Frame(meta=reply))
            except TransportError:
                pass

    async def _apply(self, worker: str, res: Frame) -> dict:
        try:
            batch = P.field(res, "batch", int)
            gen = P.field(res, "gen", int)
            ps, _ = self._hosted("result")
            async with self._lock:
                if self._assigned.get(batch) != (worker, gen):
                    self.refused += 1
                    return {
                        "batch": batch,
                        "gen": gen,
                        "ok": False,
                        "error": f"batch {batch} of generation {gen} is not assigned to "
                        f"{worker} now (fenced or re-issued); result refused",
                    }
                await asyncio.to_thread(ps.apply, batch, gen, list(res.arrays))
                del self._assigned[batch]
            return {"batch": batch, "gen": gen, "ok": True}
        except ElasticError as exc:
            self.refused += 1
            return {
                "batch": res.meta.get("batch", -1),
                "gen": res.meta.get("gen", -1),
                "ok": False,
                "error": str(exc),
            }


def _seq(req: Frame) -> int | None:
    """The durable checkpoint number a request names (None: in memory only)."""
    seq = req.meta.get("seq")
    if seq is not None and (not isinstance(seq, int) or isinstance(seq, bool) or seq < 0):
        raise ProtocolError(f"'seq' must be an int >= 0, got {seq!r}")
    return seq
