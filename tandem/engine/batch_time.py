"""Where a pipelined batch's time goes between two parties, read from its `Trace`.

Two parties: ``bottom`` sends its cut activations to ``top`` (on its lane ``send-><top>``),
``top`` sends the gradients back (``send-><bottom>``), and each batch ends with ``bottom``'s
update (a compute op named ``U...``). A batch starts when the previous one's update on
``bottom`` ended (the trace's first event, for the first batch) and ends when its own update
ends; `batch_parts` splits it, in milliseconds, so that exactly
``batch_ms = fill_ms + grad_start_ms + grad_link_ms + grad_gaps_ms + drain_ms``:

- ``fill_ms``: until the activation link starts (the first forward, the first frame's hand-off);
- ``grad_start_ms``: from the activation link's start to the gradient link's (the first part's
  transfer and latency, the first loss step);
- ``grad_link_ms``: the gradient link's busy time (a batch's gradient bytes / bandwidth);
- ``grad_gaps_ms``: the gradient link's idle time between its first and last transfer (a loss
  step that started late);
- ``drain_ms``: from the last gradient's arrival to the end of the update (the last backward
  and the update).

What is not ``grad_link_ms`` is what the batch spends beyond its busiest link. Pure: no JAX,
no asyncio.
"""

from __future__ import annotations

from .trace import Trace, TraceEvent

#: The parts of a batch, in the order they add up to ``batch_ms``.
PARTS = ("fill_ms", "grad_start_ms", "grad_link_ms", "grad_gaps_ms", "drain_ms")


def _lane(events: list[TraceEvent], party: str, lane: str) -> list[TraceEvent]:
    return sorted((e for e in events if e.party == party and e.lane == lane), key=lambda e: e.start)


def batch_parts(trace: Trace, bottom: str, top: str) -> list[dict[str, float]]:
    """The parts (`PARTS`) and ``batch_ms`` of each batch of a traced two-party training run
    (module docstring), in milliseconds, one dict per update of ``bottom``. Raises
    `ValueError` for a trace with no update on ``bottom`` or a batch that sent no activations
    or no gradients."""
    updates = [e for e in _lane(trace.events, bottom, "compute") if e.name.startswith("U")]
    if not updates:
        raise ValueError(f"the trace holds no update on {bottom}: was it a training run?")
    start = min(e.start for e in trace.events)
    out = []
    for update in updates:
        end = update.end
        inside = [e for e in trace.events if e.start >= start and e.end <= end]
        acts, grads = _lane(inside, bottom, f"send->{top}"), _lane(inside, top, f"send->{bottom}")
        if not acts or not grads:
            raise ValueError(
                f"a batch ending at {end - start:.4f} s sent no activations or no gradients"
            )
        busy = sum(e.end - e.start for e in grads)
        span = max(e.end for e in grads) - grads[0].start
        parts = {
            "fill_ms": acts[0].start - start,
            "grad_start_ms": grads[0].start - acts[0].start,
            "grad_link_ms": busy,
            "grad_gaps_ms": span - busy,
            "drain_ms": end - max(e.end for e in grads),
            "batch_ms": end - start,
        }
        out.append({k: v * 1e3 for k, v in parts.items()})
        start = end
    return out
