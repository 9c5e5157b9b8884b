"""The receiver's NaN/Inf check (``HttpConfig.reject_nonfinite``): `all_finite` for one array,
and `FiniteScan`, which runs it over a large message's float arrays while the body arrives.
`is_float` says which arrays are checked: numpy's float and complex kinds and bfloat16."""

from __future__ import annotations

import cmath
import logging
import math

import numpy as np

from tandem.errors import FrameError

from .. import codec
from ..base import Frame

log = logging.getLogger(__name__)

SCAN_STEP = 1 << 20  # received bytes scanned at a time, while still in the CPU cache
#: the exponent bits of each 16-bit float dtype: all of them set means NaN or +-Inf
EXPONENT_BITS_16 = {
    np.dtype(np.float16): 0x7C00,
    codec.EXTENSION_DTYPES["bfloat16"]: 0x7F80,
}
#: 16-bit elements tested at a time: bounds the temporary of `all_finite`'s bit test
_BITS_STEP = 1 << 16
#: below this many elements `all_finite` runs ``isfinite`` at once: the sum's error-state
#: switch costs more than it saves on a small array
_SUM_MIN_ELEMENTS = 1 << 13


def is_float(dtype: np.dtype) -> bool:
    """Whether the NaN/Inf check reads arrays of ``dtype``: float (bfloat16 included, which
    numpy sees as kind ``"V"``) and complex."""
    return dtype.kind in "fc" or dtype in EXPONENT_BITS_16


class Span:
    """One float/complex array of a message being scanned: bytes ``[start, end)`` of the
    message, ``[start, checked)`` scanned; ``bad``: where the scanned range that held a NaN or
    Inf began (scanning that array stops there)."""

    __slots__ = ("index", "start", "end", "dtype", "checked", "bad")

    def __init__(self, index: int, start: int, end: int, dtype: np.dtype) -> None:
        self.index, self.start, self.end, self.dtype = index, start, end, dtype
        self.checked = start
        self.bad: int | None = None

    def cut(self, to: int) -> int:
        """The element boundary of this array at or before byte ``to``."""
        return max(self.start, to - (to - self.start) % self.dtype.itemsize)


class FiniteScan:
    """The NaN/Inf check (``reject_nonfinite``) of one large message, run on the event loop
    over each piece of the body as it lands (every >= ``SCAN_STEP`` bytes: on the bulk path
    in `bulk.BulkSink.buffer_updated`, on the plain path in `body.read_into`), while it is
    still in the CPU cache: summing a cold buffer after the transfer costs about twice as much,
    all of it on the message's critical path (docs/transports.md has the measurements).

    Only `checks.FrameChecks.validate` reads the verdicts, after the digest (401) and the decoding
    (400) passed, so refusals keep their order; the layout is parsed from the same header
    bytes `codec.decode` reads, and a verdict is used only where the decoded array matches
    it. Before a chunk is received again (after a 401, a lost connection, a cancellation) the
    scan is rewound to its offset, forgetting what it saw of the failed attempt's bytes. Runs
    on the loop thread only."""

    __slots__ = ("buf", "spans", "header_end", "off")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.spans: list[Span] | None = None  # None until the header is in
        self.header_end = 0
        self.off = False  # header unreadable (decode will refuse it) or the scan failed

    def advance(self, upto: int) -> None:
        """Scan what the message's bytes ``[0, upto)`` (all received) allow."""
        if self.off:
            return
        try:
            spans = self.spans if self.spans is not None else self._layout(upto)
            if spans is None:
                return
            for s in spans:
                if s.bad is not None or s.checked >= s.end:
                    continue
                hi = s.cut(min(s.end, upto))
                if hi > s.checked:
                    if not all_finite(np.frombuffer(self.buf[s.checked : hi], s.dtype)):
                        s.bad = s.checked
                    s.checked = hi
        except Exception:  # never fail a request here: validate checks what is not known
            log.exception("NaN/Inf scan failed; the frame is checked once complete instead")
            self.off = True

    def _layout(self, upto: int) -> list[Span] | None:
        """The float/complex arrays' spans once the header is in (None before, or when the
        header is unreadable: then the scan is off)."""
        buf = self.buf
        if upto < codec.PREFIX_SIZE:
            return None
        try:
            end = codec.PREFIX_SIZE + codec.parse_prefix(bytes(buf[: codec.PREFIX_SIZE]))
            if upto < end:
                return None
            header = codec.parse_header(buf[codec.PREFIX_SIZE : end])
        except FrameError:
            self.off = True
            return None
        spans: list[Span] = []
        pos = end
        for i, spec in enumerate(header["arrays"]):
            dt, n = np.dtype(spec["dtype"]), int(spec["nbytes"])
            if is_float(dt) and n:
                spans.append(Span(i, pos, pos + n, dt))
            pos += n
        if pos != len(buf):  # decode will refuse it (400)
            self.off = True
            return None
        self.spans, self.header_end = spans, end
        return spans

    def rewind(self, to: int) -> None:
        """Forget what was scanned of bytes at or after ``to`` (about to be received again)."""
        if self.spans is None or self.off or to < self.header_end:
            self.spans, self.header_end, self.off = None, 0, False  # start over from the header
            return
        for s in self.spans:
            cut = s.cut(to)
            if s.checked > cut:
                s.checked = cut if s.bad is None else min(cut, s.bad)
                s.bad = None

    def verdicts(self, frame: Frame) -> dict[int, bool]:
        """``{array index: finite}`` for the arrays scanned completely (or found non-finite),
        provided the decoded ``frame``'s arrays are the ones scanned."""
        if self.off or self.spans is None:
            return {}
        out = {}
        for s in self.spans:
            a = frame.arrays[s.index] if s.index < len(frame.arrays) else None
            if a is None or a.dtype != s.dtype or a.nbytes != s.end - s.start:
                return {}
            if s.bad is not None:
                out[s.index] = False
            elif s.checked == s.end:
                out[s.index] = True
        return out


def all_finite(a: np.ndarray) -> bool:
    """Exactly ``np.isfinite(a).all()`` for a float, bfloat16 or complex array, without its
    temporary bool array when possible.

    If the sum is finite, every element is: NaN and +-Inf propagate through addition (Inf plus
    -Inf gives NaN). A non-finite sum may instead be an overflow of finite values, so that case
    is confirmed by the exact check. The sum needs no temporary bool array and is about a third
    cheaper than ``isfinite`` on float32. The 16-bit floats (float16, bfloat16) have no SIMD
    sum in numpy; their bits are tested instead (`EXPONENT_BITS_16`), a bounded piece at a
    time, several times faster than ``isfinite`` and never a copy of the array.
    """
    bits = EXPONENT_BITS_16.get(a.dtype)
    if bits is not None:
        return _exponents_finite(a, bits)
    if a.size > _SUM_MIN_ELEMENTS and a.dtype.itemsize // (2 if a.dtype.kind == "c" else 1) >= 4:
        with np.errstate(over="ignore", invalid="ignore"):  # overflow/Inf-Inf: expected here
            total = np.add.reduce(a.reshape(-1))
        if cmath.isfinite(total) if a.dtype.kind == "c" else math.isfinite(total):
            return True
    # bytes' ``in`` is one memchr over the bool array: a fraction of the cost of ``.all()``'s
    # reduction machinery, which dominates for the small arrays most frames carry
    return 0 not in np.isfinite(a).tobytes()


def _exponents_finite(a: np.ndarray, bits: int) -> bool:
    """No element of the 16-bit float array ``a`` has all of its exponent ``bits`` set."""
    flat = a.view(np.uint16).reshape(-1)  # a view of a contiguous array (a received one is)
    scratch = np.empty(min(_BITS_STEP, flat.size), np.uint16)
    for lo in range(0, flat.size, _BITS_STEP):
        piece = scratch[: min(_BITS_STEP, flat.size - lo)]
        np.bitwise_and(flat[lo : lo + _BITS_STEP], bits, out=piece)
        if piece.max() == bits:
            return False
    return True
