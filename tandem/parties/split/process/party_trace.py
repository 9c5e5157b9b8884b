"""`tandem party --trace DIR`: a Chrome trace and a Gantt picture of a few training batches.

Each party records its own ops and transfers (`tandem.engine.trace.Trace`) over a window of
training batches: the ``batches`` after the first of this process, whose kernels compile (its
timing says nothing about the pipeline). Evaluation batches that run inside the window are
recorded too. `BatchTrace.write` then saves ``DIR/trace_<party>.json`` (Chrome trace-event
JSON: https://ui.perfetto.dev or chrome://tracing) and ``DIR/gantt_<party>.png`` (the ``plot``
extra), as ``tandem demo --trace`` does for its two in-process parties.

The window bounds the memory and file size whatever the run's length; each party's clock is
its own, so the pictures of two parties are compared by shape, not by absolute time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from tandem._extras import require
from tandem.engine.trace import Trace, plot_gantt

from ..party import SplitParty

DEFAULT_BATCHES = 8


class BatchTrace:
    """Records ``batches`` training batches of ``party`` after its first; call `after_batch`
    after every training batch (the leader's ``after_batch``, a follower's ``on_batch``)."""

    def __init__(self, directory: str, party: SplitParty, *, batches: int = DEFAULT_BATCHES):
        if batches < 1:
            raise ValueError(f"batches must be >= 1, got {batches}")
        self.directory = Path(directory)
        self.party = party
        self.batches = batches
        self.trace = Trace()
        self._seen = 0  # training batches finished in this process

    @staticmethod
    def check() -> None:
        """Fail before training, not after it, if the Gantt picture cannot be drawn."""
        require("plot", "tandem party --trace (the Gantt picture)")

    def after_batch(self) -> None:
        """Open the window after the first training batch, close it ``batches`` later."""
        self._seen += 1
        if self._seen == 1:
            self.party.trace = self.trace
        elif self._seen == 1 + self.batches:
            self.party.trace = None

    async def write(self) -> dict[str, Any]:
        """Save the trace and the picture (nothing if no batch was recorded); returns
        ``{"trace": {"chrome", "gantt", "batches"}}`` for the party's JSON line."""
        self.party.trace = None
        recorded = max(0, min(self._seen - 1, self.batches))
        if not self.trace.events:
            return {"trace": {"chrome": None, "gantt": None, "batches": 0}}
        name = self.party.name
        chrome = self.directory / f"trace_{name}.json"
        gantt = self.directory / f"gantt_{name}.png"
        title = f"{name}: {recorded} training batches (n={self.party.n_groups})"
        await asyncio.to_thread(self.trace.write_chrome, chrome)
        await asyncio.to_thread(plot_gantt, [(title, self.trace)], gantt)
        return {"trace": {"chrome": str(chrome), "gantt": str(gantt), "batches": recorded}}


__all__ = ["BatchTrace", "DEFAULT_BATCHES"]
