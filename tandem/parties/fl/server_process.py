"""``tandem fl server``: the federated server in its own process, over HTTP.

`run_server(cfg)`:

1. under federated preprocessing (``[preprocessing] mode = "global"``, the default), reads the
   hellos of ``min_clients`` clients (up to ``wait`` seconds), asks them for the summaries of
   their training rows (in the clear, or their numeric sums through the secure sum under
   ``[secagg]``: `tandem.parties.fl.summary_exchange`) and merges them into one state
   (`tandem.parties.fl.preprocessing`); then reads its ``[data]`` (the held-out evaluation
   set; without ``label_column`` only its features, and the clients evaluate:
   `tandem.parties.fl.evaluation`) through the shared loader, under that state (or its own
   fit, ``per_client``), and builds the `Task` (the ``[model]`` spec with ``in_dims`` from the
   data, the loss, the seed, the state);
2. builds the `FLServer` (`build_fl_config`: the ``[compression]`` preset with the
   ``[optimizer]``) and, unless ``fresh``, resumes from ``server.checkpoint`` when one is there
   (refusing one written with another configuration);
3. serves HTTP with the roster's names admitted and no other (`HttpConfig.admit_names`: any
   other sender gets 401, with a log line); each client says ``hello`` (on connecting and on
   reconnecting) and gets a ``welcome`` with the task; a client that reconnects in the middle
   of its round gets the round's message again, planned from the version it says it holds;
4. waits for ``min_clients`` clients (up to ``wait`` seconds), then runs the remaining rounds;
   after each round the checkpoint is written (atomically) before the next round sends
   anything, so every version a client holds is one the checkpoint knows;
5. sends ``stop``, evaluates the final model on its data (when labelled) and exports it in
   split learning's format (`tandem.parties.fl.export`), and returns the summary that the
   CLI prints as JSON.

The server's transport waits on clients without a liveness timeout: every wait is bounded by
the round's deadline instead, so a client that restarts within its round is still waited for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import optax

from tandem.errors import ConfigError, TandemError
from tandem.transports.base import AddressingTransport, Frame, Transport

from . import checkpoint as ckpt
from . import presets
from . import protocol as P
from .config import ServerConfig
from .evaluation import latest
from .preprocessing import global_state
from .server import FLConfig, FLServer, RoundReport
from .summary_exchange import SUMMARY, check_summary_config, gather_summaries
from .task import Task, load_features, out_width, with_inputs
from .train import LocalTrainer

log = logging.getLogger(__name__)


def build_fl_config(cfg: ServerConfig, dim: int) -> FLConfig:
    """The `FLConfig` of ``cfg``: its compression preset with its optimizer as server rule."""
    c = cfg.compression
    common: dict[str, Any] = dict(
        rounds=cfg.rounds,
        fraction=cfg.fraction,
        round_timeout=cfg.round_timeout,
        seed=cfg.seed,
        lossless=c.lossless,
        anchor_every=c.anchor_every,
        log_size=c.log_size,
        eval_every=cfg.eval_every,
        client_eval=cfg.evaluate == "clients",
    )
    if c.preset == "dense":
        fl = presets.dense(downlink=c.downlink, **common)
    else:
        fl = presets.compressed(
            dim,
            uplink_ratio=c.uplink_ratio,
            topk_ratio=c.topk_ratio,
            momentum=0.0,
            server_lr=1.0,
            downlink=c.downlink,
            sketch=c.sketch,
            warmup=c.warmup(),
            uplink_bits=c.uplink_bits,
            quant_block=c.quant_block,
            feedback_max_gap=c.feedback_max_gap,
            **common,
        )
    secagg = None if cfg.secagg is None else cfg.secagg.build()
    try:
        dp = None
        if cfg.dp is not None:
            per_round = max(1, math.ceil(cfg.fraction * len(cfg.clients)))
            dp = cfg.dp.build(rounds=cfg.rounds, sampled=per_round, clients=len(cfg.clients))
        return dataclasses.replace(
            fl,
            optimizer=cfg.optimizer.build(),
            secagg=secagg,
            dp=dp,
            aggregator=cfg.aggregation.build(),
        )
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class ServerSetup:
    """What `prepare_server` reads and builds before any networking."""

    task: Task
    trainer: LocalTrainer
    fl: FLConfig
    x: np.ndarray
    y: np.ndarray | None  # None: the server's [data] has no labels (its clients evaluate)
    preprocessing: dict[str, Any]
    fingerprint: str


def prepare_server(
    cfg: ServerConfig, summaries: dict[str, dict[str, Any]] | None = None
) -> ServerSetup:
    """Read the evaluation data and build the task, the trainer and the `FLConfig`
    (blocking: call it in a thread). ``summaries`` (client -> its hello's summary): the
    federated preprocessing state is merged from them; None: the server's own fit, and the
    clients fit theirs."""
    state = None
    if summaries is not None:
        state = global_state(cfg.data, summaries, cfg.preprocessing.min_count)
    out = out_width(cfg.model, cfg.loss, cfg.path)
    data, x = load_features(cfg.data, loss=cfg.loss, out=out, state=state)
    spec = with_inputs(cfg.model, int(x.shape[1]), cfg.path, state or data.preprocessing)
    shared = None if state is None else state.to_json()
    probe = Task(spec, cfg.loss, cfg.seed, 0, cfg.identity_hash(), shared)
    try:
        trainer = LocalTrainer(
            probe.stage_model(), optax.identity(), loss=cfg.loss, init_seed=cfg.seed
        )
    except ConfigError as exc:
        raise ConfigError(f"{cfg.path}: [model] {exc}") from None
    task = dataclasses.replace(probe, dim=trainer.dim)
    return ServerSetup(
        task=task,
        trainer=trainer,
        fl=build_fl_config(cfg, trainer.dim),
        x=x,
        y=data.labels,
        preprocessing=data.preprocessing.to_json() if shared is None else shared,
        fingerprint=data.fingerprint if shared is None else _fingerprint(data.fingerprint, shared),
    )


def _fingerprint(own: str, state: dict[str, Any]) -> str:
    """The server data's fingerprint bound to the federated state its rows were read under."""
    import hashlib
    import json

    text = json.dumps({"data": own, "preprocessing": state}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


class DeployedServer(FLServer):
    """An `FLServer` whose clients connect themselves (``hello``) and that checkpoints after
    every round. ``connected`` holds the clients heard from since this process started."""

    def __init__(
        self,
        transport: Transport,
        cfg: ServerConfig,
        setup: ServerSetup,
        *,
        on_round: Callable[[RoundReport], None] | None = None,
    ) -> None:
        test_set = None
        if setup.trainer.classifies and setup.y is not None and cfg.evaluate == "server":
            test_set = (setup.x, setup.y)
        super().__init__(
            transport,
            cfg.clients,
            setup.trainer,
            setup.fl,
            test_set=test_set,
            on_round=on_round,
            roster=None if cfg.secagg is None else cfg.secagg.roster(),
        )
        self.config, self.task = cfg, setup.task
        self.connected: dict[str, asyncio.Event] = {c: asyncio.Event() for c in cfg.clients}
        self.hellos = 0
        self.refused_hellos: list[str] = []

    # -- connections ---------------------------------------------------------------------------
    async def watch(self) -> None:
        """Listen for hellos from every roster client the transport has admitted (forever:
        cancel it)."""
        async with asyncio.TaskGroup() as tg:
            watched: set[str] = set()
            while True:
                for c in self.clients:
                    if c not in watched and c in self.transport.peers:
                        watched.add(c)
                        tg.create_task(self._hellos(c))
                await asyncio.sleep(0.05)

    async def _hellos(self, c: str) -> None:
        while True:
            try:
                frame = await self.transport.recv(c, P.HELLO)
            except TandemError:
                return
            if frame.meta.get("kind") == SUMMARY:  # a late answer of the summary exchange
                continue
            try:
                version, url = P.check_hello(frame)
            except P.UpdateError as exc:
                self.refused_hellos.append(f"{c}: {exc}")
                log.warning("%s: hello from %r refused: %s", self.transport.name, c, exc)
                continue
            if frame.meta.get("final") is True:  # it asked for the final model with stop
                self.final_to.add(c)
            await self.welcome(c, version, url, P.hello_lineage(frame))

    async def welcome(
        self, c: str, version: int, url: str | None, lineage: str | None = None
    ) -> None:
        """Answer ``c``'s hello: record where it is and what it holds (``version`` of the
        history ``lineage`` names), send the task, and resend its round's message when its
        round is under way."""
        if url is not None and isinstance(self.transport, AddressingTransport):
            try:  # (memory transports need no address)
                self.transport.add_peer(c, url)  # it may have restarted elsewhere
            except ValueError as exc:
                log.warning("%s: %r gave an unusable URL %r: %s", self.transport.name, c, url, exc)
        # it holds a version this server never made: a newer one, or one of another history
        # (a server that started over without this one's checkpoint numbers from 0 again)
        reset = version > self.planner.version or (version > 0 and lineage != self.lineage)
        self.known[c] = 0 if reset else version
        meta = {
            "kind": P.WELCOME,
            "task": self.task.to_meta(),
            "client_seed": self.clients.index(c),
            "reset": reset,
            "lineage": self.lineage,
        }
        try:
            await self.transport.send(c, P.MODEL, Frame(meta=meta))
        except TandemError as exc:
            log.info("%s: cannot welcome %r: %s", self.transport.name, c, exc)
            return
        self.hellos += 1
        self.connected[c].set()
        log.info("%s: %r connected (holds version %d)", self.transport.name, c, version)
        inflight = self.inflight.get(c)
        if inflight is not None:
            try:
                await self.send_round(c, *inflight)
            except TandemError as exc:
                log.info("%s: cannot resend its round to %r: %s", self.transport.name, c, exc)

    async def wait_ready(self, client: str) -> None:
        await self.connected[client].wait()

    async def wait_for_clients(self, count: int, timeout: float) -> None:
        """Wait until ``count`` roster clients have connected; `ConfigError` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while sum(e.is_set() for e in self.connected.values()) < count:
            if time.monotonic() > deadline:
                missing = [c for c, e in self.connected.items() if not e.is_set()]
                raise ConfigError(
                    f"{self.config.path}: only {len(self.clients) - len(missing)} of the "
                    f"{count} clients needed (server.min_clients) connected within "
                    f"{timeout:g} s; missing: {missing}. Start them (tandem fl client --config "
                    "...), or lower server.min_clients, or raise server.wait"
                )
            await asyncio.sleep(0.05)

    # -- checkpoints ---------------------------------------------------------------------------
    async def after_round(self, report: RoundReport) -> None:
        location = self.config.checkpoint
        if location is None:
            return
        try:
            await asyncio.to_thread(ckpt.save, location, self, self.config.identity())
        except OSError as exc:
            raise ckpt.CheckpointError(
                f"{self.config.path}: cannot write the checkpoint {location!r} ({exc}); fix "
                "server.checkpoint or free some space, then start the server again (it resumes "
                "from the last checkpoint written)"
            ) from None


async def _early_setup(cfg: ServerConfig) -> ServerSetup | None:
    """The setup when it needs no client (``per_client`` preprocessing), else None once the
    server's data has been read (its errors come before any client is waited for)."""
    if cfg.preprocessing.mode == "per_client":
        return await asyncio.to_thread(prepare_server, cfg)
    await asyncio.to_thread(check_summary_config, cfg)
    out = out_width(cfg.model, cfg.loss, cfg.path)
    await asyncio.to_thread(load_features, cfg.data, loss=cfg.loss, out=out)
    return None


def _warn(cfg: ServerConfig) -> None:
    """The stderr warnings of a configuration that protects less than the defaults."""
    if cfg.preprocessing.mode == "per_client":
        log.warning(
            '%s: [preprocessing] mode = "per_client": every client scales and encodes with '
            "its own statistics (the same input means different things on different clients)",
            cfg.path,
        )
    if cfg.secagg is not None and cfg.secagg.public_keys is None:
        log.warning(
            "%s: secure aggregation without secagg.public_keys: the clients cannot check "
            "each other's round keys, so it protects their updates from an honest-but-curious "
            "server only (one that substitutes keys could read them); give every client a key "
            "(tandem keys generate NAME) and list them in [secagg] public_keys",
            cfg.path,
        )


def _transport(cfg: ServerConfig) -> Any:
    """The server's transport, built (not started): the roster's names admitted, no other."""
    from tandem.transports.factory import common_scheme, make_transport

    return make_transport(
        common_scheme([cfg.advertise_url] if cfg.advertise_url else []),
        name=cfg.name,
        **cfg.security.transport_settings(
            host=cfg.host,
            port=cfg.port,
            advertise_url=cfg.advertise_url,
            admit_unknown=True,
            admit_names=frozenset(cfg.clients),
            peer_timeout=None,
            # NaN/Inf are judged by the server (`protocol.check_update`): a refused update
            # then ends its client's wait in the round at once
            reject_nonfinite=False,
        ),
    )


async def _serve_rounds(server: DeployedServer, cfg: ServerConfig) -> None:
    """Wait for the clients, run the rounds; a `TandemError` surfaces as itself."""
    failure: TandemError | None = None
    async with asyncio.TaskGroup() as tg:
        watcher = tg.create_task(server.watch())
        try:
            await server.wait_for_clients(cfg.min_clients, cfg.wait)
            await server.run()
        except TandemError as exc:  # raised below, not wrapped in an exception group
            failure = exc
        finally:
            watcher.cancel()
    if failure is not None:
        raise failure


async def run_server(
    cfg: ServerConfig,
    *,
    fresh: bool = False,
    on_round: Callable[[RoundReport], None] | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the server of ``cfg`` to the end (see the module docstring); returns the summary.

    ``on_ready(url)`` is called once the server listens; ``on_round`` after every round."""
    from tandem.transports.factory import addressing, started

    from .export import export_global

    _warn(cfg)
    restored = None
    if cfg.checkpoint is not None and not fresh:
        restored = await asyncio.to_thread(ckpt.load, cfg.checkpoint)
    setup = await _early_setup(cfg)
    async with started(_transport(cfg)) as transport:
        if on_ready is not None:
            on_ready(addressing(transport, "an FL server").address())
        hellos: list[tuple[str, int, str | None, bool, str | None]] = []
        if setup is None:  # federated preprocessing: the clients' summaries first
            summaries, hellos = await gather_summaries(transport, cfg)
            setup = await asyncio.to_thread(prepare_server, cfg, summaries)
        server = DeployedServer(transport, cfg, setup, on_round=on_round)
        if restored is not None:
            ckpt.restore(server, restored, cfg.identity())
        resumed = server.next_round if restored is not None else None
        for c, version, url, wants_final, lineage in hellos:
            if wants_final:  # it asked for the final model with stop
                server.final_to.add(c)
            await server.welcome(c, version, url, lineage)
        await _serve_rounds(server, cfg)
        final = None
        if setup.y is not None:
            final = await asyncio.to_thread(server.trainer.evaluate, server.model, setup.x, setup.y)
        exported = None
        if cfg.export is not None:
            exported = await asyncio.to_thread(
                export_global, cfg.export, server.model, setup, party=cfg.name
            )
    reports = server.reports
    return {
        "role": "server",
        "name": cfg.name,
        "rounds": len(reports),
        "resumed_at": resumed,
        "accuracy": None
        if final is None or final.accuracy is None
        else round(100 * final.accuracy, 2),
        "loss": None if final is None else round(final.loss, 6),
        "eval_rows": 0 if final is None else int(setup.x.shape[0]),
        "evaluate": cfg.evaluate,
        "client_eval": latest(reports),
        "params": setup.task.dim,
        "version": server.planner.version,
        "bytes_up": sum(r.up_bytes for r in reports),
        "bytes_down": sum(r.down_bytes for r in reports),
        "dropped": sum(len(r.dropped) for r in reports),
        "rejected": sum(len(r.rejected) for r in reports),
        "resyncs": server.resyncs,
        "export": exported,
        "checkpoint": cfg.checkpoint,
        "aggregation": cfg.aggregation.rule,
    } | _privacy(server)


def _privacy(server: DeployedServer) -> dict[str, Any]:
    """The summary's DP entries: epsilon at delta after every round run (resumed included),
    and under distributed DP the epsilon against the server (`FLServer.epsilon_vs_server`;
    None in central mode)."""
    dp = server.cfg.dp
    if dp is None:
        return {}
    eps, vs_server = server.epsilon(server.next_round), server.epsilon_vs_server()
    return {
        "dp": {
            "mode": dp.mode,
            "epsilon": None if eps is None else round(eps, 4),
            "epsilon_vs_server": None if vs_server is None else round(vs_server, 4),
            "delta": dp.delta,
            "noise_multiplier": round(dp.noise_multiplier, 6),
            "clip": server.dp_clip,
            "adaptive": dp.adaptive,
        }
    }


__all__ = [
    "DeployedServer",
    "ServerSetup",
    "build_fl_config",
    "gather_summaries",
    "prepare_server",
    "run_server",
]
