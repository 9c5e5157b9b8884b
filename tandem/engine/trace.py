"""Trace records of ops and transfers, with Chrome-trace (Perfetto) and Gantt exports.

A `TraceEvent` is one interval on one lane of one party: ``compute`` for kernels,
``send->PEER`` for a transmission. The simulator and the runtime emit the same records, so a
simulated and a measured run can be drawn and compared the same way.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True, slots=True)
class TraceEvent:
    party: str
    lane: str
    name: str
    mb: int
    start: float
    end: float
    nbytes: int = 0


class Trace:
    """An append-only list of events; the clock origin is the first event's start."""

    def __init__(self) -> None:
        self.events: list[TraceEvent] = []

    def add(self, event: TraceEvent) -> None:
        self.events.append(event)

    def extend(self, events: Iterable[TraceEvent]) -> None:
        self.events.extend(events)

    @property
    def span(self) -> float:
        if not self.events:
            return 0.0
        return max(e.end for e in self.events) - min(e.start for e in self.events)

    def busy(self, party: str, lane: str = "compute") -> float:
        return sum(e.end - e.start for e in self.events if e.party == party and e.lane == lane)

    def order(self, party: str, lane: str = "compute") -> list[str]:
        evs = sorted(
            (e for e in self.events if e.party == party and e.lane == lane),
            key=lambda e: (e.start, e.end),
        )
        return [e.name for e in evs]

    def to_chrome(self) -> dict:
        """Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
        t0 = min((e.start for e in self.events), default=0.0)
        parties = sorted({e.party for e in self.events})
        pid = {p: i + 1 for i, p in enumerate(parties)}
        lanes = sorted({(e.party, e.lane) for e in self.events})
        tid = {pl: i + 1 for i, pl in enumerate(lanes)}
        out = []
        for p in parties:
            out.append({"ph": "M", "name": "process_name", "pid": pid[p], "args": {"name": p}})
        for (p, lane), t in tid.items():
            out.append(
                {"ph": "M", "name": "thread_name", "pid": pid[p], "tid": t, "args": {"name": lane}}
            )
        for e in self.events:
            out.append(
                {
                    "ph": "X",
                    "name": e.name,
                    "pid": pid[e.party],
                    "tid": tid[(e.party, e.lane)],
                    "ts": (e.start - t0) * 1e6,
                    "dur": max(e.end - e.start, 0.0) * 1e6,
                    "args": {"mb": e.mb, "bytes": e.nbytes},
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms"}

    def write_chrome(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_chrome()))
        return path


def _color(name: str) -> str:
    kind = name[:1]
    return {"F": "#4C72B0", "L": "#8172B2", "B": "#DD8452", "U": "#55A868", "S": "#937860"}.get(
        kind, "#999999"
    )


def plot_gantt(traces: Sequence[tuple[str, Trace]], path: str | Path) -> Path:
    """One panel per (title, trace): a row per (party, lane), a bar per event, labelled by
    micro-batch; e.g. ``[("sequential (n=1)", t1), ("pipelined (n=8)", t8)]``.

    Draws on its own `matplotlib.figure.Figure` (no pyplot, no backend switch: the caller's
    matplotlib state is left alone). Needs the ``plot`` extra (`tandem._extras`)."""
    from tandem._extras import needs

    with needs("plot", "the Gantt picture (plot_gantt, tandem demo --trace)"):
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    spans = [t.span for _, t in traces]
    xmax = max(spans, default=1.0) or 1.0
    fig = Figure(
        figsize=(
            12,
            1.2
            + 1.1
            * max(len({(e.party, e.lane) for e in t.events}) for _, t in traces)
            * len(traces)
            / 1.5,
        )
    )
    axes = fig.subplots(len(traces), 1, squeeze=False)
    for ax, (title, trace) in zip(axes[:, 0], traces, strict=True):
        t0 = min((e.start for e in trace.events), default=0.0)
        rows = sorted(
            {(e.party, e.lane) for e in trace.events},
            key=lambda pl: (pl[0], pl[1] != "compute", pl[1]),
        )
        for y, (party, lane) in enumerate(rows):
            evs = [e for e in trace.events if e.party == party and e.lane == lane]
            ax.broken_barh(
                [(e.start - t0, max(e.end - e.start, xmax * 1e-4)) for e in evs],
                (y - 0.4, 0.8),
                facecolors=[_color(e.name) for e in evs],
                edgecolor="white",
                linewidth=0.3,
            )
            if len(evs) <= 80:
                for e in evs:
                    if e.end - e.start > xmax * 0.012 and e.mb >= 0:
                        ax.text(
                            (e.start + e.end) / 2 - t0,
                            y,
                            str(e.mb),
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white",
                        )
        ax.set_yticks(range(len(rows)), [f"{p}: {lane}" for p, lane in rows], fontsize=8)
        ax.set_xlim(0, xmax * 1.02)
        ax.set_title(f"{title} -- {trace.span:.3f} s", fontsize=10, loc="left")
        ax.invert_yaxis()
    axes[-1, 0].set_xlabel("seconds")
    handles = [
        Patch(color=_color(k), label=lbl)
        for k, lbl in [
            ("F", "forward"),
            ("L", "loss fwd+bwd"),
            ("B", "backward"),
            ("U", "update"),
            ("S", "transfer"),
        ]
    ]
    fig.legend(handles=handles, loc="upper right", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=120)
    return path
