"""Prometheus lines describing a running `SplitParty`, for `HttpTransport.add_metrics_source`.

The transport's own ``/metrics`` already has bytes/frames/busy seconds per peer and direction,
inbound queue depth per (peer, channel), retries and refusals; this adds what only the party
knows (docs/parties.md#metrics)::

    tandem_party_step                       gauge    training batches run (the checkpoint step)
    tandem_party_n_groups                   gauge    current micro-batches per batch
    tandem_party_in_batch                   gauge    1 while a batch runs
    tandem_party_ops_total{kind}            counter  ops run, by kind (forward, loss, backward,
                                                     update)
    tandem_party_op_seconds_total{kind}     counter  compute-lane seconds, by kind
    tandem_party_outbound_queue_max         gauge    outbound queue high-water mark, last batch
    tandem_party_outbound_queue_capacity    gauge    its hard capacity
    tandem_party_checkpoint_step            gauge    step of the last checkpoint saved (-1: none)

Pure reads of the party's attributes (no I/O, safe on the loop).
"""

from __future__ import annotations

from collections.abc import Callable

from tandem.engine.plan import Kind
from tandem.transports.metrics import family

from .party import SplitParty


def party_metrics(
    party: SplitParty, checkpoint_step: Callable[[], int] = lambda: -1
) -> Callable[[], str]:
    """A metrics source for ``party`` (see the module docstring)."""

    def source() -> str:
        me = {"party": party.name}
        stats = party.last_stats
        lines: list[str] = []
        for name, kind, text, value in (
            ("tandem_party_step", "gauge", "Training batches run", party.step),
            ("tandem_party_n_groups", "gauge", "Micro-batches per batch", party.n_groups),
            ("tandem_party_in_batch", "gauge", "1 while a batch runs", int(party.in_batch)),
            (
                "tandem_party_outbound_queue_max",
                "gauge",
                "Outbound queue high-water mark in the last batch (frames)",
                0 if stats is None else stats.max_outbound,
            ),
            (
                "tandem_party_outbound_queue_capacity",
                "gauge",
                "Outbound queue hard capacity (frames)",
                party.config.capacity,
            ),
            (
                "tandem_party_checkpoint_step",
                "gauge",
                "Step of the last checkpoint saved",
                checkpoint_step(),
            ),
        ):
            lines += family(name, kind, text, [(me, value)])
        lines += family(
            "tandem_party_ops_total",
            "counter",
            "Ops run by kind",
            [({**me, "kind": _kind(k)}, n) for k, n in sorted(party.op_counts.items())],
        )
        lines += family(
            "tandem_party_op_seconds_total",
            "counter",
            "Compute-lane seconds by op kind",
            [({**me, "kind": _kind(k)}, t) for k, t in sorted(party.op_seconds.items())],
        )
        return "\n".join(lines) + "\n"

    return source


def _kind(code: str) -> str:
    """``"F"`` -> ``"forward"`` (`tandem.engine.plan.Kind` values to readable label values)."""
    try:
        return Kind(code).name.lower()
    except ValueError:
        return code


__all__ = ["party_metrics"]
