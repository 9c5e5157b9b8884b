"""Frame codec: a small orjson header plus raw little-endian array buffers. Never pickle.

Wire layout of one encoded frame::

    b"TDM1" | u32 header_len (little-endian) | header (orjson) | buffer_0 | buffer_1 | ...

The header is padded with spaces so that ``buffer_0`` starts at a multiple of `ALIGN` bytes.

The header holds ``sender, channel, id, spec, meta`` and, per array, ``dtype`` (numpy
``dtype.str``, little-endian; ``"bfloat16"`` for `ml_dtypes.bfloat16`, whose ``dtype.str`` is a
bare ``"<V2"``), ``shape`` and ``nbytes``. `decode` validates every field and
raises `FrameError` naming the first problem, so a server can answer 4xx and keep serving.

The codec is pure (no asyncio, no JAX).
"""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np
import orjson

from tandem.errors import FrameError, PayloadTooLargeError

from .base import Frame

MAGIC = b"TDM1"
_PREFIX = struct.Struct("<4sI")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 1 << 20
#: The header is padded with JSON whitespace so that the first array starts at a multiple of
#: this offset: decoded arrays (views of the receive buffer) are then aligned for their dtype,
#: so numpy reductions over them (the receiver's NaN/Inf check, the application's own
#: arithmetic) need no buffered copy. Decoders need not know: JSON allows trailing spaces.
ALIGN = 64
#: most dimensions an array may have on the wire (numpy's own limit is higher)
MAX_NDIM = 32
#: largest byte extent of an array's shape (its nonzero extents times the itemsize): numpy
#: cannot represent more
MAX_EXTENT = (1 << 63) - 1
#: dtypes allowed on the wire (kinds: bool, signed/unsigned int, float, complex).
_ALLOWED_KINDS = frozenset("biufc")
#: dtypes outside numpy's kinds that may travel too, by name: ``bfloat16`` (from ml_dtypes,
#: which JAX ships; numpy sees it as kind ``"V"``), the dtype of a bfloat16 cut layer.
EXTENSION_DTYPES: dict[str, np.dtype] = {"bfloat16": np.dtype(ml_dtypes.bfloat16)}


def _wire(dtype: np.dtype) -> tuple[np.dtype, str]:
    """``(wire dtype, its header token)`` of an array's ``dtype``, from `_WIRE` after the
    first time (numpy's ``dtype.name`` alone costs microseconds, and a small frame's encoding
    is dominated by such lookups)."""
    known = _WIRE.get(dtype)
    if known is not None:
        return known
    if dtype.name in EXTENSION_DTYPES and dtype == EXTENSION_DTYPES[dtype.name]:
        wire = dtype
    elif dtype.kind not in _ALLOWED_KINDS:
        raise FrameError(
            f"dtype {dtype!r} cannot travel: only bool, integer, float (bfloat16 included) and "
            "complex arrays are supported (convert strings/objects to numeric arrays first)"
        )
    else:
        wire = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
    known = (wire, dtype_token(wire))
    if len(_WIRE) < _CACHE_LIMIT:
        _WIRE[dtype] = known
    return known


def dtype_token(dtype: np.dtype) -> str:
    """How a header names ``dtype`` (a wire dtype): its name for `EXTENSION_DTYPES`, else its
    little-endian ``dtype.str``."""
    return dtype.name if dtype.name in EXTENSION_DTYPES else dtype.str


def _parse_dtype(token: Any, i: int) -> np.dtype:
    if isinstance(token, str):
        known = _PARSED.get(token)
        if known is not None:
            return known
    if isinstance(token, str) and token in EXTENSION_DTYPES:
        return EXTENSION_DTYPES[token]
    try:
        dt = np.dtype(token)
    except TypeError:
        raise FrameError(f"array {i}: unknown dtype {token!r}") from None
    if dt.kind not in _ALLOWED_KINDS or dt.byteorder == ">":
        raise FrameError(f"array {i}: dtype {token!r} is not allowed on the wire")
    if isinstance(token, str) and len(_PARSED) < _CACHE_LIMIT:
        _PARSED[token] = dt
    return dt


#: dtypes (and header tokens) seen so far, with what encoding (decoding) makes of them; a
#: bounded memo of pure functions (at most `_CACHE_LIMIT` entries each: tokens come from peers)
_WIRE: dict[np.dtype, tuple[np.dtype, str]] = {}
_PARSED: dict[str, np.dtype] = {}
_CACHE_LIMIT = 256


def header_of(frame: Frame) -> dict[str, Any]:
    """The JSON header describing ``frame`` (without the buffers)."""
    return _described(frame, frame.sender, frame.channel, frame.msg_id, frame.spec_hash)[0]


def _described(
    frame: Frame, sender: str, channel: str, msg_id: int, spec_hash: str
) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.dtype]]]:
    """``frame``'s header (with these ``sender`` .. ``spec_hash`` fields), and each array with
    the dtype it travels as: one pass, one dtype lookup per array, no array data touched."""
    specs, arrays = [], []
    for a in frame.arrays:
        a = a if type(a) is np.ndarray else np.asarray(a)
        wire, token = _wire(a.dtype)
        specs.append({"dtype": token, "shape": list(a.shape), "nbytes": a.nbytes})
        arrays.append((a, wire))
    meta = frame.meta
    header = {
        "sender": sender,
        "channel": channel,
        "id": msg_id,
        "spec": spec_hash,
        "meta": meta if type(meta) is dict else dict(meta),
        "arrays": specs,
    }
    return header, arrays


def encode_parts(frame: Frame) -> list[memoryview | bytes]:
    """Encode ``frame`` as a list of buffers to write in order (no copy of array data
    when the arrays are already C-contiguous little-endian)."""
    return encode_parts_as(frame, frame.sender, frame.channel, frame.msg_id, frame.spec_hash)


def encode_parts_as(
    frame: Frame, sender: str, channel: str, msg_id: int, spec_hash: str
) -> list[memoryview | bytes]:
    """`encode_parts` of ``frame`` with these header fields instead of its own (what a
    transport stamps on each send), without building the frame that has them."""
    header_dict, arrays = _described(frame, sender, channel, msg_id, spec_hash)
    try:
        header = orjson.dumps(header_dict, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise FrameError(f"frame meta is not JSON-serialisable: {exc}") from None
    header = _pad(header)
    parts: list[memoryview | bytes] = [_PREFIX.pack(MAGIC, len(header)), header]
    for a, wire in arrays:
        # C-contiguous in the wire dtype: a view, no copy, when the array is one already
        arr = np.ascontiguousarray(a, dtype=wire)
        if arr.nbytes:
            # extension dtypes export no buffer format of their own: send their bytes
            raw = arr.reshape(-1).view(np.uint8) if arr.dtype.kind == "V" else arr
            parts.append(raw.data.cast("B"))
    return parts


def encode(frame: Frame) -> bytes:
    """Encode ``frame`` into one bytes object."""
    return b"".join(encode_parts(frame))


def encoded_size(frame: Frame) -> int:
    """Exact number of bytes `encode(frame)` produces (what a wire would carry)."""
    header = orjson.dumps(header_of(frame), option=orjson.OPT_SERIALIZE_NUMPY)
    return PREFIX_SIZE + len(_pad(header)) + frame.nbytes


def _pad(header: bytes) -> bytes:
    """``header`` followed by spaces up to the next `ALIGN` boundary of the frame (never past
    `MAX_HEADER_BYTES`)."""
    pad = -(PREFIX_SIZE + len(header)) % ALIGN
    if not pad or len(header) + pad > MAX_HEADER_BYTES:
        return header
    return header + b" " * pad


def parse_prefix(prefix: bytes | memoryview) -> int:
    """Validate the 8-byte prefix (the start of ``prefix``) and return the header length."""
    if len(prefix) < PREFIX_SIZE:
        raise FrameError(f"frame is truncated: {len(prefix)} bytes, need at least {PREFIX_SIZE}")
    magic, header_len = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise FrameError(f"not a Tandem frame: magic {magic!r}, expected {MAGIC!r}")
    if header_len > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {header_len} bytes exceeds {MAX_HEADER_BYTES}")
    return header_len


def parse_header(raw: bytes | memoryview) -> dict[str, Any]:
    """Parse and validate a header; returns it with ``arrays`` entries checked."""
    try:
        header = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise FrameError(f"frame header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise FrameError("frame header must be a JSON object")
    # orjson makes exact types (bool is no int subclass there): one `is` test per field
    # (`_HEADER_FIELDS`) accepts a well-formed header; the loop below names the first problem
    # otherwise
    get = header.get
    if not (
        type(get("sender")) is str
        and type(get("channel")) is str
        and type(get("id")) is int
        and type(get("spec")) is str
        and type(get("meta")) is dict
        and type(get("arrays")) is list
    ):
        for key, kind in _HEADER_FIELDS:
            if key not in header:
                raise FrameError(f"frame header is missing field {key!r}")
            if not isinstance(header[key], kind) or isinstance(header[key], bool):
                got = type(header[key]).__name__
                raise FrameError(f"frame header field {key!r} must be {kind.__name__}, got {got}")
    for i, spec in enumerate(header["arrays"]):
        if not isinstance(spec, dict) or spec.keys() != _ARRAY_FIELDS:
            raise FrameError(f"array {i}: descriptor must have exactly dtype, shape, nbytes")
        dt = _parse_dtype(spec["dtype"], i)
        shape = spec["shape"]
        if not _is_shape(shape):
            raise FrameError(f"array {i}: shape must be a list of non-negative ints, got {shape!r}")
        if len(shape) > MAX_NDIM:
            raise FrameError(f"array {i}: {len(shape)} dimensions; at most {MAX_NDIM} travel")
        # exact (Python ints): an int64 product wraps around, and numpy refuses any shape
        # whose nonzero extents multiply past its index range, even with a zero extent
        count = math.prod(shape)
        extent = (count if count else math.prod(max(d, 1) for d in shape)) * dt.itemsize
        if extent > MAX_EXTENT:
            raise FrameError(
                f"array {i}: shape {shape[:8]!r}{'...' if len(shape) > 8 else ''} of "
                f"{dt.str} overflows 64-bit sizes"
            )
        expected = count * dt.itemsize
        if type(spec["nbytes"]) is not int or spec["nbytes"] != expected:
            raise FrameError(
                f"array {i}: nbytes {spec['nbytes']!r} does not match dtype {dt.str} and shape "
                f"{shape} ({expected} bytes)"
            )
    return header


def _is_shape(shape: Any) -> bool:
    """A list of non-negative ints (orjson's exact types: a JSON ``true`` is a bool, no int)."""
    if type(shape) is not list:
        return False
    for d in shape:
        if type(d) is not int or d < 0:
            return False
    return True


_HEADER_FIELDS = (
    ("sender", str),
    ("channel", str),
    ("id", int),
    ("spec", str),
    ("meta", dict),
    ("arrays", list),
)
_ARRAY_FIELDS = {"dtype", "shape", "nbytes"}


def payload_size(header: dict[str, Any]) -> int:
    total = 0
    for spec in header["arrays"]:
        total += int(spec["nbytes"])
    return total


def decode(data: bytes | bytearray | memoryview, *, max_bytes: int | None = None) -> Frame:
    """Decode one frame produced by `encode`; raises `FrameError` naming what is wrong."""
    view = memoryview(data)
    if max_bytes is not None and len(view) > max_bytes:
        raise PayloadTooLargeError(
            f"frame of {len(view)} bytes exceeds the maximum of {max_bytes}; raise max_frame_bytes "
            "on the receiver or send smaller tensors"
        )
    header_len = parse_prefix(view)
    end = PREFIX_SIZE + header_len
    if len(view) < end:
        raise FrameError(f"frame is truncated inside the header ({len(view)} < {end} bytes)")
    header = parse_header(view[PREFIX_SIZE:end])
    # the arrays are zero-copy views of ``data``, made in the same pass that checks the body's
    # length against the header
    size = len(view)
    arrays = []
    offset = end
    for spec in header["arrays"]:
        nbytes = spec["nbytes"]
        stop = offset + nbytes
        if stop > size:
            break
        token = spec["dtype"]
        dt = _PARSED.get(token) if type(token) is str else None
        arr = np.frombuffer(
            view[offset:stop], dtype=dt or _parse_dtype(token, 0), count=-1 if nbytes else 0
        )
        shape = spec["shape"]
        # frombuffer's result is 1-D already: a one-dimension shape (checked) needs no reshape
        arrays.append(arr if len(shape) == 1 and shape[0] == arr.size else arr.reshape(shape))
        offset = stop
    if offset != size or len(arrays) != len(header["arrays"]):
        total = end + payload_size(header)
        raise FrameError(f"frame body is {size} bytes but its header describes {total} bytes")
    return Frame(
        header["sender"],
        header["channel"],
        header["id"],
        header["spec"],
        header["meta"],
        tuple(arrays),
    )
