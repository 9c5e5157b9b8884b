"""Insider and outsider attacks on the elastic and federated roles (issue 39, points 3, 4 and 7),
each against a small job of its own in this process, every party on its own HTTP transport on
127.0.0.1 with a shared secret (`run_elastic` and `run_fl` build the jobs).

Elastic (two data servers, workers ``w0`` and ``w1`` on the coordinator's roster, admission of
unknown senders off as it is by default with a roster):

* ``stranger_worker``: ``mallory``, holding the secret but on no roster, beats to the
  coordinator (expect 401 for every heartbeat, no welcome, no training rows sent to it);
* ``elastic_forged_control``: roster member ``w1`` sends ``stop`` on the control channel to a data
  server as if it were the coordinator (expect 403 each time, logged and counted by the data
  server);
* ``done_without_gradients``: roster member ``w1`` reports every batch it is given done
  without pushing gradients (expect it fenced: its false reports counted, then removed).

Federated (four clients, the last one hostile, rounds of at most ``ROUND_TIMEOUT`` s):

* ``oversized_update``: an update of 64 MiB, far above the negotiated model's encoded size
  (expect 413 from its head, almost none of its body read, the round not waiting for it);
* ``inflated_count``: an update claiming 2**31 samples (expect it refused: above the client's
  declared data size);
* ``inflated_count_after_report``: the same after one honest round, to a server that knows no
  roster sizes (expect it refused: above the size the client's first report declared);
* ``nonfinite_wait``: an update holding NaN (expect it refused and the round to complete at
  once, not after its deadline).

Each attack returns its figures and ``refused_ok``: whether every hostile message was refused,
the job finished and (elastic) committed every batch exactly once. Each is bounded by
``seconds`` (and by its job's size).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from tandem.errors import TandemError
from tandem.parties.elastic import protocol as EP
from tandem.parties.elastic.coordinator import Coordinator, CoordinatorConfig
from tandem.parties.elastic.data_server import DataServer
from tandem.parties.elastic.errors import NotWelcomedError
from tandem.parties.elastic.spec import ModelSpec, make_dataset
from tandem.parties.elastic.worker import Worker
from tandem.parties.fl import protocol as FP
from tandem.parties.fl.client import FLClient
from tandem.parties.fl.server import FLConfig, FLServer
from tandem.transports.base import Frame
from tandem.transports.http import HttpConfig, HttpTransport

SECRET = b"bench-hostile-roles"
SPEC = ModelSpec(sizes=(8, 16, 3), optimizer="adam", lr=0.02, batch_size=16, seed=0)
ROUND_TIMEOUT = 30.0
OVERSIZED = 64 << 20


# -- elastic -------------------------------------------------------------------------------------
class LyingWorker(Worker):
    """Reports every batch it is given done, without pushing gradients."""

    async def _one(self, ds: str, task: Frame) -> None:
        meta = {"batch": task.meta["batch"], "gen": task.meta["gen"], "ds": ds, "ok": True}
        await self.t.send(self.coordinator, EP.DONE, Frame(meta=meta))


def _http(name: str, peers: dict[str, str] | None = None, **kw: Any) -> HttpTransport:
    return HttpTransport(HttpConfig(name=name, secret=SECRET, peers=peers or {}, **kw))


async def run_elastic(
    *,
    liar: bool = False,
    side: Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]] | None = None,
    admit_unknown: bool = False,
    epochs: int = 2,
    seconds: float = 120.0,
) -> dict[str, Any]:
    """An elastic job over HTTP: returns the coordinator's summary, ``exactly_once`` (every
    epoch committed every batch once), the data servers' ``forged`` counts and what ``side``
    (run beside the job with the parties: ``coordinator``, ``ds``, ``workers``, the
    transports) returned under ``side``."""
    shards = make_dataset(2, 128, SPEC, seed=3)
    async with contextlib.AsyncExitStack() as stack:
        enter = stack.enter_async_context
        coord_t = await enter(_http("coordinator", admit_unknown=admit_unknown))
        ds_t = [await enter(_http(f"ds{i}", {"coordinator": coord_t.url})) for i in range(2)]
        w_t = [await enter(_http(f"w{i}", {"coordinator": coord_t.url})) for i in range(2)]
        for t in [*ds_t, *w_t]:
            coord_t.add_peer(t.name, t.url)
        servers = [
            DataServer(t, coordinator="coordinator", spec=SPEC, shard=s, url=t.url)
            for t, s in zip(ds_t, shards, strict=True)
        ]
        coordinator = Coordinator(
            coord_t,
            CoordinatorConfig(
                data_servers=("ds0", "ds1"),
                data_server_urls=tuple((t.name, t.url) for t in ds_t),
                interval=0.3,
                epochs=epochs,
                min_workers=2,
            ),
        )
        kinds = [Worker, LyingWorker if liar else Worker]
        workers = [
            kind(t, coordinator="coordinator", heartbeat=0.1, url=t.url)
            for kind, t in zip(kinds, w_t, strict=True)
        ]
        parties = {"coordinator": coord_t, "ds": servers, "ds_t": ds_t, "workers": w_t}
        async with asyncio.timeout(seconds), asyncio.TaskGroup() as tg:
            runners: list[DataServer | Worker] = [*servers, *workers]
            roles = [tg.create_task(p.run()) for p in runners]
            hit = tg.create_task(side(parties)) if side is not None else None
            try:
                summary = await coordinator.run()
                got = await hit if hit is not None else {}
            finally:
                for task in [*roles, *([hit] if hit else [])]:
                    task.cancel()
        summary["coordinator_refused"] = dict(coord_t.refused)
        summary["ds_refused"] = [dict(t.refused) for t in ds_t]
    ids = sorted(i * EP.STRIDE + b for i, s in enumerate(shards) for b in range(s.n_batches(16)))
    summary["exactly_once"] = summary["epochs"] == epochs and all(
        sorted(e["committed"]) == ids for e in summary["history"]
    )
    summary["forged"] = [ds.forged for ds in servers]
    summary["side"] = got
    return summary


async def attack_stranger_worker(seconds: float) -> dict[str, Any]:
    """``mallory`` (the secret, no roster entry) tries to join; it must never be welcomed."""

    async def stranger(parties: dict[str, Any]) -> dict[str, Any]:
        coord_t = parties["coordinator"]
        async with _http("mallory", {"coordinator": coord_t.url}) as t:
            w = Worker(t, coordinator="coordinator", heartbeat=0.1, url=t.url, join_timeout=3)
            try:
                await w.run()
                welcomed = True
            except NotWelcomedError:
                welcomed = False
            rows = sum(t.received_stats(p).frames for p in ("ds0", "ds1") if p in t.peers)
        return {"welcomed": welcomed, "task_frames": rows}

    s = await run_elastic(side=stranger, seconds=seconds)
    side = s["side"]
    refused = s.get("coordinator_refused", {})
    return {
        "refused_ok": s["exactly_once"] and not side["welcomed"] and side["task_frames"] == 0,
        "welcomed": side["welcomed"],
        "task_frames_to_stranger": side["task_frames"],
        "refused_heads": refused,
        "exactly_once": s["exactly_once"],
        "epochs": s["epochs"],
    }


async def attack_forged_control(seconds: float, tries: int = 20) -> dict[str, Any]:
    """Roster member ``w1`` sends ``stop`` to ``ds0`` as if it were the coordinator."""

    async def forge(parties: dict[str, Any]) -> dict[str, Any]:
        w1, ds0 = parties["workers"][1], parties["ds_t"][0]
        # w1 knows ds0 from the coordinator's welcome; ds0 knows w1 once told to train it.
        # A schedule that never sends w1 to ds0 early would leave this waiting past the
        # job's end: after a bounded wait both learn the other's address as they would then
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5.0
        while ("ds0" not in w1.peers or "w1" not in ds0.peers) and loop.time() < deadline:
            await asyncio.sleep(0.02)
        if "ds0" not in w1.peers:
            w1.add_peer("ds0", ds0.url)
        if "w1" not in ds0.peers:
            ds0.add_peer("w1", w1.url)
        statuses: dict[str, int] = {}
        for _ in range(tries):
            try:
                await w1.send("ds0", EP.CTL, Frame(meta={"op": "stop", "req": 0}))
                key = "accepted"
            except TandemError as exc:
                key = f"{type(exc).__name__}: {str(exc)[:160]}"
            statuses[key] = statuses.get(key, 0) + 1
            await asyncio.sleep(0.05)
        return statuses

    s = await run_elastic(side=forge, seconds=seconds)
    statuses = s["side"]
    refused = sum(n for k, n in statuses.items() if k.startswith("AdmissionError"))
    return {
        "refused_ok": s["exactly_once"] and statuses.get("accepted", 0) == 0 and refused > 0,
        "sends": statuses,
        "forged_counted": s["forged"],
        "exactly_once": s["exactly_once"],
        "epochs": s["epochs"],
    }


async def attack_done_without_gradients(seconds: float) -> dict[str, Any]:
    """Roster member ``w1`` reports batches done without pushing their gradients."""
    s = await run_elastic(liar=True, seconds=seconds)
    return {
        "refused_ok": s["exactly_once"] and "w1" in s["fenced"],
        "false_reports": s["false_reports"],
        "fenced": s["fenced"],
        "generation": s["generation"],
        "exactly_once": s["exactly_once"],
        "epochs": s["epochs"],
    }


# -- federated -----------------------------------------------------------------------------------
class HostileClient(FLClient):
    """Trains like any client, then tampers with its update as ``mode`` says: ``oversized``
    (a 64 MiB payload), ``count`` (2**31 samples) or ``nonfinite`` (a NaN)."""

    mode = "honest"
    honest_rounds = 0  # rounds answered honestly before the tampering starts
    refusals: list[str]

    async def handle(self, frame: Frame) -> None:
        meta = frame.meta
        self.state.apply(meta, FP.unpack_arrays(frame, max_bytes=8 * self.state.model.nbytes))
        if not meta.get("train"):
            return
        k = FP.expected_shape(meta["uplink"], self.state.model.size)
        payload = np.zeros(k, np.float32)
        n = int(self.x.shape[0])
        if meta["round"] < self.honest_rounds:
            pass
        elif self.mode == "oversized":
            payload = np.zeros(OVERSIZED // 4, np.float32)
        elif self.mode == "count":
            n = 2**31
        elif self.mode == "nonfinite":
            payload[0] = np.nan
        out = {"round": meta["round"], "n": n, "version": self.state.version}
        out["kind"] = meta["uplink"]["kind"]
        try:
            await self.transport.send(self.server, FP.UPDATE, Frame(meta=out, arrays=(payload,)))
        except TandemError as exc:
            self.refusals.append(type(exc).__name__)


async def run_fl(
    mode: str,
    *,
    rounds: int = 3,
    sizes: bool = True,
    honest_rounds: int = 0,
    seconds: float = 120.0,
) -> dict[str, Any]:
    """A federation of four clients over HTTP, ``c3`` hostile (`HostileClient`, honest for
    its first ``honest_rounds`` rounds); ``sizes``: the server knows each client's data size
    (a roster's), else a first report declares it. Returns the round reports' figures and the
    hostile client's refusals."""
    from tandem.parties.fl.aggregate import ServerRule
    from tandem.parties.fl.data import load_federated_digits
    from tandem.parties.fl.federation import client_names, make_trainer

    data = load_federated_digits(4, 0.5, seed=1)
    trainer = make_trainer(data, [16], lr=0.1, epochs=1)
    x0, y0 = data.clients[0]
    trainer.train(trainer.init_vec, x0, y0, 0)  # compiled before the rounds are timed
    cfg = FLConfig(
        rounds=rounds,
        fraction=1.0,
        round_timeout=ROUND_TIMEOUT,
        uplink={"kind": "randk", "k": 40},
        rule=ServerRule(momentum=0.5, topk=60),
        downlink="version",
        seed=3,
    )
    names = client_names(4)
    async with contextlib.AsyncExitStack() as stack:
        enter = stack.enter_async_context
        server_t = await enter(_http("server", reject_nonfinite=False))
        client_ts = [await enter(_http(n, {"server": server_t.url})) for n in names]
        for t in client_ts:
            server_t.add_peer(t.name, t.url)
        clients = [
            (HostileClient if i == 3 else FLClient)(t, "server", x, y, trainer, seed=i)
            for i, (t, (x, y)) in enumerate(zip(client_ts, data.clients, strict=True))
        ]
        hostile = clients[3]
        assert isinstance(hostile, HostileClient)
        hostile.mode, hostile.refusals, hostile.honest_rounds = mode, [], honest_rounds
        declared = {n: int(x.shape[0]) for n, (x, _) in zip(names, data.clients, strict=True)}
        server = FLServer(server_t, names, trainer, cfg, sizes=declared if sizes else None)
        t0 = time.perf_counter()
        async with asyncio.timeout(seconds), asyncio.TaskGroup() as tg:
            for c in clients:
                tg.create_task(c.run())
            await server.run()
        elapsed = time.perf_counter() - t0
        received = server_t.received_stats("c3").bytes
        refused_heads = dict(server_t.refused)
    reports = server.reports
    return {
        "rounds": len(reports),
        "seconds": round(elapsed, 3),
        "max_round_s": round(max(r.seconds for r in reports), 3),
        "round_timeout_s": ROUND_TIMEOUT,
        "accepted": [r.accepted for r in reports],
        "rejected_c3": [r.rejected.get("c3", "") for r in reports],
        "client_refusals": hostile.refusals,
        "bytes_from_c3": received,
        "refused_heads": refused_heads,
    }


def _honest_rounds(out: dict[str, Any]) -> bool:
    return out["accepted"] == [["c0", "c1", "c2"]] * out["rounds"]


async def attack_oversized_update(seconds: float) -> dict[str, Any]:
    out = await run_fl("oversized", seconds=seconds)
    ok = (
        _honest_rounds(out)
        and all("from its head" in r for r in out["rejected_c3"])
        and out["bytes_from_c3"] < OVERSIZED // 16
        and out["max_round_s"] < ROUND_TIMEOUT / 2
    )
    return {"refused_ok": ok, "update_bytes": OVERSIZED, **out}


async def attack_inflated_count(seconds: float) -> dict[str, Any]:
    out = await run_fl("count", seconds=seconds)
    ok = _honest_rounds(out) and all("declared" in r for r in out["rejected_c3"])
    return {"refused_ok": ok and out["max_round_s"] < ROUND_TIMEOUT / 2, **out}


async def attack_inflated_count_after_report(seconds: float) -> dict[str, Any]:
    out = await run_fl("count", sizes=False, honest_rounds=1, seconds=seconds)
    first = out["accepted"][:1] == [["c0", "c1", "c2", "c3"]]
    ok = first and out["accepted"][1:] == [["c0", "c1", "c2"]] * (out["rounds"] - 1)
    ok = ok and all("declared" in r for r in out["rejected_c3"][1:])
    return {"refused_ok": ok and out["max_round_s"] < ROUND_TIMEOUT / 2, **out}


async def attack_nonfinite_wait(seconds: float) -> dict[str, Any]:
    out = await run_fl("nonfinite", seconds=seconds)
    ok = _honest_rounds(out) and all("NaN" in r for r in out["rejected_c3"])
    return {"refused_ok": ok and out["max_round_s"] < ROUND_TIMEOUT / 4, **out}


ATTACK_FUNCS: dict[str, Callable[[float], Awaitable[dict[str, Any]]]] = {
    "stranger_worker": attack_stranger_worker,
    "elastic_forged_control": attack_forged_control,
    "done_without_gradients": attack_done_without_gradients,
    "oversized_update": attack_oversized_update,
    "inflated_count": attack_inflated_count,
    "inflated_count_after_report": attack_inflated_count_after_report,
    "nonfinite_wait": attack_nonfinite_wait,
}
ATTACKS = tuple(ATTACK_FUNCS)


def _rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def one_run(name: str, seconds: float) -> dict[str, Any]:
    """Run attack ``name`` (a child process of `bench.hostile`): the same keys as a split
    attack's run, without the split job's health polls or exports."""
    t0 = time.monotonic()
    try:
        detail = await ATTACK_FUNCS[name](max(seconds, 60.0))
        done = True
    except Exception as exc:  # an attack that breaks the job is a finding, not a crash
        detail, done = {"error": f"{type(exc).__name__}: {exc}"}, False
    return {
        "name": name,
        "detail": detail,
        "done": done,
        "seconds": round(time.monotonic() - t0, 2),
        "rss_mb": round(_rss_mb(), 1),
        "healthz_ms": [],
        "healthz_failed": 0,
        "folder": None,
    }


__all__ = ["ATTACKS", "ATTACK_FUNCS", "one_run", "run_elastic", "run_fl"]
