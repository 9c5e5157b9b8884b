"""The checks a complete inbound frame passes before delivery, after its body is in and
authenticated: decoding (400; 413 past ``max_frame_bytes``), its header agreeing with the
request's (400) and its spec hash with the negotiated one (409), NaN/Inf (422) and the
``validator`` hook (422), then the ``admit_frame`` hook (422, naming the field). The
``admit_stream`` hook judges a request's head before any of it (403), and the ``admit_size``
hook its declared size (413).

The hooks are read from a `Hooks` holder on every use (the server: the transport replaces
them after negotiation; `tandem.transports.base.AdmittingTransport` states their contract).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Protocol

from tandem.errors import AdmissionError, FrameError, PayloadTooLargeError

from .. import codec
from ..base import Frame, InlineValidator
from .config import HttpConfig
from .protocol import INLINE_BYTES, Refuse, spec_text
from .scan import FiniteScan, all_finite, is_float

AdmitStream = Callable[[str, str], None]
AdmitFrame = Callable[[Frame], None]
AdmitSize = Callable[[str, str, int], None]


class Hooks(Protocol):
    """Where the current admission hooks live (`server.HttpServer`)."""

    spec_hash: str
    validator: Callable[[Frame], None] | None
    admit_stream: AdmitStream | None
    admit_frame: AdmitFrame | None
    admit_size: AdmitSize | None


class FrameChecks:
    """The frame checks of one receiver (see the module docstring); each refusal is a
    `Refuse` with its status, reason and text."""

    def __init__(self, config: HttpConfig, hooks: Hooks) -> None:
        self.cfg = config
        self.hooks = hooks
        #: (validator, whether it runs on the loop) for the last validator seen: a Protocol
        #: ``isinstance`` costs microseconds, so it is judged once per validator, not per frame
        self._inline: tuple[object, bool] = (None, True)

    def validator_inline(self) -> bool:
        """Whether the current ``validator`` may run on the loop for a small frame: there is
        none, or it is an `InlineValidator` with ``inline`` true."""
        validator = self.hooks.validator
        seen, verdict = self._inline
        if validator is not seen:
            verdict = validator is None or (
                isinstance(validator, InlineValidator) and validator.inline is True
            )
            self._inline = (validator, verdict)
        return verdict

    def check_stream(self, sender: str, channel: str) -> None:
        """The ``admit_stream`` hook (403 naming the field)."""
        admit_stream = self.hooks.admit_stream
        if admit_stream is None:
            return
        try:
            admit_stream(sender, channel)
        except FrameError as exc:
            field = exc.field if isinstance(exc, AdmissionError) else "channel"
            raise Refuse(403, "not_admitted", str(exc), field=field) from None

    def check_size(self, sender: str, channel: str, total: int) -> None:
        """The ``admit_size`` hook (413 naming the field)."""
        admit_size = self.hooks.admit_size
        if admit_size is None:
            return
        try:
            admit_size(sender, channel, total)
        except FrameError as exc:
            field = exc.field if isinstance(exc, AdmissionError) else "total"
            raise Refuse(413, "too_large", str(exc), field=field) from None

    def check_admission(self, frame: Frame) -> None:
        """The ``admit_frame`` hook (422 naming the field)."""
        admit_frame = self.hooks.admit_frame
        if admit_frame is None:
            return
        try:
            admit_frame(frame)
        except FrameError as exc:
            field = exc.field if isinstance(exc, AdmissionError) else ""
            raise Refuse(
                422, "not_admitted", f"frame refused at admission: {exc}", field=field
            ) from None

    async def check_frame(
        self,
        sender: str,
        channel: str,
        msg_id: int,
        buffer: memoryview,
        scan: FiniteScan | None = None,
    ) -> Frame:
        """The frame in ``buffer``, decoded and checked (`decode_checked`, then NaN/Inf and the
        ``validator`` hook: in a worker thread for large arrays or a validator that is not an
        `InlineValidator`)."""
        frame = self.decode_checked(sender, channel, msg_id, buffer)
        if self.cfg.reject_nonfinite or self.hooks.validator is not None:
            known = scan.verdicts(frame) if scan is not None else {}
            unknown = sum(a.nbytes for i, a in enumerate(frame.arrays) if i not in known)
            if unknown < INLINE_BYTES and self.validator_inline():
                self.validate(frame, known)
            else:
                await asyncio.to_thread(self.validate, frame, known)
        return frame

    def decode_checked(self, sender: str, channel: str, msg_id: int, buffer: memoryview) -> Frame:
        """The frame in ``buffer``, decoded (bounded by ``max_frame_bytes``), its header
        agreeing with the request's and its spec hash with the negotiated one."""
        try:
            frame = codec.decode(buffer, max_bytes=self.cfg.max_frame_bytes)
        except PayloadTooLargeError as exc:
            raise Refuse(413, "too_large", str(exc)) from None
        except FrameError as exc:
            raise Refuse(400, "malformed", f"malformed frame: {exc}") from None
        if (frame.sender, frame.channel, frame.msg_id) != (sender, channel, msg_id):
            raise Refuse(
                400,
                "malformed",
                f"frame header (sender {frame.sender!r}, channel {frame.channel!r}, id "
                f"{frame.msg_id}) disagrees with the request headers ({sender!r}, "
                f"{channel!r}, {msg_id})",
            )
        spec_hash = self.hooks.spec_hash
        if spec_hash and frame.spec_hash != spec_hash:
            raise Refuse(409, "spec_mismatch", spec_text(frame.spec_hash, spec_hash))
        return frame

    def validate(self, frame: Frame, known: Mapping[int, bool] | None = None) -> None:
        """NaN/Inf check, then the ``validator`` hook. ``known``: array index -> finite, the
        verdicts `FiniteScan` reached while the body arrived (those arrays are not read
        again)."""
        if self.cfg.reject_nonfinite:
            for i, a in enumerate(frame.arrays):
                if is_float(a.dtype) and a.size:
                    finite = known.get(i) if known else None
                    if not (all_finite(a) if finite is None else finite):
                        raise Refuse(
                            422,
                            "nonfinite",
                            f"array {i} of frame {frame.msg_id} on {frame.channel!r} "
                            "contains NaN or Inf (reject_nonfinite=True on the "
                            "receiver)",
                        )
        validator = self.hooks.validator
        if validator is not None:
            try:
                validator(frame)
            except FrameError as exc:
                raise Refuse(422, "invalid", f"frame refused by validator: {exc}") from None


__all__ = ["AdmitFrame", "AdmitSize", "AdmitStream", "FrameChecks", "Hooks"]
