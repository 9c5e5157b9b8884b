"""What the plan bounds in a client's update, judged before the update is used: its size from
the request head, its sample count from the client's declared data size; and the release of
the round's wait for a client whose update was refused.

* **Size**: an update frame is at most the negotiated model's encoded size for the round's
  uplink (``max_update_bytes``: the payload, with room for lossless compression's overhead)
  plus `HEADER_BYTES` of header; over a transport with size admission
  (`tandem.transports.base.SizeAdmittingTransport`, HTTP), a larger one is refused from its
  head (413) before any of its body is read, whatever the transport's ``max_frame_bytes``. A
  ``hello`` is at most `HEADER_BYTES`.
* **Sample count**: a client's ``n`` weighs its update in the mean, so it is bounded by the
  data size it declared: the roster's ``sizes`` when given, else its first accepted report
  (its data does not grow between rounds); a larger count is refused (`UpdateError`).
* **Release**: a refusal at the head happens inside the transport, where the round waiting for
  that client cannot see it; `UpdateBounds` records the reason and wakes the waiter
  (`wait_refusal`), so the round goes on at once instead of waiting out its deadline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from tandem.errors import AdmissionError

from . import protocol as P
from .secagg.messages import SECAGG

#: Room for an update's or a hello's header (round, counts, version, kind, zlib descriptors).
HEADER_BYTES = 64 * 1024


class UpdateBounds:
    """Bounds of one server's clients (module docstring). ``max_update_bytes``: the largest
    update payload; ``sizes``: each client's declared data size (rows), where known."""

    def __init__(self, max_update_bytes: int, sizes: Mapping[str, int] | None = None) -> None:
        self.frame_limit = max_update_bytes + HEADER_BYTES
        self.secagg_slack = 0  # bytes a secure-aggregation frame may add (set by the server)
        self.declared: dict[str, int] = dict(sizes or {})
        self.waiting: set[str] = set()  # clients whose round waits for their update
        self.refusals: dict[str, str] = {}
        self._events: dict[str, asyncio.Event] = {}

    def admit_size(self, sender: str, channel: str, total: int) -> None:
        """The transport's ``admit_size`` hook."""
        limit = self.frame_limit if channel == P.UPDATE else HEADER_BYTES
        if channel == SECAGG:  # a masked payload (the update's size) or the share tables
            limit = self.frame_limit + self.secagg_slack
        if channel not in (P.UPDATE, P.HELLO, SECAGG) or total <= limit:
            return
        reason = (
            f"update from {sender!r} refused from its head: {total} bytes exceed the "
            f"{limit} an update of the negotiated model may take (its uplink payload plus "
            f"{HEADER_BYTES} of header); compress it as the round's meta.uplink says"
        )
        if channel == P.UPDATE and sender in self.waiting:
            self.refusals[sender] = reason
            self._event(sender).set()
        raise AdmissionError(reason, field="total")

    def check_count(self, client: str, n: int) -> None:
        """`UpdateError` when ``n`` exceeds ``client``'s declared data size; a first report
        declares it."""
        bound = self.declared.get(client)
        if bound is not None and n > bound:
            raise P.UpdateError(
                f"update meta.n={n} exceeds the {bound} samples {client!r} declared (roster "
                "or first report): a client weighs the mean by its own data only"
            )

    def accepted(self, client: str, n: int) -> None:
        self.declared.setdefault(client, n)

    def open(self, client: str) -> None:
        """``client``'s round now waits for its update."""
        self.waiting.add(client)
        self.refusals.pop(client, None)
        self._event(client).clear()

    def close(self, client: str) -> None:
        self.waiting.discard(client)

    async def wait_refusal(self, client: str) -> str:
        """The reason of the next refusal of ``client``'s update at the head."""
        await self._event(client).wait()
        return self.refusals.pop(client, "update refused by the transport")

    def _event(self, client: str) -> asyncio.Event:
        return self._events.setdefault(client, asyncio.Event())


__all__ = ["HEADER_BYTES", "UpdateBounds"]
