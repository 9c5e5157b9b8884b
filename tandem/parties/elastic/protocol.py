"""Channels and small frame helpers shared by the elastic roles.

Who sends what (all through `tandem.transports.base.Transport`)::

    worker      -> coordinator  HB      {incarnation, url}            every heartbeat interval
    coordinator -> worker       WELCOME {data_servers: {name: url}}   on a new incarnation
    coordinator -> data server  CTL     {op, req, ...}                hello/train/fence/...
    data server -> coordinator  REPLY   {req, ok, error?, ...}
    data server -> worker       TASK    {batch, gen, spec, url} + params..., x, y
    worker      -> data server  RESULT  {batch, gen, loss} + grads...
    data server -> worker       ACK     {batch, gen, ok, error?}
    worker      -> coordinator  DONE    {batch, gen, ds, ok}
    coordinator -> worker       CTL     {op: "stop"}

Each role takes each channel only from the roles the table names (`admit_channels`): over a
transport with admission hooks (HTTP), a frame on another channel, or from another sender
(a worker sending ``CTL`` to a data server as if it were the coordinator), is refused at the
request head (403) and logged; the sender is the authenticated name (``Frame.sender``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from tandem.errors import AdmissionError
from tandem.transports.base import AddressingTransport, AdmittingTransport, Frame, Transport

from .errors import ProtocolError

HB, WELCOME, CTL, REPLY = "hb", "welcome", "ctl", "reply"
TASK, RESULT, ACK, DONE = "task", "result", "ack", "done"

log = logging.getLogger(__name__)

#: batch ids of data server ``index`` are ``index * STRIDE + local index``
STRIDE = 1 << 20


def cancelled_meanwhile() -> bool:
    """Whether the current task has a cancellation pending. A loop that waits out a peer's
    restart checks it before waiting again: a transport call that lost a cancellation (one
    racing with a timeout inside ``asyncio.wait_for``) must not keep the task alive."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def learn_peer(transport: Transport, name: str, url: str | None) -> None:
    """Teach ``transport`` where ``name`` lives when it can learn peers (HTTP); no-op for the
    memory transport, where every party of the network is already addressable."""
    if url and isinstance(transport, AddressingTransport) and name not in transport.peers:
        transport.add_peer(name, url)


def field(frame: Frame, key: str, kind: type | tuple[type, ...]) -> Any:
    """``frame.meta[key]``, checked for type; `ProtocolError` names what is wrong."""
    meta: Mapping[str, Any] = frame.meta
    if key not in meta:
        raise ProtocolError(f"{frame.channel!r} frame from {frame.sender!r} lacks field {key!r}")
    value = meta[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise ProtocolError(
            f"{frame.channel!r} frame from {frame.sender!r}: field {key!r} "
            f"must be {kind}, got {type(value).__name__}"
        )
    return value


def admit_channels(
    transport: Transport,
    senders: Mapping[str, Callable[[str], bool]],
    on_refused: Callable[[str, str], None] | None = None,
) -> None:
    """Admit on ``transport`` only ``channel`` frames whose sender ``senders[channel]``
    accepts; any other is refused at its head (`AdmissionError`, 403 over HTTP), logged, and
    passed to ``on_refused(sender, channel)``. No-op for a transport without admission hooks
    (the memory transport: within one process, ``recv(peer, ...)`` already names the
    sender)."""
    if not isinstance(transport, AdmittingTransport):
        return
    me = transport.name

    def admit(sender: str, channel: str) -> None:
        accept = senders.get(channel)
        if accept is not None and accept(sender):
            return
        log.warning("%s: refused %r frame from %r (not its role's channel)", me, channel, sender)
        if on_refused is not None:
            on_refused(sender, channel)
        raise AdmissionError(
            f"{me!r} takes no {channel!r} frames from {sender!r}: "
            f"only {sorted(senders)} from their roles (tandem.parties.elastic.protocol)",
            field="channel",
        )

    transport.admit_stream = admit
