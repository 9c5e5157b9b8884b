"""Elastic-training benchmark: ``python -m bench.elastic --json`` prints ONE JSON line.

Everything runs in one process on the memory transport (`tandem.parties.elastic.local`): two data
servers, a coordinator, and stateless workers computing real JAX gradients. Times are in
detection intervals T (``interval_s``); workers beat 3 times per T and are removed after
1.5 T of silence.

Reported:

* ``throughput``: committed batches per second with 1, 2 and 4 workers, steady membership,
  measured between the first commit and ``--seconds`` later.
* ``detect_heartbeats``: a worker is killed (task cancelled, its link closed, as by kill -9)
  during a 4-worker run; time from the kill to its removal, in T (target <= 3).
* ``recover_heartbeats``: time from that removal to the next checkpoint that commits at least
  one batch, in T (target <= 2); null if none was committed before the run ended.
* ``surviving_worker_restarts``: new incarnations of workers that were never killed (must be 0).
* ``churn_efficiency``: a 4-worker run where a worker is killed every ``12 T`` and a fresh one
  starts ``6 T`` later (so membership changes about every 6 T, each change costing a
  rollback), ``--churn-periods`` periods of 12 T long (at least twice ``--seconds``);
  committed batches/s divided by ``(time-averaged live workers / 4) x steady`` (target >= 0.9),
  where ``steady`` is the mean of the 4-worker throughput measured just before the churn run
  and just after it (``steady_4_after_churn``), so that load drift on a shared machine moves
  numerator and denominator alike.
* ``churn_efficiency_rollback`` / ``churn_efficiency_keep``: one 4-worker run per
  ``on_change`` mode, alternating steady and churn windows (``--churn-windows`` churn windows
  of ``--window`` T; a kill as each churn window opens, a fresh worker 6 T later); each churn
  window's efficiency is taken against the steady windows just before and after it, and the
  median is reported (`bench.elastic_windows`; target for keep >= 0.95). ``*_raw`` is the
  same median without the live-worker factor; ``churn_windows_*`` holds the details.
* ``http_*``: the same measurements with every worker a separate ``tandem elastic worker``
  process over HTTP (coordinator and data servers on HTTP transports in this process;
  `bench.elastic_http`): ``http_throughput_4``, ``http_churn_efficiency_rollback`` and
  ``http_churn_efficiency_keep`` (``--http-windows`` churn windows each; ``--skip-http`` to
  leave them out). A fresh worker process compiles its kernels on its first task, a cost the
  in-process runs (one JIT cache) do not pay.
* ``lost_batches`` / ``duplicated_batches``: over every epoch completed in all runs, batch ids
  missing from / repeated in the committed record (both must be 0). The parameter servers also
  check at each epoch's end that each batch is reflected exactly once (the run fails if not).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# one core per computation: workers then scale by running side by side (XLA releases the GIL)
os.environ.setdefault(
    "XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
)

from tandem.parties.elastic.local import LocalCluster  # noqa: E402
from tandem.parties.elastic.spec import ModelSpec, make_dataset  # noqa: E402

from .elastic_windows import efficiencies, run_windows  # noqa: E402

SPEC = ModelSpec(sizes=(64, 512, 512, 8), optimizer="adam", lr=0.003, batch_size=128, seed=0)
KILL_EVERY, JOIN_AFTER = 12, 6  # churn: a kill every 12 T, a fresh worker 6 T after it


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _committed_between(events, t0: float, t1: float) -> int:
    return sum(n for t, kind, n in events if kind == "commit" and t0 <= t <= t1)


def _audit(cluster: LocalCluster, summary: dict, totals: dict) -> None:
    ids = sorted(
        i * (1 << 20) + b for i, ds in enumerate(cluster.data_servers) for b in range(ds.n_batches)
    )
    for epoch in summary["history"]:
        got = epoch["committed"]
        totals["lost"] += len(set(ids) - set(got))
        totals["dup"] += len(got) - len(set(got))


async def _run(
    workers: int,
    seconds: float,
    interval: float,
    rows: int,
    totals: dict,
    churn: bool = False,
    kill_once: bool = False,
) -> dict:
    shards = make_dataset(2, rows, SPEC, seed=0)
    cluster = LocalCluster(SPEC, shards, interval=interval, epochs=10_000, workers=workers)
    out: dict = {}

    async def script(c: LocalCluster) -> None:
        coord = c.coordinator
        while not any(kind == "commit" and n for _, kind, n in coord.events):
            await asyncio.sleep(interval / 10)
        t0 = coord.clock()
        live_area, last, kills = 0.0, t0, []
        next_kill = t0 + KILL_EVERY * interval
        pending_join: list[float] = []
        while coord.clock() - t0 < seconds:
            await asyncio.sleep(interval / 20)
            now = coord.clock()
            live_area += len(c.alive()) * (now - last)
            last = now
            if kill_once and not kills and now - t0 > 2 * interval:
                victim = c.alive()[-1]
                c.kill(victim)
                kills.append((now, victim))
            if churn and now >= next_kill:
                victim = c.alive()[0]
                c.kill(victim)
                kills.append((now, victim))
                pending_join.append(now + JOIN_AFTER * interval)
                next_kill = now + KILL_EVERY * interval
            if pending_join and now >= pending_join[0]:
                pending_join.pop(0)
                c.spawn()
        t1 = coord.clock()
        out.update(t0=t0, t1=t1, live=live_area / (t1 - t0), kills=kills)
        coord.request_stop()

    summary = await cluster.run(script)
    _audit(cluster, summary, totals)
    events = list(cluster.coordinator.events)
    out["rate"] = _committed_between(events, out["t0"], out["t1"]) / (out["t1"] - out["t0"])
    out["events"] = events
    out["cluster"] = cluster
    return out


async def _windows(
    mode: str, args, totals: dict, *, http: bool = False, churn_windows: int
) -> tuple[dict, dict]:
    """One 4-worker run alternating steady and churn windows (`bench.elastic_windows`)."""
    shards = make_dataset(2, args.rows, SPEC, seed=0)
    cluster: Any
    if http:
        from .elastic_http import HttpCluster

        cluster = HttpCluster(
            SPEC, shards, interval=args.interval, workers=4, spares=churn_windows, on_change=mode
        )
    else:
        cluster = LocalCluster(
            SPEC, shards, interval=args.interval, epochs=10_000, workers=4, on_change=mode
        )
    marks: list = []

    async def script(c) -> None:
        marks.extend(
            await run_windows(
                c,
                interval=args.interval,
                churn_windows=churn_windows,
                window=args.window,
                join_after=JOIN_AFTER,
                workers=4,
            )
        )

    summary = await cluster.run(script)
    _audit_ids(cluster, shards, summary, totals)
    events = list(cluster.coordinator.events)
    result = efficiencies(events, marks, 4)
    steady = [
        sum(n for t, kind, n in events if kind == "commit" and w.t0 <= t < w.t1) / (w.t1 - w.t0)
        for w in marks
        if w.kind == "steady"
    ]
    return result, {"steady": sum(steady) / len(steady) if steady else 0.0, "summary": summary}


def _audit_ids(cluster, shards, summary: dict, totals: dict) -> None:
    ids = sorted(
        i * (1 << 20) + b for i, s in enumerate(shards) for b in range(s.n_batches(SPEC.batch_size))
    )
    for epoch in summary["history"]:
        got = epoch["committed"]
        totals["lost"] += len(set(ids) - set(got))
        totals["dup"] += len(got) - len(set(got))


def _recovery(run: dict, interval: float) -> tuple[float, float | None, int]:
    ((t_kill, victim),) = run["kills"]
    removed = [t for t, kind, who in run["events"] if kind == "removed" and victim in who]
    t_rm = removed[0]
    commits = [t for t, kind, n in run["events"] if kind == "commit" and n and t > t_rm]
    seen: dict[str, int] = {}
    for _, kind, who in run["events"]:
        if kind == "beat_new":
            seen[who] = seen.get(who, 0) + 1
    restarts = sum(n - 1 for w, n in seen.items() if w != victim)
    if not commits:  # the run ended before anything was committed again (extreme load)
        _say("no batch was committed after the removal before the run ended")
        return (t_rm - t_kill) / interval, None, restarts
    return (t_rm - t_kill) / interval, (commits[0] - t_rm) / interval, restarts


async def main(args) -> dict:
    totals = {"lost": 0, "dup": 0}
    _say("warm-up (JIT compile)")
    await _run(1, 2 * args.interval, args.interval, args.rows, totals)
    throughput = {}
    for n in (1, 2, 4):
        run = await _run(n, args.seconds, args.interval, args.rows, totals)
        throughput[str(n)] = round(run["rate"], 2)
        _say(f"{n} worker(s): {run['rate']:.1f} batches/s")
    run = await _run(
        4, max(args.seconds, 8 * args.interval), args.interval, args.rows, totals, kill_once=True
    )
    detect, recover, restarts = _recovery(run, args.interval)
    _say(f"kill -> removal {detect:.2f} T, removal -> next commit {recover} T")
    churn = await _run(
        4,
        max(2 * args.seconds, args.churn_periods * KILL_EVERY * args.interval),
        args.interval,
        args.rows,
        totals,
        churn=True,
    )
    _say(
        f"churn: {churn['rate']:.1f} batches/s with {churn['live']:.2f} live on average, "
        f"{len(churn['kills'])} kills"
    )
    # the steady 4-worker rate again, right after churn: the denominator is the mean of the
    # runs just before (throughput["4"]) and just after, so load drift on a shared machine
    # moves both sides of the ratio alike
    after = (await _run(4, args.seconds, args.interval, args.rows, totals))["rate"]
    _say(f"4 worker(s) again: {after:.1f} batches/s")
    steady = (throughput["4"] + after) / 2
    eff = churn["rate"] / ((churn["live"] / 4) * steady)
    extra: dict[str, Any] = {}
    n_windows = getattr(args, "churn_windows", 0)
    if n_windows:
        for mode in ("rollback", "keep"):
            res, _ = await _windows(mode, args, totals, churn_windows=n_windows)
            _say(f"churn windows, {mode}: {res}")
            extra[f"churn_efficiency_{mode}"] = res["efficiency"]
            extra[f"churn_efficiency_{mode}_raw"] = res["raw"]
            extra[f"churn_windows_{mode}"] = res
    if getattr(args, "http", False):
        for mode in ("rollback", "keep"):
            res, info = await _windows(
                mode, args, totals, http=True, churn_windows=args.http_windows
            )
            _say(f"http churn windows, {mode}: {res}")
            extra[f"http_churn_efficiency_{mode}"] = res["efficiency"]
            extra[f"http_churn_efficiency_{mode}_raw"] = res["raw"]
            extra[f"http_churn_windows_{mode}"] = res
            extra.setdefault("http_throughput_4", round(info["steady"], 2))
    return {
        "bench": "elastic",
        "interval_s": args.interval,
        "heartbeat_s": args.interval / 3,
        "throughput": throughput,
        "detect_heartbeats": round(detect, 2),
        "recover_heartbeats": None if recover is None else round(recover, 2),
        "surviving_worker_restarts": restarts,
        "steady_4_after_churn": round(after, 2),
        "churn_throughput": round(churn["rate"], 2),
        "churn_live_avg": round(churn["live"], 2),
        "churn_kills": len(churn["kills"]),
        "churn_efficiency": round(eff, 3),
        **extra,
        "lost_batches": totals["lost"],
        "duplicated_batches": totals["dup"],
        "cpus": os.cpu_count(),
    }


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def cli() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--interval", type=float, default=0.25, help="detection interval T (s)")
    p.add_argument("--seconds", type=float, default=4.0, help="timed window per steady run")
    p.add_argument("--rows", type=int, default=4096, help="rows per shard (2 shards)")
    p.add_argument(
        "--churn-periods",
        type=_at_least_one,
        default=4,
        help="length of the churn run, in periods of 12 T (a kill in each, a fresh worker 6 T "
        "after it)",
    )
    p.add_argument("--churn-windows", type=int, default=5, help="churn windows per on_change mode")
    p.add_argument("--window", type=int, default=12, help="length of each window, in T")
    p.add_argument("--http-windows", type=int, default=5, help="churn windows over HTTP")
    p.add_argument("--skip-http", dest="http", action="store_false", help="leave out the HTTP runs")
    args = p.parse_args()
    t = time.monotonic()
    result = asyncio.run(main(args))
    result["wall_s"] = round(time.monotonic() - t, 1)
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
