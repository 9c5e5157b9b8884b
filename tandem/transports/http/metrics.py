"""The HTTP transport's ``GET /metrics`` document (Prometheus text format 0.0.4)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from .. import metrics
from .client import HttpClient
from .server import HttpServer


def frame_requests(client: HttpClient, server: HttpServer) -> dict[tuple[str, str], int]:
    """Frame requests by ``(direction, path)``: ``("sent", "bulk")`` counts bulk attempts
    (retries included), ``("received", "bulk")`` bulk bodies the server accepted and started to
    read (answered 101); likewise ``"plain"`` for ordinary POST bodies and ``"stream"`` for records
    on frame streams."""
    counts = {("sent", path): n for path, n in client.requests.items()}
    counts.update({("received", path): n for path, n in server.requests.items()})
    return counts


def render(client: HttpClient, server: HttpServer, sources: Iterable[Callable[[], str]]) -> str:
    """Byte, frame and busy-time counters per peer and direction, inbox depths, retries,
    requests per path, refusals per reason; then each of ``sources``' lines."""
    me = client.cfg.name
    lines = _per_peer(client, server, me) + _refusals(server, me)
    lines += _inbound(server, {"party": me}) + _connections(server, {"party": me})
    text = "\n".join(lines) + "\n"
    for source in sources:
        try:
            extra = source()
        except Exception as exc:  # a broken source must not break /metrics
            extra = f"# metrics source {source!r} failed: {type(exc).__name__}"
        text += extra if extra.endswith("\n") else extra + "\n"
    return text


def _per_peer(client: HttpClient, server: HttpServer, me: str) -> list[str]:
    """Traffic per peer and direction, inbox depths, retries and frame requests per path."""
    lines: list[str] = []
    for direction, table in (("sent", client.sent), ("received", server.received)):
        lines += metrics.family(
            f"tandem_{direction}_bytes_total",
            "counter",
            f"Frame bytes {direction} per peer",
            [({"party": me, "peer": p}, s.bytes) for p, s in table.items()],
        )
        lines += metrics.family(
            f"tandem_{direction}_frames_total",
            "counter",
            f"Frames {direction} per peer",
            [({"party": me, "peer": p}, s.frames) for p, s in table.items()],
        )
        lines += metrics.family(
            f"tandem_{direction}_busy_seconds_total",
            "counter",
            f"Seconds spent transferring frames {direction} per peer",
            [({"party": me, "peer": p}, s.busy_seconds) for p, s in table.items()],
        )
    lines += metrics.family(
        "tandem_inbound_queue_depth",
        "gauge",
        "Frames waiting for recv per (peer, channel)",
        [({"party": me, "peer": p, "channel": c}, len(b)) for (p, c), b in server.inboxes.items()],
    )
    lines += metrics.family(
        "tandem_send_retries_total",
        "counter",
        "Send retries per peer",
        [({"party": me, "peer": p}, n) for p, n in client.retries.items()],
    )
    lines += metrics.family(
        "tandem_frame_requests_total",
        "counter",
        "Frame requests whose body was sent or received, by path (plain POST or bulk)",
        [
            ({"party": me, "direction": d, "path": p}, n)
            for (d, p), n in sorted(frame_requests(client, server).items())
        ],
    )
    return lines


def _refusals(server: HttpServer, me: str) -> list[str]:
    """Refused requests and stream handshakes, by reason."""
    lines: list[str] = []
    lines += metrics.family(
        "tandem_refused_requests_total",
        "counter",
        "Refused inbound requests by reason",
        [({"party": me, "reason": r}, n) for r, n in sorted(server.refused.items())],
    )
    lines += metrics.family(
        "tandem_refused_stream_handshakes_total",
        "counter",
        "Refused frame stream handshakes by reason (their senders POST the frame instead)",
        [({"party": me, "reason": r}, n) for r, n in sorted(server.refused_handshakes.items())],
    )
    return lines


def _inbound(server: HttpServer, party: dict[str, str]) -> list[str]:
    """The inbound byte budget, dropped partial messages and signature rebinds."""
    lines: list[str] = []
    lines += metrics.family(
        "tandem_inbound_bytes_held",
        "gauge",
        "Inbound bytes held (partial messages and frames not yet taken by recv)",
        [(party, server.budget.held)],
    )
    lines += metrics.family(
        "tandem_inbound_budget_bytes",
        "gauge",
        "The inbound byte budget (inbound_budget)",
        [(party, server.budget.capacity)],
    )
    lines += metrics.family(
        "tandem_partials_dropped_total",
        "counter",
        "Partial messages dropped after partial_timeout without a reader",
        [(party, server.store.dropped_partials)],
    )
    lines += metrics.family(
        "tandem_signature_rebinds_total",
        "counter",
        "Requests answered 421: correctly signed for another process of this party",
        [(party, server.gate.rebinds)],
    )
    return lines


def _connections(server: HttpServer, party: dict[str, str]) -> list[str]:
    """Inbound connections open and closed by cause (none without a listener)."""
    lines: list[str] = []
    listener = server.listener
    if listener is None:
        return lines
    lines += metrics.family(
        "tandem_connections_open",
        "gauge",
        "Inbound connections open",
        [(party, len(listener))],
    )
    lines += metrics.family(
        "tandem_connections_closed_total",
        "counter",
        "Inbound connections closed by the server, by cause",
        [
            ({**party, "cause": "refused"}, listener.refused),
            ({**party, "cause": "evicted"}, listener.evicted),
            *(
                ({**party, "cause": f"{phase}_timeout"}, n)
                for phase, n in sorted(listener.timed_out.items())
            ),
        ],
    )
    return lines
