"""``tandem fl client``: a federated client in its own process, over HTTP.

`run_client(cfg)`:

1. summarises its training rows (`tandem.parties.data.summary`; no row leaves it), says
   ``hello`` to the server (version 0), answers its request for the summary (in the clear,
   or the numeric sums through the secure sum: `tandem.parties.fl.summary_exchange`) and
   waits for its ``welcome``: the
   `Task` (model spec, loss, init seed, the federated preprocessing state) and the seed of its
   local shuffles. A server that is not up yet is
   retried with backoff for up to ``reconnect_timeout`` seconds; a server that refuses this
   client (not in its roster, or another secret) stops it with an error saying so;
2. reads its ``[data]`` through the shared loader (labels checked against the task's loss),
   preprocessed with the task's state (or, when the server runs ``per_client`` preprocessing,
   its own fit, with a warning on stderr), and trains on the rows of the split's training part
   (when the server asks, it evaluates the global model on the validation part's rows:
   `tandem.parties.fl.evaluation`);
3. serves rounds (`FLClient`) until the server says ``stop``. When the server is lost (its
   transport notices a restart, or ``[http] peer_timeout`` without an answer), it says
   ``hello`` again with the version it holds, retrying with backoff until the server is back
   (at most ``reconnect_timeout`` seconds), and goes on with the same model state. A
   ``welcome`` from a server running another configuration stops it.

Returns the summary that the CLI prints as JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.errors import AuthenticationError, TandemError, TransportClosedError
from tandem.parties.memory import release_free_memory
from tandem.transports.base import Frame, Transport

from . import protocol as P
from .client import FLClient
from .config import ClientConfig
from .downlink import ClientModel
from .summary_exchange import SUMMARIZE
from .task import Task, input_width, load_rows, out_width, part
from .train import LocalTrainer

log = logging.getLogger(__name__)

#: Seconds a reconnecting client waits for the server's answer before saying hello again.
ANSWER_WAIT = 10.0


class ServerLostError(TandemError):
    """The server could not be reached again within ``reconnect_timeout``."""


class RefusedError(TandemError):
    """The server refused this client (not in its roster, or another secret), or now runs
    another task."""


class Connection:
    """This client's side of the link: hello with backoff, and the server's answer."""

    def __init__(
        self,
        transport: Transport,
        cfg: ClientConfig,
        url: str,
        summary: dict[str, Any] | None = None,
    ) -> None:
        self.transport, self.cfg, self.url, self.summary = transport, cfg, url, summary
        self.server = cfg.server_name
        self.reconnects = 0
        # the lineage of the last welcome: the history the held model's version belongs to
        self.lineage: str | None = None

    def hello_meta(self, version: int) -> dict[str, Any]:
        """The hello's meta: version held, own URL, and whether this client wants the final
        model (the data summary goes only when the server asks for it, `answer_summary`)."""
        meta: dict[str, Any] = {"kind": "hello", "version": version, "url": self.url}
        if self.lineage is not None:
            meta["lineage"] = self.lineage
        return meta | ({"final": True} if self.cfg.final_model is not None else {})

    async def answer_summary(self, request: dict[str, Any]) -> None:
        """Answer the server's ``summarize`` request (`summary_exchange.answer`): in the
        clear, or the numeric sums through the secure sum, as the server runs."""
        from .summary_exchange import answer

        if self.summary is None:
            raise RefusedError(
                f"{self.cfg.path}: the server asked for this client's data summary, which it "
                "did not compute"
            )
        await answer(
            self.transport,
            self.server,
            request,
            self.summary,
            where=self.cfg.path,
            signer=self.cfg.secagg.signer(),
            roster=self.cfg.secagg.roster(),
        )

    async def hello(self, version: int, deadline: float) -> None:
        """Deliver a hello, retrying with backoff until ``deadline`` (monotonic seconds)."""
        delay = 0.1
        while True:
            try:
                await self.transport.send(
                    self.server,
                    P.HELLO,
                    Frame(meta=self.hello_meta(version)),
                )
                return
            except AuthenticationError as exc:
                raise RefusedError(
                    f"{self.cfg.path}: the server at {self.cfg.server} refused "
                    f"{self.cfg.name!r}: {exc}. Is {self.cfg.name!r} in its server.clients, "
                    "and do both use the same [http] secret?"
                ) from None
            except TransportClosedError as exc:  # unreachable for retry_timeout, or closing
                if time.monotonic() + delay > deadline:
                    raise ServerLostError(
                        f"{self.cfg.path}: the server at {self.cfg.server} did not answer "
                        f"within client.reconnect_timeout = {self.cfg.reconnect_timeout:g} s "
                        f"({exc}); start it, or check client.server"
                    ) from None
                log.info(
                    "%s: server unreachable (%s); retrying in %.1f s", self.cfg.name, exc, delay
                )
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)

    async def next_frame(self, version: int) -> Frame:
        """The next model-channel frame; when the link to the server is lost, say hello again
        (with ``version``, the version held) until the server answers."""
        deadline = None
        sent = 0.0
        delay = 0.05
        while True:
            try:
                return await self.transport.recv(self.server, P.MODEL)
            except TransportClosedError as exc:
                now = time.monotonic()
                if deadline is None:
                    log.warning("%s: lost the server (%s); reconnecting", self.cfg.name, exc)
                    deadline = now + self.cfg.reconnect_timeout
                    self.reconnects += 1
                if now > deadline:
                    raise ServerLostError(
                        f"{self.cfg.path}: lost the server at {self.cfg.server} and it did "
                        f"not come back within client.reconnect_timeout = "
                        f"{self.cfg.reconnect_timeout:g} s"
                    ) from None
                if now - sent > ANSWER_WAIT:
                    await self.hello(version, deadline)
                    sent, delay = time.monotonic(), 0.05
                    continue
                await asyncio.sleep(delay)  # the answer reopens the link
                delay = min(2 * delay, 1.0)


class ProcessClient(FLClient):
    """An `FLClient` that reconnects to a lost server and checks every ``welcome``."""

    def __init__(
        self,
        link: Connection,
        task: Task,
        *args: Any,
        on_round: Callable[[int], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(link.transport, link.server, *args, **kwargs)
        self.link, self.task, self.on_round = link, task, on_round

    async def before_reply(self, rnd: int) -> None:
        # the round's training temporaries go back to the system before the update is sent
        release_free_memory()
        if self.on_round is not None:
            self.on_round(rnd)

    async def run(self) -> str:
        while True:
            frame = await self.link.next_frame(self.state.version)
            if await self.dispatch(frame):
                return "stop"

    async def control(self, frame: Frame) -> None:
        if frame.meta.get("kind") == SUMMARIZE:  # a restarted server merges again
            return await self.link.answer_summary(dict(frame.meta))
        if frame.meta.get("kind") != P.WELCOME:
            return await super().control(frame)
        task = Task.from_meta(frame.meta.get("task"))
        if task != self.task:
            raise RefusedError(
                f"{self.link.cfg.path}: the server now runs another task (configuration "
                f"{task.identity}, was {self.task.identity}); this client stops. Start it again "
                "to join the new training"
            )
        if frame.meta.get("reset"):
            self.state = ClientModel(self.trainer.init_vec)
        lineage = frame.meta.get("lineage")  # the model held now is of this server's history
        self.link.lineage = lineage if isinstance(lineage, str) else None


async def connect(link: Connection) -> dict[str, Any]:
    """Say hello (version 0) and return the server's welcome meta (frames before it, meant
    for an earlier connection, are dropped: the server resends the round after welcoming)."""
    deadline = time.monotonic() + link.cfg.reconnect_timeout
    while True:
        await link.hello(0, deadline)
        try:
            while True:
                async with asyncio.timeout(max(0.1, min(ANSWER_WAIT, deadline - time.monotonic()))):
                    frame = await link.transport.recv(link.server, P.MODEL)
                if frame.meta.get("kind") == P.WELCOME:
                    return dict(frame.meta)
                if frame.meta.get("kind") == SUMMARIZE:
                    break
            await link.answer_summary(dict(frame.meta))
            deadline = time.monotonic() + link.cfg.reconnect_timeout  # merging takes a while
            return dict((await _welcome(link, deadline)).meta)
        except (TimeoutError, TransportClosedError):
            if time.monotonic() > deadline:
                raise ServerLostError(
                    f"{link.cfg.path}: the server at {link.cfg.server} did not welcome "
                    f"{link.cfg.name!r} within client.reconnect_timeout = "
                    f"{link.cfg.reconnect_timeout:g} s"
                ) from None


async def _welcome(link: Connection, deadline: float) -> Frame:
    """The welcome after the summary exchange (`TimeoutError` when none came by
    ``deadline``)."""
    while True:
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            frame = await link.transport.recv(link.server, P.MODEL)
        if frame.meta.get("kind") == P.WELCOME:
            return frame


def prepare_client(
    cfg: ClientConfig, task: Task
) -> tuple[LocalTrainer, np.ndarray, np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Read this client's rows and build its trainer (blocking: run in a thread); returns
    the trainer, the training part's rows and labels, and the validation part's
    (``data.split.validation``: what it evaluates the global model on when asked)."""
    state = task.state()
    if state is None:
        log.warning(
            "%s: the server runs per-client preprocessing ([preprocessing] mode = "
            '"per_client"): this client scales and encodes with its own statistics, so the same '
            "input means different things on different clients; the server's default "
            '(mode = "global") fits one state from every client\'s summary',
            cfg.path,
        )
    out = out_width(task.model, task.loss, cfg.path)
    data, x, y = load_rows(cfg.data, loss=task.loss, out=out, state=state)
    x_train, y_train = part(data, x, y, "train")
    if x_train.shape[0] == 0:
        raise TandemError(
            f"{cfg.path}: the training part of {cfg.data.source!r} is empty; lower "
            "data.split.test / data.split.validation"
        )
    expected = input_width(task.model)
    if expected != x.shape[1]:
        raise TandemError(
            f"{cfg.path}: the server's model takes {expected} features but "
            f"{cfg.data.source!r} gives {x.shape[1]} columns; use the columns the server's "
            "data has (data.features)"
        )
    trainer = task.trainer(cfg.optimizer.build(), epochs=cfg.epochs, batch_size=cfg.batch_size)
    release_free_memory()  # the initialiser's temporaries
    trainer.warm_up(x_train, y_train)
    release_free_memory()  # the load's and the trace's temporaries: peak RSS is what counts
    return trainer, x_train, y_train, part(data, x, y, "validation")


async def run_client(
    cfg: ClientConfig, *, on_round: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Run the client of ``cfg`` until the server says stop (see the module docstring);
    ``on_round(r)`` is called when it has trained for round ``r``, before it replies."""
    from tandem.transports.factory import addressing, common_scheme, make_transport, started

    built = make_transport(
        common_scheme([cfg.server]),
        name=cfg.name,
        peers={cfg.server_name: cfg.server},
        **cfg.security.transport_settings(
            host=cfg.host, port=cfg.port, advertise_url=cfg.advertise_url
        ),
    )
    from tandem.parties.data.summary import summarize_source

    summary = await asyncio.to_thread(summarize_source, cfg.data)
    async with started(built) as transport:
        url = cfg.advertise_url or addressing(transport, "an FL client").address()
        link = Connection(transport, cfg, url, summary)
        welcome = await connect(link)
        lineage = welcome.get("lineage")  # it holds version 0 (the initial model) of it
        link.lineage = lineage if isinstance(lineage, str) else None
        task = Task.from_meta(welcome.get("task"))
        trainer, x, y, validation = await asyncio.to_thread(prepare_client, cfg, task)
        seed = welcome.get("client_seed")
        client = ProcessClient(
            link,
            task,
            x,
            y,
            trainer,
            seed=seed if isinstance(seed, int) else 0,
            on_round=on_round,
            signer=cfg.secagg.signer(),
            roster=cfg.secagg.roster(),
            max_refusals=cfg.max_refusals,
            validation=validation,
        )
        log.info("%s: joined (%d rows, %d parameters)", cfg.name, x.shape[0], trainer.dim)
        await client.run()
    written = None
    if cfg.final_model is not None and client.final_model is not None:
        written = await asyncio.to_thread(write_final, cfg.final_model, client.final_model)
    return {
        "role": "client",
        "name": cfg.name,
        "rows": int(x.shape[0]),
        "validation_rows": int(validation[0].shape[0]),
        "rounds_trained": client.rounds_trained,
        "version": client.state.version,
        "reconnects": link.reconnects,
        "errors": client.errors,
        "refusals": client.refused_updates,
        "final_model": written,
    }


def write_final(location: str, model: np.ndarray) -> str:
    """Write the server's final model (flat float32 ``params``) as safetensors to
    ``location`` (a path or fsspec URL); returns the location."""
    import fsspec
    from safetensors.numpy import save

    data = save({"params": np.ascontiguousarray(model, np.float32)}, {"format": "tandem-fl"})
    with fsspec.open(location, "wb") as f:
        f.write(data)
    return location


__all__ = ["ProcessClient", "RefusedError", "ServerLostError", "prepare_client", "run_client"]
