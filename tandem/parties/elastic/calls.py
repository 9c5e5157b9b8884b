"""The coordinator's requests to its data servers: one request, one reply, matched by id.

`DataServerCalls.call` sends ``{op, req, ...}`` on ``CTL`` and waits for the ``REPLY`` with
the same ``req`` (read by one `replies_from` task per data server). A data server that does not
answer within ``call_timeout`` (the first ``hello`` waits at least 60 s for data servers still
starting), whose link fails, or that answers ``hosted: false`` (it restarted) raises
`DataServerDownError`; one that refuses the request raises `ElasticError`. `call_all` asks every
data server at once and raises one error, not a group. ``down`` collects the data servers that
failed a request this round (the coordinator then recovers them).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from tandem.errors import TransportError
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .errors import DataServerDownError, ElasticError

log = logging.getLogger(__name__)


class DataServerCalls:
    """Requests of ``transport`` to ``data_servers`` (module docstring)."""

    def __init__(
        self,
        transport: Transport,
        data_servers: Sequence[str],
        *,
        call_timeout: float,
        pause: float,
    ) -> None:
        self.t = transport
        self.data_servers = tuple(data_servers)
        self.call_timeout = call_timeout
        self.pause = pause  # wait before listening again to a data server whose link failed
        self.down: set[str] = set()
        self._replies: dict[int, tuple[str, asyncio.Future]] = {}
        self._req = itertools.count()

    async def call(self, ds: str, op: str, arrays=(), **meta) -> Frame:
        """Send request ``op`` to ``ds`` and return its reply (module docstring)."""
        req = next(self._req)
        fut = asyncio.get_running_loop().create_future()
        self._replies[req] = (ds, fut)
        wait = max(self.call_timeout, 60.0) if op == "hello" else self.call_timeout
        try:
            async with asyncio.timeout(wait):
                await self.t.send(
                    ds, P.CTL, Frame(meta={"op": op, "req": req, **meta}, arrays=tuple(arrays))
                )
                rep = await fut
        except TimeoutError:
            raise DataServerDownError(
                f"data server {ds!r} did not answer {op!r} within {wait:g} s; is it running?"
            ) from None
        except TransportError as exc:
            raise DataServerDownError(f"data server {ds!r} is unreachable: {exc}") from None
        finally:
            self._replies.pop(req, None)
        if not rep.meta.get("ok"):
            if rep.meta.get("hosted") is False:
                raise DataServerDownError(
                    f"data server {ds!r} restarted (it hosts no parameter server): "
                    f"{rep.meta.get('error')}"
                )
            raise ElasticError(f"data server {ds!r} failed {op!r}: {rep.meta.get('error')}")
        return rep

    async def call_all(
        self, op: str, per_ds: Callable[[str], dict] | None = None, arrays=(), **meta
    ) -> dict[str, Frame]:
        """``op`` on every data server at once. Raises one error, not a group: a refusal
        (`ElasticError`) before `DataServerDownError`, so a real failure is never mistaken for
        a restart."""

        async def one(ds: str) -> Frame | ElasticError:
            try:
                return await self.call(ds, op, arrays, **meta, **(per_ds(ds) if per_ds else {}))
            except ElasticError as exc:
                return exc

        async with asyncio.TaskGroup() as tg:
            tasks = {ds: tg.create_task(one(ds)) for ds in self.data_servers}
        results = {ds: task.result() for ds, task in tasks.items()}
        errors = [r for r in results.values() if isinstance(r, ElasticError)]
        if errors:
            refusals = [e for e in errors if not isinstance(e, DataServerDownError)]
            if refusals:
                raise refusals[0]
            self.down.update(ds for ds, r in results.items() if isinstance(r, ElasticError))
            raise errors[0]
        return {ds: r for ds, r in results.items() if isinstance(r, Frame)}

    async def replies_from(self, ds: str) -> None:
        """Deliver ``ds``'s replies to their callers (forever: cancel it)."""
        while True:
            try:
                rep = await self.t.recv(ds, P.REPLY)
            except TransportError as exc:  # the data server is gone: fail its pending calls
                for who, fut in self._replies.values():
                    if who == ds and not fut.done():
                        fut.set_exception(DataServerDownError(f"data server {ds!r} is gone: {exc}"))
                # a restarted data server speaks again at the same address
                if P.cancelled_meanwhile():
                    return
                await asyncio.sleep(self.pause)
                continue
            req = rep.meta.get("req")
            pending = self._replies.get(req) if isinstance(req, int) else None
            if pending is not None and not pending[1].done():
                pending[1].set_result(rep)

    async def request_training(self, ds: str, meta: dict[str, Any]) -> None:
        """Ask ``ds`` to send a batch to a worker (no reply); a data server that cannot be
        reached is marked down (the detection then recovers) instead of stalling the round."""
        if ds in self.down:
            return
        try:
            async with asyncio.timeout(self.call_timeout):
                await self.t.send(ds, P.CTL, Frame(meta=meta))
        except (TransportError, TimeoutError) as exc:
            log.warning("data server %s unreachable: %s", ds, exc)
            self.down.add(ds)
