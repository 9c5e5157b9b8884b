"""How a sender reads a receiver's refusal: the exception each status and reason raises
(`error_for`), and the one refusal that is no error (`ResendFrom`: resend from a chunk)."""

from __future__ import annotations

import orjson

from tandem.errors import (
    AdmissionError,
    AuthenticationError,
    FrameError,
    PayloadTooLargeError,
    TransportError,
)


class ResendFrom(Exception):
    """The receiver expects the message's chunk ``index`` next (409 with ``expect_chunk``)."""

    def __init__(self, index: int, text: str) -> None:
        super().__init__(text)
        self.index = index


def error_for(peer: str, sender: str, status: int, text: str, reason: str = "") -> Exception:
    """The exception a refusal of ``peer`` (``status``, its ``text`` and ``reason``) raises at
    the sender ``sender``; `ResendFrom` for a 409 naming the chunk the receiver expects."""
    if status == 409 and text.startswith("{"):
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            body = {}
        if isinstance(body, dict) and "expect_chunk" in body:
            return ResendFrom(int(body["expect_chunk"]), body.get("error", ""))
    where = f"peer {peer!r} refused the frame ({status})"
    if status == 401:
        return AuthenticationError(
            f"{where}: authentication failed; check that both parties share the same "
            f"secret, that {peer!r} lists "
            f"{sender!r} among its peers, and that clocks agree within the replay "
            "window"
        )
    if status == 421:
        return AuthenticationError(
            f"{where}: it keeps refusing our signature as meant for another process of it: {text}"
        )
    if status == 403 and reason == "identity":
        return AuthenticationError(f"{where}: {text}")
    if status == 413:
        return PayloadTooLargeError(f"{where}: {text}")
    if status == 403:
        return AdmissionError(f"{where}: {text}", field=_field(text))
    if status == 422 and reason == "not_admitted":
        return AdmissionError(f"{where}: {text}", field=_field(text))
    if status in (400, 408, 409, 410, 411, 422):
        return FrameError(f"{where}: {text}")
    return TransportError(f"{where}: {text}")


def _field(text: str) -> str:
    """The ``field`` of a JSON refusal body ("" when there is none)."""
    try:
        body = orjson.loads(text)
    except orjson.JSONDecodeError:
        return ""
    field = body.get("field", "") if isinstance(body, dict) else ""
    return field if isinstance(field, str) else ""
