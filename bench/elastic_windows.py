"""Churn windows for ``bench.elastic``: steady and churn windows in alternation on one running
cluster, and the churn efficiency of each churn window against the steady windows around it.

A run is ``S C S C ... S`` (``2 n + 1`` windows of ``window`` detection intervals T each). A churn
window kills the oldest live worker as it opens and starts a fresh one ``join_after`` T later,
so membership changes twice in it. Its efficiency is

    committed batches/s in the window / ((time-averaged live workers / total) x steady)

where ``steady`` is the mean rate of the steady windows just before and just after it, so that
load drifting on a shared machine moves numerator and denominator alike. ``raw`` is the same
ratio without the live-worker factor. The benchmark reports the median over the churn windows.

The cluster is anything with ``alive() -> list[str]``, ``kill(name)``, ``spawn()`` and a
``coordinator`` (its ``events``, ``clock`` and ``request_stop``): the in-process
`tandem.parties.elastic.local.LocalCluster` and the benchmark's HTTP cluster alike.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
from typing import Any, Protocol


class Cluster(Protocol):
    coordinator: Any

    def alive(self) -> list[str]: ...

    def kill(self, name: str) -> None: ...

    def spawn(self) -> str: ...


@dataclasses.dataclass
class Window:
    kind: str  # "steady" or "churn"
    t0: float
    t1: float = 0.0
    live: float = 0.0  # time-averaged live workers


async def run_windows(
    cluster: Cluster,
    *,
    interval: float,
    churn_windows: int,
    window: int,
    join_after: int,
    workers: int,
) -> list[Window]:
    """Drive ``cluster`` through the windows (module docstring), then ask it to stop."""
    coord = cluster.coordinator
    while not any(kind == "commit" and n for _, kind, n in coord.events):
        await asyncio.sleep(interval / 10)
    out: list[Window] = []
    for i in range(2 * churn_windows + 1):
        w = Window("churn" if i % 2 else "steady", coord.clock())
        end = w.t0 + window * interval
        join_at = w.t0 + join_after * interval if w.kind == "churn" else None
        if w.kind == "churn":
            cluster.kill(cluster.alive()[0])
        area, last = 0.0, w.t0
        while (now := coord.clock()) < end:
            area += min(len(cluster.alive()), workers) * (now - last)
            last = now
            if join_at is not None and now >= join_at:
                cluster.spawn()
                join_at = None
            await asyncio.sleep(interval / 20)
        w.t1 = coord.clock()
        w.live = area / (w.t1 - w.t0)
        out.append(w)
    coord.request_stop()
    return out


def efficiencies(events, windows: list[Window], workers: int) -> dict[str, Any]:
    """Per churn window: efficiency and raw ratio (module docstring), and their medians."""

    def rate(w: Window) -> float:
        n = sum(n for t, kind, n in events if kind == "commit" and w.t0 <= t < w.t1)
        return n / (w.t1 - w.t0)

    rates = [rate(w) for w in windows]
    eff, raw = [], []
    for i in range(1, len(windows), 2):
        steady = (rates[i - 1] + rates[i + 1]) / 2
        if steady <= 0:
            continue
        raw.append(rates[i] / steady)
        eff.append(rates[i] / ((windows[i].live / workers) * steady))
    return {
        "efficiency": round(statistics.median(eff), 3) if eff else None,
        "raw": round(statistics.median(raw), 3) if raw else None,
        "per_window": [round(e, 3) for e in eff],
        "steady_rates": [
            round(r, 1) for w, r in zip(windows, rates, strict=True) if w.kind == "steady"
        ],
        "churn_rates": [
            round(r, 1) for w, r in zip(windows, rates, strict=True) if w.kind == "churn"
        ],
    }
