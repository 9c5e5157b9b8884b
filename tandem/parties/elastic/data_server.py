"""The data server: holds one shard, hosts a parameter server, sends batches to the workers
the coordinator names and applies the gradients they return.

Contract:

* It acts only on the coordinator's requests (``CTL``), answered on ``REPLY`` in order.
* A result is applied only if it answers the task this server sent to that worker for that
  batch in the current generation; anything else is refused with an ``ACK`` saying why, and
  the server keeps serving.
* Parameter-server operations (apply, fence, checkpoint, rollback, merge) are serialised by
  one lock and run off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import logging

from tandem.errors import TransportError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .errors import ElasticError, ProtocolError
from .param_server import ParamServer
from .spec import ModelSpec, Shard

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
    ) -> None:
        self.t = transport
        self.coordinator = coordinator
        self.spec = spec
        self.shard = shard
        self.url = url
        self.n_batches = shard.n_batches(spec.batch_size)
        self.index: int | None = None
        self.ps: ParamServer | None = None
        self._lock = asyncio.Lock()
        self._assigned: dict[int, tuple[str, int]] = {}  # batch -> (worker, generation)
        self._listening: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()
        self.refused = 0

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
            req = await self.t.recv(self.coordinator, P.CTL)
            op = req.meta.get("op")
            try:
                reply, arrays = await self._handle(op, req, tg)
            except ElasticError as exc:
                reply, arrays = {"ok": False, "error": str(exc)}, ()
            if reply is None:
                continue
            await self.t.send(
                self.coordinator,
                P.REPLY,
                Frame(
                    meta={"req": req.meta.get("req", -1), "ok": True, **reply}, arrays=tuple(arrays)
                ),
            )
            if op == "stop":
                return

    async def _handle(self, op, req: Frame, tg: asyncio.TaskGroup):
        if op == "hello":
            self.index = P.field(req, "index", int)
            self.ps = await asyncio.to_thread(
                ParamServer, self.spec, self.n_batches, offset=self.index * P.STRIDE
            )
            return {"n_batches": self.n_batches, "spec": self.spec.digest}, ()
        ps, index = self._hosted(op)
        if op == "train":
            self._train(req, ps, index, tg)
            return None, ()
        async with self._lock:
            if op == "fence":
                gen = P.field(req, "gen", int)
                applied = ps.fence(gen)
                self._assigned.clear()
                arrays = ps.leaves() if req.meta.get("export") else ()
                return {"applied": applied}, arrays
            if op == "checkpoint":
                if req.arrays:
                    await asyncio.to_thread(ps.load, list(req.arrays))
                digest = await asyncio.to_thread(ps.checkpoint)
                return {"digest": digest, "model": ps.model_digest()}, ()
            if op == "rollback":
                gen = P.field(req, "gen", int)
                self._assigned.clear()
                digest = await asyncio.to_thread(ps.rollback, gen)
                self._forget(req.meta.get("live", []))
                return {"digest": digest, "model": ps.model_digest()}, ()
            if op == "epoch":
                await asyncio.to_thread(ps.new_epoch, self.n_batches)
                return {
                    "epoch": ps.epoch,
                    "digest": ps.digest(),
                    "model": ps.model_digest(),
                }, ()
            if op == "eval":
                loss = await asyncio.to_thread(ps.loss, self.shard.x, self.shard.y)
                return {"loss": loss}, ()
            if op == "stop":
                return {}, ()
        raise ProtocolError(
            f"unknown operation {op!r}; expected hello, train, fence, "
            "checkpoint, rollback, epoch, eval or stop"
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
        if worker not in self._listening:
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
